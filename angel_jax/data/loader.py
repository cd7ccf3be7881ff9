"""Deterministic batches: batch `i` depends only on (data, seed, i), never on history.

So resuming at step s reads exactly the batches an uninterrupted run reads from step s on; the
checkpoint stores the index of the next batch. Grain shuffles windows of `seq_len + 1` tokens
(reshuffled every epoch; packed chat data: rows of whole conversations, padded) and prefetches
on background threads. Each process loads only its own rows of the global batch.
"""

import grain
import jax
import ml_collections
import numpy as np

from angel_jax.config import ConfigError
from angel_jax.data.objectives import make_row_builder, reserved_ids
from angel_jax.data.tokens import END, NO_LOSS, TokenFile, default_corpus


class Batches:
    """Random access (`batches[i]`) and prefetching iteration from any index."""

    def __init__(self, dataset: grain.MapDataset, prefetch: int):
        self._dataset = dataset
        self._prefetch = prefetch

    def __getitem__(self, index: int) -> np.ndarray:
        return self._dataset[index]

    def iterate(self, start: int):
        read = grain.ReadOptions(
            num_threads=max(1, self._prefetch), prefetch_buffer_size=self._prefetch
        )
        return iter(self._dataset[start:].to_iter_dataset(read))


def process_rows(batch_sharding: jax.sharding.Sharding, batch_size: int) -> tuple[int, int]:
    """The rows [lo, hi) of the global batch that this process's devices hold.

    With `data` across hosts that is this process's share; an axis that replicates the batch
    over processes (e.g. data=1 with tensor across hosts) gives several processes the same rows.
    """
    spans = {
        (index[0].start or 0, batch_size if index[0].stop is None else index[0].stop)
        for index in batch_sharding.addressable_devices_indices_map((batch_size, 1)).values()
    }
    spans = sorted(spans)
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        if start != stop:
            raise ConfigError(
                f"this process's devices hold rows {spans} of the batch, not one contiguous "
                "block; let config.mesh.data span the hosts (the mesh puts it outermost)"
            )
    return spans[0][0], spans[-1][1]


def make_batches(config: ml_collections.ConfigDict, rows: tuple[int, int] | None = None) -> Batches:
    """Batches of this process's rows, int32 tokens of shape (rows, seq_len + 1), or the
    objective's rows built from them (data/objectives.py).

    `rows`: the rows [lo, hi) of the global batch to load (`process_rows`); by default an
    even share by process index.
    """
    t, seed = config.train, config.seed
    if rows is None:
        share = t.batch_size // jax.process_count()
        rows = (jax.process_index() * share, (jax.process_index() + 1) * share)
    lo, hi = rows
    rows = hi - lo  # How many.
    length = t.seq_len + 1

    if config.data.synthetic and config.data.path is None and not config.data.loss_mask:
        vocab = config.model.vocab_size - reserved_ids(config)  # Below mask/sentinel ids.

        def synthetic(step):
            rng = np.random.default_rng((seed, step))
            return rng.integers(0, vocab, (t.batch_size, length), dtype=np.int32)[lo : lo + rows]

        dataset = grain.MapDataset.range(2**62).map(synthetic)
        return _with_objective(dataset, make_row_builder(config, vocab, None), lo, config)

    marks = None  # Chat data's loss mask (tokens.py).
    if config.data.path is None:
        tokens, vocab, where, eos = default_corpus(), 257, "the default corpus", 256
    else:
        data = TokenFile(config.data.path)
        tokens, vocab, where = data.tokens, data.vocab_size, f"config.data.path={config.data.path}"
        eos, marks = data.meta.get("eos_id"), data.loss_mask
    if config.data.loss_mask and marks is None:
        raise ConfigError(
            f"config.data.loss_mask=true, but {where} has no loss mask; make the token file "
            "from chat data with `python -m angel_jax.data.prepare --jsonl`, or set "
            "config.data.loss_mask=false"
        )
    if marks is not None and not config.data.loss_mask:  # Else prompts are learnt, silently.
        raise ConfigError(
            f"{where} is chat data with a loss mask on the assistant's tokens; set "
            "config.data.loss_mask=true to learn those only (tokenize the text without --jsonl "
            "to learn every token)"
        )
    if vocab > config.model.vocab_size:
        raise ConfigError(
            f"{where} has token ids up to {vocab - 1}, but config.model.vocab_size="
            f"{config.model.vocab_size}; set config.model.vocab_size >= {vocab}"
        )
    if marks is not None and config.data.packing:  # Whole conversations a row.
        bounds = conversation_rows(marks, length)
    else:  # Windows every seq_len tokens, each its last target the next one's first input.
        starts = np.arange((len(tokens) - 1) // t.seq_len) * t.seq_len
        bounds = np.stack([starts, starts + length], axis=1)
    windows = len(bounds)
    if windows < t.batch_size:
        raise ConfigError(
            f"{where} holds {len(tokens)} tokens, fewer than one batch of "
            f"config.train.batch_size={t.batch_size} x config.train.seq_len={t.seq_len}; "
            "use more data or a smaller batch"
        )

    pad = eos if eos is not None else 0

    def read(window_ids):
        """The windows' tokens, and with a loss mask its windows beside them; a packed row's
        tail after its last conversation is padding (no loss, a segment of its own)."""
        spans = bounds[np.asarray(window_ids[lo : lo + rows])]

        def cut(a, fill):
            out = np.full((len(spans), length), fill, np.int32)
            for row, (s, e) in zip(out, spans, strict=True):
                row[: e - s] = a[s:e]
            return out

        return (
            cut(tokens, pad)
            if marks is None
            else np.concatenate([cut(tokens, pad), cut(marks, NO_LOSS)], 1)
        )

    dataset = (
        grain.MapDataset.range(windows).shuffle(seed=seed).repeat().batch(t.batch_size).map(read)
    )
    return _with_objective(dataset, make_row_builder(config, vocab, eos), lo, config)


def conversation_rows(marks: np.ndarray, length: int) -> np.ndarray:
    """[start, end) of each packed row of chat data (`marks`: its loss mask, END after each
    conversation): the conversations in order, as many whole ones as fit in `length` tokens,
    so none starts in one row and ends in the next. One longer than a row fills rows of its
    own, cut every `length - 1` tokens (a row's last token is a target only), its rest
    starting the next row."""
    ends = np.flatnonzero(np.asarray(marks) == END) + 1
    if not len(ends) or ends[-1] < len(marks):
        ends = np.append(ends, len(marks))
    rows, start, conversation = [], 0, 0  # The open row's start, the next conversation's.
    for end in ends.tolist():
        if end - start > length and conversation > start:  # It does not fit beside the row's.
            rows.append((start, conversation))
            start = conversation
        while end - start > length:
            rows.append((start, start + length))
            start += length - 1
        conversation = end
    if start < ends[-1]:
        rows.append((start, int(ends[-1])))
    return np.asarray(rows, np.int64).reshape(-1, 2)


def _with_objective(dataset: grain.MapDataset, build, first_row: int, config) -> Batches:
    """Batches of the windows, or of the rows `build` makes of them (masked LM, span
    corruption, packing), from the batch index so resuming rebuilds the same rows."""
    if build is not None:
        dataset = dataset.map_with_index(lambda index, windows: build(windows, index, first_row))
    return Batches(dataset, config.data.prefetch)
