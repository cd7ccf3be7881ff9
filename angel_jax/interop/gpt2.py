"""GPT-2 checkpoints in Hugging Face's layout <-> our `models/gpt2.py` params.

Hugging Face's GPT-2 stores its projections as Conv1D weights, (in, out), with queries, keys
and values fused in one `c_attn` tensor; we keep one kernel each with heads as their own axis,
and stack the layers on a leading axis. The model passes through host memory once on import
(interop/classic.py), then each device receives only its block of every param.

    params = load_params(path, abstract_params, shardings)   # fp32 masters, sharded
    save_params(path, params, config.model)                   # from_pretrained can read it
"""

import pathlib

import jax
import ml_collections
import numpy as np

from angel_jax.interop.classic import layer_slices, place, save, stack_layers
from angel_jax.interop.hf import DEFAULT_SHARD_BYTES, Checkpoint


def model_settings(hf: dict, setting: str = "checkpoint") -> dict:
    """config.model settings of a Hugging Face GPT-2 config.json."""
    d = hf["n_embd"]
    return dict(
        family="gpt2",
        num_layers=hf["n_layer"],
        d_model=d,
        num_heads=hf["n_head"],
        num_kv_heads=hf["n_head"],
        head_dim=0,
        ffn_dim=hf.get("n_inner") or 4 * d,
        vocab_size=hf["vocab_size"],
        max_positions=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=True,
    )


def hf_config(model: ml_collections.ConfigDict) -> dict:
    """A Hugging Face GPT-2 config.json for config.model."""
    return dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_layer=model.num_layers,
        n_embd=model.d_model,
        n_head=model.num_heads,
        n_inner=model.ffn_dim,
        vocab_size=model.vocab_size,
        n_positions=model.max_positions,
        layer_norm_epsilon=model.norm_eps,
        activation_function="gelu_new",
        tie_word_embeddings=True,
    )


def _norm(prefix: str) -> dict:
    return {"scale": f"{prefix}.weight", "bias": f"{prefix}.bias"}


def params_from_hf(read, layers: int, heads: int) -> dict:
    """Our params (numpy, float32) from `read(name)` of Hugging Face tensors."""

    def attn(i):
        w, b = read(f"h.{i}.attn.c_attn.weight"), read(f"h.{i}.attn.c_attn.bias")
        d = w.shape[0]
        per_head = lambda x: x.reshape(*x.shape[:-1], heads, d // heads)
        q, k, v = (per_head(x) for x in np.split(w, 3, axis=1))
        qb, kb, vb = (per_head(x) for x in np.split(b, 3))
        out = read(f"h.{i}.attn.c_proj.weight").reshape(heads, d // heads, d)
        return {
            "query": {"kernel": q, "bias": qb},
            "key": {"kernel": k, "bias": kb},
            "value": {"kernel": v, "bias": vb},
            "out": {"kernel": out, "bias": read(f"h.{i}.attn.c_proj.bias")},
        }

    def layer(i):
        linear = lambda name: {"kernel": read(f"{name}.weight"), "bias": read(f"{name}.bias")}
        norm = lambda name: {k: read(v) for k, v in _norm(name).items()}
        return {
            "attn_norm": norm(f"h.{i}.ln_1"),
            "attn": attn(i),
            "mlp_norm": norm(f"h.{i}.ln_2"),
            "mlp": {"wi": linear(f"h.{i}.mlp.c_fc"), "wo": linear(f"h.{i}.mlp.c_proj")},
        }

    return {
        "embed": {"embedding": read("wte.weight")},
        "pos_embed": read("wpe.weight"),
        "layers": stack_layers([layer(i) for i in range(layers)]),
        "final_norm": {k: read(v) for k, v in _norm("ln_f").items()},
    }


def params_to_hf(params) -> dict[str, np.ndarray]:
    """Hugging Face tensors (GPT2LMHeadModel names) of our params (numpy)."""
    p = jax.tree.map(np.asarray, params)
    out = {
        "transformer.wte.weight": p["embed"]["embedding"],
        "transformer.wpe.weight": p["pos_embed"],
        "transformer.ln_f.weight": p["final_norm"]["scale"],
        "transformer.ln_f.bias": p["final_norm"]["bias"],
    }
    for i, at in enumerate(layer_slices(p["layers"])):
        a = at["attn"]
        d = a["query"]["kernel"].shape[0]
        flat = lambda x, d=d: x.reshape(d, -1)
        h = f"transformer.h.{i}"
        out.update(
            {
                f"{h}.ln_1.weight": at["attn_norm"]["scale"],
                f"{h}.ln_1.bias": at["attn_norm"]["bias"],
                f"{h}.attn.c_attn.weight": np.concatenate(
                    [flat(a[n]["kernel"]) for n in ("query", "key", "value")], axis=1
                ),
                f"{h}.attn.c_attn.bias": np.concatenate(
                    [a[n]["bias"].reshape(-1) for n in ("query", "key", "value")]
                ),
                f"{h}.attn.c_proj.weight": a["out"]["kernel"].reshape(-1, d),
                f"{h}.attn.c_proj.bias": a["out"]["bias"],
                f"{h}.ln_2.weight": at["mlp_norm"]["scale"],
                f"{h}.ln_2.bias": at["mlp_norm"]["bias"],
                f"{h}.mlp.c_fc.weight": at["mlp"]["wi"]["kernel"],
                f"{h}.mlp.c_fc.bias": at["mlp"]["wi"]["bias"],
                f"{h}.mlp.c_proj.weight": at["mlp"]["wo"]["kernel"],
                f"{h}.mlp.c_proj.bias": at["mlp"]["wo"]["bias"],
            }
        )
    return out


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a GPT-2 checkpoint, each placed with its sharding (a
    tree like `abstract_params`; needs config.model.scan_layers, the stacked layout)."""
    checkpoint = Checkpoint(path, setting)
    # GPT2LMHeadModel saves under "transformer.", GPT2Model without a prefix.
    prefix = "transformer." if "transformer.wte.weight" in checkpoint else ""
    read = lambda name: checkpoint.read(prefix + name).astype(np.float32)
    hf = checkpoint.config
    params = params_from_hf(read, hf["n_layer"], hf["n_head"])
    return place(params, abstract_params, shardings, setting, path)


def save_params(
    path: str | pathlib.Path,
    params,
    model: ml_collections.ConfigDict,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes our params as a Hugging Face GPT-2 checkpoint (GPT2LMHeadModel): `dtype` tensors, in
    shards of at most `max_shard_bytes`."""
    save(path, hf_config(model), params, params_to_hf, dtype, max_shard_bytes)
