"""The offloaded step's update of the train state with a step's grads: the streamed update of
the offloaded state's chunks (`offload.stream.StreamedUpdate`), at once or, with
config.offload.delayed_update, waiting for the next step (`steps.OffloadedStep` makes the
grads, `OffloadedUpdate` applies them).

Delayed, the update of step t's grads waits (`OffloadedUpdate.pending`): the host cores' share
starts at once (its grads' copies down queued before step t+1, so they and the host's update
run beside it), and the device's share runs after step t+1's forward/backward is dispatched
(queued behind it), or between its microbatches (`OffloadedUpdate.between_microbatches`);
`settle` finishes a waiting update (before a checkpoint). Either way the update's first chunks
are fetched (`StreamedUpdate.prefetch`) before the forward/backward is dispatched, so their
copies run beside it.
"""

import jax
from jax.sharding import Mesh

from angel_jax import sharding
from angel_jax.offload.stream import StreamedUpdate
from angel_jax.state_layout import TrainState


def as_flat(stacked, tree) -> list:
    """`tree` as the streamed update's flat list over the params' leaves (`stacked`: a flag a
    weight, in the params' tree)."""
    return jax.tree.structure(stacked).flatten_up_to(tree)


def from_flat(stacked, step, flat_trees, comm=None) -> TrainState:
    """The train state at `step` from the streamed update's flat (masters, states, compute
    copy)."""
    treedef = jax.tree.structure(stacked)
    return TrainState(step, *(treedef.unflatten(t) for t in flat_trees), comm)


class OffloadedUpdate:
    """The streamed update of the offloaded state with a step's grads, now or waiting for the
    next step: the offloaded step's second half, which holds what waits between steps."""

    def __init__(
        self, streamed: StreamedUpdate, stacked, delayed: bool, mesh: Mesh, rules: sharding.Rules
    ):
        self.streamed, self.stacked, self.delayed = streamed, stacked, delayed
        self.mesh, self.rules = mesh, rules
        self.pending = None  # (grads, clipping scale, the host's share as started).

    def apply(self, state: TrainState, step, grads, scale, on_cpu=None, fetched=None):
        """The offloaded state after its streamed update with `grads` (`state` is donated;
        `on_cpu`: its host share, if started already; `fetched`: its prefetched chunks)."""
        trees = (grads, state.params, state.opt_state, state.compute_params)
        flat = [as_flat(self.stacked, t) for t in trees]
        new = self.streamed(flat[0], scale, *flat[1:], on_cpu=on_cpu, fetched=fetched)
        return from_flat(self.stacked, step, new)

    def settle(self, state: TrainState, fetched=None) -> TrainState:
        """`state` with the waiting update applied, if any."""
        if self.pending is None:
            return state
        (grads, scale, on_cpu), self.pending = self.pending, None
        with sharding.use_rules(self.mesh, self.rules):
            return self.apply(state, state.step, grads, scale, on_cpu, fetched)

    def prefetch(self, state: TrainState):
        """The next update's first chunks on their way to the device (the waiting update's if
        delayed): called before a forward/backward is dispatched."""
        if self.delayed and self.pending is None:
            return None
        flat = (as_flat(self.stacked, t) for t in (state.params, state.opt_state))
        return self.streamed.prefetch(*flat)

    def discard(self) -> None:
        """Drops the waiting update (a rollback's)."""
        # The host's share runs on: let it finish before the restore writes its chunks.
        for _, done in self.pending[2] if self.pending else []:
            done.result()
        self.pending = None
        self.streamed.drain()  # The old state's copies home, before it goes.

    def after_step(self, state: TrainState, step, grads, scale, fetched) -> TrainState:
        """`apply` now, or (delayed) the update made the pending one, its host share started."""
        if not self.delayed:
            return self.apply(state, step, grads, scale, fetched=fetched)
        flat_grads, compute = (as_flat(self.stacked, t) for t in (grads, state.compute_params))
        on_cpu = self.streamed.start_on_cpu(flat_grads, scale, compute)
        self.pending = (grads, scale, on_cpu)
        return state.replace(step=step)

    def between_microbatches(self, state: TrainState, fetched, microbatches: int):
        """The waiting update dispatched between the next step's `microbatches`: (`between(j)`,
        to call after microbatch j's, and `updated()`, the updated state after the last). It
        writes the new compute copy into new arrays, which the step's microbatches do not
        read: the step computes on the weights without the waiting update, as the delay
        asks."""
        (grads, scale, on_cpu), self.pending = self.pending, None
        update = self.streamed
        stages = update.stages(
            # The grads' only reference: a weight's go after its last group.
            as_flat(self.stacked, grads),
            scale,
            *(
                as_flat(self.stacked, t)
                for t in (state.params, state.opt_state, state.compute_params)
            ),
            on_cpu=on_cpu,
            fetched=fetched,
            into_new=True,
        )
        del grads
        next(stages)  # The first groups on their way, before the first microbatch.
        slots = update.slots(microbatches - 1)

        def between(j):  # The last microbatch's copies have nothing to run beside.
            for _ in range(slots[j] if j < len(slots) else 0):
                next(stages)

        return between, lambda: from_flat(self.stacked, state.step, update.run_out(stages))
