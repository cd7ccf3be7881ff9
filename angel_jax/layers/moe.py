"""Mixture of experts: the module (router, experts' weights) and its router losses.

Routers (per group of tokens; a group is one sequence, so what is dropped does not depend on
how the batch is split over devices):
  topk           each token picks its k best experts (softmax, renormalised over the k); each
                 expert takes at most `capacity` of a group's assignments, first choices first,
                 the rest are dropped (their share of the output is zero; the residual carries
                 the token);
  expert_choice  each expert picks its `capacity` best tokens of the group (Zhou et al. 2022);
  dropless       topk with no capacity: assignments sorted by expert, experts applied with
                 grouped matmuls (JAX's or tokamax's Mosaic GPU grouped GEMMs or `lax.ragged_dot`,
                 `config.model.moe_kernel`).
The compute and expert parallelism on `expert` live in parallel/expert.py.

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

from angel_jax.parallel.expert import expert_parallel

F32 = jnp.float32


def router_losses(logits_BTE, load_E):
    """(z-loss, load-balancing loss, the router's mean entropy in nats: log E when it cannot
    tell experts apart, 0 when every token is sure of one)."""
    logits = logits_BTE.astype(F32)
    logz_BT = jax.nn.logsumexp(logits, axis=-1)
    z = jnp.mean(jnp.square(logz_BT))
    probs_BTE = jax.nn.softmax(logits, axis=-1)
    # -sum p log p, with log p = logits - logz.
    entropy = jnp.mean(logz_BT - jnp.sum(probs_BTE * logits, axis=-1))
    probs = jnp.mean(probs_BTE, axis=(0, 1))
    fraction = load_E / jnp.maximum(jnp.sum(load_E), 1.0)
    return z, logits.shape[-1] * jnp.sum(fraction * probs), entropy


class MoE(nn.Module):
    """x (B, T, D) -> (y (B, T, D), metrics). `router`: topk | expert_choice | dropless."""

    num_experts: int
    experts_per_token: int
    hidden: int
    router: str = "topk"
    capacity_factor: float = 1.25
    dtype: jnp.dtype = jnp.bfloat16
    dispatch_chunks: int = 1  # Parts of the slot buffers moved one after another.
    kernel: str = "xla"  # dropless's grouped matmuls (angel_jax/kernels.py).

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
        z, balance, entropy = router_losses(logits, load)
        return y.astype(x_BTD.dtype), dict(
            router_z_loss=z,
            load_balance_loss=balance,
            router_entropy=entropy,
            expert_load=load,
            dropped=dropped,
        )
