"""T5 encoder-decoder: RMS-style T5 LayerNorm before each block, relative position bias (one
table per stack, shared by its layers), unscaled attention scores, ReLU MLP without biases;
tied embeddings scale the decoder's output by 1/sqrt(D) before the shared table (T5 v1.0).

Params: embed/embedding (V, D), encoder_bias, encoder/{attn_norm, attn, mlp_norm, mlp}
(stacked), encoder_norm, decoder_bias, decoder/{self_attn_norm, self_attn, cross_attn_norm,
cross_attn, mlp_norm, mlp} (stacked), decoder_norm, lm_head (untied only).
Letters: B batch, T encoder length, S decoder length, D model dim, V vocabulary.
"""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.family import Family
from angel_jax.layers import Attention, Embed, Linear, RMSNorm
from angel_jax.layers.mlp import DenseMLP
from angel_jax.layers.position import RelativePositionBias, segment_mask, segment_positions
from angel_jax.models.classic import LENGTH, RESIDUAL, ClassicConfig, as_dtype, run_layers
from angel_jax.sharding import constrain, regather


def _attention(cfg: ClassicConfig, causal: bool, name: str) -> Attention:
    return Attention(
        cfg.num_heads,
        cfg.num_heads,
        cfg.head_dim,
        implementation=cfg.attention,
        dtype=as_dtype(cfg),
        rope=False,
        causal=causal,
        scale=1.0,  # T5 folds 1/sqrt(head_dim) into the query weights' initialisation.
        name=name,
    )


class T5EncoderLayer(nn.Module):
    cfg: ClassicConfig

    @nn.compact
    def __call__(self, h_BTD, mask_BTT, bias_NTT):
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        norm = functools.partial(RMSNorm, cfg.norm_eps, dtype)
        x = regather(norm(name="attn_norm")(h_BTD), RESIDUAL, LENGTH)
        attn = _attention(cfg, False, "attn")(x, mask_BTS=mask_BTT, bias_NTS=bias_NTT)
        h_BTD = constrain(h_BTD + attn, RESIDUAL)
        x = regather(norm(name="mlp_norm")(h_BTD), RESIDUAL, LENGTH)
        mlp = DenseMLP(cfg.ffn_dim, "relu", use_bias=False, dtype=dtype, name="mlp")
        return constrain(h_BTD + mlp(x), RESIDUAL), None


class T5DecoderLayer(nn.Module):
    cfg: ClassicConfig

    @nn.compact
    def __call__(self, h_BSD, encoded_BTD, self_mask_BSS, self_bias_NSS, cross_mask_BST):
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        norm = functools.partial(RMSNorm, cfg.norm_eps, dtype)
        x = regather(norm(name="self_attn_norm")(h_BSD), RESIDUAL, LENGTH)
        attn = _attention(cfg, True, "self_attn")(x, mask_BTS=self_mask_BSS, bias_NTS=self_bias_NSS)
        h_BSD = constrain(h_BSD + attn, RESIDUAL)
        x = regather(norm(name="cross_attn_norm")(h_BSD), RESIDUAL, LENGTH)
        cross = _attention(cfg, False, "cross_attn")(x, kv_BSD=encoded_BTD, mask_BTS=cross_mask_BST)
        h_BSD = constrain(h_BSD + cross, RESIDUAL)
        x = regather(norm(name="mlp_norm")(h_BSD), RESIDUAL, LENGTH)
        mlp = DenseMLP(cfg.ffn_dim, "relu", use_bias=False, dtype=dtype, name="mlp")
        return constrain(h_BSD + mlp(x), RESIDUAL), None


class T5(nn.Module):
    """(encoder tokens (B, T), decoder inputs (B, S)) -> decoder logits (B, S, V) float32.
    Segment ids ((B, T), (B, S); 0: padding) keep each packed example to itself, in the
    encoder, the decoder and across; None: one example per row, no padding."""

    cfg: ClassicConfig

    @nn.compact
    def __call__(
        self,
        inputs_BT: jax.Array,
        decoder_inputs_BS: jax.Array,
        segment_ids: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg, dtype = self.cfg, as_dtype(self.cfg)
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
        bias = functools.partial(
            RelativePositionBias,
            cfg.num_heads,
            buckets=cfg.relative_buckets,
            max_distance=cfg.relative_max_distance,
        )
        enc_pos, dec_pos = jnp.arange(inputs_BT.shape[1]), jnp.arange(decoder_inputs_BS.shape[1])
        enc_mask = dec_mask = cross_mask = None
        if segment_ids is not None:
            enc_mask = segment_mask(segment_ids, segment_ids)
            enc_pos = segment_positions(segment_ids)
        if decoder_segment_ids is not None:
            dec_mask = segment_mask(decoder_segment_ids, decoder_segment_ids)
            dec_pos = segment_positions(decoder_segment_ids)
            if segment_ids is not None:
                cross_mask = segment_mask(decoder_segment_ids, segment_ids)

        h_BTD = constrain(embed(inputs_BT), RESIDUAL)
        enc_bias = bias(bidirectional=True, name="encoder_bias")(enc_pos, enc_pos)
        h_BTD = run_layers(
            T5EncoderLayer, cfg, cfg.num_layers, "encoder", h_BTD, enc_mask, enc_bias
        )
        encoded_BTD = RMSNorm(cfg.norm_eps, dtype, name="encoder_norm")(h_BTD)
        encoded_BTD = regather(encoded_BTD, RESIDUAL, LENGTH)

        h_BSD = constrain(embed(decoder_inputs_BS), RESIDUAL)
        dec_bias = bias(bidirectional=False, name="decoder_bias")(dec_pos, dec_pos)
        h_BSD = run_layers(
            T5DecoderLayer,
            cfg,
            cfg.decoder_layers,
            "decoder",
            h_BSD,
            encoded_BTD,
            dec_mask,
            dec_bias,
            cross_mask,
        )
        h_BSD = RMSNorm(cfg.norm_eps, dtype, name="decoder_norm")(h_BSD)
        h_BSD = regather(h_BSD, RESIDUAL, LENGTH)
        if cfg.tie_embeddings:
            logits = embed.attend(h_BSD * cfg.d_model**-0.5)
        else:
            logits = Linear((cfg.vocab_size,), ("embed", "vocab"), dtype, name="lm_head")(h_BSD)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


FAMILY = Family(
    "t5",
    ClassicConfig.from_config,
    T5,
    decoder_inputs=True,
    converter="angel_jax.interop.t5",
    hf_model_types=("t5",),
)
