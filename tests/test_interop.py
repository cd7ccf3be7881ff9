"""Hugging Face interop: small random `transformers` models imported into our params (sharded
as they load), compared on logits, exported and read back bit for bit."""

import json
import pathlib
import types

import jax
import ml_collections
import numpy as np
import pytest

from angel_jax import checkpoint, loop, models, sharding, train
from angel_jax.config import ConfigError, default_config, load_config, validate
from angel_jax.interop import hf, llama
from angel_jax.mesh import make_mesh

# The references are transformers models in PyTorch, whose CPU wheel on our machines is for
# Python 3.11: .ci/run runs these in an environment of their own (requirements-torch.txt).
torch = pytest.importorskip("torch", reason="needs PyTorch: pip install -r requirements-torch.txt")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf_reference

VOCAB, SEQ = 128, 16
CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
MODELS = {
    "llama_gqa_untied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SMALL, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5e5
        )
    ),
    # Llama 3.1's RoPE, with an original length that puts frequencies in all three bands.
    "llama3_rope_scaling": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SMALL,
            num_key_value_heads=2,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        )
    ),
    "llama_tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=True)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        )
    ),
}


def hf_checkpoint(name: str, directory) -> tuple[torch.nn.Module, str]:
    """A random fp32 `transformers` model and the directory save_pretrained wrote it to."""
    torch.manual_seed(sorted(MODELS).index(name))
    model = MODELS[name]().float().eval()
    # Non-trivial norm scales, so a misplaced norm weight shows in the logits.
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = str(directory / name)
    model.save_pretrained(path)
    return model, path


def finetune_config(path: str) -> ml_collections.ConfigDict:
    c = default_config()
    c.update(init_from_hf=path, zero_stage=3)
    c.mesh.update(data=4, tensor=2)
    c.model.dtype = "float32"
    c.train.update(batch_size=4, seq_len=SEQ, z_loss=0.0)
    return c


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def our_logits(exp: train.Experiment, params, tokens: np.ndarray) -> np.ndarray:
    with sharding.use_rules(exp.mesh, exp.rules):
        apply = jax.jit(lambda p, t: exp.model.apply({"params": p}, t))
        return np.asarray(apply(params, tokens))


def assert_close_relative(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= rtol, f"max error {err:.2e} of the largest logit, over {rtol}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_import_matches_transformers_and_export_round_trips(name, tmp_path, monkeypatch):
    model, path = hf_checkpoint(name, tmp_path)
    config = finetune_config(path)
    exp = train.build(config, make_mesh(config.mesh))  # Sets config.model from config.json.
    assert config.model.tie_embeddings == (name == "llama_tied")
    assert config.model.num_experts == (4 if name == "mixtral" else 0)

    # Each device's block is read on its own: no read returns a whole sharded tensor.
    reads = []
    read = hf.Checkpoint.read
    monkeypatch.setattr(
        hf.Checkpoint, "read", lambda self, n, i=None: reads.append(i) or read(self, n, i)
    )
    params = llama.load_params(path, exp.abstract_state.params, exp.state_sharding.params)
    monkeypatch.undo()
    assert reads and None not in reads
    targets = jax.tree.leaves(exp.state_sharding.params)
    for p, s in zip(jax.tree.leaves(params), targets, strict=True):
        assert p.sharding == s and p.dtype == np.float32
    assert "data" in exp.state_sharding.params["embed"]["embedding"].spec  # ZeRO-3 blocks.

    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, SEQ))
    ref = hf_logits(model, tokens)
    assert_close_relative(our_logits(exp, params, tokens), ref)

    # Export in shards: every tensor is the original, bit for bit, and comes back the same.
    out = tmp_path / "export"
    llama.save_params(out, params, config.model, max_shard_bytes=64 * 1024)
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    original = hf.Checkpoint(path)
    exported = hf.Checkpoint(out)
    expected = [n for n in original.names() if not (name == "llama_tied" and n == "lm_head.weight")]
    assert exported.names() == expected
    for n in expected:
        np.testing.assert_array_equal(exported.read(n), original.read(n), err_msg=n)
    again = llama.load_params(out, exp.abstract_state.params, exp.state_sharding.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reloaded = type(model).from_pretrained(out).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), ref)


def test_finetune_recipe_starts_from_the_imported_weights(tmp_path):
    model, path = hf_checkpoint("llama_gqa_untied", tmp_path)
    overrides = [
        f"--config.init_from_hf={path}",
        "--config.model.dtype=float32",
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        "--config.train.batch_size=4",
        f"--config.train.seq_len={SEQ}",
    ]
    config = load_config(str(CONFIGS / "llama_finetune.py"), overrides)
    exp = train.build(config, make_mesh(config.mesh))
    state = exp.init_state()
    tokens = np.random.default_rng(1).integers(0, VOCAB, (4, SEQ + 1))
    _, metrics = exp.train_step(state, exp.global_batch(tokens))
    with torch.no_grad():
        hf_loss = model(torch.from_numpy(tokens), labels=torch.from_numpy(tokens)).loss.item()
    np.testing.assert_allclose(float(metrics["loss"]), hf_loss, rtol=1e-5)

    # A checkpoint of the run's own wins over the import: a restarted run resumes.
    restored = checkpoint.Restored(7, state, 3, [])
    ckpt = types.SimpleNamespace(restore_latest=lambda *args: restored, directory=tmp_path)
    exp.init_state = lambda: pytest.fail("imported again despite a checkpoint")
    _, data_index = loop.restore_or_init(exp, ckpt, None, lambda message: None)
    assert data_index == 3


def test_unstacked_layers_import_the_same_weights(tmp_path):
    _, path = hf_checkpoint("llama_tied", tmp_path)
    config = finetune_config(path)
    config.model.scan_layers = False
    exp = train.build(config, make_mesh(config.mesh))
    params = llama.load_params(path, exp.abstract_state.params, exp.state_sharding.params)
    checkpoint = hf.Checkpoint(path)
    np.testing.assert_array_equal(
        params["layer_1"]["attn"]["out"]["kernel"],
        checkpoint.read("model.layers.1.self_attn.o_proj.weight").T.reshape(4, 16, 64),
    )


def write_config(directory, **fields) -> str:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return str(directory)


def test_bad_checkpoints_are_config_errors_naming_the_setting(tmp_path):
    config = default_config()
    config.init_from_hf = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="config.init_from_hf=.*missing: no config.json"):
        validate(config)

    llama_fields = dict(SMALL, model_type="llama", num_key_value_heads=2)
    cases = {
        "mamba": (dict(model_type="mamba"), "model_type 'mamba'"),
        "yarn": (dict(llama_fields, rope_scaling=dict(rope_type="yarn")), "rope scaling 'yarn'"),
        "bias": (dict(llama_fields, attention_bias=True), "attention_bias=true"),
    }
    for case, (fields, message) in cases.items():
        config.init_from_hf = write_config(tmp_path / case, **fields)
        with pytest.raises(ConfigError, match=f"config.init_from_hf: {message}"):
            models.apply_checkpoint_architecture(config)

    config.init_from_hf = write_config(tmp_path / "no_weights", **llama_fields)
    (tmp_path / "no_weights" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="pytorch_model.bin: re-save it with save_pretrained"):
        hf.Checkpoint(config.init_from_hf, "config.init_from_hf").names()


def test_mismatched_weights_are_config_errors(tmp_path):
    _, path = hf_checkpoint("llama_tied", tmp_path)
    # config.json says a wider MLP than the weights have.
    hf_config = json.loads((tmp_path / "llama_tied" / "config.json").read_text())
    hf_config["intermediate_size"] = 128
    (tmp_path / "llama_tied" / "config.json").write_text(json.dumps(hf_config))
    config = finetune_config(path)
    exp = train.build(config, make_mesh(config.mesh))
    message = r"down_proj.weight has shape \(64, 96\), our layers/mlp/down/kernel needs \(64, 128"
    with pytest.raises(ConfigError, match=message):
        llama.load_params(path, exp.abstract_state.params, exp.state_sharding.params)


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_rope_scaling_frequencies_match_transformers(kind):
    """Every band of Llama 3.1's scaling (head dim 16, original length 32: wavelengths below
    8 kept, 8..32 blended, above 32 stretched) and linear scaling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from angel_jax.layers.attention import RopeScaling, rope_frequencies

    rope = dict(rope_type=kind, factor=8.0)
    if kind == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    hf_config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_scaling=rope
    )
    expected = LlamaRotaryEmbedding(hf_config).inv_freq.numpy()
    ours = rope_frequencies(8, 10000.0, RopeScaling(kind, 8.0, 1.0, 4.0, 32))
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    ratios = expected / np.asarray(rope_frequencies(8, 10000.0))
    assert len(set(np.round(ratios, 4))) == (
        3 if kind == "llama3" else 1
    )  # The bands are all there: kept (1), blended, stretched (1/8).
