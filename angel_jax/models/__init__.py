"""The model families, chosen in one place by config.model.family (angel_jax/family.py: what
each gives the rest of the house)."""

import ml_collections

from angel_jax.family import Family
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
