"""What planning reads, made once from the config and the mesh (`plan_input`): the model's
shape, the batch, the mesh's sizes, the tiers' budgets and the policies. The planners take a
`PlanInput`, never the whole config; the plan then hands the model its settings in one step
(`model_settings`).
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from angel_jax import machine
from angel_jax.config import head_dim
from angel_jax.kernels import resolve_attention
from angel_jax.mesh import zero_axes
from angel_jax.planning import tiers


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """config.model's settings the planners read; `attention` resolved for the backend."""

    family: str
    dtype: str
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # Resolved: d_model // num_heads where config.model.head_dim is 0.
    ffn_dim: int
    num_layers: int
    vocab_size: int
    num_experts: int
    moe_ffn_dim: int
    experts_per_token: int
    shared_experts: int
    router: str
    sequence_parallel: bool
    logits_chunks: int
    mlp_chunks: int
    scan_layers: bool
    remat: str  # config.model.remat: a policy, or auto.
    attention: str
    # config.model.lora.rank: > 0, only the adapters train (grads and optimizer state are
    # theirs alone, angel_jax/lora.py); 0, every param.
    lora_rank: int = 0


@dataclasses.dataclass(frozen=True)
class Train:
    """config.train's and config.monitor's settings the planners read."""

    batch_size: int
    microbatches: int
    seq_len: int
    steps: int
    grad_clip: float
    peak_tflops: float
    on_anomaly: str


@dataclasses.dataclass(frozen=True)
class Offload:
    """config.offload's policies (docs/zero-cache.md)."""

    policy: str
    activations: str
    chunks_in_flight: int
    split_masters: bool
    ssd_dir: str
    ssd_compress: bool
    cpu_update: float
    delayed_update: bool
    update_in_step: bool
    speculative_update: bool
    device_gib: float  # Set (> 0): a budget for another machine's device, on a CPU in tests.


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """config.pipeline's settings (the stage planner's)."""

    schedule: str
    microbatches: int
    virtual_stages: int
    remat: str
    balance: str


@dataclasses.dataclass(frozen=True)
class PlanInput:
    model: ModelShape
    # The family's model config (a `family.DecoderShape`): its layers' FLOPs.
    decoder: Any
    train: Train
    offload: Offload
    pipeline: Pipeline
    zero_stage: int
    mesh: Mapping[str, int]  # Axis -> size.
    zero_ranks: int  # The devices ZeRO splits a state over (`mesh.zero_axes`).
    processes: int  # jax.process_count(): the hybrid update and the pinned pool are per process.
    budget: Mapping[str, int]  # Tier -> bytes per device (`tiers.measured_budget`).
    # The stage planner's device budget: config.offload.device_gib, else the device's limit.
    device_limit: float
    # Whether the family gives the pieces of a decoder with unrolled layers (`family.Pieces`).
    has_pieces: bool

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def local_devices(self) -> int:
        return max(1, self.devices // self.processes)


def plan_input(
    config: ml_collections.ConfigDict,
    mesh,
    decoder: Any = None,
    budget: Mapping[str, int] | None = None,
) -> PlanInput:
    """The planners' input for `config` on `mesh` (a Mesh, or its axes' sizes): `decoder` the
    family's model config (made here if None), `budget` the tiers' (measured here,
    `tiers.measured_budget`, if None)."""
    sizes = dict(mesh.shape if hasattr(mesh, "shape") else mesh)
    from angel_jax.models import family_of  # The registry; planning sits above the models.

    m, t, o, p = config.model, config.train, config.offload, config.pipeline
    family = family_of(m)
    if decoder is None:
        decoder = family.make_config(m, machine.backend())
    model = ModelShape(
        family=m.family,
        dtype=m.dtype,
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=head_dim(m),
        ffn_dim=m.ffn_dim,
        num_layers=m.num_layers,
        vocab_size=m.vocab_size,
        num_experts=m.num_experts,
        moe_ffn_dim=m.moe_ffn_dim,
        experts_per_token=m.experts_per_token,
        shared_experts=m.shared_experts,
        router=m.router,
        sequence_parallel=m.sequence_parallel,
        logits_chunks=m.logits_chunks,
        mlp_chunks=m.mlp_chunks,
        scan_layers=m.scan_layers,
        remat=m.remat,
        attention=resolve_attention(m, machine.backend()),
        lora_rank=m.lora.rank,
    )
    return PlanInput(
        model=model,
        decoder=decoder,
        train=Train(
            t.batch_size,
            t.microbatches,
            t.seq_len,
            t.steps,
            t.grad_clip,
            t.peak_tflops,
            config.monitor.on_anomaly,
        ),
        offload=Offload(
            o.policy,
            o.activations,
            o.chunks_in_flight,
            o.split_masters,
            o.ssd_dir,
            o.ssd_compress,
            o.cpu_update,
            o.delayed_update,
            o.update_in_step,
            o.speculative_update,
            o.device_gib,
        ),
        pipeline=Pipeline(p.schedule, p.microbatches, p.virtual_stages, p.remat, p.balance),
        zero_stage=config.zero_stage,
        mesh=sizes,
        zero_ranks=math.prod(sizes[a] for a in zero_axes(sizes, config.fp8.collectives)),
        processes=machine.process_count(),
        budget=dict(
            tiers.measured_budget(config, math.prod(sizes.values())) if budget is None else budget
        ),
        device_limit=_device_limit(o.device_gib),
        has_pieces=family.pieces is not None,
    )


def _device_limit(device_gib: float) -> float:
    if device_gib > 0:
        return device_gib * 2**30
    stats = jax.local_devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", math.inf))


def model_settings(fp8: Mapping[str, bool], plan) -> dict:
    """What the plan (`plan.Plan`) hands the family's model config, in one
    `dataclasses.replace`: the FP8 switches where any is on (`fp8`), the remat policy, and
    layer streaming and the layer inputs in host memory where the plan takes them."""
    settings = dict(fp8) if any(fp8.values()) else {}
    settings["remat"] = plan.remat
    if plan.streams_params:
        settings["stream_params"] = True
    if plan.layer_inputs_on_host:
        settings["layer_input_on_host"] = True
    return settings
