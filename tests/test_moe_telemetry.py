"""A mixture of experts' telemetry in metrics.jsonl and TensorBoard: per layer, tokens per expert
(the step's, over its microbatches), the load's max over mean, dropped tokens, the router's
entropy and z-loss."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import load_config
from angel_jax.layers.moe import router_losses
from angel_jax.loop import train_loop
from tests.runs import ROOT

BATCH, SEQ, LAYERS, EXPERTS, K = 16, 32, 2, 8, 2


def run(tmp_path, router, tensorboard=False):
    config = load_config(
        str(ROOT / "configs" / "mixtral_tiny.py"),
        [
            f"--config.model.router={router}",
            f"--config.model.num_layers={LAYERS}",
            "--config.model.d_model=64",
            "--config.model.moe_ffn_dim=64",
            "--config.mesh.data=2",
            "--config.mesh.expert=4",
            "--config.train.steps=2",
            f"--config.train.batch_size={BATCH}",
            f"--config.train.seq_len={SEQ}",
            "--config.train.microbatches=2",
            "--config.train.log_every_steps=1",
            f"--config.train.tensorboard={str(tensorboard).lower()}",
            "--config.checkpoint.every_steps=0",
        ],
    )
    train_loop(config, str(tmp_path))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_topk_load_counts_every_assignment_of_the_step(tmp_path):
    for r in run(tmp_path, "topk", tensorboard=True):
        load = np.asarray(r["moe_tokens_per_expert"])
        assert load.shape == (LAYERS, EXPERTS)
        # Every token's K assignments of both microbatches, routed or dropped.
        assert load.sum(axis=1).tolist() == [BATCH * SEQ * K] * LAYERS
        np.testing.assert_allclose(r["moe_load_max_over_mean"], load.max(1) / load.mean(1))
        dropped = np.asarray(r["moe_dropped_tokens"])
        assert dropped.shape == (LAYERS,) and dropped.sum() > 0  # Capacity 1.25 drops some.
        assert dropped.sum() / load.sum() == pytest.approx(r["dropped_fraction"], rel=1e-5)
        assert all(0 < h <= math.log(EXPERTS) + 1e-5 for h in r["moe_router_entropy"])
        assert np.mean(r["moe_router_z_loss"]) == pytest.approx(r["router_z_loss"], rel=1e-5)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    tags = b"".join(e.read_bytes() for e in events)
    for tag in ("moe_load_max_over_mean/layer_01", "moe_tokens_per_expert/layer_00"):
        assert tag.encode() in tags


def test_dropless_drops_nothing(tmp_path):
    for r in run(tmp_path, "dropless"):
        assert r["moe_dropped_tokens"] == [0] * LAYERS
        assert np.sum(r["moe_tokens_per_expert"]) == LAYERS * BATCH * SEQ * K


def test_router_entropy_bounds():
    load = jnp.ones(EXPERTS)
    *_, undecided = router_losses(jnp.zeros((2, 3, EXPERTS)), load)
    *_, sure = router_losses(jnp.eye(EXPERTS)[None] * 100.0, load)
    # Probabilities 1/2, 1/4, 1/4 (the rest ~0): -sum p log p = 1.5 log 2.
    logits = jnp.log(jnp.array([0.5, 0.25, 0.25] + [1e-30] * (EXPERTS - 3)))
    *_, halves = router_losses(logits[None, None], load)
    assert float(undecided) == pytest.approx(math.log(EXPERTS), rel=1e-6)
    assert float(sure) == pytest.approx(0.0, abs=1e-3)
    assert float(halves) == pytest.approx(1.5 * math.log(2), rel=1e-5)
