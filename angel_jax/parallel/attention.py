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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError
from angel_jax.kernels import RING_BLOCKS
from angel_jax.mesh import CONTEXT, SEQUENCE
from angel_jax.remat import ATTENTION_RESULTS
from angel_jax.sharding import shard_map_mesh

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


def merge_blocks(out, lse, out_b, lse_b):
    """Combines two partial softmax attentions of the same queries over disjoint keys."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w, w_b = jnp.exp(lse - safe), jnp.exp(lse_b - safe)  # (B,K,G,Tq)
    to_out = lambda w: jnp.moveaxis(w, -1, 1)[..., None]  # -> (B,Tq,K,G,1)
    return out * to_out(w) + out_b * to_out(w_b), new


class _Ring:
    """The ring schedule on one rank (inside shard_map over `axis`), for local query and
    key/value chunks of length 2c (causal: in zigzag order) or any length (non-causal)."""

    def __init__(self, axis: str, causal: bool, length: int):
        self.axis, self.causal = axis, causal
        self.n = jax.lax.axis_size(axis)
        self.rank = jax.lax.axis_index(axis)
        self.c = length // 2

    def send(self, tree):
        perm = [(i, (i + 1) % self.n) for i in range(self.n)]
        return jax.lax.ppermute(tree, self.axis, perm)

    def schedule(self, step, *, diagonal, before, after, full):
        """The blocks of ring step `step` (0, or traced inside the loop): the local diagonal
        at step 0, all x all when not causal; else `before` (all queries x the source's first
        key chunk) when the source rank precedes this one, `after` (the second query chunk x
        both of its key chunks) when it follows."""
        if not self.causal:
            return full()
        if isinstance(step, int) and step == 0:
            return diagonal()
        src = (self.rank - step) % self.n
        return jax.lax.cond(source_precedes(src, self.rank), before, after)


def source_precedes(src, rank):
    """Whether rank `src`'s chunk pair (src, 2N-1-src) sits, seen from `rank`'s queries, wholly
    before both query chunks (else only before the second)."""
    return src < rank


def _ring_forward(q, k, v, axis, causal, blocks_impl):
    kernel, _ = RING_BLOCKS[blocks_impl]

    def block(*args):  # Outputs widened to float32, in which the ring merges them.
        out, lse = kernel(*args)
        return out.astype(F32), lse

    ring = _Ring(axis, causal, q.shape[1])
    c = ring.c

    def blocks(step, kv):
        """(out, lse) over all local queries from this key/value chunk pair (zeros/-inf where
        a step leaves queries out). Every block is fully visible or causal with aligned
        chunks, which is what flash kernels take."""
        k, v = kv

        def diagonal():
            # The first query chunk sees the first key chunk causally; the second (later in
            # the sequence) sees the first whole and the second causally.
            out_a, lse_a = block(q[:, :c], k[:, :c], v[:, :c], True)
            out_b, lse_b = merge_blocks(
                *block(q[:, c:], k[:, :c], v[:, :c], False),
                *block(q[:, c:], k[:, c:], v[:, c:], True),
            )
            return jnp.concatenate([out_a, out_b], 1), jnp.concatenate([lse_a, lse_b], -1)

        def after():  # Only the second query chunk sees the pair, both chunks of it.
            out, lse = block(q[:, c:], k, v, False)
            none_out = jnp.zeros_like(out)
            none_lse = jnp.full(lse.shape, -jnp.inf, F32)
            return jnp.concatenate([none_out, out], 1), jnp.concatenate([none_lse, lse], -1)

        return ring.schedule(
            step,
            diagonal=diagonal,
            before=lambda: block(q, k[:, :c], v[:, :c], False),
            after=after,
            full=lambda: block(q, k, v, False),
        )

    def step(s, carry):
        out, lse, kv = carry
        incoming = ring.send(kv)  # Overlaps with this step's blocks.
        out, lse = merge_blocks(out, lse, *blocks(s, kv))
        return out, lse, incoming

    out, lse = blocks(0, (k, v))
    incoming = ring.send((k, v))
    out, lse, _ = jax.lax.fori_loop(1, ring.n, step, (out, lse, incoming))
    return out, lse


def _ring_backward(q, k, v, out, lse, do, axis, causal, blocks_impl):
    _, kernel = RING_BLOCKS[blocks_impl]
    block_grads = lambda *a: tuple(g.astype(F32) for g in kernel(*a))  # Summed over the ring.
    ring = _Ring(axis, causal, q.shape[1])
    c = ring.c
    first, second = (lambda x: x[:, :c]), (lambda x: x[:, c:])
    lse_first, lse_second = lse[..., :c], lse[..., c:]
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)

    def grads(step, k, v):
        def diagonal():  # The forward's three blocks.
            dq_a, dk_a, dv_a = block_grads(
                first(q), first(k), first(v), first(do), first(out), lse_first, True
            )
            dq_b1, dk_b1, dv_b1 = block_grads(
                second(q), first(k), first(v), second(do), second(out), lse_second, False
            )
            dq_b2, dk_b2, dv_b2 = block_grads(
                second(q), second(k), second(v), second(do), second(out), lse_second, True
            )
            return cat(dq_a, dq_b1 + dq_b2), cat(dk_a + dk_b1, dk_b2), cat(dv_a + dv_b1, dv_b2)

        def before():
            dq, dk, dv = block_grads(q, first(k), first(v), do, out, lse, False)
            return dq, cat(dk, jnp.zeros_like(dk)), cat(dv, jnp.zeros_like(dv))

        def after():
            dq, dk, dv = block_grads(second(q), k, v, second(do), second(out), lse_second, False)
            return cat(jnp.zeros_like(dq), dq), dk, dv

        return ring.schedule(
            step,
            diagonal=diagonal,
            before=before,
            after=after,
            full=lambda: block_grads(q, k, v, do, out, lse, False),
        )

    def step(s, carry):
        dq, k, v, dk, dv = carry
        dq_b, dk_b, dv_b = grads(s, k, v)
        # The chunk moves on with its grads so far; after the last step one more hop
        # brings every chunk's dK/dV home.
        return (dq + dq_b, *ring.send((k, v, dk + dk_b, dv + dv_b)))

    carry = step(0, (0.0, k, v, 0.0, 0.0))  # Step 0 (the diagonal) outside the loop.
    dq, _, _, dk, dv = jax.lax.fori_loop(1, ring.n, step, carry)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring_attention_local(q, k, v, axis, causal, blocks_impl):
    """Attention of this rank's q over every rank's k, v along mesh `axis` (inside shard_map),
    the k, v chunks passed round the ring; `blocks_impl` computes each block (`kernels`)."""
    out, _ = _ring_forward(q, k, v, axis, causal, blocks_impl)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, axis, causal, blocks_impl):
    out, lse = _ring_forward(q, k, v, axis, causal, blocks_impl)
    # Named, so that a remat policy can keep them (remat.flash_attention_saveable) instead of
    # running the whole ring forward again in the backward pass, which takes the output (the
    # output projection's weight grad) as well as the residuals. The backward's blocks take
    # the output in q's dtype, as cuDNN's does.
    out, lse = checkpoint_name((out.astype(q.dtype), lse), ATTENTION_RESULTS)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis, causal, blocks_impl, residuals, do):
    q, k, v, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, out, lse, do, axis, causal, blocks_impl)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


ring_attention_local.defvjp(_ring_fwd, _ring_bwd)


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
    (`jax.nn.dot_product_attention`'s) without a ring, `ring_blocks` the ring's block kernels
    ("xla", "cudnn" or "tokamax", angel_jax/kernels.py). Returns (B, T, N, H) like q."""
    length_axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
    ring = CONTEXT in length_axes and mesh.shape[CONTEXT] > 1
    ulysses = SEQUENCE in length_axes and mesh.shape[SEQUENCE] > 1
    heads_axes = spec[2] if isinstance(spec[2], tuple) else (spec[2],)
    split = int(np.prod([mesh.shape[a] for a in heads_axes if a]))
    n = q.shape[2]
    s = mesh.shape[SEQUENCE] if ulysses else 1
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
                jax.lax.all_to_all, axis_name=SEQUENCE, split_axis=2, concat_axis=1, tiled=True
            )
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
        if ring:
            b, t, nh, h = q.shape
            kh = k.shape[2]
            grouped = q.reshape(b, t, kh, nh // kh, h)
            out = ring_attention_local(grouped, k, v, CONTEXT, causal, ring_blocks)
            out = out.reshape(b, t, nh, h)
        else:
            out = _local_attention(q, k, v, causal, implementation)
        if ulysses:  # And back.
            out = jax.lax.all_to_all(out, SEQUENCE, split_axis=1, concat_axis=2, tiled=True)
        return out

    return _on_each_device(local, mesh, spec, q, k, v)


def per_device_attention(q, k, v, mesh, spec: P, *, scale, causal, implementation):
    """Attention of global q (B, T, N, H) and k, v (their heads split like q's) laid out by
    `spec` (the length whole), each device on its own batch rows and heads. Inside a pipeline
    stage (a region manual over `pipeline` only) cuDNN's custom partitioner cannot lay its call
    out over the other split axes; a region manual over all of them leaves it nothing to
    partition."""

    def local(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation=implementation
        )

    return _on_each_device(local, mesh, spec, q, k, v)


def _on_each_device(local, mesh, spec: P, q, k, v):
    """`local` on each device's shards of q, k and v (all laid out by `spec`), in a region
    manual over every mesh axis (inside a pipeline stage, the rest of its mesh)."""
    return jax.shard_map(
        local,
        mesh=shard_map_mesh(mesh),
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )(q, k, v)
