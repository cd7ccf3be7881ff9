"""Float32 masters kept as two halves (ZeRO-Cache, config.offload.split_masters): where the
compute copy is bfloat16 and lives on the device, it is the master's high half, and the
master's tier (pinned host memory, disk, or the device for resident chunks) keeps only the low
16 bits. The update fetches those, joins them with the compute copy's layer into the exact
float32 master, and sends home the new low half beside the new compute copy: 2 bytes of a
parameter's master cross the host link each way instead of 4 (AdamW: 10 bytes instead of 12;
Adafactor's factored state is small, so nearly half), and host memory holds 2 bytes less.

The compute copy rounds the master's bits half up (ties away from zero) instead of to the
nearest even, so the low half, read as the signed 16-bit difference between the master's bits
and the compute copy's, always recovers the master bit for bit (with ties to even a tie could
have come from either neighbour). It differs from `astype` only where the low 16 bits are
exactly 0x8000, by one bfloat16 step.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from angel_jax.planning.memory import splits_masters

LOW = jnp.uint16  # The low half's dtype: what the master's tier keeps.


def split(master: jax.Array, compute_dtype) -> tuple[jax.Array, jax.Array]:
    """(the low half, the compute copy) of float32 `master`; inside or outside jit."""
    # The barrier makes both halves read one evaluation of `master`. Without it XLA may fuse
    # the update that makes `master` into each half's consumers and compute it twice, and two
    # evaluations can differ in the last bit (seen on the CPU at -O0, jax 0.11.2): at a tie
    # the halves then join one bfloat16 step off.
    bits = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(master, jnp.uint32))
    high = (bits + 0x8000) >> 16
    low = (bits - (high << 16)).astype(LOW)  # The difference, in [-0x8000, 0x7fff], mod 2**16.
    compute = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), compute_dtype)
    # A NaN stays a NaN (its bits rounded up could read as an infinity).
    return low, jnp.where(jnp.isnan(master), master.astype(compute_dtype), compute)


def join(low: jax.Array, compute: jax.Array) -> jax.Array:
    """The float32 master whose halves are `low` and `compute` (`split`'s)."""
    high = jax.lax.bitcast_convert_type(compute, jnp.uint16).astype(jnp.uint32)
    low = low.astype(jnp.uint32)
    bits = (high << 16) + low - jnp.where(low >= 0x8000, jnp.uint32(0x10000), jnp.uint32(0))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split_numpy(master: np.ndarray) -> np.ndarray:
    """`split`'s low half of a float32 `master` on the host (checkpoints)."""
    bits = np.asarray(master, np.float32).view(np.uint32)
    high = (bits + np.uint32(0x8000)) >> np.uint32(16)
    return (bits - (high << np.uint32(16))).astype(np.uint16)


def join_numpy(low: np.ndarray, compute: np.ndarray) -> np.ndarray:
    """`join` on numpy arrays (checkpoints, exports), on the host."""
    compute = np.asarray(compute)
    if compute.dtype != ml_dtypes.bfloat16:  # Not a high half: a cast would hide it.
        raise TypeError(f"join_numpy: the compute copy is {compute.dtype}, not bfloat16")
    high = compute.view(np.uint16).astype(np.uint32)
    low = np.asarray(low, np.uint16).astype(np.uint32)
    bits = (high << 16) + low - np.where(low >= 0x8000, np.uint32(0x10000), np.uint32(0))
    return bits.astype(np.uint32).view(np.float32)


def compute_copy(master: jax.Array, home_dtype, dtype) -> tuple[jax.Array, jax.Array]:
    """(what a chunk's tier keeps of updated float32 `master`, its compute copy in `dtype`):
    for a split master (its home in `home_dtype` LOW) its low half, else the master whole.
    A bfloat16 compute copy is the master's high half either way (`split`'s rounding),
    so that splitting changes nothing but where the bytes are."""
    if not splits_masters(dtype):
        return master, master.astype(dtype)
    low, compute = split(master, dtype)
    return (low if home_dtype == LOW else master), compute
