"""Block-scaled FP8 in Pallas: quantize, dequantize, and dequantize-and-sum (the receiving end of
an FP8 reduce-scatter), each beside its pure-JAX reference.

Values travel as rows of `block` elements (N, B): each row gets one float32 scale, its absolute
maximum over the format's largest finite value, so the row's largest element maps onto that
value and nothing overflows. A row of zeros gets scale 1. e4m3fn (3 mantissa bits, max 448)
suits weights and activations; e5m2 (2 bits, max 57344) the wider range of gradients.

Each program takes `rows` rows; N is padded up to a multiple of it. On a CPU the kernels run in
Pallas' interpreter (`interpret=True`), as the tests do; on a GPU through Pallas' Triton backend.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _largest(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _scaled(x_NB, dtype):
    """(q, scale) of f32 rows: the shared math of the kernel and the reference."""
    fmax = _largest(dtype)
    amax = jnp.max(jnp.abs(x_NB), axis=-1)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    return jnp.clip(x_NB / scale[..., None], -fmax, fmax).astype(dtype), scale


def quantize_reference(x_NB, dtype=E4M3):
    """(q (N, B) in `dtype`, scale (N,) float32)."""
    return _scaled(x_NB.astype(F32), dtype)


def dequantize_reference(q_NB, scale_N, dtype=F32):
    return (q_NB.astype(F32) * scale_N[:, None]).astype(dtype)


def dequantize_sum_reference(q_PNB, scale_PN):
    """sum over p of dequantize(q[p], scale[p]), in float32."""
    return jnp.sum(q_PNB.astype(F32) * scale_PN[..., None], axis=0)


def _quantize_kernel(x_ref, q_ref, s_ref):
    q, scale = _scaled(x_ref[...].astype(F32), q_ref.dtype)
    q_ref[...], s_ref[...] = q, scale


def _dequantize_kernel(q_ref, s_ref, o_ref):
    o_ref[...] = (q_ref[...].astype(F32) * s_ref[...][:, None]).astype(o_ref.dtype)


def _dequantize_sum_kernel(q_ref, s_ref, o_ref, *, parts):
    total = jnp.zeros(o_ref.shape, F32)
    for p in range(parts):  # Few parts (one per rank): unrolled.
        total += q_ref[p].astype(F32) * s_ref[p][:, None]
    o_ref[...] = total


def _padded_rows(n: int, rows: int) -> tuple[int, int]:
    rows = min(rows, n)
    return rows, -n % rows


def quantize(x_NB, dtype=E4M3, *, rows=64):
    """(q (N, B) in `dtype`, scale (N,) float32): the Pallas kernel of `quantize_reference`."""
    n, b = x_NB.shape
    rows, pad = _padded_rows(n, rows)
    x = jnp.pad(x_NB, ((0, pad), (0, 0)))
    tile, scales = pl.BlockSpec((rows, b), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))
    q, scale = pl.pallas_call(
        _quantize_kernel,
        grid=(x.shape[0] // rows,),
        in_specs=[tile],
        out_specs=[tile, scales],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, dtype),
            jax.ShapeDtypeStruct((x.shape[0],), F32),
        ],
        interpret=_interpret(),
    )(x)
    return q[:n], scale[:n]


def dequantize(q_NB, scale_N, dtype=F32, *, rows=64):
    """The Pallas kernel of `dequantize_reference`."""
    n, b = q_NB.shape
    rows, pad = _padded_rows(n, rows)
    q, scale = jnp.pad(q_NB, ((0, pad), (0, 0))), jnp.pad(scale_N, (0, pad))
    tile, scales = pl.BlockSpec((rows, b), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))
    return pl.pallas_call(
        _dequantize_kernel,
        grid=(q.shape[0] // rows,),
        in_specs=[tile, scales],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, dtype),
        interpret=_interpret(),
    )(q, scale)[:n]


def dequantize_sum(q_PNB, scale_PN, *, rows=64):
    """The Pallas kernel of `dequantize_sum_reference`: the parts are read once and summed in
    float32 registers, never written back in a wider type first."""
    parts, n, b = q_PNB.shape
    rows, pad = _padded_rows(n, rows)
    q, scale = jnp.pad(q_PNB, ((0, 0), (0, pad), (0, 0))), jnp.pad(scale_PN, ((0, 0), (0, pad)))
    return pl.pallas_call(
        functools.partial(_dequantize_sum_kernel, parts=parts),
        grid=(q.shape[1] // rows,),
        in_specs=[
            pl.BlockSpec((parts, rows, b), lambda i: (0, i, 0)),
            pl.BlockSpec((parts, rows), lambda i: (0, i)),
        ],
        out_specs=pl.BlockSpec((rows, b), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((q.shape[1], b), F32),
        interpret=_interpret(),
    )(q, scale)[:n]


def to_blocks(x, block: int):
    """x flattened into rows of `block` (zero-padded at the end): (N, B)."""
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % block)).reshape(-1, block)


def from_blocks(x_NB, shape):
    """The inverse of `to_blocks`."""
    return x_NB.reshape(-1)[: math.prod(shape)].reshape(shape)
