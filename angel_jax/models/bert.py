"""BERT encoder with its masked-LM head: learned positions and token types, post-LayerNorm
layers, exact GELU, the LM decoder tied to the word embeddings.

Params: embed/embedding (V, D), pos_embed (P, D), type_embed (2, D), embed_norm,
layers/{attn, attn_norm, mlp, mlp_norm} (stacked over layers), mlm_transform, mlm_norm,
mlm_bias (V,). Letters: B batch, T length, D model dim, V vocabulary.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.family import Family
from angel_jax.layers import Attention, Embed, Linear
from angel_jax.layers.mlp import ACTIVATIONS, DenseMLP
from angel_jax.layers.norm import LayerNorm
from angel_jax.layers.position import segment_mask, segment_positions
from angel_jax.models.classic import LENGTH, RESIDUAL, ClassicConfig, as_dtype, run_layers
from angel_jax.sharding import constrain, regather


class BertLayer(nn.Module):
    cfg: ClassicConfig

    @nn.compact
    def __call__(self, h_BTD: jax.Array, mask_BTT: jax.Array | None):
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        x = regather(h_BTD, RESIDUAL, LENGTH)
        attn = Attention(
            cfg.num_heads,
            cfg.num_heads,
            cfg.head_dim,
            implementation=cfg.attention,
            dtype=dtype,
            rope=False,
            causal=False,
            use_bias=True,
            name="attn",
        )
        h_BTD = LayerNorm(cfg.norm_eps, dtype, name="attn_norm")(h_BTD + attn(x, mask_BTS=mask_BTT))
        h_BTD = constrain(h_BTD, RESIDUAL)
        x = regather(h_BTD, RESIDUAL, LENGTH)
        mlp = DenseMLP(cfg.ffn_dim, "gelu", use_bias=True, dtype=dtype, name="mlp")
        h_BTD = LayerNorm(cfg.norm_eps, dtype, name="mlp_norm")(h_BTD + mlp(x))
        return constrain(h_BTD, RESIDUAL), None


class Bert(nn.Module):
    """tokens (B, T) -> masked-LM logits (B, T, V) float32, every token seeing every other of
    its segment (`segment_ids` (B, T): packed documents, 0: padding; None: one per row)."""

    cfg: ClassicConfig

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        table = lambda name, rows: self.param(
            name,
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (rows, cfg.d_model),
            jnp.float32,
        ).astype(dtype)
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
        mask = None
        index = jnp.arange(tokens_BT.shape[1])
        if segment_ids is not None:
            mask, index = segment_mask(segment_ids, segment_ids), segment_positions(segment_ids)
        h_BTD = embed(tokens_BT) + jnp.take(table("pos_embed", cfg.max_positions), index, axis=0)
        h_BTD = h_BTD + table("type_embed", cfg.type_vocab_size)[0]  # Always sentence A.
        h_BTD = LayerNorm(cfg.norm_eps, dtype, name="embed_norm")(h_BTD)
        h_BTD = constrain(h_BTD, RESIDUAL)
        h_BTD = run_layers(BertLayer, cfg, cfg.num_layers, "layers", h_BTD, mask)
        h_BTD = regather(h_BTD, RESIDUAL, LENGTH)
        # The masked-LM head: transform, GELU, LayerNorm, then the tied decoder and its bias.
        x = Linear((cfg.d_model,), ("embed", None), dtype, use_bias=True, name="mlm_transform")
        x = ACTIVATIONS["gelu"](x(h_BTD))
        x = LayerNorm(cfg.norm_eps, dtype, name="mlm_norm")(x)
        bias = self.param(
            "mlm_bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
            (cfg.vocab_size,),
            jnp.float32,
        )
        logits = embed.attend(x) + bias.astype(dtype)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


FAMILY = Family(
    "bert",
    ClassicConfig.from_config,
    Bert,
    converter="angel_jax.interop.bert",
    hf_model_types=("bert",),
)
