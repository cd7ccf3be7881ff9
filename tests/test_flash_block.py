"""The Pallas flash block (interpreted on CPU) equals the plain-JAX block of ring attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.parallel.attention import _block, _block_grads
from kernels_pallas.flash_block import flash_block_backward, flash_block_forward


def to_kernel(x):  # (B, T, K, G, H) -> (B, K*G, T, H)
    b, t, k, g, h = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(b, k * g, t, h)


def kv_to_kernel(x):  # (B, T, K, H) -> (B, K, T, H)
    return x.transpose(0, 2, 1, 3)


def stats_to_kernel(x):  # (B, K, G, T) -> (B, K*G, T)
    b, k, g, t = x.shape
    return x.reshape(b, k * g, t)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_flash_block_matches_the_reference(causal, dtype, group):
    b, tq, tk, kv, h = 2, 32, 48, 2, 16
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (b, tq, kv, group, h), dtype)
    k = jax.random.normal(keys[1], (b, tk, kv, h), dtype)
    v = jax.random.normal(keys[2], (b, tk, kv, h), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    # Zigzag-like positions: the queries start inside the keys, some rows see no key at all.
    q_pos = jnp.concatenate([jnp.arange(16) + 8, jnp.arange(16) + 100])
    k_pos = jnp.arange(tk) + 16

    out, lse = _block(q, k, v, q_pos, k_pos, causal)
    kout, klse = flash_block_forward(
        to_kernel(q),
        kv_to_kernel(k),
        kv_to_kernel(v),
        q_pos,
        k_pos,
        causal=causal,
        block_q=16,
        block_k=16,
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(kout, to_kernel(out), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isfinite(klse), np.isfinite(stats_to_kernel(lse)))
    finite = np.isfinite(klse)
    np.testing.assert_allclose(klse[finite], stats_to_kernel(lse)[finite], rtol=tol, atol=tol)
    if causal:
        assert not finite.all() and finite.any()  # Both kinds of rows are exercised.

    # Grads given the block's own statistics (a ring passes the final ones); rows that see no
    # key have no gradient, and lse -inf must not make them NaN.
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", do.astype(jnp.float32), out)
    dq, dk, dv = _block_grads(q, k, v, do, lse, delta, q_pos, k_pos, causal)
    kdq, kdk, kdv = flash_block_backward(
        to_kernel(q),
        kv_to_kernel(k),
        kv_to_kernel(v),
        to_kernel(do),
        stats_to_kernel(lse),
        stats_to_kernel(delta),
        q_pos,
        k_pos,
        causal=causal,
        block_q=16,
        block_k=16,
    )
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(kdq, to_kernel(dq), rtol=tol, atol=tol)
    np.testing.assert_allclose(kdk, kv_to_kernel(dk), rtol=tol, atol=tol)
    np.testing.assert_allclose(kdv, kv_to_kernel(dv), rtol=tol, atol=tol)
