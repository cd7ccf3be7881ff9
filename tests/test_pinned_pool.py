"""XLA's pinned-host pool as the planner models it (`tiers.PinnedPool`, `tiers.replay_pool`):
the BFC allocator's rules, and the advice for the 8B 1M-token FP8 record's plan against them."""

import pathlib
import re
import sys

import jax
import pytest

from angel_jax.config import load_config
from angel_jax.mesh import make_mesh
from angel_jax.planning import tiers
from angel_jax.planning.tiers import HOST, USABLE, PinnedPool, replay_pool
from angel_jax.train import build

MiB, GiB = 2**20, 2**30
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))


def test_the_pool_grows_as_xlas_bfc_allocator_does():
    """Regions of doubling size from 2 MiB, raised until they hold the allocation (and then
    not doubled again for the next), the last one what the cap leaves; no allocation spans
    regions; best fit, a chunk taken whole when what it would leave is small; freed neighbours
    merge; a preallocated pool is one region of its cap."""
    pool = PinnedPool(100 * MiB)
    a = pool.alloc(1 * MiB)
    assert pool.held == 2 * MiB  # The first region.
    pool.alloc(3 * MiB)  # 1 MiB is left in the first region: a second, of 4 MiB.
    assert pool.held == 6 * MiB
    pool.alloc(20 * MiB)  # 8 MiB raised to 32 MiB for it...
    assert pool.held == 38 * MiB
    pool.alloc(30 * MiB)  # ... and the next region is 32 MiB again, not 64.
    assert pool.held == 70 * MiB
    # 14 MiB are free (1 + 1 + 12) but not in one region: 13 MiB take a new region, of what
    # the 100 MiB cap leaves (30 MiB), not the next doubled size.
    pool.alloc(13 * MiB)
    assert pool.held == 100 * MiB
    # Nothing left under the cap for a region: 18 MiB fail with 32 MiB free in five holes.
    assert pool.alloc(18 * MiB) is None and pool.held == 100 * MiB
    # Best fit: 1 MiB goes to the smallest hole that holds it, the lowest such.
    assert pool.alloc(1 * MiB) == a + 1 * MiB

    one = PinnedPool(GiB, preallocated=True)
    x, y = one.alloc(300 * MiB), one.alloc(1 * MiB)
    assert one.held == GiB  # One region, the cap.
    one.free(x)  # A 300 MiB hole before y; the region's rest (723 MiB) after it.
    used = one.in_use
    assert one.alloc(200 * MiB) == x  # Best fit; 100 MiB left: too little to split off.
    assert one.in_use - used == 300 * MiB
    one.free(x)
    w, v = one.alloc(150 * MiB), one.alloc(100 * MiB)  # Split in two, then the rest whole.
    assert (w, v) == (x, x + 150 * MiB) and one.in_use - used == 300 * MiB
    one.alloc(500 * MiB)  # From the 723 MiB: the 223 MiB left are split off (over 128 MiB).
    assert one.in_use - used == 800 * MiB
    for chunk in (w, v, y, x + 301 * MiB):
        one.free(chunk)
    assert one.in_use == 0 and one.alloc(GiB) == x  # Freed neighbours merged: one chunk.


# Record offload_8b_1m: llama3_8b at 128 x 8192 tokens a step in 64 microbatches, FP8 matmuls and
# LM head, masters and AdamW state in pinned host memory (experiments/offload_throughput.py's
# variant), planned for one H200 (its device budget at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95).
RECORD = [
    "--config.offload.policy=optimizer",
    "--config.offload.cpu_update=0",
    "--config.zero_stage=1",
    "--config.train.batch_size=128",
    "--config.model.remat=dots_no_batch",
    "--config.train.microbatches=64",
    "--config.fp8.matmul=true",
    "--config.fp8.lm_head=true",
    "--config.offload.device_gib=132.81",
    "--config.offload.host_gib=120",
]
GPU_HOST = 118 * GiB  # What the record's machine (125 GiB) had available, at the least.


@pytest.fixture(scope="module")
def record_plan():
    config = load_config("configs/llama3_8b.py", RECORD)
    return build(config, make_mesh(config.mesh, jax.devices()[:1]), fit_compiled=False).plan


def test_the_8b_record_plans_pool_fails_where_the_gpu_did(record_plan):
    """On the GPU the plan's pool ran out in its first step at a 79 GiB cap (the old advice,
    74.8 GiB over USABLE), on a 1.96 GiB allocation (the embedding's float32 moments), and a
    110 GiB cap is held whole: the replay does both, and holds no more than its regions
    under a cap it does not reach."""
    need = record_plan.tier_bytes(HOST)
    assert round(need / GiB, 1) == 74.8
    assert 79 * GiB == -(-need / USABLE // GiB) * GiB  # The old advice.
    old = replay_pool(record_plan.pool, 79 * GiB)
    assert not old.ok and old.step == 1 and round(old.failed / GiB, 2) == 1.96
    whole = replay_pool(record_plan.pool, 110 * GiB)
    assert whole.ok and whole.held == 110 * GiB
    # Under a cap it never reaches, the pool holds the regions it made: 1, 2, 2, 4, ... 64 GiB
    # (the first raised to the embedding's 0.98 GiB low half, then doubling).
    assert replay_pool(record_plan.pool, 256 * GiB).held == 129 * GiB


def test_the_8b_record_is_advised_a_pool_that_the_replay_accepts(record_plan, monkeypatch):
    """At the 110 GiB cap the record ran with, the planner refuses (the pool is held whole,
    beside the process's 24 GiB) and names the cap to set; at that cap every allocation of
    the run's steps finds room, and at the cap below too; two below, one does not (the update's
    arrays drift in the pool over the steps); and the pool it holds fits the record's machine
    beside the process. With the advice set the plan passes, and its table names it."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", raising=False)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
    refusal = tiers.pool_overflow(record_plan, 1, backend="gpu", available=GPU_HOST)
    assert "would hold 110.0 GiB" in refusal
    advised = int(re.search(r"set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=(\d+) ", refusal)[1])
    at = {gib: replay_pool(record_plan.pool, gib * GiB) for gib in range(advised - 2, advised + 1)}
    assert at[advised].ok and at[advised - 1].ok and not at[advised - 2].ok
    assert at[advised - 2].step > 3  # Three steps' replay would have taken it.
    assert at[advised].held + tiers.BESIDE_POOL <= GPU_HOST
    assert advised == 93  # The replay's answer for this plan (pinned: 93 GiB held).
    # What a plan refused for its host tier names, where the cap is what is short (64 GB).
    advice = tiers.pool_advice(record_plan, 1, backend="gpu", available=GPU_HOST)
    assert advice == f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={advised}"
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    fix = tiers.pool_fixes({HOST}, backend="gpu", setting=advice, available=GPU_HOST)
    assert f"({advice} for this plan, now 64;" in fix[0]
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(advised))
    assert tiers.pool_overflow(record_plan, 1, backend="gpu", available=GPU_HOST) == ""
    note = tiers.pool_note(record_plan, 1, backend="gpu", available=GPU_HOST)
    assert note == f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={advised} holds {advised}.0 GiB, pinned"
    # The old advice is refused for running out, with the same advice.
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "79")
    refusal = tiers.pool_overflow(record_plan, 1, backend="gpu", available=GPU_HOST)
    assert "runs out in step 1: a 1.96 GiB allocation" in refusal
    assert f"set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={advised} " in refusal


def test_the_benchmark_recipe_runs_the_record_with_the_plans_advice(record_plan):
    """experiments/recipes.py's `offload_8b_1m` sets the pool cap this plan prints, on the
    machine the record runs on, and nothing more; its run is this plan's."""
    import offload_throughput
    import recipes

    recipe = {r.name: r for r in recipes.RECIPES}["offload_8b_1m"]
    advice = tiers.pool_advice(record_plan, 1, backend="gpu", available=GPU_HOST)
    assert [f"{k}={v}" for k, v in recipe.env.items()] == [advice]
    variant = {v[0]: v[2] for v in offload_throughput.VARIANTS}[recipes.V8_1M]
    assert set(RECORD) - set(variant) == {
        "--config.offload.device_gib=132.81",
        "--config.offload.host_gib=120",
    }
