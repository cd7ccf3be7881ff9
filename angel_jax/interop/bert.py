"""BERT (masked LM) checkpoints in Hugging Face's layout <-> our `models/bert.py` params.

Hugging Face's Linear weights are (out, in); our kernels are (in..., out...) with heads as their
own axis, the layers stacked on a leading axis. The MLM decoder is tied to the word
embeddings, so only its bias is stored.

    params = load_params(path, abstract_params, shardings)   # fp32 masters, sharded
    save_params(path, params, config.model)                   # from_pretrained can read it
"""

import pathlib

import jax
import ml_collections
import numpy as np

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
    """config.model settings of a Hugging Face BERT config.json."""
    return dict(
        family="bert",
        num_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_attention_heads"],
        head_dim=0,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_positions=hf["max_position_embeddings"],
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        tie_embeddings=True,
    )


def hf_config(model: ml_collections.ConfigDict) -> dict:
    """A Hugging Face BERT config.json for config.model."""
    return dict(
        architectures=["BertForMaskedLM"],
        model_type="bert",
        num_hidden_layers=model.num_layers,
        hidden_size=model.d_model,
        num_attention_heads=model.num_heads,
        intermediate_size=model.ffn_dim,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_positions,
        layer_norm_eps=model.norm_eps,
        hidden_act="gelu",
        type_vocab_size=2,
        tie_word_embeddings=True,
    )


# Our per-layer param -> the Hugging Face module under bert.encoder.layer.{i}.
LAYER = {
    "attn/query": "attention.self.query",
    "attn/key": "attention.self.key",
    "attn/value": "attention.self.value",
    "attn/out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "mlp/wi": "intermediate.dense",
    "mlp/wo": "output.dense",
    "mlp_norm": "output.LayerNorm",
}


def _norm(read, name):
    return {"scale": read(f"{name}.weight"), "bias": read(f"{name}.bias")}


def params_from_hf(read, layers: int, heads: int) -> dict:
    """Our params (numpy, float32) from `read(name)` of Hugging Face tensors."""

    def layer(i):
        at = lambda name: f"bert.encoder.layer.{i}.{LAYER[name]}"
        d = read(f"{at('attn/query')}.weight").shape[1]
        qkv = lambda name: {
            "kernel": from_out_in(read(f"{at(name)}.weight"), (heads, d // heads)),
            "bias": read(f"{at(name)}.bias").reshape(heads, d // heads),
        }
        dense = lambda name, in_shape=(): {
            "kernel": from_out_in(read(f"{at(name)}.weight"), in_shape=in_shape),
            "bias": read(f"{at(name)}.bias"),
        }
        return {
            "attn": {
                "query": qkv("attn/query"),
                "key": qkv("attn/key"),
                "value": qkv("attn/value"),
                "out": dense("attn/out", (heads, d // heads)),
            },
            "attn_norm": _norm(read, at("attn_norm")),
            "mlp": {"wi": dense("mlp/wi"), "wo": dense("mlp/wo")},
            "mlp_norm": _norm(read, at("mlp_norm")),
        }

    emb = "bert.embeddings"
    return {
        "embed": {"embedding": read(f"{emb}.word_embeddings.weight")},
        "pos_embed": read(f"{emb}.position_embeddings.weight"),
        "type_embed": read(f"{emb}.token_type_embeddings.weight"),
        "embed_norm": _norm(read, f"{emb}.LayerNorm"),
        "layers": stack_layers([layer(i) for i in range(layers)]),
        "mlm_transform": {
            "kernel": from_out_in(read("cls.predictions.transform.dense.weight")),
            "bias": read("cls.predictions.transform.dense.bias"),
        },
        "mlm_norm": _norm(read, "cls.predictions.transform.LayerNorm"),
        "mlm_bias": read("cls.predictions.bias"),
    }


def params_to_hf(params) -> dict[str, np.ndarray]:
    """Hugging Face tensors (BertForMaskedLM names) of our params (numpy)."""
    p = jax.tree.map(np.asarray, params)
    emb = "bert.embeddings"
    out = {
        f"{emb}.word_embeddings.weight": p["embed"]["embedding"],
        f"{emb}.position_embeddings.weight": p["pos_embed"],
        f"{emb}.token_type_embeddings.weight": p["type_embed"],
        f"{emb}.LayerNorm.weight": p["embed_norm"]["scale"],
        f"{emb}.LayerNorm.bias": p["embed_norm"]["bias"],
        "cls.predictions.transform.dense.weight": to_out_in(p["mlm_transform"]["kernel"]),
        "cls.predictions.transform.dense.bias": p["mlm_transform"]["bias"],
        "cls.predictions.transform.LayerNorm.weight": p["mlm_norm"]["scale"],
        "cls.predictions.transform.LayerNorm.bias": p["mlm_norm"]["bias"],
        "cls.predictions.bias": p["mlm_bias"],
    }
    for i, layer in enumerate(layer_slices(p["layers"])):
        for ours, theirs in LAYER.items():
            group, _, name = ours.partition("/")
            leaf = layer[group][name] if name else layer[group]
            hf = f"bert.encoder.layer.{i}.{theirs}"
            if "kernel" in leaf:
                out[f"{hf}.weight"] = to_out_in(leaf["kernel"], 2 if ours == "attn/out" else 1)
                out[f"{hf}.bias"] = leaf["bias"].reshape(-1)
            else:
                out[f"{hf}.weight"], out[f"{hf}.bias"] = leaf["scale"], leaf["bias"]
    return out


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a BERT checkpoint (BertForMaskedLM), each placed with
    its sharding (a tree like `abstract_params`)."""
    checkpoint = Checkpoint(path, setting)
    read = lambda name: checkpoint.read(name).astype(np.float32)
    hf = checkpoint.config
    params = params_from_hf(read, hf["num_hidden_layers"], hf["num_attention_heads"])
    return place(params, abstract_params, shardings, setting, path)


def save_params(
    path: str | pathlib.Path,
    params,
    model: ml_collections.ConfigDict,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes our params as a Hugging Face BERT checkpoint (BertForMaskedLM): `dtype` tensors, in
    shards of at most `max_shard_bytes`."""
    save(path, hf_config(model), params, params_to_hf, dtype, max_shard_bytes)
