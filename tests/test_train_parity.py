"""Sharded training equals single-device training (float32), and ZeRO shards what it says."""

import jax
import numpy as np
import pytest

from angel_jax import sharding
from angel_jax.config import default_config
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.planning.inputs import plan_input
from angel_jax.train import build


def small_config(zero_stage=1, microbatches=1, **overrides):
    c = default_config()
    c.model.update(
        num_layers=2,
        d_model=64,
        num_heads=8,
        num_kv_heads=4,
        ffn_dim=128,
        vocab_size=512,
        dtype="float32",
    )
    c.train.update(
        batch_size=16, seq_len=32, steps=10, warmup_steps=1, lr=1e-2, microbatches=microbatches
    )
    c.zero_stage = zero_stage
    for key, value in overrides.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


def run_steps(config, devices, steps=3):
    exp = build(config, make_mesh(config.mesh, devices))
    state = exp.init_state()
    init_params = jax.device_get(state.params)
    batches = make_batches(config)
    with sharding.use_rules(exp.mesh, exp.rules):
        metrics, grads = jax.jit(exp.grads.loss_and_grads)(
            state.params, exp.global_batch(batches[0])
        )
    grads = jax.device_get(grads)
    losses = []
    for i in range(steps):
        state, m = exp.train_step(state, exp.global_batch(batches[i]))
        losses.append(float(m["loss"]))
    return init_params, grads, losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(optimizer="adamw"):
        """One device, the whole batch at once (no accumulation), per optimizer."""
        if optimizer not in cache:
            c = small_config(mesh__data=1, train__optimizer=optimizer)
            cache[optimizer] = run_steps(c, jax.devices()[:1])
        return cache[optimizer]

    return get


CASES = {
    "data8": dict(mesh__data=8),
    "data2_tensor4": dict(mesh__data=2, mesh__tensor=4),  # 4 KV heads split 4 ways.
    "data4_tensor2_zero3": dict(zero_stage=3, mesh__data=4, mesh__tensor=2),
    "data8_zero0": dict(zero_stage=0, mesh__data=8),
    "data8_zero2": dict(zero_stage=2, mesh__data=8),
    "data2_tensor4_sp_zero3": dict(
        zero_stage=3, mesh__data=2, mesh__tensor=4, model__sequence_parallel=True
    ),
    "tensor8_kv_replicated": dict(mesh__data=1, mesh__tensor=8),  # 4 KV heads < 8 ranks.
    "data4_tensor2_microbatch4": dict(microbatches=4, zero_stage=2, mesh__data=4, mesh__tensor=2),
    "data4_tensor2_zero3_adafactor": dict(
        zero_stage=3, mesh__data=4, mesh__tensor=2, train__optimizer="adafactor"
    ),
    # ZeRO splits over context and sequence too (test_zero_splits_over_context_and_sequence).
    "data2_context2_sequence2_zero3": dict(
        zero_stage=3, mesh__data=2, mesh__context=2, mesh__sequence=2
    ),
    "data2_context4_zero2": dict(zero_stage=2, mesh__data=2, mesh__context=4),
}


@pytest.mark.parametrize("case", CASES)
def test_sharded_equals_single_device(case, reference):
    kwargs = dict(CASES[case])
    config = small_config(**kwargs)
    ref_init, ref_grads, ref_losses, ref_final = reference(config.train.optimizer)
    init, grads, losses, final = run_steps(config, jax.devices())
    # Initialisation does not depend on the layout (threefry_partitionable).
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), init, ref_init)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), grads, ref_grads
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # The steps did train.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), final, ref_final
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_splits_over_context_and_sequence(stage):
    """Ranks of `context` and `sequence` hold the same params as those of `data` and see other
    tokens: ZeRO splits the states over all three (8 ways on 2 x 2 x 2), as Megatron's
    distributed optimizer splits over data x context."""
    config = small_config(zero_stage=stage, mesh__data=2, mesh__context=2, mesh__sequence=2)
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    big = lambda tree: [x for x in jax.tree.leaves(tree) if x.size >= 4096]
    local = lambda tree: sum(x.addressable_shards[0].data.size for x in big(tree))
    total = lambda tree: sum(x.size for x in big(tree))
    assert local(state.opt_state) * 8 == total(state.opt_state)
    assert local(state.params) * (8 if stage == 3 else 1) == total(state.params)
    with sharding.use_rules(exp.mesh, exp.rules):
        _, grads = jax.jit(exp.grads.loss_and_grads)(
            state.params, exp.global_batch(make_batches(config)[0])
        )
    assert local(grads) * (8 if stage >= 2 else 1) == total(grads)
    # The planner splits them as the trainer does.
    assert plan_input(config, exp.mesh).zero_ranks == 8


def specs(tree):
    return [str(x.sharding.spec) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_layouts(stage):
    """Stage >= 1 shards optimizer state over data, >= 2 grads, 3 params."""
    config = small_config(zero_stage=stage, mesh__data=8)
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    big = lambda tree: [x for x in jax.tree.leaves(tree) if x.size >= 4096]
    assert all(("data" in str(x.sharding.spec)) == (stage >= 3) for x in big(state.params))
    assert all(("data" in str(x.sharding.spec)) == (stage >= 1) for x in big(state.opt_state))
    grad_specs = [str(s.spec) for s in jax.tree.leaves(exp.grad_sharding)]
    assert any("data" in s for s in grad_specs) == (stage >= 2)
    # Per-device bytes of the params shrink 8x under ZeRO-3.
    local = sum(x.addressable_shards[0].data.size for x in big(state.params))
    total = sum(x.size for x in big(state.params))
    assert local * (8 if stage == 3 else 1) == total

    batch = exp.global_batch(make_batches(config)[0])
    with sharding.use_rules(exp.mesh, exp.rules):
        hlo = jax.jit(exp.steps.update).lower(state, batch).compile().as_text()
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    if stage == 3:
        # Each layer's weights are gathered inside the layer loop, not all at once before it.
        assert any("while/body" in line for line in gathers)
    if jax.default_backend() == "gpu":  # XLA:CPU has no reduce-scatter rewrite.
        assert ("reduce-scatter" in hlo) == (stage >= 2)
    # The grads as the step makes them: each device holds 1/8 of them from stage 2 on.
    with sharding.use_rules(exp.mesh, exp.rules):
        _, grads = jax.jit(exp.grads.loss_and_grads)(state.params, batch)
    local = sum(x.addressable_shards[0].data.size for x in big(grads))
    assert local * (8 if stage >= 2 else 1) == sum(x.size for x in big(grads))
