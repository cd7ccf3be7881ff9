"""A compiled step checked against its plan, before the state is allocated: XLA's
temporaries in place of the plan's estimate of the states they hold (`check_compiled`), and
the error that names what they took beyond it (`CompiledTooLarge`), which the settle loop
(`settle.py`) plans again with.
"""

import dataclasses

from angel_jax import machine
from angel_jax.config import ConfigError
from angel_jax.planning import tiers
from angel_jax.planning.plan import IN_TEMPORARIES, Plan
from angel_jax.planning.tiers import DEVICE, USABLE


def checks_compiled(device_gib: float) -> bool:
    """Whether a compiled program is checked against the plan: on a CPU too when the budget is
    the machine's own (its RAM): XLA:CPU's f32 widening of bf16 work is then what it will
    allocate. A device budget set in config.offload (`device_gib`) on a CPU stands for
    another machine's (tests emulate GPU budgets so), which CPU sizes do not tell."""
    return machine.backend() != "cpu" or device_gib <= 0


class CompiledTooLarge(ConfigError):
    """The compiled step does not fit beside the plan's device states; its temporaries took
    `beyond_estimate` bytes more than the planner's estimate of what they hold."""

    def __init__(self, message: str, beyond_estimate: int):
        super().__init__(message)
        self.beyond_estimate = beyond_estimate


def in_temporaries(plan: Plan) -> list[str]:
    """The plan's device states its compiled step holds as XLA temporaries: `IN_TEMPORARIES`,
    and without an offloaded optimizer the grads (the step is one program, which takes the
    params and optimizer state and gives them back, donated: its grads are neither)."""
    held = IN_TEMPORARIES + (() if plan.offloads_optimizer else ("grads",))
    return [s for s in held if plan.placement.get(s) == DEVICE]


def temporaries_estimate(plan: Plan) -> int:
    """The planner's estimate of the bytes its compiled step's temporaries take: the states
    `in_temporaries`, the grads beside the rest or, made after the step's activations
    (`Plan.grads_after_activations`), the larger of the two."""
    held = {s: plan.state_bytes[s] for s in in_temporaries(plan)}
    grads = held.pop("grads", 0)
    rest = sum(held.values())
    return max(rest, grads) if plan.grads_after_activations else rest + grads


def compiled_peak(plan: Plan, temp_bytes: int) -> int:
    """The plan's device peak with a compiled step's temporaries, `temp_bytes`, in place of
    the planner's estimate of the states they hold (`in_temporaries`)."""
    on_device = in_temporaries(plan)
    compiled = {**plan.state_bytes, **dict.fromkeys(on_device, 0), "activations": temp_bytes}
    return dataclasses.replace(plan, state_bytes=compiled).tier_bytes(DEVICE)


def check_compiled(plan: Plan, memory) -> int:
    """Refuses, before the state is allocated, a plan whose compiled step would not fit the
    device: the plan's peak (`Plan.tier_bytes`) with what XLA allocates beyond the program's
    arguments and outputs (`memory`: a `Compiled.memory_analysis()`) in place of the
    planner's estimate of the states it holds (`in_temporaries`). Returns the temporaries'
    bytes beyond that estimate (`temporaries_estimate`; negative when below it; 0 without
    the analysis, where the estimate stands)."""
    if memory is None:
        return 0
    on_device = in_temporaries(plan)
    estimate = temporaries_estimate(plan)
    need = compiled_peak(plan, memory.temp_size_in_bytes)
    usable = USABLE * plan.budget[DEVICE]
    excess = memory.temp_size_in_bytes - estimate
    if need > usable:
        fixes = [*tiers.pool_fixes({DEVICE}), "config.offload.policy=auto or params"]
        if not plan.layer_inputs_on_host:
            fixes += ["config.offload.activations=host (with remat)"]
        if plan.remat != "full":
            fixes += ["more remat (config.model.remat=auto or full)"]
        fixes += ["a smaller batch or model", tiers.more_devices()]
        raise CompiledTooLarge(
            f"the compiled train step needs {need / 2**30:.1f} GiB per device "
            f"({memory.temp_size_in_bytes / 2**30:.1f} GiB of it XLA temporaries, against an "
            f"estimate of {estimate / 2**30:.1f} GiB for the {', '.join(on_device)}), more "
            f"than the {usable / 2**30:.1f} GiB usable: use {', '.join(fixes[:-1])} or "
            f"{fixes[-1]}",
            excess,
        )
    return excess
