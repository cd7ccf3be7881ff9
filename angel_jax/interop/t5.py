"""T5 v1.0 checkpoints (ReLU MLP; tied, scaled output) in Hugging Face's layout <-> our
`models/t5.py` params.

Hugging Face's Linear weights are (out, in); our kernels are (in..., out...) with heads as their
own axis, each stack's layers on a leading axis. The relative position bias lives in Hugging
Face's first block of each stack and is shared by the others; ours sits beside the stack.

    params = load_params(path, abstract_params, shardings)   # fp32 masters, sharded
    save_params(path, params, config.model)                   # from_pretrained can read it
"""

import pathlib

import jax
import ml_collections
import numpy as np

from angel_jax.config import ConfigError
from angel_jax.interop.classic import (
    from_out_in,
    layer_slices,
    place,
    save,
    stack_layers,
    to_out_in,
)
from angel_jax.interop.hf import DEFAULT_SHARD_BYTES, Checkpoint


def model_settings(hf: dict, setting: str = "checkpoint") -> dict:
    """config.model settings of a Hugging Face T5 config.json."""
    if hf.get("feed_forward_proj", "relu") != "relu":
        raise ConfigError(
            f"{setting}: T5 feed_forward_proj={hf['feed_forward_proj']!r}: only T5 v1.0's relu "
            "MLP is supported (not the gated v1.1 variants)"
        )
    # transformers 5 always ties the head and says whether outputs are scaled in
    # scale_decoder_outputs; older configs said both with tie_word_embeddings.
    if not hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)):
        raise ConfigError(
            f"{setting}: T5 checkpoints without the tied, 1/sqrt(d_model)-scaled output (v1.1 "
            "style) are "
            "not supported; import a T5 v1.0 checkpoint"
        )
    return dict(
        family="t5",
        num_layers=hf["num_layers"],
        decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        d_model=hf["d_model"],
        num_heads=hf["num_heads"],
        num_kv_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        ffn_dim=hf["d_ff"],
        vocab_size=hf["vocab_size"],
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        tie_embeddings=True,
    )


def hf_config(model: ml_collections.ConfigDict) -> dict:
    """A Hugging Face T5 config.json for config.model."""
    return dict(
        architectures=["T5ForConditionalGeneration"],
        model_type="t5",
        num_layers=model.num_layers,
        num_decoder_layers=model.decoder_layers or model.num_layers,
        d_model=model.d_model,
        num_heads=model.num_heads,
        d_kv=model.head_dim or model.d_model // model.num_heads,
        d_ff=model.ffn_dim,
        vocab_size=model.vocab_size,
        relative_attention_num_buckets=model.relative_buckets,
        relative_attention_max_distance=model.relative_max_distance,
        layer_norm_epsilon=model.norm_eps,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        decoder_start_token_id=0,
    )


# Per stack: our layer's sublayer -> (its Hugging Face layer index, the module there).
ENCODER = {"attn": (0, "SelfAttention"), "mlp": (1, "DenseReluDense")}
DECODER = {
    "self_attn": (0, "SelfAttention"),
    "cross_attn": (1, "EncDecAttention"),
    "mlp": (2, "DenseReluDense"),
}
PROJECTIONS = {"query": "q", "key": "k", "value": "v", "out": "o"}


def params_from_hf(read, hf: dict) -> dict:
    """Our params (numpy, float32) from `read(name)` of Hugging Face tensors."""
    heads, head_dim = hf["num_heads"], hf["d_kv"]

    def layer(stack, i, parts):
        out = {}
        for ours, (index, module) in parts.items():
            at = f"{stack}.block.{i}.layer.{index}"
            out[f"{ours}_norm"] = {"scale": read(f"{at}.layer_norm.weight")}
            if module == "DenseReluDense":
                wi, wo = (read(f"{at}.{module}.{n}.weight") for n in ("wi", "wo"))
                out[ours] = {"wi": {"kernel": from_out_in(wi)}, "wo": {"kernel": from_out_in(wo)}}
                continue
            w = lambda n, at=at, module=module: read(f"{at}.{module}.{n}.weight")
            qkv = {
                ours_: {"kernel": from_out_in(w(theirs), (heads, head_dim))}
                for ours_, theirs in PROJECTIONS.items()
                if ours_ != "out"
            }
            qkv["out"] = {"kernel": from_out_in(w("o"), in_shape=(heads, head_dim))}
            out[ours] = qkv
        return out

    bias = lambda stack: {
        "embedding": read(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    }
    params = {
        "embed": {"embedding": read("shared.weight")},
        "encoder_bias": bias("encoder"),
        "encoder": stack_layers([layer("encoder", i, ENCODER) for i in range(hf["num_layers"])]),
        "encoder_norm": {"scale": read("encoder.final_layer_norm.weight")},
        "decoder_bias": bias("decoder"),
        "decoder": stack_layers(
            [
                layer("decoder", i, DECODER)
                for i in range(hf.get("num_decoder_layers") or hf["num_layers"])
            ]
        ),
        "decoder_norm": {"scale": read("decoder.final_layer_norm.weight")},
    }
    return params


def params_to_hf(params) -> dict[str, np.ndarray]:
    """Hugging Face tensors (T5ForConditionalGeneration names) of our params (numpy)."""
    p = jax.tree.map(np.asarray, params)
    out = {
        "shared.weight": p["embed"]["embedding"],
        "encoder.final_layer_norm.weight": p["encoder_norm"]["scale"],
        "decoder.final_layer_norm.weight": p["decoder_norm"]["scale"],
    }
    if "lm_head" in p:
        raise ConfigError(
            "exporting T5 needs config.model.tie_embeddings=True (T5 v1.0, what transformers "
            "loads as T5ForConditionalGeneration with scaled outputs)"
        )
    for stack, parts in (("encoder", ENCODER), ("decoder", DECODER)):
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        out[bias] = p[f"{stack}_bias"]["embedding"]
        for i, layer in enumerate(layer_slices(p[stack])):
            for ours, (index, module) in parts.items():
                at = f"{stack}.block.{i}.layer.{index}"
                out[f"{at}.layer_norm.weight"] = layer[f"{ours}_norm"]["scale"]
                if module == "DenseReluDense":
                    for n in ("wi", "wo"):
                        out[f"{at}.{module}.{n}.weight"] = to_out_in(layer[ours][n]["kernel"])
                    continue
                for ours_, theirs in PROJECTIONS.items():
                    kernel = layer[ours][ours_]["kernel"]
                    inputs = 2 if ours_ == "out" else 1
                    out[f"{at}.{module}.{theirs}.weight"] = to_out_in(kernel, inputs)
    return out


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a T5 checkpoint (T5ForConditionalGeneration), each
    placed with its sharding (a tree like `abstract_params`)."""
    checkpoint = Checkpoint(path, setting)
    model_settings(checkpoint.config)  # Refuses the gated variants.
    read = lambda name: checkpoint.read(name).astype(np.float32)
    params = params_from_hf(read, checkpoint.config)
    return place(params, abstract_params, shardings, setting, path)


def save_params(
    path: str | pathlib.Path,
    params,
    model: ml_collections.ConfigDict,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes our params as a Hugging Face T5 checkpoint: `dtype` tensors, in shards of at
    most `max_shard_bytes`."""
    save(path, hf_config(model), params, params_to_hf, dtype, max_shard_bytes)
