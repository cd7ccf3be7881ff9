"""Deterministic batches: batch `i` depends only on (data, seed, i), never on history.

So resuming at step s reads exactly the batches an uninterrupted run reads from step s on; the
checkpoint stores the index of the next batch. Grain shuffles windows of `seq_len + 1` tokens
(reshuffled every epoch) and prefetches on background threads. Each process loads only its
own rows of the global batch.
"""

import grain
import jax
import ml_collections
import numpy as np

from angel_jax.config import ConfigError
from angel_jax.data.tokens import TokenFile, default_corpus


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


def make_batches(config: ml_collections.ConfigDict) -> Batches:
    """Batches of this process's rows, int32 tokens of shape (rows, seq_len + 1)."""
    t, seed = config.train, config.seed
    rows = t.batch_size // jax.process_count()
    lo = jax.process_index() * rows
    length = t.seq_len + 1

    if config.data.synthetic and config.data.path is None:
        vocab = config.model.vocab_size

        def synthetic(step):
            rng = np.random.default_rng((seed, step))
            return rng.integers(0, vocab, (t.batch_size, length), dtype=np.int32)[lo : lo + rows]

        return Batches(grain.MapDataset.range(2**62).map(synthetic), config.data.prefetch)

    if config.data.path is None:
        tokens, vocab, where = default_corpus(), 257, "the default corpus"
    else:
        data = TokenFile(config.data.path)
        tokens, vocab, where = data.tokens, data.vocab_size, f"config.data.path={config.data.path}"
    if vocab > config.model.vocab_size:
        raise ConfigError(
            f"{where} has token ids up to {vocab - 1}, but config.model.vocab_size="
            f"{config.model.vocab_size}; set config.model.vocab_size >= {vocab}"
        )
    windows = (len(tokens) - 1) // t.seq_len
    if windows < t.batch_size:
        raise ConfigError(
            f"{where} holds {len(tokens)} tokens, fewer than one batch of "
            f"config.train.batch_size={t.batch_size} x config.train.seq_len={t.seq_len}; "
            "use more data or a smaller batch"
        )

    def read(window_ids):
        return np.stack(
            [tokens[i * t.seq_len : i * t.seq_len + length] for i in window_ids[lo : lo + rows]]
        ).astype(np.int32)

    dataset = (
        grain.MapDataset.range(windows).shuffle(seed=seed).repeat().batch(t.batch_size).map(read)
    )
    return Batches(dataset, config.data.prefetch)
