"""Pipeline parallelism: schedule tables, stage layout and balance, and every schedule's loss
and grads against the model without a pipeline (float32, 8 emulated devices)."""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax import sharding
from angel_jax.config import ConfigError, load_config
from angel_jax.data import make_batches
from angel_jax.mesh import CONTEXT, make_mesh
from angel_jax.models.llama import LlamaConfig, decoder_layer
from angel_jax.parallel.pipeline import (
    IDLE,
    Residuals,
    StageLayout,
    make_schedule,
    theoretical_bubble,
)
from angel_jax.planning.inputs import plan_input
from angel_jax.planning.memory import saved_values
from angel_jax.planning.stage_plan import balance_layers, effective_remat, make_pipeline_plan
from angel_jax.remat import REMATS, STAGE_REMATS
from angel_jax.train import build
from tests.hlo import collective_sizes
from tests.test_train_parity import small_config

LAYERS = 6  # Uneven over 4 stages, and over 2 x 2 virtual ones.


@pytest.mark.parametrize(
    "name, stages, microbatches, virtual",
    [
        ("gpipe", 2, 4, 1),
        ("gpipe", 4, 8, 1),
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 16, 1),
        ("1f1b", 2, 4, 2),  # Interleaved 1F1B.
        ("1f1b", 4, 16, 5),
        ("circular", 2, 4, 2),
        ("circular", 4, 8, 3),
    ],
)
def test_schedule_runs_every_item_once_in_order_with_the_theoretical_bubble(
    name, stages, microbatches, virtual
):
    p, m, v = stages, microbatches, virtual
    sched = make_schedule(name, p, m, v)
    f_tick, b_tick = {}, {}
    for table, ticks in ((sched.forward, f_tick), (sched.backward, b_tick)):
        for t, s in zip(*np.nonzero(table[..., 0] != IDLE), strict=True):
            mb, chunk, _ = table[t, s]
            key = (mb, chunk * p + s)  # (microbatch, global chunk)
            assert key not in ticks
            ticks[key] = t
    chunks = p * v
    assert set(f_tick) == set(b_tick) == {(j, k) for j in range(m) for k in range(chunks)}
    for j in range(m):
        for k in range(1, chunks):  # An activation is used the tick after it was sent.
            assert f_tick[j, k] == f_tick[j, k - 1] + 1
            assert b_tick[j, k - 1] == b_tick[j, k] + 1
        assert b_tick[j, chunks - 1] >= f_tick[j, chunks - 1]  # F before B within a tick.
    # Whatever F and B cost, the idle share is the theory's.
    for backward_cost in (1.0, 2.0, 3.0):
        assert sched.bubble(1.0, backward_cost) == pytest.approx(theoretical_bubble(p, m, v))
    # The live inputs: GPipe keeps every microbatch's; 1F1B at most 2(p - s) - 1 on stage s,
    # interleaved (v > 1) Megatron's count, (v - 1) p warm-up items more.
    live = sched.live().max(axis=0)
    if name == "1f1b":
        assert list(live) == [min(2 * (p - s) - 1 + (v - 1) * p, v * m) for s in range(p)]
    else:
        assert list(live) == [v * m] * p
    assert sched.slots == live.max()


def test_stage_layout_round_trips_uneven_chunks():
    layout = StageLayout(stages=2, virtual=2, layers_per_chunk=(3, 2, 1, 1))
    x = np.arange(7 * 5, dtype=np.float32).reshape(7, 5) + 1
    stored = np.asarray(layout.to_stages(x))
    assert stored.shape == (2 * 2 * 3, 5)
    # Stage 0 holds chunks 0 and 2, stage 1 chunks 1 and 3; padding slots are zero.
    assert [int(r[0] // 5) if r[0] else -1 for r in stored] == [
        *(0, 1, 2),
        *(5, -1, -1),
        *(3, 4, -1),
        *(6, -1, -1),
    ]
    np.testing.assert_array_equal(layout.from_stages(stored), x)
    assert layout.mask().sum(axis=1).tolist() == [3, 1, 2, 1]


def test_balance_minimises_the_cost():
    costliest = lambda first, last: lambda c: max(c[0] + first, *c[1:-1], c[-1] + last)
    assert balance_layers(22, 2, costliest(0, 0)) == (11, 11)
    assert balance_layers(22, 2, costliest(0, 3)) == (12, 10)  # 12 vs 13: the smaller chunk.
    assert balance_layers(10, 4, costliest(1, 2)) == (2, 3, 3, 2)


def llama_1b_plan(balance, stages, context=1):
    config = load_config(
        str(pathlib.Path(__file__).parents[1] / "configs/llama_1b.py"),
        [f"--config.pipeline.balance={balance}", "--config.pipeline.microbatches=8"],
    )
    cfg = LlamaConfig.from_config(config.model, "cpu")
    shape = dict(data=1, pipeline=stages, expert=1, context=context, sequence=1, tensor=1)
    return make_pipeline_plan(plan_input(config, shape, cfg, budget={}), cfg)


def test_llama_1b_balanced_plan_beats_the_even_split():
    even, auto = llama_1b_plan("even", 4), llama_1b_plan("auto", 4)
    assert even.layout.layers_per_chunk == (6, 6, 5, 5)
    # The last stage also runs the head and the loss (and its B recomputes the head), so it
    # takes fewer layers.
    assert auto.layout.layers_per_chunk == (6, 6, 6, 4)
    assert auto.step_flops() < 0.97 * even.step_flops()
    lines = auto.table().splitlines()
    assert lines[1].split()[:3] == ["0", "+embed", "6"]
    assert lines[4].split()[:3] == ["3", "+head", "4"]
    assert "bubble 0.273" in lines[5]  # (p - 1) / (m + p - 1) with p = 4, m = 8.
    # On two stages the head is worth about two layers.
    assert llama_1b_plan("auto", 2).layout.layers_per_chunk == (12, 10)
    assert llama_1b_plan("auto", 2).step_flops() < llama_1b_plan("even", 2).step_flops()
    assert llama_1b_plan("10,12", 2).step_flops() > llama_1b_plan("even", 2).step_flops()
    # With ring attention inside the stages their padded slots run: no split beats the even one.
    assert llama_1b_plan("auto", 2, context=2).layout.layers_per_chunk == (11, 11)


def loss_and_grads(config, devices):
    """Metrics and grads of one batch, the layers' grads in the model's (layers, ...) order."""
    exp = build(config, make_mesh(config.mesh, devices))
    state = exp.init_state()
    batch = exp.global_batch(make_batches(config)[0])
    with sharding.use_rules(exp.mesh, exp.rules):
        metrics, grads = jax.jit(exp.grads.loss_and_grads)(state.params, batch)
    metrics, grads = jax.device_get((metrics, grads))
    if exp.pipeline:
        padding = exp.pipeline.layout.slot_layer < 0
        for stored in jax.tree.leaves(grads["layers"]):
            assert not stored[padding].any()  # So padded slots stay zero.
        grads["layers"] = jax.tree.map(exp.pipeline.layout.from_stages, grads["layers"])
    return exp, metrics, grads


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(small_config(mesh__data=1, model__num_layers=LAYERS), jax.devices()[:1])


CASES = {
    "p2_gpipe_remat_full": dict(
        mesh__pipeline=2, mesh__data=4, pipeline__schedule="gpipe", pipeline__remat="full"
    ),
    "p2_1f1b_data2_tensor2_zero3": dict(
        zero_stage=3, mesh__pipeline=2, mesh__data=2, mesh__tensor=2, pipeline__schedule="1f1b"
    ),
    "p2x2_circular_data2_tensor2_sequence_parallel": dict(
        mesh__pipeline=2,
        mesh__data=2,
        mesh__tensor=2,
        model__sequence_parallel=True,
        pipeline__schedule="circular",
        pipeline__virtual_stages=2,
    ),
    "p4_1f1b_uneven_data2": dict(
        mesh__pipeline=4, mesh__data=2, pipeline__schedule="1f1b", pipeline__microbatches=8
    ),
    "p4_gpipe_uneven_tensor2_dots_no_batch": dict(
        mesh__pipeline=4,
        mesh__data=1,
        mesh__tensor=2,
        pipeline__schedule="gpipe",
        pipeline__remat="dots_no_batch",
    ),
    "p2_1f1b_sequence2_data2": dict(
        mesh__pipeline=2, mesh__data=2, mesh__sequence=2, pipeline__schedule="1f1b"
    ),
    # Ring attention inside the stages; 4 + 2 layers: padded slots run (zero weights).
    "p2_gpipe_context2_data2_uneven": dict(
        mesh__pipeline=2,
        mesh__data=2,
        mesh__context=2,
        pipeline__schedule="gpipe",
        pipeline__balance="4,2",
    ),
    "p2x2_interleaved_1f1b_context2_data2": dict(
        mesh__pipeline=2,
        mesh__data=2,
        mesh__context=2,
        pipeline__schedule="1f1b",
        pipeline__virtual_stages=2,
        pipeline__microbatches=4,
    ),
    "p2_1f1b_context2_tensor2_sequence_parallel": dict(
        mesh__pipeline=2,
        mesh__data=1,
        mesh__context=2,
        mesh__tensor=2,
        model__sequence_parallel=True,
        pipeline__schedule="1f1b",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_pipeline_equals_the_model_without_one(case, reference):
    _, ref_metrics, ref_grads = reference
    config = small_config(model__num_layers=LAYERS, **{"pipeline__balance": "even", **CASES[case]})
    exp, metrics, grads = loss_and_grads(config, jax.devices())
    counts = exp.pipeline.layout.layers_per_chunk
    assert len(counts) == config.mesh.pipeline * config.pipeline.virtual_stages
    if len(counts) == 4 or config.pipeline.balance != "even":
        assert max(counts) > min(counts)  # Padded slots: skipped, or run on zero weights.
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["z_loss"], ref_metrics["z_loss"], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), grads, ref_grads
    )


def layer_residuals(remat: str, context: int = 1):
    """(layer config, batch, length, what one bf16 layer keeps from its forward for its
    backward under `remat`, the `Residuals` that recorded where each came from); with
    `context` > 1, a ring's layer (data=2 x context on 2 x context devices)."""
    mesh = dict(mesh__data=2, mesh__context=context) if context > 1 else {}
    config = small_config(model__dtype="bfloat16", model__remat=remat, **mesh)
    cfg = LlamaConfig.from_config(config.model, "cpu")
    exp = build(config, make_mesh(config.mesh, jax.devices()[: 2 * context if mesh else 1]))
    params = jax.tree.map(lambda x: x[0], exp.init_state().params["layers"])
    b, t = 2, config.train.seq_len
    h = jax.ShapeDtypeStruct((b, t, cfg.d_model), jnp.bfloat16)
    residuals = Residuals()

    def forward(params, h):
        _, vjp = jax.vjp(functools.partial(decoder_layer, cfg), params, h)
        return residuals.save(vjp, params)

    with sharding.use_rules(exp.mesh, exp.rules):
        saved = jax.eval_shape(forward, params, h)
    return cfg, b, t, saved, residuals, len(jax.tree.leaves(params))


@pytest.mark.parametrize("remat", STAGE_REMATS)
def test_kept_residuals_are_activations_only(remat):
    """What a stage keeps from a microbatch's F to its B: activations (batch, length, ...),
    never a copy of a weight (the weights are looked up again in B), for every policy."""
    cfg, b, t, saved, residuals, weights = layer_residuals(remat)
    assert saved and all(x.shape[:2] == (b, t) for x in saved), [x.shape for x in saved]
    # The planner's memory model counts the same bytes (dots_attention is dots_no_batch here).
    units = REMATS[effective_remat(cfg, remat, {CONTEXT: 1})].widths
    widths = (cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    assert sum(x.size for x in saved) == b * t * np.dot(units, (*widths, cfg.ffn_dim))
    # Every weight the layer has is looked up again in B, not kept per microbatch.
    assert sorted(i for i in residuals.sources if i >= 0) == list(range(weights))


@pytest.mark.parametrize("remat", STAGE_REMATS)
def test_a_rings_layer_keeps_what_the_memory_model_counts(remat):
    """With ring attention (context=4) the layer keeps, per token, the values the planners
    count for `remat` (bf16; the ring's output once per token where the policy keeps the
    attention's results), and the ring's float32 log-sum-exp, one per head, beside it."""
    cfg, b, t, saved, _, _ = layer_residuals(remat, context=4)
    mesh_shape = {CONTEXT: 4}
    units = REMATS[effective_remat(cfg, remat, mesh_shape)].widths
    widths = (cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    size = lambda dtype: sum(x.size for x in saved if x.dtype == dtype)
    assert size(jnp.bfloat16) == b * t * np.dot(units, (*widths, cfg.ffn_dim))
    keeps_results = remat in ("dots_attention", "attention")
    assert size(jnp.float32) == (b * t * cfg.num_heads if keeps_results else 0)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_the_memory_model_counts_what_a_layer_keeps_per_token(remat):
    """The policies pipelines do not offer, on XLA's attention: the bytes the layer keeps per
    token (its (T, T) arrays per head included) match memory.saved_values to within a few
    per-token statistics (under `none` a bf16 cast of each fp32 weight is kept too, which no
    per-token model counts: those arrays are left out here)."""
    cfg, b, t, saved, _, _ = layer_residuals(remat)
    assert cfg.attention is None  # XLA's.
    batched = [x for x in saved if x.shape[:1] == (b,)]
    kept = sum(x.size * x.dtype.itemsize for x in batched) / (b * t)
    widths = (cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    values, _ = saved_values(remat, (*widths, cfg.ffn_dim), cfg.num_heads * t, 2)
    assert 2 * values <= kept <= 2 * values * 1.015, (kept, 2 * values)


def train(config, devices, steps=2):
    """(experiment, losses, final params) of `steps` train steps."""
    exp = build(config, make_mesh(config.mesh, devices))
    state, batches = exp.init_state(), make_batches(config)
    losses = []
    for i in range(steps):
        state, metrics = exp.train_step(state, exp.global_batch(batches[i]))
        losses.append(float(metrics["loss"]))
    return exp, losses, jax.device_get(state.params)


def test_pipelined_training_steps_equal_the_model_without_one():
    """Two optimizer steps through the trainer: the padded slots stay zero, the rest trains
    as without a pipeline."""
    _, ref_losses, ref_params = train(
        small_config(mesh__data=1, model__num_layers=5), jax.devices()[:1]
    )
    config = small_config(
        model__num_layers=5, mesh__pipeline=2, mesh__data=4, pipeline__schedule="1f1b"
    )
    exp, losses, params = train(config, jax.devices())
    padding = exp.pipeline.layout.slot_layer < 0
    assert padding.any()  # Five layers on two stages.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for stored in jax.tree.leaves(params["layers"]):
        assert not stored[padding].any()
    params["layers"] = jax.tree.map(exp.pipeline.layout.from_stages, params["layers"])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, ref_params
    )


@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(model__num_layers=3, mesh__pipeline=4), ["num_layers=3", "4 chunks"]),
        (
            dict(mesh__pipeline=2, pipeline__microbatches=3),
            ["batch_size=16", "pipeline.microbatches=3"],
        ),
        (
            dict(mesh__pipeline=2, mesh__data=4, pipeline__microbatches=8),
            ["batch_size / config.pipeline.microbatches=2", "config.mesh.data=4"],
        ),
        (
            dict(mesh__pipeline=2, pipeline__virtual_stages=2, pipeline__schedule="gpipe"),
            ["virtual_stages=2", "schedule=1f1b or circular"],
        ),
        (
            dict(
                model__num_layers=8,
                mesh__pipeline=4,
                pipeline__schedule="circular",
                pipeline__virtual_stages=2,
                pipeline__microbatches=2,
            ),
            ["microbatches=2", "mesh.pipeline=4", "groups of p"],
        ),
        (dict(mesh__pipeline=2, train__microbatches=2), ["train.microbatches=2", "set"]),
        (dict(mesh__pipeline=2, pipeline__schedule="zb"), ["schedule='zb'", "1f1b"]),
        (dict(mesh__pipeline=2, pipeline__balance="3,2"), ["balance='3,2'", "num_layers=4"]),
        (dict(mesh__pipeline=2, pipeline__remat="none"), ["remat='none'", "dots_no_batch"]),
    ],
)
def test_bad_pipeline_settings_name_the_setting(overrides, names):
    config = small_config(**{"model__num_layers": 4, "mesh__data": -1, **overrides})
    with pytest.raises(ConfigError) as e:
        build(config, make_mesh(config.mesh))
    for name in names:
        assert name in str(e.value)


def test_attention_in_a_stage_runs_on_each_devices_shard():
    """cuDNN's attention in a stage beside other split axes: the stage's region is manual over
    `pipeline` only, so the call runs in a region manual over data and tensor too, each device
    on its rows and heads (the GPU compile of it: tests/test_plan.py). Here XLA's attention
    stands in for cuDNN's, to check the layout plumbing against the whole computation."""
    from jax.sharding import PartitionSpec as P

    from angel_jax.parallel.attention import per_device_attention

    mesh = jax.make_mesh((2, 2, 2), ("pipeline", "data", "tensor"))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 4, 32, 4, 8))
    spec = P("data", None, "tensor", None)

    def stage(q, k, v):
        return per_device_attention(
            q, k, v, mesh, spec, scale=None, causal=True, implementation="xla"
        )

    in_stage = jax.shard_map(
        stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"pipeline"}, check_vma=False
    )
    got = jax.jit(in_stage)(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    config = small_config(model__num_layers=4, mesh__pipeline=2, mesh__data=2)
    cfg = dataclasses.replace(LlamaConfig.from_config(config.model, "cpu"), attention="cudnn")
    shape = dict(data=2, pipeline=2, expert=1, context=1, sequence=1, tensor=1)
    make_pipeline_plan(plan_input(config, shape, cfg, budget={}), cfg)  # Accepted.


def test_vocab_parallel_take_is_take():
    """The embedding's lookup in a stage (XLA's GPU partitioner aborts on the gather there):
    each device looks up its tokens in its own rows of the table split over tensor (and data,
    major), the tokens' rows split over data; values and the table's grads as jnp.take's."""
    from jax.sharding import PartitionSpec as P

    from angel_jax.parallel.embedding import vocab_parallel_take

    auto = (jax.sharding.AxisType.Auto,) * 3  # As the trainer's mesh.
    mesh = jax.make_mesh((2, 2, 2), ("pipeline", "data", "tensor"), axis_types=auto)
    table = jax.random.normal(jax.random.key(0), (16, 8))
    tokens = jax.random.randint(jax.random.key(1), (4, 6), 0, 16)
    ct = jax.random.normal(jax.random.key(2), (4, 6, 8))
    for table_spec, tokens_spec in (
        (P("tensor", None), P("data", None)),
        (P(("data", "tensor"), None), P()),
    ):
        stage = functools.partial(
            vocab_parallel_take, mesh=mesh, table_spec=table_spec, tokens_spec=tokens_spec
        )
        in_stage = jax.shard_map(
            stage,
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
            axis_names={"pipeline"},
            check_vma=False,
        )
        got, vjp = jax.vjp(jax.jit(in_stage), table, tokens)  # tokens' cotangent: float0.
        d_table = vjp(ct)[0]
        want, vjp = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(d_table, vjp(ct)[0], rtol=1e-5, atol=1e-6)


def test_stages_hold_their_own_layers_and_pass_activations_by_collective_permute():
    """The mechanism, not the numbers: each stage keeps its half of the stacked layers (no
    gather of the whole stack), and the microbatches' activations (rows x T x D) move between
    stages by collective-permutes in the compiled step."""
    config = small_config(
        model__num_layers=LAYERS,
        mesh__pipeline=2,
        mesh__data=4,
        pipeline__schedule="1f1b",
        pipeline__balance="even",
    )
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    layers = jax.tree.leaves(state.params["layers"])
    assert all(x.addressable_shards[0].data.size * 2 == x.size for x in layers)
    batch = exp.global_batch(make_batches(config)[0])
    with sharding.use_rules(exp.mesh, exp.rules):
        hlo = jax.jit(exp.grads.loss_and_grads).lower(state.params, batch).compile().as_text()
    sizes = collective_sizes(hlo)
    t = config.train
    rows = t.batch_size // config.mesh.data // config.pipeline.microbatches
    assert rows * t.seq_len * config.model.d_model in sizes["collective-permute"], sizes
    assert not {x.size for x in layers} & set(sizes["all-gather"]), sizes


def test_a_stage_adds_each_layers_grads_to_its_accumulators_in_the_layer_loop():
    """A B adds each layer's grads to the float32 accumulators as the layer loop makes them:
    stacked over the chunk first, they were a float32 copy of the chunk's layers (4 bytes a
    parameter more, on the GPU too). Eight more layers on two stages add to the compiled step's
    temporaries their accumulators and the CPU's update temporaries, about 1.8 x 4 bytes a
    parameter here; with the stacked copy (a stage's one chunk) 2.8 x."""

    def temporaries(layers):
        config = small_config(
            model__num_layers=layers,
            model__d_model=256,
            model__ffn_dim=1024,
            mesh__pipeline=2,
            mesh__data=2,
            pipeline__schedule="1f1b",
            pipeline__balance="even",
        )
        exp = build(config, make_mesh(config.mesh, jax.devices()[:4]), fit_compiled=False)
        stacked = jax.tree.leaves(exp.abstract_state.params["layers"])
        return exp.train_step.memory_analysis().temp_size_in_bytes, sum(x.size for x in stacked)

    (temp_8, params_8), (temp_16, params_16) = temporaries(8), temporaries(16)
    per_stage = (params_16 - params_8) / 2
    assert (temp_16 - temp_8) < 2.3 * 4 * per_stage, (temp_16 - temp_8) / (4 * per_stage)


def test_the_zero_cache_plan_takes_the_stages_activations():
    """Under a pipeline the ZeRO-Cache plan's activations are the stage plan's (each stage's
    microbatches in flight through its own layers), not a whole batch through every layer at
    once: llama3_8b on pipeline=2 with 8 microbatches of 2 x 8192 fits a 132 GiB device (its
    step compiled for two H200s needs 123.4 GiB of 126.2 usable, two_gpu_compiled.py),
    where the batch-wide estimate planned 257 GiB and refused it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    overrides = [
        "--config.mesh.pipeline=2",
        "--config.mesh.data=1",
        "--config.train.microbatches=1",
        "--config.pipeline.microbatches=8",
        "--config.train.batch_size=16",
        "--config.offload.device_gib=132",
        "--config.offload.host_gib=100",
    ]
    config = load_config(str(root / "configs/llama3_8b.py"), overrides)
    exp = build(config, make_mesh(config.mesh, jax.devices()[:2]), fit_compiled=False)
    assert exp.plan.policy == "none"
    assert exp.plan.state_bytes["activations"] == int(exp.pipeline.activation_bytes)
    assert exp.plan.tier_bytes("device") < 100 * 2**30
