"""The model families, chosen in one place by config.model.family (angel_jax/family.py: what
each gives the rest of the house): the full validation of a config, which adds the family's
features to `config.validate`, and the Hugging Face converters found by the families."""

import importlib
import pathlib
from types import ModuleType

import ml_collections

from angel_jax import config as settings
from angel_jax.config import ConfigError
from angel_jax.family import FEATURES, Family
from angel_jax.models import bert, gpt2, llama, t5

FAMILIES: dict[str, Family] = {
    f.name: f for f in (llama.FAMILY, gpt2.FAMILY, bert.FAMILY, t5.FAMILY)
}


def family_of(model: ml_collections.ConfigDict) -> Family:
    """config.model's family (validated: a known one)."""
    return FAMILIES[model.family]


def make_model(model: ml_collections.ConfigDict, backend: str):
    """(model config, Flax module) for config.model."""
    family = family_of(model)
    cfg = family.make_config(model, backend)
    return cfg, family.module(cfg)


def validate(config: ml_collections.ConfigDict) -> None:
    """The features config.model.family does not support, then `config.validate`: what
    builds or runs a config calls this."""
    settings.choose("model.family", config.model.family, FAMILIES)
    family = family_of(config.model)
    used = family.unsupported(config)
    if not used:
        settings.validate(config)
        return
    needed = {name for name, (setting, _) in FEATURES.items() if setting in used}
    others = sorted(f.name for f in FAMILIES.values() if needed <= f.features)
    raise ConfigError(
        f"config.model.family={family.name} does not support {'; nor '.join(used)}: leave "
        "those settings at their defaults (mesh sizes 1)"
        + (f", or use config.model.family={' or '.join(others)}" if others else "")
    )


def converter(checkpoint) -> ModuleType:
    """The Hugging Face converter (angel_jax/interop/) of this checkpoint's architecture
    (an `interop.hf.Checkpoint`)."""
    kind = checkpoint.config.get("model_type")
    for family in FAMILIES.values():
        if kind in family.hf_model_types:
            return importlib.import_module(family.converter)
    architectures = ", ".join(checkpoint.config.get("architectures") or [])
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(
        f"{checkpoint.setting}: model_type {kind!r} ({architectures}) is not supported; "
        f"these import: {', '.join(known)}"
    )


def apply_checkpoint_architecture(config: ml_collections.ConfigDict) -> None:
    """Sets `config.model`'s architecture from the checkpoint at `config.init_from_hf`."""
    from angel_jax.interop.hf import Checkpoint  # safetensors: only for Hugging Face files.

    checkpoint = Checkpoint(config.init_from_hf, "config.init_from_hf")
    config.model.update(
        converter(checkpoint).model_settings(checkpoint.config, "config.init_from_hf")
    )


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a Hugging Face checkpoint directory, each placed with its
    sharding (a tree like `abstract_params`) as it loads."""
    from angel_jax.interop.hf import Checkpoint

    module = converter(Checkpoint(path, setting))
    return module.load_params(path, abstract_params, shardings, setting)
