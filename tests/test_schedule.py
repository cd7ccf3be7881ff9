"""What of a compiled program's collectives its schedule hides (angel_jax/planning/schedule.py):
on hand-written scheduled programs, and on one the GPU compiler schedules."""

import pytest

from angel_jax import plan
from angel_jax.planning import cost_model, schedule
from tests.test_plan import needs_cuda_compiler, problem

H100 = cost_model.GPUS["h100"]
NVLINK = cost_model.link(H100, False, 8)

# A scan's body: the all-gather of a (1024, 1024) bf16 shard's 8 parts, and a 4096^3 matmul
# (0.14 TFLOP: ~0.3 ms at half the peak) placed by the schedule at `{matmul_at}`.
PROGRAM = """HloModule m, is_scheduled=true

%gemm (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {{
  %p0 = bf16[4096,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[4096,4096]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (param: (bf16[128,1024], bf16[4096,4096])) -> (bf16[128,1024], bf16[4096,4096]) {{
  %param = (bf16[128,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) parameter(0)
  %x = bf16[128,1024]{{1,0}} get-tuple-element(%param), index=0
  %w = bf16[4096,4096]{{1,0}} get-tuple-element(%param), index=1
  {before}
  %all-gather-start = ((bf16[128,1024]{{1,0}}), bf16[1024,1024]{{1,0}}) all-gather-start(%x), channel_id=1, replica_groups={groups}, dimensions={{0}}
  {between}
  %all-gather-done = bf16[1024,1024]{{1,0}} all-gather-done(%all-gather-start)
  {after}
  ROOT %out = (bf16[128,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) tuple(%x, %matmul)
}}

ENTRY %main (a: (bf16[128,1024], bf16[4096,4096])) -> (bf16[128,1024], bf16[4096,4096]) {{
  %a = (bf16[128,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) parameter(0)
  ROOT %while = (bf16[128,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) while(%a), condition=%cond, body=%body
}}
"""  # noqa: E501 (XLA's lines)
MATMUL = "%matmul = bf16[4096,4096]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm"
TENSOR_8 = "mesh['data'=2,'tensor'=8] {'tensor'}"


def scheduled(matmul_at: str, groups: str = TENSOR_8) -> list[schedule.Collective]:
    slots = dict.fromkeys(("before", "between", "after"), "")
    text = PROGRAM.format(groups=groups, **{**slots, matmul_at: MATMUL})
    return schedule.collectives(text, H100, 0.5, lambda ranks, innermost: NVLINK)


def test_a_collective_is_hidden_by_the_compute_its_schedule_puts_beside_it():
    (beside,) = scheduled("between")
    (after,) = scheduled("after")
    for c in (beside, after):
        assert (c.kind, c.nbytes, c.ranks, c.innermost, c.in_loop) == (
            "all-gather",
            2 * 1024 * 1024,
            8,
            True,
            True,
        )
        assert c.transfer_s == pytest.approx(cost_model.all_gather_s(2 * 2**20, 8, NVLINK))
    # The matmul (2 x 4096^3 FLOPs at half of 989 TFLOP/s: 0.28 ms) outlasts the transfer.
    assert beside.exposed_s == 0.0
    assert after.exposed_s == after.transfer_s  # Scheduled after the done: nothing hides it.
    assert schedule.exposed_share([beside], 8) == 0.0
    assert schedule.exposed_share([after], 8) == 1.0
    assert schedule.exposed_share([after], 4) is None  # No 4-way tensor collectives.


def test_replica_groups_in_each_spelling():
    spellings = {
        TENSOR_8: (8, True),
        "mesh['data'=4,'pipeline'=1,'tensor'=2] {'data'}": (4, False),
        "mesh['axis_0'=8] {'axis_0'}": (8, True),  # XLA renames the axes at times.
        "[2,8]<=[16]": (8, True),  # An iota: groups of consecutive devices.
        "[8,2]<=[2,8]T(1,0)": (2, False),  # Transposed: strided, an outer axis.
        "{{0,1,2,3},{4,5,6,7}}": (4, True),
        "{{0,2},{1,3}}": (2, False),
    }
    for groups, (ranks, innermost) in spellings.items():
        (c,) = scheduled("after", groups)
        assert (c.ranks, c.innermost) == (ranks, innermost), groups


def test_an_ops_time_hides_one_transfer_only():
    # Two gathers in flight beside one matmul that outlasts each but not both together.
    body = PROGRAM.format(groups=TENSOR_8, before="", between=MATMUL, after="")
    second = (
        body.replace("%all-gather-start =", "%ag2-start-x = SECOND\n  %all-gather-start =")
        .replace(
            "SECOND",
            "((bf16[128,131072]{1,0}), bf16[1024,131072]{1,0}) all-gather-start(%x), "
            f"channel_id=2, replica_groups={TENSOR_8}, dimensions={{0}}",
        )
        .replace(
            "  ROOT %out",
            "  %ag2-done = bf16[1024,131072]{1,0} all-gather-done(%ag2-start-x)\n  ROOT %out",
        )
    )
    first, big = schedule.collectives(second, H100, 0.5, lambda r, i: NVLINK)
    matmul_s = 2 * 4096**3 / (0.5 * H100.peak_tflops * 1e12)
    assert first.exposed_s == 0.0
    assert big.transfer_s > matmul_s - first.transfer_s
    assert big.exposed_s == pytest.approx(big.transfer_s - (matmul_s - first.transfer_s))


def test_the_cost_model_shows_the_tensor_share_the_schedule_leaves():
    p = problem(64, "configs/llama3_70b.py")
    shape = plan.model_shape(p.config.model)
    layout = plan.Layout(8, 8, 1, 1, 3, "dots_attention", 4)
    hidden = cost_model.Calibration("t", ((1e8, 0.5),), tensor_exposed_points=((2, 0.1), (8, 0.5)))
    exposed = cost_model.Calibration("t", ((1e8, 0.5),))
    a, b = (cost_model.step_time(shape, layout, 8192, 64, p.gpu, cal) for cal in (hidden, exposed))
    assert a.tensor_s == pytest.approx(0.5 * b.tensor_s)
    assert a.compute_s == b.compute_s
    assert hidden.tensor_exposed(4) == pytest.approx(0.3)  # Halfway in log(size).
    # Another system's share is its own.
    c = cost_model.step_time(shape, layout, 8192, 64, p.gpu, hidden, cost_model.TORCHTITAN)
    assert c.tensor_s == pytest.approx(b.tensor_s)


@needs_cuda_compiler
def test_the_gpu_compiler_schedules_tensor_collectives_beside_compute():
    """Compiled for 8 GPUs under tensor + sequence parallel, the layer loop's all-gathers and
    reduce-scatters over `tensor` are asynchronous; the backward's weight-gradient matmuls
    run beside some of them, so part of their time is hidden, not all (XLA's scheduler, not
    the model's assumption)."""
    p = problem(8, "configs/tiny.py", overrides=["--config.model.dtype=bfloat16"])
    got = plan.compile_layout(p, plan.Layout(2, 4, 1, 1, 1, "dots_attention", 1), hosts=1)
    assert 0.0 < got["tensor_exposed"] < 1.0, got


def test_counts_every_collective_started_or_run():
    # The asynchronous start's result is a tuple, its first element the operand.
    assert schedule.counts(
        PROGRAM.format(groups=TENSOR_8, before="", between="", after=MATMUL)
    ) == {"all-gather": {"ops": 1, "in_loops": 1, "dtypes": ["bf16"]}}
