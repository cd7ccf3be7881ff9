"""FP8 matmuls that run on FP8 tensor cores (Hopper's `__cublas$lt$matmul$f8`).

The dot takes its operands *as* FP8: e4m3 activations and weights in the forward pass, the e5m2
output gradient (with the e4m3 copies saved from the forward) in the two backward dots, each
tensor with one float32 scale from its current absolute maximum ("current" or "dynamic"
scaling, torchao's default). The scales multiply the dot's output. Quantize-then-dequantize
before a bf16 dot is not used: XLA folds that pair away and runs the bf16 GEMM.

Letters: the dot contracts x's last `n_in` dims with w's first `n_in`; L names x's leading
dims, O w's output dims: x (L.., I..), w (I.., O..), y (L.., O..).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = jnp.float32


def quantize(x: jax.Array, dtype, axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(x in `dtype`, float32 scale) with x's absolute maximum onto the format's largest value.
    With `axis_name` (inside shard_map) the maximum is over every rank's x: one scale for the
    whole tensor, so the ranks' parts gather into one FP8 tensor."""
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(F32)
    if axis_name is not None:
        amax = jax.lax.pmax(amax, axis_name)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    return jnp.clip(x.astype(F32) * (1.0 / scale), -fmax, fmax).astype(dtype), scale


def row_major(w: jax.Array) -> jax.Array:
    """w pinned to its default (row-major) layout. cuBLAS's FP8 GEMM wants both operands with
    the contracted dim minor, so the forward dot wants w (I.., O..) transposed; unpinned, XLA
    gives that layout to the whole stacked bf16 weights carried by the microbatch loop, a
    second copy of them (27 GiB more temporaries in the 8B offload step). Pinned, it
    transposes each layer's e4m3 copy in the loop instead."""
    return with_layout_constraint(w, Layout(major_to_minor=tuple(range(w.ndim))))


def scaled_dot(a, b, scale, dimension_numbers, dtype) -> jax.Array:
    """FP8 a and b straight into the dot, the product of their scales on its output."""
    out = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=dtype)
    return out * scale.astype(dtype)


def dims(x_ndim: int, w_ndim: int, n_in: int):
    """dimension_numbers of the forward dot and of the backward dots dx = g.w and dw = x.g
    (contracting g's O with w's O, and x's L with g's L): no batch dims, no transposes."""
    lead, n_out = x_ndim - n_in, w_ndim - n_in
    forward = ((tuple(range(lead, x_ndim)), tuple(range(n_in))), ((), ()))
    dx = ((tuple(range(lead, lead + n_out)), tuple(range(n_in, w_ndim))), ((), ()))
    dw = ((tuple(range(lead)), tuple(range(lead))), ((), ()))
    return forward, dx, dw


def matmul(x: jax.Array, w: jax.Array, n_in: int = 1, scaling=quantize, x8=None) -> jax.Array:
    """x (L.., I..) . w (I.., O..) -> (L.., O..) in x's dtype, through FP8 GEMMs forward and
    backward; `scaling` quantizes each operand (`quantize`'s signature: current scaling;
    experiments/fp8_gemm.py passes a fixed scale to bound what delayed scaling could save).
    `x8`: x's FP8 copy and scale when the caller made them (`gather_quantized`: once for
    several projections of one input); x then only carries the gradient."""
    if x8 is None:
        x8 = scaling(jax.lax.stop_gradient(x), E4M3)
    return _matmul(x, *x8, w, n_in, scaling)


def gather_quantized(x: jax.Array, layouts) -> tuple[jax.Array, jax.Array]:
    """x's e4m3 copy and scale for `matmul`'s `x8`, made on x's split and gathered whole
    (`layouts` = (split, whole): `sharding.gather_layouts`): under sequence parallel each rank
    casts 1/tp of x and the all-gather moves FP8 bytes, half of bf16's, where quantizing the
    gathered x would cast all of it on every rank."""
    split, whole = layouts
    pin = jax.lax.with_sharding_constraint
    # Pinned to the split on both sides of the cast, else XLA may gather float32 in between.
    xq, xs = quantize(pin(jax.lax.stop_gradient(x), split), E4M3)
    return pin(pin(xq, split), whole), xs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _matmul(x, xq, xs, w, n_in, scaling):
    """x.w from x's FP8 copy (xq, xs): x is there for its gradient."""
    return _matmul_fwd(x, xq, xs, w, n_in, scaling)[0]


def _matmul_fwd(x, xq, xs, w, n_in, scaling):
    wq, ws = scaling(row_major(w), E4M3)
    forward, _, _ = dims(x.ndim, w.ndim, n_in)
    y = scaled_dot(xq, wq, xs * ws, forward, x.dtype)
    return y, (xq, xs, wq, ws)  # The FP8 copies are the residuals: half of bf16's memory.


def _matmul_bwd(n_in, scaling, residuals, g):
    dx, dw = backward(*residuals, g, n_in, scaling)
    return dx, None, None, dw


def backward(xq, xs, wq, ws, g, n_in, scaling=quantize):
    """(dx, dw) of y = x.w from the forward's FP8 copies and g quantized to e5m2."""
    gq, gs = scaling(g, E5M2)
    _, dx_dims, dw_dims = dims(xq.ndim, wq.ndim, n_in)
    dx = scaled_dot(gq, wq, gs * ws, dx_dims, g.dtype)
    dw = scaled_dot(xq, gq, xs * gs, dw_dims, g.dtype)
    return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
