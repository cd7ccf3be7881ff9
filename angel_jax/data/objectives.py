"""Batch builders for the objectives: causal LM, masked LM (BERT) and span corruption (T5).

Every objective reads the same token windows (`seq_len + 1` tokens of the document stream) and
turns each into one int32 row of fixed-width fields laid side by side, so the trainer's batch
stays one (batch, width) array, sharded, split into microbatches and prefetched as before:

  causal   tokens (T + 1) [+ segment_ids (T + 1) with config.data.packing]
           [+ loss_mask (T + 1) with config.data.loss_mask: 1 on the tokens to learn]
  masked   inputs (T), labels (T; -1: not predicted), segment_ids (T)
  span     inputs (T), segment_ids (T), targets (S), target_segment_ids (S)

Segment ids number the documents of a row from 1 (a new one after each end-of-document token
when packing, or after each END of a loss mask; 1 everywhere otherwise); 0 marks padding.
Randomness (which tokens are masked or corrupted) comes from (seed, batch index, row of the
global batch), so a row is the same whichever process builds it and whenever the run resumes.
"""

import ml_collections
import numpy as np

from angel_jax.config import ConfigError, objective
from angel_jax.data.tokens import END, LOSS


def span_shape(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(corrupted tokens, spans) of a `length`-token window; fixed for a config, so rows
    have fixed widths (T5's rounding: at least one span, at least one token kept)."""
    noise = min(max(round(length * noise_density), 1), length - 1)
    return noise, max(round(noise / mean_span), 1)


def row_fields(config: ml_collections.ConfigDict) -> tuple[tuple[str, int], ...]:
    """The (name, width) of each field of a batch row, in order."""
    t = config.train.seq_len
    goal = objective(config)
    if goal == "causal":
        packed = (("segment_ids", t + 1),) if config.data.packing else ()
        masked = (("loss_mask", t + 1),) if config.data.loss_mask else ()
        return (("tokens", t + 1),) + packed + masked
    if goal == "masked":
        return (("inputs", t), ("labels", t), ("segment_ids", t))
    noise, spans = span_shape(t, config.data.noise_density, config.data.mean_span_length)
    s = noise + spans  # Each span: its sentinel, then its tokens.
    return (("inputs", t), ("segment_ids", t), ("targets", s), ("target_segment_ids", s))


def split_fields(rows_BW, fields) -> dict:
    """A batch (B, width) as a dict of its fields (numpy or jax arrays alike)."""
    out, start = {}, 0
    for name, width in fields:
        out[name] = rows_BW[:, start : start + width]
        start += width
    return out


def document_segments(tokens_BT: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Segment ids 1, 2, ...: a token's document is 1 + the end-of-document tokens before it
    (the end token belongs to the document it ends)."""
    if eos_id is None:
        return np.ones_like(tokens_BT, np.int32)
    return segments_ending_at(tokens_BT == eos_id)


def segments_ending_at(ends_BT: np.ndarray) -> np.ndarray:
    """Segment ids 1, 2, ...: a new one after each True of `ends_BT`."""
    ends = ends_BT.astype(np.int32)
    return (1 + np.cumsum(ends, axis=1) - ends).astype(np.int32)


def causal_rows(windows: np.ndarray, eos_id: int | None, packing: bool, loss_mask: bool):
    """Causal rows: tokens [+ segment ids] [+ loss mask]. With a loss mask the windows are
    tokens and mask side by side (loader.py), and END, not the end-of-document id, ends a
    document."""
    if not loss_mask:
        return np.concatenate([windows, document_segments(windows, eos_id)], axis=1)
    tokens, marks = np.split(windows, 2, axis=1)
    segments = [segments_ending_at(marks == END)] if packing else []
    return np.concatenate([tokens, *segments, (marks == LOSS).astype(np.int32)], axis=1)


def mask_tokens(tokens_T: np.ndarray, rng: np.random.Generator, rate: float, mask_id: int, vocab):
    """BERT's corruption: (inputs, labels). round(rate * T) positions are predicted (labels
    hold their tokens, -1 elsewhere); of those 80% read `mask_id`, 10% a random token below
    `vocab`, 10% stay."""
    n = len(tokens_T)
    chosen = rng.choice(n, size=max(1, round(rate * n)), replace=False)
    labels = np.full(n, -1, np.int32)
    labels[chosen] = tokens_T[chosen]
    inputs = tokens_T.astype(np.int32).copy()
    roll = rng.random(len(chosen))
    inputs[chosen[roll < 0.8]] = mask_id
    swapped = chosen[(roll >= 0.8) & (roll < 0.9)]
    inputs[swapped] = rng.integers(0, vocab, len(swapped))
    return inputs, labels


def _random_split(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`parts` positive lengths summing to `total`, uniformly among such splits."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def span_corrupt(
    tokens_L: np.ndarray, rng: np.random.Generator, density: float, mean_span: float, vocab: int
):
    """T5's span corruption: (inputs, targets). Random spans (together `density` of the
    tokens) are each replaced in the inputs by a sentinel (vocab - 1, vocab - 2, ...); the
    targets list each sentinel followed by the tokens it hid. The window starts with kept
    tokens and alternates kept / corrupted runs."""
    noise, spans = span_shape(len(tokens_L), density, mean_span)
    noise_lengths = _random_split(noise, spans, rng)
    kept_lengths = _random_split(len(tokens_L) - noise, spans, rng)
    inputs, targets, start = [], [], 0
    for i, (kept, hidden) in enumerate(zip(kept_lengths, noise_lengths, strict=True)):
        sentinel = vocab - 1 - i
        inputs.extend(tokens_L[start : start + kept])
        inputs.append(sentinel)
        start += kept
        targets.append(sentinel)
        targets.extend(tokens_L[start : start + hidden])
        start += hidden
    return np.asarray(inputs, np.int32), np.asarray(targets, np.int32)


def _padded(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(x zero-padded to `width`, segment ids: 1 on x, 0 on the padding)."""
    out, segments = np.zeros(width, np.int32), np.zeros(width, np.int32)
    out[: len(x)], segments[: len(x)] = x, 1
    return out, segments


def reserved_ids(config: ml_collections.ConfigDict) -> int:
    """How many of the top ids of the vocabulary the objective uses as special tokens."""
    goal, d = objective(config), config.data
    if goal == "masked":
        return 1 if d.mask_id < 0 else 0  # The mask token, unless the data has its own.
    if goal == "span":  # One sentinel per span.
        return span_shape(config.train.seq_len, d.noise_density, d.mean_span_length)[1]
    return 0


def make_row_builder(config: ml_collections.ConfigDict, data_vocab: int, eos_id: int | None):
    """`build(windows (rows, T + 1), batch index, first global row) -> rows (rows, width)`, or
    None when rows are the windows themselves (causal LM without packing or loss mask). With
    config.data.loss_mask a window is its tokens and their loss mask side by side. Checks that the
    reserved ids (mask, sentinels) lie above the data's."""
    goal, d, m = objective(config), config.data, config.model
    if goal == "causal" and not d.packing and not d.loss_mask:
        return None
    t, reserved = config.train.seq_len, reserved_ids(config)
    mask_id = d.mask_id if d.mask_id >= 0 else m.vocab_size - 1
    if data_vocab + reserved > m.vocab_size:
        raise ConfigError(
            f"the {goal} objective takes the top {reserved} ids of config.model.vocab_size="
            f"{m.vocab_size} for mask/sentinel tokens, but the data uses ids up to "
            f"{data_vocab - 1}; set config.model.vocab_size >= {data_vocab + reserved}"
        )

    def build(windows, index: int, first_row: int) -> np.ndarray:
        if goal == "causal":
            return causal_rows(windows, eos_id, d.packing, d.loss_mask)
        rows = []
        for r, window in enumerate(windows):
            rng = np.random.default_rng((config.seed, index, first_row + r))
            tokens = window[:t]
            if goal == "masked":
                segments = document_segments(tokens[None], eos_id if d.packing else None)[0]
                inputs, labels = mask_tokens(tokens, rng, d.mask_rate, mask_id, data_vocab)
                rows.append(np.concatenate([inputs, labels, segments]))
            else:
                inputs, targets = span_corrupt(
                    tokens, rng, d.noise_density, d.mean_span_length, m.vocab_size
                )
                width = dict(row_fields(config))["targets"]
                rows.append(np.concatenate([*_padded(inputs, t), *_padded(targets, width)]))
        return np.stack(rows).astype(np.int32)

    return build


def row_width(config: ml_collections.ConfigDict) -> int:
    return sum(width for _, width in row_fields(config))
