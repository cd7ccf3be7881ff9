"""The loop that settles a plan against its compiled step: plan -> build -> compile -> check
-> plan again. The planner's estimate of the step's temporaries may err either way; a plan
that offloads the optimizer fills the device's room around it (chunks resident on the device
under policy auto, the update's groups beside the step), and config.model.remat=auto picks the
fastest remat policy that fits by it. `settle` compiles the step the loop runs, before
anything is allocated, and plans again with what its temporaries took: when they took more
(fewer chunks resident, none of the update's groups beside the step, or the next remat
policy), and when they took less and the room left lets the plan keep more on the device (or
take a faster remat policy).

The trainer builds (`make`); planning only plans and reads what a build's compiled programs
took, through `Built`.
"""

import sys
from collections.abc import Callable
from typing import Protocol

from angel_jax.planning import activations
from angel_jax.planning.chunks import may_update_between_microbatches
from angel_jax.planning.compiled import CompiledTooLarge
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.plan import Plan

# Plans `settle` makes at most, each for what the last one's compiled step took.
_MOST_PLANS = 6

# (Offloads the optimizer, remat policy) -> what that compiled step took beyond the estimate:
# `placement.make_plan`'s `extra_activations`.
Extra = dict[tuple[bool, str], int]


class Built(Protocol):
    """A run built from a plan, as the settle loop sees it."""

    @property
    def plan(self) -> Plan: ...

    @property
    def pipelined(self) -> bool: ...

    def check_program(self) -> int:
        """Compiles the offloaded step's program (the one whose memory holds the step's
        activations) and checks it against the plan: its temporaries' bytes beyond the plan's
        estimate; raises `CompiledTooLarge`."""

    def check_loop_step(self) -> int:
        """Compiles the step the training loop runs and checks it, as `check_program`."""

    def reuse_program(self, before: "Built") -> bool:
        """Takes `before`'s compiled program where it is the same program (not compiled
        again); whether it did."""


def settle(inp: PlanInput, make: Callable[[Extra], Built], first: Built) -> Built:
    """`first` (built from the plan without extra), or a build planned again (`make(extra)`)
    until its compiled step fits the plan, as the module says."""
    built = first
    picks_remat = inp.model.remat == "auto" and not built.pipelined
    if not (built.plan.offloads_optimizer or picks_remat):
        return built
    extra: Extra = {}
    for attempt in range(_MOST_PLANS):
        try:
            # The program the loop runs: compiled and checked against the plan.
            offloads = built.plan.offloads_optimizer
            excess = built.check_program() if offloads else built.check_loop_step()
            break
        except CompiledTooLarge as e:
            if attempt == _MOST_PLANS - 1:
                raise
            before, key = built, (built.plan.offloads_optimizer, built.plan.remat)
            extra[key] = extra.get(key, 0) + e.beyond_estimate
            built = make(extra)
            now = f"policy {built.plan.policy}, remat {built.plan.remat}"
            if before.plan.offloads_optimizer and built.plan.offloads_optimizer:
                built.reuse_program(before)  # The same program: not compiled again.
                now += f", {len(built.plan.resident)} chunks resident on the device, not "
                now += str(len(before.plan.resident))
            print(
                f"the compiled step (remat {key[1]}) took {e.beyond_estimate / 2**30:.1f} GiB "
                f"more temporaries than the plan's estimate: planned again with them ({now})",
                file=sys.stderr,
            )
    if built.plan.offloads_optimizer:
        return built if extra else _with_room_given_back(inp, make, built, excess)
    return _with_a_faster_remat(inp, make, built, excess) if picks_remat and not extra else built


def _with_a_faster_remat(
    inp: PlanInput, make: Callable[[Extra], Built], built: Built, excess: int
) -> Built:
    """`built` (remat auto, everything on the device), or planned again with a faster remat
    policy than its pick: when the compiled step's temporaries came in under the estimate
    (by -`excess`), the faster policies' estimates are scaled alike, and the fastest that
    then fits is compiled and taken if its step fits too; one that does not is planned again
    with what it took, which passes to the next (a compile each; the estimate errs high: by
    14% for dots_no_batch and 34% for full on llama_1b at 48 x 2048)."""
    plan = built.plan
    choices = activations.remat_choices(inp)
    faster = choices[: choices.index(plan.remat)]
    estimate = plan.state_bytes["activations"]
    if excess >= 0 or not faster or estimate <= 0:
        return built
    scale = max(0.0, (estimate + excess) / estimate)
    extra = {
        (False, r): int((scale - 1) * activations.activation_bytes(inp, r)["activations"])
        for r in faster
    }
    for _ in faster:
        again = make(extra)
        if again.plan.remat not in faster:
            break
        try:
            again.check_loop_step()
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
    return built


def _with_room_given_back(
    inp: PlanInput, make: Callable[[Extra], Built], built: Built, excess: int
) -> Built:
    """`built`, or planned again with its compiled step's temporaries when they came in under
    the estimate (by -`excess`) and the room left lets the plan keep more on the device for
    the same program."""
    plan = built.plan
    # Room left over helps a plan that fills it: resident chunks, or groups it switched off.
    # A delayed update that could run between microbatches, if the room let it.
    could_go_between = not plan.update_between_microbatches and may_update_between_microbatches(
        inp, plan, built.pipelined
    )
    fills = inp.offload.policy == "auto" or not plan.copies_beside_step or could_go_between
    if excess >= 0 or not fills:
        return built
    again = make({(True, plan.remat): excess})
    between = again.plan.update_between_microbatches and not plan.update_between_microbatches
    more = (
        len(again.plan.resident) > len(plan.resident)
        or (again.plan.copies_beside_step and not plan.copies_beside_step)
        or between
    )
    if not (more and again.plan.offloads_optimizer):
        return built
    # Only for the same program: another's temporaries are not the ones measured. But a
    # delayed update the room lets run between microbatches brings its own program (one
    # microbatch's forward/backward, the same work as the loop's body): taken if it fits.
    if not (again.reuse_program(built) or between):
        return built
    try:
        again.check_program()  # Checked against the plan made again.
    except CompiledTooLarge as e:
        if not between:
            raise
        # Its temporaries passed the scan's (the 8B's by 0.01 GiB, where the groups took all
        # the room): once more with them, the same program.
        again = _between_again(make, again, {(True, plan.remat): excess + e.beyond_estimate})
        if again is None:
            return built
    print(
        f"the compiled step's temporaries took {-excess / 2**30:.1f} GiB less than the plan's "
        f"estimate: planned again with them ({len(again.plan.resident)} chunks resident on the "
        f"device, not {len(plan.resident)}; the update's groups beside the step "
        f"{'on' if again.plan.copies_beside_step else 'off'}; the delayed update between "
        f"microbatches {'on' if again.plan.update_between_microbatches else 'off'})",
        file=sys.stderr,
    )
    return again


def _between_again(make: Callable[[Extra], Built], before: Built, extra: Extra) -> Built | None:
    """`before`'s update between microbatches planned once more with its microbatch program's
    temporaries (`extra`) and that program, checked; None if the plan made so leaves that
    mode or its program does not fit."""
    again = make(extra)
    if not (again.plan.update_between_microbatches and again.reuse_program(before)):
        return None
    try:
        again.check_program()
    except CompiledTooLarge:
        return None
    return again
