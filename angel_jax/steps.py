"""The train step, in one of three forms behind one signature, chosen by the ZeRO-Cache plan:
`DeviceStep` (masters and optimizer state on the device: one compiled program),
`OffloadedStep` (the optimizer state in host memory or on SSD: a compiled forward/backward,
then the streamed update of every chunk) and `InStepUpdate` (config.offload.update_in_step:
the offloaded update inside the forward/backward's program). Each gives `train_step(state,
batch) -> (state, metrics)` and `guarded_train_step(state, batch, loss ceiling)`, which drops
an anomalous step's update (`monitor.is_anomalous`). The grads come from `exp.grads`
(angel_jax/grads.py) each way.
"""

import functools
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import dispatch, machine, sharding
from angel_jax.config import ConfigError
from angel_jax.data.objectives import row_width
from angel_jax.monitor import is_anomalous, skip_if_anomalous
from angel_jax.offload.planner import check_compiled
from angel_jax.offload.stream import global_norm, layer_index, update_in_step
from angel_jax.optim import learning_rate_schedule
from angel_jax.state_layout import TrainState


class _Step:
    """What both forms share: the abstract batch, ahead-of-time compilation, the ceiling."""

    def __init__(self, exp):
        self.exp = exp
        self.replicated = NamedSharding(exp.mesh, P())
        self._ceiling = {}  # The loss ceiling's device copy, made again only when it changes.
        self.pending = None  # An update that waits (`OffloadedStep`'s delayed update).
        # The last checked program's temporaries beyond the plan's estimate (`check_compiled`).
        self.beyond_estimate = 0

    def abstract_batch(self):
        t = self.exp.config.train
        # Inputs and, shifted by one, targets; or the objective's fields side by side.
        shape = (t.batch_size, row_width(self.exp.config))
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.exp.batch_sharding)

    def compile(self, jitted, *abstract_args):
        """Compiles ahead of time, from shapes alone: `train_step` is built before the state
        is allocated, so XLA's GPU autotuner has the device's memory to try kernels in (a
        state filled to the planner's budget leaves it too little: the H200 capacity runs
        failed to compile so). The compiled program's memory is checked against the plan,
        on a CPU too when the budget is the machine's own (its RAM): XLA:CPU's f32 widening of
        bf16 work is then what it will allocate. A device budget set in config.offload on a
        CPU stands for another machine's (tests emulate GPU budgets so), which CPU sizes do
        not tell."""
        with sharding.use_rules(self.exp.mesh, self.exp.rules):
            return self.checked(jitted.lower(*abstract_args).compile())

    def checked(self, compiled: jax.stages.Compiled) -> jax.stages.Compiled:
        """`compiled`, once its memory is checked against the plan (see `compile`)."""
        if self.checks_compiled:
            self.beyond_estimate = check_compiled(self.exp.plan, compiled.memory_analysis())
        return compiled

    @property
    def checks_compiled(self) -> bool:
        """Whether `compile` checks the program against the plan (see there)."""
        return machine.backend() != "cpu" or self.exp.config.offload.device_gib <= 0

    def settle(self, state: TrainState) -> TrainState:
        """`state` with any update still waiting applied (`OffloadedStep`'s delayed update)."""
        return state

    def discard(self) -> None:
        """Drops an update still waiting (a rollback's)."""
        self.pending = None

    def ceiling_array(self, ceiling: float) -> jax.Array:
        value = np.float32(min(ceiling, np.finfo(np.float32).max))
        if self._ceiling.get("value") != value:
            with jax.transfer_guard_host_to_device("allow"):  # One scalar, on purpose.
                array = jax.make_array_from_callback((), self.replicated, lambda _: value)
                self._ceiling.update(value=value, array=array)
        return self._ceiling["array"]


class DeviceStep(_Step):
    """The whole step in one compiled program, the state donated."""

    def update(self, state: TrainState, batch_BT1: jax.Array):
        """(state, batch) -> (next state, metrics), traced."""
        exp, comm = self.exp, state.comm
        if exp.powersgd:
            metrics, grads, comm = exp.grads.powersgd(state, batch_BT1)
        else:
            metrics, grads = exp.grads.loss_and_grads(state.params, batch_BT1)
        params, opt_state, norm = exp.optimizer.update(
            grads, state.opt_state, state.params, exp.stacked
        )
        metrics.update(grad_norm=norm, lr=learning_rate_schedule(exp.config.train)(state.step))
        return TrainState(state.step + 1, params, opt_state, None, comm), metrics

    @functools.cached_property
    def _jitted(self):
        exp = self.exp
        return jax.jit(
            self.update,
            in_shardings=(exp.state_sharding, exp.batch_sharding),
            out_shardings=(exp.state_sharding, self.replicated),
            donate_argnums=0,
        )

    def lowered(self) -> jax.stages.Lowered:
        """The step lowered from shapes (not compiled): its StableHLO holds the program as JAX
        wrote it (dtypes of every dot, before XLA's rewrites)."""
        with sharding.use_rules(self.exp.mesh, self.exp.rules):
            return self._jitted.lower(self.exp.abstract_state, self.abstract_batch())

    @functools.cached_property
    def train_step(self):
        return self.compile(self._jitted, self.exp.abstract_state, self.abstract_batch())

    @functools.cached_property
    def guarded_program(self) -> jax.stages.Compiled:
        """`guarded_train_step`'s compiled program: (state, batch, ceiling array)."""
        exp = self.exp
        jitted = jax.jit(
            skip_if_anomalous(self.update),
            in_shardings=(exp.state_sharding, exp.batch_sharding, self.replicated),
            out_shardings=(exp.state_sharding, self.replicated),
            donate_argnums=0,
        )
        ceiling = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
        return self.compile(jitted, exp.abstract_state, self.abstract_batch(), ceiling)

    @functools.cached_property
    def guarded_train_step(self):
        compiled = self.guarded_program
        return lambda state, batch, ceiling: compiled(state, batch, self.ceiling_array(ceiling))


class _Offloaded(_Step):
    """What both offloaded forms share: the program `build` compiles and checks against the
    plan before anything is allocated (`program`), and the params-shaped trees as the
    streamed update's flat lists."""

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

    def _flat(self, tree) -> list:
        """`tree` as the streamed update's flat list over the params' leaves."""
        return jax.tree.structure(self.exp.stacked).flatten_up_to(tree)


class OffloadedStep(_Offloaded):
    """A compiled forward/backward (`grad_step`), then the streamed update of the offloaded
    state (`apply`). The guarded step reads the loss and grad norm on the host (one sync a
    step) before the update, which it leaves out when they are anomalous.

    With config.offload.delayed_update the update of step t's grads waits (`pending`): the
    host cores' share starts at once (its grads' copies down queued before step t+1, so they
    and the host's update run beside it), and the device's share runs after step t+1's
    forward/backward is dispatched (queued behind it); `settle` finishes a waiting update
    (before a checkpoint).

    With microbatches the plan may run the waiting update between step t+1's microbatches
    instead (`Plan.update_between_microbatches`): the forward/backward is then one program a
    microbatch, and the update's groups are dispatched between them (`StreamedUpdate.slots`),
    so that their copies each way and their kernels run beside the microbatches'. The update
    writes the new compute copy into new arrays, which the step's microbatches do not read:
    step t+1 computes on the weights without step t's update, as the delay asks.

    Either way the update's first chunks are fetched (`StreamedUpdate.prefetch`) before the
    forward/backward is dispatched, so their copies run beside it."""

    def __init__(self, exp):
        super().__init__(exp)
        # pending: (grads, clipping scale, the host's share as started).
        self.delayed = exp.config.offload.delayed_update
        self.between_microbatches = self.delayed and exp.plan.update_between_microbatches

    def settle(self, state: TrainState, fetched=None) -> TrainState:
        if self.pending is None:
            return state
        (grads, scale, on_cpu), self.pending = self.pending, None
        with sharding.use_rules(self.exp.mesh, self.exp.rules):
            return self.apply(state, state.step, grads, scale, on_cpu, fetched)

    def _prefetch(self, state: TrainState):
        """The next update's first chunks on their way to the device (the waiting update's if
        delayed): called before a forward/backward is dispatched."""
        if self.delayed and self.pending is None:
            return None
        flat = (self._flat(t) for t in (state.params, state.opt_state))
        return self.exp.streamed_update.prefetch(*flat)

    def discard(self) -> None:
        # The host's share runs on: let it finish before the restore writes its chunks.
        for _, done in self.pending[2] if self.pending else []:
            done.result()
        self.pending = None
        self.exp.streamed_update.drain()  # The old state's copies home, before it goes.

    def _update(self, state: TrainState, step, grads, scale, fetched) -> TrainState:
        """`apply` now, or (delayed) the update made the pending one, its host share started."""
        if not self.delayed:
            return self.apply(state, step, grads, scale, fetched=fetched)
        update = self.exp.streamed_update
        on_cpu = update.start_on_cpu(self._flat(grads), scale, self._flat(state.compute_params))
        self.pending = (grads, scale, on_cpu)
        return state.replace(step=step)

    def _grad_step(self, step: jax.Array, compute_params, batch_BT1: jax.Array):
        """(step + 1, grads, their clipping scale, metrics). The compute copy gives the same
        grads as the masters would (the model casts them to the compute dtype either way), in
        the compute dtype."""
        metrics, grads = self.exp.grads.loss_and_grads(compute_params, batch_BT1)
        return self._finish(step, metrics, grads)

    def _finish(self, step: jax.Array, metrics, grads):
        """`_grad_step`'s result from the batch's metrics and grads."""
        exp = self.exp
        norm = global_norm(grads, exp.stacked, exp.config.offload.chunks_in_flight)
        metrics.update(grad_norm=norm, lr=learning_rate_schedule(exp.config.train)(step))
        return step + 1, grads, exp.optimizer.clip_scale(norm), metrics

    @functools.cached_property
    def program_lowered(self) -> jax.stages.Lowered:
        """The forward/backward, or with the update between microbatches one microbatch's."""
        exp, replicated = self.exp, self.replicated
        state = exp.abstract_state
        if self.between_microbatches:
            j = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            args = (state.compute_params, self.abstract_batch(), j, self._sums_shapes)
            jitted = self._microbatch_jitted
        else:
            args = (state.step, state.compute_params, self.abstract_batch())
            jitted = jax.jit(
                self._grad_step,
                in_shardings=(replicated, exp.state_sharding.compute_params, exp.batch_sharding),
                # Grads stay where `loss_and_grads` put them (streamed layers' in host memory).
                out_shardings=(replicated, None, replicated, replicated),
            )
        with sharding.use_rules(exp.mesh, exp.rules):
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

    # A step a microbatch at a time (the update between microbatches).

    @functools.cached_property
    def _sums_sharding(self):
        """The microbatch sums' (metrics, float32 grads) shardings."""
        return (self.replicated, self.exp.grad_sharding)

    @functools.cached_property
    def _sums_shapes(self):
        exp = self.exp
        t = exp.config.train
        mb = jax.ShapeDtypeStruct(
            (t.batch_size // t.microbatches, row_width(exp.config)), jnp.int32
        )
        with sharding.use_rules(exp.mesh, exp.rules):
            shapes = jax.eval_shape(exp.grads.zero_sums, exp.abstract_state.compute_params, mb)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            jax.tree.broadcast(self._sums_sharding, shapes),
        )

    @functools.cached_property
    def _microbatch_jitted(self):
        """(compute params, batch, j, sums) -> sums with microbatch j's (donated)."""
        exp = self.exp
        return jax.jit(
            exp.grads.add_microbatch,
            in_shardings=(
                exp.state_sharding.compute_params,
                exp.batch_sharding,
                self.replicated,
                self._sums_sharding,
            ),
            out_shardings=self._sums_sharding,
            donate_argnums=3,
        )

    @functools.cached_property
    def _zero_sums(self):
        def zero_sums():  # Named: a profile or an error names the program by it.
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self._sums_shapes)

        return jax.jit(zero_sums, out_shardings=self._sums_sharding)

    @functools.cached_property
    def _finish_jitted(self):
        """(step, sums) -> `_grad_step`'s result but the grads (the sums' own, not passed
        through: a program's output that only aliases its input is one more way to copy it)."""

        def finish(step, sums):
            metrics, grads = sums
            step, _, scale, metrics = self._finish(
                step, self.exp.grads.mean_metrics(metrics), grads
            )
            return step, scale, metrics

        sharded = self.replicated
        return jax.jit(
            finish, in_shardings=(sharded, self._sums_sharding), out_shardings=(sharded,) * 3
        )

    @functools.cached_property
    def _finish_lowered(self) -> jax.stages.Lowered:
        exp = self.exp
        with sharding.use_rules(exp.mesh, exp.rules):
            return self._finish_jitted.lower(exp.abstract_state.step, self._sums_shapes)

    @functools.cached_property
    def _finish_unchecked(self) -> jax.stages.Compiled:
        return self._finish_lowered.compile()

    @functools.cached_property
    def finish_program(self) -> jax.stages.Compiled:
        """With the update between microbatches, the program that ends the step (the grad
        norm, clipping scale and metrics from the microbatches' sums), compiled and checked
        against the plan."""
        compiled = self._finish_unchecked
        # Raises CompiledTooLarge: its temporaries, like a microbatch's, are the step's.
        if self.checks_compiled:
            check_compiled(self.exp.plan, compiled.memory_analysis())
        return compiled

    def reuse_program(self, other: "_Offloaded") -> bool:
        """`_Offloaded.reuse_program`, and with the update between microbatches in both the
        program that ends the step too (checked against this plan when used)."""
        if not super().reuse_program(other):
            return False
        finish = self.between_microbatches and getattr(other, "between_microbatches", False)
        if finish and self._finish_lowered.as_text() == other._finish_lowered.as_text():
            self._finish_unchecked = other._finish_unchecked
        return True

    def _microbatched(self, step, compute_params, batch_BT1, between=lambda j: None):
        """`_grad_step` dispatched a program a microbatch, `between(j)` called after
        microbatch j's."""
        microbatch = self.program  # Checked against the plan.
        sums = self._zero_sums()
        for j in range(self.exp.config.train.microbatches):
            dispatch.mark(dispatch.MICROBATCH)
            sums = microbatch(compute_params, batch_BT1, layer_index(self.exp.mesh, j), sums)
            between(j)
        step, scale, metrics = self.finish_program(step, sums)
        return step, sums[1], scale, metrics

    def _beside_microbatches(self, state: TrainState, batch_BT1, fetched):
        """`grad_step` on `batch_BT1` with the waiting update dispatched between its
        microbatches: (step + 1, grads, clipping scale, metrics, the updated state)."""
        (grads, scale, on_cpu), self.pending = self.pending, None
        update = self.exp.streamed_update
        stages = update.stages(
            # The grads' only reference: a weight's go after its last group.
            self._flat(grads),
            scale,
            *(self._flat(t) for t in (state.params, state.opt_state, state.compute_params)),
            on_cpu=on_cpu,
            fetched=fetched,
            into_new=True,
        )
        del grads
        next(stages)  # The first groups on their way, before the first microbatch.
        slots = update.slots(self.exp.config.train.microbatches - 1)

        def between(j):  # The last microbatch's copies have nothing to run beside.
            for _ in range(slots[j] if j < len(slots) else 0):
                next(stages)

        out = self._microbatched(state.step, state.compute_params, batch_BT1, between)
        new = update.run_out(stages)
        treedef = jax.tree.structure(self.exp.stacked)
        return *out, TrainState(state.step, *(treedef.unflatten(t) for t in new))

    def apply(self, state: TrainState, step, grads, scale, on_cpu=None, fetched=None):
        """The offloaded state after its streamed update with `grads` (`state` is donated;
        `on_cpu`: its host share, if started already; `fetched`: its prefetched chunks)."""
        flat = [self._flat(t) for t in (grads, state.params, state.opt_state, state.compute_params)]
        new = self.exp.streamed_update(flat[0], scale, *flat[1:], on_cpu=on_cpu, fetched=fetched)
        treedef = jax.tree.structure(self.exp.stacked)
        return TrainState(step, *(treedef.unflatten(t) for t in new))

    def lowered(self):
        raise ConfigError("lowered_train_step: the offloaded step is not one program")

    @functools.cached_property
    def train_step(self):
        exp = self.exp
        _ = self.program  # Compiled and checked now, before the state is allocated.

        def run(state, batch):
            with sharding.use_rules(exp.mesh, exp.rules):
                fetched = self._prefetch(state)
                step, grads, scale, metrics, state = self._grad_step_settled(state, batch, fetched)
                return self._update(state, step, grads, scale, fetched), metrics

        return run

    def _grad_step_settled(self, state: TrainState, batch_BT1, fetched):
        """`grad_step`'s result and the state with a waiting (delayed) update applied: queued
        behind this step's compute, or between its microbatches."""
        if self.pending is not None and self.between_microbatches:
            return self._beside_microbatches(state, batch_BT1, fetched)
        out = self.grad_step(state.step, state.compute_params, batch_BT1)
        return *out, self.settle(state, fetched)

    @functools.cached_property
    def guarded_train_step(self):
        exp = self.exp
        _ = self.program  # Compiled and checked now, before the state is allocated.

        def run(state, batch, ceiling):
            with sharding.use_rules(exp.mesh, exp.rules):
                fetched = self._prefetch(state)
                # Delayed: the last step's update, before this one's loss is read.
                step, grads, scale, metrics, state = self._grad_step_settled(state, batch, fetched)
                loss, norm = (
                    float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"]))
                )
                ok = np.isfinite(loss) and np.isfinite(norm) and loss <= ceiling
                metrics["skipped"] = np.int32(not ok)
                if not ok:  # Prefetched chunks are dropped: their host copies stay.
                    return state.replace(step=step), metrics
                return self._update(state, step, grads, scale, fetched), metrics

        return run


# XLA:GPU's scheduler keeps at most this many of a program's asynchronous copies open at once
# (its default, 2, lets one fetch and one copy home run together). 8 on one H200 (llama_1b
# in-step, 32 x 2048 tokens, two jobs): 1.026 s a step against 1.145 s, the copies beside
# compute kernels 48% of their time against 26% (README "Update inside the step").
COPIES_IN_FLIGHT = {"xla_gpu_experimental_parallel_async_compute_limit": 8}


class InStepUpdate(_Offloaded):
    """config.offload.update_in_step: the offloaded update traced into the forward/backward's
    program (`stream.update_in_step`), one program a step. With the layers unrolled, XLA
    compiles each chunk's host copies as asynchronous copies (copy-start/copy-done) that its
    scheduler may run beside the compute, where a scanned layer's copies are synchronous
    (experiments/fused_update_probe.py, README "Update inside the step"). A chunk's update
    waits for its grad, and for the global grad norm when it clips (config.train.grad_clip) or
    skips anomalous steps (config.monitor.on_anomaly=skip), unless it speculates
    (config.offload.speculative_update): then every chunk is updated as if the step neither
    clips nor is anomalous, and a step that does is updated again after it, from the old
    state the step kept (`_validated`). The math is the streamed update's."""

    def __init__(self, exp):
        super().__init__(exp)
        self.order = backward_order(exp)
        self.guarded = exp.config.monitor.on_anomaly == "skip"
        self.speculative = exp.config.offload.speculative_update

    @property
    def waits_for_the_norm(self) -> list[str]:
        """The settings that make every chunk's update wait for the step's global grad norm,
        so that the update runs after the backward pass, not beside it."""
        c, waits = self.exp.config, []
        if self.speculative:
            return waits
        if c.train.grad_clip > 0:
            waits.append(f"config.train.grad_clip={c.train.grad_clip:g}")
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
        `_validated` needs: (grads, clipping scale, whether the speculation held)."""
        exp = self.exp
        metrics, grads = exp.grads.loss_and_grads(state.compute_params, batch_BT1)
        in_flight = exp.config.offload.chunks_in_flight
        norm = global_norm(grads, exp.stacked, in_flight)
        ok, scale = None, exp.optimizer.clip_scale(norm)
        if ceiling is not None:
            skipped = is_anomalous(metrics["loss"], norm, ceiling)
            ok, metrics["skipped"] = ~skipped, skipped.astype(jnp.int32)
        used_scale = scale
        if speculate:  # Nothing below may wait for the norm.
            held = scale == 1 if ok is None else ok & (scale == 1)
            ok, used_scale = None, jnp.ones((), jnp.float32)
        flat = [self._flat(t) for t in (grads, state.params, state.opt_state, state.compute_params)]
        new = update_in_step(
            exp.optimizer,
            exp.streamed_update.chunks,
            self.order,
            flat[0],
            used_scale,
            *flat[1:],
            in_flight,
            ok,
        )
        metrics.update(grad_norm=norm, lr=learning_rate_schedule(exp.config.train)(state.step))
        treedef = jax.tree.structure(exp.stacked)
        new = TrainState(state.step + 1, *(treedef.unflatten(t) for t in new), state.comm)
        if speculate:
            return new, metrics, (grads, scale, held)
        return new, metrics

    def _lowered(self, guarded: bool, speculate: bool | None = None) -> jax.stages.Lowered:
        """The step as a program: guarded or not; speculating (`speculate`, by default
        config.offload.speculative_update) or exact."""
        speculate = self.speculative if speculate is None else speculate
        exp, replicated = self.exp, self.replicated
        args = [exp.abstract_state, self.abstract_batch()]
        shardings = [exp.state_sharding, exp.batch_sharding]
        if guarded:
            args.append(jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated))
            shardings.append(replicated)
        outs = (exp.state_sharding, replicated)
        if speculate:  # Grads stay where `loss_and_grads` put them.
            outs += ((None, replicated, replicated),)
        jitted = jax.jit(
            functools.partial(self.update, speculate=speculate),
            in_shardings=tuple(shardings),
            out_shardings=outs,
            # Speculating, the old state stays until the step is validated.
            donate_argnums=() if speculate else 0,
        )
        with sharding.use_rules(exp.mesh, exp.rules):
            return jitted.lower(*args)

    @functools.cached_property
    def program_lowered(self) -> jax.stages.Lowered:
        """The whole step in the form the loop runs (guarded when it skips anomalies)."""
        return self._lowered(self.guarded)

    @functools.cached_property
    def program_compiled(self) -> jax.stages.Compiled:
        return self.program_lowered.compile(compiler_options=COPIES_IN_FLIGHT)

    @property
    def runs_exact_steps(self) -> bool:
        """Whether a speculating step may be followed by exact ones (`_validated`): when it
        can clip."""
        return self.speculative and self.exp.config.train.grad_clip > 0

    @functools.cached_property
    def exact_lowered(self) -> jax.stages.Lowered:
        """The exact step that follows a clipped speculating one (`_validated`)."""
        return self._lowered(self.guarded, speculate=False)

    @functools.cached_property
    def exact_compiled(self) -> jax.stages.Compiled:
        return self.exact_lowered.compile(compiler_options=COPIES_IN_FLIGHT)

    def program_that_ran(self, speculated: list[int]) -> jax.stages.Compiled:
        """The program steps whose metrics["speculated"] were `speculated` ran: the exact
        one when none speculated (each followed a clipped step), else `program`."""
        return self.exact_compiled if speculated and not any(speculated) else self.program

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

        @functools.cache  # The loop's own form was compiled with `program`.
        def exact():
            if guarded == self.guarded:
                return self.exact_compiled
            lowered = self._lowered(guarded, speculate=False)
            return self.checked(lowered.compile(compiler_options=COPIES_IN_FLIGHT))

        return self._validated(compiled, exact)

    def _validated(self, compiled, exact):
        """The speculating step: the compiled step, then its speculation checked (one sync a
        step). When the step clipped, its update is made again from the old state with the
        clipped grads (the streamed update, after the step); when it was anomalous, the old
        state stays. metrics["update_redone"] is 1 for a step updated again.

        A step after one that clipped runs the exact program instead (`exact()`), which waits
        for the norm but pays no redo (on one H200 at clip 1.0, 1.285 s a step, where a
        speculated step redone took 1.471 s in another job: README "Speculative update"),
        until a step does not clip: norms change little from one step to the next.
        metrics["speculated"] says which program ran."""
        exp = self.exp
        clip = np.float32(exp.config.train.grad_clip)  # As the step compares its norm.
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
            flat = [self._flat(t) for t in (state.params, state.opt_state, state.compute_params)]
            with sharding.use_rules(exp.mesh, exp.rules):
                masters, states, compute = exp.streamed_update(self._flat(grads), scale, *flat)
            treedef = jax.tree.structure(exp.stacked)
            return TrainState(
                step, *(treedef.unflatten(t) for t in (masters, states, compute)), state.comm
            ), metrics

        return run

    @functools.cached_property
    def train_step(self):
        return self._compiled(False)

    @functools.cached_property
    def guarded_train_step(self):
        compiled = self._compiled(True)
        return lambda state, batch, ceiling: compiled(state, batch, self.ceiling_array(ceiling))


def backward_order(exp) -> list[int]:
    """The streamed update's chunks (unstacked weights) in the order the backward pass
    finishes their grads: the weights outside the layers that the embedding does not read
    (final norm, LM head), the layers last to first, then the weights the embedding reads
    (a tied LM head's included)."""
    from angel_jax.models import family_of  # The models import the trainer's planner.

    pieces, cfg = family_of(exp.config.model).pieces, exp.model_config
    params = exp.abstract_state.compute_params
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    with sharding.use_rules(exp.mesh, exp.rules):
        jaxpr = jax.make_jaxpr(lambda p, t: pieces.embed(cfg, p, t, 0))(params, tokens).jaxpr
    read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jax.extend.core.Var)}
    read |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    embedding = {w for w, v in enumerate(jaxpr.invars[:-1]) if v in read}
    layer = re.compile(re.escape(pieces.unrolled_name).replace(re.escape("{}"), r"(\d+)"))

    def key(k):
        c = exp.streamed_update.chunks[k]
        found = layer.fullmatch(str(c.path[0].key))
        if found:
            return (1, -int(found.group(1)))
        return (2, 0) if c.weight in embedding else (0, 0)

    return sorted(range(len(exp.streamed_update.chunks)), key=key)
