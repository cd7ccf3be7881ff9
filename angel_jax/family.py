"""What the rest of the house needs of a model family, so that the trainer, the planners and
the generator import this interface and never a family.

A family gives its config from the settings, its Flax module (the whole model: `init` and the
plain train step), where it has them its `Pieces` (the model cut into the parts that the
pipeline, the chunked LM head and KV-cache generation apply one at a time), the `FEATURES` it
supports (`angel_jax.models.validate` refuses the others in one line) and its Hugging Face
converter (a module of angel_jax/interop/, named with the checkpoints' `model_type`s it reads).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections
from flax import linen as nn


class DecoderShape(Protocol):
    """What the pipeline's stage planner costs and checks a decoder by (the model config of a
    family with training `Pieces` has these fields, and its layers' matmul parameters)."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    dtype: str
    tie_embeddings: bool
    attention: str | None
    num_experts: int
    scan_layers: bool
    logits_chunks: int

    def layer_matmul_params(self) -> int:
        """One layer's parameters that take part in a token's matmuls: its FLOPs are twice
        these per token, besides attention's."""
        ...

    def layer_attention_flops(self, seq_len: int) -> float:
        """One layer's attention's forward FLOPs per token (causal or not)."""
        ...


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A decoder's parts, each (cfg, params or a layer's params, ...) -> array.

    embed(cfg, params, tokens_BT, start): the tokens' states entering layer 0 (`start`: the
        first token's position, for learned position tables).
    layer(cfg, layer_params, h_BTD): one training layer under the config's remat, or None.
    final_norm(cfg, params, h_BTD): the states the LM head reads.
    lm_head(cfg, params): h (..., D) -> logits (..., V) in the compute dtype.
    decode_layer(cfg, layer_params, h_BTD, k_BSKH, v_BSKH, start): one layer over new tokens
        with its KV cache -> (h, (k, v)), or None (no generation): the training layer's module
        in its decoding mode (one model, two modes), not a second copy of the layer.
    kv_heads(cfg): the cache's heads.
    unrolled_name: the format of a layer's params name when layers are not scanned.
    """

    embed: Callable
    final_norm: Callable
    lm_head: Callable
    kv_heads: Callable
    unrolled_name: str
    layer: Callable | None = None
    decode_layer: Callable | None = None


# What a family may support beyond plain data- and tensor-parallel training: each feature with
# the settings that turn it on and a test of the config for them.
FEATURES: dict[str, tuple[str, Callable[[ml_collections.ConfigDict], bool]]] = {
    # A mesh size of -1 takes the devices the other axes leave: split too, unless just one.
    "pipeline": ("config.mesh.pipeline != 1", lambda c: c.mesh.pipeline != 1),
    "sequence split": (
        "config.mesh.context != 1 or config.mesh.sequence != 1 (the family needs the whole "
        "sequence per device: masks, learned positions, bidirectional or cross attention)",
        lambda c: c.mesh.context != 1 or c.mesh.sequence != 1,
    ),
    "experts": ("config.model.num_experts > 0", lambda c: c.model.num_experts > 0),
    "chunked logits": ("config.model.logits_chunks > 1", lambda c: c.model.logits_chunks > 1),
    "chunked MLP": ("config.model.mlp_chunks > 1", lambda c: c.model.mlp_chunks > 1),
    "fp8": (
        "config.fp8.matmul, lm_head or collectives",
        lambda c: c.fp8.matmul or c.fp8.lm_head or c.fp8.collectives,
    ),
    "offload": (
        "config.offload.policy other than none or config.offload.activations=host",
        lambda c: c.offload.policy != "none" or c.offload.activations == "host",
    ),
    "powersgd": ("config.train.powersgd_rank > 0", lambda c: c.train.powersgd_rank > 0),
    "lora": ("config.model.lora.rank > 0", lambda c: c.model.lora.rank > 0),
}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[ml_collections.ConfigDict, str], Any]  # (config.model, backend).
    module: Callable[[Any], nn.Module]
    pieces: Pieces | None = None
    decoder_inputs: bool = False  # `init` takes decoder inputs too (encoder-decoders).
    # Its layers name their input remat.LAYER_INPUT and take `layer_input_on_host` in their
    # config: the ZeRO-Cache planner may then keep the layer inputs in host memory.
    offloads_layer_inputs: bool = False
    features: frozenset[str] = frozenset()  # Keys of FEATURES.
    # Its Hugging Face converter, a module of angel_jax/interop/ (see its __init__), and the
    # checkpoints' `model_type`s it reads.
    converter: str | None = None
    hf_model_types: tuple[str, ...] = ()

    def unsupported(self, config: ml_collections.ConfigDict) -> list[str]:
        """The settings of `config` that turn on a feature this family lacks."""
        return [
            setting
            for name, (setting, used) in FEATURES.items()
            if name not in self.features and used(config)
        ]

    def example_inputs(self, tokens_BT: jax.Array) -> tuple:
        """The positional inputs `init` needs (param shapes do not depend on their lengths)."""
        return (tokens_BT, tokens_BT) if self.decoder_inputs else (tokens_BT,)
