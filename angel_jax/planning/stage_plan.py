"""Stage balancing: a cost model of the pipeline's chunks, the layer split it picks, and the
remat policy.

Costs are estimated from the model config, per microbatch and per device (the other mesh
axes split each chunk's work evenly). A layer's forward costs 2 x its matmul params + 2 T N H
(causal attention) FLOPs per token; the first chunk adds the embedding (a lookup: no FLOPs, its
grad a scatter), the last the final norm, LM head and loss (2 D V + 5 V per token). In the
pipeline (parallel/pipeline.py) a chunk's F costs its forward and its B the backward (2
forwards) plus what the remat policy recomputes; the head, which keeps no logits, is
recomputed in B. A step then lasts, tick by tick, as long as the costliest F plus the costliest
B (`critical_path`). `balance=auto` splits the layers so that this is shortest; `even` gives
every chunk the same count (the remainder to the first ones); "12,10" gives the counts of chunk
0, 1, ... (chunk k on stage k mod p).

Memory per device: the state (fp32 masters, grads, the pipeline's fp32 grad accumulators and
AdamW moments, with ZeRO's `data` split), every stage holding the embedding and head; the
residuals of the microbatches in flight (the schedule's slots, each holding a chunk's layers'
saved activations and the head's input, and one slot more for copies in flight); and the last
chunk's logits and their grad. One program runs on every stage, so each allocates what the
fullest stage needs: padded layer slots, the same remat policy, buffers and branch temporaries
everywhere. `remat=auto` picks the fastest policy that fits the device memory
(config.offload.device_gib, else what the device reports). With `context` split, every stage
runs its padded slots (pipeline.py), so every chunk costs as much as the longest.
"""

import dataclasses
import math

import numpy as np

from angel_jax.config import ConfigError
from angel_jax.family import DecoderShape
from angel_jax.mesh import CONTEXT, PIPELINE, TENSOR
from angel_jax.metrics import peak_tflops
from angel_jax.parallel.pipeline import IDLE, Schedule, StageLayout, make_schedule
from angel_jax.planning.activations import auto_order, layer_flops
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.memory import per_device_widths, saved_values, state_bytes_per_param
from angel_jax.remat import REMATS, has_attention_results, kept

ASSUMED_MFU = 0.4  # For the predicted times: a share of the device's peak FLOP/s.


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    layout: StageLayout
    schedule: Schedule
    remat: str
    forward_flops: np.ndarray  # (chunks,) per microbatch and device.
    backward_flops: np.ndarray  # (chunks,)
    memory_bytes: np.ndarray  # (stages,) per device.
    peak_tflops: float | None
    # Per device, the most of any stage: the residuals of the microbatches in flight and the
    # logits (memory_bytes less the model states). The ZeRO-Cache planner's activations.
    activation_bytes: float

    def stage_busy_flops(self) -> np.ndarray:
        """(stages,) the FLOPs each stage computes in a step."""
        p, m = self.schedule.stages, self.schedule.microbatches
        per_chunk = (self.forward_flops + self.backward_flops) * m
        return per_chunk.reshape(-1, p).sum(axis=0)

    def step_flops(self) -> float:
        """The step's critical path in FLOPs (see `critical_path`)."""
        return critical_path(self.schedule, self.forward_flops, self.backward_flops)

    def _ms(self, flops: float) -> str:
        if not self.peak_tflops:
            return "-"
        return f"{flops / (self.peak_tflops * 1e12 * ASSUMED_MFU) * 1e3:.1f}"

    def table(self) -> str:
        p, v = self.schedule.stages, self.schedule.virtual
        rows = [("stage", "layers", "GFLOP/step", "busy ms", "memory GiB")]
        chunks = np.asarray(self.layout.layers_per_chunk).reshape(v, p)
        busy = self.stage_busy_flops()
        for s in range(p):
            rows.append(
                (
                    str(s) + (" +embed" if s == 0 else "") + (" +head" if s == p - 1 else ""),
                    "+".join(str(n) for n in chunks[:, s]),
                    f"{busy[s] / 1e9:.1f}",
                    self._ms(busy[s]),
                    f"{self.memory_bytes[s] / 2**30:.2f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        sched = self.schedule
        lines.append(
            f"schedule {sched.name}: {p} stages x {v} virtual, {sched.microbatches} "
            f"microbatches, {sched.ticks} ticks, bubble {sched.bubble():.3f}, "
            f"{sched.slots} microbatches kept per stage, remat {self.remat}, step "
            f"{self._ms(self.step_flops())} ms predicted (at {ASSUMED_MFU:.0%} of peak)"
        )
        return "\n".join(line.rstrip() for line in lines)


def layer_forward_flops(
    cfg: DecoderShape, seq_len: int, remat: str, mesh_shape: dict[str, int]
) -> tuple[float, float]:
    """(forward FLOPs of one layer per token, what `remat` recomputes of it in a backward)."""
    matmul, attention = layer_flops(cfg, seq_len)
    share_attention, share_matmul = REMATS[effective_remat(cfg, remat, mesh_shape)].recompute
    return matmul + attention, share_attention * attention + share_matmul * matmul


def effective_remat(cfg: DecoderShape, remat: str, mesh_shape: dict[str, int]) -> str:
    """What `remat` keeps in a stage on a mesh of `mesh_shape`."""
    return kept(remat, has_attention_results(cfg.attention, mesh_shape[CONTEXT]))


def critical_path(schedule: Schedule, forward: np.ndarray, backward: np.ndarray) -> float:
    """A step's time in FLOPs when chunk k's F costs forward[k] and its B backward[k]: each
    tick's F phase lasts as long as its costliest F, its B phase likewise (each phase ends in a
    ppermute that every stage joins)."""
    total = 0.0
    stage = np.arange(schedule.stages)[None, :]
    for table, cost in ((schedule.forward, forward), (schedule.backward, backward)):
        chunk = table[..., 1] * schedule.stages + stage
        total += np.where(table[..., 0] != IDLE, cost[chunk], 0.0).max(axis=1).sum()
    return float(total)


def balance_layers(num_layers: int, chunks: int, cost) -> tuple[int, ...]:
    """Layers per chunk (each at least one) minimising `cost(counts)`. The first and last
    chunks differ from the rest (the embedding, the head and the loss), so their counts are
    searched and the chunks between share the other layers evenly. Ties go to the split whose
    largest chunk is smallest (less padding)."""
    if chunks == 1:
        return (num_layers,)
    best_key, best = None, None
    for n_first in range(1, num_layers - chunks + 2):
        for n_last in range(1, num_layers - n_first - (chunks - 2) + 1):
            middle = num_layers - n_first - n_last
            if chunks == 2 and middle:
                continue
            counts = (n_first, *(even_layers(middle, chunks - 2) if chunks > 2 else ()), n_last)
            key = (cost(counts), max(counts))
            if best_key is None or key < best_key:
                best_key, best = key, counts
    return best


def even_layers(num_layers: int, chunks: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, chunks)
    return tuple(base + (i < extra) for i in range(chunks))


def given_layers(text: str, num_layers: int, chunks: int) -> tuple[int, ...]:
    """config.pipeline.balance as an explicit split, e.g. "12,10"."""
    counts = tuple(int(n) for n in text.split(","))
    if len(counts) != chunks or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(
            f"config.pipeline.balance={text!r}: give {chunks} positive layer counts (one per "
            f"chunk, stage-major) adding up to config.model.num_layers={num_layers}, or use "
            "auto or even"
        )
    return counts


def make_pipeline_plan(inp: PlanInput, cfg: DecoderShape) -> PipelinePlan:
    """The plan for config.pipeline (`inp.pipeline`) on `inp`'s mesh, for the layers of
    `cfg` (the family's model config); checks the settings."""
    pc, t, mesh_shape = inp.pipeline, inp.train, inp.mesh
    p, v, m = mesh_shape[PIPELINE], pc.virtual_stages, pc.microbatches
    chunks = p * v
    unsupported = {
        "config.train.microbatches": (
            t.microbatches,
            1,
            "the pipeline's microbatches are config.pipeline.microbatches",
        ),
        "config.offload.policy": (
            inp.offload.policy,
            "none",
            "offload is not built for pipeline stages",
        ),
        "config.model.num_experts": (
            cfg.num_experts,
            0,
            "mixture-of-experts layers are not built for pipeline stages",
        ),
        "config.model.scan_layers": (cfg.scan_layers, True, "stages stack their layers"),
        "config.model.logits_chunks": (
            cfg.logits_chunks,
            1,
            "the last stage computes one microbatch's logits at a time already",
        ),
    }
    for name, (value, needed, why) in unsupported.items():
        if value != needed:
            raise ConfigError(
                f"{name}={value} with config.mesh.pipeline={p}: {why}; set {name}={needed}"
            )
    if cfg.num_layers < chunks:
        raise ConfigError(
            f"config.model.num_layers={cfg.num_layers} is fewer than config.mesh.pipeline x "
            f"config.pipeline.virtual_stages = {chunks} chunks; every chunk needs a layer: "
            "lower one of them"
        )
    schedule = make_schedule(pc.schedule, p, m, v)
    others = math.prod(n for a, n in mesh_shape.items() if a != PIPELINE)
    tokens = t.batch_size // m * t.seq_len / others  # Per microbatch and device.
    budget = inp.device_limit
    if pc.remat == "auto":
        results = has_attention_results(cfg.attention, mesh_shape[CONTEXT])
        options = auto_order(results, *layer_flops(cfg, t.seq_len))
    else:
        options = (pc.remat,)
    plans = [_plan(inp, cfg, schedule, tokens, r) for r in options]
    fitting = [plan for plan in plans if plan.memory_bytes.max() <= budget]
    return fitting[0] if fitting else plans[-1]


def _plan(inp: PlanInput, cfg, schedule, tokens, remat) -> PipelinePlan:
    p, v = schedule.stages, schedule.virtual
    chunks, mesh_shape = p * v, inp.mesh
    layer, recompute = (
        tokens * f for f in layer_forward_flops(cfg, inp.train.seq_len, remat, mesh_shape)
    )
    head = tokens * (2 * cfg.d_model * cfg.vocab_size + 5 * cfg.vocab_size)

    # With `context` split every stage runs its padded slots too (pipeline.py): every chunk
    # then costs as many layers as the longest, and the even split is as good as any.
    uniform = mesh_shape[CONTEXT] > 1

    def chunk_flops(counts):
        """(F, B) FLOPs per chunk and microbatch: a layer's F is a forward, its B the
        backward (2 forwards) and the remat's recompute; the last chunk's F adds the head's
        forward, its B the head's forward again and its backward."""
        n = np.asarray([max(counts)] * len(counts) if uniform else counts, np.float64)
        forward = n * layer
        forward[-1] += head
        backward = n * (2 * layer + recompute)
        backward[-1] += 3 * head
        return forward, backward

    if inp.pipeline.balance == "auto":
        counts = balance_layers(
            cfg.num_layers, chunks, lambda c: critical_path(schedule, *chunk_flops(c))
        )
    elif inp.pipeline.balance == "even":
        counts = even_layers(cfg.num_layers, chunks)
    else:
        counts = given_layers(inp.pipeline.balance, cfg.num_layers, chunks)
    forward, backward = chunk_flops(counts)
    layout = StageLayout(p, v, tuple(counts))
    states, activations = _memory_bytes(inp, cfg, schedule, layout, tokens, remat)
    return PipelinePlan(
        layout,
        schedule,
        remat,
        forward,
        backward,
        states + activations,
        peak_tflops(inp.train.peak_tflops),
        float(activations.max()),
    )


def _memory_bytes(
    inp: PlanInput, cfg, schedule, layout, tokens, remat
) -> tuple[np.ndarray, np.ndarray]:
    """(stages,) estimated bytes per device of (the model states, the activations); `tokens`
    are a microbatch's per device of the work (split over `tensor` too), so a device holds
    the activations of tokens x tensor."""
    p, v, mesh_shape = schedule.stages, schedule.virtual, inp.mesh
    tp = mesh_shape[TENSOR]
    rows = tokens * tp
    # fp32 masters, the grad accumulators and AdamW moments, ZeRO-split.
    per_param = state_bytes_per_param(inp.zero_stage, inp.zero_ranks)
    layer_params = cfg.layer_matmul_params()  # A dense layer's (pipelines take no experts).
    shared = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    # A B's grads of the embedding and head, before they join their accumulator.
    state = (layout.slots * v * layer_params + shared) * per_param / tp + shared * 4 / tp
    dtype_bytes = np.dtype(cfg.dtype).itemsize
    widths = per_device_widths(
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.ffn_dim,
        tp,
        inp.model.sequence_parallel,
    )
    d = widths[0]
    saved, _ = saved_values(effective_remat(cfg, remat, mesh_shape), widths)
    # Per slot: a chunk's layer slots' residuals and the head's input; one slot more for the
    # copies in flight (an F's new residuals before they go into the buffer, a B's slot).
    per_slot = rows * (layout.slots * saved + d) * dtype_bytes
    residuals = (schedule.slots + 1) * per_slot
    logits = rows * cfg.vocab_size / tp * 4 * 2  # fp32 logits and their grad, in a B.
    return np.full(p, state), np.full(p, residuals + logits)
