"""Dense projections and embeddings with logically named fp32 master weights.

Weights are stored in `param_dtype` (float32 masters) and cast to the compute dtype before use;
the cast happens on the stored shard, so ZeRO-3 all-gathers compute-dtype bytes. With `fp8`, a
projection's inputs and weight enter the matmul as e4m3 and its output gradient as e5m2, each
with one scale from its current absolute maximum: the dequantize-then-dot pattern that XLA
rewrites into Hopper's FP8 GEMMs.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.parallel.fp8_collectives import zero3_dot
from angel_jax.sharding import active_mesh, constrain

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x in `dtype`, float32 scale): one scale per tensor, its amax onto the format's largest
    value."""
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype), scale


def _dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    # Convert-then-scale right before the dot: the pattern XLA turns into an FP8 GEMM.
    return q.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_dot_general(x, w, dimension_numbers):
    """`jax.lax.dot_general(x, w, dimension_numbers)` with x and w through e4m3 and, in the
    backward pass, the output gradient through e5m2."""
    return _fp8_fwd(x, w, dimension_numbers)[0]


def _fp8_fwd(x, w, dimension_numbers):
    (xq, xs), (wq, ws) = _quantize(x, E4M3), _quantize(w, E4M3)
    y = jax.lax.dot_general(
        _dequantize(xq, xs, x.dtype), _dequantize(wq, ws, w.dtype), dimension_numbers
    )
    return y, (xq, xs, wq, ws)  # FP8 residuals: half of bf16's memory.


def _fp8_bwd(dimension_numbers, residuals, g):
    xq, xs, wq, ws = residuals  # x, w and g share the compute dtype.
    dot = lambda x, w: jax.lax.dot_general(x, w, dimension_numbers)
    _, transpose = jax.vjp(dot, _dequantize(xq, xs, g.dtype), _dequantize(wq, ws, g.dtype))
    return transpose(_dequantize(*_quantize(g, E5M2), g.dtype))


fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)


class Linear(nn.Module):
    """Contracts the last `len(axes) - len(features)` dims of x with a kernel.

    `axes` names every kernel dimension, inputs first: e.g. ("embed", "heads", "head_dim").
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    fp8_gather: bool = False  # ZeRO-3's all-gather of the kernel in FP8 (zero3_dot).
    use_bias: bool = False  # A bias over the output dims (GPT-2, BERT), named like them.

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = self._project(x)
        if not self.use_bias:
            return y
        out_axes = self.axes[len(self.axes) - len(self.features) :]
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, out_axes),
            self.features,
            self.param_dtype,
        )
        return y + constrain(bias.astype(self.dtype), out_axes)

    def _project(self, x: jax.Array) -> jax.Array:
        n_in = len(self.axes) - len(self.features)
        in_shape = x.shape[x.ndim - n_in :]
        init = nn.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.axes),
            (*in_shape, *self.features),
            self.param_dtype,
        )
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        dims, x = (contract, ((), ())), x.astype(self.dtype)
        dot = fp8_dot_general if self.fp8 else jax.lax.dot_general
        if self.fp8_gather and active_mesh() is not None:
            return zero3_dot(x, kernel.astype(self.dtype), self.axes, dims, dot)
        return dot(x, constrain(kernel.astype(self.dtype), self.axes), dims)


class Embed(nn.Module):
    """Token embedding table ("vocab", "embed"); `attend` reuses it as a tied LM head."""

    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("vocab", "embed")),
            (self.vocab_size, self.features),
            self.param_dtype,
        )

    def _table(self) -> jax.Array:
        return constrain(self.embedding.astype(self.dtype), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self._table(), tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self._table())
