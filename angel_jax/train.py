"""The train step and the objects around it, built once from a config and a mesh.

`build(config, mesh)` gives an `Experiment`: the model, optimizer, every sharding, a sharded
`init_state` and the jitted `train_step`. It is what the launcher runs and what a notebook or a
test imports.
"""

import dataclasses
import functools
import pathlib
import signal
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import kernels, sharding
from angel_jax.config import ConfigError, objective, validate
from angel_jax.data.objectives import row_width
from angel_jax.losses import chunked_cross_entropy, cross_entropy, objective_loss
from angel_jax.models import family_of
from angel_jax.monitor import Stopped, StopRequest, skip_if_anomalous
from angel_jax.offload.planner import HOST, SSD, Plan, check_compiled, make_plan
from angel_jax.offload.ssd import SSDTier
from angel_jax.offload.state import OffloadedState, host_layout
from angel_jax.offload.stream import (
    Space,
    StreamedUpdate,
    fetch_f32,
    global_norm,
    layer_chunks,
    pipelined,
    regroup,
)
from angel_jax.optim import Optimizer, learning_rate_schedule, make_optimizer
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.parallel.attention import zigzag_order
from angel_jax.parallel.pipeline import StageFunctions, pipeline_grads
from angel_jax.parallel.stage_plan import PipelinePlan, make_pipeline_plan


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


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict
    mesh: Mesh
    rules: sharding.Rules
    model_config: Any  # The family's (angel_jax/family.py), from config.model.
    model: nn.Module
    optimizer: Optimizer
    state_sharding: TrainState  # Of NamedShardings.
    grad_sharding: Any
    batch_sharding: NamedSharding
    abstract_state: TrainState  # ShapeDtypeStructs with shardings, e.g. for restoring.
    plan: Plan
    stacked: Any  # Like the params, of bools: stacked over layers (a leading "layers" axis).
    # The optimizer update of offloaded states, run after the jitted forward/backward step.
    streamed_update: StreamedUpdate | None = None
    # The offloaded states' layout and SSD tier, with plan.offloads_optimizer.
    offloaded: OffloadedState | None = None
    # With config.mesh.pipeline > 1: the stages' layers, schedule and remat; the stacked
    # layers are then stored stage by stage (`pipeline.layout`).
    pipeline: PipelinePlan | None = None
    powersgd: PowerSGD | None = None  # Compressed data-parallel averaging of the grads.

    def init_state(self, seed: int | None = None) -> TrainState:
        """Initialises the state directly in its sharded layout."""
        rng = jax.random.key(self.config.seed if seed is None else seed)
        if self.config.init_from_hf:
            return self._init_from_hf(rng)
        # No activation rules: the init's forward pass (one row, only for the params' shapes)
        # need not be laid out, and one row cannot be split over `data`.
        if not self.offloaded:
            return jax.jit(self._init, out_shardings=self.state_sharding)(rng)
        return TrainState(*self.offloaded.init(self._init_params, rng))

    def _init_params(self, rng):
        tokens = jnp.zeros((1, self.config.train.seq_len), jnp.int32)
        inputs = family_of(self.config.model).example_inputs(tokens)
        params = nn.meta.unbox(self.model.init(rng, *inputs)["params"])
        if self.pipeline:
            params["layers"] = jax.tree.map(self.pipeline.layout.to_stages, params["layers"])
        return params

    def _init_from_hf(self, rng) -> TrainState:
        """The state around params imported from config.init_from_hf, each loaded straight
        into its sharding (validate limits this to the plain layout: no pipeline, no offload)."""
        from angel_jax.interop import load_params

        params = load_params(
            self.config.init_from_hf,
            self.abstract_state.params,
            self.state_sharding.params,
            "config.init_from_hf",
        )
        init = jax.jit(self._init, out_shardings=self.state_sharding, donate_argnums=1)
        return init(rng, params)

    def _init(self, rng, params=None) -> TrainState:
        params = self._init_params(rng) if params is None else params
        comm = None
        if self.powersgd:
            replicas = self.mesh.shape["data"]
            comm = self.powersgd.init(params, self.stacked, replicas, jax.random.fold_in(rng, 1))
        return TrainState(
            jnp.zeros((), jnp.int32), params, self.optimizer.init(params, self.stacked), None, comm
        )

    @property
    def ssd(self) -> SSDTier | None:
        """Update chunks on disk (ZeRO-Cache's third tier), if any."""
        return self.offloaded.ssd if self.offloaded else None

    def params_numpy(self, state: TrainState):
        """The fp32 master params as numpy arrays in the model's layout, whatever the policy."""
        if self.offloaded:
            return self.offloaded.params_numpy(state.params)
        return jax.device_get(state.params)

    def checkpointed(self, state: TrainState) -> TrainState:
        """What checkpoints hold: the state, less what offloaded states derive and with their SSD
        chunks in (`OffloadedState.checkpointed`)."""
        return self.offloaded.checkpointed(state) if self.offloaded else state

    def checkpoint_target(self) -> TrainState:
        """The abstract `checkpointed` state to restore into."""
        if self.offloaded:
            return self.offloaded.checkpoint_target(self.abstract_state)
        return self.abstract_state

    def from_checkpointed(self, state: TrainState) -> TrainState:
        """Re-derives what `checkpointed` left out (`OffloadedState.from_checkpointed`)."""
        return self.offloaded.from_checkpointed(state) if self.offloaded else state

    def _inputs_and_targets(self, tokens_BT1: jax.Array):
        inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        if self.mesh.shape["context"] > 1:  # Ring attention's zigzag order (a mean is blind
            # to the order of its terms).
            order = zigzag_order(inputs_BT.shape[1], self.mesh.shape["context"])
            inputs_BT, targets_BT = inputs_BT[:, order], targets_BT[:, order]
        return inputs_BT, targets_BT

    def loss(self, params, tokens_BT1: jax.Array):
        if objective(self.config) != "causal" or self.config.data.packing:
            # Rows of the objective's fields (data/objectives.py), not plain token windows.
            loss, metrics, variables = objective_loss(self.model, self.config, params, tokens_BT1)
            return self._with_router_losses(loss, metrics, variables)
        inputs_BT, targets_BT = self._inputs_and_targets(tokens_BT1)
        z_loss, chunks = self.config.train.z_loss, self.model_config.logits_chunks
        if chunks > 1:
            h_BTD, moe = self.model.apply(
                {"params": params}, inputs_BT, hidden=True, mutable="intermediates"
            )
            lm_head = family_of(self.config.model).pieces.lm_head(self.model_config, params)
            loss, metrics = chunked_cross_entropy(h_BTD, lm_head, targets_BT, z_loss, chunks)
            return self._with_router_losses(loss, metrics, moe)
        logits, moe = self.model.apply({"params": params}, inputs_BT, mutable="intermediates")
        loss, metrics = cross_entropy(logits, targets_BT, z_loss)
        return self._with_router_losses(loss, metrics, moe)

    def _with_router_losses(self, loss, metrics, variables):
        """Adds a mixture of experts' router losses (weighted) to the loss, and to the metrics
        their values and the share of dropped assignments, averaged over the layers."""
        if not self.model_config.num_experts:
            return loss, metrics
        (stats,) = variables["intermediates"]["moe"]
        m = self.config.model
        z, balance = jnp.mean(stats["router_z_loss"]), jnp.mean(stats["load_balance_loss"])
        assignments = jnp.sum(stats["expert_load"])
        metrics.update(
            router_z_loss=z,
            load_balance_loss=balance,
            dropped_fraction=jnp.sum(stats["dropped"]) / jnp.maximum(assignments, 1.0),
        )
        return loss + m.router_z_loss * z + m.load_balance_loss * balance, metrics

    def loss_and_grads(self, params, batch_BT1: jax.Array):
        """Mean loss, metrics and grads over the batch. Grads come in the params' dtype, or
        float32 when accumulated over microbatches; streamed layers' grads in host memory
        (stacked, or one array per layer when accumulated)."""
        if self.pipeline:
            return self._pipeline_loss_and_grads(params, batch_BT1)
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        micro = self.config.train.microbatches
        if micro == 1:
            (_, metrics), grads = grad_fn(params, batch_BT1)
            return metrics, self._constrain_grads(grads)
        # Microbatch j takes rows j, j + micro, ...: each device keeps its own rows.
        rows, length = batch_BT1.shape
        micro_MBT = batch_BT1.reshape(rows // micro, micro, length).swapaxes(0, 1)

        def accumulate(acc, mb):
            (_, metrics), grads = grad_fn(params, mb)
            acc_metrics, acc_grads = acc
            grads = self._accumulate(acc_grads, self._constrain_grads(grads), 1.0 / micro)
            return (jax.tree.map(jnp.add, acc_metrics, metrics), grads), None

        shapes = jax.eval_shape(lambda: self.loss(params, micro_MBT[0])[1])
        metrics0 = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), shapes)
        (metrics, grads), _ = jax.lax.scan(accumulate, (metrics0, self._zero_grads()), micro_MBT)
        return jax.tree.map(lambda m: m / micro, metrics), grads

    def _pipeline_loss_and_grads(self, params, batch_BT1: jax.Array):
        """`loss_and_grads` through the pipeline's schedule, microbatch j taking rows j,
        j + m, ... (float32 grads)."""
        inputs_BT, targets_BT = self._inputs_and_targets(batch_BT1)
        m = self.config.pipeline.microbatches
        micro = lambda x_BT: x_BT.reshape(x_BT.shape[0] // m, m, -1).swapaxes(0, 1)
        cfg, z_loss = self.model_config, self.config.train.z_loss
        pieces = family_of(self.config.model).pieces

        def head_loss(shared, h_BTD, targets_BT):
            h_BTD = pieces.final_norm(cfg, shared, h_BTD)
            logits = pieces.lm_head(cfg, shared)(h_BTD).astype(jnp.float32)
            logits = sharding.constrain(logits, ("batch", "length", "vocab"))
            return cross_entropy(logits, targets_BT, z_loss, one_hot=True)

        fns = StageFunctions(
            functools.partial(pieces.embed, cfg), functools.partial(pieces.layer, cfg), head_loss
        )
        shared = {name: p for name, p in params.items() if name != "layers"}
        metrics, layer_grads, shared_grads = pipeline_grads(
            self.pipeline.schedule,
            self.pipeline.layout,
            fns,
            self.mesh,
            params["layers"],
            shared,
            micro(inputs_BT),
            micro(targets_BT),
            sharding.active_spec(("batch", "norm_length", "embed")),
            jax.tree.map(lambda s: s.spec, self.grad_sharding),
        )
        metrics.pop("objective")
        return metrics, self._constrain_grads({**shared_grads, "layers": layer_grads})

    @functools.cached_property
    def streamed(self):
        """Like `self.stacked`: the weights whose compute copy and grads live in host memory."""
        return jax.tree.map(lambda s: s and self.plan.streams_params, self.stacked)

    def _constrain_grads(self, grads):
        """Grads (or their float32 sums) in the ZeRO grad layout; streamed layers' are left
        where they are, in host memory in their params' layout (and per layer when summed)."""
        # The shardings' tree is a prefix of `grads`, whose summed streamed leaves are tuples.
        return jax.tree.map(
            lambda s, host, g: g if host else jax.lax.with_sharding_constraint(g, s),
            self.grad_sharding,
            self.streamed,
            grads,
        )

    def _zero_grads(self):
        """Float32 zeros to accumulate grads into; a streamed weight's one per layer on host."""

        def zeros(p, host):
            if not host:
                return jnp.zeros(p.shape, jnp.float32)
            layer = jnp.zeros(p.shape[1:], jnp.float32)
            return tuple(jax.device_put(layer, Space.Host) for _ in range(p.shape[0]))

        abstract = self.abstract_state.compute_params
        if abstract is None:
            abstract = self.abstract_state.params
        return self._constrain_grads(jax.tree.map(zeros, abstract, self.streamed))

    def _accumulate(self, acc, grads, scale: float):
        """acc + scale * grads in float32; streamed layers' sums stay in host memory, a layer
        at a time on the device."""
        if not self.plan.streams_params:
            return self._constrain_grads(
                jax.tree.map(lambda a, g: a + g.astype(jnp.float32) * scale, acc, grads)
            )
        chunks, layers, treedef = layer_chunks(grads, acc, stacked=self.stacked)
        dest = [Space.Host if n else Space.Device for n in layers for _ in range(n or 1)]

        def add(k, g, a):
            return (jax.device_put(fetch_f32(a) + fetch_f32(g) * scale, dest[k]),)

        done = pipelined(add, [c[1:] for c in chunks], self.config.offload.chunks_in_flight)
        return self._constrain_grads(regroup(done, layers, treedef)[0])

    def _train_step(self, state: TrainState, batch_BT1: jax.Array):
        """The whole step, with the masters and optimizer state on the device."""
        comm = state.comm
        if self.powersgd:
            metrics, grads, comm = self._powersgd_grads(state, batch_BT1)
        else:
            metrics, grads = self.loss_and_grads(state.params, batch_BT1)
        params, opt_state, norm = self.optimizer.update(
            grads, state.opt_state, state.params, self.stacked
        )
        metrics.update(grad_norm=norm, lr=learning_rate_schedule(self.config.train)(state.step))
        return TrainState(state.step + 1, params, opt_state, None, comm), metrics

    def _powersgd_grads(self, state: TrainState, batch_BT1: jax.Array):
        """(metrics, grads, new PowerSGD state): each replica's grads on its rows of the batch
        (the mesh has no other split axis), averaged through PowerSGD's low-rank factors
        instead of XLA's all-reduce; exactly before `train.powersgd_start_step` (early grads
        are the least low-rank, as PyTorch's PowerSGD hook also assumes)."""
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        start = self.config.train.powersgd_start_step

        def per_replica(step, params, comm, batch):
            with sharding.no_rules():
                (_, metrics), grads = grad_fn(params, batch)
            compressed = lambda: self.powersgd.average(grads, comm, self.stacked)
            exact = lambda: (jax.lax.pmean(grads, "data"), comm)
            grads, comm = jax.lax.cond(step >= start, compressed, exact)
            return jax.lax.pmean(metrics, "data"), grads, comm

        comm_specs = jax.tree.map(lambda s: s.spec, self.state_sharding.comm)
        return jax.shard_map(
            per_replica,
            mesh=self.mesh,
            in_specs=(P(), P(), comm_specs, P("data")),
            out_specs=(P(), P(), comm_specs),
            check_vma=False,
        )(state.step, state.params, state.comm, batch_BT1)

    def _grad_step(self, step: jax.Array, compute_params, batch_BT1: jax.Array):
        """The jitted part of an offloaded step: (step + 1, grads, their clipping scale,
        metrics). The compute copy gives the same grads as the masters would (the model casts
        them to the compute dtype either way), in the compute dtype."""
        metrics, grads = self.loss_and_grads(compute_params, batch_BT1)
        norm = global_norm(grads, self.stacked, self.config.offload.chunks_in_flight)
        metrics.update(grad_norm=norm, lr=learning_rate_schedule(self.config.train)(step))
        return step + 1, grads, self.optimizer.clip_scale(norm), metrics

    @functools.cached_property
    def grad_step(self):
        """Compiled `_grad_step`: (step, compute params, batch) -> (step + 1, grads, clipping
        scale, metrics)."""
        replicated = NamedSharding(self.mesh, P())
        step = jax.jit(
            self._grad_step,
            in_shardings=(replicated, self.state_sharding.compute_params, self.batch_sharding),
            # Grads stay where `loss_and_grads` put them (streamed layers' in host memory).
            out_shardings=(replicated, None, replicated, replicated),
        )
        state = self.abstract_state
        return self._compile(step, state.step, state.compute_params, self._abstract_batch())

    def _abstract_batch(self):
        t = self.config.train
        # Inputs and, shifted by one, targets; or the objective's fields side by side.
        shape = (t.batch_size, row_width(self.config))
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    def _compile(self, jitted, *abstract_args):
        """Compiles ahead of time, from shapes alone: `train_step` is built before the state
        is allocated, so XLA's GPU autotuner has the device's memory to try kernels in (a
        state filled to the planner's budget leaves it too little: the H200 capacity runs
        failed to compile so). The compiled program's memory is checked against the plan,
        on a CPU too when the budget is the machine's own (its RAM): XLA:CPU's f32 widening of
        bf16 work is then what it will allocate. A device budget set in config.offload on a
        CPU stands for another machine's (tests emulate GPU budgets so), which CPU sizes do
        not tell."""
        with sharding.use_rules(self.mesh, self.rules):
            compiled = jitted.lower(*abstract_args).compile()
        if jax.default_backend() != "cpu" or self.config.offload.device_gib <= 0:
            check_compiled(self.plan, compiled.memory_analysis())
        return compiled

    def apply_streamed_update(self, state: TrainState, step, grads, scale) -> TrainState:
        """The offloaded state after its streamed update with `grads` (`state` is donated)."""
        treedef = jax.tree.structure(self.stacked)
        flat = [
            treedef.flatten_up_to(t)
            for t in (grads, state.params, state.opt_state, state.compute_params)
        ]
        new = self.streamed_update(flat[0], scale, *flat[1:])
        return TrainState(step, *(treedef.unflatten(t) for t in new))

    @functools.cached_property
    def _jitted_train_step(self):
        return jax.jit(
            self._train_step,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, NamedSharding(self.mesh, P())),
            donate_argnums=0,
        )

    def lowered_train_step(self) -> jax.stages.Lowered:
        """The on-device train step lowered from shapes (not compiled): its StableHLO holds
        the program as JAX wrote it (dtypes of every dot, before XLA's rewrites)."""
        if self.plan.offloads_optimizer:
            raise ConfigError("lowered_train_step: the offloaded step is not one program")
        with sharding.use_rules(self.mesh, self.rules):
            return self._jitted_train_step.lower(self.abstract_state, self._abstract_batch())

    @functools.cached_property
    def train_step(self):
        """(state, batch) -> (state, metrics); the state is donated. With offloaded states, a
        jitted forward/backward step, then the streamed update of every chunk."""
        if not self.plan.offloads_optimizer:
            return self._compile(
                self._jitted_train_step, self.abstract_state, self._abstract_batch()
            )
        grad_step = self.grad_step

        def run(state, batch):
            with sharding.use_rules(self.mesh, self.rules):
                step, grads, scale, metrics = grad_step(state.step, state.compute_params, batch)
                return self.apply_streamed_update(state, step, grads, scale), metrics

        return run

    @functools.cached_property
    def guarded_train_step(self):
        """(state, batch, loss ceiling) -> (state, metrics): `train_step` that drops the update
        of a step whose loss or grad norm is not finite or whose loss is above the ceiling
        (`monitor.skip_if_anomalous`; the step count advances, metrics["skipped"] says it); the
        state is donated. With offloaded states the jitted step's loss and grad norm are read
        on the host (one sync a step) before the streamed update, which is left out when they
        are anomalous."""
        replicated = NamedSharding(self.mesh, P())
        last = {}  # The ceiling's device copy, made again only when it changes.

        def ceiling_array(ceiling: float) -> jax.Array:
            value = np.float32(min(ceiling, np.finfo(np.float32).max))
            if last.get("value") != value:
                with jax.transfer_guard_host_to_device("allow"):  # One scalar, on purpose.
                    last.update(
                        value=value,
                        array=jax.make_array_from_callback((), replicated, lambda _: value),
                    )
            return last["array"]

        if not self.plan.offloads_optimizer:
            jitted = jax.jit(
                skip_if_anomalous(self._train_step),
                in_shardings=(self.state_sharding, self.batch_sharding, replicated),
                out_shardings=(self.state_sharding, replicated),
                donate_argnums=0,
            )
            abstract_ceiling = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
            compiled = self._compile(
                jitted, self.abstract_state, self._abstract_batch(), abstract_ceiling
            )
            return lambda state, batch, ceiling: compiled(state, batch, ceiling_array(ceiling))
        grad_step = self.grad_step

        def run(state, batch, ceiling):
            with sharding.use_rules(self.mesh, self.rules):
                step, grads, scale, metrics = grad_step(state.step, state.compute_params, batch)
                loss, norm = (
                    float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"]))
                )
                ok = np.isfinite(loss) and np.isfinite(norm) and loss <= ceiling
                metrics["skipped"] = np.int32(not ok)
                if not ok:
                    return state.replace(step=step), metrics
                return self.apply_streamed_update(state, step, grads, scale), metrics

        return run

    def global_batch(self, rows: np.ndarray) -> jax.Array:
        """This process's rows of the batch -> one global array laid out for the step."""
        shape = (self.config.train.batch_size, rows.shape[1])
        return jax.make_array_from_process_local_data(self.batch_sharding, rows, shape)


def build(config: ml_collections.ConfigDict, mesh: Mesh) -> Experiment:
    validate(config)
    if config.init_from_hf:  # The checkpoint decides the architecture.
        from angel_jax.interop import apply_checkpoint_architecture

        apply_checkpoint_architecture(config)
        validate(config)
    rules = sharding.axis_rules(config, mesh)
    family = family_of(config.model)
    model_config = family.make_config(config.model, jax.default_backend())
    fp8 = dict(
        fp8_matmul=config.fp8.matmul,
        # ZeRO-3 splits the params over `data` (validate checks the stage): gather in FP8.
        fp8_gather=config.fp8.collectives and mesh.shape["data"] > 1,
        fp8_lm_head=config.fp8.lm_head,
    )
    if any(fp8.values()):  # validate: only families with FP8 projections get here.
        model_config = dataclasses.replace(model_config, **fp8)
    model = family.module(model_config)
    optimizer = make_optimizer(config.train)
    pipeline = None
    if mesh.shape["pipeline"] > 1:
        pipeline = make_pipeline_plan(config, model_config, dict(mesh.shape))
        model_config = dataclasses.replace(model_config, remat=pipeline.remat)

    tokens = jax.ShapeDtypeStruct((1, config.train.seq_len), jnp.int32)
    inputs = family.example_inputs(tokens)
    boxed = jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"]
    logical = sharding.logical_axes(boxed)
    abstract_params = nn.meta.unbox(boxed)
    if pipeline:  # Stored stage by stage.
        abstract_params["layers"] = jax.eval_shape(
            lambda x: jax.tree.map(pipeline.layout.to_stages, x), abstract_params["layers"]
        )
    stacked = jax.tree.map(lambda names: tuple(names[:1]) == ("layers",), logical)
    abstract_opt = jax.eval_shape(lambda p: optimizer.init(p, stacked), abstract_params)

    stage = config.zero_stage
    specs = functools.partial(sharding.state_specs, logical, abstract_params, mesh, rules)
    # State shaped like its parameter (moments) takes its (ZeRO) layout; the rest (step
    # counts, factored moments) is small and replicated.
    opt_specs = jax.tree.map(
        lambda spec, p, leaf_state: jax.tree.map(
            lambda x: spec if x.shape == p.shape else P(), leaf_state
        ),
        specs(stage >= 1),
        abstract_params,
        abstract_opt,
    )
    param_sharding = sharding.named(mesh, specs(stage >= 3))
    grad_sharding = sharding.named(mesh, specs(stage >= 2))
    # Offloaded masters are updated where their optimizer state is: in its ZeRO layout.
    offloaded_master_sharding = sharding.named(mesh, specs(stage >= 1))
    opt_sharding = sharding.named(mesh, opt_specs)
    plan = make_plan(
        config,
        mesh,
        params=sharding.with_shardings(abstract_params, param_sharding),
        grads=sharding.with_shardings(abstract_params, grad_sharding),
        offloaded_masters=sharding.with_shardings(abstract_params, offloaded_master_sharding),
        opt=sharding.with_shardings(abstract_opt, opt_sharding),
        stacked=stacked,
    )
    compute_sharding = abstract_compute = ssd = update = None
    if plan.streams_params:
        model_config = dataclasses.replace(model_config, stream_params=True)
        model = family.module(model_config)
    if plan.offloads_optimizer:
        dtype = jnp.dtype(config.model.dtype)
        # Streamed layers' compute copy lives in host memory.
        compute_sharding = jax.tree.map(
            lambda s, is_stacked: (
                s.with_memory_kind(HOST) if is_stacked and plan.streams_params else s
            ),
            param_sharding,
            stacked,
        )
        abstract_compute = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, dtype), abstract_params
        )
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
        update = StreamedUpdate(optimizer, chunks, config.offload.chunks_in_flight, ssd)
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
        offloaded = OffloadedState(stacked, optimizer, state_sharding, dtype, ssd)
    return Experiment(
        config=config,
        mesh=mesh,
        rules=rules,
        model_config=model_config,
        model=model,
        optimizer=optimizer,
        state_sharding=state_sharding,
        grad_sharding=grad_sharding,
        batch_sharding=NamedSharding(mesh, sharding.logical_to_spec(("batch", None), rules)),
        abstract_state=abstract_state,
        plan=plan,
        stacked=stacked,
        streamed_update=update,
        offloaded=offloaded,
        pipeline=pipeline,
        powersgd=powersgd,
    )


def train_loop(config: ml_collections.ConfigDict, workdir: str) -> dict | None:
    """Trains from the latest checkpoint in `workdir` (or from scratch) to `config.train.steps`,
    watched by a `monitor.Monitor` (anomalies, stragglers, hangs).

    Returns the last logged metrics.
    """
    from angel_jax.monitor import Monitor

    validate(config)
    monitor = Monitor(config, workdir)  # Its hang watchdog runs from here on.
    stop = StopRequest()
    try:
        return _train_loop(config, workdir, monitor, stop)
    finally:
        stop.close()
        monitor.close()


def _restore_or_init(exp: Experiment, ckpt, monitor, say) -> tuple[TrainState, int]:
    """(state, next batch index) from the newest readable checkpoint, or a fresh state."""
    found = ckpt.restore_latest(exp.checkpoint_target(), exp.plan.policy) if ckpt else None
    if found is None:
        return exp.init_state(), 0
    for step, reason in found.unreadable:
        say(
            f"warning: checkpoint {ckpt.directory / str(step)} is unreadable ({reason}); set "
            f"aside as {step}.unreadable, resuming from the one before"
        )
        monitor.events.write("unreadable_checkpoint", step, reason=reason)
    say(f"resumed from {ckpt.directory / str(found.step)}")
    return exp.from_checkpointed(found.state), found.data_index


def _train_loop(
    config: ml_collections.ConfigDict, workdir: str, monitor, stop: StopRequest
) -> dict | None:
    from angel_jax.checkpoint import Checkpointer
    from angel_jax.data import make_batches
    from angel_jax.data.loader import process_rows
    from angel_jax.mesh import make_mesh
    from angel_jax.metrics import MetricsWriter, peak_tflops, progress_line, say

    t = config.train
    try:
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--workdir {workdir}: cannot create it ({e}); pass a writable directory"
        ) from None
    mesh = make_mesh(config.mesh)
    exp = build(config, mesh)
    # This process's rows of each batch; checks the data before any device memory is taken.
    batches = make_batches(config, process_rows(exp.batch_sharding, t.batch_size))
    ckpt = None
    if config.checkpoint.every_steps > 0:
        ckpt = Checkpointer(
            workdir,
            config.checkpoint.every_steps,
            config.checkpoint.keep,
            config.checkpoint.async_save,
        )
    train_step = monitor.step_fn(exp)  # Compiled before the state takes the device's memory.
    state, data_index = _restore_or_init(exp, ckpt, monitor, say)
    start = int(jax.device_get(state.step))
    if start >= t.steps:
        say(
            f"nothing to do: the run is at step {start} and config.train.steps="
            f"{t.steps}; raise config.train.steps to train further"
        )
        if ckpt:
            ckpt.close()
        return None

    cfg = exp.model_config
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(exp.abstract_state.params))
    mesh_text = " x ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "1 device"
    say(
        f"angel-jax: {n_params / 1e6:.1f}M params, {cfg.num_layers} layers, mesh {mesh_text} "
        f"({mesh.size} {jax.devices()[0].platform} devices), ZeRO-{config.zero_stage}, "
        f"batch {t.batch_size} x {t.seq_len}, steps {start} -> {t.steps}"
    )
    for line in kernels.banner(config.model, mesh.shape["context"] > 1):
        say(line)
    say(exp.plan.table())
    if exp.pipeline:
        say(exp.pipeline.table())
    if t.lr_scaling != "none":
        from angel_jax.optim.scaling import lr_and_warmup

        lr, warmup = lr_and_warmup(t)
        say(
            f"learning rate {lr:.3g}, warmup {warmup} steps: config.train.lr={t.lr:g} and "
            f"warmup_steps={t.warmup_steps} moved from batch {t.lr_base_batch or t.batch_size} "
            f"to {t.batch_size} by lr_scaling={t.lr_scaling}"
        )
    peak = peak_tflops(t.peak_tflops)
    if peak is None:
        say(
            f"note: no known peak FLOP/s for device kind {jax.devices()[0].device_kind!r}: MFU "
            "is reported as null; set config.train.peak_tflops to report it"
        )
    flops_per_step = cfg.flops_per_token(t.seq_len) * t.batch_size * t.seq_len
    writer = MetricsWriter(workdir, t.tensorboard)
    if jax.process_index() == 0:  # What this run was, for whoever reads the workdir later.
        (pathlib.Path(workdir) / "config.json").write_text(config.to_json_best_effort(indent=1))
    last = None

    def due(step):
        return step % t.log_every_steps == 0 or step == t.steps or step == start + 1

    def log(step, device_metrics):
        nonlocal last, t_last, step_last
        # .item(): Python ints stay ints (`skipped`), floats floats.
        metrics = {k: np.asarray(v).item() for k, v in jax.device_get(device_metrics).items()}
        now = time.perf_counter()
        step_time = (now - t_last) / (step - step_last)
        metrics.update(
            step_time_s=step_time,
            tokens_per_s=t.batch_size * t.seq_len / step_time,
            mfu=None if peak is None else flops_per_step / step_time / (peak * 1e12 * mesh.size),
        )
        if step == start + 1:
            metrics["includes_compile"] = True
        writer.write(step, metrics)
        say(progress_line(step, t.steps, metrics))
        t_last, step_last, last = now, step, metrics

    t_last, step_last = time.perf_counter(), start
    pending = None
    batch_iter = batches.iterate(data_index)
    step = start
    monitor.start(step, data_index)
    while step < t.steps:
        batch = exp.global_batch(next(batch_iter))
        with jax.transfer_guard("disallow"):
            state, metrics = train_step(state, batch)
        step, data_index = step + 1, data_index + 1
        if pending:  # Step t's metrics are read after step t+1 is dispatched.
            log(*pending)
            pending = None
        if due(step):
            pending = (step, metrics)
        stopping = stop.after(step)
        saving = ckpt is not None and (stopping or ckpt.should_save(step, t.steps))
        # Reads the previous step's loss (and this one's before a save: no anomalous state is
        # ever saved).
        rollback = monitor.observe(step, metrics, data_index, sync=saving)
        if rollback:
            ckpt.manager.wait_until_finished()  # Then free the state before restoring.
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state)
            state, _ = _restore_or_init(exp, ckpt, monitor, say)
            step, data_index = int(jax.device_get(state.step)), rollback.data_index
            monitor.rolled_back(step, rollback)
            batch_iter = batches.iterate(data_index)
            pending, t_last, step_last = None, time.perf_counter(), step
            continue
        if saving:
            if pending:  # Read already: metrics.jsonl is complete up to every checkpoint.
                log(*pending)
                pending = None
            ckpt.save(step, exp.checkpointed(state), data_index, exp.plan.policy)
            monitor.saved(step)
        if stopping:
            break
    if pending:
        log(*pending)
    if ckpt:
        ckpt.close()  # Waits for the last save.
    writer.close()
    if stop.signum is not None and step < t.steps:
        name = signal.Signals(stop.signum).name
        if ckpt:
            say(
                f"stopped by {name} after step {step}, saved in {ckpt.directory / str(step)}; "
                "the same command resumes from there"
            )
        else:
            say(
                f"stopped by {name} after step {step}; nothing saved "
                "(config.checkpoint.every_steps=0)"
            )
        raise Stopped(stop.signum)
    return last
