"""The notebooks in notebooks/: each runs top to bottom without an error, on the test run's 8
emulated CPU devices (tests/conftest.py's XLA_FLAGS reach the kernel through its environment;
the notebook's first cell asks for 8 devices too, for a user's own Jupyter), and git holds
them stripped: no outputs, no execution counts, the portable kernel name."""

import os
import pathlib

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.runs import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # A cell that compiles a train step takes seconds; a hang fails here.
# What each notebook's text says its cells show, in their printed output.
SHOWS = {
    "mesh_and_sharding": [
        "data=8             per device: params 2050 KiB, optimizer state 513 KiB",
        "data=4 x tensor=2  per device: params 1026 KiB, optimizer state 513 KiB",
        "data=4 x tensor=2  all-gather x12",
        "config.model.num_heads=4 is not divisible by config.mesh.tensor=8",
    ],
    "zero_cache_planner": [
        "ZeRO-Cache plan (policy none, ",
        "config.offload.policy=none: the model states do not fit",
        "ZeRO-Cache plan (policy optimizer, ",
        "model states: 20.0 bytes per parameter",
        " 24.0 GiB: policy optimizer",
        " 16.0 GiB: refused: ",
    ],
    "huggingface_finetune": [
        "mesh data=4 x tensor=2 (8 cpu devices), ZeRO-3",
        "step      3/3",
        "'def main(",
        "exported ",
        "{'model_type': 'llama', 'hidden_size': 64, 'num_hidden_layers': 2, 'vocab_size': 512}",
    ],
}


def test_each_notebook_is_run_here():
    assert {p.stem for p in NOTEBOOKS} == set(SHOWS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path: pathlib.Path):
    """Outputs and execution counts stay out of git (run a notebook, then clear its outputs
    before committing: Jupyter's "Clear All Outputs", or `jupyter nbconvert
    --clear-output --inplace`), and the kernel is the plain `python3`, not a local one."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has outputs"
            assert cell.execution_count is None, f"cell {i} has an execution count"
        assert "execution" not in cell.metadata, f"cell {i} has timings"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: pathlib.Path):
    """Every cell runs, from the repository root, in a kernel of this Python (not whatever
    `python3` kernel the machine has installed)."""
    nb = nbformat.read(path, as_version=4)
    # No kernel directories: the `python3` kernel is then ipykernel's own, this interpreter.
    kernel = KernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    client = NotebookClient(
        nb,
        km=kernel,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(ROOT)}},
    )
    # As under Jupyter: pytest's variable makes ipykernel leave the process's stdout and
    # stderr file descriptors alone, and sys.stderr then has none (the hang watchdog's
    # faulthandler needs one).
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    client.execute(env=env)  # A cell's error raises CellExecutionError, with its traceback.
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count for c in ran)
    printed = "".join(o.text for c in ran for o in c.outputs if o.output_type == "stream")
    missing = [line for line in SHOWS[path.stem] if line not in printed]
    assert not missing, f"{path.name} no longer prints {missing}; its output:\n{printed}"
