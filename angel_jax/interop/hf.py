"""Hugging Face checkpoint directories: read lazily, assemble sharded, write back.

A checkpoint directory holds `config.json` and its weights in safetensors: one
`model.safetensors`, or shards that `model.safetensors.index.json` maps tensor names to. Tensors
are read a block at a time (safetensors slices a memory-mapped file), so importing a model never
holds more than one tensor, usually one shard's block of it, in host memory, and every device
receives only its own block (`assemble`).

Model-specific name mappings live beside this file (llama.py); they only say which Hugging Face
tensor fills which of our params, and how it is transposed.
"""

import functools
import json
import os
import pathlib
from collections.abc import Callable, Iterable

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from angel_jax.config import ConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' own default shard size.
DEFAULT_SHARD_BYTES = 5 * 2**30
# What a training workdir holds (loop.py, checkpoint.py), to tell one from a Hugging Face
# checkpoint: both have a config.json.
WORKDIR_MARKS = ("checkpoints", "metrics.jsonl")

Index = tuple[slice, ...]


class Checkpoint:
    """A local Hugging Face checkpoint directory, its tensors read lazily by name.

    `setting` names where the path came from (e.g. config.init_from_hf), for error messages.
    """

    def __init__(self, path: str | pathlib.Path, setting: str = "checkpoint"):
        self.path = pathlib.Path(path)
        self.setting = setting
        if not self.path.is_dir():
            raise ConfigError(
                f"{setting}={path}: no such directory; pass a local Hugging Face checkpoint "
                "directory (config.json + *.safetensors), e.g. one written by save_pretrained"
            )
        config_file = self.path / CONFIG_FILE
        self.config: dict = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "model_type" not in self.config and any((self.path / m).exists() for m in WORKDIR_MARKS):
            raise ConfigError(
                f"{setting}={path} is an angel-jax training workdir, not a Hugging Face "
                f"checkpoint: resume it with --workdir, read it with --checkpoint (generate, "
                f"export), or export it first: python -m angel_jax.export --config CONFIG "
                f"--checkpoint {path} --out DIR"
            )
        if not config_file.is_file():
            raise ConfigError(f"{setting}={path}: no {CONFIG_FILE} in it; is it a checkpoint?")
        self._open: dict[str, object] = {}

    @functools.cached_property
    def _file_of(self) -> dict[str, str]:
        """Tensor name -> the safetensors file (in the directory) that holds it."""
        index = self.path / INDEX_FILE
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.path / SINGLE_FILE
        if not single.is_file():
            others = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt"))
            hint = (
                f" (found {', '.join(others)}: re-save it with save_pretrained(..., "
                "safe_serialization=True))"
                if others
                else ""
            )
            raise ConfigError(
                f"{self.setting}={self.path}: no {SINGLE_FILE} or {INDEX_FILE}; only "
                f"safetensors weights are read{hint}"
            )
        with safe_open(single, framework="np") as f:
            return {name: SINGLE_FILE for name in f.keys()}

    def _handle(self, name: str):
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, framework="np")
        return self._open[file]

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        """The tensor `name`, or only its block `index` (one slice per dimension)."""
        if name not in self._file_of:
            raise ConfigError(
                f"{self.setting}={self.path}: tensor {name} is missing; the checkpoint does not "
                "match its config.json's architecture"
            )
        tensor = self._handle(name).get_slice(name)
        return np.asarray(tensor[index] if index is not None else tensor[:])


def numpy_dtype(dtype: str):
    """The numpy dtype of an export's `dtype` setting."""
    found = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}.get(dtype)
    if found is None:
        raise ConfigError(f"export dtype {dtype!r}: use float32 or bfloat16")
    return found


def write_checkpoint(
    path: str | pathlib.Path,
    config: dict,
    tensors: Iterable[tuple[str, Callable[[], np.ndarray]]],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes `config.json` and the tensors ((name, fetch) pairs, fetched one at a time) as
    safetensors, in shards of at most `max_shard_bytes` plus an index when they need several.
    Host memory holds at most one shard's tensors."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, np.ndarray] = {}
    written: list[pathlib.Path] = []  # Shard files, named once their count is known.
    size = 0

    def flush():
        if shard:
            part = path / f".part-{len(written):05d}.safetensors"
            save_file(shard, part, metadata={"format": "pt"})  # transformers wants "pt".
            # safetensors leaves its file private (0600); a checkpoint is for others to load.
            os.chmod(part, 0o644)
            written.append(part)
            shard.clear()

    weight_map: dict[str, int] = {}
    total = 0
    for name, fetch in tensors:
        array = np.ascontiguousarray(fetch())
        total += array.nbytes
        if size and size + array.nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = array
        weight_map[name] = len(written)
        size += array.nbytes
    flush()
    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(written) == 1:
        written[0].rename(path / SINGLE_FILE)
    else:
        n = len(written)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for part, final in zip(written, names, strict=True):
            part.rename(path / final)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: names[i] for name, i in sorted(weight_map.items())},
        }
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def assemble(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    read_block: Callable[[Index], np.ndarray],
    dtype=np.float32,
) -> jax.Array:
    """A global array of `shape` with `sharding`, each device's block read by
    `read_block(index)` (a tuple of one concrete slice per dimension) and cast to `dtype`.
    No device, and no host buffer, ever holds more than its block."""

    def block(index: Index) -> np.ndarray:
        full = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        return np.asarray(read_block(full), dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, block)
