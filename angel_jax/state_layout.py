"""The train state's layout: its parts (`TrainState`), their shapes, and where each lives
(ZeRO shardings over the mesh, host memory or SSD for what the ZeRO-Cache planner offloads,
PowerSGD's factors), decided once from the config, the mesh and the params' shapes."""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from angel_jax.config import ConfigError
from angel_jax.offload.cpu import CPUTier, measure_rates
from angel_jax.offload.ssd import SSDTier
from angel_jax.offload.state import OffloadedState, host_layout
from angel_jax.offload.stream import StreamedUpdate
from angel_jax.optim import Optimizer
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.memory import zero_splits
from angel_jax.planning.placement import make_plan
from angel_jax.planning.plan import Plan
from angel_jax.planning.tiers import CPU, HOST, SSD


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # float32 masters.
    opt_state: Any
    # A compute-dtype copy when the masters live in host memory (ZeRO-Cache): on the device,
    # or with layer streaming its layers in host memory; derived from `params`, so checkpoints
    # leave it out.
    compute_params: Any = None
    # PowerSGD's state (config.train.powersgd_rank): per weight, Q and each replica's error.
    comm: Any = None


@dataclasses.dataclass(frozen=True)
class StateLayout:
    abstract_state: TrainState  # ShapeDtypeStructs with shardings, e.g. for restoring.
    state_sharding: TrainState  # Of NamedShardings.
    grad_sharding: Any
    batch_sharding: NamedSharding
    plan: Plan
    stacked: Any  # Like the params, of bools: stacked over layers (a leading "layers" axis).
    # The optimizer update of offloaded states, run after the jitted forward/backward step.
    streamed_update: StreamedUpdate | None = None
    # The offloaded states' layout and SSD tier, with plan.offloads_optimizer.
    offloaded: OffloadedState | None = None
    powersgd: PowerSGD | None = None  # Compressed data-parallel averaging of the grads.


def _largest_path(abstract_params):
    """The key path of the largest parameter (a weight matrix: the hybrid update's kind)."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    return max(leaves, key=lambda leaf: leaf[1].size)[0]


def _offloaded_layout(
    config, optimizer, plan: Plan, stacked, abstract_params, abstract_opt, shardings
) -> tuple:
    """The offloaded states' layout (`offload.state.host_layout`), its SSD and host-core tiers
    and the streamed update, for `plan` (which offloads the optimizer): (compute sharding,
    abstract compute params, abstract params, abstract optimizer state, param sharding,
    optimizer state sharding, SSD tier, CPU tier, streamed update). `shardings`: the params',
    the offloaded masters' and the optimizer state's."""
    param_sharding, offloaded_master_sharding, opt_sharding = shardings
    ssd = None
    dtype = jnp.dtype(config.model.dtype)
    # Streamed layers' compute copy lives in host memory.
    compute_sharding = jax.tree.map(
        lambda s, is_stacked: s.with_memory_kind(HOST) if is_stacked and plan.streams_params else s,
        param_sharding,
        stacked,
    )
    abstract_compute = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), abstract_params)
    abstract_params, abstract_opt, param_sharding, opt_sharding, chunks = host_layout(
        abstract_params, abstract_opt, offloaded_master_sharding, opt_sharding, stacked, plan
    )
    on_disk = [c for c in chunks if c.tier == SSD]
    if on_disk:
        if jax.process_count() > 1:
            raise ConfigError(
                "config.offload.ssd_dir: the SSD tier runs in one process only for now; "
                "leave it empty on multi-process runs"
            )
        ssd = SSDTier(config.offload.ssd_dir, config.offload.ssd_compress, on_disk)
    on_cpu = [c for c in chunks if c.tier == CPU]
    cpu = CPUTier(optimizer, on_cpu, jnp.dtype(config.model.dtype)) if on_cpu else None
    update = StreamedUpdate(
        optimizer,
        chunks,
        config.offload.chunks_in_flight,
        ssd,
        cpu,
        # Beside the in-step update it only redoes a speculated one (steps.InStepUpdate),
        # after which nothing may stay on its way home: no step after it sends it off.
        beside_step=plan.copies_beside_step and not config.offload.update_in_step,
        slot_bytes=plan.slot_bytes,
    )
    return (
        compute_sharding,
        abstract_compute,
        abstract_params,
        abstract_opt,
        param_sharding,
        opt_sharding,
        ssd,
        cpu,
        update,
    )


def make_state_layout(
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    inp: PlanInput,
    rules: sharding.Rules,
    boxed_params: Any,
    optimizer: Optimizer,
    to_stages=None,
    inputs_offloadable: bool = False,
    extra_activations: dict[tuple[bool, str], int] | None = None,
    pipeline=None,
) -> StateLayout:
    """The layout of the state around params of these (logically boxed) shapes, with the
    ZeRO-Cache plan made from `inp` (`planning.placement.make_plan`); `to_stages` (the
    pipeline's) reorders the stacked layers stage by stage; `inputs_offloadable`: the planner
    may keep the layers' inputs in host memory; `extra_activations` and `pipeline`:
    `make_plan`'s."""
    logical = sharding.logical_axes(boxed_params)
    abstract_params = flax.linen.meta.unbox(boxed_params)
    if to_stages:  # Stored stage by stage.
        abstract_params["layers"] = jax.eval_shape(
            lambda x: jax.tree.map(to_stages, x), abstract_params["layers"]
        )
    stacked = jax.tree.map(lambda names: tuple(names[:1]) == ("layers",), logical)
    abstract_opt = jax.eval_shape(lambda p: optimizer.init(p, stacked), abstract_params)

    stage = config.zero_stage
    specs = lambda state: sharding.state_specs(
        logical, abstract_params, mesh, rules, zero_splits(state, stage)
    )
    # State shaped like its parameter (moments) takes its (ZeRO) layout; the rest (step
    # counts, factored moments) is small and replicated. Grads and optimizer state are the
    # trained params' (`Optimizer.trained`: under LoRA the adapters').
    trained = optimizer.trained
    opt_specs = jax.tree.map(
        lambda spec, p, leaf_state: jax.tree.map(
            lambda x: spec if x.shape == p.shape else P(), leaf_state
        ),
        trained(specs("optimizer state")),
        trained(abstract_params),
        abstract_opt,
    )
    param_sharding = sharding.named(mesh, specs("params"))
    grad_sharding = sharding.named(mesh, trained(specs("grads")))
    # Offloaded masters are updated where their optimizer state is: in its ZeRO layout.
    offloaded_master_sharding = sharding.named(mesh, specs("optimizer state"))
    opt_sharding = sharding.named(mesh, opt_specs)
    plan = make_plan(
        inp,
        params=sharding.with_shardings(abstract_params, param_sharding),
        grads=sharding.with_shardings(trained(abstract_params), grad_sharding),
        offloaded_masters=trained(
            sharding.with_shardings(abstract_params, offloaded_master_sharding)
        ),
        opt=sharding.with_shardings(abstract_opt, opt_sharding),
        stacked=stacked,
        inputs_offloadable=inputs_offloadable,
        extra_activations=extra_activations,
        pipeline=pipeline,
        measure_rates=lambda: measure_rates(
            optimizer, _largest_path(abstract_params), jnp.dtype(config.model.dtype)
        ),
    )
    compute_sharding = abstract_compute = ssd = cpu = update = None
    if plan.offloads_optimizer:
        shardings = (param_sharding, offloaded_master_sharding, opt_sharding)
        (
            compute_sharding,
            abstract_compute,
            abstract_params,
            abstract_opt,
            param_sharding,
            opt_sharding,
            ssd,
            cpu,
            update,
        ) = _offloaded_layout(
            config, optimizer, plan, stacked, abstract_params, abstract_opt, shardings
        )
    powersgd = abstract_comm = comm_sharding = None
    if config.train.powersgd_rank:
        powersgd = PowerSGD(config.train.powersgd_rank)
        replicas = mesh.shape["data"]
        abstract_comm = jax.eval_shape(
            lambda: powersgd.init(abstract_params, stacked, replicas, jax.random.key(0))
        )
        # Q is the replicas' common factor; the errors are each replica's own.
        comm_sharding = jax.tree.map(
            lambda s: (NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
            abstract_comm,
            is_leaf=lambda s: isinstance(s, tuple),
        )
    state_sharding = TrainState(
        NamedSharding(mesh, P()), param_sharding, opt_sharding, compute_sharding, comm_sharding
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    abstract_state = sharding.with_shardings(
        TrainState(scalar, abstract_params, abstract_opt, abstract_compute, abstract_comm),
        state_sharding,
    )
    offloaded = None
    if plan.offloads_optimizer:
        dtype = jnp.dtype(config.model.dtype)
        offloaded = OffloadedState(
            stacked, optimizer, state_sharding, dtype, ssd, cpu, plan.split_masters
        )
    return StateLayout(
        abstract_state=abstract_state,
        state_sharding=state_sharding,
        grad_sharding=grad_sharding,
        batch_sharding=NamedSharding(mesh, sharding.logical_to_spec(("batch", None), rules)),
        plan=plan,
        stacked=stacked,
        streamed_update=update,
        offloaded=offloaded,
        powersgd=powersgd,
    )
