"""Optimizer: AdamW with warmup + cosine decay and global-norm clipping (optax)."""

import jax
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


def _decay_mask(params):
    """Weight decay on matrices only: not on norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "scale" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(train),
        b1=train.b1,
        b2=train.b2,
        eps=train.eps,
        weight_decay=train.weight_decay,
        mask=_decay_mask,
    )
    if train.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)
    return adamw
