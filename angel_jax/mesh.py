"""The device mesh: six named axes, sized from `config.mesh`."""

import math

import jax
import ml_collections
from jax.sharding import AxisType, Mesh

from angel_jax.config import ConfigError

# Outermost to innermost: devices that talk most (tensor) end up closest together.
AXES = ("data", "pipeline", "expert", "context", "sequence", "tensor")

# Axes whose parallelism is not built yet; a size > 1 would silently replicate work.
_NOT_YET = {
    "pipeline": "pipeline parallelism",
}


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
    for axis, what in _NOT_YET.items():
        if sizes[axis] > 1:
            raise ConfigError(
                f"config.mesh.{axis}={sizes[axis]}: {what} is not implemented yet; set it to 1"
            )
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
        )
    return sizes


def make_mesh(mesh_config: ml_collections.ConfigDict, devices=None) -> Mesh:
    """Builds the mesh over `devices` (default: all), axes in `AXES` order."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(mesh_config, len(devices))
    return jax.make_mesh(
        tuple(sizes[a] for a in AXES),
        AXES,
        axis_types=(AxisType.Auto,) * len(AXES),
        devices=devices,
    )


def _fmt(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
