"""The model zoo: GPT-2, BERT and T5 train through the same trainer and sharding rules as
Llama; packed rows compute what their documents do alone; the objectives' batch builders."""

import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from angel_jax import models
from angel_jax.config import ConfigError, default_config, load_config
from angel_jax.data import make_batches
from angel_jax.data.objectives import (
    document_segments,
    make_row_builder,
    mask_tokens,
    row_fields,
    span_corrupt,
    span_shape,
    split_fields,
)
from angel_jax.family import FEATURES
from angel_jax.losses import objective_loss
from angel_jax.mesh import make_mesh
from angel_jax.models import FAMILIES, make_model
from angel_jax.train import build

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"

# Tiny shapes: compiling is most of each case's time.
TINY = [
    "--config.model.num_layers=1",
    "--config.model.decoder_layers=1",
    "--config.model.d_model=32",
    "--config.model.ffn_dim=64",
    "--config.model.dtype=float32",
    "--config.train.seq_len=32",
    "--config.train.batch_size=8",
    "--config.train.lr=1e-2",
    "--config.train.warmup_steps=1",
]


@pytest.mark.parametrize(
    "name, mesh, zero_stage, synthetic",
    [
        ("gpt2_tiny", dict(data=4, tensor=2), 3, False),
        ("bert_tiny", dict(data=4, tensor=2), 1, True),
        ("t5_tiny", dict(data=2, tensor=4), 2, True),
    ],
)
def test_family_trains_sharded_with_loss_going_down(name, mesh, zero_stage, synthetic):
    """GPT-2 on the default corpus packed by documents; BERT and T5 on random tokens (their
    builders are tested below; reading the corpus costs a second or two)."""
    overrides = [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]
    overrides.append(f"--config.data.synthetic={synthetic}")
    overrides.append("--config.model.sequence_parallel=true")  # Norm regions split too.
    config = load_config(str(CONFIGS / f"{name}.py"), TINY + overrides)
    config.zero_stage = zero_stage
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    # Megatron layout from the shared rules, plus ZeRO-3's `data` on the params.
    kernel = state.params["embed"]["embedding"]
    assert "tensor" in jax.tree.leaves(tuple(kernel.sharding.spec))
    assert ("data" in jax.tree.leaves(tuple(kernel.sharding.spec))) == (zero_stage == 3)
    batch = exp.global_batch(make_batches(config)[0])
    losses = []
    for _ in range(4):  # The same batch: the loss must fall.
        state, metrics = exp.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.05, losses
    assert float(metrics["predicted_tokens"]) > 0


def test_gpt2_trains_on_plain_windows():
    """Without packing, GPT-2 reads plain token windows as Llama does."""
    overrides = ["--config.data.packing=false", "--config.data.synthetic=true"]
    config = load_config(str(CONFIGS / "gpt2_tiny.py"), TINY + overrides)
    exp = build(config, make_mesh(config.mesh))
    state, batch = exp.init_state(), exp.global_batch(make_batches(config)[0])
    losses = []
    for _ in range(4):
        state, metrics = exp.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.05, losses


def tiny_model(family: str):
    c = default_config()
    c.model.update(
        family=family,
        num_layers=2,
        d_model=32,
        num_heads=4,
        num_kv_heads=4 if family != "llama" else 2,
        ffn_dim=64,
        vocab_size=64,
        max_positions=32,
        dtype="float32",
        scan_layers=family != "bert",  # Both layer layouts take the masks.
    )
    return make_model(c.model, "cpu")[1]


def random_params(model, *inputs):
    """Random params from the shapes alone: compiling the init's random draws costs seconds."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


DOC_A = np.arange(3, 8)  # 5 tokens.
DOC_B = np.arange(20, 27)  # 7 tokens.


def packed_row(width=16):
    """DOC_A, DOC_B, then padding: tokens and segment ids (1, 2, 0)."""
    tokens, segments = np.zeros(width, np.int32), np.zeros(width, np.int32)
    tokens[:5], tokens[5:12] = DOC_A, DOC_B
    segments[:5], segments[5:12] = 1, 2
    return jnp.asarray(tokens[None]), jnp.asarray(segments[None])


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_packed_documents_equal_documents_alone(family):
    model = tiny_model(family)
    tokens, segments = packed_row()

    params = random_params(model, *FAMILIES[family].example_inputs(tokens))

    @jax.jit  # One program for all four runs: compiling once is faster than running eagerly.
    def run(params, tokens, segments):
        return (
            model.apply(params, tokens, segment_ids=segments)[0],
            model.apply(params, jnp.asarray(DOC_A[None]))[0],
            model.apply(params, jnp.asarray(DOC_B[None]))[0],
            model.apply(params, tokens)[0],
        )

    packed, alone_a, alone_b, whole = run(params, tokens, segments)
    np.testing.assert_allclose(packed[:5], alone_a, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(packed[5:12], alone_b, atol=2e-5, rtol=2e-5)
    # Without segment ids the second document sees the first (the mask is what separates).
    assert not np.allclose(whole[5:12], alone_b, atol=1e-3)


def test_packed_causal_loss_counts_only_tokens_within_documents():
    c = default_config()
    c.model.update(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, ffn_dim=64)
    c.model.update(vocab_size=64, dtype="float32")
    c.train.seq_len, c.data.packing = 15, True
    model = make_model(c.model, "cpu")[1]
    tokens, segments = packed_row()  # 16 = seq_len + 1 tokens: A (5), B (7), padding.
    params = random_params(model, tokens)

    @jax.jit
    def run(params, rows):
        loss = objective_loss(model, c, params["params"], rows)[0]
        nll = lambda doc: optax.softmax_cross_entropy_with_integer_labels(
            model.apply(params, jnp.asarray(doc[None, :-1])), jnp.asarray(doc[None, 1:])
        )
        return loss, nll(DOC_A), nll(DOC_B)

    loss, nll_a, nll_b = run(params, jnp.concatenate([tokens, segments], axis=1))
    # 4 + 6 predictions: none from A's last token onto B's first, none on padding.
    expected = (jnp.sum(nll_a) + jnp.sum(nll_b)) / 10
    np.testing.assert_allclose(loss, expected, rtol=2e-5)


def test_t5_packed_examples_equal_examples_alone():
    model = tiny_model("t5")
    tokens, segments = packed_row()
    targets = jnp.asarray(np.array([[9, 10, 11, 30, 31, 0, 0, 0]], np.int32))
    target_segments = jnp.asarray(np.array([[1, 1, 1, 2, 2, 0, 0, 0]], np.int32))

    params = random_params(model, tokens, targets)

    @jax.jit
    def run(params, tokens, targets, segments, target_segments):
        return (
            model.apply(params, tokens, targets, segments, target_segments)[0],
            model.apply(params, jnp.asarray(DOC_A[None]), targets[:, :3])[0],
            model.apply(params, jnp.asarray(DOC_B[None]), targets[:, 3:5])[0],
        )

    packed, alone_a, alone_b = run(params, tokens, targets, segments, target_segments)
    np.testing.assert_allclose(packed[:3], alone_a, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(packed[3:5], alone_b, atol=2e-5, rtol=2e-5)


def test_layer_params_are_stacked_and_named_like_llama():
    model = tiny_model("gpt2")
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
    assert sorted(params) == ["embed", "final_norm", "layers", "pos_embed"]
    assert params["layers"]["attn"]["query"]["kernel"].shape == (2, 32, 4, 8)
    assert params["layers"]["attn"]["query"]["bias"].shape == (2, 4, 8)


def test_document_segments_start_after_each_end_token():
    eos = 9
    tokens = np.array([[1, 2, eos, 3, eos, eos, 4]])
    np.testing.assert_array_equal(document_segments(tokens, eos), [[1, 1, 1, 2, 2, 3, 4]])
    np.testing.assert_array_equal(document_segments(tokens, None), np.ones_like(tokens))


def test_mask_tokens_follows_bert_rule():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, 4000).astype(np.int32)
    inputs, labels = mask_tokens(tokens, rng, 0.15, mask_id=127, vocab=100)
    chosen = labels >= 0
    assert chosen.sum() == 600
    np.testing.assert_array_equal(labels[chosen], tokens[chosen])
    np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])
    masked = np.mean(inputs[chosen] == 127)
    assert 0.75 < masked < 0.85, masked
    assert inputs.max() <= 127 and inputs[inputs != 127].max() < 100


def test_span_corruption_hides_spans_that_targets_restore():
    rng = np.random.default_rng(1)
    tokens = np.arange(100, 164, dtype=np.int32)  # 64 tokens.
    inputs, targets = span_corrupt(tokens, rng, 0.15, 3.0, vocab=512)
    noise, spans = span_shape(64, 0.15, 3.0)
    assert (noise, spans) == (10, 3)
    assert len(inputs) == 64 - noise + spans and len(targets) == noise + spans
    sentinels = [511, 510, 509]
    assert [int(x) for x in inputs if x >= 500] == sentinels
    assert [int(x) for x in targets if x >= 500] == sentinels
    assert inputs[0] < 500  # Kept tokens come first.
    # Putting each span back at its sentinel gives the original window.
    spans_by_sentinel, current = {}, None
    for x in targets:
        if x >= 500:
            current = int(x)
            spans_by_sentinel[current] = []
        else:
            spans_by_sentinel[current].append(int(x))
    restored = []
    for x in inputs:
        restored.extend(spans_by_sentinel[int(x)] if x >= 500 else [int(x)])
    np.testing.assert_array_equal(restored, tokens)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_row_builder_is_deterministic_and_split_invariant(family):
    c = default_config()
    c.model.update(family=family, vocab_size=512)
    c.train.update(seq_len=32, batch_size=4)
    c.data.packing = family == "bert"
    build_rows = make_row_builder(c, data_vocab=257, eos_id=256)
    windows = np.random.default_rng(0).integers(0, 257, (4, 33)).astype(np.int32)
    rows = build_rows(windows, 7, 0)
    assert rows.shape == (4, sum(w for _, w in row_fields(c)))
    np.testing.assert_array_equal(rows, build_rows(windows, 7, 0))
    np.testing.assert_array_equal(rows[2:], build_rows(windows[2:], 7, 2))  # Another process.
    assert not np.array_equal(rows, build_rows(windows, 8, 0))  # Another batch.
    fields = split_fields(rows, row_fields(c))
    if family == "t5":  # 32 tokens, 5 corrupted in 2 spans: 29 inputs, 3 of padding.
        real = fields["segment_ids"] > 0
        assert real.sum(axis=1).tolist() == [29] * 4
        assert np.all(fields["inputs"][~real] == 0)
        assert fields["targets"].shape == (4, 7) and np.all(fields["target_segment_ids"] == 1)
    else:  # Masked: 5 of 32 predicted, documents numbered from the end-of-document tokens.
        assert np.all((fields["labels"] >= 0).sum(axis=1) == 5)
        np.testing.assert_array_equal(
            fields["segment_ids"], document_segments(windows[:, :32], 256)
        )


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(model__family="bert", train__objective="causal"), "train.objective"),
        (dict(model__family="t5", data__packing=True), "data.packing"),
        (dict(model__family="bert", mesh__context=2), "does not support config.mesh.context"),
        (dict(model__family="gpt2", mesh__context=2), "does not support config.mesh.context"),
        (dict(data__packing=True, mesh__context=2), "mesh.context=1"),
        (dict(model__family="gpt2", train__seq_len=2048), "max_positions"),
        (
            dict(model__family="gpt2", model__num_experts=4),
            r"gpt2 does not support config.model.num_experts > 0: .*config.model.family=llama",
        ),
        (dict(model__family="t5", fp8__matmul=True), "does not support config.fp8.matmul"),
        (dict(model__family="gpt3"), "model.family"),
        (dict(data__packing=True, mesh__pipeline=2), "mesh.pipeline=1"),
        (dict(model__family="bert", data__mask_id=512), "data.mask_id"),
    ],
)
def test_bad_family_settings_are_config_errors(setting, message):
    c = default_config()
    for key, value in setting.items():
        section, name = key.split("__")
        c[section][name] = value
    with pytest.raises(ConfigError, match=message):
        models.validate(c)


def test_reserved_ids_must_lie_above_the_data():
    c = default_config()
    c.model.update(family="bert", vocab_size=257)
    with pytest.raises(ConfigError, match="vocab_size >= 258"):
        make_row_builder(c, data_vocab=257, eos_id=256)


@pytest.mark.parametrize(
    "name, millions",
    [
        ("gpt2_tiny", 0.5),
        ("gpt2_124m", 124.5),  # GPT-2 small, its vocabulary padded by 47 rows.
        ("bert_tiny", 0.5),
        ("bert_base", 109.5),  # bert-base-uncased with the MLM head, without the pooler.
        ("t5_tiny", 1.0),
        ("t5_base", 222.9),  # t5-base.
    ],
)
def test_configs_validate_and_have_the_published_sizes(name, millions):
    config = load_config(str(CONFIGS / f"{name}.py"))
    models.validate(config)
    model = make_model(config.model, "cpu")[1]
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    shapes = jax.eval_shape(
        model.init, jax.random.key(0), *FAMILIES[config.model.family].example_inputs(tokens)
    )
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert round(count / 1e6, 1) == millions


def test_each_family_names_its_features_and_its_converter():
    """What `models.validate` and the Hugging Face import read of a family: features that
    exist, a converter module with the three conversions, one family per model_type."""
    for family in FAMILIES.values():
        assert family.features <= set(FEATURES), family.name
        module = importlib.import_module(family.converter)
        for name in ("model_settings", "load_params", "save_params"):
            assert callable(getattr(module, name)), (family.name, name)
    model_types = [t for f in FAMILIES.values() for t in f.hf_model_types]
    assert len(model_types) == len(set(model_types)) and "mixtral" in model_types
