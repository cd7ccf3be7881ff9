"""The experiment: a model, its loss and its train state, built once from a config and a mesh.

`build(config, mesh)` gives an `Experiment`: the model, optimizer, every sharding
(`state_layout.py`), a sharded `init_state`, the loss, its grads (`grads.py`) and the compiled
`train_step` (`steps.py`). It is what the loop (`loop.py`) runs and what a notebook or a test
imports.
"""

import dataclasses
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding

from angel_jax import machine, sharding
from angel_jax.grads import Gradients, GradSetup, PipelineSetup
from angel_jax.losses import TrainingLoss
from angel_jax.models import apply_checkpoint_architecture, family_of, load_params, validate
from angel_jax.offload import planner
from angel_jax.offload.planner import CompiledTooLarge, Plan, may_update_between_microbatches
from angel_jax.offload.ssd import SSDTier
from angel_jax.offload.state import OffloadedState
from angel_jax.offload.stream import (
    StreamedUpdate,
)
from angel_jax.optim import Optimizer, make_optimizer
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.parallel.attention import zigzag_order
from angel_jax.parallel.stage_plan import PipelinePlan, make_pipeline_plan
from angel_jax.state_layout import TrainState, make_state_layout
from angel_jax.steps import DeviceStep, InStepUpdate, OffloadedStep

# Plans `build` makes at most, each for what the last one's compiled step took.
_MOST_PLANS = 6


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict
    mesh: Mesh
    rules: sharding.Rules
    model_config: Any  # The family's (angel_jax/family.py), from config.model.
    model: nn.Module
    optimizer: Optimizer
    # With config.mesh.pipeline > 1: the stages' layers, schedule and remat; the stacked
    # layers are then stored stage by stage (`pipeline.layout`).
    pipeline: PipelinePlan | None
    # The fields of its `state_layout.StateLayout`:
    abstract_state: TrainState
    state_sharding: TrainState
    grad_sharding: Any
    batch_sharding: NamedSharding
    plan: Plan
    stacked: Any
    streamed_update: StreamedUpdate | None
    offloaded: OffloadedState | None
    powersgd: PowerSGD | None

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
            return self.offloaded.params_numpy(state)
        return jax.device_get(state.params)

    @property
    def checkpoint_layout(self) -> tuple[str, bool]:
        """(offload policy, split masters): what a checkpoint's state restores only under."""
        return self.plan.policy, self.plan.split_masters

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

    @functools.cached_property
    def loss(self) -> TrainingLoss:
        """(params, rows) -> (loss, metrics), what the grads differentiate."""
        context = self.mesh.shape["context"]
        order = (lambda length: zigzag_order(length, context)) if context > 1 else None
        pieces = family_of(self.config.model).pieces
        return TrainingLoss(
            self.model,
            self.config,
            self.model_config.logits_chunks,
            lambda params: pieces.lm_head(self.model_config, params),
            order,
            bool(self.model_config.num_experts),
        )

    @functools.cached_property
    def grads(self) -> Gradients:
        c = self.config
        pipeline = None
        if self.pipeline:
            pieces = family_of(c.model).pieces
            pipeline = PipelineSetup(
                self.pipeline, c.pipeline.microbatches, pieces, self.model_config, c.train.z_loss
            )
        compute = self.abstract_state.compute_params
        setup = GradSetup(
            mesh=self.mesh,
            microbatches=c.train.microbatches,
            grad_sharding=self.grad_sharding,
            abstract_params=self.abstract_state.params if compute is None else compute,
            stacked=self.stacked,
            streams_params=self.plan.streams_params,
            chunks_in_flight=c.offload.chunks_in_flight,
            pipeline=pipeline,
            powersgd=self.powersgd,
            powersgd_start_step=c.train.powersgd_start_step,
            comm_sharding=self.state_sharding.comm,
        )
        return Gradients(self.loss, setup)

    @functools.cached_property
    def steps(self) -> DeviceStep | OffloadedStep:
        """The train step's form, as the plan places the optimizer state."""
        if not self.plan.offloads_optimizer:
            return DeviceStep(self)
        return (InStepUpdate if self.config.offload.update_in_step else OffloadedStep)(self)

    @property
    def train_step(self):
        """(state, batch) -> (state, metrics), compiled; the state is donated."""
        return self.steps.train_step

    @property
    def loop_step(self):
        """The step the training loop runs: `guarded_train_step` when anomalies are skipped
        in the step (config.monitor.on_anomaly=skip), else `train_step`."""
        skips = self.config.monitor.on_anomaly == "skip"
        return self.guarded_train_step if skips else self.train_step

    @property
    def guarded_train_step(self):
        """(state, batch, loss ceiling) -> (state, metrics): `train_step` that drops the update
        of a step whose loss or grad norm is not finite or whose loss is above the ceiling
        (`monitor.skip_if_anomalous`; the step count advances, metrics["skipped"] says it)."""
        return self.steps.guarded_train_step

    def settled(self, state: TrainState) -> TrainState:
        """`state` with a delayed update still waiting applied (config.offload.delayed_update):
        what a checkpoint holds."""
        return self.steps.settle(state)

    def global_batch(self, rows: np.ndarray) -> jax.Array:
        """This process's rows of the batch -> one global array laid out for the step."""
        shape = (self.config.train.batch_size, rows.shape[1])
        return jax.make_array_from_process_local_data(self.batch_sharding, rows, shape)


def build(config: ml_collections.ConfigDict, mesh: Mesh, fit_compiled: bool = True) -> Experiment:
    """The experiment `config` describes on `mesh`. A plan that offloads the optimizer fills
    the device's room around the planner's estimate of the step's temporaries: chunks
    resident on the device (policy auto) and the update's groups beside the step; with
    config.model.remat=auto the plan also picks the fastest remat policy that fits. With
    `fit_compiled`, such a plan's step is compiled here and the plan made again with what its
    temporaries took, before anything is allocated: when they took more (fewer chunks
    resident, none of the update's groups beside the step, or the next remat policy), and
    when they took less and the room left lets the plan keep more on the device for the same
    program. Otherwise the first use of the step compiles it and refuses a plan it overruns."""
    exp = _build(config, mesh)
    picks_remat = config.model.remat == "auto" and not exp.pipeline
    if not (fit_compiled and exp.steps.checks_compiled):
        return exp
    if not (exp.plan.offloads_optimizer or picks_remat):
        return exp
    # (Offloads the optimizer, remat policy) -> what that compiled step took beyond the estimate.
    extra: dict[tuple[bool, str], int] = {}
    for attempt in range(_MOST_PLANS):
        try:
            # The program the loop runs: compiled and checked against the plan.
            _ = exp.steps.program if exp.plan.offloads_optimizer else exp.loop_step
            break
        except CompiledTooLarge as e:
            if attempt == _MOST_PLANS - 1:
                raise
            before, key = exp, (exp.plan.offloads_optimizer, exp.plan.remat)
            extra[key] = extra.get(key, 0) + e.beyond_estimate
            exp = _build(config, mesh, extra)
            now = f"policy {exp.plan.policy}, remat {exp.plan.remat}"
            if before.plan.offloads_optimizer and exp.plan.offloads_optimizer:
                exp.steps.reuse_program(before.steps)  # The same program: not compiled again.
                now += f", {len(exp.plan.resident)} chunks resident on the device, not "
                now += str(len(before.plan.resident))
            print(
                f"the compiled step (remat {key[1]}) took {e.beyond_estimate / 2**30:.1f} GiB "
                f"more temporaries than the plan's estimate: planned again with them ({now})",
                file=sys.stderr,
            )
    if exp.plan.offloads_optimizer:
        return exp if extra else _with_room_given_back(config, mesh, exp)
    return _with_a_faster_remat(config, mesh, exp) if picks_remat and not extra else exp


def _with_a_faster_remat(config: ml_collections.ConfigDict, mesh: Mesh, exp: Experiment):
    """`exp` (remat auto, everything on the device), or planned again with a faster remat
    policy than its pick: when the compiled step's temporaries came in under the estimate,
    the faster policies' estimates are scaled alike, and the fastest that then fits is
    compiled and taken if its step fits too; one that does not is planned again with what it
    took, which passes to the next (a compile each; the estimate errs high: by 14% for
    dots_no_batch and 34% for full on llama_1b at 48 x 2048 on the H200)."""
    plan = exp.plan
    choices = planner.remat_choices(config, mesh)
    faster = choices[: choices.index(plan.remat)]
    excess, activations = exp.steps.beyond_estimate, plan.state_bytes["activations"]
    if excess >= 0 or not faster or activations <= 0:
        return exp
    scale = max(0.0, (activations + excess) / activations)
    extra = {
        (False, r): int((scale - 1) * planner.activation_bytes(config, mesh, r)["activations"])
        for r in faster
    }
    for _ in faster:
        again = _build(config, mesh, extra)
        if again.plan.remat not in faster:
            break
        try:
            _ = again.loop_step  # Compiled and checked against the plan.
        except CompiledTooLarge as e:
            extra[False, again.plan.remat] += e.beyond_estimate
            print(
                f"remat {again.plan.remat}, tried in the room remat {plan.remat}'s compiled "
                f"step left, took {e.beyond_estimate / 2**30:.1f} GiB more than its scaled "
                "estimate",
                file=sys.stderr,
            )
            continue
        print(
            f"the compiled step (remat {plan.remat}) took {-excess / 2**30:.1f} GiB less than "
            f"the plan's estimate: remat {again.plan.remat} fits, and is taken",
            file=sys.stderr,
        )
        return again
    return exp


def _with_room_given_back(config: ml_collections.ConfigDict, mesh: Mesh, exp: Experiment):
    """`exp`, or planned again with its compiled step's temporaries when they came in under
    the estimate and the room left lets the plan keep more on the device for the same
    program."""
    plan, excess = exp.plan, exp.steps.beyond_estimate  # Of the step compiled in `build`.
    # Room left over helps a plan that fills it: resident chunks, or groups it switched off.
    # A delayed update that could run between microbatches, if the room let it.
    could_go_between = not plan.update_between_microbatches and may_update_between_microbatches(
        config, plan, exp.pipeline is not None
    )
    fills = config.offload.policy == "auto" or not plan.copies_beside_step or could_go_between
    if excess >= 0 or not fills:
        return exp
    again = _build(config, mesh, {(True, plan.remat): excess})
    between = again.plan.update_between_microbatches and not plan.update_between_microbatches
    more = (
        len(again.plan.resident) > len(plan.resident)
        or (again.plan.copies_beside_step and not plan.copies_beside_step)
        or between
    )
    if not (more and again.plan.offloads_optimizer):
        return exp
    # Only for the same program: another's temporaries are not the ones measured. But a
    # delayed update the room lets run between microbatches brings its own program (one
    # microbatch's forward/backward, the same work as the loop's body): taken if it fits.
    if not (again.steps.reuse_program(exp.steps) or between):
        return exp
    try:
        _ = again.steps.program  # Checked against the plan made again.
    except CompiledTooLarge as e:
        if not between:
            raise
        # Its temporaries passed the scan's (on the H200, the 8B's by 0.01 GiB, where the
        # groups took all the room): once more with them, the same program.
        again = _between_again(
            config, mesh, again, {(True, plan.remat): excess + e.beyond_estimate}
        )
        if again is None:
            return exp
    print(
        f"the compiled step's temporaries took {-excess / 2**30:.1f} GiB less than the plan's "
        f"estimate: planned again with them ({len(again.plan.resident)} chunks resident on the "
        f"device, not {len(plan.resident)}; the update's groups beside the step "
        f"{'on' if again.plan.copies_beside_step else 'off'}; the delayed update between "
        f"microbatches {'on' if again.plan.update_between_microbatches else 'off'})",
        file=sys.stderr,
    )
    return again


def _between_again(config: ml_collections.ConfigDict, mesh: Mesh, before: Experiment, extra):
    """`before`'s update between microbatches planned once more with its microbatch program's
    temporaries (`extra`, `_build`'s) and that program, checked; None if the plan made so
    leaves that mode or its program does not fit."""
    again = _build(config, mesh, extra)
    if not (again.plan.update_between_microbatches and again.steps.reuse_program(before.steps)):
        return None
    try:
        _ = again.steps.program
    except CompiledTooLarge:
        return None
    return again


def _build(
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    extra_activations: dict[tuple[bool, str], int] | None = None,
) -> Experiment:
    validate(config)
    if config.init_from_hf:  # The checkpoint decides the architecture.
        apply_checkpoint_architecture(config)
        validate(config)
    rules = sharding.axis_rules(config, mesh)
    family = family_of(config.model)
    model_config = family.make_config(config.model, machine.backend())
    fp8 = dict(
        fp8_matmul=config.fp8.matmul,
        # ZeRO-3 splits the params over `data` (validate checks the stage): gather in FP8.
        fp8_gather=config.fp8.collectives and mesh.shape["data"] > 1,
        fp8_lm_head=config.fp8.lm_head,
    )
    if any(fp8.values()):  # validate: only families with FP8 projections get here.
        model_config = dataclasses.replace(model_config, **fp8)
    pipeline = None
    if mesh.shape["pipeline"] > 1:
        pipeline = make_pipeline_plan(config, model_config, dict(mesh.shape))
        model_config = dataclasses.replace(model_config, remat=pipeline.remat)
    elif model_config.remat == "auto":  # The plan's pick, below; shapes do not depend on it.
        model_config = dataclasses.replace(model_config, remat="none")
    optimizer = make_optimizer(config.train)
    # The params' shapes (the planners' input) do not depend on what the plan then decides.
    tokens = jax.ShapeDtypeStruct((1, config.train.seq_len), jnp.int32)
    shapes_of = family.module(model_config).init
    boxed = jax.eval_shape(shapes_of, jax.random.key(0), *family.example_inputs(tokens))
    to_stages = pipeline.layout.to_stages if pipeline else None
    # The pipeline's stage planner keeps its own activation model: inputs stay on the device.
    offloadable = family.offloads_layer_inputs and not pipeline
    layout = make_state_layout(
        config,
        mesh,
        rules,
        boxed["params"],
        optimizer,
        to_stages,
        offloadable,
        extra_activations,
        pipeline=pipeline,  # Its stages' remat pick and activation model.
    )
    if not pipeline:
        model_config = dataclasses.replace(model_config, remat=layout.plan.remat)
    if layout.plan.streams_params:
        model_config = dataclasses.replace(model_config, stream_params=True)
    if layout.plan.layer_inputs_on_host:
        model_config = dataclasses.replace(model_config, layer_input_on_host=True)
    return Experiment(
        config=config,
        mesh=mesh,
        rules=rules,
        model_config=model_config,
        model=family.module(model_config),
        optimizer=optimizer,
        pipeline=pipeline,
        **{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)},
    )
