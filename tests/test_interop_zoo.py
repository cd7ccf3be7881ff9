"""Hugging Face interop for the classic families: small random `transformers` models saved,
imported into our params (sharded), logits compared in float32; export round-trips exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from angel_jax.config import default_config
from angel_jax.interop import gpt2 as gpt2_interop
from angel_jax.mesh import make_mesh
from angel_jax.train import build

# The references are transformers models in PyTorch, whose CPU wheel on our machines is for
# Python 3.11: .ci/run runs these in an environment of their own (requirements-torch.txt).
torch = pytest.importorskip("torch", reason="needs PyTorch: pip install -r requirements-torch.txt")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf_reference


def experiment(settings: dict):
    """An Experiment for config.model `settings` on a data x tensor mesh, float32."""
    c = default_config()
    c.model.update(settings, dtype="float32")
    c.train.update(seq_len=16, batch_size=8)
    c.mesh.update(data=4, tensor=2)
    return build(c, make_mesh(c.mesh))


def test_gpt2_import_matches_transformers_and_export_round_trips(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_inner=64, vocab_size=64, n_positions=16
    )
    reference = transformers.GPT2LMHeadModel(hf_config).eval()
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)

    settings = gpt2_interop.model_settings(hf_config.to_dict())
    exp = experiment(settings)
    params = gpt2_interop.load_params(
        tmp_path / "hf", exp.abstract_state.params, exp.state_sharding.params
    )
    # Loaded straight into the training layout: the vocabulary split over `tensor`.
    assert "tensor" in jax.tree.leaves(tuple(params["embed"]["embedding"].sharding.spec))

    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).logits.numpy()
    logits = jax.jit(exp.model.apply)({"params": params}, jnp.asarray(tokens))
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())

    gpt2_interop.save_params(tmp_path / "ours", params, exp.config.model)
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "ours"))
    for name, tensor in exported.items():  # Bit-exact, HF's own tensors back.
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    assert set(original) - set(exported) <= {"lm_head.weight"}  # Tied: the same table.
    again = gpt2_interop.load_params(
        tmp_path / "ours", exp.abstract_state.params, exp.state_sharding.params
    )
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(again), jax.device_get(params))


def test_bert_import_matches_transformers_and_export_round_trips(tmp_path):
    from angel_jax.interop import bert as bert_interop

    torch.manual_seed(0)
    hf_config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=16,
    )
    reference = transformers.BertForMaskedLM(hf_config).eval()
    with torch.no_grad():  # Non-zero biases, so a misplaced one shows.
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)

    exp = experiment(bert_interop.model_settings(hf_config.to_dict()))
    params = bert_interop.load_params(
        tmp_path / "hf", exp.abstract_state.params, exp.state_sharding.params
    )
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).logits.numpy()
    logits = jax.jit(exp.model.apply)({"params": params}, jnp.asarray(tokens))
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())

    bert_interop.save_params(tmp_path / "ours", params, exp.config.model)
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "ours"))
    for name, tensor in exported.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert set(original) - set(exported) <= tied
    again = bert_interop.load_params(
        tmp_path / "ours", exp.abstract_state.params, exp.state_sharding.params
    )
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(again), jax.device_get(params))


def test_t5_import_matches_transformers_and_export_round_trips(tmp_path):
    from angel_jax.interop import t5 as t5_interop

    torch.manual_seed(0)
    hf_config = transformers.T5Config(
        num_layers=2,
        num_decoder_layers=1,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=64,
        vocab_size=64,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,  # Offsets past it share the last bucket.
    )
    reference = transformers.T5ForConditionalGeneration(hf_config).eval()
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)

    exp = experiment(t5_interop.model_settings(hf_config.to_dict()))
    params = t5_interop.load_params(
        tmp_path / "hf", exp.abstract_state.params, exp.state_sharding.params
    )
    rng = np.random.default_rng(0)
    inputs, decoder_inputs = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (2, 6))
    with torch.no_grad():
        expected = reference(
            input_ids=torch.from_numpy(inputs), decoder_input_ids=torch.from_numpy(decoder_inputs)
        ).logits.numpy()
    logits = jax.jit(exp.model.apply)(
        {"params": params}, jnp.asarray(inputs), jnp.asarray(decoder_inputs)
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())

    t5_interop.save_params(tmp_path / "ours", params, exp.config.model)
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "ours"))
    for name, tensor in exported.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    tied_copies = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert set(original) - set(exported) <= tied_copies
    again = t5_interop.load_params(
        tmp_path / "ours", exp.abstract_state.params, exp.state_sharding.params
    )
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(again), jax.device_get(params))


def test_a_gpt2_checkpoint_starts_a_training_run(tmp_path):
    """config.init_from_hf takes a GPT-2 checkpoint's architecture and weights, like Llama's."""
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_inner=64, vocab_size=64, n_positions=16
    )
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(tmp_path / "hf")
    c = default_config()
    c.init_from_hf = str(tmp_path / "hf")
    c.model.dtype = "float32"
    c.train.update(seq_len=16, batch_size=8)
    c.mesh.update(data=4, tensor=2)
    exp = build(c, make_mesh(c.mesh))
    assert exp.config.model.family == "gpt2" and exp.config.model.d_model == 32
    state = exp.init_state()
    expected = gpt2_interop.load_params(
        tmp_path / "hf", exp.abstract_state.params, exp.state_sharding.params
    )
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(expected)
    )
