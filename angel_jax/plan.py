"""Plan a run's layout on a GPU cluster before having it: the mesh (data x ZeRO stage, tensor,
pipeline with its microbatches and schedule, context), the remat policy and the optimizer's
offload, searched under the per-GPU memory budget, ranked by predicted step time.

    python -m angel_jax.plan --config configs/llama3_70b.py --gpus 64 --gpu h100
    python -m angel_jax.plan --config configs/llama3_70b.py --gpus 64 --gpu h100 --compile 1

Memory per device is the project's own model: `memory.state_bytes_per_param` for the model
states, the ZeRO-Cache planner's `activation_bytes` for what the layers keep, and the
pipeline's stage planner (`make_pipeline_plan`) for pipelined layouts. Step time is
`cost_model.step_time` (calibrated compute, alpha-beta collectives). `--compile N` compiles the
N best layouts' train steps for the whole cluster on this machine (JAX's compile-only devices
of a described GPU topology, `hosts x GPUs a host`) and prints the compiled program's peak
memory beside the prediction, and the collectives it holds. docs/planning.md says how to read
the output and where the model is weak.
"""

import collections
import dataclasses
import functools
import itertools
import math
import os
import pathlib
import re
import sys
import time

import ml_collections

from angel_jax import machine
from angel_jax.cli import Parser
from angel_jax.config import ConfigError, apply_overrides, load_config
from angel_jax.planning import cost_model, schedule, tiers
from angel_jax.planning.activations import AUTO_REMATS, activation_bytes
from angel_jax.planning.inputs import plan_input
from angel_jax.planning.memory import state_bytes_per_param
from angel_jax.planning.stage_plan import make_pipeline_plan
from angel_jax.planning.tiers import POOL_CAP, USABLE
from angel_jax.remat import STAGE_REMATS

RESERVED_GIB = 2.0  # cuBLAS/cuDNN workspaces and NCCL's buffers, beside what XLA plans.
TENSOR_SIZES = (1, 2, 4, 8)  # Within a host: tensor traffic stays on NVLink.
CONTEXT_SIZES = (1, 2, 4, 8, 16)  # Beyond a host, a ring over InfiniBand (long sequences).
PIPELINE_SIZES = (1, 2, 4, 8, 16)
VIRTUAL = (2, 4, 5)  # Interleaved 1F1B's chunks per stage tried (circular's keep more).
BUDGET_NOTE = f"{USABLE:.0%} of jax's limit less {RESERVED_GIB:g} GiB for workspaces"


@dataclasses.dataclass(frozen=True)
class Layout:
    data: int
    tensor: int
    pipeline: int
    context: int
    zero: int
    remat: str
    microbatches: int  # Gradient accumulation, or the pipeline's microbatches.
    schedule: str = ""  # Pipelines: 1f1b (interleaved with virtual > 1) | gpipe | circular.
    virtual: int = 1
    offload: str = "none"  # none | optimizer (masters and AdamW state in pinned host memory).

    def mesh_shape(self) -> dict[str, int]:
        return dict(
            data=self.data,
            pipeline=self.pipeline,
            expert=1,
            context=self.context,
            sequence=1,
            tensor=self.tensor,
        )

    def settings(self) -> dict[str, object]:
        """The config settings (dotted paths) that run this layout."""
        s = {f"mesh.{a}": n for a, n in self.mesh_shape().items()}
        s.update({"zero_stage": self.zero, "offload.policy": self.offload})
        s["model.attention"] = "cudnn"
        if self.tensor > 1:
            # Megatron's sequence parallel: the norm regions' activations split over tensor
            # too, for the same bytes of collectives (all-gathers and reduce-scatters for
            # all-reduces).
            s["model.sequence_parallel"] = True
        s["model.remat"] = self.remat
        if self.pipeline > 1:
            s["train.microbatches"] = 1
            s.update(
                {
                    "pipeline.microbatches": self.microbatches,
                    "pipeline.schedule": self.schedule,
                    "pipeline.virtual_stages": self.virtual,
                    "pipeline.remat": self.remat,
                }
            )
        else:
            s["train.microbatches"] = self.microbatches
        return s

    def overrides(self) -> list[str]:
        """The `--config.` overrides that run this layout."""
        return [
            f"--config.{k}={str(v).lower() if v is True else v}" for k, v in self.settings().items()
        ]

    def name(self) -> str:
        parts = [f"dp{self.data} z{self.zero}", f"tp{self.tensor}"]
        if self.pipeline > 1:
            v = f" v{self.virtual}" if self.virtual > 1 else ""
            parts.append(f"pp{self.pipeline} {self.schedule}{v}")
        if self.context > 1:
            parts.append(f"cp{self.context}")
        parts.append(f"mb{self.microbatches} {self.remat}")
        if self.offload != "none":
            parts.append("opt->host")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory_gib: float
    budget_gib: float
    breakdown: cost_model.Breakdown | None = None
    tokens_per_s: float = 0.0  # Per GPU.
    mfu: float = 0.0  # Causal attention FLOPs counted, as angel_jax.metrics reports it.
    host_gib: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory_gib <= self.budget_gib


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is planned: the model, its batch and the cluster."""

    config: ml_collections.ConfigDict
    gpus: int
    gpu: cost_model.Gpu
    seq_len: int
    batch: int  # Sequences per step.
    calibration: cost_model.Calibration

    @property
    def budget_gib(self) -> float:
        return USABLE * self.gpu.budget_gib - RESERVED_GIB


def model_shape(model: ml_collections.ConfigDict):
    """The family's model config (a DecoderShape) for config.model, as on a GPU (cuDNN's
    attention: every layout runs it, pipeline stages included)."""
    from angel_jax.models import family_of  # The models import the trainer's planner.

    model = ml_collections.ConfigDict(model.to_dict())
    model.attention = "cudnn"
    model.ring_blocks = "xla"  # The planner costs kernels itself; no library check here.
    model.moe_kernel = "xla"
    return family_of(model).make_config(model, "gpu")


def param_count(shape) -> float:
    """Parameters the trainer holds: the layers' and LM head's matmul weights and the embedding
    (norms are a rounding error)."""
    embed = 0 if shape.tie_embeddings else shape.vocab_size * shape.d_model
    return shape.matmul_params() + embed


def layouts(problem: Problem, shape) -> list[Layout]:
    """Every layout of `problem.gpus` devices the search tries."""
    out = []
    b, L, m = problem.batch, shape.num_layers, problem.config.model
    # Positions split over context x tensor in norm regions (sequence parallel), each rank's
    # twice over for the ring's zigzag, and again by the logits' and MLP's chunks.
    per_split = math.lcm(2, m.logits_chunks, m.mlp_chunks)
    for tp, pp, cp in itertools.product(TENSOR_SIZES, PIPELINE_SIZES, CONTEXT_SIZES):
        if problem.gpus % (tp * pp * cp) or tp > problem.gpu.per_host:
            continue
        if shape.num_heads % tp or problem.seq_len % (tp * cp * per_split) or L < pp:
            continue
        dp = problem.gpus // (tp * pp * cp)
        if b % dp:
            continue
        per_replica = b // dp  # Sequences each data replica takes a step.
        counts = [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if per_replica % m == 0]
        if pp == 1:
            for zero, remat, m, off in itertools.product(
                (0, 1, 2, 3), AUTO_REMATS, counts, ("none", "optimizer")
            ):
                if off == "optimizer" and zero == 0:
                    continue
                out.append(Layout(dp, tp, 1, cp, zero, remat, m, offload=off))
            continue
        for m in (m for m in counts if m >= pp):
            schedules = [("1f1b", 1), ("gpipe", 1)]
            if m % pp == 0:
                schedules += [("1f1b", v) for v in VIRTUAL if L >= pp * v]
            for (sched, v), zero, remat in itertools.product(schedules, (0, 1, 2, 3), STAGE_REMATS):
                out.append(Layout(dp, tp, pp, cp, zero, remat, m, sched, v))
    return out


def _work_config(
    problem: Problem, layout: Layout, config: ml_collections.ConfigDict | None = None
) -> ml_collections.ConfigDict:
    """problem.config set up for `layout`: a new copy, or `config` (such a copy) changed."""
    c = config or ml_collections.ConfigDict(problem.config.to_dict())
    c.model.sequence_parallel = False  # A reused copy: the layout's settings say where it is on.
    apply_overrides(c, layout.overrides())
    c.train.seq_len, c.train.batch_size = problem.seq_len, problem.batch
    c.pipeline.balance = "even"  # auto's search over splits is too slow for thousands of layouts.
    # The trainer's planners take a share (USABLE) of this themselves; the layers' inputs stay
    # on the device, as the memory model here counts them.
    c.offload.device_gib = problem.gpu.budget_gib
    c.offload.activations = "device"
    c.offload.policy = layout.offload
    return c


def memory(
    problem: Problem, shape, layout: Layout, work: ml_collections.ConfigDict | None = None
) -> tuple[float, float, object]:
    """(device bytes, pinned host bytes, the pipeline plan or None) of `layout`; `work`: a
    copy of problem.config to set up for it (a search reuses one)."""
    config = _work_config(problem, layout, work)
    if layout.pipeline > 1:
        stage_cfg = dataclasses.replace(shape, remat=layout.remat)
        with _described_gpu(problem):
            inp = plan_input(config, layout.mesh_shape(), stage_cfg, budget={})
        plan = make_pipeline_plan(inp, stage_cfg)
        device = float(plan.memory_bytes.max())
        return device, 0.0, plan
    with _described_gpu(problem):
        inp = plan_input(config, layout.mesh_shape(), shape, budget={})
        acts = activation_bytes(inp, layout.remat)
    params = param_count(shape) / layout.tensor
    split = lambda stage: inp.zero_ranks if layout.zero >= stage else 1
    accumulating = layout.microbatches > 1
    if layout.offload == "optimizer":
        # A bf16 compute copy and bf16 grads on the device (float32 while accumulating, and
        # one microbatch's beside them); the masters' low halves and AdamW's moments on host.
        grads = (4 if accumulating else 2) + 4 * accumulating
        device = params * (2 / split(3) + grads / split(2))
        host = params * (2 + 8) / split(1)
    else:
        per_param = state_bytes_per_param(layout.zero, inp.zero_ranks)
        device = params * (per_param + 4 * accumulating / split(2))
        host = 0.0
    device += acts["layer inputs"] + acts["activations"]
    return device, host + acts["offloaded activations"], None


def gpu_target(problem: Problem) -> pathlib.Path:
    """The XLA target description of `problem.gpu`'s kind (may not exist)."""
    targets = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "gpu_targets"
    return targets / f"{problem.gpu.name}.txtpb"


@functools.cache
def _capability(target: pathlib.Path) -> str:
    return machine.target_capability(target.read_text()) if target.is_file() else ""


class _described_gpu:
    """Plans and picks kernels as for a GPU (angel_jax.machine), for the block only."""

    def __init__(self, problem: Problem):
        self.host = int(problem.gpu.host_gib * 2**30)
        self.capability = _capability(gpu_target(problem))

    def __enter__(self):
        machine.describe("gpu", self.host, capability=self.capability)

    def __exit__(self, *exc):
        machine.describe(None)


def evaluate(
    problem: Problem,
    shape,
    layout: Layout,
    system: cost_model.System = cost_model.OURS,
    work: ml_collections.ConfigDict | None = None,
    with_memory: bool = True,
) -> Candidate:
    """`layout`'s memory (ours; `with_memory` off: not counted, NaN) and step time as `system`
    runs it (another system's: its schedule's bubble, not our pipeline's)."""
    device, host, plan = (
        memory(problem, shape, layout, work) if with_memory else (math.nan, 0, None)
    )
    mem_gib = device / 2**30
    budget = problem.budget_gib
    if host / 2**30 > problem.gpu.host_gib:
        budget = 0.0  # Refused: the host cannot hold the offloaded states.
    critical = plan.step_flops() if plan is not None and not system.interleaved_1f1b else None
    br = cost_model.step_time(
        shape,
        layout,
        problem.seq_len,
        problem.batch,
        problem.gpu,
        problem.calibration,
        system,
        critical,
        fp8=problem.config.fp8.matmul,
    )
    tokens = problem.batch * problem.seq_len / br.total_s / problem.gpus
    mfu = tokens * shape.flops_per_token(problem.seq_len) / (problem.gpu.peak_tflops * 1e12)
    return Candidate(layout, mem_gib, budget, br, tokens, mfu, host / 2**30)


def search(problem: Problem) -> tuple[list[Candidate], list[Candidate]]:
    """(layouts that fit, fastest first; those over memory)."""
    shape = model_shape(problem.config.model)
    fits, over = [], []
    work = ml_collections.ConfigDict(problem.config.to_dict())
    for layout in layouts(problem, shape):
        try:
            c = evaluate(problem, shape, layout, work=work)
        except ConfigError:
            continue  # A combination the trainer refuses (stage_plan says why).
        (fits if c.fits else over).append(c)
    fits.sort(key=lambda c: c.breakdown.total_s)
    over.sort(key=lambda c: c.memory_gib)
    return fits, over


def _mesh_key(layout: Layout) -> tuple:
    return (layout.tensor, layout.pipeline, layout.context)


def why_lost(fits: list[Candidate], over: list[Candidate]) -> list[str]:
    """One line per mesh (tensor x pipeline x context) that did not win: slower by how much
    and what it lost time to, or over memory by how much."""
    if not fits:
        return []
    best = fits[0]
    lines, seen = [], {_mesh_key(best.layout)}
    for c in fits:
        key = _mesh_key(c.layout)
        if key in seen:
            continue
        seen.add(key)
        slower = c.breakdown.total_s / best.breakdown.total_s - 1
        lines.append(
            f"  {c.layout.name():<52} slower by {slower:.0%} "
            f"({c.breakdown.lost_to(best.breakdown)})"
        )
    for c in over:
        key = _mesh_key(c.layout)
        if key in seen:
            continue
        seen.add(key)
        lines.append(
            f"  {c.layout.name():<52} over memory: {c.memory_gib:.1f} GiB of "
            f"{c.budget_gib:.1f} at its smallest"
        )
    return lines


def table(cands: list[Candidate]) -> list[str]:
    rows = [
        ("layout", "GiB/GPU", "step s", "tok/s/GPU", "MFU", "compute", "bubble", "exposed comm")
    ]
    for c in cands:
        b = c.breakdown
        comm = b.tensor_s + b.data_s + b.context_s + b.pipeline_s
        rows.append(
            (
                c.layout.name(),
                f"{c.memory_gib:.1f}",
                f"{b.total_s:.2f}",
                f"{c.tokens_per_s:,.0f}",
                f"{c.mfu:.1%}",
                f"{b.compute_s:.2f}",
                f"{b.bubble_s:.2f}",
                f"{comm:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


# --- Memory as the compiled program says.


POOL_STEPS = 20


def compile_layout(problem: Problem, layout: Layout, hosts: int) -> dict:
    """Compiles `layout`'s train step for `hosts` x `gpus / hosts` GPUs of `problem.gpu`'s kind
    on this machine (JAX's compile-only devices of a described topology: no GPU needed, the
    CUDA plugin is) and returns its compiled memory and collectives."""
    import jax
    from jax.experimental import topologies

    from angel_jax.mesh import make_mesh
    from angel_jax.planning.compiled import compiled_peak
    from angel_jax.train import build

    target = gpu_target(problem)
    if not target.is_file():
        raise ConfigError(f"--compile: no GPU target description at {target}")
    described = {} if jax.default_backend() == "gpu" else {"target_config": target.read_text()}
    per_host = problem.gpus // hosts
    topo = topologies.get_topology_desc(
        "compile-only", "cuda", topology=f"1x{hosts}x{per_host}", **described
    )
    config = _work_config(problem, layout)
    config.data.synthetic = True
    config.monitor.on_anomaly = "log"  # The step the loop runs, not the anomaly guard's.
    # The pinned-host pool is replayed over the run's steps (tiers.replay_pool), a fraction
    # of a second a step for a host's 8 GPUs: a few steps, for the regions it settles at.
    config.train.steps = POOL_STEPS
    start = time.perf_counter()
    host = int(problem.gpu.host_gib * per_host * 2**30)
    # A run has one process a host; the target's GPU picks the kernels (cuDNN's ring blocks).
    machine.describe("gpu", host, hosts, _capability(target))
    # The pinned-host pool's cap is the run's environment, not the program's: the whole
    # host here, and the cap the plan needs is reported with the memory.
    saved_cap = os.environ.get(POOL_CAP)
    os.environ[POOL_CAP] = str(host // 2**30)
    try:
        exp = build(config, make_mesh(config.mesh, topo.devices), fit_compiled=False)
        pool = ""
        if exp.plan.pool is not None:  # The cap that makes the regions the replay ended with.
            cap = int(tiers.pinned_pool_cap_gb() * 2**30)  # As build replayed it.
            held = tiers.replay_pool(exp.plan.pool, cap, False, per_host).held
            pool = f"{POOL_CAP}={math.ceil(held / 2**30)} (over {POOL_STEPS} steps)"
        # Not checked against the plan (a run's `build` refuses what does not fit): the
        # compiled numbers are the answer here. With the optimizer offloaded, the
        # forward/backward's program (the streamed update runs after it).
        if exp.plan.offloads_optimizer:
            program = exp.steps.program_compiled
        elif exp.pipeline is None:
            program = exp.steps.lowered().compile()
        else:
            program = exp.train_step
        mem = program.memory_analysis()
        text = program.as_text()
    finally:
        machine.describe(None)
        if saved_cap is None:
            os.environ.pop(POOL_CAP)
        else:
            os.environ[POOL_CAP] = saved_cap
    out = dict(
        layout=layout.name(),
        topology=f"1x{hosts}x{per_host}",
        compile_s=round(time.perf_counter() - start, 1),
        temp_gib=mem.temp_size_in_bytes / 2**30,
        argument_gib=mem.argument_size_in_bytes / 2**30,
        host_temp_gib=mem.host_temp_size_in_bytes / 2**30,
        collectives=schedule.counts(text),
        # The library kernels it calls (cuDNN's attention, cuBLAS's GEMMs), by name.
        kernels=dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
        pinned_pool=pool,  # The setting a host's process needs, "" for XLA's default.
        tensor_exposed=tensor_exposed(problem, layout, text, per_host),
    )
    if exp.pipeline is None:
        out["compiled_peak_gib"] = compiled_peak(exp.plan, mem.temp_size_in_bytes) / 2**30
    else:  # The pipeline's step: its arguments (the states) and temporaries.
        out["compiled_peak_gib"] = out["temp_gib"] + out["argument_gib"]
    out["usable_gib"] = USABLE * exp.plan.budget[tiers.DEVICE] / 2**30
    return out


def with_compiled_schedule(problem: Problem, shape, layout: Layout, share: float | None):
    """`layout` evaluated with the tensor collectives' exposed `share` its own compiled program
    gives (`compile_layout`'s `tensor_exposed`) in place of the calibration's."""
    if share is not None:
        cal = dataclasses.replace(
            problem.calibration, tensor_exposed_points=((layout.tensor, share),)
        )
        problem = dataclasses.replace(problem, calibration=cal)
    return evaluate(problem, shape, layout)  # With memory: a pipeline's plan gives its bubble.


def tensor_exposed(problem: Problem, layout: Layout, hlo_text: str, per_host: int):
    """The share of `layout`'s tensor collectives that its compiled program's schedule leaves
    exposed (planning/schedule.py); None without tensor collectives in its layer loop."""
    gpu = problem.gpu
    eff = problem.calibration.efficiency(
        model_shape(problem.config.model).layer_matmul_params() / layout.tensor,
        layout.tensor > 1,
    )
    hosts = max(problem.gpus // per_host, 1)

    def link_of(ranks: int, innermost: bool) -> cost_model.Link:
        spans = ranks > per_host or (not innermost and hosts > 1)
        return cost_model.link(gpu, spans, min(ranks, per_host))

    return schedule.exposed_share(schedule.collectives(hlo_text, gpu, eff, link_of), layout.tensor)


# --- The command line.


def make_problem(args) -> Problem:
    overrides = [f"--config.train.seq_len={args.seq_len}"] if args.seq_len else []
    config = load_config(args.config, [*args.overrides, *overrides])
    t = config.train
    tokens = args.global_batch_tokens or t.batch_size * t.seq_len
    if tokens % t.seq_len:
        raise ConfigError(
            f"--global-batch-tokens={tokens} is not a multiple of the sequence length "
            f"{t.seq_len}: give whole sequences"
        )
    gpu = cost_model.GPUS[args.gpu]
    if args.hosts:
        gpu = dataclasses.replace(gpu, per_host=args.gpus // args.hosts)
    cal = cost_model.load_calibration(args.gpu)
    return Problem(config, args.gpus, gpu, t.seq_len, tokens // t.seq_len, cal)


def plan(problem: Problem, top: int) -> tuple[list[str], list[Candidate]]:
    """The report's lines and the layouts that fit, fastest first."""
    fits, over = search(problem)
    shape = model_shape(problem.config.model)
    head = (
        f"{problem.gpus} x {problem.gpu.name.upper()} ({problem.gpus // problem.gpu.per_host} "
        f"hosts of {problem.gpu.per_host}), {shape.num_layers} layers d{shape.d_model}, "
        f"{param_count(shape) / 1e9:.1f}B params, {problem.batch} x {problem.seq_len} tokens "
        f"a step; budget {problem.budget_gib:.1f} GiB a GPU ({BUDGET_NOTE})"
    )
    lines = [head, f"calibration: {problem.calibration.source}"]
    if not fits:
        least = over[0] if over else None
        need = (
            f" (the smallest needs {least.memory_gib:.1f} GiB: {least.layout.name()})"
            if least
            else ""
        )
        raise ConfigError(
            f"no layout of {problem.gpus} {problem.gpu.name.upper()}s fits "
            f"{problem.budget_gib:.1f} GiB a GPU{need}: use more GPUs, a GPU with more "
            "memory (--gpu h200), a smaller --global-batch-tokens or a shorter --seq-len"
        )
    lines += [f"{len(fits)} layouts fit, {len(over)} over memory; the best {top}:"]
    lines += table(fits[:top])
    lines += ["why the other meshes lost (their best layout):", *why_lost(fits, over)]
    lines += [f"run the best: {' '.join(fits[0].layout.overrides())}"]
    return lines, fits


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config file, e.g. configs/llama3_70b.py")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    parser.add_argument("--gpu", choices=sorted(cost_model.GPUS), default="h100")
    parser.add_argument("--hosts", type=int, default=0, help="default: GPUs / 8")
    parser.add_argument("--seq-len", type=int, default=0, help="default: the config's")
    parser.add_argument(
        "--global-batch-tokens", type=int, default=0, help="default: the config's batch"
    )
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument(
        "--compile",
        type=int,
        default=0,
        metavar="N",
        help="compile the N best layouts for the whole cluster here and print their memory",
    )
    args, args.overrides = parser.parse_known_args(argv)
    try:
        if args.hosts and args.gpus % args.hosts:
            raise ConfigError(f"--gpus={args.gpus} is not a multiple of --hosts={args.hosts}")
        problem = make_problem(args)
        lines, fits = plan(problem, args.top)
        print("\n".join(lines), flush=True)
        shape = model_shape(problem.config.model)
        hosts = args.hosts or max(problem.gpus // problem.gpu.per_host, 1)
        for c in fits[: args.compile]:
            got = compile_layout(problem, c.layout, hosts)
            notes = [f"collectives {got['collectives']}", f"library kernels {got['kernels']}"]
            if got["tensor_exposed"] is not None:
                share = problem.calibration.tensor_exposed(c.layout.tensor)
                again = with_compiled_schedule(problem, shape, c.layout, got["tensor_exposed"])
                notes += [
                    f"its schedule leaves {got['tensor_exposed']:.0%} of the tensor collectives "
                    f"exposed (the plan assumed {share:.0%}): {again.tokens_per_s:,.0f} "
                    "tokens/s/GPU with that"
                ]
            if got["pinned_pool"]:
                notes += [f"each host's process needs {got['pinned_pool']}"]
            if got["compiled_peak_gib"] > got["usable_gib"]:
                notes += [f"OVER the {got['usable_gib']:.1f} GiB usable: it does not fit"]
            print(
                f"compiled {got['layout']} for {got['topology']} in {got['compile_s']} s: "
                f"peak {got['compiled_peak_gib']:.1f} GiB a GPU (predicted "
                f"{c.memory_gib:.1f}; temporaries {got['temp_gib']:.1f}, arguments "
                f"{got['argument_gib']:.1f}); {'; '.join(notes)}",
                flush=True,
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
