"""AdamW with warmup + cosine decay and global-norm clipping, applied parameter by parameter.

The optimizer state is a tree shaped like the params whose leaves are each parameter's own optax
state. That lets each state be placed, sharded and streamed (ZeRO-Cache) with its parameter, and
a stacked layer weight be updated one layer slice at a time.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.lr,
        warmup_steps=min(train.warmup_steps, train.steps),
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=train.lr * train.min_lr_ratio,
    )


def _decays(path) -> bool:
    """Weight decay on matrices only: not on norm scales."""
    return "scale" not in jax.tree_util.keystr(path)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    decayed: optax.GradientTransformation
    undecayed: optax.GradientTransformation
    grad_clip: float  # Global-norm clipping; 0 disables.

    def _tx(self, path) -> optax.GradientTransformation:
        return self.decayed if _decays(path) else self.undecayed

    def init(self, params):
        return jax.tree_util.tree_map_with_path(lambda path, p: self._tx(path).init(p), params)

    def clip(self, grads):
        """(grads scaled to the global norm limit, the global norm before clipping)."""
        norm = optax.tree.norm(grads)
        if self.grad_clip <= 0:
            return grads, norm
        scale = self.grad_clip / jnp.maximum(norm, self.grad_clip)  # As optax clips.
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm

    def update_leaf(self, path, grad, state, param):
        """(new param, new state) of one parameter, or of any slice of one."""
        updates, state = self._tx(path).update(grad, state, param)
        return optax.apply_updates(param, updates), state

    def update(self, grads, state, params):
        """(new params, new state, global grad norm) for params and state on the device."""
        grads, norm = self.clip(grads)
        # `grads` has the params' structure, a prefix of the state's: each leaf call gets one
        # parameter's whole optax state.
        out = jax.tree_util.tree_map_with_path(self.update_leaf, grads, state, params)
        new_params = jax.tree.map(lambda _, o: o[0], grads, out)
        new_state = jax.tree.map(lambda _, o: o[1], grads, out)
        return new_params, new_state, norm


def make_optimizer(train: ml_collections.ConfigDict) -> Optimizer:
    def adamw(weight_decay):
        return optax.adamw(
            learning_rate_schedule(train),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=weight_decay,
        )

    return Optimizer(adamw(train.weight_decay), adamw(0.0), train.grad_clip)
