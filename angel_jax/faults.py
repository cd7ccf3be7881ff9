"""Faults injected on purpose, for the tests of fault handling (tests/test_supervise.py,
tests/test_monitor.py, experiments/multiprocess.py): `ANGEL_FAULTS="crash@3,nan@5"` in a
training process's environment. Unset, nothing here runs."""

import os
import pathlib
import signal
import time

import jax
import numpy as np

from angel_jax.config import ConfigError


class Faults:
    """Faults injected on purpose, for tests: `ANGEL_FAULTS="crash@3,nan@5"`.

    Process faults fire once per workdir and process (recorded in WORKDIR/faults_fired.PROCESS),
    so a restarted run does not fire them again: `crash@N` (SIGKILL before step N), `hang@N`
    (the main thread sleeps before step N), `kill_in_save@N` (SIGKILL right after step N's
    checkpoint save starts, while it is being written).

    Data faults belong to a batch, the N-th of the data stream (the one step N reads when
    nothing has been skipped), every time it is read: `nan@N` (an out-of-range token: NaN
    embeddings, a NaN loss), `spike@N` (uniform random tokens).
    """

    KINDS = ("crash", "hang", "nan", "spike", "kill_in_save")
    DATA = ("nan", "spike")

    def __init__(self, spec: str, workdir: str, vocab_size: int):
        self.pending = set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            kind, _, step = item.partition("@")
            if kind not in self.KINDS or not step.isdigit():
                raise ConfigError(
                    f"ANGEL_FAULTS: bad item {item!r}; use KIND@STEP, KIND one of "
                    f"{', '.join(self.KINDS)}"
                )
            self.pending.add((kind, int(step)))
        self.record = pathlib.Path(workdir) / f"faults_fired.{jax.process_index()}"
        if self.record.exists():
            fired = {tuple(line.split("@")) for line in self.record.read_text().split()}
            self.pending -= {(k, int(s)) for k, s in fired}
        self.vocab_size = vocab_size

    def _fire(self, kind: str, step: int) -> bool:
        if (kind, step) not in self.pending:
            return False
        if kind in self.DATA:
            return True
        self.pending.discard((kind, step))
        with open(self.record, "a") as f:  # Recorded first: the fault may end the process.
            f.write(f"{kind}@{step}\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def before_step(self, step: int, batch_index: int, batch: jax.Array) -> jax.Array:
        """`batch`, possibly damaged, for step `step` reading batch `batch_index` (from 0)."""
        if not self.pending:
            return batch
        if self._fire("crash", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fire("hang", step):
            while True:
                time.sleep(3600)
        with jax.transfer_guard("allow"):
            if self._fire("nan", batch_index + 1):
                batch = _damaged(batch, _out_of_range_first_token)
            if self._fire("spike", batch_index + 1):
                rng = np.random.default_rng(batch_index)
                tokens = rng.integers(0, self.vocab_size, batch.shape).astype(batch.dtype)
                batch = _damaged(batch, lambda block, index: tokens[index])
        return batch

    def after_save(self, step: int) -> None:
        if self.pending and self._fire("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)


def _out_of_range_first_token(block, index):
    if (index[1].start or 0) == 0:  # This shard holds the rows' first tokens.
        block = block.copy()
        block[:, 0] = 2**30
    return block


def _damaged(batch: jax.Array, damage) -> jax.Array:
    """`batch` with `damage(host block, its index)` applied to each of this process's shards,
    on the host: no program to compile, which under load could outlast a short hang timeout."""
    shards = [
        jax.device_put(damage(np.asarray(s.data), s.index), s.device)
        for s in batch.addressable_shards
    ]
    return jax.make_array_from_single_device_arrays(batch.shape, batch.sharding, shards)
