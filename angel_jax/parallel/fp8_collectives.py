"""FP8 collectives: all-gather and reduce-scatter that put block-scaled FP8 on the wire.

For use inside `shard_map` over `axis_name`, with `check_vma=False` (Pallas calls' outputs carry
no varying-axes type). Each rank quantizes what it sends in blocks of
`block` elements with one float32 scale per block (`kernels_pallas/fp8.py`), so the bytes on the
wire are about half of bf16's (1 + 4/block bytes per element against 2). The receiving side
dequantizes, and a reduce-scatter sums the ranks' parts in float32 (the fused `dequantize_sum`
kernel), never in FP8. The two are each other's transpose, so each one's VJP is the other.
Forward all-gathers (parameters) carry e4m3; reduce-scatters and every backward collective
carry gradients, in e5m2 for its wider range.

Letters: P ranks on `axis_name`, N blocks, B block size.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from kernels_pallas import fp8

F32 = jnp.float32


def _parts(x, parts: int, axis: int) -> list:
    return jnp.split(x, parts, axis=axis)


def _as_bytes(q):
    # Collectives see uint8: XLA:CPU widens FP8 collectives to f16, and NCCL has no FP8 type.
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _send_and_sum(parts: list, axis_name: str, block: int, dtype) -> jax.Array:
    """Rank r's sum over ranks of their parts[r], carried in FP8, summed in float32."""
    shape = parts[0].shape
    blocks = jnp.stack([fp8.to_blocks(p, block) for p in parts])  # (P, N, B)
    p, n, b = blocks.shape
    q, scale = fp8.quantize(blocks.reshape(p * n, b), dtype)
    q = jax.lax.all_to_all(_as_bytes(q).reshape(p, n, b), axis_name, 0, 0, tiled=True)
    q = jax.lax.bitcast_convert_type(q, dtype)
    scale = jax.lax.all_to_all(scale.reshape(p, n), axis_name, 0, 0, tiled=True)
    return fp8.from_blocks(fp8.dequantize_sum(q, scale), shape)


def _gather(x, axis_name: str, axis: int, block: int, dtype) -> jax.Array:
    q, scale = fp8.quantize(fp8.to_blocks(x, block), dtype)
    gathered = jax.lax.all_gather(_as_bytes(q), axis_name)
    q, scale = jax.lax.bitcast_convert_type(gathered, dtype), jax.lax.all_gather(scale, axis_name)
    p, n, b = q.shape
    parts = fp8.dequantize(q.reshape(p * n, b), scale.reshape(p * n), x.dtype).reshape(p, n, b)
    return jnp.concatenate([fp8.from_blocks(part, x.shape) for part in parts], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_gather_fp8(x, axis_name: str, axis: int = 0, block: int = 128):
    """`jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)` carried in e4m3."""
    return _gather(x, axis_name, axis, block, fp8.E4M3)


def _all_gather_fwd(x, axis_name, axis, block):
    return all_gather_fp8(x, axis_name, axis, block), None


def _all_gather_bwd(axis_name, axis, block, _, ct):
    parts = _parts(ct, jax.lax.axis_size(axis_name), axis)
    return (_send_and_sum(parts, axis_name, block, fp8.E5M2).astype(ct.dtype),)


all_gather_fp8.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def reduce_scatter_fp8(x, axis_name: str, axis: int = 0, block: int = 128):
    """`jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)` carried in
    e5m2 and summed in float32; the result has x's dtype."""
    parts = _parts(x, jax.lax.axis_size(axis_name), axis)
    return _send_and_sum(parts, axis_name, block, fp8.E5M2).astype(x.dtype)


def _reduce_scatter_fwd(x, axis_name, axis, block):
    return reduce_scatter_fp8(x, axis_name, axis, block), None


def _reduce_scatter_bwd(axis_name, axis, block, _, ct):
    return (_gather(ct, axis_name, axis, block, fp8.E5M2),)


reduce_scatter_fp8.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


def zero3_dot(x, w, axes: tuple[str, ...], dimension_numbers, dot=jax.lax.dot_general):
    """`dot(x, w, dimension_numbers)` for a weight that ZeRO-3 stores split over `data`, with the
    weight all-gathered in FP8 (and its gradient reduce-scattered in FP8) instead of by XLA in
    the compute dtype. x is batch-first, its batch split over `data`; `axes` are w's logical
    axes. Only `data` is manual: tensor and sequence splits stay XLA's."""
    mesh = sharding.active_mesh()
    stored = sharding.zero_spec(sharding.active_spec(axes), w.shape, mesh)
    if "data" not in stored:  # Too small to split: replicated, nothing to gather.
        return dot(x, sharding.constrain(w, axes), dimension_numbers)
    dim = list(stored).index("data")
    w_spec = P(*("data" if d == dim else None for d in range(w.ndim)))

    def local(x, w):
        return dot(x, all_gather_fp8(w, "data", dim), dimension_numbers)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P("data"), w_spec),
        out_specs=P("data"),
        axis_names={"data"},
        check_vma=False,
    )(x, w)
