"""The experiment: a model, its loss and its train state, built once from a config and a mesh.

`build(config, mesh)` gives an `Experiment`: the model, optimizer, every sharding
(`state_layout.py`), a sharded `init_state`, the loss, its grads (`grads.py`) and the compiled
`train_step` (`steps.py`). It is what the loop (`loop.py`) runs and what a notebook or a test
imports.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding

from angel_jax import lora, machine, sharding
from angel_jax.data.objectives import row_width
from angel_jax.grads import Gradients, GradSetup, PipelineSetup
from angel_jax.losses import TrainingLoss
from angel_jax.models import apply_checkpoint_architecture, family_of, load_params, validate
from angel_jax.offload.ssd import SSDTier
from angel_jax.offload.state import OffloadedState
from angel_jax.offload.stream import (
    StreamedUpdate,
)
from angel_jax.optim import Optimizer, learning_rate_schedule, make_optimizer
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.parallel.attention import zigzag_order
from angel_jax.planning.compiled import check_compiled, checks_compiled
from angel_jax.planning.inputs import PlanInput, model_settings, plan_input
from angel_jax.planning.plan import Plan
from angel_jax.planning.settle import settle
from angel_jax.planning.stage_plan import PipelinePlan, make_pipeline_plan
from angel_jax.state_layout import TrainState, make_state_layout
from angel_jax.steps import (
    DeviceStep,
    InStepUpdate,
    OffloadedStep,
    OffloadSetup,
    Step,
    StepSetup,
    backward_order,
)


@dataclasses.dataclass
class Experiment:
    """What a user holds (`build` makes it): the state's init, the step functions, batch
    placement and checkpoint conversions, beside the model, optimizer and layouts."""

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
        return self._state_init(jax.random.key(self.config.seed if seed is None else seed))

    @functools.cached_property
    def _state_init(self) -> "_StateInit":
        """What `init_state` runs, given the fields it reads."""
        return _StateInit(**{f.name: getattr(self, f.name) for f in dataclasses.fields(_StateInit)})

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
        return _training_loss(self)

    @functools.cached_property
    def grads(self) -> Gradients:
        """The grads of `loss`, in the layout the plan gives them (`_grad_setup`)."""
        return Gradients(self.loss, _grad_setup(self))

    @functools.cached_property
    def steps(self) -> Step:
        """The train step's form, as the plan places the optimizer state."""
        setup = _step_setup(self)
        if not self.plan.offloads_optimizer:
            return DeviceStep(setup)
        form = InStepUpdate if self.config.offload.update_in_step else OffloadedStep
        return form(setup)

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


@dataclasses.dataclass(frozen=True, eq=False)
class _StateInit:
    """The train state's first values, made straight into their shardings: what
    `Experiment.init_state` does, apart from what the experiment holds."""

    config: ml_collections.ConfigDict
    mesh: Mesh
    model: nn.Module
    optimizer: Optimizer
    pipeline: PipelinePlan | None
    abstract_state: TrainState
    state_sharding: TrainState
    stacked: Any
    offloaded: OffloadedState | None
    powersgd: PowerSGD | None

    def __call__(self, rng) -> TrainState:
        """The state from `rng`: the model's init, or around config.init_from_hf's params."""
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
        into its sharding (validate limits this to the plain layout: no pipeline, no offload).
        LoRA's adapters are not in the checkpoint: they start as a random init makes them."""
        part = lora.base if self.optimizer.adapters_only else lambda tree: tree
        params = load_params(
            self.config.init_from_hf,
            part(self.abstract_state.params),
            part(self.state_sharding.params),
            "config.init_from_hf",
        )
        init = jax.jit(self._init, out_shardings=self.state_sharding, donate_argnums=1)
        return init(rng, params)

    def _init(self, rng, params=None) -> TrainState:
        if params is None:
            params = self._init_params(rng)
        elif self.optimizer.adapters_only:  # Imported base weights: the init's adapters.
            params = lora.with_adapters(params, lora.adapters(self._init_params(rng)))
        comm = None
        if self.powersgd:
            replicas = self.mesh.shape["data"]
            comm = self.powersgd.init(params, self.stacked, replicas, jax.random.fold_in(rng, 1))
        return TrainState(
            jnp.zeros((), jnp.int32), params, self.optimizer.init(params, self.stacked), None, comm
        )


def _training_loss(exp: Experiment) -> TrainingLoss:
    """`exp`'s loss: its model (under LoRA dropout, with the step's dropout key) and the
    config's objective, its logits chunked and its rows in the context's order."""
    context = exp.mesh.shape["context"]
    order = (lambda length: zigzag_order(length, context)) if context > 1 else None
    pieces = family_of(exp.config.model).pieces
    # LoRA dropout: the model applied with the step's dropout key (`lora.Dropout`).
    dropout = exp.optimizer.adapters_only and exp.config.model.lora.dropout
    model = lora.Dropout(exp.model) if dropout else exp.model
    return TrainingLoss(
        model,
        exp.config,
        exp.model_config.logits_chunks,
        lambda params: pieces.lm_head(exp.model_config, params),
        order,
        bool(exp.model_config.num_experts),
    )


def _grad_setup(exp: Experiment) -> GradSetup:
    """The layout `exp`'s grads are made in, from its config, plan and layout."""
    c = exp.config
    pipeline = None
    if exp.pipeline:
        pieces = family_of(c.model).pieces
        pipeline = PipelineSetup(
            exp.pipeline, c.pipeline.microbatches, pieces, exp.model_config, c.train.z_loss
        )
    compute = exp.abstract_state.compute_params
    trained = exp.optimizer.trained  # Under LoRA, the adapters alone have grads.
    return GradSetup(
        mesh=exp.mesh,
        microbatches=c.train.microbatches,
        grad_sharding=exp.grad_sharding,
        abstract_params=trained(exp.abstract_state.params if compute is None else compute),
        stacked=trained(exp.stacked),
        streams_params=exp.plan.streams_params,
        chunks_in_flight=c.offload.chunks_in_flight,
        pipeline=pipeline,
        powersgd=exp.powersgd,
        powersgd_start_step=c.train.powersgd_start_step,
        comm_sharding=exp.state_sharding.comm,
        adapters_only=exp.optimizer.adapters_only,
        dropout_seed=c.seed if c.model.lora.rank and c.model.lora.dropout else None,
    )


def _step_setup(exp: Experiment) -> StepSetup:
    """What `exp`'s train step reads, from its config, plan and layout."""
    c, plan = exp.config, exp.plan
    offload = None
    if plan.offloads_optimizer:
        order = None
        if c.offload.update_in_step:
            pieces = family_of(c.model).pieces
            chunks, compute = exp.streamed_update.chunks, exp.abstract_state.compute_params
            order = backward_order(pieces, exp.model_config, compute, chunks, exp.mesh, exp.rules)
        offload = OffloadSetup(
            update=exp.streamed_update,
            chunks_in_flight=c.offload.chunks_in_flight,
            delayed=c.offload.delayed_update,
            between_microbatches=c.offload.delayed_update and plan.update_between_microbatches,
            speculative=c.offload.speculative_update,
            order=order,
        )
    return StepSetup(
        mesh=exp.mesh,
        rules=exp.rules,
        grads=exp.grads,
        optimizer=exp.optimizer,
        learning_rate=learning_rate_schedule(c.train),
        abstract_state=exp.abstract_state,
        state_sharding=exp.state_sharding,
        grad_sharding=exp.grad_sharding,
        batch_sharding=exp.batch_sharding,
        batch_shape=(c.train.batch_size, row_width(c)),
        microbatches=c.train.microbatches,
        stacked=exp.stacked,
        grad_clip=c.train.grad_clip,
        skips_anomalies=c.monitor.on_anomaly == "skip",
        check=functools.partial(check_compiled, plan),
        checks_compiled=checks_compiled(c.offload.device_gib),
        powersgd=exp.powersgd,
        offload=offload,
    )


def build(
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    fit_compiled: bool = True,
    extra_activations: dict[tuple[bool, str], int] | None = None,
) -> Experiment:
    """The experiment `config` describes on `mesh`, planned once from a `PlanInput`. With
    `fit_compiled`, a plan that offloads the optimizer or picks the remat policy
    (config.model.remat=auto) is settled against its compiled step before anything is
    allocated (`planning.settle`): planned again, and built again, with what the step's
    temporaries took. Otherwise the first use of the step compiles it and refuses a plan it
    overruns. `extra_activations`: what compiled steps took beyond the planner's estimate,
    known already (`placement.make_plan`'s), for the first plan."""
    validate(config)
    if config.init_from_hf:  # The checkpoint decides the architecture.
        apply_checkpoint_architecture(config)
        validate(config)
    family = family_of(config.model)
    inp = plan_input(config, mesh, family.make_config(config.model, machine.backend()))
    exp = _build(config, mesh, inp, extra_activations)
    if not (fit_compiled and exp.steps.checks_compiled):
        return exp
    make = lambda extra: _Built(_build(config, mesh, inp, extra))
    return settle(inp, make, _Built(exp)).exp


@dataclasses.dataclass(frozen=True)
class _Built:
    """An `Experiment` as the settle loop sees it (`planning.settle.Built`)."""

    exp: Experiment

    @property
    def plan(self) -> Plan:
        return self.exp.plan

    @property
    def pipelined(self) -> bool:
        return self.exp.pipeline is not None

    def check_program(self) -> int:
        _ = self.exp.steps.program  # Compiled and checked against the plan.
        return self.exp.steps.beyond_estimate

    def check_loop_step(self) -> int:
        _ = self.exp.loop_step  # Compiled and checked against the plan.
        return self.exp.steps.beyond_estimate

    def reuse_program(self, before: "_Built") -> bool:
        return self.exp.steps.reuse_program(before.exp.steps)


def _build(
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    inp: PlanInput,
    extra_activations: dict[tuple[bool, str], int] | None = None,
) -> Experiment:
    """The experiment planned from `inp` (`plan_input(config, mesh)`), with
    `extra_activations` (`placement.make_plan`'s)."""
    rules = sharding.axis_rules(config, mesh)
    family = family_of(config.model)
    fp8 = dict(
        fp8_matmul=config.fp8.matmul,
        # ZeRO-3 splits the params over `data` (validate checks the stage): gather in FP8.
        fp8_gather=config.fp8.collectives and mesh.shape["data"] > 1,
        fp8_lm_head=config.fp8.lm_head,
    )
    pipeline = None
    if mesh.shape["pipeline"] > 1:
        pipeline = make_pipeline_plan(inp, inp.decoder)
    # The params' shapes (the planners' input) do not depend on what the plan then decides:
    # any remat policy gives them (auto is none until the plan picks one).
    remat = pipeline.remat if pipeline else inp.decoder.remat
    shapes_config = dataclasses.replace(
        inp.decoder,
        **(fp8 if any(fp8.values()) else {}),
        remat="none" if remat == "auto" else remat,
    )
    optimizer = make_optimizer(config.train, adapters_only=config.model.lora.rank > 0)
    tokens = jax.ShapeDtypeStruct((1, config.train.seq_len), jnp.int32)
    shapes_of = family.module(shapes_config).init
    boxed = jax.eval_shape(shapes_of, jax.random.key(0), *family.example_inputs(tokens))
    to_stages = pipeline.layout.to_stages if pipeline else None
    # The pipeline's stage planner keeps its own activation model: inputs stay on the device.
    offloadable = family.offloads_layer_inputs and not pipeline
    layout = make_state_layout(
        config,
        mesh,
        inp,
        rules,
        boxed["params"],
        optimizer,
        to_stages,
        offloadable,
        extra_activations,
        pipeline=pipeline,  # Its stages' remat pick and activation model.
    )
    # The plan hands the model its settings in one step.
    model_config = dataclasses.replace(inp.decoder, **model_settings(fp8, layout.plan))
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
