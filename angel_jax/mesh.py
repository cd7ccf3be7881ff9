"""The device mesh: six named axes, sized from `config.mesh`."""

import collections
import math
import os
import re

import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh

from angel_jax.config import ConfigError

# The mesh axis names, for shard_map regions and their collectives. Outermost to innermost:
# devices that talk most (tensor) end up closest together.
DATA, PIPELINE, EXPERT, CONTEXT, SEQUENCE, TENSOR = AXES = (
    "data",
    "pipeline",
    "expert",
    "context",
    "sequence",
    "tensor",
)
# ZeRO splits param-shaped states over these axes: their ranks hold the same params and see
# different tokens, so each can keep a share (Megatron's distributed optimizer splits over
# data x context; MaxText's FSDP over context and sequence too).
ZERO_AXES = (DATA, CONTEXT, SEQUENCE)


def zero_axes(sizes, fp8_collectives: bool = False) -> tuple[str, ...]:
    """The axes ZeRO splits states over on a mesh of `sizes` (axis -> size). FP8 collectives
    gather over `data` only (parallel/fp8_collectives.py), so with them ZeRO keeps to it."""
    return tuple(a for a in ((DATA,) if fp8_collectives else ZERO_AXES) if sizes[a] > 1)


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Resolves a -1 entry and checks that the axis sizes multiply to `num_devices`."""
    sizes = {axis: int(mesh_config[axis]) for axis in AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            f"config.mesh: only one axis may be -1, got {', '.join(free)}; give the others sizes"
        )
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"config.mesh.{axis}={size}: axis sizes must be positive or -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % known:
            raise ConfigError(
                f"config.mesh: the fixed axes multiply to {known}, which does not divide the "
                f"{num_devices} devices; change the sizes so config.mesh.{free[0]}=-1 can take "
                "the rest"
            )
        sizes[free[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(
            f"config.mesh: axis sizes {_fmt(sizes)} multiply to {known}, but there are "
            f"{num_devices} devices; make the product {num_devices} or set one axis to -1"
            + _late_flags(num_devices)
        )
    return sizes


def _late_flags(num_devices: int) -> str:
    """A hint when XLA_FLAGS asks for more emulated CPU devices than JAX made: the flags were
    set after JAX had started its CPU client (in a notebook: after `import jax` ran)."""
    asked = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    if not asked or int(asked[1]) == num_devices or jax.devices()[0].platform != "cpu":
        return ""
    return (
        f" (XLA_FLAGS asks for {asked[1]} CPU devices, but JAX had started before it was set: "
        "set it before the first `import jax`, e.g. in a notebook's first cell, and restart)"
    )


def make_mesh(mesh_config: ml_collections.ConfigDict, devices=None) -> Mesh:
    """Builds the mesh over `devices` (default: all), axes in `AXES` order.

    Over several processes (hosts), each axis is split into a part inside a process and a part
    across processes (`split_over_hosts`): the innermost axes stay inside a host, so tensor,
    sequence and expert traffic uses the host's links and `data` spans the hosts.
    """
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(mesh_config, len(devices))
    axis_types = (AxisType.Auto,) * len(AXES)
    if len({d.process_index for d in devices}) == 1:
        return jax.make_mesh(
            tuple(sizes[a] for a in AXES), AXES, axis_types=axis_types, devices=devices
        )
    return Mesh(device_grid(sizes, devices), AXES, axis_types=axis_types)


def device_grid(sizes: dict[str, int], devices) -> np.ndarray:
    """`devices` of several processes as an array of the mesh's shape (`AXES` order), each
    axis's part inside a process innermost (`split_over_hosts`)."""
    per_process = collections.Counter(d.process_index for d in devices)
    if len(set(per_process.values())) > 1:
        raise ConfigError(
            f"the processes have different device counts ({dict(sorted(per_process.items()))}); "
            "give every process the same number of devices"
        )
    inside, across = split_over_hosts(sizes, len(devices) // len(per_process))
    # As mesh_utils.create_hybrid_device_mesh(process_is_granule=True) arranges them, without
    # depending on that experimental module: process-major, each process's devices by id.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    n = len(AXES)
    grid = grid.reshape([across[a] for a in AXES] + [inside[a] for a in AXES])
    grid = grid.transpose([k for axis in range(n) for k in (axis, n + axis)])  # Across outer.
    return grid.reshape([sizes[a] for a in AXES])


def split_over_hosts(sizes: dict[str, int], per_host: int) -> tuple[dict[str, int], dict[str, int]]:
    """(Part of each axis inside a host, part across hosts): their products are the sizes.

    Axes fill a host innermost first (tensor, sequence, context, expert, pipeline, data), each
    taking as much of itself as still fits. An axis larger than what is left of a host spans
    hosts, e.g. tensor=16 on hosts of 8 devices.
    """
    inside, room = {}, per_host
    for axis in reversed(AXES):
        inside[axis] = math.gcd(sizes[axis], room)
        room //= inside[axis]
    # Each prime's power in `per_host` is covered by the axes' (their product is a multiple
    # of `per_host`), so the host is always filled: room == 1.
    return {a: inside[a] for a in AXES}, {a: sizes[a] // inside[a] for a in AXES}


def _fmt(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
