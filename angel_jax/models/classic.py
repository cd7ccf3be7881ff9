"""What the classic families (GPT-2, BERT, T5) share: their config and the layer stack.

They use the same layers, logical axis names and remat policies as Llama (models/llama.py), so
the same sharding rules place them: heads, MLP and vocabulary over `tensor`, ZeRO over `data`.
"""

import dataclasses

import jax
import ml_collections
from flax import linen as nn

from angel_jax.config import head_dim
from angel_jax.kernels import resolve_attention
from angel_jax.remat import REMATS

# The residual stream's layout (as in Llama; "norm_length" splits under sequence parallel).
RESIDUAL = ("batch", "norm_length", "embed")
LENGTH = ("batch", "length", "embed")  # Attention's and the MLP's input.


@dataclasses.dataclass(frozen=True)
class ClassicConfig:
    family: str  # gpt2 | bert | t5.
    num_layers: int  # The encoder's for T5.
    d_model: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int = 1024  # Learned position table (GPT-2, BERT).
    decoder_layers: int = 0  # T5's decoder.
    relative_buckets: int = 32  # T5's relative position bias.
    relative_max_distance: int = 128
    type_vocab_size: int = 2  # BERT's token types (sentence A/B); training uses type 0.
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "bfloat16"
    remat: str = "none"
    attention: str | None = None  # jax.nn.dot_product_attention's implementation.
    scan_layers: bool = True
    logits_chunks: int = 1  # Unused (full logits); here so the trainer reads one interface.
    num_experts: int = 0

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict, backend: str) -> "ClassicConfig":
        attention = resolve_attention(model, backend)
        return cls(
            family=model.family,
            num_layers=model.num_layers,
            d_model=model.d_model,
            num_heads=model.num_heads,
            head_dim=head_dim(model),
            ffn_dim=model.ffn_dim,
            vocab_size=model.vocab_size,
            max_positions=model.max_positions,
            decoder_layers=model.decoder_layers or model.num_layers,
            relative_buckets=model.relative_buckets,
            relative_max_distance=model.relative_max_distance,
            norm_eps=model.norm_eps,
            tie_embeddings=model.tie_embeddings,
            dtype=model.dtype,
            remat=model.remat,
            attention=None if attention == "xla" else attention,
            scan_layers=model.scan_layers,
        )

    def layer_matmul_params(self) -> int:
        """One (encoder or decoder-only) layer's matmul parameters."""
        return 4 * self.d_model * self.num_heads * self.head_dim + 2 * self.d_model * self.ffn_dim

    def layer_attention_flops(self, seq_len: int) -> float:
        """One (encoder or decoder-only) layer's attention's forward FLOPs per token: all of
        QK^T and AV's for BERT's bidirectional attention, half for a causal one."""
        causal = 2 * seq_len * self.num_heads * self.head_dim
        return 2 * causal if self.family == "bert" else causal

    def matmul_params(self) -> int:
        layers = self.num_layers * self.layer_matmul_params()
        if self.family == "t5":  # Decoder layers also have cross-attention.
            attn = 4 * self.d_model * self.num_heads * self.head_dim
            layers += self.decoder_layers * (attn + self.layer_matmul_params())
        return layers + self.vocab_size * self.d_model

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + 3 x attention's forward (as LlamaConfig
        counts; T5's decoder layers counted as its encoder's)."""
        layers = self.num_layers + (self.decoder_layers if self.family == "t5" else 0)
        return 6 * self.matmul_params() + 3 * layers * self.layer_attention_flops(seq_len)


def run_layers(layer: type[nn.Module], cfg, count: int, name: str, h, *context):
    """`count` layers of `layer(cfg)` applied to h, under lax.scan (params stacked on a leading
    "layers" axis, named `name`) or unrolled (`name`_0, ...); `context` (masks, biases, the
    encoder's states) is the same for every layer."""
    if cfg.remat != "none":
        layer = nn.remat(layer, policy=REMATS[cfg.remat].policy, prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        stack = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * len(context),
            length=count,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return stack(cfg, name=name)(h, *context)[0]
    for i in range(count):
        h = layer(cfg, name=f"{name}_{i}")(h, *context)[0]
    return h


def as_dtype(cfg) -> jax.typing.DTypeLike:
    return jax.numpy.dtype(cfg.dtype)
