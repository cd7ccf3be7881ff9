"""GPT-2 style decoder: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings.

Params: embed/embedding (V, D), pos_embed (P, D), layers/{attn_norm, attn, mlp_norm, mlp}
(stacked over layers), final_norm. Letters: B batch, T length, D model dim, V vocabulary.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.layers import Attention, Embed
from angel_jax.layers.mlp import DenseMLP
from angel_jax.layers.norm import LayerNorm
from angel_jax.layers.position import segment_mask, segment_positions
from angel_jax.models.classic import RESIDUAL, ClassicConfig, as_dtype, run_layers
from angel_jax.sharding import constrain


class GPT2Block(nn.Module):
    cfg: ClassicConfig

    @nn.compact
    def __call__(self, h_BTD: jax.Array, mask_BTT: jax.Array | None):
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        x = LayerNorm(cfg.norm_eps, dtype, name="attn_norm")(h_BTD)
        x = constrain(x, ("batch", "length", "embed"))
        attn = Attention(
            cfg.num_heads,
            cfg.num_heads,
            cfg.head_dim,
            implementation=cfg.attention,
            dtype=dtype,
            rope=False,
            use_bias=True,
            name="attn",
        )
        h_BTD = constrain(h_BTD + attn(x, mask_BTS=mask_BTT), RESIDUAL)
        x = LayerNorm(cfg.norm_eps, dtype, name="mlp_norm")(h_BTD)
        x = constrain(x, ("batch", "length", "embed"))
        mlp = DenseMLP(cfg.ffn_dim, "gelu_tanh", use_bias=True, dtype=dtype, name="mlp")
        return constrain(h_BTD + mlp(x), RESIDUAL), None


class GPT2(nn.Module):
    """tokens (B, T) -> next-token logits (B, T, V) float32. With `segment_ids` (B, T) (packed
    documents, 0: padding) a token sees only its own document, positions counted from its
    start."""

    cfg: ClassicConfig

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
        positions = self.param(
            "pos_embed",
            nn.with_logical_partitioning(nn.initializers.normal(0.01), (None, "embed")),
            (cfg.max_positions, cfg.d_model),
            jnp.float32,
        )
        mask = None
        index = jnp.arange(tokens_BT.shape[1])
        if segment_ids is not None:
            mask, index = segment_mask(segment_ids, segment_ids), segment_positions(segment_ids)
        h_BTD = embed(tokens_BT) + jnp.take(positions.astype(dtype), index, axis=0)
        h_BTD = constrain(h_BTD, RESIDUAL)
        h_BTD = run_layers(GPT2Block, cfg, cfg.num_layers, "layers", h_BTD, mask)
        h_BTD = LayerNorm(cfg.norm_eps, dtype, name="final_norm")(h_BTD)
        h_BTD = constrain(h_BTD, ("batch", "length", "embed"))
        return constrain(embed.attend(h_BTD).astype(jnp.float32), ("batch", "length", "vocab"))
