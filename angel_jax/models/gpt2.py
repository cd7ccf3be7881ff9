"""GPT-2 style decoder: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings.

Params: embed/embedding (V, D), pos_embed (P, D), layers/{attn_norm, attn, mlp_norm, mlp}
(stacked over layers), final_norm. Letters: B batch, T length, D model dim, V vocabulary.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.family import Family, Pieces
from angel_jax.layers import Attention, Embed
from angel_jax.layers.mlp import DenseMLP
from angel_jax.layers.norm import LayerNorm
from angel_jax.layers.position import segment_mask, segment_positions
from angel_jax.models.classic import LENGTH, RESIDUAL, ClassicConfig, as_dtype, run_layers
from angel_jax.sharding import constrain, regather


class GPT2Block(nn.Module):
    cfg: ClassicConfig

    @nn.compact
    def __call__(self, h_BTD: jax.Array, mask_BTT: jax.Array | None, cache=None):
        """(h, None); decoding with `cache` = (k, v, start) (Attention's): (h, (k, v))."""
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        x = LayerNorm(cfg.norm_eps, dtype, name="attn_norm")(h_BTD)
        x = regather(x, RESIDUAL, LENGTH)
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
        attended = attn(x, mask_BTS=mask_BTT, cache=cache)
        if cache is not None:
            attended, cache = attended
        h_BTD = constrain(h_BTD + attended, RESIDUAL)
        x = LayerNorm(cfg.norm_eps, dtype, name="mlp_norm")(h_BTD)
        x = regather(x, RESIDUAL, LENGTH)
        mlp = DenseMLP(cfg.ffn_dim, "gelu_tanh", use_bias=True, dtype=dtype, name="mlp")
        return constrain(h_BTD + mlp(x), RESIDUAL), cache


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
        h_BTD = regather(h_BTD, RESIDUAL, LENGTH)
        return constrain(embed.attend(h_BTD).astype(jnp.float32), ("batch", "length", "vocab"))


# Pieces (family.py) for generation: the same modules as `GPT2`, applied to its params.


def embed_tokens(cfg: ClassicConfig, params, tokens_BT, start=0):
    """The tokens' embeddings plus the learned positions start..start+T-1 (generate checks
    they exist: a slice past the table's end would be clamped, not refused)."""
    dtype = as_dtype(cfg)
    h_BTD = Embed(cfg.vocab_size, cfg.d_model, dtype).apply({"params": params["embed"]}, tokens_BT)
    table = params["pos_embed"].astype(h_BTD.dtype)
    h_BTD = h_BTD + jax.lax.dynamic_slice_in_dim(table, start, tokens_BT.shape[1])
    return constrain(h_BTD, RESIDUAL)


def final_norm(cfg: ClassicConfig, params, h_BTD):
    norm = LayerNorm(cfg.norm_eps, as_dtype(cfg))
    return regather(norm.apply({"params": params["final_norm"]}, h_BTD), RESIDUAL, LENGTH)


def lm_head(cfg: ClassicConfig, params):
    """GPT-2's head is its embedding table, whatever config.model.tie_embeddings says."""
    embed = Embed(cfg.vocab_size, cfg.d_model, as_dtype(cfg))
    return lambda h_BTD: embed.apply({"params": params["embed"]}, h_BTD, method="attend")


def decode_layer(cfg: ClassicConfig, p, h_BTD, k_BSKH, v_BSKH, start):
    """`GPT2Block` in its decoding mode: the new tokens at positions start.., with its KV cache
    -> (h, (k, v))."""
    return GPT2Block(cfg).apply({"params": p}, h_BTD, None, cache=(k_BSKH, v_BSKH, start))


FAMILY = Family(
    "gpt2",
    ClassicConfig.from_config,
    GPT2,
    Pieces(
        embed=embed_tokens,
        final_norm=final_norm,
        lm_head=lm_head,
        kv_heads=lambda cfg: cfg.num_heads,  # One per query head.
        unrolled_name="layers_{}",
        decode_layer=decode_layer,
    ),
    converter="angel_jax.interop.gpt2",
    hf_model_types=("gpt2",),
)
