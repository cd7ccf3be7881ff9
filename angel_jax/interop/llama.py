"""Llama and Mixtral checkpoints in Hugging Face's layout <-> our `models/llama.py` params.

Hugging Face stores each layer's tensors separately, linear weights as (out, in); we stack the
layers (a leading "layers" axis under nn.scan, or `layer_{i}` subtrees without it), keep
kernels as (in..., out...) with heads as their own axis, and stack a mixture of experts'
weights over a leading "expert" axis. Both use the rotate-half RoPE convention, so q and k
need no permutation.

    params = load_params(path, abstract_params, shardings)   # fp32 masters, sharded
    save_params(path, params, config.model)                   # from_pretrained can read it
"""

import dataclasses
import math
import pathlib

import jax
import ml_collections
import numpy as np

from angel_jax.config import ConfigError, head_dim
from angel_jax.interop.hf import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    assemble,
    numpy_dtype,
    write_checkpoint,
)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our params comes from: a Hugging Face tensor name (with `{layer}` and
    `{expert}` fields where it repeats) and how many leading dims of our kernel are its input
    dims (0: the same layout as Hugging Face's; else HF's (out, in) transposed and split)."""

    name: str
    input_dims: int = 0


PER_LAYER = {
    "attn_norm/scale": Source("model.layers.{layer}.input_layernorm.weight"),
    "attn/query/kernel": Source("model.layers.{layer}.self_attn.q_proj.weight", 1),
    "attn/key/kernel": Source("model.layers.{layer}.self_attn.k_proj.weight", 1),
    "attn/value/kernel": Source("model.layers.{layer}.self_attn.v_proj.weight", 1),
    "attn/out/kernel": Source("model.layers.{layer}.self_attn.o_proj.weight", 2),
    "mlp_norm/scale": Source("model.layers.{layer}.post_attention_layernorm.weight"),
    "mlp/gate/kernel": Source("model.layers.{layer}.mlp.gate_proj.weight", 1),
    "mlp/up/kernel": Source("model.layers.{layer}.mlp.up_proj.weight", 1),
    "mlp/down/kernel": Source("model.layers.{layer}.mlp.down_proj.weight", 1),
    "moe/router": Source("model.layers.{layer}.block_sparse_moe.gate.weight", 1),
    # Mixtral's experts: w1 gate, w3 up, w2 down.
    "moe/gate": Source("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", 1),
    "moe/up": Source("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", 1),
    "moe/down": Source("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", 1),
}
TOP_LEVEL = {
    "embed/embedding": Source("model.embed_tokens.weight"),
    "final_norm/scale": Source("model.norm.weight"),
    "lm_head/kernel": Source("lm_head.weight", 1),
}
# Buffers some older checkpoints carry; recomputed here, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# --- Configs ---------------------------------------------------------------------------------


def model_settings(hf: dict, setting: str = "checkpoint") -> dict:
    """Our `config.model` settings for a Hugging Face `config.json` (as a dict)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(
            f"{setting}: model_type {kind!r} ({', '.join(hf.get('architectures') or [])}) is "
            f"not supported; Llama and Mixtral import here: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{setting}: {flag}=true is not supported (our layers have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{setting}: hidden_act={hf['hidden_act']!r}; only silu is supported")
    if hf.get("sliding_window") is not None:
        raise ConfigError(
            f"{setting}: sliding_window={hf['sliding_window']}; only full causal attention is "
            "supported"
        )
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    out = dict(
        family="llama",
        num_layers=hf["num_hidden_layers"],
        d_model=d_model,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or d_model // heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        **_rope(hf, setting),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_experts=0,
        shared_experts=0,
    )
    if kind == "mixtral":
        # Mixtral drops no token: the dropless router computes what it computes.
        out.update(
            num_experts=hf["num_local_experts"],
            experts_per_token=hf["num_experts_per_tok"],
            moe_ffn_dim=hf["intermediate_size"],
            router="dropless",
        )
    return out


def _rope(hf: dict, setting: str) -> dict:
    """rope_theta and rope_scaling settings: transformers 5 writes rope_parameters, older
    files rope_theta and rope_scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if kind == "default":
        return dict(rope_theta=theta)
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            f"{setting}: rope scaling {kind!r} is not supported (linear and llama3 are); use "
            "a checkpoint with one of those or none"
        )
    scaling = dict(kind=kind, factor=float(rope["factor"]))
    if kind == "llama3":
        scaling.update(
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_positions=int(rope["original_max_position_embeddings"]),
        )
    return dict(rope_theta=theta, rope_scaling=scaling)


def _rope_parameters(model: ml_collections.ConfigDict) -> dict:
    """Hugging Face's rope_parameters for our settings (the inverse of `_rope`)."""
    rs, out = model.rope_scaling, dict(rope_type="default", rope_theta=model.rope_theta)
    if rs.kind != "none":
        out.update(rope_type=rs.kind, factor=rs.factor)
    if rs.kind == "llama3":
        out.update(
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_positions,
        )
    return out


def hf_config(model: ml_collections.ConfigDict, dtype: str = "float32") -> dict:
    """A Hugging Face `config.json` (dict) for our `config.model`."""
    if model.shared_experts:
        raise ConfigError(
            f"config.model.shared_experts={model.shared_experts}: Mixtral has no shared "
            "experts, so this model cannot be exported to it"
        )
    kind = "mixtral" if model.num_experts else "llama"
    out = dict(
        architectures=[ARCHITECTURES[kind]],
        model_type=kind,
        hidden_size=model.d_model,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=head_dim(model),
        intermediate_size=model.ffn_dim,
        vocab_size=model.vocab_size,
        rms_norm_eps=model.norm_eps,
        rope_theta=model.rope_theta,
        rope_parameters=_rope_parameters(model),
        tie_word_embeddings=model.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        dtype=dtype,
    )
    if kind == "mixtral":
        out.update(
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
            intermediate_size=model.moe_ffn_dim or model.ffn_dim,
            sliding_window=None,
        )
    return out


# --- Params ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One of our params: its Hugging Face source and which leading dims repeat it
    (`stacked`: a "layers" axis; `experts`: an "expert" axis after it)."""

    source: Source
    layer: int | None  # The layer of an unstacked `layer_{i}` param.
    stacked: bool
    experts: bool

    def names(self, layers: range, experts: range) -> list[list[str]]:
        """Hugging Face names, [layer][expert]: one entry along an axis the param lacks."""
        layers = layers if self.stacked else [self.layer]
        experts = experts if self.experts else [None]
        return [[self.source.name.format(layer=i, expert=e) for e in experts] for i in layers]


def _leaf(path: str) -> Leaf:
    top, _, rest = path.partition("/")
    if path in TOP_LEVEL:
        return Leaf(TOP_LEVEL[path], None, False, False)
    if top == "layers" or top.startswith("layer_"):
        source = PER_LAYER.get(rest)
        if source is not None:
            layer = None if top == "layers" else int(top.removeprefix("layer_"))
            return Leaf(source, layer, top == "layers", "{expert}" in source.name)
    raise ConfigError(
        f"param {path} has no Hugging Face counterpart (Llama/Mixtral); export and import "
        "cover dense and Mixtral-style models without shared experts"
    )


def _paths(tree) -> list[tuple[str, object]]:
    flat = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(p, simple=True, separator="/"), x) for p, x in flat]


def _merged(index: tuple[slice, ...], shape: tuple[int, ...]) -> slice | None:
    """The slice of the flattened dims `shape` that `index` covers, if it is one range (only
    the first dim sliced); None otherwise."""
    if any(s != slice(0, n, 1) for s, n in zip(index[1:], shape[1:], strict=True)):
        return None
    inner = math.prod(shape[1:])
    return slice(index[0].start * inner, index[0].stop * inner)


def _read_block(
    checkpoint: Checkpoint, name: str, source: Source, shape: tuple, index: tuple
) -> np.ndarray:
    """Block `index` of one Hugging Face tensor in our layout `shape` (one layer, one
    expert): transposed and split by `source.input_dims`, read only as far as needed."""
    if not source.input_dims:
        return checkpoint.read(name, index)
    n_in = source.input_dims
    rows = _merged(index[n_in:], shape[n_in:])  # HF's (out, in): rows are our outputs.
    cols = _merged(index[:n_in], shape[:n_in])
    if rows is None or cols is None:  # A split not along whole heads: read it all.
        full = checkpoint.read(name).T.reshape(shape)
        return full[index]
    block = checkpoint.read(name, (rows, cols)).T
    return block.reshape([s.stop - s.start for s in index])


def load_params(path: str | pathlib.Path, abstract_params, shardings, setting: str = "checkpoint"):
    """Our params (fp32 masters) from a Llama/Mixtral checkpoint, each placed with its
    sharding (a tree like `abstract_params`, e.g. an `Experiment`'s `state_sharding.params`)
    and assembled from per-device blocks as it loads."""
    checkpoint = Checkpoint(path, setting)
    used: set[str] = set()
    leaves = {}
    flat_shardings = dict(_paths(shardings))
    for path_, abstract in _paths(abstract_params):
        leaf = _leaf(path_)
        if path_ == "lm_head/kernel" and leaf.source.name not in checkpoint:
            raise ConfigError(
                f"{setting}={checkpoint.path}: no lm_head.weight, so its embeddings are tied; "
                "set config.model.tie_embeddings=True (init_from_hf sets it from config.json)"
            )
        lead = int(leaf.stacked) + int(leaf.experts)
        shape = tuple(abstract.shape)
        names = leaf.names(range(shape[0]), range(shape[lead - 1] if leaf.experts else 0))
        used.update(n for per_layer in names for n in per_layer)
        for name in (names[0][0], names[-1][-1]):  # Missing and misshapen tensors fail early.
            hf_shape = checkpoint.shape(name)
            want = shape[lead:]
            if leaf.source.input_dims:
                n_in = leaf.source.input_dims
                want = (math.prod(want[n_in:]), math.prod(want[:n_in]))
            if tuple(hf_shape) != tuple(want):
                raise ConfigError(
                    f"{setting}={checkpoint.path}: {name} has shape {hf_shape}, our "
                    f"{path_} needs {want}; the checkpoint does not match config.json"
                )

        def read_block(index, leaf=leaf, shape=shape, lead=lead):
            per_tensor = shape[lead:]
            layers = range(index[0].start, index[0].stop) if leaf.stacked else range(1)
            experts = range(index[lead - 1].start, index[lead - 1].stop) if leaf.experts else [0]
            blocks = [
                [
                    _read_block(
                        checkpoint,
                        leaf.names(range(i, i + 1), range(e, e + 1))[0][0],
                        leaf.source,
                        per_tensor,
                        index[lead:],
                    )
                    for e in experts
                ]
                for i in layers
            ]
            out = np.stack([np.stack(per_layer) for per_layer in blocks])
            # Drop the dims this param does not have (unstacked, dense).
            return out.reshape([s.stop - s.start for s in index])

        leaves[path_] = assemble(shape, flat_shardings[path_], read_block)
    unused = [n for n in checkpoint.names() if n not in used and not n.endswith(IGNORED_SUFFIXES)]
    if unused and unused != ["lm_head.weight"]:  # A tied model may still carry its head.
        raise ConfigError(
            f"{setting}={checkpoint.path}: tensors our model has no place for: "
            f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}; the checkpoint does "
            "not match its config.json, or uses a layout not supported here"
        )
    treedef = jax.tree.structure(abstract_params)
    return jax.tree.unflatten(treedef, [leaves[p] for p, _ in _paths(abstract_params)])


def hf_tensors(params, dtype=np.float32):
    """(Hugging Face name, fetch) pairs for our params: each fetch copies one layer's (one
    expert's) tensor to the host, in HF's layout and `dtype`."""
    for path_, array in _paths(params):
        leaf = _leaf(path_)
        lead = int(leaf.stacked) + int(leaf.experts)
        layers = range(array.shape[0])
        experts = range(array.shape[lead - 1] if leaf.experts else 0)
        for i, per_layer in enumerate(leaf.names(layers, experts)):
            for e, name in enumerate(per_layer):
                where = (i,) * leaf.stacked + (e,) * leaf.experts

                def fetch(array=array, where=where, source=leaf.source):
                    x = np.asarray(jax.device_get(array[where] if where else array))
                    if source.input_dims:
                        n_in = source.input_dims
                        x = x.reshape(math.prod(x.shape[:n_in]), -1).T
                    return x.astype(dtype)

                yield name, fetch


def save_params(
    path: str | pathlib.Path,
    params,
    model: ml_collections.ConfigDict,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Writes our params as a Hugging Face checkpoint (config.json + safetensors) that
    `transformers`' `from_pretrained` loads, one tensor at a time through host memory."""
    tensors = hf_tensors(params, numpy_dtype(dtype))
    write_checkpoint(path, hf_config(model, dtype), tensors, max_shard_bytes)
