"""FP8 block quantization: the Pallas kernels against their references, and error bounds."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError
from angel_jax.data import make_batches
from angel_jax.layers.linear import fp8_dot_general
from angel_jax.mesh import make_mesh
from angel_jax.parallel.fp8_collectives import all_gather_fp8, reduce_scatter_fp8
from angel_jax.train import build
from kernels_pallas import fp8
from tests.test_train_parity import small_config

# Half an ulp relative to the value, and half the smallest subnormal, of each format.
BOUNDS = {fp8.E4M3: (2.0**-4, 2.0**-10), fp8.E5M2: (2.0**-3, 2.0**-17)}


def rows(n=100, b=128, seed=0):
    """Rows with very different magnitudes, a zero row and exact zeros inside rows."""
    x = jax.random.normal(jax.random.key(seed), (n, b)) * jnp.logspace(-6, 4, n)[:, None]
    return x.at[3].set(0.0).at[:, 5].set(0.0)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_kernels_equal_references_and_error_is_bounded(dtype):
    x = rows()
    q, scale = fp8.quantize(x, dtype, rows=32)  # 100 rows: the last program is padded.
    q_ref, scale_ref = fp8.quantize_reference(x, dtype)
    assert q.dtype == dtype and scale.dtype == jnp.float32
    np.testing.assert_array_equal(q.astype(jnp.float32), q_ref.astype(jnp.float32))
    np.testing.assert_array_equal(scale, scale_ref)
    assert float(scale[3]) == 1.0 and not jnp.any(q[3].astype(jnp.float32))
    back = fp8.dequantize(q, scale, rows=32)
    np.testing.assert_array_equal(back, fp8.dequantize_reference(q, scale))
    relative, subnormal = BOUNDS[dtype]
    error = jnp.abs(back - x)
    assert bool(jnp.all(error <= relative * jnp.abs(x) + subnormal * scale[:, None]))
    # Each row's largest magnitude maps onto the format's largest value, exactly.
    np.testing.assert_allclose(
        jnp.max(jnp.abs(back), axis=1), jnp.max(jnp.abs(x), axis=1), rtol=1e-6
    )
    # And the bound is not loose: the worst error is within a factor 2 of it somewhere.
    assert float(jnp.max(error / (relative * jnp.abs(x) + subnormal * scale[:, None]))) > 0.5


def test_dequantize_sum_equals_reference_and_float32_sum():
    parts = jnp.stack([rows(seed=s) for s in range(4)])
    q, scale = jax.vmap(fp8.quantize_reference)(parts)
    total = fp8.dequantize_sum(q, scale, rows=32)
    # The same float32 sum up to the order of the additions.
    magnitude = jnp.sum(jnp.abs(q.astype(jnp.float32)) * scale[..., None], axis=0)
    assert bool(
        jnp.all(jnp.abs(total - fp8.dequantize_sum_reference(q, scale)) <= 1e-6 * magnitude)
    )
    # Summed in float32: four parts' rounding errors, no FP8 accumulation error on top.
    relative, subnormal = BOUNDS[fp8.E4M3]
    bound = jnp.sum(relative * jnp.abs(parts) + subnormal * scale[..., None], axis=0)
    assert bool(jnp.all(jnp.abs(total - parts.sum(0)) <= bound * (1 + 1e-5)))


def test_blocks_round_trip_any_shape():
    x = jnp.arange(3 * 5 * 7, dtype=jnp.float32).reshape(3, 5, 7)
    blocks = fp8.to_blocks(x, 16)
    assert blocks.shape == (7, 16)
    np.testing.assert_array_equal(fp8.from_blocks(blocks, x.shape), x)


def ranks(n=8):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def over_data(fn, mesh, inputs=1):
    """fn per rank, every input and the output split over `data`."""
    specs = dict(in_specs=(P("data"),) * inputs, out_specs=P("data"), check_vma=False)
    return jax.jit(jax.shard_map(fn, mesh=mesh, **specs))


def test_fp8_all_gather_and_its_gradient_match_bf16_within_fp8_error():
    mesh = ranks()
    x = jax.random.normal(jax.random.key(0), (8 * 4, 96), jnp.float32)  # 4 rows per rank.
    w = jax.random.normal(jax.random.key(1), (8 * 32, 96), jnp.float32)  # Rank r's w: 32 rows.

    def loss(gather):  # Each rank weighs the whole gathered x with its own w.
        per_rank = lambda x, w: jnp.sum(gather(x, "data") * w)[None]
        return lambda x: jnp.sum(over_data(per_rank, mesh, inputs=2)(x, w))

    exact = lambda x, name: jax.lax.all_gather(x, name, axis=0, tiled=True)
    gathered = over_data(lambda x: all_gather_fp8(x, "data")[None], mesh)(x)
    relative, _ = BOUNDS[fp8.E4M3]
    # Every rank holds the whole array, each element within e4m3's rounding of the exact one.
    for full in gathered:
        assert bool(jnp.all(jnp.abs(full - x) <= relative * jnp.abs(x)))
    # The gradient, sum over ranks of their w, comes back reduce-scattered in e5m2.
    g_fp8, g_exact = jax.grad(loss(all_gather_fp8))(x), jax.grad(loss(exact))(x)
    bound = BOUNDS[fp8.E5M2][0] * jnp.sum(jnp.abs(w.reshape(8, 32, 96)), axis=0)
    assert bool(jnp.all(jnp.abs(g_fp8 - g_exact) <= bound + 1e-6))
    assert float(jnp.max(jnp.abs(g_fp8 - g_exact))) > 0  # It did go through FP8.


def test_fp8_reduce_scatter_sums_in_float32_within_fp8_error():
    mesh = ranks()
    x = jax.random.normal(jax.random.key(2), (8, 8 * 16, 64), jnp.float32)  # Rank r's x[r].
    rs = lambda fn: over_data(lambda x: fn(x[0], "data")[None], mesh)(x)
    got = rs(lambda x, name: reduce_scatter_fp8(x, name)).reshape(8 * 16, 64)
    want = rs(lambda x, name: jax.lax.psum_scatter(x, name, tiled=True)).reshape(8 * 16, 64)
    relative, _ = BOUNDS[fp8.E5M2]
    bound = relative * jnp.sum(jnp.abs(x), axis=0)  # Each rank's part rounded once, then summed.
    assert bool(jnp.all(jnp.abs(got - want) <= bound + 1e-6))


def wire_bytes(lowered_text: str) -> int:
    """Bytes of the results of a lowered program's all-gathers and all-to-alls, as the program
    asks for them (XLA:CPU then widens bf16 collectives to f32; GPUs send bf16 as it is)."""
    sizes = {"ui8": 1, "bf16": 2, "f32": 4}
    total = 0
    for line in lowered_text.splitlines():
        if "stablehlo.all_gather" in line or "stablehlo.all_to_all" in line:
            dims, dtype = re.search(r"-> tensor<([\dx]+)x(\w+)>", line).groups()
            total += math.prod(int(d) for d in dims.split("x")) * sizes[dtype]
    return total


def test_fp8_collectives_halve_the_bytes_on_the_wire():
    mesh = ranks()
    x = jax.ShapeDtypeStruct((8 * 64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    n = 8 * 64 * 1024
    gathers = over_data(lambda x: all_gather_fp8(x, "data")[None], mesh)
    bf16 = over_data(lambda x: jax.lax.all_gather(x, "data", tiled=True)[None], mesh)
    assert wire_bytes(bf16.lower(x).as_text()) == 2 * n
    # One byte per element and a float32 scale per 128: 1.03 bytes against 2.
    assert wire_bytes(gathers.lower(x).as_text()) == n * (1 + 4 / 128)
    # Out and back: the gradient returns through an all-to-all of e5m2 bytes.
    grads = jax.jit(jax.grad(lambda x: jnp.sum(gathers(x).astype(jnp.float32) ** 2)))
    assert wire_bytes(grads.lower(x).as_text()) == 2 * n * (1 + 4 / 128)
    # The compiled program keeps them bytes: only u8 and the f32 scales are gathered.
    compiled = gathers.lower(x).compile().as_text()
    kinds = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} all-gather\(", compiled)
    assert sorted(kinds) == ["f32", "u8"]


def test_fp8_matmul_and_its_grads_stay_close_to_the_exact_ones():
    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x, w = jax.random.normal(kx, (64, 256)), jax.random.normal(kw, (256, 128))
    g = jax.random.normal(kg, (64, 128))
    dims = (((1,), (0,)), ((), ()))
    y8, vjp8 = jax.vjp(lambda x, w: fp8_dot_general(x, w, dims), x, w)
    y, vjp = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, dims), x, w)
    error = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    # e4m3 rounds each input by up to 2^-4 relative; independent roundings average down.
    assert 0 < error(y8, y) < 0.05
    for got, want in zip(vjp8(g), vjp(g), strict=True):  # e5m2 on g: up to 2^-3.
        assert 0 < error(got, want) < 0.1


def test_training_with_fp8_matmuls_and_collectives_tracks_the_exact_run():
    """ZeRO-3 on 8 devices: FP8 matmuls and FP8 gathers train like the exact run (within FP8
    rounding), and the step's param gathers carry bytes, not the compute dtype."""
    losses = {}
    for name, fp8_overrides in [
        ("exact", {}),
        ("fp8", dict(fp8__matmul=True, fp8__collectives=True)),
    ]:
        config = small_config(zero_stage=3, **fp8_overrides)
        config.mesh.data = 8
        exp = build(config, make_mesh(config.mesh, jax.devices()))
        if name == "fp8":
            compiled = exp.train_step.as_text()
            gathered = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} all-gather\(", compiled)
            # The projection weights (7 per layer) come as u8, with their f32 scales.
            assert gathered.count("u8") >= 7 and "bf16" not in gathered
        state, batches = exp.init_state(), make_batches(config)
        losses[name] = []
        for i in range(3):
            state, metrics = exp.train_step(state, exp.global_batch(batches[i]))
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["fp8"], losses["exact"], rtol=0.02)
    assert losses["fp8"] != losses["exact"]  # It did go through FP8.


def test_fp8_collectives_need_zero3():
    with pytest.raises(ConfigError, match=r"config.fp8.collectives .* config.zero_stage=1"):
        build(small_config(fp8__collectives=True), make_mesh(small_config().mesh, jax.devices()))
