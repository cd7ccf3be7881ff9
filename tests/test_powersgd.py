"""PowerSGD: rank-r averaging across data-parallel replicas, its error feedback, its bytes."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from angel_jax.optim.powersgd import PowerSGD, matrix_shape


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


def test_replicas_agree_on_a_projection_of_the_mean_and_keep_what_it_misses():
    psgd = PowerSGD(rank=2)
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jnp.zeros((64, 48)), "stack": jnp.zeros((3, 32, 40)), "scale": jnp.zeros(48)}
    stacked = {"w": False, "stack": True, "scale": False}
    grads = {
        k: jax.random.normal(keys[i], (8, *v.shape)) for i, (k, v) in enumerate(params.items())
    }
    state = psgd.init(params, stacked, 8, jax.random.key(1))
    assert state["scale"] is None and state["w"][0].shape == (48, 2)
    assert state["stack"][0].shape == (3, 40, 2)
    means, new = replicas_average(psgd, grads, state, stacked)
    exact = jax.tree.map(lambda g: g.mean(0), grads)
    # Every replica ends with the same result.
    for m in jax.tree.leaves(means):
        np.testing.assert_allclose(m, jnp.broadcast_to(m[0], m.shape), rtol=1e-6)
    np.testing.assert_allclose(means["scale"][0], exact["scale"], rtol=1e-6)  # Vectors: exact.
    for name in ("w", "stack"):
        approx, mean = means[name][0], exact[name]
        # A rank-2 projection of the mean: smaller than it, and not equal.
        assert float(jnp.linalg.norm(approx)) < float(jnp.linalg.norm(mean))
        assert (
            jnp.linalg.matrix_rank(
                approx.reshape(-1, approx.shape[-1]) if name == "w" else approx[0]
            )
            == 2
        )
        # Error feedback: each replica keeps its grad minus the agreed approximation.
        errors = new[name][1]
        np.testing.assert_allclose(errors, grads[name] - approx[None], rtol=1e-4, atol=1e-5)


def test_a_low_rank_mean_comes_through_exactly():
    psgd = PowerSGD(rank=2)
    u = jax.random.normal(jax.random.key(2), (8, 64, 1))
    v = jax.random.normal(jax.random.key(3), (1, 48))
    grads = {"w": u * v}  # Replica i: u_i v^T; the mean is rank 1.
    state = psgd.init({"w": jnp.zeros((64, 48))}, {"w": False}, 8, jax.random.key(4))
    means, _ = replicas_average(psgd, grads, state, {"w": False})
    np.testing.assert_allclose(means["w"][0], grads["w"].mean(0), rtol=1e-4, atol=1e-5)


def test_wire_numbers_count_the_factors():
    psgd = PowerSGD(rank=4)
    params = {"w": jnp.zeros((64, 48)), "stack": jnp.zeros((3, 32, 40)), "scale": jnp.zeros(48)}
    sent, full = psgd.wire_numbers(params, {"w": False, "stack": True, "scale": False})
    assert full == 64 * 48 + 3 * 32 * 40 + 48
    assert sent == 4 * (64 + 48) + 3 * 4 * (32 + 40) + 48
