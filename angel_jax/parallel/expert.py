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

import functools
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


def gather_rows(x_ND, idx_M):
    """x's rows idx (M, D). 16-bit rows move as 32-bit words: XLA:GPU's gather moves those
    about 1.3x as fast."""
    d = x_ND.shape[-1]
    if x_ND.dtype.itemsize != 2 or d % 2:
        return x_ND.at[idx_M].get(mode="promise_in_bounds")
    words = jax.lax.bitcast_convert_type(x_ND.reshape(-1, d // 2, 2), jnp.uint32)
    rows = words.at[idx_M].get(mode="promise_in_bounds")
    return jax.lax.bitcast_convert_type(rows, x_ND.dtype).reshape(-1, d)


def _summed_rows(y_MD, position_M, n: int):
    """(N, D) float32: each token's K rows of y (assignment token * K + choice is sorted row
    position[token * K + choice]), summed. One gather-and-reduce fusion."""
    rows = y_MD.at[position_M].get(unique_indices=True, mode="promise_in_bounds")
    return jnp.sum(rows.reshape(n, -1, y_MD.shape[-1]).astype(F32), axis=1)


@jax.custom_vjp
def sorted_rows(x_ND, order_M, position_M):
    """x's row of each sorted assignment (M, D): token order // K. Its gradient sums each
    token's K rows (a gather, where autodiff of a gather would scatter-add)."""
    return gather_rows(x_ND, order_M // (order_M.size // x_ND.shape[0]))


def _sorted_rows_fwd(x_ND, order_M, position_M):
    return sorted_rows(x_ND, order_M, position_M), (x_ND.shape[0], position_M)


def _sorted_rows_bwd(residuals, d_MD):
    n, position_M = residuals
    return _summed_rows(d_MD, position_M, n).astype(d_MD.dtype), None, None


sorted_rows.defvjp(_sorted_rows_fwd, _sorted_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def summed_rows(y_MD, order_M, position_M, n: int):
    """(N, D) float32: each token's K sorted rows of y summed (the dual of `sorted_rows`: its
    gradient is that gather, in y's dtype)."""
    return _summed_rows(y_MD, position_M, n)


def _summed_rows_fwd(y_MD, order_M, position_M, n):
    dtype = jnp.zeros((), y_MD.dtype)  # The cotangent's dtype, as a residual.
    return summed_rows(y_MD, order_M, position_M, n), (order_M, dtype)


def _summed_rows_bwd(n, residuals, d_ND):
    order_M, dtype = residuals
    return gather_rows(d_ND.astype(dtype.dtype), order_M // (order_M.size // n)), None, None


summed_rows.defvjp(_summed_rows_fwd, _summed_rows_bwd)


@jax.custom_vjp
def swiglu(h_MF2):
    """silu(gate) * up of the fused gate/up output (M, 2F): its gradient is written as one
    (M, 2F) array, not two halves padded and added."""
    gate, up = jnp.split(h_MF2, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(h_MF2):
    return swiglu(h_MF2), h_MF2


def _swiglu_bwd(h_MF2, d_MF):
    gate, up = jnp.split(h_MF2.astype(F32), 2, axis=-1)
    d, sig = d_MF.astype(F32), jax.nn.sigmoid(gate)
    d_gate = d * up * sig * (1.0 + gate * (1.0 - sig))
    return (jnp.concatenate([d_gate, d * gate * sig], axis=-1).astype(h_MF2.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def dropless_experts(x_ND, top_e, top_p, gate, up, down, first, kernel: str, all_local=False):
    """Outputs (N, D) f32 of the experts first..first+E_local over rows x with their top-K
    choices (`all_local`: these are all the experts, so every row is this rank's). The
    assignments, sorted by expert, go through grouped matmuls (`kernels.ragged_dot`, gate and
    up as one of 2F outputs, so x is read once); none is ever dropped. The sorted rows move by
    gathers both ways, in the backward pass too. Each assignment's router weight scales its
    hidden row before the down projection (linear, so the same sum): the router's gradient
    is then the hidden row's dot with the down projection's dX, which the backward computes
    anyway, and the down projection's output is needed by nothing in the backward (not
    saved, not recomputed)."""
    n, k = top_e.shape
    m, local = n * k, gate.shape[0]
    flat_e = top_e.reshape(-1) - first
    mine = (flat_e >= 0) & (flat_e < local)
    # Other ranks' assignments sort last, past the groups: the kernels leave those rows out.
    key = jnp.where(mine, flat_e, local)
    order = jnp.argsort(key, stable=True)  # Sorted row -> assignment (token * K + choice).
    position = jnp.zeros_like(order).at[order].set(jnp.arange(m), unique_indices=True)
    sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
    # Saved by the dots remat policies: the assignments' sorted rows, gate+up output and
    # weighted hidden rows (the projections' dW take the first and last) and the sort's
    # indices, so the backward recomputes neither gathers nor the sort. The barrier keeps
    # XLA:GPU from fusing a kernel into the scan's stacking of saved values: it then ran the
    # kernel twice, once for the stack and once for the layer (seen in the compiled HLO).
    saved = lambda a: checkpoint_name(jax.lax.optimization_barrier(a), "experts")
    order, position, sizes = saved((order, position, sizes))
    grouped = lambda x, w: ragged_dot(x, w, sizes, kernel, every_row=all_local)
    rows = saved(sorted_rows(x_ND, order, position))
    h = saved(grouped(rows, jnp.concatenate([gate, up], -1)))
    weight = jnp.where(mine, top_p.reshape(-1), 0.0)[order]  # (M,), sorted.
    a = saved((swiglu(h) * weight[:, None]).astype(h.dtype))
    return summed_rows(grouped(a, down), order, position, n)


def expert_parallel(router, x_BTD, logits_BTE, weights, k, factor, chunks=1, kernel="xla"):
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
            out = dropless_experts(
                rows(x), rows(top_e), rows(top_p), gate, up, down, 0, kernel, all_local=True
            )
            return out.reshape(x.shape), load, jnp.zeros((), F32)
        # Every rank of the expert group sees the group's tokens, applies its experts.
        gather = lambda a: jax.lax.all_gather(a, EXPERT, axis=0, tiled=True)
        first = jax.lax.axis_index(EXPERT) * gate.shape[0]
        top_e, top_p = rows(gather(top_e)), rows(gather(top_p))
        out = dropless_experts(rows(gather(x)), top_e, top_p, gate, up, down, first, kernel)
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
