"""The SSD tier of ZeRO-Cache: optimizer chunks that fit neither device nor host memory.

Each chunk (a pytree of arrays) lives on local disk as one .npy file per leaf; its structure
stays in memory, so a store does not reopen files from an earlier run. Reads and writes run on a
thread pool, so the trainer can read the next chunks and write the previous ones while the device
updates the current one. Operations on one key run in the order they were issued.
"""

import concurrent.futures as futures
import functools
import hashlib
import math
import os
import pathlib
import re
import struct
import tempfile
import threading
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np

from angel_jax.config import ConfigError


class _Entry(NamedTuple):
    treedef: jax.tree_util.PyTreeDef
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int


def compression_error(x: np.ndarray) -> float:
    """Returns max|x - bf16(x)| / max|x|, the relative error of storing `x` as bfloat16."""
    x = np.asarray(x, np.float64)
    scale = np.max(np.abs(x), initial=0.0)
    if scale == 0:
        return 0.0
    rounded = x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return float(np.max(np.abs(x - rounded)) / scale)


class SSDStore:
    """One directory of .npy files; a chunk is a pytree of numpy arrays stored under a string key.

    compress=True stores float32 leaves as bfloat16 (half the bytes, relative error <= 2**-9),
    like AngelPTM's half-precision optimizer states on SSD; reads give float32 back.
    """

    def __init__(self, directory: str | os.PathLike, compress: bool = False, workers: int = 4):
        self.directory = pathlib.Path(directory)
        self.compress = compress
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()  # Writable, not just present.
        except OSError as e:
            raise ConfigError(
                f"config.offload.ssd_dir={str(directory)!r}: cannot write there "
                f"({e.strerror or e}); set it to a writable directory on a local SSD"
            ) from e
        self._queue = _KeyOrderedPool(workers)
        self._lock = threading.Lock()  # Guards the dict and list below.
        self._meta: dict[str, _Entry] = {}  # Committed writes only.
        self.pending_writes: list[futures.Future] = []  # Writes issued since the last wait().

    def write(self, key: str, tree) -> futures.Future:
        """Stores `tree` under `key` in the background; the future's result is None.

        Leaves are converted with np.asarray in the worker, so a jax array's device-to-host copy
        overlaps too. Until the future is done, do not mutate, delete or donate the leaves.
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        future = self._queue.submit(key, self.write_file, key, leaves, treedef)
        with self._lock:
            self.pending_writes.append(future)
        return future

    def read(self, key: str) -> futures.Future:
        """Loads `key` in the background: the written pytree, numpy leaves in their dtypes.

        Sees every write of `key` issued before it; raises KeyError if there is none, or if the
        latest one failed.
        """
        return self._queue.submit(key, self._read, key)

    def wait(self) -> None:
        """Blocks until the writes issued so far are done; raises the first one's exception."""
        with self._lock:
            writes, self.pending_writes = self.pending_writes, []
        futures.wait(writes)
        for future in writes:
            if future.exception() is not None:
                raise future.exception()

    @property
    def nbytes(self) -> int:
        """Bytes on disk now, counting committed writes only."""
        with self._lock:
            return sum(entry.nbytes for entry in self._meta.values())

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._meta)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._queue.shutdown()

    def _stem(self, key: str) -> str:
        # Readable prefix for humans, hash so that distinct keys never share a file name.
        safe = re.sub(r"[^A-Za-z0-9_-]+", "_", key)[:64]
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        return str(self.directory / f"{safe}-{digest}")

    def write_file(self, key: str, leaves: list, treedef) -> None:
        """Writes `key`'s leaves and commits them; runs on a worker."""
        stem = self._stem(key)
        try:
            arrays = [np.asarray(leaf) for leaf in leaves]
            nbytes = _save_leaves(stem, arrays, self.compress)
        except BaseException:
            with self._lock:
                self._meta.pop(key, None)  # Its files may be half old, half new: forget them.
            raise
        entry = _Entry(
            treedef, tuple(x.dtype for x in arrays), tuple(x.shape for x in arrays), nbytes
        )
        with self._lock:
            self._meta[key] = entry
        # Leaves left over from an earlier, larger tree under this key.
        i = len(arrays)
        while os.path.exists(f"{stem}.{i}.npy"):
            os.remove(f"{stem}.{i}.npy")
            i += 1

    def _read(self, key: str):
        with self._lock:
            entry = self._meta.get(key)
        if entry is None:
            raise KeyError(f"SSDStore has no {key!r}: never written, or its last write failed")
        leaves = _load_leaves(self._stem(key), entry.dtypes, entry.shapes, self.compress)
        return jax.tree_util.tree_unflatten(entry.treedef, leaves)


class _KeyOrderedPool:
    """A thread pool that runs each key's operations in the order they were issued, so a read
    sees the writes of its key before it."""

    def __init__(self, workers: int):
        self._pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="ssd")
        self._lock = threading.Lock()  # Guards `_last`.
        self._last: dict[str, futures.Future] = {}  # Latest unfinished operation per key.

    def submit(self, key: str, fn, *args) -> futures.Future:
        with self._lock:
            future = self._pool.submit(_after, self._last.get(key), fn, *args)
            self._last[key] = future
        # Drop the reference once done, else each key would pin its last read's arrays in memory.
        future.add_done_callback(functools.partial(self._forget, key))
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _forget(self, key: str, future: futures.Future) -> None:
        with self._lock:
            if self._last.get(key) is future:
                del self._last[key]


def _after(previous: futures.Future | None, fn, *args):
    """Runs `fn` once `previous` (the key's prior operation) is done, so each key sees its
    operations in order. Cannot deadlock: the pool takes work first in, first out, so
    `previous` was started before this and is already running on another worker."""
    if previous is not None:
        futures.wait([previous])
    return fn(*args)


def _disk_dtype(dtype: np.dtype, compress: bool) -> np.dtype:
    """The dtype a leaf of `dtype` has on disk: bfloat16 for float32 when compressing."""
    if compress and dtype == np.float32:
        return np.dtype(ml_dtypes.bfloat16)
    return dtype


def _save_leaves(stem: str, arrays: list[np.ndarray], compress: bool) -> int:
    """Writes `arrays` as `{stem}.{i}.npy` files, each in its disk dtype; returns their bytes."""
    nbytes = 0
    for i, x in enumerate(arrays):
        x = x.astype(_disk_dtype(x.dtype, compress), copy=False)
        if x.dtype.isbuiltin == 2:
            # np.save writes user-defined dtypes (ml_dtypes) as void bytes: store the bits.
            x = x.view(f"u{x.dtype.itemsize}")
        path = f"{stem}.{i}.npy"
        # Write aside, then rename: a crash never leaves a truncated file under `path`.
        with open(path + ".tmp", "wb") as f:
            np.save(f, x, allow_pickle=False)
            nbytes += f.tell()
        os.replace(path + ".tmp", path)
    return nbytes


def _load_leaves(stem: str, dtypes, shapes, compress: bool) -> list[np.ndarray]:
    """The leaves `_save_leaves` wrote under `stem`, back in their `dtypes` and `shapes`."""
    leaves = []
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        disk = _disk_dtype(dtype, compress)
        stored = np.dtype(f"u{disk.itemsize}") if disk.isbuiltin == 2 else disk
        x = _load_npy(f"{stem}.{i}.npy", stored, shape)
        leaves.append(x.view(disk).astype(dtype, copy=False))
    return leaves


def _load_npy(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An .npy file this store wrote, read as `dtype` and `shape` without `np.load`'s header
    parser: CPython 3.11's AST builder is not thread-safe, and concurrent `np.load` calls on
    the store's threads raised "SystemError: AST constructor recursion depth mismatch"."""
    count = math.prod(shape)
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        size = 2 if major == 1 else 4
        (header,) = struct.unpack("<H" if size == 2 else "<I", f.read(size))
        f.seek(header, os.SEEK_CUR)
        x = np.fromfile(f, dtype=dtype, count=count)
    if x.size != count:
        raise OSError(f"{path}: {x.size} values, wrote {count}; changed on disk?")
    return x.reshape(shape)


class SSDTier:
    """The update chunks (`stream.Chunk`s) the plan put on disk: masters stay exact there
    (float32, or their low halves when split: `masters.py`); `compress` keeps the optimizer
    state in bfloat16. `StreamedUpdate` reads them ahead of
    their update and writes them back behind it."""

    def __init__(self, directory, compress: bool, chunks: list):
        directory = pathlib.Path(directory)
        self.masters = SSDStore(directory / "masters")
        self.states = SSDStore(directory / "optimizer_state", compress)
        self.chunks = chunks
        self.by_key = {(jax.tree_util.keystr(c.path), c.layer): c for c in chunks}

    def put(self, chunk, master, state) -> tuple[futures.Future, futures.Future]:
        return self.masters.write(chunk.key, master), self.states.write(chunk.key, state)

    def read(self, chunk) -> tuple[futures.Future, futures.Future]:
        return self.masters.read(chunk.key), self.states.read(chunk.key)

    def read_all(self) -> list:
        """Every chunk's (master, state) as numpy arrays, in order."""
        reads = [self.read(c) for c in self.chunks]
        return [(m.result(), s.result()) for m, s in reads]

    @property
    def nbytes(self) -> int:
        return self.masters.nbytes + self.states.nbytes

    def wait(self) -> None:
        self.masters.wait()
        self.states.wait()

    def close(self) -> None:
        self.masters.close()
        self.states.close()
