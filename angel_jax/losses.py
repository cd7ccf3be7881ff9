"""Training losses: next-token cross entropy over plain token windows (whole, or over
sequence slices so the float32 logits never exist at once), and the objectives' losses over
rows laid out by data/objectives.py:

causal  next-token loss; with segment ids, no loss from a document's last token onto the next
        document's first, nor on padding; with a loss mask (chat data), only on the tokens it
        marks (the assistant's).
masked  loss on the masked-LM positions only (labels >= 0).
span    the T5 decoder's loss on the targets (teacher-forced: decoder inputs are the targets
        shifted right behind id 0, T5's start token), padding excluded.
Each is a mean over the predicted tokens of the batch (of the microbatch, when accumulating).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from angel_jax import sharding
from angel_jax.config import objective
from angel_jax.data.objectives import row_fields, split_fields

DECODER_START_ID = 0


def target_logits(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """logits[..., target], by comparing each vocabulary index with the target and summing,
    not by a gather: with the vocabulary split over `tensor` each rank sums its own slice and
    the ranks add one number a token. XLA partitions a gather there by moving the logits
    between the ranks (all-to-alls of the whole logits, forward and backward), and inside a
    pipeline stage its partitioner fails on one."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
    return jnp.sum(jnp.where(vocab == targets_BT[..., None], logits_BTV, 0), axis=-1)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, z_loss: float):
    """Mean next-token loss (+ z_loss * mean(logsumexp^2)), and its parts as metrics."""
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit = target_logits(logits_BTV, targets_BT)
    loss = jnp.mean(logz_BT - target_logit)
    z = jnp.mean(jnp.square(logz_BT))
    return loss + z_loss * z, dict(loss=loss, z_loss=z)


def chunked_cross_entropy(
    h_BTD: jax.Array, lm_head: Callable, targets_BT: jax.Array, z_loss: float, chunks: int
):
    """`cross_entropy` of the logits lm_head(h) ((..., D) -> (..., V)), a slice of the
    sequence at a time under remat, so only one slice's float32 logits exist at once (forward
    and backward). Each slice takes
    the same share of every device's positions when the sequence is split over devices."""
    b, t, d = h_BTD.shape
    ways = 1  # Devices the sequence is split over: each slice keeps that split.
    for axis in jax.tree.leaves(sharding.rule("length")):
        ways *= sharding.active_mesh().shape[axis]
    per = t // (ways * chunks)
    # (B, ways, chunks, per, ...) with the chunk axis first, for the scan.
    h_NBWPD = h_BTD.reshape(b, ways, chunks, per, d).transpose(2, 0, 1, 3, 4)
    t_NBWP = targets_BT.reshape(b, ways, chunks, per).transpose(2, 0, 1, 3)

    @jax.checkpoint
    def step(sums, xs):
        h_BWPD, t_BWP = xs
        logits = lm_head(h_BWPD).astype(jnp.float32)
        logits = sharding.constrain(logits, ("batch", "length", None, "vocab"))
        logz = jax.nn.logsumexp(logits, axis=-1)
        target = target_logits(logits, t_BWP)
        return (sums[0] + jnp.sum(logz - target), sums[1] + jnp.sum(jnp.square(logz))), None

    zero = jnp.zeros((), jnp.float32)
    (nll, z), _ = jax.lax.scan(step, (zero, zero), (h_NBWPD, t_NBWP))
    loss, z = nll / (b * t), z / (b * t)
    return loss + z_loss * z, dict(loss=loss, z_loss=z)


def weighted_cross_entropy(logits_BTV, targets_BT, weights_BT, z_loss: float):
    """Mean loss over tokens with weight 1 (+ z_loss * mean(logsumexp^2)) and its parts."""
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    safe = jnp.maximum(targets_BT, 0)  # Unweighted targets may be -1.
    target_logit = target_logits(logits_BTV, safe)
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
        tokens, segments = f["tokens"], f.get("segment_ids")
        if segments is None:  # A loss mask alone: the row is one sequence.
            logits, extra = apply(tokens[:, :-1])
            weights = jnp.ones(tokens[:, 1:].shape, bool)
        else:
            logits, extra = apply(tokens[:, :-1], segment_ids=segments[:, :-1])
            weights = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0)
        if "loss_mask" in f:  # Each target counts only if marked (the assistant's tokens).
            weights = weights & (f["loss_mask"][:, 1:] > 0)
        return (*weighted_cross_entropy(logits, tokens[:, 1:], weights, z_loss), extra)
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


@dataclasses.dataclass(frozen=True, eq=False)
class TrainingLoss:
    """The loss the gradient code differentiates, `(params, rows) -> (loss, metrics)`: the
    objective's (data/objectives.py rows), or next-token loss over token windows (whole, or
    over `logits_chunks` sequence slices through `lm_head`), plus a mixture of experts' router
    losses. Made once by `train.build` and given to `grads.Gradients`."""

    model: object  # The Flax module.
    config: ml_collections.ConfigDict
    logits_chunks: int
    lm_head: Callable  # params -> (hidden (B, T, D) -> logits (B, T, V)), for the slices.
    # Ring attention's zigzag order of a length's positions (a mean is blind to the order of
    # its terms), or None.
    order: Callable[[int], np.ndarray] | None
    has_experts: bool

    def inputs_and_targets(self, tokens_BT1: jax.Array):
        inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        if self.order is not None:
            order = self.order(inputs_BT.shape[1])
            inputs_BT, targets_BT = inputs_BT[:, order], targets_BT[:, order]
        return inputs_BT, targets_BT

    def __call__(self, params, tokens_BT1: jax.Array):
        d = self.config.data
        if objective(self.config) != "causal" or d.packing or d.loss_mask:
            loss, metrics, variables = objective_loss(self.model, self.config, params, tokens_BT1)
            return self._with_router_losses(loss, metrics, variables)
        inputs_BT, targets_BT = self.inputs_and_targets(tokens_BT1)
        z_loss = self.config.train.z_loss
        if self.logits_chunks > 1:
            h_BTD, moe = self.model.apply(
                {"params": params}, inputs_BT, hidden=True, mutable="intermediates"
            )
            head = self.lm_head(params)
            loss, metrics = chunked_cross_entropy(
                h_BTD, head, targets_BT, z_loss, self.logits_chunks
            )
            return self._with_router_losses(loss, metrics, moe)
        logits, moe = self.model.apply({"params": params}, inputs_BT, mutable="intermediates")
        loss, metrics = cross_entropy(logits, targets_BT, z_loss)
        return self._with_router_losses(loss, metrics, moe)

    def _with_router_losses(self, loss, metrics, variables):
        """Adds a mixture of experts' router losses (weighted) to the loss, and to the metrics
        their values and the share of dropped assignments, averaged over the layers, and the
        per-layer telemetry (`moe_*`, arrays with a leading layer axis; metrics.host_metrics
        turns them into the step's figures)."""
        if not self.has_experts:
            return loss, metrics
        (stats,) = variables["intermediates"]["moe"]
        m = self.config.model
        z, balance = jnp.mean(stats["router_z_loss"]), jnp.mean(stats["load_balance_loss"])
        assignments = jnp.sum(stats["expert_load"])
        metrics.update(
            router_z_loss=z,
            load_balance_loss=balance,
            dropped_fraction=jnp.sum(stats["dropped"]) / jnp.maximum(assignments, 1.0),
            moe_tokens_per_expert=stats["expert_load"],
            moe_dropped_tokens=stats["dropped"],
            moe_router_entropy=stats["router_entropy"],
            moe_router_z_loss=stats["router_z_loss"],
        )
        return loss + m.router_z_loss * z + m.load_balance_loss * balance, metrics
