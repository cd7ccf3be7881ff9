"""What the rest of the house needs of a model family, so that the trainer, the planners and
the generator import this interface and never a family.

A family gives its config from the settings, its Flax module (the whole model: `init` and the
plain train step) and, where it has them, its `Pieces`: the model cut into the parts that the
pipeline, the chunked LM head and KV-cache generation apply one at a time. A family without
pieces does not support what needs them (`config.validate` says so in one line).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections
from flax import linen as nn


class DecoderShape(Protocol):
    """What the pipeline's stage planner costs and checks a decoder by (the model config of a
    family with training `Pieces` has these fields)."""

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

    def example_inputs(self, tokens_BT: jax.Array) -> tuple:
        """The positional inputs `init` needs (param shapes do not depend on their lengths)."""
        return (tokens_BT, tokens_BT) if self.decoder_inputs else (tokens_BT,)
