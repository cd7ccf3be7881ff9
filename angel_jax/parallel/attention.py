"""Attention over a sequence split across devices: ring attention on `context`, Ulysses on
`sequence`, or both.

Ring attention (Liu et al. 2023): each `context` rank keeps its query chunk and passes its
key/value chunk around the ring with `ppermute`, sending the next chunk while it computes on
the current one; blocks merge through their log-sum-exp. The backward pass rings again, with
each chunk's dK/dV travelling with it and arriving home after the last step.

Causal balance (zigzag): the sequence is cut into 2N chunks and rank i holds chunks i and
2N-1-i (`zigzag` reorders a sequence so; the model feeds tokens and positions in that order).
Then every rank does the same work at every ring step: at step s > 0 the chunk pair from rank
j = i - s either lies wholly before both of rank i's chunks' queries (j < i: both query chunks
see key chunk j) or only before the second (j > i: the second query chunk sees both key
chunks), two chunk blocks either way; step 0 is the local diagonal.

Ulysses (Jacobs et al. 2023): an all-to-all turns a sequence-split tensor into a head-split one
around attention and back, so attention itself sees the whole (context-local) sequence.

Shapes: B batch, T length, N query heads, K kv heads, G = N / K, H head dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError
from angel_jax.sharding import shard_map_mesh
from kernels_pallas.flash_block import flash_block_backward, flash_block_forward

F32 = jnp.float32


def zigzag_order(length: int, ranks: int) -> np.ndarray:
    """Token order that puts chunks i and 2N-1-i of a `length` sequence on rank i of `ranks`."""
    if length % (2 * ranks):
        raise ConfigError(
            f"config.train.seq_len={length} is not divisible by 2 x config.mesh.context="
            f"{2 * ranks} (ring attention's zigzag split); change one so it divides"
        )
    chunks = np.arange(length).reshape(2 * ranks, -1)
    return np.concatenate([chunks[[i, 2 * ranks - 1 - i]].ravel() for i in range(ranks)])


def _block(q, k, v, q_pos, k_pos, causal):
    """Attention of a query block to a key block: (out f32 (B,Tq,K,G,H), lse f32 (B,K,G,Tq)).
    Masked rows (no visible key) get lse = -inf and out = 0."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(v.dtype), v, preferred_element_type=F32)
    return out, lse


def _merge(out, lse, out_b, lse_b):
    """Combines two partial softmax attentions of the same queries over disjoint keys."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w, w_b = jnp.exp(lse - safe), jnp.exp(lse_b - safe)  # (B,K,G,Tq)
    to_out = lambda w: jnp.moveaxis(w, -1, 1)[..., None]  # -> (B,Tq,K,G,1)
    return out * to_out(w) + out_b * to_out(w_b), new


def _block_grads(q, k, v, do, lse, delta, q_pos, k_pos, causal):
    """(dq, dk, dv) in f32 of one block, given the final lse and delta = sum(do * out)."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, -jnp.inf)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k.astype(F32))
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q.astype(F32))
    return dq, dk, dv


def _pallas_block(q, k, v, q_pos, k_pos, causal):
    """`_block` through the Pallas flash kernel (its layouts are head-major)."""
    b, t, kh, g, h = q.shape
    out, lse = flash_block_forward(
        _heads_major(q),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        q_pos,
        k_pos,
        causal=causal,
    )
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4), lse.reshape(b, kh, g, t)


def _pallas_block_grads(q, k, v, do, lse, delta, q_pos, k_pos, causal):
    """`_block_grads` through the Pallas flash kernels."""
    b, t, kh, g, h = q.shape
    dq, dk, dv = flash_block_backward(
        _heads_major(q),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        _heads_major(do),
        lse.reshape(b, kh * g, t),
        delta.reshape(b, kh * g, t),
        q_pos,
        k_pos,
        causal=causal,
    )
    back = lambda x: x.transpose(0, 2, 1, 3)
    return dq.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4), back(dk), back(dv)


def _heads_major(x):
    """(B, T, K, G, H) -> (B, K*G, T, H)."""
    b, t, kh, g, h = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(b, kh * g, t, h)


BLOCKS = {"xla": (_block, _block_grads), "pallas": (_pallas_block, _pallas_block_grads)}


class _Ring:
    """The ring schedule on one rank (inside shard_map over `axis`), for local query and
    key/value chunks of length 2c (causal: in zigzag order) or any length (non-causal)."""

    def __init__(self, axis: str, causal: bool, length: int):
        self.axis, self.causal = axis, causal
        self.n = jax.lax.axis_size(axis)
        self.rank = jax.lax.axis_index(axis)
        self.c = length // 2

    def positions(self, rank):
        """Global positions of a rank's tokens (zigzag chunks rank and 2N-1-rank)."""
        first = jnp.arange(self.c) + rank * self.c
        return jnp.concatenate([first, first + (2 * self.n - 1 - 2 * rank) * self.c])

    def send(self, tree):
        perm = [(i, (i + 1) % self.n) for i in range(self.n)]
        return jax.lax.ppermute(tree, self.axis, perm)

    def pairs(self, step):
        """The blocks to compute at `step`, as a branch index and the source rank: 0 the
        diagonal (step 0), 1 all queries x the first key chunk (source before this rank),
        2 the second query chunk x all keys (source after); non-causal: always 3 (all x all)."""
        src = (self.rank - step) % self.n
        if not self.causal:
            return jnp.int32(3), src
        branch = jnp.where(step == 0, 0, jnp.where(src < self.rank, 1, 2))
        return branch, src


def _ring_forward(q, k, v, axis, causal, blocks_impl):
    block, block_grads = BLOCKS[blocks_impl]
    ring = _Ring(axis, causal, q.shape[1])
    c, q_pos = ring.c, ring.positions(ring.rank)

    def blocks(branch, kv, src):
        """(out, lse) over all local queries from this key/value chunk (zeros/-inf where a
        branch leaves queries out)."""
        k, v = kv
        k_pos = ring.positions(src)
        none = (
            jnp.zeros(q.shape, F32),
            jnp.full((q.shape[0], q.shape[2], q.shape[3], q.shape[1]), -jnp.inf, F32),
        )

        def diagonal():  # Causal within the local pair of chunks.
            return block(q, k, v, q_pos, k_pos, True)

        def before():  # Every local query sees key chunk `src` (the first of its pair).
            return block(q, k[:, :c], v[:, :c], q_pos, k_pos[:c], False)

        def after():  # Only the second query chunk sees the pair, both chunks of it.
            out, lse = block(q[:, c:], k, v, q_pos[c:], k_pos, False)
            return (
                none[0].at[:, c:].set(out),
                none[1].at[..., c:].set(lse),
            )

        def full():
            return block(q, k, v, q_pos, k_pos, False)

        return jax.lax.switch(branch, (diagonal, before, after, full))

    def step(s, carry):
        out, lse, kv = carry
        incoming = ring.send(kv)  # Overlaps with this step's blocks.
        branch, src = ring.pairs(s)
        out_b, lse_b = blocks(branch, kv, src)
        out, lse = _merge(out, lse, out_b, lse_b)
        return out, lse, incoming

    branch, src = ring.pairs(0)
    out, lse = blocks(branch, (k, v), src)
    incoming = ring.send((k, v))
    out, lse, _ = jax.lax.fori_loop(1, ring.n, step, (out, lse, incoming))
    return out, lse


def _ring_backward(q, k, v, out, lse, do, axis, causal, blocks_impl):
    block, block_grads = BLOCKS[blocks_impl]
    ring = _Ring(axis, causal, q.shape[1])
    c, q_pos = ring.c, ring.positions(ring.rank)
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", do.astype(F32), out)

    def grads(branch, k, v, src):
        k_pos = ring.positions(src)

        def diagonal():
            return block_grads(q, k, v, do, lse, delta, q_pos, k_pos, True)

        def before():
            dq, dk, dv = block_grads(q, k[:, :c], v[:, :c], do, lse, delta, q_pos, k_pos[:c], False)
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
            return dq, pad(dk), pad(dv)

        def after():
            dq, dk, dv = block_grads(
                q[:, c:], k, v, do[:, c:], lse[..., c:], delta[..., c:], q_pos[c:], k_pos, False
            )
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

        def full():
            return block_grads(q, k, v, do, lse, delta, q_pos, k_pos, False)

        return jax.lax.switch(branch, (diagonal, before, after, full))

    def step(s, carry):
        dq, k, v, dk, dv = carry
        branch, src = ring.pairs(s)
        dq_b, dk_b, dv_b = grads(branch, k, v, src)
        # The chunk moves on with its grads so far; after the last step one more hop
        # brings every chunk's dK/dV home.
        return (dq + dq_b, *ring.send((k, v, dk + dk_b, dv + dv_b)))

    zeros = lambda x: jnp.zeros(x.shape, F32)
    carry = (zeros(q), k, v, zeros(k), zeros(v))
    dq, _, _, dk, dv = jax.lax.fori_loop(0, ring.n, step, carry)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring_attention_local(q, k, v, axis, causal, blocks_impl):
    out, _ = _ring_forward(q, k, v, axis, causal, blocks_impl)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, axis, causal, blocks_impl):
    out, lse = _ring_forward(q, k, v, axis, causal, blocks_impl)
    return out.astype(q.dtype), (q, k, v, out, lse)


def _ring_bwd(axis, causal, blocks_impl, residuals, do):
    q, k, v, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, out, lse, do, axis, causal, blocks_impl)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring_attention_local.defvjp(_ring_fwd, _ring_bwd)


def _local_attention(q, k, v, causal, implementation):
    """Attention on one device (B, T, N, H) x (B, T, K, H)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


def sequence_parallel_attention(
    q,
    k,
    v,
    mesh,
    spec: P,
    *,
    causal: bool = True,
    implementation: str | None = None,
    ring_blocks: str = "xla",
):
    """Attention of global q (B, T, N, H) and k, v (B, T, K, H) laid out by `spec`, whose
    length entry names `context` and/or `sequence` (in that order). With `context`, the
    sequence must be in `zigzag_order` when causal. `implementation` picks the local attention
    (`jax.nn.dot_product_attention`'s) without a ring, `ring_blocks` the ring's block math
    ("xla" or "pallas"). Returns (B, T, N, H) like q."""
    length_axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
    ring = "context" in length_axes and mesh.shape["context"] > 1
    ulysses = "sequence" in length_axes and mesh.shape["sequence"] > 1
    heads_axes = spec[2] if isinstance(spec[2], tuple) else (spec[2],)
    split = int(np.prod([mesh.shape[a] for a in heads_axes if a]))
    n = q.shape[2]
    s = mesh.shape["sequence"] if ulysses else 1
    if n % (split * s):
        raise ConfigError(
            f"config.model.num_heads={n} is not divisible by config.mesh.tensor x "
            f"config.mesh.sequence = {split} x {s}: each device attends with a whole number "
            f"of heads; make the heads divisible by {split * s}"
        )
    if k.shape[2] % (split * s):
        # Too few KV heads to split: give every query head its own copy.
        k, v = jnp.repeat(k, n // k.shape[2], axis=2), jnp.repeat(v, n // v.shape[2], axis=2)

    def local(q, k, v):
        if ulysses:  # Sequence-split -> head-split.
            to_heads = functools.partial(
                jax.lax.all_to_all, axis_name="sequence", split_axis=2, concat_axis=1, tiled=True
            )
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
        if ring:
            b, t, nh, h = q.shape
            kh = k.shape[2]
            grouped = q.reshape(b, t, kh, nh // kh, h)
            out = _ring_attention_local(grouped, k, v, "context", causal, ring_blocks)
            out = out.reshape(b, t, nh, h)
        else:
            out = _local_attention(q, k, v, causal, implementation)
        if ulysses:  # And back.
            out = jax.lax.all_to_all(out, "sequence", split_axis=1, concat_axis=2, tiled=True)
        return out

    return jax.shard_map(
        local,
        mesh=shard_map_mesh(mesh),
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )(q, k, v)
