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

from angel_jax import fp8, sharding
from angel_jax.mesh import DATA
from kernels_pallas import fp8 as blocks

F32 = jnp.float32


def _parts(x, parts: int, axis: int) -> list:
    return jnp.split(x, parts, axis=axis)


def _as_bytes(q):
    # Collectives see uint8: XLA:CPU widens FP8 collectives to f16, and NCCL has no FP8 type.
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _send_and_sum(parts: list, axis_name: str, block: int, dtype) -> jax.Array:
    """Rank r's sum over ranks of their parts[r], carried in FP8, summed in float32."""
    shape = parts[0].shape
    rows = jnp.stack([blocks.to_blocks(p, block) for p in parts])  # (P, N, B)
    p, n, b = rows.shape
    q, scale = blocks.quantize(rows.reshape(p * n, b), dtype)
    q = jax.lax.all_to_all(_as_bytes(q).reshape(p, n, b), axis_name, 0, 0, tiled=True)
    q = jax.lax.bitcast_convert_type(q, dtype)
    scale = jax.lax.all_to_all(scale.reshape(p, n), axis_name, 0, 0, tiled=True)
    return blocks.from_blocks(blocks.dequantize_sum(q, scale), shape)


def _gather(x, axis_name: str, axis: int, block: int, dtype) -> jax.Array:
    q, scale = blocks.quantize(blocks.to_blocks(x, block), dtype)
    gathered = jax.lax.all_gather(_as_bytes(q), axis_name)
    q, scale = jax.lax.bitcast_convert_type(gathered, dtype), jax.lax.all_gather(scale, axis_name)
    p, n, b = q.shape
    parts = blocks.dequantize(q.reshape(p * n, b), scale.reshape(p * n), x.dtype).reshape(p, n, b)
    return jnp.concatenate([blocks.from_blocks(part, x.shape) for part in parts], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_gather_fp8(x, axis_name: str, axis: int = 0, block: int = 128):
    """`jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)` carried in e4m3."""
    return _gather(x, axis_name, axis, block, blocks.E4M3)


def _all_gather_fwd(x, axis_name, axis, block):
    return all_gather_fp8(x, axis_name, axis, block), None


def _all_gather_bwd(axis_name, axis, block, _, ct):
    parts = _parts(ct, jax.lax.axis_size(axis_name), axis)
    return (_send_and_sum(parts, axis_name, block, blocks.E5M2).astype(ct.dtype),)


all_gather_fp8.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def reduce_scatter_fp8(x, axis_name: str, axis: int = 0, block: int = 128):
    """`jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)` carried in
    e5m2 and summed in float32; the result has x's dtype."""
    parts = _parts(x, jax.lax.axis_size(axis_name), axis)
    return _send_and_sum(parts, axis_name, block, blocks.E5M2).astype(x.dtype)


def _reduce_scatter_fwd(x, axis_name, axis, block):
    return reduce_scatter_fp8(x, axis_name, axis, block), None


def _reduce_scatter_bwd(axis_name, axis, block, _, ct):
    return (_gather(ct, axis_name, axis, block, blocks.E5M2),)


reduce_scatter_fp8.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gathered_fp8_matmul(x, w, n_in: int, dim: int):
    """`angel_jax.fp8.matmul(x, all_gather(w))` for rank r's slice w of a weight split over
    `data` along `dim`: the slice quantized to e4m3 with the whole weight's scale, gathered as
    those bytes and fed to the FP8 GEMM as they are, so the weight is quantized once and its
    gather carries 1 byte an element. The gathered e4m3 weight is the backward's residual, as
    XLA keeps a gathered weight without remat (under remat the layer's forward, gather
    included, runs again); dw goes back reduce-scattered in e5m2 blocks."""
    return _gathered_fwd(x, w, n_in, dim)[0]


def _gathered_fwd(x, w, n_in, dim):
    (xq, xs), (wq, ws) = fp8.quantize(x, fp8.E4M3), fp8.quantize(fp8.row_major(w), fp8.E4M3, DATA)
    wq = jax.lax.all_gather(_as_bytes(wq), DATA, axis=dim, tiled=True)
    wq = jax.lax.bitcast_convert_type(wq, fp8.E4M3)
    forward, _, _ = fp8.dims(x.ndim, w.ndim, n_in)
    return fp8.scaled_dot(xq, wq, xs * ws, forward, x.dtype), (xq, xs, wq, ws)


def _gathered_bwd(n_in, dim, residuals, g):
    dx, dw = fp8.backward(*residuals, g, n_in)
    return dx, reduce_scatter_fp8(dw, DATA, dim)


gathered_fp8_matmul.defvjp(_gathered_fwd, _gathered_bwd)


def zero3_dot(x, w, axes: tuple[str, ...], n_in: int, fp8_matmul: bool) -> jax.Array:
    """x (L.., I..) . w (I.., O..) for a weight that ZeRO-3 stores split over `data`, gathered
    in FP8 (its gradient reduce-scattered in FP8) instead of by XLA in the compute dtype: with
    `fp8_matmul` into the FP8 GEMM as gathered (`gathered_fp8_matmul`), else dequantized for a
    dot in x's dtype. x is batch-first, its batch split over `data`; `axes` are w's logical
    axes. Only `data` is manual: tensor and sequence splits stay XLA's."""
    mesh = sharding.active_mesh()
    forward, _, _ = fp8.dims(x.ndim, w.ndim, n_in)
    dot = fp8.matmul if fp8_matmul else lambda x, w, n_in: jax.lax.dot_general(x, w, forward)
    stored = sharding.zero_spec(sharding.active_spec(axes), w.shape, mesh, sharding.rule("zero"))
    if DATA not in stored:  # Too small to split: replicated, nothing to gather.
        return dot(x, sharding.constrain(w, axes), n_in)
    dim = list(stored).index(DATA)
    w_spec = P(*(DATA if d == dim else None for d in range(w.ndim)))

    def local(x, w):
        if fp8_matmul:
            return gathered_fp8_matmul(x, w, n_in, dim)
        return dot(x, all_gather_fp8(w, DATA, dim), n_in)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(DATA), w_spec),
        out_specs=P(DATA),
        axis_names={DATA},
        check_vma=False,
    )(x, w)
