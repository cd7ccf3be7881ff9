"""Golden sharding dumps: a change in how any state of a real-size model is laid out fails here.

Regenerate after an intended change:
    ANGEL_UPDATE_GOLDEN=1 python -m pytest tests/test_sharding_golden.py
Only shapes are traced (jax.eval_shape), so the full-size models cost no memory.
"""

import os
import pathlib

import pytest

from angel_jax import sharding
from angel_jax.config import load_config
from angel_jax.mesh import make_mesh
from angel_jax.train import build

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = {
    "llama_1b_data4_tensor2_zero3": (
        "llama_1b",
        ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.zero_stage=3"],
    ),
    "llama_1b_data8_zero1": ("llama_1b", ["--config.mesh.data=8", "--config.zero_stage=1"]),
    "llama3_8b_data2_tensor4_sp_zero3": (
        "llama3_8b",
        ["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.model.sequence_parallel=true"],
    ),
}


# The memory budgets of the target machines, not of the CPU that traces them.
BUDGET = ["--config.offload.device_gib=141", "--config.offload.host_gib=1000"]


@pytest.mark.parametrize("case", CASES)
def test_sharding_matches_golden(case):
    name, overrides = CASES[case]
    config = load_config(str(ROOT / "configs" / f"{name}.py"), [*overrides, *BUDGET])
    exp = build(config, make_mesh(config.mesh))
    dump = "\n".join(
        [
            "## params",
            sharding.describe(exp.abstract_state.params),
            "## optimizer state",
            sharding.describe(exp.abstract_state.opt_state),
            "## rules",
            *(f"{k}: {v}" for k, v in exp.rules.items()),
            "",
        ]
    )
    golden = ROOT / "tests" / "golden" / f"{case}.txt"
    if os.environ.get("ANGEL_UPDATE_GOLDEN"):
        golden.write_text(dump)
    assert golden.exists(), f"no golden file {golden}; create it with ANGEL_UPDATE_GOLDEN=1"
    assert dump == golden.read_text()
