"""Mixture of experts: routers' bookkeeping, and expert parallel equal to one device."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from angel_jax.layers.moe import MoE
from angel_jax.mesh import AXES
from angel_jax.parallel.expert import (
    capacity,
    combine,
    dispatch,
    route_expert_choice,
    route_topk,
)
from tests.hlo import collective_sizes


def mesh_of(**sizes):
    shape = tuple(sizes.get(a, 1) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def layer(router, k=2, factor=1.25, chunks=1):
    return MoE(
        8,
        k,
        32,
        router=router,
        capacity_factor=factor,
        dtype=jnp.float32,
        dispatch_chunks=chunks,
    )


def inputs(batch=8, length=16, d=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (batch, length, d), jnp.float32)


def test_topk_load_counts_every_assignment_and_drops_the_overflow():
    b, t, e, k = 4, 32, 8, 2
    logits = jax.random.normal(jax.random.key(1), (b, t, e))
    cap = capacity(t, e, k, 0.5)  # Half the even share: many assignments overflow.
    token_of_slot, weight, load, dropped = route_topk(logits, k, cap)
    assert float(jnp.sum(load)) == b * t * k  # Every token's two choices.
    filled = token_of_slot < t
    assert float(dropped) > 0 and int(jnp.sum(filled)) + float(dropped) == b * t * k
    # A token sits at most once in an expert's buffer, and empty slots weigh nothing.
    for g in range(b):
        for x in range(e):
            kept = np.asarray(token_of_slot[g, x * cap : (x + 1) * cap])
            kept = kept[kept < t]
            assert len(set(kept.tolist())) == len(kept)
    assert float(jnp.max(jnp.where(filled, 0.0, weight))) == 0.0
    # A token's kept weights are part of its renormalised top-k probabilities.
    per_token = jnp.zeros((b, t + 1)).at[jnp.arange(b)[:, None], token_of_slot].add(weight)
    assert float(jnp.max(per_token[:, :t])) <= 1.0 + 1e-6


def test_capacity_routers_equal_one_hot_dispatch():
    """The gather/scatter dispatch equals the textbook one-hot einsum formulation."""
    b, t, d, e, k = 2, 16, 8, 4, 2
    x = jax.random.normal(jax.random.key(2), (b, t, d))
    logits = jax.random.normal(jax.random.key(3), (b, t, e))
    cap = capacity(t, e, k, 1.0)
    for token_of_slot, weight, _, _ in (
        route_topk(logits, k, cap),
        route_expert_choice(logits, cap),
    ):
        c = token_of_slot.shape[1] // e
        one_hot = jax.nn.one_hot(token_of_slot, t).reshape(b, e, c, t)  # Empty slots: all 0.
        xs = dispatch(x, token_of_slot, e)
        np.testing.assert_allclose(xs, jnp.einsum("bect,btd->becd", one_hot, x), atol=1e-6)
        out = jax.random.normal(jax.random.key(4), xs.shape)
        ref = jnp.einsum("bect,bec,becd->btd", one_hot, weight.reshape(b, e, c), out)
        np.testing.assert_allclose(combine(out, token_of_slot, weight, t), ref, atol=1e-5)


def test_dropless_equals_topk_with_room_for_everything():
    """In value and grads (its permutations have hand-written gradients)."""
    x = inputs()
    params = layer("topk").init(jax.random.key(0), x)

    def loss(router, factor):
        def fn(params, x):
            y, stats = layer(router, factor=factor).apply(params, x)
            return jnp.sum(jnp.sin(y)), stats

        return jax.value_and_grad(fn, (0, 1), has_aux=True)

    (big, _), big_grads = loss("topk", 8.0)(params, x)  # Capacity = every assignment.
    (dropless, stats), grads = loss("dropless", 1.25)(params, x)
    np.testing.assert_allclose(dropless, big, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(big_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    assert float(jnp.sum(stats["expert_load"])) == 8 * 16 * 2 and float(stats["dropped"]) == 0


def test_dropless_moves_rows_by_gathers_not_scatters():
    """Autodiff of the sort's gathers would scatter-add (N*K, D) rows in the backward pass
    (slow on a GPU: atomics); the hand-written gradients gather."""
    x = inputs()
    moe = layer("dropless")
    params = moe.init(jax.random.key(0), x)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(moe.apply(p, x)[0]), (0, 1)))
    hlo = grad.lower(params, x).compile().as_text()
    rows, d = 8 * 16 * 2, x.shape[-1]  # Assignments (tokens x experts per token), features.
    scattered = re.findall(rf"= f32\[\d+,{d}\]\S* scatter\(", hlo)  # Into tokens or rows.
    gathered = re.findall(rf"= f32\[{rows},[\d,]+\]\S* gather\(", hlo)
    assert not scattered and len(gathered) >= 3, (scattered, gathered)


def test_dropless_backward_neither_saves_nor_recomputes_the_down_projection(capsys):
    """Router weights scale the hidden rows before the down projection, so under the dots
    remat policy, in a scan of layers as the model runs them, the compiled gradient runs six
    grouped matmuls a layer (forward, dX and dW of each projection) and keeps none of the
    experts' (M, D) outputs: weighting the outputs after it needs them in the backward, saved
    or recomputed (a seventh matmul). The sort's indices are kept (no sort in the backward)."""
    from angel_jax.remat import layer_policy

    x = inputs()
    moe = layer("dropless")
    stacked = jax.vmap(lambda key: moe.init(key, x))(jax.random.split(jax.random.key(0), 2))
    body = lambda h, p: (h + moe.apply(p, h)[0], None)
    policy = layer_policy("dots_no_batch", False)
    rematted = jax.checkpoint(body, policy=policy, prevent_cse=False)
    loss = lambda ps, x: jnp.sum(jnp.sin(jax.lax.scan(rematted, x, ps)[0]))
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(stacked, x).compile().as_text()
    rows, experts = 8 * 16 * 2, 8  # Assignments; XLA:CPU's ragged dots batch dW by expert.
    grouped = re.findall(rf"= f32\[({rows}|{experts}),[\d,]+\]\S* dot\(", hlo)
    assert len(grouped) == 6, grouped
    one_layer = jax.tree.map(lambda a: a[0], stacked)
    one_step = jax.checkpoint(lambda p, h: body(h, p)[0], policy=policy)
    jax.ad_checkpoint.print_saved_residuals(one_step, one_layer, x)
    saved = capsys.readouterr().out
    # The sorted input rows (M, D), gate+up output (M, 2F) and weighted hidden rows (M, F), and
    # no (M, D) output.
    kept = [f"f32[{rows},16]", f"f32[{rows},64]", f"f32[{rows},32]"]
    assert re.findall(rf"^f32\[{rows},\d+\]", saved, re.M) == kept, saved
    assert len(re.findall(rf"^i32\[{rows}\] named 'experts'", saved, re.M)) == 2, saved


@pytest.mark.parametrize("d", [16, 15])
def test_rows_gathered_as_words_equal_a_plain_gather(d):
    """bf16 rows move as 32-bit words (odd widths as they are): the same bits."""
    from angel_jax.parallel.expert import gather_rows

    x = jax.random.normal(jax.random.key(0), (32, d), jnp.bfloat16)
    idx = jax.random.randint(jax.random.key(1), (96,), 0, 32)
    np.testing.assert_array_equal(np.asarray(gather_rows(x, idx)), np.asarray(x[idx]))


RULES = {"batch": ("data", "expert"), "expert": "expert", "embed": None, "mlp": "tensor"}


@pytest.mark.parametrize(
    "router, k", [("topk", 1), ("topk", 2), ("expert_choice", 2), ("dropless", 2)]
)
@pytest.mark.parametrize(
    "mesh, chunks",
    [
        (dict(expert=8), 1),
        (dict(expert=4, data=2), 3),
        (dict(expert=2, tensor=2, data=2), 1),
        (dict(expert=2, tensor=4), 2),
    ],
)
def test_expert_parallel_equals_one_device(router, k, mesh, chunks):
    """Also with the buffers moved in chunks (padded: 3 does not divide the capacity) and with
    each tensor rank moving its share of them (expert-sequence parallel)."""
    mesh = mesh_of(**mesh)
    x = inputs()
    moe = layer(router, k=k, factor=1.0, chunks=chunks)  # Drops under topk.
    params = moe.init(jax.random.key(0), x)

    def loss(params, x, moe=moe):
        y, stats = moe.apply(params, x)
        return jnp.sum(jnp.sin(y)) + stats["load_balance_loss"] + stats["router_z_loss"], stats

    one_device = functools.partial(loss, moe=layer(router, k=k, factor=1.0))  # One chunk.
    (ref, ref_stats), ref_grads = jax.value_and_grad(one_device, has_aux=True)(params, x)
    rules = RULES
    specs = nn_specs(params, rules)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x_placed = jax.device_put(x, NamedSharding(mesh, P(rules["batch"])))
    with sharding.use_rules(mesh, rules):
        (out, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed, x_placed)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for key in ("expert_load", "dropped", "load_balance_loss", "router_z_loss"):
        np.testing.assert_allclose(stats[key], ref_stats[key], rtol=1e-5)
    if router == "topk" and k == 2:
        assert float(stats["dropped"]) > 0  # The capacity path was exercised.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, ref_grads
    )


def all_to_all_sizes(chunks):
    """Elements each all-to-all of a forward and backward moves per device, expert=2 x
    tensor=4."""
    mesh = mesh_of(expert=2, tensor=4)
    x = inputs()
    moe = layer("topk", k=2, factor=2.0, chunks=chunks)
    params = moe.init(jax.random.key(0), x)
    placed = jax.device_put(
        params, jax.tree.map(lambda s: NamedSharding(mesh, s), nn_specs(params, RULES))
    )
    x_placed = jax.device_put(x, NamedSharding(mesh, P(RULES["batch"])))
    grad = jax.grad(lambda params, x: jnp.sum(jnp.sin(moe.apply(params, x)[0])))
    with sharding.use_rules(mesh, RULES):
        hlo = jax.jit(grad).lower(placed, x_placed).compile().as_text()
    return collective_sizes(hlo)["all-to-all"]


def test_expert_sequence_parallel_and_chunks_split_the_all_to_alls():
    """With tensor=4 each all-to-all carries a quarter of the expert buffers (each tensor rank
    sends only its share of the slots, none sends what another one does); in 2 chunks, twice
    as many all-to-alls carry half as much each."""
    batch, length, d = inputs().shape
    slots = capacity(length, 8, 2, 2.0)  # Per expert and sequence: 8.
    share = batch // 2 * 8 * slots // 4 * d  # Local rows x experts x slots / tensor x d.
    one, two = all_to_all_sizes(1), all_to_all_sizes(2)
    assert len(one) >= 2 and set(one) == {share}, one
    assert len(two) == 2 * len(one) and set(two) == {share // 2}, two


def nn_specs(params, rules):
    from flax import linen as nn

    names = nn.get_partition_spec(params)
    return jax.tree.map(
        lambda spec: sharding.logical_to_spec(tuple(spec), rules),
        names,
        is_leaf=lambda s: isinstance(s, P),
    )


# Expert choice is left to the layer tests (exact there, for every layout): in training its
# cut flips between near-tied tokens with the layout's rounding, so only its losses compared,
# for 40 s of the suite's 15 minutes.
@pytest.mark.parametrize("router", ["topk", "dropless"])
def test_training_with_experts_split_over_devices_equals_one_expert_rank(router):
    """EP=4 against EP=1 on the same 8 devices (data parallel only): routing is a
    discontinuous choice, so the reference shares the batch split's float rounding."""
    from tests.test_train_parity import run_steps, small_config

    moe = dict(model__num_experts=8, model__moe_ffn_dim=32, model__router=router)
    moe.update(model__capacity_factor=1.0, model__shared_experts=1, zero_stage=3)
    _, ref_grads, ref_losses, ref_params = run_steps(
        small_config(mesh__data=8, **moe), jax.devices()
    )
    for mesh in (dict(mesh__data=2, mesh__expert=4),):
        _, grads, losses, params = run_steps(small_config(**mesh, **moe), jax.devices())
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
        jax.tree.map(close, grads, ref_grads)
        jax.tree.map(close, params, ref_params)


def test_expert_axis_errors_name_the_settings():
    from angel_jax.config import ConfigError, validate
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build
    from tests.test_train_parity import small_config

    config = small_config(mesh__data=2, mesh__expert=4)
    with pytest.raises(ConfigError, match="config.mesh.expert=4 needs a mixture-of-experts"):
        build(config, make_mesh(config.mesh))
    config = small_config(mesh__data=2, mesh__expert=4, model__num_experts=6)
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by config.mesh.expert"):
        build(config, make_mesh(config.mesh))
    with pytest.raises(ConfigError, match="moe_dispatch_chunks=0: use 1 or more"):
        validate(small_config(model__num_experts=8, model__moe_dispatch_chunks=0))


@pytest.mark.parametrize("router", ["topk", "expert_choice", "dropless"])
def test_expert_parallel_moves_tokens_by_the_router_s_collectives(router):
    """expert=8, one row per rank. Capacity routers send each expert its slots through
    all-to-alls (dispatch and combine, forward and backward: rows x experts x slots x d each)
    and gather nothing; dropless gathers the group's tokens (all B x T x D), applies its own
    experts and reduce-scatters the outputs back (T x D per rank), with no all-to-all."""
    mesh = mesh_of(expert=8)
    x = inputs()  # (8, 16, 16)
    moe = layer(router, k=2, factor=2.0)
    params = moe.init(jax.random.key(0), x)
    placed = jax.device_put(
        params, jax.tree.map(lambda s: NamedSharding(mesh, s), nn_specs(params, RULES))
    )
    x_placed = jax.device_put(x, NamedSharding(mesh, P(RULES["batch"])))
    grad = jax.grad(lambda p, x: jnp.sum(jnp.sin(moe.apply(p, x)[0])), argnums=(0, 1))
    with sharding.use_rules(mesh, RULES):
        sizes = collective_sizes(jax.jit(grad).lower(placed, x_placed).compile().as_text())
    b, t, d = x.shape
    if router == "dropless":
        assert "all-to-all" not in sizes, sizes
        assert b * t * d in sizes["all-gather"] and t * d in sizes["reduce-scatter"], sizes
    else:
        slots = capacity(t, 8, 2, 2.0)
        assert len(sizes["all-to-all"]) == 4 and set(sizes["all-to-all"]) == {8 * slots * d}
        assert "all-gather" not in sizes, sizes
