"""Flash attention of one (query block, key/value block) pair in Pallas: the block step of ring
attention, forward and backward, with positions for the causal mask (so zigzag chunks work).

Forward: each program takes `block_q` queries of one head and walks the keys `block_k` at a
time with an online softmax (running max and sum), returning the output and its log-sum-exp,
which ring attention merges across key/value chunks. Backward (FlashAttention-2's split): one
kernel accumulates dQ per query block over the key blocks, another dK and dV per key block over
the query blocks of every query head that shares the key/value head (GQA). Inputs are bf16 or
f32; every dot takes the inputs' dtype (the softmax grads are cast to it, as FlashAttention
does) and accumulates in f32; outputs and grads are f32, since the ring sums them further.
Under a causal mask, block pairs it hides entirely are skipped.

Layouts: B batch, N query heads, K kv heads (N = K x G), T length, H head dim; q (B, N, Tq, H),
k and v (B, K, Tk, H). On a CPU the kernels run in Pallas' interpreter (`interpret=True`):
that is how the tests check them. On a GPU they lower through Pallas' Triton backend.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _mask(s, q_pos, k_pos, causal):
    return jnp.where(q_pos[:, None] >= k_pos[None, :], s, -jnp.inf) if causal else s


def _unless_masked(causal, q_pos, k_pos, update, carry):
    """update(carry), skipped for a (query block, key block) pair the causal mask hides whole:
    half of a diagonal chunk pair's blocks (positions are given, so zigzag chunks work)."""
    if not causal:
        return update(carry)
    return jax.lax.cond(jnp.min(k_pos) <= jnp.max(q_pos), update, lambda c: c, carry)


def _forward_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, o_ref, lse_ref, *, causal, block_k):
    q, q_pos = q_ref[...], qp_ref[...]
    scale = q.shape[-1] ** -0.5

    def body(j, carry):
        keys = pl.ds(j * block_k, block_k)
        k_pos = kp_ref[keys]

        def update(carry):
            m, total, acc = carry
            k, v = k_ref[keys, :], v_ref[keys, :]
            s = _mask(jnp.dot(q, k.T, preferred_element_type=F32) * scale, q_pos, k_pos, causal)
            m_new = jnp.maximum(m, s.max(axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # Rows with nothing visible.
            p = jnp.exp(s - shift[:, None])
            alpha = jnp.exp(m - shift)
            total = alpha * total + p.sum(axis=-1)
            acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
            return m_new, total, acc

        return _unless_masked(causal, q_pos, k_pos, update, carry)

    rows = q.shape[0]
    init = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32), jnp.zeros(q.shape, F32))
    m, total, acc = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / total[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(total), -jnp.inf)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, dq_ref, *, causal, block_k
):
    q, do, lse, delta, q_pos = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], qp_ref[...]
    scale = q.shape[-1] ** -0.5

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k_pos = kp_ref[keys]

        def update(dq):
            k, v = k_ref[keys, :], v_ref[keys, :]
            s = _mask(jnp.dot(q, k.T, preferred_element_type=F32) * scale, q_pos, k_pos, causal)
            p = jnp.exp(s - lse[:, None])
            dp = jnp.dot(do, v.T, preferred_element_type=F32)
            ds = p * (dp - delta[:, None]) * scale
            # In the inputs' dtype, as every other dot: an f32 dot is many times slower.
            return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

        return _unless_masked(causal, q_pos, k_pos, update, dq)

    dq_ref[...] = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, F32))


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qp_ref,
    kp_ref,
    dk_ref,
    dv_ref,
    *,
    causal,
    block_q,
):
    k, v, k_pos = k_ref[...], v_ref[...], kp_ref[...]
    scale = k.shape[-1] ** -0.5
    group, length = q_ref.shape[0], q_ref.shape[1]

    def body(i, carry):  # i runs over (query head in the group, query block).
        # lax.div/rem, not // and %: their sign fix-ups do not lower to Triton (i32 vs i1).
        blocks = length // block_q
        g, rows = jax.lax.div(i, blocks), pl.ds(jax.lax.rem(i, blocks) * block_q, block_q)
        q_pos = qp_ref[rows]

        def update(carry):
            dk, dv = carry
            q, do = q_ref[g, rows, :], do_ref[g, rows, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            s = _mask(jnp.dot(q, k.T, preferred_element_type=F32) * scale, q_pos, k_pos, causal)
            p = jnp.exp(s - lse[:, None])
            dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=F32)
            dp = jnp.dot(do, v.T, preferred_element_type=F32)
            ds = p * (dp - delta[:, None]) * scale
            return dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=F32), dv

        return _unless_masked(causal, q_pos, k_pos, update, carry)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = jax.lax.fori_loop(0, group * (length // block_q), body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _blocks(length: int, block: int) -> int:
    block = min(block, length)
    if length % block:
        raise ValueError(f"length {length} is not a multiple of the block size {block}")
    return block


def _query_block_specs(h: int, tk: int, block_q: int, group: int):
    """BlockSpecs of the grid (batch, query head, query block) that the forward and dQ kernels
    share: a query block's rows and its per-row statistics, its kv head's keys (all of them),
    and the positions of both."""
    rows = pl.BlockSpec((None, None, block_q, h), lambda i, j, r: (i, j, r, 0))
    stats = pl.BlockSpec((None, None, block_q), lambda i, j, r: (i, j, r))
    keys = pl.BlockSpec((None, None, tk, h), lambda i, j, r: (i, j // group, 0, 0))
    q_pos = pl.BlockSpec((block_q,), lambda i, j, r: (r,))
    k_pos = pl.BlockSpec((tk,), lambda i, j, r: (0,))
    return rows, stats, keys, q_pos, k_pos


def flash_block_forward(q, k, v, q_pos, k_pos, *, causal, block_q=128, block_k=128):
    """(out f32 (B, N, Tq, H), lse f32 (B, N, Tq)) of q against k, v; rows that see no key
    get out 0 and lse -inf."""
    b, n, tq, h = q.shape
    kv, tk = k.shape[1], k.shape[2]
    block_q, block_k = _blocks(tq, block_q), _blocks(tk, block_k)
    rows, stats, keys, q_spec, k_spec = _query_block_specs(h, tk, block_q, n // kv)
    return pl.pallas_call(
        functools.partial(_forward_kernel, causal=causal, block_k=block_k),
        grid=(b, n, tq // block_q),
        in_specs=[rows, keys, keys, q_spec, k_spec],
        out_specs=[rows, stats],
        out_shape=[jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct((b, n, tq), F32)],
        interpret=_interpret(),
    )(q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32))


def flash_block_backward(
    q, k, v, do, lse, delta, q_pos, k_pos, *, causal, block_q=128, block_k=128
):
    """(dq, dk, dv) in f32 of one block, given the final lse (B, N, Tq) of these queries over
    all keys and delta = sum(do * out, -1) (B, N, Tq)."""
    b, n, tq, h = q.shape
    kv, tk = k.shape[1], k.shape[2]
    block_q, block_k = _blocks(tq, block_q), _blocks(tk, block_k)
    group = n // kv
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    rows, stats, keys, q_spec, k_spec = _query_block_specs(h, tk, block_q, group)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, block_k=block_k),
        grid=(b, n, tq // block_q),
        in_specs=[rows, keys, keys, rows, stats, stats, q_spec, k_spec],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(q.shape, F32),
        interpret=_interpret(),
    )(q, k, v, do, lse, delta, q_pos, k_pos)
    # dK/dV: one program per (batch, kv head, key block), over the group's query heads.
    group_rows = pl.BlockSpec((None, group, tq, h), lambda i, j, c: (i, j, 0, 0))
    group_stats = pl.BlockSpec((None, group, tq), lambda i, j, c: (i, j, 0))
    key_block = pl.BlockSpec((None, None, block_k, h), lambda i, j, c: (i, j, c, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, causal=causal, block_q=block_q),
        grid=(b, kv, tk // block_k),
        in_specs=[
            group_rows,
            key_block,
            key_block,
            group_rows,
            group_stats,
            group_stats,
            pl.BlockSpec((tq,), lambda i, j, c: (0,)),
            pl.BlockSpec((block_k,), lambda i, j, c: (c,)),
        ],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, F32), jax.ShapeDtypeStruct(v.shape, F32)],
        interpret=_interpret(),
    )(q, k, v, do, lse, delta, q_pos, k_pos)
    return dq, dk, dv
