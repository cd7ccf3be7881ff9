"""Ring attention (context) and Ulysses (sequence) equal attention on one device."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError
from angel_jax.parallel.attention import (
    sequence_parallel_attention,
    source_precedes,
    zigzag_order,
)
from tests.test_plan import ROOT, needs_cuda_compiler
from tests.test_train_parity import run_steps, small_config

AXES = ("data", "pipeline", "expert", "context", "sequence", "tensor")


def mesh_of(**sizes):
    shape = tuple(sizes.get(a, 1) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def inputs(batch=2, length=32, heads=4, kv_heads=2, head_dim=8, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    return q, k, v, do


def reference(q, k, v, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def check(mesh, spec, causal, dtype=jnp.float32, tol=2e-5, ring_blocks="xla", **shape):
    """Outputs and grads of the split attention (inputs in zigzag order when the ring is
    causal) against one-device attention in natural order."""
    q, k, v, do = inputs(dtype=dtype, **shape)
    length = q.shape[1]
    ring = "context" in (spec[1] if isinstance(spec[1], tuple) else (spec[1],))
    order = zigzag_order(length, mesh.shape["context"]) if ring and causal else np.arange(length)
    inverse = np.argsort(order)

    def split(q, k, v):
        place = lambda x: jax.device_put(x[:, order], NamedSharding(mesh, spec))
        out = sequence_parallel_attention(
            place(q), place(k), place(v), mesh, spec, causal=causal, ring_blocks=ring_blocks
        )
        return out[:, inverse]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    ref_out = reference(q, k, v, causal)
    out = jax.jit(split)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol
    )
    ref_grads = jax.grad(lambda *a: loss(lambda *b: reference(*b, causal), *a), (0, 1, 2))(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: loss(split, *a), (0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_ring_attention_equals_full_attention(causal, kv_heads):
    mesh = mesh_of(context=4, data=2)
    check(mesh, P("data", "context", None, None), causal, kv_heads=kv_heads)


@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_equals_full_attention(causal):
    mesh = mesh_of(sequence=4, data=2)
    check(mesh, P("data", "sequence", None, None), causal, kv_heads=4)
    # Two KV heads cannot split four ways: each query head gets its own copy.
    check(mesh, P("data", "sequence", None, None), causal, kv_heads=2)


@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_inside_ring_with_tensor_parallel_heads(causal):
    mesh = mesh_of(context=2, sequence=2, tensor=2)
    check(mesh, P(None, ("context", "sequence"), "tensor", None), causal, heads=8, kv_heads=4)


def test_ring_attention_in_bfloat16():
    mesh = mesh_of(context=8)
    check(mesh, P(None, "context", None, None), True, dtype=jnp.bfloat16, tol=3e-2, length=64)


def test_uneven_heads_are_refused():
    mesh = mesh_of(sequence=4, data=2)
    q, k, v, _ = inputs(heads=6, kv_heads=2)
    with pytest.raises(ConfigError, match=r"num_heads=6 is not divisible by .* 1 x 4"):
        sequence_parallel_attention(q, k, v, mesh, P("data", "sequence", None, None))
    with pytest.raises(ConfigError, match=r"seq_len=30 is not divisible by 2 x config.mesh"):
        zigzag_order(30, 4)


def test_zigzag_order_puts_chunks_i_and_2n_minus_1_minus_i_on_rank_i():
    order = zigzag_order(16, 4).reshape(4, 2, 2)  # ranks x its two chunks x chunk length
    for rank in range(4):
        assert order[rank, 0, 0] == 2 * rank and order[rank, 1, 0] == 2 * (7 - rank)


def test_zigzag_ring_steps_compute_exactly_the_visible_pairs_and_balance():
    """For every rank and ring step, the blocks the schedule picks cover exactly the (query,
    key) pairs the causal mask leaves visible between the rank's zigzag chunks and the source's,
    and every rank computes as many pairs as every other at each step. Without zigzag (rank i
    holding contiguous chunk i) rank i would do i + 1/2 chunk blocks of the N + 1/2 of its last
    rank."""
    n, c = 4, 3
    pos = zigzag_order(2 * n * c, n).reshape(n, 2 * c)  # Global positions per rank.
    for step in range(1, n):
        work = []
        for rank in range(n):
            src = (rank - step) % n
            visible = pos[rank][:, None] >= pos[src][None, :]  # (queries, keys)
            chosen = np.zeros_like(visible)
            if source_precedes(src, rank):
                chosen[:, :c] = True  # All queries x the source's first key chunk.
            else:
                chosen[c:, :] = True  # The second query chunk x both key chunks.
            np.testing.assert_array_equal(chosen, visible)
            work.append(chosen.sum())
        assert len(set(work)) == 1, work


@pytest.fixture(scope="module")
def one_device_run():
    return run_steps(small_config(mesh__data=1), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh",
    [
        dict(data=2, context=4),
        dict(data=2, sequence=4),
        dict(data=2, context=2, sequence=2),
        dict(context=2, sequence=2, tensor=2),
    ],
    ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()),
)
def test_training_with_a_split_sequence_equals_one_device(one_device_run, mesh):
    config = small_config(**{f"mesh__{a}": n for a, n in mesh.items()})
    _, grads, losses, params = run_steps(config, jax.devices())
    _, ref_grads, ref_losses, ref_params = one_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    jax.tree.map(close, grads, ref_grads)
    jax.tree.map(close, params, ref_params)


def test_sequence_split_errors_name_the_settings():
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    config = small_config(mesh__data=2, mesh__context=4, train__seq_len=36)
    with pytest.raises(ConfigError, match=r"seq_len=36 is not divisible by .*context"):
        build(config, make_mesh(config.mesh))
    config = small_config(
        mesh__data=2, mesh__sequence=4, model__num_heads=6, model__num_kv_heads=2, model__d_model=48
    )
    with pytest.raises(ConfigError, match=r"num_heads=6 is not divisible by .*sequence=4"):
        build(config, make_mesh(config.mesh))


@pytest.mark.parametrize(
    "mesh, tie",
    [(dict(data=8), False), (dict(data=2, context=2, tensor=2), True)],
    ids=["data8", "data2xcontext2xtensor2-tied"],
)
def test_chunked_logits_give_the_same_loss_and_grads(mesh, tie):
    """The LM head and loss a sequence slice at a time equal the whole-sequence ones."""
    axes = {f"mesh__{a}": n for a, n in mesh.items()}
    whole = small_config(**axes, model__tie_embeddings=tie, train__z_loss=1e-3)
    chunked = small_config(
        **axes, model__tie_embeddings=tie, train__z_loss=1e-3, model__logits_chunks=4
    )
    _, grads, losses, params = run_steps(chunked, jax.devices())
    _, ref_grads, ref_losses, ref_params = run_steps(whole, jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    jax.tree.map(close, grads, ref_grads)
    jax.tree.map(close, params, ref_params)


@pytest.mark.parametrize(
    "axis, collective", [("context", "collective-permute"), ("sequence", "all-to-all")]
)
def test_split_attention_moves_keys_and_values_by_its_collective_not_a_gather(axis, collective):
    """Ring attention passes K/V blocks around the ring, Ulysses exchanges heads for sequence:
    the compiled program holds that collective and no all-gather of the whole sequence."""
    mesh = mesh_of(data=2, **{axis: 4})
    spec = P("data", axis, None, None)
    place = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    q, k, v, _ = (place(x) for x in inputs(kv_heads=4))

    def attention(q, k, v):
        return sequence_parallel_attention(q, k, v, mesh, spec, causal=True, ring_blocks="xla")

    hlo = jax.jit(attention).lower(q, k, v).compile().as_text()
    assert f" {collective}(" in hlo or f" {collective}-start(" in hlo, collective
    assert " all-gather(" not in hlo and " all-gather-start(" not in hlo


def test_remat_attention_keeps_the_rings_results_instead_of_running_it_again():
    """remat=attention recomputes the layer as full does, but keeps the ring's merged output
    and log-sum-exp: the same grads, and the backward pass sends no K/V around the ring for a
    second forward (fewer collective-permutes in the compiled step: those of remat none)."""
    from angel_jax import sharding
    from angel_jax.data import make_batches
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    def compiled(remat):
        config = small_config(mesh__data=2, mesh__context=4, model__remat=remat)
        exp = build(config, make_mesh(config.mesh, jax.devices()))
        params = exp.init_state().params
        batch = exp.global_batch(make_batches(config)[0])
        with sharding.use_rules(exp.mesh, exp.rules):
            step = jax.jit(exp.grads.loss_and_grads)
            hlo = step.lower(params, batch).compile().as_text()
            _, grads = step(params, batch)
        sends = len(re.findall(r" collective-permute(?:-start)?\(", hlo))
        return sends, jax.device_get(grads)

    sends_full, grads_full = compiled("full")
    sends, grads = compiled("attention")
    sends_none, _ = compiled("none")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, grads_full
    )
    assert sends == sends_none < sends_full, (sends, sends_none, sends_full)


def activation_collectives(hlo: str, elements: int, within: str = "") -> list[tuple[str, str]]:
    """(kind, element type) of each all-gather, reduce-scatter and all-reduce in a compiled
    program that moves an activation of `elements` or more elements (from ops whose name
    holds `within`)."""
    found = []
    for line in (line for line in hlo.splitlines() if within in line):
        op = re.search(r"= \(*(\w+)\[([\d,]*)\][^=]*? (all-gather|reduce-scatter|all-reduce)", line)
        if op and math.prod(int(n) for n in op.group(2).split(",") if n) >= elements:
            found.append((op.group(3), op.group(1)))
    return found


@needs_cuda_compiler
@pytest.mark.parametrize("fp8", [False, True])
def test_megatron_sequence_parallel_gathers_bf16_and_reduce_scatters_the_grads(fp8):
    """Tensor parallel with sequence parallel, compiled for 8 GPUs: into attention and the MLP
    the norm's bf16 output is all-gathered (not the float32 before its cast, twice the bytes),
    under FP8 matmuls its e4m3 copy made on the split (`fp8.gather_quantized`: a bf16 gather
    had each rank cast all of it), and the row-parallel layers' output gradients in e5m2;
    back, the input gradient's partial sums are reduce-scattered (FP8's scaled dots made XLA
    all-reduce them whole, then slice). Only the GPU compiler has reduce-scatters."""
    from jax.experimental import topologies

    from angel_jax import machine
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    target = (ROOT / "experiments" / "gpu_targets" / "h100.txtpb").read_text()
    topology = topologies.get_topology_desc(
        "compile-only", "cuda", topology="1x1x8", target_config=target
    )
    config = small_config(
        mesh__data=1,
        mesh__tensor=8,
        model__sequence_parallel=True,
        model__num_heads=8,
        model__num_kv_heads=8,
        model__dtype="bfloat16",
        fp8__matmul=fp8,
    )
    machine.describe("gpu", 2**40, 1, machine.target_capability(target))
    try:
        exp = build(config, make_mesh(config.mesh, topology.devices), fit_compiled=False)
        hlo = exp.train_step.as_text()
    finally:
        machine.describe(None)
    t = config.train
    elements = t.batch_size * t.seq_len * config.model.d_model // 8
    moved = activation_collectives(hlo, elements)
    kinds = {kind for kind, _ in moved}
    assert kinds == {"all-gather", "reduce-scatter"}, moved
    in_layers = activation_collectives(hlo, elements, within="/layers/")
    gathered = {dtype for kind, dtype in in_layers if kind == "all-gather"}
    assert gathered == ({"f8e4m3fn", "f8e5m2"} if fp8 else {"bf16"}), in_layers


def test_regathers_backward_pins_the_gradient_to_the_split_layout_only():
    """The backward of `regather` is one constraint, to the split layout: the ranks' partial
    sums become a reduce-scatter on a GPU. Two plain constraints transpose to the whole
    layout first (an all-reduce), then the split one (a slice)."""
    from angel_jax import sharding
    from angel_jax.mesh import make_mesh

    config = small_config(mesh__data=2, mesh__tensor=4, model__sequence_parallel=True)
    mesh = make_mesh(config.mesh, jax.devices())
    split, whole = ("batch", "norm_length", "embed"), ("batch", "length", "embed")
    with sharding.use_rules(mesh, sharding.axis_rules(config, mesh)):
        _, backward = jax.vjp(lambda x: sharding.regather(x, split, whole), jnp.ones((4, 32, 8)))
        jaxpr = jax.make_jaxpr(backward)(jnp.ones((4, 32, 8)))
    specs = [
        tuple(e.params["sharding"].spec)
        for e in equations(jaxpr.jaxpr)
        if e.primitive.name == "sharding_constraint"
    ]
    assert specs == [("data", "tensor", None)], specs


def equations(jaxpr):
    """A jaxpr's equations, those of the jaxprs inside them included."""
    for e in jaxpr.eqns:
        yield e
        for value in e.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from equations(inner)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_the_loss_picks_target_logits_where_the_vocabulary_is_split(zero_stage):
    """With the vocabulary split over `tensor`, each rank picks the targets' logits from its
    own slice (`losses.target_logits`): the compiled step moves no logits between ranks. A
    gather (take_along_axis) there compiles to all-to-alls of the whole logits, forward and
    backward, and a different pick would change the loss."""
    from angel_jax.losses import target_logits
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    logits = jax.random.normal(jax.random.key(0), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(target_logits(logits, targets), picked)
    config = small_config(
        zero_stage=zero_stage,
        microbatches=2,
        mesh__data=2,
        mesh__tensor=2,
        model__sequence_parallel=True,
        model__dtype="bfloat16",
    )
    exp = build(config, make_mesh(config.mesh, jax.devices()[:4]), fit_compiled=False)
    assert "all-to-all" not in exp.train_step.as_text()


@needs_cuda_compiler
def test_zero3_gathers_the_lm_head_in_the_compute_dtype():
    """Under ZeRO-3 each param is cast on its stored split and gathered in bf16
    (`sharding.gather_param`). Unpinned, XLA gathered the float32 LM head of a 70B (8192 x
    64128 a tensor rank: 2 GiB a microbatch, twice the bf16 bytes) and cast it after."""
    import re

    from jax.experimental import topologies

    from angel_jax import machine, plan
    from angel_jax.config import load_config
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    target = (ROOT / "experiments" / "gpu_targets" / "h100.txtpb").read_text()
    topology = topologies.get_topology_desc(
        "compile-only", "cuda", topology="1x1x8", target_config=target
    )
    layout = plan.Layout(4, 2, 1, 1, 3, "dots_attention", 2)  # As the planner runs it.
    config = load_config(
        str(ROOT / "configs" / "llama3_70b.py"),
        [
            "--config.model.num_layers=2",
            "--config.train.batch_size=8",
            "--config.data.synthetic=true",
            "--config.offload.device_gib=75",  # An H100's budget (no device here).
            "--config.offload.activations=device",
            *layout.overrides(),
        ],
    )
    machine.describe("gpu", 2**40, 1, machine.target_capability(target))
    try:
        exp = build(config, make_mesh(config.mesh, topology.devices), fit_compiled=False)
        hlo = exp.steps.lowered().compile().as_text()
    finally:
        machine.describe(None)
    size = lambda array: math.prod(map(int, array[1].split(",")))
    big = set()
    for types in re.findall(r"= (.+?) all-gather(?:-start)?\(", hlo):  # The gathered side.
        gathered = max(re.findall(r"(\w+)\[([\d,]+)\]", types), key=size)
        if size(gathered) > 2**20:
            big.add(gathered)
    assert ("bf16", "8192,64128") in big, big
    assert all(dtype == "bf16" for dtype, _ in big), big
