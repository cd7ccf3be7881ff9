"""PowerSGD: rank-r averaging across data-parallel replicas, its error feedback, its bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError, validate
from angel_jax.optim.powersgd import PowerSGD, matrix_shape
from tests.test_train_parity import run_steps, small_config


def test_matrix_view_is_the_most_square_split():
    assert matrix_shape((2048, 32, 64)) == (2048, 2048)
    assert matrix_shape((32, 64, 2048)) == (2048, 2048)
    assert matrix_shape((5632, 2048)) == (5632, 2048)


def replicas_average(psgd, grads, state, stacked):
    """`psgd.average` on 8 replicas: rank i's grads are grads[i] (a leading replica axis)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_replica(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        mean, s = psgd.average(g, s, stacked)
        return jax.tree.map(lambda x: x[None], mean), s

    spec = lambda tree: jax.tree.map(lambda _: P("data"), tree)
    q_spec = jax.tree.map(
        lambda s: None if s is None else (P(), P("data")),
        state,
        is_leaf=lambda x: x is None or isinstance(x, tuple),
    )
    step = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(spec(grads), q_spec),
        out_specs=(spec(grads), q_spec),
        check_vma=False,
    )
    return jax.jit(step)(grads, state)


PARAMS = {"embed": jnp.zeros((64, 48)), "stack": jnp.zeros((3, 32, 40)), "norm": jnp.zeros((3, 40))}
STACKED = {"embed": False, "stack": True, "norm": True}


def test_replicas_agree_on_a_projection_of_the_mean_and_keep_what_it_misses():
    psgd = PowerSGD(rank=2)
    keys = jax.random.split(jax.random.key(0), 3)
    grads = {
        k: jax.random.normal(keys[i], (8, *v.shape)) for i, (k, v) in enumerate(PARAMS.items())
    }
    state = psgd.init(PARAMS, STACKED, 8, jax.random.key(1))
    assert state["embed"] is None and state["norm"] is None  # Averaged exactly.
    assert state["stack"][0].shape == (3, 40, 2) and state["stack"][1].shape == (8, 3, 32, 40)
    means, new = replicas_average(psgd, grads, state, STACKED)
    exact = jax.tree.map(lambda g: g.mean(0), grads)
    # Every replica ends with the same result.
    for m in jax.tree.leaves(means):
        np.testing.assert_allclose(m, jnp.broadcast_to(m[0], m.shape), rtol=1e-6)
    for name in ("embed", "norm"):
        np.testing.assert_allclose(means[name][0], exact[name], rtol=1e-5, atol=1e-6)
    for layer in range(3):  # Each layer's matrix: a rank-2 projection of its mean.
        approx, mean = means["stack"][0, layer], exact["stack"][layer]
        assert float(jnp.linalg.norm(approx)) < float(jnp.linalg.norm(mean))
        assert int(jnp.linalg.matrix_rank(approx)) == 2
    # Error feedback: each replica keeps its grad minus the agreed approximation.
    errors = new["stack"][1]
    np.testing.assert_allclose(errors, grads["stack"] - means["stack"][:1], rtol=1e-4, atol=1e-5)


def test_a_low_rank_mean_comes_through_exactly():
    psgd = PowerSGD(rank=2)
    u = jax.random.normal(jax.random.key(2), (8, 1, 64, 1))
    v = jax.random.normal(jax.random.key(3), (1, 1, 1, 48))
    grads = {"w": u * v}  # Replica i: u_i v^T; the mean is rank 1.
    state = psgd.init({"w": jnp.zeros((1, 64, 48))}, {"w": True}, 8, jax.random.key(4))
    means, _ = replicas_average(psgd, grads, state, {"w": True})
    np.testing.assert_allclose(means["w"][0], grads["w"].mean(0), rtol=1e-4, atol=1e-5)


def test_wire_numbers_count_the_factors():
    psgd = PowerSGD(rank=4)
    sent, full = psgd.wire_numbers(PARAMS, STACKED)
    assert full == 64 * 48 + 3 * 32 * 40 + 3 * 40
    assert sent == 64 * 48 + 3 * 4 * (32 + 40) + 3 * 40


def test_training_with_powersgd_stays_near_the_exact_average():
    """Data parallel on 8 devices: exact averaging before the start step, then rank 8 (of
    32-64 wide matrices) trains like the exact average."""
    losses = {}
    for rank in (0, 8):
        config = small_config(zero_stage=0, train__powersgd_rank=rank)
        config.train.powersgd_start_step = 2
        config.mesh.data = 8
        _, _, losses[rank], _ = run_steps(config, jax.devices(), steps=4)
    # Steps 0 and 1 averaged exactly: the losses after them are the exact run's.
    np.testing.assert_allclose(losses[8][:3], losses[0][:3], rtol=1e-5)
    np.testing.assert_allclose(losses[8], losses[0], rtol=0.02)
    assert losses[8][3] != losses[0][3]  # Step 2 went through the factors.


def test_powersgd_errors_name_what_it_needs():
    for overrides in (dict(zero_stage=3), dict(mesh__tensor=2), dict(offload__policy="optimizer")):
        zero = overrides.pop("zero_stage", 0)
        config = small_config(zero_stage=zero, train__powersgd_rank=4, **overrides)
        with pytest.raises(ConfigError, match="config.train.powersgd_rank=4"):
            validate(config)
