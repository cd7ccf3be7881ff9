"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, layers under lax.scan."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from angel_jax import fp8
from angel_jax.config import head_dim
from angel_jax.family import FEATURES, Family, Pieces
from angel_jax.kernels import choose, resolve_attention, shape_misfits
from angel_jax.layers import Attention, Embed, Linear, RMSNorm, RopeScaling, SwiGLU
from angel_jax.layers.moe import MoE
from angel_jax.layers.position import segment_mask, segment_positions
from angel_jax.lora import LoRA
from angel_jax.remat import LAYER_INPUT, layer_policy
from angel_jax.sharding import constrain, gather_param, regather


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"
    remat: str = "none"
    attention: str | None = None  # Resolved implementation: None (XLA) or "cudnn".
    ring_blocks: str = "xla"  # Ring attention's block kernels: "xla", "cudnn" or "tokamax".
    logits_chunks: int = 1  # LM head + loss over this many sequence slices, one at a time.
    num_experts: int = 0  # Mixture of experts in the MLPs; 0: dense.
    experts_per_token: int = 2
    moe_ffn_dim: int = 0
    router: str = "topk"
    capacity_factor: float = 1.25
    moe_dispatch_chunks: int = 1
    moe_kernel: str = "xla"  # dropless's grouped matmuls: "xla", "jax_pallas" or "tokamax".
    shared_experts: int = 0
    scan_layers: bool = True
    # The MLP (with its norm and residual add) over this many interleaved slices of the
    # sequence, one at a time under remat: its (T, ffn_dim) temporaries shrink by as much.
    mlp_chunks: int = 1
    # ZeRO-Cache activation tier: each layer's input kept in pinned host memory for the
    # backward pass (config.offload.activations, decided by the planner).
    layer_input_on_host: bool = False
    # ZeRO-Cache layer streaming: the layers' weights live in host memory and each scan step
    # copies its layer's to the device (and, in the backward pass, its grads back).
    stream_params: bool = False
    fp8_matmul: bool = False  # Projections through FP8 (config.fp8.matmul).
    fp8_gather: bool = False  # ZeRO-3's all-gathers of projection weights in FP8.
    fp8_lm_head: bool = False  # The LM head through FP8 too (config.fp8.lm_head).
    lora: LoRA | None = None  # Adapters on the projections (config.model.lora).

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict, backend: str) -> "LlamaConfig":
        attention = resolve_attention(model, backend)
        return cls(
            num_layers=model.num_layers,
            d_model=model.d_model,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=head_dim(model),
            ffn_dim=model.ffn_dim,
            vocab_size=model.vocab_size,
            rope_theta=model.rope_theta,
            rope_scaling=RopeScaling(**model.rope_scaling),
            norm_eps=model.norm_eps,
            tie_embeddings=model.tie_embeddings,
            dtype=model.dtype,
            remat=model.remat,
            logits_chunks=model.logits_chunks,
            num_experts=model.num_experts,
            experts_per_token=model.experts_per_token,
            moe_ffn_dim=model.moe_ffn_dim or model.ffn_dim,
            router=model.router,
            capacity_factor=model.capacity_factor,
            moe_dispatch_chunks=model.moe_dispatch_chunks,
            shared_experts=model.shared_experts,
            attention=None if attention == "xla" else attention,
            ring_blocks=choose("ring_blocks", model.ring_blocks, model.dtype)[0],
            moe_kernel=choose(
                "moe_kernel", model.moe_kernel, model.dtype, shape_misfits("moe_kernel", model)
            )[0],
            scan_layers=model.scan_layers,
            mlp_chunks=model.mlp_chunks,
            lora=LoRA.from_config(model),
        )

    def layer_matmul_params(self) -> int:
        """One layer's parameters that take part in a token's matmuls (a mixture of experts':
        the experts it goes through and the router)."""
        attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.d_model * self.ffn_dim
        if self.num_experts:
            experts = self.experts_per_token + self.shared_experts
            mlp = experts * 3 * self.d_model * self.moe_ffn_dim + self.d_model * self.num_experts
        return attn + mlp

    def layer_attention_flops(self, seq_len: int) -> float:
        """One layer's attention's forward FLOPs per token: causal, half of QK^T and AV's."""
        return 2 * seq_len * self.num_heads * self.head_dim

    def matmul_params(self) -> int:
        """Parameters that take part in matmuls: the layers and the LM head, not the lookup."""
        return self.num_layers * self.layer_matmul_params() + self.vocab_size * self.d_model

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + causal attention (6 x L x T x N*H),
        the convention of the peer baselines (`../shared/baselines/common.py`)."""
        return 6 * self.matmul_params() + 3 * self.num_layers * self.layer_attention_flops(seq_len)


def _to_device(variables):
    # Its transpose moves the grads back to where the weights came from: host memory.
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), variables)


class DecoderLayer(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, h_BTD: jax.Array, mask_BTT=None, positions_BT=None, cache=None):
        """(h, MoE stats). `mask_BTT` and `positions_BT` (packed documents, `segment_mask`
        and `segment_positions` of layers/position.py): None for whole rows. Decoding: with
        `cache` = (k, v, start) (Attention's), the new tokens at positions start.. attend over
        the cache; returns (h, (k, v))."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        # Everything below derives from the named input, so a policy that offloads it leaves
        # no device copy behind.
        h_BTD = checkpoint_name(h_BTD, LAYER_INPUT)
        # The residual stream lives in norm regions ("norm_length": split over tensor under
        # sequence parallel); attention and MLP see the full sequence ("length"), gathered
        # by their input projections (quantized first under FP8).
        x = constrain(RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(h_BTD), RESIDUAL)
        attn = Attention(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rope_theta,
            cfg.attention,
            dtype,
            cfg.ring_blocks,
            cfg.fp8_matmul,
            cfg.fp8_gather,
            rope_scaling=cfg.rope_scaling,
            adapters=cfg.lora,
            gather=(RESIDUAL, LENGTH),
            name="attn",
        )(x, mask_BTS=mask_BTT, positions=positions_BT, cache=cache)
        if cache is not None:
            attn, cache = attn
        h_BTD = constrain(h_BTD + attn, RESIDUAL)
        if not cfg.num_experts:
            if cfg.mlp_chunks == 1 or cache is not None:  # Decoding: a few tokens.
                return _mlp_half(self, h_BTD), {} if cache is None else cache
            # Interleaved slices (position t in slice t % chunks): a split length stays split.
            b, t, d = h_BTD.shape
            body = lambda module, carry, h: (carry, _mlp_half(module, h))
            if cfg.remat != "none":  # Each slice's temporaries live only in its own backward.
                body = nn.remat(body, policy=layer_policy(cfg.remat, False))
            chunks = nn.scan(
                body,
                variable_broadcast="params",
                in_axes=2,
                out_axes=2,
                length=cfg.mlp_chunks,
                **_dropout_rngs(cfg, False),
            )
            _, h_BTCD = chunks(self, None, h_BTD.reshape(b, t // cfg.mlp_chunks, cfg.mlp_chunks, d))
            return constrain(h_BTCD.reshape(b, t, d), RESIDUAL), {}
        x = regather(RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(h_BTD), RESIDUAL, LENGTH)
        # Decoding moves a few rows: one dispatch chunk, and XLA's grouped matmul (the
        # library kernels are measured at training's row counts only).
        chunks, kernel = (
            (1, "xla") if cache is not None else (cfg.moe_dispatch_chunks, cfg.moe_kernel)
        )
        y, stats = MoE(
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.moe_ffn_dim,
            cfg.router,
            cfg.capacity_factor,
            dtype,
            chunks,
            kernel,
            name="moe",
        )(x)
        if cfg.shared_experts:
            shared = SwiGLU(
                cfg.shared_experts * cfg.moe_ffn_dim,
                dtype,
                cfg.fp8_matmul,
                cfg.fp8_gather,
                name="shared",
            )
            y = y + shared(x)
        return constrain(h_BTD + y, RESIDUAL), stats if cache is None else cache


RESIDUAL = ("batch", "norm_length", "embed")
LENGTH = ("batch", "length", "embed")  # Attention's and the MLP's input.


def _dropout_rngs(cfg: LlamaConfig, params: bool) -> dict:
    """nn.scan's split_rngs (params split over its steps or not), with LoRA dropout's stream
    split too: each layer and slice draws its own mask."""
    if cfg.lora is None or not cfg.lora.dropout:
        return dict(split_rngs={"params": params})
    return dict(split_rngs={"params": params, "dropout": True})


def _mlp_half(layer: DecoderLayer, h_BTD: jax.Array) -> jax.Array:
    """h + MLP(norm(h)): the dense layer's second half, its modules named in `layer`."""
    cfg, dtype = layer.cfg, jnp.dtype(layer.cfg.dtype)
    x = constrain(RMSNorm(cfg.norm_eps, dtype, name="mlp_norm", parent=layer)(h_BTD), RESIDUAL)
    mlp = SwiGLU(
        cfg.ffn_dim,
        dtype,
        cfg.fp8_matmul,
        cfg.fp8_gather,
        adapters=cfg.lora,
        gather=(RESIDUAL, LENGTH),
        name="mlp",
        parent=layer,
    )
    return constrain(h_BTD + mlp(x), RESIDUAL)


class Llama(nn.Module):
    """tokens (B, T) int -> logits (B, T, V) in float32."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(
        self, tokens_BT: jax.Array, hidden: bool = False, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Logits (B, T, V) float32, or with `hidden` the final normed states (B, T, D) that
        the LM head (`lm_head_kernel`) turns into them. With `segment_ids` (B, T) (packed
        documents, 0: padding) a token attends only within its document, RoPE positions
        counted from the document's start (the mask goes to jax.nn.dot_product_attention; on
        cuDNN that path is not yet measured on a GPU)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        context = (None, None)
        if segment_ids is not None:
            context = (segment_mask(segment_ids, segment_ids), segment_positions(segment_ids))
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
        h_BTD = constrain(embed(tokens_BT), ("batch", "norm_length", "embed"))

        layer = DecoderLayer
        if cfg.stream_params:
            # Inside remat: the device copies are fetched again in the backward pass instead of
            # being saved for it (which would keep every layer's weights on the device).
            layer = nn.map_variables(layer, "params", trans_in_fn=_to_device, init=True)
        if cfg.remat != "none":
            layer = nn.remat(
                layer,
                policy=layer_policy(cfg.remat, cfg.layer_input_on_host),
                prevent_cse=not cfg.scan_layers,
            )
        if cfg.scan_layers:
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                **_dropout_rngs(cfg, True),
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            h_BTD, stats = stack(cfg, name="layers")(h_BTD, *context)
        else:
            per_layer = []
            for i in range(cfg.num_layers):
                h_BTD, layer_stats = layer(cfg, name=f"layer_{i}")(h_BTD, *context)
                per_layer.append(layer_stats)
            stats = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        if cfg.num_experts:  # Router losses and load, per layer, for the loss and metrics.
            self.sow("intermediates", "moe", stats)

        h_BTD = regather(RMSNorm(cfg.norm_eps, dtype, name="final_norm")(h_BTD), RESIDUAL, LENGTH)
        if hidden:
            return h_BTD
        if cfg.tie_embeddings:
            logits = embed.attend(h_BTD, cfg.fp8_lm_head)
        else:
            head = Linear(
                (cfg.vocab_size,), ("embed", "vocab"), dtype, fp8=cfg.fp8_lm_head, name="lm_head"
            )
            logits = head(h_BTD)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


def lm_head_kernel(cfg: LlamaConfig, params) -> jax.Array:
    """The LM head as a (D, V) matrix in the compute dtype: the `lm_head` kernel, or the
    embedding table when tied (what `Llama` applies to the final states)."""
    dtype = jnp.dtype(cfg.dtype)
    if cfg.tie_embeddings:
        return gather_param(params["embed"]["embedding"].astype(dtype), ("vocab", "embed")).T
    return gather_param(params["lm_head"]["kernel"].astype(dtype), ("embed", "vocab"))


def lm_head_logits(cfg: LlamaConfig, h_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
    """h (..., D) @ head (D, V) in the compute dtype, on FP8 GEMMs with `fp8_lm_head`."""
    if cfg.fp8_lm_head:
        return fp8.matmul(h_BTD, head_DV)
    return jnp.einsum("...d,dv->...v", h_BTD, head_DV)


def lm_head(cfg: LlamaConfig, params):
    """h (..., D) -> logits (..., V) in the compute dtype, as `Llama` applies its head."""
    head_DV = lm_head_kernel(cfg, params)
    return lambda h_BTD: lm_head_logits(cfg, h_BTD, head_DV)


# The model cut into pieces (family.py) for the pipeline, the chunked LM head and
# generation: the same modules as `Llama`, applied to its params' subtrees.


def embed_tokens(cfg: LlamaConfig, params, tokens_BT: jax.Array, start=0) -> jax.Array:
    del start  # Positions enter through RoPE, in attention.
    embed = Embed(cfg.vocab_size, cfg.d_model, jnp.dtype(cfg.dtype))
    h_BTD = embed.apply({"params": params["embed"]}, tokens_BT)
    return constrain(h_BTD, ("batch", "norm_length", "embed"))


def decoder_layer(cfg: LlamaConfig, layer_params, h_BTD: jax.Array) -> jax.Array:
    """One layer (params: one slice of the stacked `layers`), under the config's remat."""

    def apply(layer_params, h_BTD):
        return DecoderLayer(cfg).apply({"params": layer_params}, h_BTD)[0]

    if cfg.remat != "none":
        apply = jax.checkpoint(apply, policy=layer_policy(cfg.remat, cfg.layer_input_on_host))
    return apply(layer_params, h_BTD)


def final_norm(cfg: LlamaConfig, params, h_BTD: jax.Array) -> jax.Array:
    """The final RMSNorm: the states the LM head (`lm_head_kernel`) turns into logits."""
    norm = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype))
    return regather(norm.apply({"params": params["final_norm"]}, h_BTD), RESIDUAL, LENGTH)


def decode_layer(cfg: LlamaConfig, p, h_BTD, k_BSKH, v_BSKH, start):
    """`DecoderLayer` in its decoding mode: the new tokens at positions start.., with its KV
    cache -> (h, (k, v))."""
    return DecoderLayer(cfg).apply({"params": p}, h_BTD, cache=(k_BSKH, v_BSKH, start))


FAMILY = Family(
    "llama",
    LlamaConfig.from_config,
    Llama,
    Pieces(
        embed=embed_tokens,
        final_norm=final_norm,
        lm_head=lm_head,
        kv_heads=lambda cfg: cfg.num_kv_heads,
        unrolled_name="layer_{}",
        layer=decoder_layer,
        decode_layer=decode_layer,
    ),
    offloads_layer_inputs=True,
    features=frozenset(FEATURES),
    converter="angel_jax.interop.llama",
    hf_model_types=("llama", "mixtral"),
)
