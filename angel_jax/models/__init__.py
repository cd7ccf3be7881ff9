"""The model families, chosen in one place by config.model.family."""

import ml_collections

from angel_jax.models.bert import Bert
from angel_jax.models.classic import ClassicConfig
from angel_jax.models.gpt2 import GPT2
from angel_jax.models.llama import Llama, LlamaConfig
from angel_jax.models.t5 import T5

CLASSIC = {"gpt2": GPT2, "bert": Bert, "t5": T5}


def make_model(model: ml_collections.ConfigDict, backend: str):
    """(model config, Flax module) for config.model (validated: a known family)."""
    if model.family == "llama":
        cfg = LlamaConfig.from_config(model, backend)
        return cfg, Llama(cfg)
    cfg = ClassicConfig.from_config(model, backend)
    return cfg, CLASSIC[model.family](cfg)


def example_inputs(family: str, tokens_BT):
    """The positional inputs `init` needs: the tokens, and for T5 decoder inputs too (param
    shapes do not depend on their lengths)."""
    return (tokens_BT, tokens_BT) if family == "t5" else (tokens_BT,)
