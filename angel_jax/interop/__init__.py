"""Hugging Face interop: import local safetensors checkpoints into our parameter trees, sharded
as they load, and export them back.

hf.py reads and writes the checkpoint directory format; one module per architecture maps its
tensors to our params. Each such module has:
  model_settings(hf_config: dict, setting: str) -> dict   our config.model settings
  load_params(path, abstract_params, shardings, setting)   our params, sharded as they load
  save_params(path, params, model_config)  (Llama's also takes dtype and max_shard_bytes)
and is listed in CONVERTERS under each Hugging Face `model_type` it reads.
"""

import importlib
import pathlib
from types import ModuleType

import ml_collections

from angel_jax.config import ConfigError
from angel_jax.interop.hf import Checkpoint

# Hugging Face model_type -> the module that converts it.
CONVERTERS = {
    "llama": "angel_jax.interop.llama",
    "mixtral": "angel_jax.interop.llama",
    "gpt2": "angel_jax.interop.gpt2",
    "bert": "angel_jax.interop.bert",
    "t5": "angel_jax.interop.t5",
}


def converter(checkpoint: Checkpoint) -> ModuleType:
    """The module that converts this checkpoint's architecture."""
    kind = checkpoint.config.get("model_type")
    if kind not in CONVERTERS:
        architectures = ", ".join(checkpoint.config.get("architectures") or [])
        raise ConfigError(
            f"{checkpoint.setting}: model_type {kind!r} ({architectures}) is not supported; "
            f"these import: {', '.join(sorted(CONVERTERS))}"
        )
    return importlib.import_module(CONVERTERS[kind])


def apply_checkpoint_architecture(config: ml_collections.ConfigDict) -> None:
    """Sets `config.model`'s architecture from the checkpoint at `config.init_from_hf`."""
    checkpoint = Checkpoint(config.init_from_hf, "config.init_from_hf")
    settings = converter(checkpoint).model_settings(checkpoint.config, "config.init_from_hf")
    config.model.update(settings)


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a Hugging Face checkpoint directory, each placed with its
    sharding (a tree like `abstract_params`) as it loads."""
    module = converter(Checkpoint(path, setting))
    return module.load_params(path, abstract_params, shardings, setting)
