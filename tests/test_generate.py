"""Generation with a KV cache: the cache changes nothing but speed, sampling obeys top-k, and
greedy decoding of imported Hugging Face Llama and GPT-2 models matches transformers' own."""

import functools

import jax
import numpy as np
import pytest

from angel_jax import generate, sharding, train
from angel_jax.config import ConfigError, default_config
from angel_jax.interop import gpt2, llama
from angel_jax.mesh import make_mesh
from tests.conftest import hf_reference

VOCAB, PROMPT, STEPS = 128, 5, 6


def experiment(**model):
    c = default_config()
    c.zero_stage = 3  # Params split over data too: generation gathers what it needs.
    c.mesh.update(data=4, tensor=2)
    c.model.update(
        num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_dim=96, vocab_size=VOCAB
    )
    c.model.update(dtype="float32", **model)
    c.train.update(batch_size=4, seq_len=16)
    return train.build(c, make_mesh(c.mesh))


def full_logits(exp, params, tokens):
    # On a device first, and ready: a numpy array passed straight to the jitted call was at
    # times read stale under load on XLA:CPU's 8 devices (jax 0.10 and 0.11: the previous
    # call's tokens, once the caller had written the next one into the same array).
    tokens = jax.device_put(np.asarray(tokens, np.int32)).block_until_ready()
    with sharding.use_rules(exp.mesh, exp.rules):
        return np.asarray(_forward(exp.model, params, tokens))


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens):
    return model.apply({"params": params}, tokens)


def random_params(exp):
    """Random weights (from numpy: quicker than compiling the model's init) in the training
    layout; norm scales around 1."""
    rng = np.random.default_rng(0)

    def one(path, abstract, target):
        scale = jax.tree_util.keystr(path).endswith("['scale']")
        x = rng.normal(1.0 if scale else 0.0, 0.1 if scale else 0.2, abstract.shape)
        return jax.device_put(x.astype(np.float32), target)

    return jax.tree_util.tree_map_with_path(
        one, exp.abstract_state.params, exp.state_sharding.params
    )


def recomputed_greedy(exp, params, prompt, steps):
    """Greedy tokens, each from a full forward pass over the sequence so far (padded to the
    final length: causal, so the padding changes nothing before it)."""
    tokens = np.zeros((prompt.shape[0], prompt.shape[1] + steps), np.int64)
    tokens[:, : prompt.shape[1]] = prompt
    for pos in range(prompt.shape[1], tokens.shape[1]):
        tokens[:, pos] = full_logits(exp, params, tokens)[:, pos - 1].argmax(-1)
    return tokens


def test_cached_decoding_equals_the_full_forward_and_sampling_obeys_top_k():
    # Mixture-of-experts layers (dropless, as imported Mixtral) here; dense layers are checked
    # against transformers below.
    exp = experiment(num_experts=4, router="dropless", moe_ffn_dim=48)
    params = random_params(exp)
    prompt = np.random.default_rng(0).integers(0, VOCAB, (4, PROMPT))

    # Each new token's logits, computed with the cache, are the full forward pass's; and so
    # greedy generation equals recomputing the whole sequence for each new token.
    tokens, logits = generate.generate(exp, params, prompt, STEPS, with_logits=True)
    full = full_logits(exp, params, tokens)
    np.testing.assert_allclose(logits, full[:, PROMPT - 1 : -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tokens, recomputed_greedy(exp, params, prompt, STEPS))

    # Sampling (one prompt: fewer rows than `data`, so replicated): top-1 is greedy, top-3
    # draws only among each step's three likeliest tokens.
    one = prompt[:1]
    top1, _ = generate.generate(exp, params, one, STEPS, 1.0, top_k=1, with_logits=True)
    np.testing.assert_array_equal(top1, tokens[:1])
    drawn, logits = generate.generate(exp, params, one, STEPS, 2.0, 3, seed=3, with_logits=True)
    for step in range(STEPS):
        assert drawn[0, PROMPT + step] in np.argsort(logits[0, step])[-3:], step
    np.testing.assert_allclose(  # atol: jax 0.11.2's CPU sums in another order (1.1e-5 seen).
        logits[0],
        full_logits(exp, params, np.repeat(drawn, 4, 0))[0, PROMPT - 1 : -1],
        rtol=1e-5,
        atol=3e-5,
    )
    assert not np.array_equal(drawn, top1)


@hf_reference
def test_greedy_generation_of_imported_llama_matches_transformers(tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    model.save_pretrained(tmp_path)
    c = default_config()
    c.init_from_hf = str(tmp_path)
    c.mesh.update(data=4, tensor=2)
    c.model.dtype = "float32"
    c.train.update(batch_size=4, seq_len=16)
    exp = train.build(c, make_mesh(c.mesh))
    params = llama.load_params(tmp_path, exp.abstract_state.params, exp.state_sharding.params)
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, PROMPT))
    ours = generate.generate(exp, params, prompt, STEPS)
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    np.testing.assert_array_equal(ours, ref)


def test_gpt2_cached_decoding_equals_the_full_forward_within_its_positions():
    exp = experiment(family="gpt2", num_kv_heads=4, max_positions=16)
    params = random_params(exp)
    prompt = np.random.default_rng(1).integers(0, VOCAB, (4, PROMPT))
    tokens, logits = generate.generate(exp, params, prompt, STEPS, with_logits=True)
    full = full_logits(exp, params, tokens)
    np.testing.assert_allclose(logits, full[:, PROMPT - 1 : -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tokens, recomputed_greedy(exp, params, prompt, STEPS))
    # The learned position table has 16 rows: a 17th position is refused, not clamped.
    with pytest.raises(ConfigError, match="config.model.max_positions=16"):
        generate.generate(exp, params, prompt, 16 - PROMPT + 1)
    # Ids outside the vocabulary are refused, not clamped by the embedding lookup.
    outside = prompt.copy()
    outside[0, :2] = (VOCAB, 600)
    with pytest.raises(ConfigError, match=f"prompt token ids {VOCAB}, 600 lie outside"):
        generate.generate(exp, params, outside, 1)


@hf_reference
def test_greedy_generation_of_imported_gpt2_matches_transformers(tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_inner=64, vocab_size=VOCAB, n_positions=16
    )
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    model.save_pretrained(tmp_path)
    c = default_config()
    c.model.update(gpt2.model_settings(hf_config.to_dict()), dtype="float32")
    c.mesh.update(data=4, tensor=2)
    c.train.update(batch_size=4, seq_len=16)
    exp = train.build(c, make_mesh(c.mesh))
    params = gpt2.load_params(tmp_path, exp.abstract_state.params, exp.state_sharding.params)
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, PROMPT))
    ours = generate.generate(exp, params, prompt, STEPS)
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    np.testing.assert_array_equal(ours, ref)


def _generate_cli(monkeypatch, capsys, *args: str) -> str:
    """generate's command line on configs/tiny.py (1 layer, the byte tokenizer's 257 ids:
    random weights over more emit ids it cannot decode, refused) with random params."""
    monkeypatch.setattr(generate, "load_params_for", lambda exp, checkpoint: random_params(exp))
    argv = ["--config", "configs/tiny.py", "--steps", "4", "--config.model.num_layers=1"]
    argv += ["--config.model.vocab_size=257", *args]
    assert generate.main(argv) == 0
    return capsys.readouterr().out.strip()


def test_text_prompt_gives_text_the_same_as_token_ids(monkeypatch, capsys):
    from angel_jax.data import ByteTokenizer

    text = _generate_cli(monkeypatch, capsys, "--prompt", "Hi")
    ids = [
        int(t) for t in _generate_cli(monkeypatch, capsys, "--prompt-tokens", "72,105").split(",")
    ]
    assert ids[:2] == [72, 105] and len(ids) == 6
    assert text == ByteTokenizer().decode(ids) and text.startswith("Hi")


@hf_reference  # `tokenizers` comes with transformers (the Python 3.11 environment).
def test_text_prompt_through_a_hugging_face_tokenizer(monkeypatch, capsys, tmp_path):
    import tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ("--tokenizer", str(tmp_path / "tokenizer.json"), "--config.model.vocab_size=4")
    text = _generate_cli(monkeypatch, capsys, "--prompt", "hello world", *tokenizer)
    ids = _generate_cli(monkeypatch, capsys, "--prompt-tokens", "1,2", *tokenizer[2:]).split(",")
    assert text == tok.decode([int(i) for i in ids]) and text.startswith("hello world")


@pytest.mark.parametrize("split", [True, False])
def test_generates_from_an_offloaded_checkpoint(tmp_path, split):
    """A checkpoint of an offloaded run (masters in host memory, per layer; split or whole)
    generates with its compute copy: the tokens and logits of its masters on the device (the
    same bfloat16 weights, but where a master's low 16 bits are a tie). Before, its host
    masters reached the model and the embedding's gather refused them."""
    from angel_jax.checkpoint import Checkpointer
    from tests.test_offload import train as train_steps
    from tests.test_train_parity import small_config

    kw = dict(mesh__data=8, model__dtype="bfloat16")
    config = small_config(offload__policy="optimizer", offload__split_masters=split, **kw)
    exp, state, _ = train_steps(config, steps=2)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(2, exp.checkpointed(state), 2, *exp.checkpoint_layout)
    ckpt.close()
    prompt = np.array([[1, 2, 3, 4]])
    tokens, logits = generate.generate(
        exp, generate.load_params_for(exp, str(tmp_path)), prompt, 4, with_logits=True
    )
    on_device = train.build(small_config(**kw), exp.mesh, fit_compiled=False)
    params = jax.device_put(exp.params_numpy(state), on_device.state_sharding.params)
    ref_tokens, ref_logits = generate.generate(on_device, params, prompt, 4, with_logits=True)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(logits, ref_logits)
