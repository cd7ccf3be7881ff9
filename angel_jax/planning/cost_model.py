"""Step time of a training layout on a GPU cluster, for the run planner (angel_jax/plan.py).

A step is compute plus what of its communication the compute does not hide:

- compute: the FLOPs each device runs (forward, backward = 2 forwards, and what the remat
  policy recomputes) at the device's peak times an efficiency. The efficiency is calibrated:
  measured for a layer's shard on one GPU (experiments/plan_calibrate.py writes
  experiments/calibration/<gpu>.json), else derived from the step records on file
  (`DEFAULT_POINTS`). It depends on the layer's matmul parameters per device (a tensor split
  makes the matmuls narrower and less efficient), interpolated log-linearly between points.
- collectives: ring algorithms on alpha-beta links (`all_gather_s`, `reduce_scatter_s`,
  `all_reduce_s`): within a host NVLink, across hosts InfiniBand (figures in `GPUS`).
- overlap: ZeRO-3's per-layer gathers and reduce-scatters run beside the compute (XLA's latency
  hiding scheduler, inside the scan over layers) so only what exceeds the compute, and the first
  layer's, shows; the gradient reduction of ZeRO 0-2 comes after the backward scan, whole;
  tensor-parallel collectives show as far as the compiled schedule leaves them exposed (the
  share read from programs compiled for the GPU, planning/schedule.py; all of them without
  that reading); ring attention's K/V passes hide behind the attention; the pipeline's bubble
  is the schedule's.

The model is small on purpose: every term is a line below, and `Breakdown` prints each.
"""

import dataclasses
import json
import math
import pathlib

import numpy as np

from angel_jax.remat import REMATS, has_attention_results, kept


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU kind in a cluster of hosts of `per_host` GPUs."""

    name: str
    peak_tflops: float  # Dense bf16, as angel_jax.metrics.PEAK_TFLOPS (MFU's denominator).
    budget_gib: float  # jax's bytes_limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95.
    hbm_gbps: float
    # NCCL bus bandwidth (GB/s per GPU) of a ring inside a host over NVLink 4: 450 GB/s a
    # direction (900 bidirectional, NVIDIA H100 SXM datasheet); nccl-tests reach about 360
    # without NVLink SHARP (multicast, which we never use: ../shared/JAX-FACTS.md).
    nvlink_gbps: float
    # InfiniBand per GPU: one 400 Gb/s NDR NIC each (8 a DGX/HGX H100 host) = 50 GB/s a
    # direction; we assume NCCL reaches 90% of the line rate.
    ib_gbps: float
    nvlink_alpha_s: float  # Per ring step: a few microseconds (NCCL's LL/Simple protocols).
    ib_alpha_s: float
    host_gbps: float  # Host <-> device copies (../shared/JAX-FACTS.md: 52-53 GB/s each way).
    host_gib: float  # Host memory per GPU for offloaded states: 2 TB a DGX host over 8, less OS.
    per_host: int = 8


GPUS = {
    "h100": Gpu("h100", 989.0, 75.15, 3350, 360, 45, 3e-6, 8e-6, 52, 224),
    "h200": Gpu("h200", 989.0, 132.81, 4800, 360, 45, 3e-6, 8e-6, 52, 224),
}
HBM_EFFICIENCY = 0.7  # Of the HBM bandwidth an optimizer update's elementwise kernels reach.


# --- Collectives: ring algorithms, `nbytes` the full (gathered / unreduced) buffer per rank.


@dataclasses.dataclass(frozen=True)
class Link:
    gbps: float  # Bus bandwidth per rank, GB/s.
    alpha_s: float


def link(gpu: Gpu, spans_hosts: bool, ranks_per_host: int) -> Link:
    """The ring's link for a group of devices: NVLink inside a host; across hosts each rank's
    NIC carries its share, NCCL running one ring per NIC, so a group with k ranks a host
    has k NICs' bandwidth there, up to NVLink's."""
    if not spans_hosts:
        return Link(gpu.nvlink_gbps, gpu.nvlink_alpha_s)
    return Link(min(gpu.nvlink_gbps, ranks_per_host * gpu.ib_gbps), gpu.ib_alpha_s)


def all_gather_s(nbytes: float, n: int, ln: Link) -> float:
    """Ring all-gather of an `nbytes` result over `n` ranks: n-1 steps, each rank receiving
    (n-1)/n of the result."""
    if n <= 1:
        return 0.0
    return (n - 1) * ln.alpha_s + (n - 1) / n * nbytes / (ln.gbps * 1e9)


def reduce_scatter_s(nbytes: float, n: int, ln: Link) -> float:
    """Ring reduce-scatter of an `nbytes` input: the all-gather's traffic, reversed."""
    return all_gather_s(nbytes, n, ln)


def all_reduce_s(nbytes: float, n: int, ln: Link) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2(n-1)/n of the buffer each way."""
    return 2 * all_gather_s(nbytes, n, ln)


def send_s(nbytes: float, ln: Link) -> float:
    """One point-to-point send (a pipeline stage's activations)."""
    return ln.alpha_s + nbytes / (ln.gbps * 1e9) if nbytes else 0.0


# --- Compute efficiency, calibrated.


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Hardware FLOPs efficiency of a layer's forward+backward (bf16, cuDNN attention) by the
    layer's matmul parameters on a device: (params, efficiency) points, interpolated in
    log(params) and held flat beyond the ends."""

    source: str
    points: tuple[tuple[float, float], ...]
    fp8_speedup: float = 1.0  # The step's speed-up with FP8 matmuls (no FP8 record: 1).
    # (params, FP8's speed-up) where timed by shard size: narrower shards gain less, their
    # matmuls' share of the layer and size smaller beside the casts.
    fp8_points: tuple[tuple[float, float], ...] = ()
    # (tensor size, share of the tensor collectives' time left exposed) read from the layer
    # loop of programs compiled for the GPU (planning/schedule.py); none: all exposed.
    tensor_exposed_points: tuple[tuple[int, float], ...] = ()
    # `points` and `fp8_points` as sequence parallel runs the shard (with the tp 1 point):
    # the timed shard runs its norm regions, and FP8's casts, on the whole sequence, which
    # sequence parallel splits tp ways (plan_calibrate.sequence_parallel). Empty: not profiled.
    sp_points: tuple[tuple[float, float], ...] = ()
    fp8_sp_points: tuple[tuple[float, float], ...] = ()

    def efficiency(self, params_per_device: float, sequence_parallel: bool = False) -> float:
        points = self.sp_points if sequence_parallel and self.sp_points else self.points
        return _interpolated(points, params_per_device)

    def fp8(self, params_per_device: float, sequence_parallel: bool = False) -> float:
        """FP8 matmuls' speed-up of a layer with this many matmul params on a device."""
        points = self.fp8_sp_points if sequence_parallel and self.fp8_sp_points else self.fp8_points
        if not points:
            return self.fp8_speedup
        return _interpolated(points, params_per_device)

    def tensor_exposed(self, tensor: int) -> float:
        """The share of a `tensor`-way split's collectives our compiled schedule leaves
        exposed, interpolated in log(tensor size) between the compiled points."""
        if not self.tensor_exposed_points or tensor <= 1:
            return 1.0
        return _interpolated(self.tensor_exposed_points, tensor)


def _interpolated(points, params_per_device: float) -> float:
    """Interpolated in log(params), held flat beyond the ends."""
    xs, ys = zip(*sorted(points), strict=True)
    return float(np.interp(math.log(params_per_device), np.log(xs), ys))


def record_efficiency(
    step_s: float, tokens: float, flops_per_token: float, update_s: float, peak_tflops: float
) -> float:
    """A measured step's compute efficiency: its FLOPs (model FLOPs plus recompute, per
    token) over the peak for its time less the optimizer update's (modelled, `update_s`)."""
    return tokens * flops_per_token / ((step_s - update_s) * peak_tflops * 1e12)


# Derived with `record_efficiency` from the benchmark's one-GPU step records of each GPU kind
# (experiments/plan_calibrate.py --from-records; tests/test_plan.py checks them against it):
# llama_1b (8 x 2048, remat dots_attention: nothing recomputed) and fp8_8b_8layers's bf16
# run (llama3_8b widths, 8 layers, 2 x 8192, dots_no_batch: attention recomputed). Points:
# (layer matmul params on the device, efficiency); FP8's speed-up is that record's FP8 step
# against its bf16 step.
DEFAULT_POINTS = {
    "h100": Calibration(
        "default: experiments/records/h100 llama_1b + fp8_8b_8layers (bf16)",
        ((44_040_192, 0.478), (218_103_808, 0.583)),
        fp8_speedup=1.279,
    ),
    "h200": Calibration(
        "default: experiments/records/h200 llama_1b + fp8_8b_8layers (bf16)",
        ((44_040_192, 0.489), (218_103_808, 0.572)),
        fp8_speedup=1.34,
    ),
}


REPO = pathlib.Path(__file__).resolve().parents[2]


def calibration_path(gpu: str, root: pathlib.Path | None = None) -> pathlib.Path:
    return (root or REPO) / "experiments" / "calibration" / f"{gpu}.json"


def load_calibration(gpu: str, path: pathlib.Path | None = None) -> Calibration:
    """The measured calibration (plan_calibrate.py's JSON) where one is on file, else the
    default from the step records."""
    path = path or calibration_path(gpu)
    if not path.is_file():
        return DEFAULT_POINTS[gpu]
    data = json.loads(path.read_text())
    default = DEFAULT_POINTS[gpu]
    points = lambda rows, key: tuple(
        (p["layer_params_per_device"], p[key]) for p in rows if key in p
    )
    fp8 = data.get("fp8_points", [])
    sp = data.get("sequence_parallel_from")
    return Calibration(
        f"measured: {path.relative_to(REPO) if path.is_relative_to(REPO) else path} "
        f"({data.get('device', '?')}, {data.get('date', '?')}"
        + (f"; sequence parallel from a profile at {sp.get('commit')})" if sp else ")"),
        points(data["points"], "efficiency"),
        data.get("fp8_speedup", default.fp8_speedup),
        points(fp8, "speedup"),
        tuple((p["tensor"], p["exposed"]) for p in data.get("tensor_exposed_points", [])),
        points(data["points"], "efficiency_sp"),
        points(fp8, "speedup_sp"),
    )


# --- The step.


@dataclasses.dataclass(frozen=True)
class System:
    """How a training system runs what the layout asks: what it overlaps."""

    name: str
    # Share of tensor-parallel collectives left on the critical path; None: as our compiled
    # schedule leaves them (Calibration.tensor_exposed).
    tp_exposed: float | None = 1.0
    dp_overlapped: bool = False  # ZeRO 0-2's gradient reduction overlaps the backward too.
    grad_bytes: int = 4  # The reduced gradients' bytes per parameter.
    gather_bytes: int = 2  # ZeRO-3's gathered parameters' bytes per parameter.
    interleaved_1f1b: bool = False  # Megatron's interleaved 1F1B bubble, not our schedules'.


# Ours (XLA SPMD): float32 grads reduced after the scan, bf16 gathers under ZeRO-3; the
# tensor collectives as hidden as XLA's latency-hiding scheduler places them.
OURS = System("angel-jax", None)
# Megatron-core / NeMo: TP communication overlap (userbuffers, Megatron-LM
# --tp-comm-overlap) hides most TP traffic; DDP buckets overlap the grad reduce-scatter with
# the backward; interleaved 1F1B. We assume a quarter of the TP traffic stays exposed.
MEGATRON = System("megatron", 0.25, True, 4, 2, True)
# torchtitan (FSDP2 + TP, async TP when on): the reduce-scatters overlap the backward.
TORCHTITAN = System("torchtitan", 1.0, True, 4, 2)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Seconds per step, per device, of each part (`total_s` their sum)."""

    compute_s: float
    bubble_s: float
    tensor_s: float
    data_s: float  # ZeRO / data-parallel collectives left exposed.
    context_s: float
    pipeline_s: float
    update_s: float

    @property
    def total_s(self) -> float:
        return sum(dataclasses.astuple(self))

    def lost_to(self, best: "Breakdown") -> str:
        """Where this step spends most beyond `best`'s, e.g. "tensor all-reduces +1.20 s"."""
        names = {
            "compute_s": "compute (recompute, narrower matmuls)",
            "bubble_s": "pipeline bubble",
            "tensor_s": "tensor all-reduces",
            "data_s": "data-parallel/ZeRO collectives",
            "context_s": "ring attention passes",
            "pipeline_s": "pipeline sends",
            "update_s": "optimizer update",
        }
        extra = {n: getattr(self, f) - getattr(best, f) for f, n in names.items()}
        name = max(extra, key=extra.get)
        return f"{name} +{extra[name]:.2f} s"


def layer_flops_per_token(shape, seq_len: int) -> tuple[float, float]:
    """(weight matmuls', causal attention's) forward FLOPs of one layer per token (the model's
    own count, as planning/activations.layer_flops)."""
    return 2 * shape.layer_matmul_params(), shape.layer_attention_flops(seq_len)


def update_s(params_per_device: float, gpu: Gpu, offloaded: bool) -> float:
    """An AdamW update of `params_per_device` (after ZeRO's split): on the device, its float32
    param, grad and moments read and param and moments written (28 bytes a parameter) at HBM
    speed; offloaded, about 12 bytes a parameter each way over the host link (the masters'
    low halves, the moments, bf16 grads and compute copy), not hidden behind the step."""
    if offloaded:
        return 12 * params_per_device / (gpu.host_gbps * 1e9)
    return 28 * params_per_device / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)


def step_time(
    shape,
    layout,
    seq_len: int,
    batch: int,
    gpu: Gpu,
    cal: Calibration,
    system: System = OURS,
    critical_flops: float | None = None,
    fp8: bool = False,
) -> Breakdown:
    """Seconds per step of `layout` (plan.Layout) for a model of `shape` (a DecoderShape) on
    `batch` sequences of `seq_len` tokens. `critical_flops`: a pipeline's critical path in
    FLOPs per device (planning/stage_plan.PipelinePlan.step_flops, our schedules); else the
    bubble is Megatron's interleaved 1F1B's or (p-1)/(m+p-1) of the step."""
    from angel_jax.mesh import split_over_hosts  # Floor 1; the cost model has no mesh else.

    tp, pp, cp, dp, m = (
        layout.tensor,
        layout.pipeline,
        layout.context,
        layout.data,
        layout.microbatches,
    )
    sizes = layout.mesh_shape()
    inside, across = split_over_hosts(sizes, min(gpu.per_host, math.prod(sizes.values())))
    links = {a: link(gpu, across[a] > 1, inside[a]) for a in sizes}
    tokens = batch * seq_len / (dp * cp)  # A device group's tokens per step (all microbatches).
    mb_tokens = tokens / m  # Per microbatch.
    layers = shape.num_layers / pp

    matmul, attention = layer_flops_per_token(shape, seq_len)
    results = has_attention_results("cudnn", cp)
    share_attention, share_matmul = REMATS[kept(layout.remat, results)].recompute or (1, 1)
    # Every layout with a tensor split runs sequence parallel: ours (plan.py) and the
    # published runs' systems (Megatron, torchtitan, Meta's).
    eff = cal.efficiency(shape.layer_matmul_params() / tp, tp > 1)
    if fp8:
        eff *= cal.fp8(shape.layer_matmul_params() / tp, tp > 1)
    peak = gpu.peak_tflops * 1e12
    attention_work = (3 + share_attention) * attention / tp  # Per token, per device.
    layer_work = (3 + share_matmul) * matmul / tp + attention_work
    head = 3 * 2 * shape.d_model * shape.vocab_size / tp  # LM head forward + backward.
    per_token_s = (layers * layer_work / eff + head / pp / eff) / peak
    compute = tokens * per_token_s
    if critical_flops is not None:  # Our schedule's critical path, bubble included.
        bubble = critical_flops / (peak * eff) - compute
        bubble = max(bubble, 0.0)
    elif pp > 1:
        v = layout.virtual if system.interleaved_1f1b else 1
        bubble = compute * (pp - 1) / v / m
    else:
        bubble = 0.0

    # Tensor parallel: 2 all-reduces of (tokens, d_model) in bf16 per layer forward, 2 in the
    # backward and 2 in a recomputed forward (Megatron's count; sequence parallel's
    # reduce-scatter + all-gather pairs move the same bytes).
    passes = 4 + 2 * (share_matmul > 0)
    tensor = passes * layers * m * all_reduce_s(mb_tokens * shape.d_model * 2, tp, links["tensor"])
    tensor *= cal.tensor_exposed(tp) if system.tp_exposed is None else system.tp_exposed
    if fp8:  # Each pair's all-gather moves e4m3 inputs or e5m2 gradients: half its bytes
        tensor *= 0.75  # (fp8.gather_quantized; torchao's float8 tensor parallel alike).

    # Data parallel over data x context: the grads' replicas, and ZeRO's split of the states
    # (mesh.ZERO_AXES; Megatron's distributed optimizer splits over both too).
    params = (shape.matmul_params() + shape.vocab_size * shape.d_model) / (tp * pp)
    group = dp * cp
    dl = links["data"] if dp > 1 else links["context"]
    if layout.zero == 3:
        gathers = 2 * m * all_gather_s(params * system.gather_bytes, group, dl)
        scatters = m * reduce_scatter_s(params * system.grad_bytes, group, dl)
        dp_total = gathers + scatters
        data = max(dp_total - compute, 0.0) + dp_total / max(layers, 1)
    else:
        per_mb = m if layout.zero == 2 else 1
        dp_total = per_mb * all_reduce_s(params * system.grad_bytes, group, dl)
        data = dp_total / max(layers, 1) if system.dp_overlapped else dp_total

    # Ring attention: each layer passes K and V round the ring in the forward, K, V and their
    # grads in the backward (and once more in a recomputed forward), beside the attention.
    context = 0.0
    if cp > 1:
        kv = 2 * shape.num_kv_heads * shape.head_dim / (tp if shape.num_kv_heads % tp == 0 else 1)
        chunk = mb_tokens * kv * 2
        ring = (cp - 1) * send_s(chunk, links["context"]) * (3 + share_attention)
        attn_s = mb_tokens * attention_work / (peak * eff)
        context = layers * m * max(ring - attn_s, 0.0)

    # Pipeline sends: each microbatch's activations forward and their grads back per chunk
    # boundary; on the critical path at the fill and drain.
    pipe = 0.0
    if pp > 1:
        nbytes = mb_tokens * shape.d_model * 2 / tp
        pipe = 2 * (pp - 1) * layout.virtual * send_s(nbytes, links["pipeline"])

    split = group if layout.zero >= 1 else 1
    upd = update_s(params / split, gpu, layout.offload == "optimizer")
    return Breakdown(compute, bubble, tensor, data, context, pipe, upd)
