"""FP8: the block-quantization kernels against their references, FP8 collectives and their bytes
on the wire, and FP8 matmuls as FP8 dots in the program (and as cuBLAS FP8 GEMMs on a GPU)."""

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import fp8 as fp8_matmul
from angel_jax.config import ConfigError
from angel_jax.data import make_batches
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


def quantized(a, dtype):
    """numpy's per-tensor quantization of float32 a, as fp8.quantize defines it: (values, scale)."""
    a = np.asarray(a, np.float32)
    fmax = np.float32(jnp.finfo(dtype).max)
    scale = np.float32(np.abs(a).max()) / fmax
    q = np.clip(a * (np.float32(1) / scale), -fmax, fmax).astype(dtype).astype(np.float32)
    return q, scale


def test_fp8_matmul_is_the_dot_of_the_quantized_operands_forward_and_backward():
    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x, w = jax.random.normal(kx, (64, 256)), jax.random.normal(kw, (256, 128))
    g = jax.random.normal(kg, (64, 128))
    y8, vjp8 = jax.vjp(fp8_matmul.matmul, x, w)
    dx8, dw8 = vjp8(g)
    (xq, xs), (wq, ws), (gq, gs) = (
        quantized(x, fp8.E4M3),
        quantized(w, fp8.E4M3),
        quantized(g, fp8.E5M2),
    )
    # e4m3 x and w forward; e5m2 g against the forward's e4m3 copies backward; scales outside.
    np.testing.assert_allclose(y8, xq @ wq * (xs * ws), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx8, gq @ wq.T * (gs * ws), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw8, xq.T @ gq * (xs * gs), rtol=1e-5, atol=1e-4)
    # The error is FP8's (e4m3 rounds by up to 2^-4, e5m2 by 2^-3), far above bf16's or f16's.
    y, vjp = jax.vjp(jnp.matmul, x, w)
    error = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert 0.01 < error(y8, y) < 0.05
    for got, want in zip((dx8, dw8), vjp(g), strict=True):
        assert 0.02 < error(got, want) < 0.1


def dot_operand_types(lowered_text: str) -> collections.Counter:
    """(lhs, rhs) element types of the StableHLO dots of a lowered program, with counts."""
    return collections.Counter(
        re.findall(
            r"stablehlo.dot_general .*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\)",
            lowered_text,
        )
    )


def projections_per_layer(exp) -> int:
    return sum(
        1
        for path, _ in jax.tree_util.tree_leaves_with_path(exp.abstract_state.params["layers"])
        if jax.tree_util.keystr(path).endswith("['kernel']")
    )


E4, E5 = "f8E4M3FN", "f8E5M2"


@pytest.mark.parametrize("lm_head", [False, True])
def test_every_projection_of_the_train_step_is_an_fp8_dot(lm_head):
    """The lowered train step (before XLA's rewrites): one e4m3 x e4m3 dot per projection in
    the forward, and per projection an e5m2 x e4m3 (dx) and an e4m3 x e5m2 (dw) dot in the
    backward; with fp8.lm_head the head's three dots too. The scanned layer is lowered once."""
    config = small_config(fp8__matmul=True, fp8__lm_head=lm_head)
    config.model.update(dtype="bfloat16", remat="none")
    exp = build(config, make_mesh(config.mesh, jax.devices()))
    dots = dot_operand_types(exp.steps.lowered().as_text())
    n = projections_per_layer(exp) + lm_head
    assert projections_per_layer(exp) == 7  # query, key, value, out, gate, up, down.
    assert {pair: dots[pair] for pair in [(E4, E4), (E5, E4), (E4, E5)]} == {
        (E4, E4): n,
        (E5, E4): n,
        (E4, E5): n,
    }
    assert (E5, E5) not in dots  # No FP8 GEMM takes two e5m2 operands.
    config.fp8.update(matmul=False, lm_head=False)
    exp = build(config, make_mesh(config.mesh, jax.devices()))
    assert not any("f8" in a + b for a, b in dot_operand_types(exp.steps.lowered().as_text()))


def collective_elements(compiled_text: str) -> collections.Counter:
    """Elements by (collective, element type) in a compiled program (tuple results summed)."""
    counts = collections.Counter()
    for line in compiled_text.splitlines():
        op = re.search(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter)(?:-start)?\(", line)
        if op:
            result = line.split(op.group(0))[0]
            for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result):
                counts[op.group(1), dtype] += math.prod(int(d) for d in dims.split(",") if d)
    return counts


def test_fp8_matmuls_under_zero3_gather_each_weight_once_as_e4m3_bytes():
    """ZeRO-3 on 8 devices, bf16 compute: with FP8 matmuls and collectives, the projection
    weights are gathered as e4m3 bytes (1 byte an element against bf16's 2) and fed to the dot
    as gathered; the weights XLA gathers in the compute dtype drop by exactly those elements,
    and the grads come back through e5m2 all-to-alls."""
    gathered = {}
    for name, fp8_on in [("bf16", False), ("fp8", True)]:
        config = small_config(zero_stage=3, fp8__matmul=fp8_on, fp8__collectives=fp8_on)
        config.model.update(dtype="bfloat16", remat="none")
        config.mesh.data = 8
        exp = build(config, make_mesh(config.mesh, jax.devices()))
        gathered[name] = collective_elements(exp.steps.lowered().compile().as_text())
        per_layer = sum(
            math.prod(leaf.shape[1:])
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                exp.abstract_state.params["layers"]
            )
            if jax.tree_util.keystr(path).endswith("['kernel']")
        )
        if fp8_on:
            dots = dot_operand_types(exp.steps.lowered().as_text())
            assert dots[E4, E4] == projections_per_layer(exp)
    # XLA:CPU widens bf16 collectives to f32; on a GPU these gathers are bf16.
    widened = lambda counts: sum(
        n for (op, t), n in counts.items() if op == "all-gather" and t != "u8"
    )
    assert gathered["bf16"]["all-gather", "u8"] == 0
    assert gathered["fp8"]["all-gather", "u8"] == per_layer  # The scanned layer's, once.
    assert widened(gathered["bf16"]) - widened(gathered["fp8"]) == per_layer
    assert gathered["fp8"]["all-to-all", "u8"] > 0 and gathered["bf16"]["all-to-all", "u8"] == 0


def test_training_with_fp8_matmuls_and_collectives_tracks_the_exact_run():
    """ZeRO-3 on 8 devices: FP8 matmuls and FP8 gathers train like the exact run (within FP8
    rounding)."""
    losses = {}
    for name, fp8_overrides in [
        ("exact", {}),
        ("fp8", dict(fp8__matmul=True, fp8__collectives=True)),
    ]:
        config = small_config(zero_stage=3, **fp8_overrides)
        config.mesh.data = 8
        exp = build(config, make_mesh(config.mesh, jax.devices()))
        state, batches = exp.init_state(), make_batches(config)
        losses[name] = []
        for i in range(3):
            state, metrics = exp.train_step(state, exp.global_batch(batches[i]))
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["fp8"], losses["exact"], rtol=0.02)
    assert losses["fp8"] != losses["exact"]  # It did go through FP8.


def test_fp8_matmuls_under_sequence_parallel_equal_one_device():
    """Tensor 4 with sequence parallel: each norm output is quantized on its split and
    gathered in e4m3 (`fp8.gather_quantized`, one scale over the whole tensor), its gradient
    summed from the projections that share it. The losses and gradients are one device's FP8
    run's up to the reduction order (a quantized value may round the other way: 1e-3)."""
    from tests.test_train_parity import run_steps

    one = run_steps(small_config(mesh__data=1, fp8__matmul=True), jax.devices()[:1])
    config = small_config(
        mesh__data=2, mesh__tensor=4, model__sequence_parallel=True, fp8__matmul=True
    )
    _, grads, losses, _ = run_steps(config, jax.devices())
    np.testing.assert_allclose(losses, one[2], rtol=1e-3)
    relative = lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    assert max(jax.tree.leaves(jax.tree.map(relative, grads, one[1]))) < 1e-4


def test_fp8_collectives_need_zero3():
    with pytest.raises(ConfigError, match=r"config.fp8.collectives .* config.zero_stage=1"):
        build(small_config(fp8__collectives=True), make_mesh(small_config().mesh, jax.devices()))


def test_fp8_lm_head_needs_fp8_matmuls():
    with pytest.raises(ConfigError, match=r"config.fp8.lm_head .* config.fp8.matmul=true"):
        build(small_config(fp8__lm_head=True), make_mesh(small_config().mesh, jax.devices()))


def _no_fp8_gemms() -> str:
    if jax.default_backend() != "gpu":
        return f"no GPU (backend {jax.default_backend()})"
    capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
    return "" if capability >= 8.9 else f"compute capability {capability} has no FP8 GEMMs"


@pytest.mark.skipif(bool(_no_fp8_gemms()), reason=f"FP8 GEMMs cannot run here: {_no_fp8_gemms()}")
def test_fp8_matmul_compiles_to_cublas_fp8_gemms_forward_and_backward():
    """On Hopper and later: the forward dot and both backward dots are cuBLAS FP8 GEMMs, and
    no bf16 GEMM is left."""
    kx, kw = jax.random.split(jax.random.key(0))
    # A layer's size: on tiny shapes XLA's autotuner may pick its Triton FP8 GEMM instead.
    x = jax.random.normal(kx, (8, 2048, 2048), jnp.bfloat16)
    w = jax.random.normal(kw, (2048, 16, 128), jnp.bfloat16)  # Two output dims, as a query's.
    loss = lambda x, w: jnp.sum(fp8_matmul.matmul(x, w).astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    calls = collections.Counter(
        re.findall(r'custom_call_target="(__cublas\$lt\$matmul[^"]*)"', text)
    )
    assert calls == {"__cublas$lt$matmul$f8": 3}, calls
