"""AdamW or Adafactor with warmup + cosine decay and global-norm clipping, per parameter.

The optimizer state is a tree shaped like the params whose leaves are each parameter's own optax
state. That lets each state be placed, sharded and streamed (ZeRO-Cache) with its parameter.
A weight stacked over layers is optimized as one parameter per layer (vmapped over the layer
axis): the same as an unstacked model, and what lets ZeRO-Cache update it a layer at a time.
With LoRA (`adapters_only`) it trains the adapters alone: its state covers them and nothing
else (angel_jax/lora.py), and the base weights pass through its update as they came.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax

from angel_jax import lora
from angel_jax.optim.scaling import lr_and_warmup


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup, then cosine decay; the peak and the warmup follow the batch size when
    `train.lr_scaling` asks for it (optim/scaling.py)."""
    lr, warmup_steps = lr_and_warmup(train)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=min(warmup_steps, train.steps),
        decay_steps=max(train.steps, warmup_steps + 1),
        end_value=lr * train.min_lr_ratio,
    )


def _decays(path) -> bool:
    """Weight decay on matrices only: not on norm scales."""
    return "scale" not in jax.tree_util.keystr(path)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    decayed: optax.GradientTransformation
    undecayed: optax.GradientTransformation
    grad_clip: float  # Global-norm clipping; 0 disables.
    adapters_only: bool = False  # LoRA: the base weights are frozen, only the adapters train.

    def trained(self, tree):
        """The part of a params-shaped tree that it trains: the adapters under LoRA, else all."""
        return lora.adapters(tree) if self.adapters_only else tree

    def _tx(self, path) -> optax.GradientTransformation:
        return self.decayed if _decays(path) else self.undecayed

    def init_leaf(self, path, param, is_stacked=False):
        """The optax state of one parameter (vmapped over layers if `is_stacked`)."""
        init = self._tx(path).init
        return jax.vmap(init)(param) if is_stacked else init(param)

    def init(self, params, stacked):
        """`stacked`: a tree like the params of bools, true for weights stacked over layers."""
        params, stacked = self.trained(params), self.trained(stacked)
        return jax.tree_util.tree_map_with_path(self.init_leaf, params, stacked)

    def clip_scale(self, norm):
        """What grads with global norm `norm` are multiplied by to clip them, as optax does."""
        if self.grad_clip <= 0:
            return jnp.ones((), jnp.float32)
        return self.grad_clip / jnp.maximum(norm, self.grad_clip)

    def clip(self, grads):
        """(grads scaled to the global norm limit, the global norm before clipping)."""
        norm = optax.tree.norm(grads)
        scale = self.clip_scale(norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm

    def update_leaf(self, path, grad, state, param, is_stacked=False):
        """(new param, new state) of one parameter (all layers of it if `is_stacked`)."""

        def one(grad, state, param):
            updates, state = self._tx(path).update(grad, state, param)
            return optax.apply_updates(param, updates), state

        return jax.vmap(one)(grad, state, param) if is_stacked else one(grad, state, param)

    def update(self, grads, state, params, stacked):
        """(new params, new state, global grad norm) for params and state on the device;
        `grads` and `state` of the trained part only (`trained`)."""
        every = params
        params, stacked = self.trained(params), self.trained(stacked)
        grads, norm = self.clip(grads)
        # `grads` has the params' structure, a prefix of the state's: each leaf call gets one
        # parameter's whole optax state.
        out = jax.tree_util.tree_map_with_path(self.update_leaf, grads, state, params, stacked)
        new_params = jax.tree.map(lambda _, o: o[0], grads, out)
        new_state = jax.tree.map(lambda _, o: o[1], grads, out)
        if self.adapters_only:
            new_params = lora.with_adapters(every, new_params)
        return new_params, new_state, norm


def make_optimizer(train: ml_collections.ConfigDict, adapters_only: bool = False) -> Optimizer:
    schedule = learning_rate_schedule(train)
    if train.optimizer == "adafactor":
        # Factored second moments, no first moment: about 4 bytes per parameter row + column
        # instead of AdamW's 8 per parameter. Updates are not scaled by the parameter's RMS, so
        # config.train.lr and weight_decay mean what they mean for AdamW.
        def tx(weight_decay):
            # optax.adafactor's parts, with decay before the learning rate as in AdamW (optax's
            # own adds it after, at a fixed rate). Attention kernels (d, heads, head_dim)
            # factor over d and head_dim (>= 32).
            return optax.chain(
                optax.scale_by_factored_rms(min_dim_size_to_factor=32),
                optax.clip_by_block_rms(1.0),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(schedule),
            )

    else:

        def tx(weight_decay):
            return optax.adamw(
                schedule,
                train.b1,
                train.b2,
                train.eps,
                # None: the params' float32, as before the setting.
                mu_dtype=None if train.mu_dtype == "float32" else jnp.dtype(train.mu_dtype),
                weight_decay=weight_decay,
            )

    return Optimizer(tx(train.weight_decay), tx(0.0), train.grad_clip, adapters_only)
