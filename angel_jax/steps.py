"""The train step, in one of three forms behind one signature, chosen by the ZeRO-Cache plan:
`DeviceStep` (masters and optimizer state on the device: one compiled program),
`OffloadedStep` (the optimizer state in host memory or on SSD: a compiled forward/backward,
then the streamed update of every chunk, `offloaded_update.py`) and `InStepUpdate`
(config.offload.update_in_step: the offloaded update inside the forward/backward's program).
Each gives `train_step(state,
batch) -> (state, metrics)` and `guarded_train_step(state, batch, loss ceiling)`, which drops
an anomalous step's update (`monitor.is_anomalous`). Each takes a `StepSetup` (`train.build`
fills it), the grads from its `grads` (angel_jax/grads.py) each way.
"""

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import dispatch, sharding
from angel_jax.config import ConfigError
from angel_jax.family import Pieces
from angel_jax.grads import Gradients
from angel_jax.monitor import is_anomalous, skip_if_anomalous
from angel_jax.offload.stream import Chunk, StreamedUpdate, global_norm, layer_index, update_in_step
from angel_jax.offloaded_update import OffloadedUpdate, as_flat, from_flat
from angel_jax.optim import Optimizer
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.state_layout import TrainState


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadSetup:
    """What the offloaded forms read beside `StepSetup`."""

    update: StreamedUpdate  # The streamed update of the offloaded state's chunks.
    chunks_in_flight: int  # config.offload.chunks_in_flight.
    delayed: bool  # config.offload.delayed_update: step t's update waits for step t+1.
    # Delayed, and run between step t+1's microbatches (`Plan.update_between_microbatches`).
    between_microbatches: bool
    speculative: bool  # config.offload.speculative_update (the update in the step).
    # The update in the step's chunks in the order the backward pass finishes their grads
    # (`backward_order`); None for the other forms.
    order: list[int] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class StepSetup:
    """What a train step reads, made once by `train.build` from the config and the plan."""

    mesh: Mesh
    rules: sharding.Rules
    grads: Gradients
    optimizer: Optimizer
    learning_rate: Callable  # step -> learning rate (`optim.learning_rate_schedule`).
    abstract_state: TrainState
    state_sharding: TrainState
    grad_sharding: Any
    batch_sharding: NamedSharding
    batch_shape: tuple[int, int]  # (rows, a row's tokens: `data.objectives.row_width`).
    microbatches: int  # config.train.microbatches.
    stacked: Any  # Per weight: whether it is the layers' stack.
    grad_clip: float  # config.train.grad_clip.
    skips_anomalies: bool  # config.monitor.on_anomaly=skip: the loop runs the guarded step.
    # The compiled programs' memory checked against the plan (`planning.compiled`): memory
    # analysis -> the temporaries' bytes beyond the plan's estimate.
    check: Callable
    checks_compiled: bool  # Whether `check` runs (`planning.compiled.checks_compiled`).
    powersgd: PowerSGD | None = None
    offload: OffloadSetup | None = None  # The offloaded forms'.


class Step:
    """What every form shares: the abstract batch, ahead-of-time compilation, the ceiling."""

    def __init__(self, setup: StepSetup):
        self.setup = setup
        self.replicated = NamedSharding(setup.mesh, P())
        self._ceiling = {}  # The loss ceiling's device copy, made again only when it changes.
        # The last checked program's temporaries beyond the plan's estimate (`setup.check`).
        self.beyond_estimate = 0

    def rules(self):
        """The logical-axis rules on the mesh, for tracing the step."""
        return sharding.use_rules(self.setup.mesh, self.setup.rules)

    def abstract_batch(self):
        # Inputs and, shifted by one, targets; or the objective's fields side by side.
        s = self.setup
        return jax.ShapeDtypeStruct(s.batch_shape, jnp.int32, sharding=s.batch_sharding)

    def compile(self, jitted, *abstract_args):
        """Compiles ahead of time, from shapes alone: `train_step` is built before the state
        is allocated, so XLA's GPU autotuner has the device's memory to try kernels in (a
        state filled to the planner's budget leaves it too little, and the compile fails). The
        compiled program's memory is checked against the plan (`checks_compiled`)."""
        with self.rules():
            return self.checked(jitted.lower(*abstract_args).compile())

    def checked(self, compiled: jax.stages.Compiled) -> jax.stages.Compiled:
        """`compiled`, once its memory is checked against the plan (see `compile`)."""
        if self.checks_compiled:
            self.beyond_estimate = self.setup.check(compiled.memory_analysis())
        return compiled

    @property
    def checks_compiled(self) -> bool:
        """Whether `compile` checks the program against the plan
        (`planning.compiled.checks_compiled`)."""
        return self.setup.checks_compiled

    def settle(self, state: TrainState) -> TrainState:
        """`state` with any update still waiting applied (`OffloadedStep`'s delayed update)."""
        return state

    def discard(self) -> None:
        """Drops an update still waiting (a rollback's): only `OffloadedStep` keeps one."""

    def ceiling_array(self, ceiling: float) -> jax.Array:
        value = np.float32(min(ceiling, np.finfo(np.float32).max))
        if self._ceiling.get("value") != value:
            with jax.transfer_guard_host_to_device("allow"):  # One scalar, on purpose.
                array = jax.make_array_from_callback((), self.replicated, lambda _: value)
                self._ceiling.update(value=value, array=array)
        return self._ceiling["array"]


class DeviceStep(Step):
    """The whole step in one compiled program, the state donated."""

    def update(self, state: TrainState, batch_BT1: jax.Array):
        """(state, batch) -> (next state, metrics), traced."""
        s, comm = self.setup, state.comm
        if s.powersgd:
            metrics, grads, comm = s.grads.powersgd(state, batch_BT1)
        else:
            metrics, grads = s.grads.loss_and_grads(state.params, batch_BT1, state.step)
        params, opt_state, norm = s.optimizer.update(
            grads, state.opt_state, state.params, s.stacked
        )
        metrics.update(grad_norm=norm, lr=s.learning_rate(state.step))
        return TrainState(state.step + 1, params, opt_state, None, comm), metrics

    @functools.cached_property
    def _jitted(self):
        s = self.setup
        return jax.jit(
            self.update,
            in_shardings=(s.state_sharding, s.batch_sharding),
            out_shardings=(s.state_sharding, self.replicated),
            donate_argnums=0,
        )

    def lowered(self) -> jax.stages.Lowered:
        """The step lowered from shapes (not compiled): its StableHLO holds the program as JAX
        wrote it (dtypes of every dot, before XLA's rewrites)."""
        with self.rules():
            return self._jitted.lower(self.setup.abstract_state, self.abstract_batch())

    @functools.cached_property
    def train_step(self):
        return self.compile(self._jitted, self.setup.abstract_state, self.abstract_batch())

    @functools.cached_property
    def guarded_program(self) -> jax.stages.Compiled:
        """`guarded_train_step`'s compiled program: (state, batch, ceiling array)."""
        s = self.setup
        jitted = jax.jit(
            skip_if_anomalous(self.update),
            in_shardings=(s.state_sharding, s.batch_sharding, self.replicated),
            out_shardings=(s.state_sharding, self.replicated),
            donate_argnums=0,
        )
        ceiling = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
        return self.compile(jitted, s.abstract_state, self.abstract_batch(), ceiling)

    @functools.cached_property
    def guarded_train_step(self):
        compiled = self.guarded_program
        return lambda state, batch, ceiling: compiled(state, batch, self.ceiling_array(ceiling))


class _Offloaded(Step):
    """What both offloaded forms share: the program `build` compiles and checks against the
    plan before anything is allocated (`program`), and the params-shaped trees as the
    streamed update's flat lists."""

    def __init__(self, setup: StepSetup):
        super().__init__(setup)
        self.offload = setup.offload
        self.streamed = setup.offload.update  # The streamed update of the chunks.

    @functools.cached_property
    def program_lowered(self) -> jax.stages.Lowered:
        """`program`, lowered from shapes: its text says whether two plans' steps are one
        program."""
        raise NotImplementedError

    @functools.cached_property
    def program_compiled(self) -> jax.stages.Compiled:
        """`program` before its memory is checked against the plan."""
        return self.program_lowered.compile()

    @functools.cached_property
    def program(self) -> jax.stages.Compiled:
        """The compiled program whose memory holds the step's activations, checked."""
        return self.checked(self.program_compiled)

    def reuse_program(self, other: "_Offloaded") -> bool:
        """Takes `other`'s compiled program when both lower to the same one (a plan made
        again for the compiled step's temporaries, whose choices leave the program as it
        was): XLA need not compile it twice."""
        if self.program_lowered.as_text() != other.program_lowered.as_text():
            return False
        self.program_compiled = other.program_compiled
        return True

    def flat(self, tree) -> list:
        """`tree` as the streamed update's flat list over the params' leaves."""
        return as_flat(self.setup.stacked, tree)

    def unflat(self, step, flat_trees, comm=None) -> TrainState:
        """The train state at `step` from the streamed update's flat (masters, states,
        compute copy)."""
        return from_flat(self.setup.stacked, step, flat_trees, comm)


def _finish_grads(s: StepSetup, step: jax.Array, metrics, grads):
    """`OffloadedStep.grads_of_batch`'s result from the batch's metrics and grads: (step + 1,
    grads, their clipping scale, metrics with the grad norm and learning rate), traced."""
    norm = global_norm(grads, s.stacked, s.offload.chunks_in_flight)
    metrics.update(grad_norm=norm, lr=s.learning_rate(step))
    return step + 1, grads, s.optimizer.clip_scale(norm), metrics


class MicrobatchPrograms:
    """The programs of `OffloadedStep`'s step a microbatch at a time: one adds a microbatch's
    grads to float32 sums, one ends the step from the sums. They depend on the setup alone;
    the step dispatches them and checks them against the plan."""

    def __init__(self, setup: StepSetup, replicated: NamedSharding):
        self.setup, self.replicated = setup, replicated

    @functools.cached_property
    def sums_sharding(self):
        """The microbatch sums' (metrics, float32 grads) shardings."""
        return (self.replicated, self.setup.grad_sharding)

    @functools.cached_property
    def sums_shapes(self):
        s = self.setup
        rows, width = s.batch_shape
        mb = jax.ShapeDtypeStruct((rows // s.microbatches, width), jnp.int32)
        with sharding.use_rules(s.mesh, s.rules):
            shapes = jax.eval_shape(s.grads.zero_sums, s.abstract_state.compute_params, mb)
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
            shapes,
            jax.tree.broadcast(self.sums_sharding, shapes),
        )

    @functools.cached_property
    def microbatch_jitted(self):
        """(compute params, batch, j, sums) -> sums with microbatch j's (donated)."""
        s = self.setup
        return jax.jit(
            s.grads.add_microbatch,
            in_shardings=(
                s.state_sharding.compute_params,
                s.batch_sharding,
                self.replicated,
                self.sums_sharding,
            ),
            out_shardings=self.sums_sharding,
            donate_argnums=3,
        )

    @functools.cached_property
    def zero_sums(self):
        def zero_sums():  # Named: a profile or an error names the program by it.
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self.sums_shapes)

        return jax.jit(zero_sums, out_shardings=self.sums_sharding)

    @functools.cached_property
    def finish_lowered(self) -> jax.stages.Lowered:
        """(step, sums) -> `grads_of_batch`'s result but the grads (the sums' own, not passed
        through: a program's output that only aliases its input is one more way to copy it),
        lowered from shapes."""
        s = self.setup

        def finish(step, sums):
            metrics, grads = sums
            step, _, scale, metrics = _finish_grads(s, step, s.grads.mean_metrics(metrics), grads)
            return step, scale, metrics

        sharded = self.replicated
        jitted = jax.jit(
            finish, in_shardings=(sharded, self.sums_sharding), out_shardings=(sharded,) * 3
        )
        with sharding.use_rules(s.mesh, s.rules):
            return jitted.lower(s.abstract_state.step, self.sums_shapes)


class _BetweenMicrobatches:
    """`OffloadedStep`'s step a microbatch at a time, for a delayed update dispatched between
    the next step's microbatches (`Plan.update_between_microbatches`): the programs of
    `MicrobatchPrograms` dispatched, the one that ends the step checked against the plan."""

    @functools.cached_property
    def microbatch_programs(self) -> MicrobatchPrograms:
        """The programs dispatched a microbatch at a time, made at their first use."""
        return MicrobatchPrograms(self.setup, self.replicated)

    @functools.cached_property
    def finish_compiled(self) -> jax.stages.Compiled:
        """`finish_program` before its memory is checked against the plan."""
        return self.microbatch_programs.finish_lowered.compile()

    @functools.cached_property
    def finish_program(self) -> jax.stages.Compiled:
        """With the update between microbatches, the program that ends the step (the grad
        norm, clipping scale and metrics from the microbatches' sums), compiled and checked
        against the plan."""
        compiled = self.finish_compiled
        # Raises CompiledTooLarge: its temporaries, like a microbatch's, are the step's.
        if self.checks_compiled:
            self.setup.check(compiled.memory_analysis())
        return compiled

    def reuse_program(self, other: "_Offloaded") -> bool:
        """`_Offloaded.reuse_program`, and with the update between microbatches in both the
        program that ends the step too (checked against this plan when used)."""
        if not super().reuse_program(other):
            return False
        finish = self.between_microbatches and getattr(other, "between_microbatches", False)
        text = lambda form: form.microbatch_programs.finish_lowered.as_text()
        if finish and text(self) == text(other):
            self.finish_compiled = other.finish_compiled
        return True

    def _microbatched(self, step, compute_params, batch_BT1, between=lambda j: None):
        """`grads_of_batch` dispatched a program a microbatch, `between(j)` called after
        microbatch j's."""
        microbatch = self.program  # Checked against the plan.
        sums = self.microbatch_programs.zero_sums()
        for j in range(self.setup.microbatches):
            dispatch.mark(dispatch.MICROBATCH)
            sums = microbatch(compute_params, batch_BT1, layer_index(self.setup.mesh, j), sums)
            between(j)
        step, scale, metrics = self.finish_program(step, sums)
        return step, sums[1], scale, metrics

    def _beside_microbatches(self, state: TrainState, batch_BT1, fetched):
        """`grad_step` on `batch_BT1` with the waiting update dispatched between its
        microbatches: (step + 1, grads, clipping scale, metrics, the updated state)."""
        micro = self.setup.microbatches
        between, updated = self.updater.between_microbatches(state, fetched, micro)
        out = self._microbatched(state.step, state.compute_params, batch_BT1, between)
        return *out, updated()


class OffloadedStep(_BetweenMicrobatches, _Offloaded):
    """A compiled forward/backward (`grad_step`), then the streamed update of the offloaded
    state (`apply`; `OffloadedUpdate`, which with config.offload.delayed_update keeps the
    update of step t's grads waiting for step t+1's forward/backward, and fetches the
    update's first chunks before it is dispatched). The guarded step reads the loss and grad
    norm on the host (one sync a step) before the update, which it leaves out when they are
    anomalous.

    With microbatches the plan may run the waiting update between step t+1's microbatches
    instead (`Plan.update_between_microbatches`): the forward/backward is then one program a
    microbatch, and the update's groups are dispatched between them (`StreamedUpdate.slots`),
    so that their copies each way and their kernels run beside the microbatches'."""

    def __init__(self, setup: StepSetup):
        super().__init__(setup)
        self.between_microbatches = self.offload.between_microbatches
        self.updater = OffloadedUpdate(
            self.streamed, setup.stacked, self.offload.delayed, setup.mesh, setup.rules
        )

    def settle(self, state: TrainState, fetched=None) -> TrainState:
        return self.updater.settle(state, fetched)

    def discard(self) -> None:
        self.updater.discard()

    def apply(self, state: TrainState, step, grads, scale, on_cpu=None, fetched=None):
        """The offloaded state after its streamed update with `grads` (`OffloadedUpdate.apply`)."""
        return self.updater.apply(state, step, grads, scale, on_cpu, fetched)

    def grads_of_batch(self, step: jax.Array, compute_params, batch_BT1: jax.Array):
        """(step + 1, grads, their clipping scale, metrics), traced. The compute copy gives
        the same grads as the masters would (the model casts them to the compute dtype either
        way), in the compute dtype."""
        metrics, grads = self.setup.grads.loss_and_grads(compute_params, batch_BT1)
        return _finish_grads(self.setup, step, metrics, grads)

    @functools.cached_property
    def program_lowered(self) -> jax.stages.Lowered:
        """The forward/backward, or with the update between microbatches one microbatch's."""
        s, replicated = self.setup, self.replicated
        state = s.abstract_state
        if self.between_microbatches:
            j = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            sums = self.microbatch_programs.sums_shapes
            args = (state.compute_params, self.abstract_batch(), j, sums)
            jitted = self.microbatch_programs.microbatch_jitted
        else:
            args = (state.step, state.compute_params, self.abstract_batch())
            jitted = jax.jit(
                self.grads_of_batch,
                in_shardings=(replicated, s.state_sharding.compute_params, s.batch_sharding),
                # Grads stay where `loss_and_grads` put them (streamed layers' in host memory).
                out_shardings=(replicated, None, replicated, replicated),
            )
        with self.rules():
            return jitted.lower(*args)

    @functools.cached_property
    def program(self) -> jax.stages.Compiled:
        """`_Offloaded.program`; with the update between microbatches also the program that
        ends the step (the grad norm), compiled and checked against the plan too: its
        temporaries take the microbatch's place."""
        program = self.checked(self.program_compiled)
        if self.between_microbatches:
            _ = self.finish_program
        return program

    @functools.cached_property
    def grad_step(self):
        """(step, compute params, batch) -> (step + 1, grads, clipping scale, metrics): the
        offloaded step's `program`, or with the update between microbatches a program a
        microbatch (`_microbatched`)."""
        return self._microbatched if self.between_microbatches else self.program

    def lowered(self):
        raise ConfigError("lowered_train_step: the offloaded step is not one program")

    @functools.cached_property
    def train_step(self):
        _ = self.program  # Compiled and checked now, before the state is allocated.

        def run(state, batch):
            with self.rules():
                fetched = self.updater.prefetch(state)
                step, grads, scale, metrics, state = self._grad_step_settled(state, batch, fetched)
                return self.updater.after_step(state, step, grads, scale, fetched), metrics

        return run

    def _grad_step_settled(self, state: TrainState, batch_BT1, fetched):
        """`grad_step`'s result and the state with a waiting (delayed) update applied: queued
        behind this step's compute, or between its microbatches."""
        if self.updater.pending is not None and self.between_microbatches:
            return self._beside_microbatches(state, batch_BT1, fetched)
        out = self.grad_step(state.step, state.compute_params, batch_BT1)
        return *out, self.settle(state, fetched)

    @functools.cached_property
    def guarded_train_step(self):
        _ = self.program  # Compiled and checked now, before the state is allocated.

        def run(state, batch, ceiling):
            with self.rules():
                fetched = self.updater.prefetch(state)
                # Delayed: the last step's update, before this one's loss is read.
                step, grads, scale, metrics, state = self._grad_step_settled(state, batch, fetched)
                loss, norm = (
                    float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"]))
                )
                ok = np.isfinite(loss) and np.isfinite(norm) and loss <= ceiling
                metrics["skipped"] = np.int32(not ok)
                if not ok:  # Prefetched chunks are dropped: their host copies stay.
                    return state.replace(step=step), metrics
                return self.updater.after_step(state, step, grads, scale, fetched), metrics

        return run


# XLA:GPU's scheduler keeps at most this many of a program's asynchronous copies open at once
# (its default, 2, lets one fetch and one copy home run together). With 8, the in-step
# update's copies ran beside compute kernels twice as much of their time, and llama_1b's
# step took 10% less.
COPIES_IN_FLIGHT = {"xla_gpu_experimental_parallel_async_compute_limit": 8}


def _speculating(compiled, exact, grad_clip: float, redo):
    """The speculating step: the compiled step, then its speculation checked (one sync a
    step). When the step clipped, its update is made again from the old state with the
    clipped grads (`redo(state, step, grads, scale)`: the streamed update, after the step);
    when it was anomalous, the old state stays. metrics["update_redone"] is 1 for a step
    updated again.

    A step after one that clipped runs the exact program instead (`exact()`), which waits
    for the norm but pays no redo (for llama_1b about 13% less than a speculated step
    redone), until a step does not clip: norms change little from one step to the next.
    metrics["speculated"] says which program ran."""
    clip = np.float32(grad_clip)  # As the step compares its norm.
    clipped = False  # Whether the last step clipped: the next runs `exact`.

    def run(state, batch, *ceiling):
        nonlocal clipped
        if clipped:
            new, metrics = exact()(state, batch, *ceiling)
            norm, skipped = jax.device_get((metrics["grad_norm"], metrics.get("skipped", 0)))
            clipped = bool(norm > clip and not skipped)
            metrics.update(speculated=np.int32(0), update_redone=np.int32(0))
            return new, metrics
        new, metrics, (grads, scale, held) = compiled(state, batch, *ceiling)
        metrics["speculated"] = np.int32(1)
        if jax.device_get(held):
            metrics["update_redone"] = np.int32(0)
            # The old state goes, as a donated one would (JAX may pass an unchanged
            # input through as an output: those stay).
            kept = {id(x) for x in jax.tree.leaves(new)}
            for x in jax.tree.leaves(state):
                if id(x) not in kept:
                    x.delete()
            return new, metrics
        step, new = new.step, None  # The speculated state goes.
        skipped = bool(ceiling) and bool(jax.device_get(metrics["skipped"]))
        metrics["update_redone"] = np.int32(not skipped)
        clipped = not skipped  # An anomalous step says nothing of the next one's norm.
        if skipped:
            return state.replace(step=step), metrics
        return redo(state, step, grads, scale), metrics

    return run


class _Speculation:
    """`InStepUpdate`'s speculating step (config.offload.speculative_update): every chunk
    updated as if the step neither clips nor is anomalous, the speculation checked after the
    step (`_speculating`), and the exact program that follows a step that clipped."""

    @property
    def runs_exact_steps(self) -> bool:
        """Whether a speculating step may be followed by exact ones (`_speculating`): when it
        can clip."""
        return self.speculative and self.setup.grad_clip > 0

    @functools.cached_property
    def exact_lowered(self) -> jax.stages.Lowered:
        """The exact step that follows a clipped speculating one (`_speculating`)."""
        return self._lowered(self.guarded, speculate=False)

    @functools.cached_property
    def exact_compiled(self) -> jax.stages.Compiled:
        return self.exact_lowered.compile(compiler_options=COPIES_IN_FLIGHT)

    def program_that_ran(self, speculated: list[int]) -> jax.stages.Compiled:
        """The program steps whose metrics["speculated"] were `speculated` ran: the exact
        one when none speculated (each followed a clipped step), else `program`."""
        return self.exact_compiled if speculated and not any(speculated) else self.program

    def _exact(self, guarded: bool):
        """() -> the exact program of the step's `guarded` form (`_speculating`'s `exact`),
        compiled and checked against the plan at its first use."""

        @functools.cache  # The loop's own form was compiled with `program`.
        def exact():
            if guarded == self.guarded:
                return self.exact_compiled
            lowered = self._lowered(guarded, speculate=False)
            return self.checked(lowered.compile(compiler_options=COPIES_IN_FLIGHT))

        return exact

    def _redo(self, state: TrainState, step, grads, scale) -> TrainState:
        """A clipped speculating step's update made again from the old `state` with the
        clipped grads: the streamed update, after the step."""
        flat = [self.flat(t) for t in (state.params, state.opt_state, state.compute_params)]
        with self.rules():
            new = self.streamed(self.flat(grads), scale, *flat)
        return self.unflat(step, new, state.comm)


def _updated_in_step(
    s: StepSetup, chunks: list[Chunk], order, state, batch_BT1, ceiling, speculate
):
    """`InStepUpdate.update`, traced: the grads, their global norm, and every chunk's update
    (`stream.update_in_step`), which waits for the norm unless it speculates."""
    metrics, grads = s.grads.loss_and_grads(state.compute_params, batch_BT1)
    in_flight = s.offload.chunks_in_flight
    norm = global_norm(grads, s.stacked, in_flight)
    ok, scale = None, s.optimizer.clip_scale(norm)
    if ceiling is not None:
        skipped = is_anomalous(metrics["loss"], norm, ceiling)
        ok, metrics["skipped"] = ~skipped, skipped.astype(jnp.int32)
    used_scale = scale
    if speculate:  # Nothing below may wait for the norm.
        held = scale == 1 if ok is None else ok & (scale == 1)
        ok, used_scale = None, jnp.ones((), jnp.float32)
    trees = (grads, state.params, state.opt_state, state.compute_params)
    flat = [as_flat(s.stacked, t) for t in trees]
    new = update_in_step(
        s.optimizer,
        chunks,
        order,
        flat[0],
        used_scale,
        *flat[1:],
        in_flight,
        ok,
    )
    metrics.update(grad_norm=norm, lr=s.learning_rate(state.step))
    new = from_flat(s.stacked, state.step + 1, new, state.comm)
    if speculate:
        return new, metrics, (grads, scale, held)
    return new, metrics


class InStepUpdate(_Speculation, _Offloaded):
    """config.offload.update_in_step: the offloaded update traced into the forward/backward's
    program (`stream.update_in_step`), one program a step. With the layers unrolled, XLA
    compiles each chunk's host copies as asynchronous copies (copy-start/copy-done) that its
    scheduler may run beside the compute, where a scanned layer's copies are synchronous
    (experiments/fused_update_probe.py). A chunk's update waits for its grad, and for the
    global grad norm when it clips (config.train.grad_clip) or skips anomalous steps
    (config.monitor.on_anomaly=skip), unless it speculates (config.offload.speculative_update,
    `_Speculation`): then a step that clips or is anomalous is updated again after it, from
    the old state the step kept. The math is the streamed update's."""

    def __init__(self, setup: StepSetup):
        super().__init__(setup)
        self.order = self.offload.order
        self.guarded = setup.skips_anomalies
        self.speculative = self.offload.speculative

    @property
    def waits_for_the_norm(self) -> list[str]:
        """The settings that make every chunk's update wait for the step's global grad norm,
        so that the update runs after the backward pass, not beside it."""
        waits = []
        if self.speculative:
            return waits
        if self.setup.grad_clip > 0:
            waits.append(f"config.train.grad_clip={self.setup.grad_clip:g}")
        if self.guarded:
            waits.append("config.monitor.on_anomaly=skip")
        return waits

    def update(
        self,
        state: TrainState,
        batch_BT1: jax.Array,
        ceiling: jax.Array | None = None,
        speculate: bool = False,
    ):
        """(state, batch[, loss ceiling]) -> (next state, metrics), traced; with a ceiling the
        update of an anomalous step is left out. Speculating, it returns as well what
        `_speculating` needs: (grads, clipping scale, whether the speculation held)."""
        chunks = self.streamed.chunks
        return _updated_in_step(
            self.setup, chunks, self.order, state, batch_BT1, ceiling, speculate
        )

    def _lowered(self, guarded: bool, speculate: bool | None = None) -> jax.stages.Lowered:
        """The step as a program: guarded or not; speculating (`speculate`, by default
        config.offload.speculative_update) or exact."""
        speculate = self.speculative if speculate is None else speculate
        s, replicated = self.setup, self.replicated
        args = [s.abstract_state, self.abstract_batch()]
        shardings = [s.state_sharding, s.batch_sharding]
        if guarded:
            args.append(jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated))
            shardings.append(replicated)
        outs = (s.state_sharding, replicated)
        if speculate:  # Grads stay where `loss_and_grads` put them.
            outs += ((None, replicated, replicated),)
        jitted = jax.jit(
            functools.partial(self.update, speculate=speculate),
            in_shardings=tuple(shardings),
            out_shardings=outs,
            # Speculating, the old state stays until the step is validated.
            donate_argnums=() if speculate else 0,
        )
        with self.rules():
            return jitted.lower(*args)

    @functools.cached_property
    def program_lowered(self) -> jax.stages.Lowered:
        """The whole step in the form the loop runs (guarded when it skips anomalies)."""
        return self._lowered(self.guarded)

    @functools.cached_property
    def program_compiled(self) -> jax.stages.Compiled:
        return self.program_lowered.compile(compiler_options=COPIES_IN_FLIGHT)

    @functools.cached_property
    def program(self) -> jax.stages.Compiled:
        """The step's program, checked; with exact steps to follow a clipped speculating one,
        their program is compiled and checked with it (in `build`, before anything is
        allocated), and the larger excess over the plan's estimate stands."""
        compiled = self.checked(self.program_compiled)
        if self.runs_exact_steps:
            speculating = self.beyond_estimate
            self.checked(self.exact_compiled)
            self.beyond_estimate = max(speculating, self.beyond_estimate)
        return compiled

    def reuse_program(self, other: "_Offloaded") -> bool:
        if not super().reuse_program(other):
            return False
        if self.runs_exact_steps and self.exact_lowered.as_text() == other.exact_lowered.as_text():
            self.exact_compiled = other.exact_compiled
        return True

    def lowered(self) -> jax.stages.Lowered:
        return self._lowered(False)

    def _compiled(self, guarded: bool):
        if guarded == self.guarded:
            compiled = self.program
        else:
            compiled = self.checked(
                self._lowered(guarded).compile(compiler_options=COPIES_IN_FLIGHT)
            )
        if not self.speculative:
            return compiled
        return _speculating(compiled, self._exact(guarded), self.setup.grad_clip, self._redo)

    @functools.cached_property
    def train_step(self):
        return self._compiled(False)

    @functools.cached_property
    def guarded_train_step(self):
        compiled = self._compiled(True)
        return lambda state, batch, ceiling: compiled(state, batch, self.ceiling_array(ceiling))


def backward_order(
    pieces: Pieces, model_config, compute_params, chunks: list[Chunk], mesh: Mesh, rules
) -> list[int]:
    """The streamed update's `chunks` (unstacked weights) in the order the backward pass
    finishes their grads: the weights outside the layers that the embedding does not read
    (final norm, LM head), the layers last to first, then the weights the embedding reads
    (a tied LM head's included). `compute_params`: the abstract compute copy."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    with sharding.use_rules(mesh, rules):
        embed = lambda p, t: pieces.embed(model_config, p, t, 0)
        jaxpr = jax.make_jaxpr(embed)(compute_params, tokens).jaxpr
    read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jax.extend.core.Var)}
    read |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    embedding = {w for w, v in enumerate(jaxpr.invars[:-1]) if v in read}
    layer = re.compile(re.escape(pieces.unrolled_name).replace(re.escape("{}"), r"(\d+)"))

    def key(k):
        c = chunks[k]
        found = layer.fullmatch(str(c.path[0].key))
        if found:
            return (1, -int(found.group(1)))
        return (2, 0) if c.weight in embedding else (0, 0)

    return sorted(range(len(chunks)), key=key)
