"""Mixture of experts: routers, dispatch, SwiGLU experts, and expert parallelism on `expert`.

Routers (per group of tokens; a group is one sequence, so what is dropped does not depend on
how the batch is split over devices):
  topk           each token picks its k best experts (softmax, renormalised over the k); each
                 expert takes at most `capacity` of a group's assignments, first choices first,
                 the rest are dropped (their share of the output is zero; the residual carries
                 the token);
  expert_choice  each expert picks its `capacity` best tokens of the group (Zhou et al. 2022);
  dropless       topk with no capacity: assignments sorted by expert, experts applied with
                 grouped matmuls (tokamax's Mosaic GPU grouped GEMM or `jax.lax.ragged_dot`,
                 `config.model.moe_kernel`).
Expert parallel: the experts' weights are split over `expert`, and so are the tokens (the
batch axis spans `data` and `expert`). Capacity routers move each group's (expert, slot) buffers
to the experts' ranks with one all-to-all and back with another; dropless gathers the tokens
of the `expert` group, applies the local experts, and reduce-scatters the result (no token has
a fixed slot to send). Tensor parallel splits each expert's hidden dimension over `tensor`;
with capacity routers each tensor rank then moves only its share of the slots
(expert-sequence parallel), and the buffers can move in chunks that overlap the experts'
compute (`expert_parallel`).

Losses (returned as metrics and added to the training loss by their weights): the router
z-loss, mean(logsumexp(logits)^2), which keeps bf16 router logits small (ST-MoE), and the
load-balancing loss E * sum_e f_e * p_e (Switch), f_e the fraction of assignments to expert e
and p_e its mean router probability.

Letters: B groups (sequences), T tokens per group, D model dim, E experts, C capacity,
F expert hidden dim, K experts per token.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from angel_jax.kernels import ragged_dot

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


def router_losses(logits_BTE, load_E):
    """(z-loss, load-balancing loss)."""
    logits = logits_BTE.astype(F32)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    probs = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=(0, 1))
    fraction = load_E / jnp.maximum(jnp.sum(load_E), 1.0)
    return z, logits.shape[-1] * jnp.sum(fraction * probs)


def _swiglu(x, gate, up, down):
    """SwiGLU experts: x (..., E, C, D) with weights (E, D, F), (E, D, F), (E, F, D)."""
    h = jax.nn.silu(jnp.einsum("...ecd,edf->...ecf", x, gate)) * jnp.einsum(
        "...ecd,edf->...ecf", x, up
    )
    return jnp.einsum("...ecf,efd->...ecd", h, down)


def _dropless(x_ND, top_e, top_p, gate, up, down, first: int, kernel: str):
    """Outputs (N, D) f32 of the experts first..first+E_local over rows x with their top-K
    choices: assignments sorted by expert, grouped matmuls (`kernels.ragged_dot`), the outputs
    put back in assignment order and weighted per row. Sorting and unsorting are gathers by
    permutations (their transposes scatter without collisions), not scatter-adds."""
    n, k = top_e.shape
    local = gate.shape[0]
    flat_e = top_e.reshape(-1) - first
    mine = (flat_e >= 0) & (flat_e < local)
    key = jnp.where(mine, flat_e, local)  # Other ranks' experts sort last, past the groups.
    order = jnp.argsort(key, stable=True)  # Sorted slot -> assignment (row * K + choice).
    sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
    permute = lambda a, idx: a.at[idx].get(unique_indices=True)
    xs = permute(jnp.repeat(x_ND, k, axis=0), order)
    # Named for the remat policies. The down projection is recomputed in the backward pass
    # (the router's gradient needs it): keeping it too took moe_1b past one H200's memory.
    grouped = lambda a, w: checkpoint_name(ragged_dot(a, w, sizes, kernel), "experts")
    h = jax.nn.silu(grouped(xs, gate)) * grouped(xs, up)
    out = ragged_dot(h, down, sizes, kernel)  # Rows past the local groups are zero.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k), unique_indices=True)
    unsorted = permute(out, inverse).reshape(n, k, -1)
    weight = jnp.where(mine, top_p.reshape(-1), 0.0).reshape(n, k, 1)
    return jnp.sum(unsorted.astype(F32) * weight, axis=1)


class MoE(nn.Module):
    """x (B, T, D) -> (y (B, T, D), metrics). `router`: topk | expert_choice | dropless."""

    num_experts: int
    experts_per_token: int
    hidden: int
    router: str = "topk"
    capacity_factor: float = 1.25
    dtype: jnp.dtype = jnp.bfloat16
    dispatch_chunks: int = 1  # Parts of the slot buffers moved one after another.
    kernel: str = "xla"  # dropless's grouped matmuls: "xla" or "tokamax" (angel_jax/kernels.py).

    @nn.compact
    def __call__(self, x_BTD):
        e, d, f = self.num_experts, x_BTD.shape[-1], self.hidden
        init = lambda fan_in: nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))
        param = lambda name, shape, axes, fan_in: self.param(
            name, nn.with_logical_partitioning(init(fan_in), axes), shape, F32
        )
        router = param("router", (d, e), ("embed", None), d)
        gate = param("gate", (e, d, f), ("expert", "embed", "mlp"), d)
        up = param("up", (e, d, f), ("expert", "embed", "mlp"), d)
        down = param("down", (e, f, d), ("expert", "mlp", "embed"), f)
        logits = jnp.einsum("btd,de->bte", x_BTD.astype(F32), router)
        cast = lambda w: w.astype(self.dtype)
        y, load, dropped = expert_parallel(
            self.router,
            x_BTD.astype(self.dtype),
            logits,
            (cast(gate), cast(up), cast(down)),
            self.experts_per_token,
            self.capacity_factor,
            self.dispatch_chunks,
            self.kernel,
        )
        z, balance = router_losses(logits, load)
        return y.astype(x_BTD.dtype), dict(
            router_z_loss=z, load_balance_loss=balance, expert_load=load, dropped=dropped
        )


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
    tp = mesh.shape["tensor"] if split else 1
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
            first = jax.lax.axis_index("tensor") * share
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, first, share, axis=2)
            token_of_slot, weight = take(token_of_slot), take(weight)
        y = jnp.zeros(x.shape, F32)
        step = share // (parts // tp)
        for i in range(parts // tp):
            slots = token_of_slot[:, :, i * step : (i + 1) * step].reshape(b, -1)
            xs = dispatch(x, slots, e)  # (B, E, step, D)
            if split:  # Each group's slots to the ranks of their experts.
                xs = jax.lax.all_to_all(xs, "expert", split_axis=1, concat_axis=0, tiled=True)
                if tp > 1:
                    xs = jax.lax.all_gather(xs, "tensor", axis=2, tiled=True)
            out = _swiglu(xs, gate, up, down)
            if split:  # And back.
                if tp > 1:
                    out = jax.lax.psum_scatter(out, "tensor", scatter_dimension=2, tiled=True)
                out = jax.lax.all_to_all(out, "expert", split_axis=0, concat_axis=1, tiled=True)
            chunk_weight = weight[:, :, i * step : (i + 1) * step].reshape(b, -1)
            y = y + combine(out, slots, chunk_weight, t)
        if tp > 1:
            # Each tensor rank combined its share of the slots; summed in the compute dtype, as
            # the expert outputs were before (half the bytes of float32).
            y = jax.lax.psum(y.astype(x.dtype), "tensor").astype(F32)
        if split:
            load = jax.lax.psum(load, ("data", "expert"))
            dropped = jax.lax.psum(dropped, ("data", "expert"))
        return y, load, dropped

    def dropless(x, logits, gate, up, down):
        top_p, top_e = jax.lax.top_k(jax.nn.softmax(logits.astype(F32), axis=-1), k)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        load = jnp.sum(jax.nn.one_hot(top_e, e, dtype=F32), axis=(0, 1, 2))
        rows = lambda a: a.reshape(-1, *a.shape[2:])
        if not split:
            out = _dropless(rows(x), rows(top_e), rows(top_p), gate, up, down, 0, kernel)
            return out.reshape(x.shape), load, jnp.zeros((), F32)
        # Every rank of the expert group sees the group's tokens, applies its experts.
        gather = lambda a: jax.lax.all_gather(a, "expert", axis=0, tiled=True)
        first = jax.lax.axis_index("expert") * gate.shape[0]
        out = _dropless(
            rows(gather(x)), rows(gather(top_e)), rows(gather(top_p)), gate, up, down, first, kernel
        )
        out = jax.lax.psum(out, "tensor")
        out = jax.lax.psum_scatter(out, "expert", scatter_dimension=0, tiled=True)
        load = jax.lax.psum(load, ("data", "expert"))
        return out.reshape(x.shape), load, jnp.zeros((), F32)

    local = dropless if router == "dropless" else capacity_routed
    if not split:
        return local(x_BTD, logits_BTE, *weights)
    batch = sharding.active_spec(("batch",))[0]
    tokens = P(batch, None, None)
    expert_w = P("expert", None, "tensor")
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, expert_w, expert_w, P("expert", "tensor", None)),
        out_specs=(tokens, P(), P()),
        check_vma=False,
    )(x_BTD, logits_BTE, *weights)
