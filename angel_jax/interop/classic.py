"""What the GPT-2, BERT and T5 converters share: placing imported params and writing them.

Their checkpoints are small enough to pass through host memory whole on import; each device
then receives only its block of every param (`jax.device_put` with the training shardings).
"""

import pathlib
from collections.abc import Callable

import jax
import numpy as np

from angel_jax.config import ConfigError
from angel_jax.interop.hf import DEFAULT_SHARD_BYTES, numpy_dtype, write_checkpoint


def place(params, abstract_params, shardings, setting: str, path) -> dict:
    """`params` (numpy) checked against the model's shapes and put in their shardings."""
    if "layers" not in abstract_params and "encoder" not in abstract_params:
        raise ConfigError(
            f"{setting}: importing needs the stacked layer layout; set "
            "config.model.scan_layers=True"
        )
    expected = jax.tree.map(lambda a: tuple(a.shape), abstract_params)
    got = jax.tree.map(lambda a: tuple(a.shape), params)
    if got != expected:
        raise ConfigError(
            f"{setting}={path}: the checkpoint's shapes do not match config.model; set "
            "config.model from its config.json (the converter's model_settings)"
        )
    return jax.device_put(params, shardings)


def from_out_in(w_OI: np.ndarray, out_shape: tuple[int, ...] = (), in_shape=()) -> np.ndarray:
    """A torch Linear weight (out, in) as our kernel (in..., out...)."""
    w = w_OI.T
    return w.reshape(*(in_shape or w.shape[:1]), *(out_shape or w.shape[1:]))


def to_out_in(kernel: np.ndarray, inputs: int = 1) -> np.ndarray:
    """Our kernel with `inputs` leading input dims as a torch Linear weight (out, in)."""
    fan_in = int(np.prod(kernel.shape[:inputs]))
    return kernel.reshape(fan_in, -1).T


def stack_layers(per_layer: list) -> dict:
    return jax.tree.map(lambda *xs: np.stack(xs), *per_layer)


def layer_slices(stacked) -> list:
    """The per-layer subtrees of a tree stacked on a leading layer axis."""
    count = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)]


def save(
    path: str | pathlib.Path,
    config: dict,
    params,
    to_hf: Callable[[dict], dict[str, np.ndarray]],
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes `params` as the Hugging Face checkpoint of `config` (its config.json), their
    tensors named and laid out by `to_hf` (numpy params -> tensors) and cast to `dtype`."""
    if "layers" not in params and "encoder" not in params:
        raise ConfigError(
            "exporting needs the stacked layer layout; train with config.model.scan_layers=True"
        )
    np_dtype = numpy_dtype(dtype)
    tensors = to_hf(jax.device_get(params))
    items = ((name, lambda x=x: np.asarray(x, np_dtype)) for name, x in tensors.items())
    write_checkpoint(path, dict(config, dtype=dtype), items, max_shard_bytes)
