"""Mixture-of-experts compute and expert parallelism on `expert`: routing, dispatch, the
SwiGLU experts, dropless grouped matmuls, and the `shard_map` that moves tokens to the experts'
ranks (layers/moe.py holds the module, its parameters and router losses).

Expert parallel: the experts' weights are split over `expert`, and so are the tokens (the
batch axis spans `data` and `expert`). Capacity routers move each group's (expert, slot) buffers
to the experts' ranks with one all-to-all and back with another; dropless gathers the tokens
of the `expert` group, applies the local experts, and reduce-scatters the result (no token has
a fixed slot to send). Tensor parallel splits each expert's hidden dimension over `tensor`;
with capacity routers each tensor rank then moves only its share of the slots
(expert-sequence parallel), and the buffers can move in chunks that overlap the experts'
compute (`expert_parallel`).

Letters: B groups (sequences), T tokens per group, D model dim, E experts, C capacity,
F expert hidden dim, K experts per token, N rows, M assignments.
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from angel_jax.kernels import ragged_dot
from angel_jax.mesh import DATA, EXPERT, TENSOR

F32 = jnp.float32


def capacity(tokens: int, experts: int, k: int, factor: float) -> int:
    """Slots per expert and group: factor x the even share of the group's assignments."""
    return max(1, math.ceil(factor * tokens * k / experts))


def route_topk(logits_BTE, k: int, cap: int):
    """(token of each slot (B, E*C), T where empty; its weight (B, E*C); load (E,); dropped ()).
    Slot e*C + c is expert e's c-th buffer row; first choices of every token fill first."""
    b, t, e = logits_BTE.shape
    probs = jax.nn.softmax(logits_BTE.astype(F32), axis=-1)
    top_p, top_e = jax.lax.top_k(probs, k)  # (B, T, K)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(top_e, e, dtype=jnp.int32)  # (B, T, K, E)
    # Rank of each assignment within its expert, counting choice by choice over the group.
    order = chosen.transpose(0, 2, 1, 3).reshape(b, k * t, e)
    rank = (jnp.cumsum(order, axis=1) - 1).reshape(b, k, t, e).transpose(0, 2, 1, 3)
    rank = jnp.sum(rank * chosen, axis=-1)  # (B, T, K)
    kept = rank < cap
    # Dropped assignments all land on one extra slot, cut off below.
    slot = jnp.where(kept, top_e * cap + rank, e * cap)
    rows = jnp.arange(b)[:, None, None]
    tokens = jnp.broadcast_to(jnp.arange(t)[None, :, None], slot.shape)
    token_of_slot = jnp.full((b, e * cap + 1), t).at[rows, slot].set(tokens)[:, :-1]
    weight = jnp.zeros((b, e * cap + 1), F32).at[rows, slot].set(top_p)[:, :-1]
    load = jnp.sum(chosen, axis=(0, 1, 2)).astype(F32)
    return token_of_slot, weight, load, jnp.sum(~kept).astype(F32)


def route_expert_choice(logits_BTE, cap: int):
    """Each expert takes its `cap` highest-probability tokens of each group (same outputs as
    `route_topk`, with C = min(cap, T))."""
    b, t, e = logits_BTE.shape
    probs = jax.nn.softmax(logits_BTE.astype(F32), axis=-1)
    top_p, top_t = jax.lax.top_k(probs.swapaxes(1, 2), min(cap, t))  # (B, E, C)
    load = jnp.full((e,), b * top_t.shape[-1], F32)
    return top_t.reshape(b, -1), top_p.reshape(b, -1), load, jnp.zeros((), F32)


def dispatch(x_BTD, token_of_slot, experts: int):
    """The experts' buffers (B, E, C, D): each slot's token row, zeros in empty slots. A
    gather, not a one-hot matmul: the (B, T, E, C) one-hots cost more FLOPs than the experts."""
    b, _, d = x_BTD.shape
    padded = jnp.concatenate([x_BTD, jnp.zeros((b, 1, d), x_BTD.dtype)], axis=1)
    rows = jnp.take_along_axis(padded, token_of_slot[..., None], axis=1)
    return rows.reshape(b, experts, -1, d)


def combine(out_BECD, token_of_slot, weight, tokens: int):
    """Each token's weighted sum (B, T, D) f32 of its slots' expert outputs (a scatter-add)."""
    b, d = out_BECD.shape[0], out_BECD.shape[-1]
    rows = out_BECD.reshape(b, -1, d).astype(F32) * weight[..., None]
    y = jnp.zeros((b, tokens + 1, d), F32).at[jnp.arange(b)[:, None], token_of_slot].add(rows)
    return y[:, :tokens]


def swiglu_experts(x, gate, up, down):
    """SwiGLU experts: x (..., E, C, D) with weights (E, D, F), (E, D, F), (E, F, D)."""
    h = jax.nn.silu(jnp.einsum("...ecd,edf->...ecf", x, gate)) * jnp.einsum(
        "...ecd,edf->...ecf", x, up
    )
    return jnp.einsum("...ecf,efd->...ecd", h, down)


def dense_rows(assignments: int, experts: int, share: float) -> int:
    """Rows per expert that `dropless_experts` runs through the dense batched matmul: `share` of the
    even share of `assignments`, rounded down to a multiple of 8 (0 turns it off)."""
    return int(share * assignments / experts) // 8 * 8


def dropless_experts(x_ND, top_e, top_p, gate, up, down, first: int, kernel: str, dense: int = 0):
    """Outputs (N, D) f32 of the experts first..first+E_local over rows x with their top-K
    choices. Each expert's first `dense` assignments (in row order) go through one batched
    dense matmul (E, C, D) x (E, D, F), groups short of C padded with zeros; the rest, sorted
    by expert, through grouped matmuls (`kernels.ragged_dot`). A grouped GEMM runs at a third
    of a dense matmul's speed on an H200 (experiments/results/grouped_gemm.json), so with
    balanced routing most of the work moves to the fast kernel; none is ever dropped. The
    outputs are gathered back per assignment and weighted per row."""
    n, k = top_e.shape
    m, local, c = n * k, gate.shape[0], dense
    flat_e = top_e.reshape(-1) - first
    mine = (flat_e >= 0) & (flat_e < local)
    key = jnp.where(mine, flat_e, local)  # Other ranks' experts sort last, past the groups.
    order = jnp.argsort(key, stable=True)  # Sorted slot -> assignment (row * K + choice).
    sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    permute = lambda a, idx: a.at[idx].get(unique_indices=True)
    inverse = lambda perm: jnp.zeros_like(perm).at[perm].set(jnp.arange(m), unique_indices=True)
    position = inverse(order) - jnp.append(starts, 0)[key]  # Within its expert's assignments.
    in_dense = mine & (position < c)
    # The rest, sorted by expert, are the grouped GEMMs' rows; the dense part's and other
    # ranks' sort past the groups (the kernels leave those rows out).
    rest_key = jnp.where(in_dense, local, key)
    rest_order = jnp.argsort(rest_key, stable=True) if c else order
    rest_sizes = jnp.bincount(rest_key, length=local + 1)[:local].astype(jnp.int32)
    x_rep = jnp.repeat(x_ND, k, axis=0)  # One row per assignment.
    named = lambda a: checkpoint_name(a, "experts")  # Saved by the dots remat policies.
    # Under dots_no_batch the down projections are recomputed in the backward pass (the
    # router's gradient needs them): keeping them too took moe_1b past one H200. With the
    # dense part the grouped GEMMs hold only the overflow, cheap to recompute, in (M, F)
    # buffers not worth keeping.
    rest_named = named if c == 0 else (lambda a: a)
    xr = permute(x_rep, rest_order)
    h = jax.nn.silu(rest_named(ragged_dot(xr, gate, rest_sizes, kernel)))
    h = h * rest_named(ragged_dot(xr, up, rest_sizes, kernel))
    out = permute(ragged_dot(h, down, rest_sizes, kernel), inverse(rest_order))  # (M, D).
    if c:
        slot = starts[:, None] + jnp.arange(c)  # (E, C): sorted slots of each expert's first C.
        dense_assignment = jnp.where(jnp.arange(c) < sizes[:, None], order[slot % m], m)
        take = lambda a, idx: a.at[idx].get(mode="fill", fill_value=0)
        xd = take(x_rep, dense_assignment)  # (E, C, D), zero past a group's size.
        hd = jax.nn.silu(named(jnp.einsum("ecd,edf->ecf", xd, gate)))
        hd = hd * named(jnp.einsum("ecd,edf->ecf", xd, up))
        out_dense = jnp.einsum("ecf,efd->ecd", hd, down).reshape(local * c, -1)
        dense_out = take(out_dense, jnp.where(in_dense, key * c + position, local * c))
        out = jnp.where(in_dense[:, None], dense_out, out)
    weight = jnp.where(mine, top_p.reshape(-1), 0.0).reshape(n, k, 1)
    return jnp.sum(out.reshape(n, k, -1).astype(F32) * weight, axis=1)


def expert_parallel(
    router, x_BTD, logits_BTE, weights, k, factor, chunks=1, kernel="xla", dense_share=0.0
):
    """The routed expert outputs (B, T, D) f32, the load per expert (assignments, summed over
    the batch) and the number of dropped assignments, over the active mesh's `expert` axis (and
    `tensor` inside each expert) when the rules split the experts, else on one device.

    Capacity routers move the slot buffers in `chunks` parts (slices of every expert's slots),
    each part's all-to-all independent of the previous part's expert compute, so the scheduler
    can run one while the other computes. With `tensor` > 1 each tensor rank sends a 1/tensor
    share of the slots (expert-sequence parallel: no rank sends what another tensor rank
    sends), gathers the others' inside its expert group for the split expert matmuls, and
    reduce-scatters their outputs back."""
    mesh = sharding.active_mesh()
    split = mesh is not None and sharding.rule("expert") is not None
    tp = mesh.shape[TENSOR] if split else 1
    t, e = x_BTD.shape[1], logits_BTE.shape[-1]
    cap = capacity(t, e, k, factor)

    def capacity_routed(x, logits, gate, up, down):
        if router == "expert_choice":
            token_of_slot, weight, load, dropped = route_expert_choice(logits, cap)
        else:
            token_of_slot, weight, load, dropped = route_topk(logits, k, cap)
        # Every expert's C slots, padded with empty ones (token t, weight 0) to a multiple of
        # tensor x chunks; this tensor rank takes its share, then the chunks slice that.
        b, c = x.shape[0], token_of_slot.shape[1] // e
        parts = tp * min(chunks, -(-c // tp))  # No chunk of padding only.
        padded = -(-c // parts) * parts
        pad = lambda a, value: jnp.pad(
            a.reshape(b, e, c), ((0, 0), (0, 0), (0, padded - c)), constant_values=value
        )
        token_of_slot, weight = pad(token_of_slot, t), pad(weight, 0.0)
        share = padded // tp
        if tp > 1:
            first = jax.lax.axis_index(TENSOR) * share
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, first, share, axis=2)
            token_of_slot, weight = take(token_of_slot), take(weight)
        y = jnp.zeros(x.shape, F32)
        step = share // (parts // tp)
        for i in range(parts // tp):
            slots = token_of_slot[:, :, i * step : (i + 1) * step].reshape(b, -1)
            xs = dispatch(x, slots, e)  # (B, E, step, D)
            if split:  # Each group's slots to the ranks of their experts.
                xs = jax.lax.all_to_all(xs, EXPERT, split_axis=1, concat_axis=0, tiled=True)
                if tp > 1:
                    xs = jax.lax.all_gather(xs, TENSOR, axis=2, tiled=True)
            out = swiglu_experts(xs, gate, up, down)
            if split:  # And back.
                if tp > 1:
                    out = jax.lax.psum_scatter(out, TENSOR, scatter_dimension=2, tiled=True)
                out = jax.lax.all_to_all(out, EXPERT, split_axis=0, concat_axis=1, tiled=True)
            chunk_weight = weight[:, :, i * step : (i + 1) * step].reshape(b, -1)
            y = y + combine(out, slots, chunk_weight, t)
        if tp > 1:
            # Each tensor rank combined its share of the slots; summed in the compute dtype, as
            # the expert outputs were before (half the bytes of float32).
            y = jax.lax.psum(y.astype(x.dtype), TENSOR).astype(F32)
        if split:
            load = jax.lax.psum(load, (DATA, EXPERT))
            dropped = jax.lax.psum(dropped, (DATA, EXPERT))
        return y, load, dropped

    def dropless(x, logits, gate, up, down):
        top_p, top_e = jax.lax.top_k(jax.nn.softmax(logits.astype(F32), axis=-1), k)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        load = jnp.sum(jax.nn.one_hot(top_e, e, dtype=F32), axis=(0, 1, 2))
        rows = lambda a: a.reshape(-1, *a.shape[2:])
        if not split:
            dense = dense_rows(top_e.size, e, dense_share)
            out = dropless_experts(
                rows(x), rows(top_e), rows(top_p), gate, up, down, 0, kernel, dense
            )
            return out.reshape(x.shape), load, jnp.zeros((), F32)
        # Every rank of the expert group sees the group's tokens, applies its experts.
        gather = lambda a: jax.lax.all_gather(a, EXPERT, axis=0, tiled=True)
        first = jax.lax.axis_index(EXPERT) * gate.shape[0]
        top_e, top_p = rows(gather(top_e)), rows(gather(top_p))
        dense = dense_rows(top_e.size, e, dense_share)
        out = dropless_experts(rows(gather(x)), top_e, top_p, gate, up, down, first, kernel, dense)
        out = jax.lax.psum(out, TENSOR)
        out = jax.lax.psum_scatter(out, EXPERT, scatter_dimension=0, tiled=True)
        load = jax.lax.psum(load, (DATA, EXPERT))
        return out.reshape(x.shape), load, jnp.zeros((), F32)

    local = dropless if router == "dropless" else capacity_routed
    if not split:
        return local(x_BTD, logits_BTE, *weights)
    batch = sharding.active_spec(("batch",))[0]
    tokens = P(batch, None, None)
    expert_w = P(EXPERT, None, TENSOR)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, expert_w, expert_w, P(EXPERT, TENSOR, None)),
        out_specs=(tokens, P(), P()),
        check_vma=False,
    )(x_BTD, logits_BTE, *weights)
