"""Losses of the objectives over a batch of rows laid out by data/objectives.py.

causal  next-token loss; with segment ids, no loss from a document's last token onto the next
        document's first, nor on padding.
masked  loss on the masked-LM positions only (labels >= 0).
span    the T5 decoder's loss on the targets (teacher-forced: decoder inputs are the targets
        shifted right behind id 0, T5's start token), padding excluded.
Each is a mean over the predicted tokens of the batch (of the microbatch, when accumulating).
"""

import jax
import jax.numpy as jnp
import ml_collections

from angel_jax.config import objective
from angel_jax.data.objectives import row_fields, split_fields

DECODER_START_ID = 0


def weighted_cross_entropy(logits_BTV, targets_BT, weights_BT, z_loss: float):
    """Mean loss over tokens with weight 1 (+ z_loss * mean(logsumexp^2)) and its parts."""
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    safe = jnp.maximum(targets_BT, 0)  # Unweighted targets may be -1.
    target_logit = jnp.take_along_axis(logits_BTV, safe[..., None], axis=-1)[..., 0]
    weights_BT = weights_BT.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weights_BT), 1.0)
    loss = jnp.sum(weights_BT * (logz_BT - target_logit)) / count
    z = jnp.sum(weights_BT * jnp.square(logz_BT)) / count
    return loss + z_loss * z, dict(loss=loss, z_loss=z, predicted_tokens=count)


def objective_loss(model, config: ml_collections.ConfigDict, params, rows_BW):
    """(loss, metrics, the model's mutable intermediates (MoE router stats)) of a batch."""
    f = split_fields(rows_BW, row_fields(config))
    goal, z_loss = objective(config), config.train.z_loss
    apply = lambda *args, **kw: model.apply(
        {"params": params}, *args, mutable="intermediates", **kw
    )
    if goal == "causal":
        tokens, segments = f["tokens"], f["segment_ids"]
        logits, extra = apply(tokens[:, :-1], segment_ids=segments[:, :-1])
        same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0)
        return (*weighted_cross_entropy(logits, tokens[:, 1:], same, z_loss), extra)
    if goal == "masked":
        logits, extra = apply(f["inputs"], segment_ids=f["segment_ids"])
        labels = f["labels"]
        return (*weighted_cross_entropy(logits, labels, labels >= 0, z_loss), extra)
    targets, target_segments = f["targets"], f["target_segment_ids"]
    start = jnp.full_like(targets[:, :1], DECODER_START_ID)
    decoder_inputs = jnp.concatenate([start, targets[:, :-1]], axis=1)
    logits, extra = apply(
        f["inputs"],
        decoder_inputs,
        segment_ids=f["segment_ids"],
        decoder_segment_ids=target_segments,
    )
    return (*weighted_cross_entropy(logits, targets, target_segments > 0, z_loss), extra)
