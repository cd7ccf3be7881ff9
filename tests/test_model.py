"""The Llama model's math: loss, RoPE, causality, FLOP accounting."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from angel_jax.config import ConfigError, default_config, load_config
from angel_jax.layers import apply_rope
from angel_jax.losses import cross_entropy
from angel_jax.models.llama import Llama, LlamaConfig
from angel_jax.planning.activations import layer_flops


def test_cross_entropy_matches_optax_and_adds_z_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    total, parts = cross_entropy(logits, targets, z_loss=0.0)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    with_z, parts_z = cross_entropy(logits, targets, z_loss=1e-2)
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(parts_z["z_loss"], jnp.mean(lse**2), rtol=1e-6)
    np.testing.assert_allclose(with_z, expected + 1e-2 * jnp.mean(lse**2), rtol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([pq]), 10000.0)
        rk = apply_rope(k, jnp.array([pk]), 10000.0)
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-5)
    np.testing.assert_allclose(score(0, 0), float(jnp.sum(q * k)), rtol=1e-5)
    assert abs(score(5, 0) - score(0, 0)) > 1e-3


def tiny_model(**kw):
    c = default_config()
    c.model.update(dtype="float32", **kw)
    return Llama(LlamaConfig.from_config(c.model, "cpu"))


def test_decoder_is_causal_and_scan_equals_unrolled():
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 512)
    model = tiny_model()
    params = model.init(jax.random.key(1), tokens)
    logits = model.apply(params, tokens)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 512)
    logits2 = model.apply(params, changed)
    np.testing.assert_array_equal(logits[:, :10], logits2[:, :10])
    assert not np.allclose(logits[:, 10:], logits2[:, 10:])

    # The same weights laid out per layer give the same logits without scan, and under remat.
    unrolled = tiny_model(scan_layers=False, remat="full")
    p = dict(nn.meta.unbox(params)["params"])
    layers = p.pop("layers")
    for i in range(2):
        p[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], layers)
    np.testing.assert_allclose(unrolled.apply({"params": p}, tokens), logits, rtol=1e-5, atol=1e-5)


def test_flops_per_token_matches_baseline_convention():
    """TinyLlama-1.1B shape: 6 x 1,034,420,224 matmul params + 6 x 22 x 2048 x 2048."""
    c = default_config()
    c.model.update(
        num_layers=22, d_model=2048, num_heads=32, num_kv_heads=4, ffn_dim=5632, vocab_size=32000
    )
    cfg = LlamaConfig.from_config(c.model, "cpu")
    assert cfg.matmul_params() == 1_034_420_224
    assert cfg.flops_per_token(2048) == 6 * 1_034_420_224 + 6 * 22 * 2048 * 2048


@pytest.mark.parametrize("name, full", [("bert_tiny", True), ("gpt2_tiny", False)])
def test_flops_per_token_counts_bidirectional_attention_whole(name, full):
    """BERT attends to every position: QK^T and AV cost twice a causal model's (MFU and the
    remat and stage planners read these)."""
    from angel_jax.models.classic import ClassicConfig

    root = pathlib.Path(__file__).resolve().parents[1]
    model = load_config(str(root / f"configs/{name}.py")).model
    cfg, t = ClassicConfig.from_config(model, "cpu"), 128
    attention = (12 if full else 6) * cfg.num_layers * t * cfg.num_heads * cfg.head_dim
    assert cfg.flops_per_token(t) == 6 * cfg.matmul_params() + attention
    assert layer_flops(cfg, t)[1] == attention / 3 / cfg.num_layers


def test_cudnn_attention_off_gpu_is_a_config_error():
    c = default_config()
    c.model.attention = "cudnn"
    with pytest.raises(ConfigError, match="attention=cudnn needs a GPU"):
        LlamaConfig.from_config(c.model, "cpu")


def test_attention_policies_save_the_cudnn_forward_and_the_rings_results():
    """The policy matches cuDNN attention's forward as JAX's public attention binds it (by
    primitive name: pinned to JAX's names), not the core primitive the ring's blocks bind
    (their per-block results), and the ring's merged results by name."""
    from jax._src.ad_checkpoint import name_p
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from angel_jax.remat import ATTENTION_RESULTS, flash_attention_saveable

    assert flash_attention_saveable(cudnn._dot_product_attention_fwd_p_wrapper)
    assert not flash_attention_saveable(cudnn._dot_product_attention_fwd_p)
    assert not flash_attention_saveable(cudnn._dot_product_attention_bwd_p_wrapper)
    assert flash_attention_saveable(name_p, name=ATTENTION_RESULTS)
    assert not flash_attention_saveable(name_p, name="attn_out")
    assert not flash_attention_saveable(jax.lax.exp_p)
