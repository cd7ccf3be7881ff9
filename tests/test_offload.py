"""ZeRO-Cache: offloaded training equal to on-device (optimizer, layer streaming, the SSD tier,
the hybrid update, offloaded activations), checkpoints, and the streamed update's groups and
copies. The planner, the delayed update and the update inside the step have files of their own
(test_offload_planner.py, test_offload_delayed.py, test_offload_in_step.py)."""

import collections
import functools
import re

import jax
import jax.extend.core
import numpy as np
import pytest

from angel_jax import sharding, steps
from angel_jax.checkpoint import Checkpointer
from angel_jax.config import ConfigError
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.planning import activations
from angel_jax.planning.chunks import hybrid_share, with_cpu_update
from angel_jax.planning.compiled import CompiledTooLarge
from angel_jax.planning.inputs import plan_input
from angel_jax.planning.plan import Plan
from angel_jax.planning.tiers import DEVICE, HOST
from angel_jax.train import build
from tests.test_train_parity import small_config

# Where arrays live and what the device holds show on a GPU: XLA:CPU keeps every memory kind
# in RAM, with no allocator statistics.
gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="a GPU's memory, on a GPU only")


def train(config, steps=3):
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    batches = make_batches(config)
    losses = []
    for i in range(steps):
        state, metrics = exp.train_step(state, exp.global_batch(batches[i]))
        losses.append(float(metrics["loss"]))
    return exp, state, losses


@pytest.mark.parametrize(
    "mesh",
    [
        # Every chunk fetched before the step, sent home beside the next one.
        dict(zero_stage=1, mesh__data=8, offload__chunks_in_flight=100),
        dict(zero_stage=3, mesh__data=4, mesh__tensor=2),
        dict(zero_stage=3, mesh__data=8, train__optimizer="adafactor"),
    ],
)
def test_optimizer_offload_equals_on_device(mesh):
    _, ref_state, ref_losses = train(small_config(**mesh))
    exp, state, losses = train(small_config(offload__policy="optimizer", **mesh))
    assert exp.plan.offloads_optimizer
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert kinds(state.params) == {HOST}
    # Masters and moments keep the ZeRO layout over data (stage >= 1) on the host, and take
    # the bytes the plan counted for them.
    big = [x for x in jax.tree.leaves((state.params, state.opt_state)) if x.size >= 2048]
    assert all("data" in str(x.sharding.spec) for x in big)
    local = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    assert local(state.params) == exp.plan.state_bytes["master params"]
    assert local(state.opt_state) == exp.plan.state_bytes["optimizer state"]
    assert kinds([x for x in jax.tree.leaves(state.opt_state) if x.ndim]) == {HOST}
    assert kinds(state.compute_params) == {DEVICE}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        exp.params_numpy(state),
        jax.device_get(ref_state.params),
    )
    # The device copy is the masters in the compute dtype.
    jax.tree.map(
        lambda c, p: np.testing.assert_array_equal(c, p.astype(c.dtype)),
        jax.device_get(state.compute_params),
        exp.params_numpy(state),
    )


@pytest.mark.parametrize(
    "mesh",
    [
        dict(zero_stage=1, mesh__data=8),
        dict(zero_stage=3, mesh__data=4, mesh__tensor=2, microbatches=2),
        dict(zero_stage=2, mesh__data=8, microbatches=2, train__optimizer="adafactor"),
    ],
)
def test_layer_streaming_equals_on_device(mesh):
    """`params`: the layers' compute weights and their grads live in host memory; the scan
    fetches each layer's weights inside remat (forward and backward)."""
    kw = dict(model__remat="full", **mesh)
    _, ref_state, ref_losses = train(small_config(**kw))
    exp, state, losses = train(small_config(offload__policy="params", **kw))
    assert exp.plan.streams_params and exp.model_config.stream_params
    stacked = jax.tree.leaves(exp.stacked)
    kinds = [x.sharding.memory_kind for x in jax.tree.leaves(state.compute_params)]
    assert kinds == [HOST if s else DEVICE for s in stacked] and any(stacked)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        exp.params_numpy(state),
        jax.device_get(ref_state.params),
    )
    # The grads the step computes: streamed layers' arrive in host memory, one array per layer
    # when accumulated, and equal the on-device ones.
    batch = exp.global_batch(make_batches(exp.config)[0])
    with sharding.use_rules(exp.mesh, exp.rules):
        jaxpr = str(jax.make_jaxpr(exp.grads.loss_and_grads)(state.compute_params, batch))
        _, grads = jax.jit(exp.grads.loss_and_grads)(state.compute_params, batch)
    for g, s in zip(
        jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, tuple)), stacked, strict=True
    ):
        layers = g if isinstance(g, tuple) else [g]
        assert {x.sharding.memory_kind for x in layers} == {HOST if s else DEVICE}
        assert isinstance(g, tuple) == (s and exp.config.train.microbatches > 1)
    # Each layer's weights are copied to the device in the forward scan and again in the
    # backward (remat) scan: 9 weights per layer, twice.
    assert jaxpr.count("device_put") >= 2 * 9


# The small model with eight layers, ZeRO-3 over 8 devices: room on the device to fill.
EIGHT_LAYERS = dict(zero_stage=3, mesh__data=8, model__num_layers=8, offload__host_gib=64)


@pytest.fixture(scope="module")
def eight_layers():
    """The small model with eight layers and one chunk in flight, trained on the device: its
    settings, its `optimizer` plan, the budget halfway between what `optimizer` and `none`
    need on the device (room for some update chunks), and the reference params and losses."""
    kw = dict(EIGHT_LAYERS, offload__chunks_in_flight=1)
    mesh = make_mesh(small_config(**kw).mesh)
    plan = lambda policy: build(small_config(offload__policy=policy, **kw), mesh).plan
    offloaded = plan("optimizer")
    between = (offloaded.tier_bytes(DEVICE) + plan("none").tier_bytes(DEVICE)) / 2
    device_gib = between / 0.95 / 2**30
    _, ref_state, ref_losses = train(small_config(**kw))
    return kw, offloaded, device_gib, jax.device_get(ref_state.params), ref_losses


def test_auto_fills_the_device_first(eight_layers):
    """`auto` keeps as many update chunks on the device as fit, the rest in host memory, and
    trains exactly as `none` does."""
    kw, _, budget_gib, _, ref_losses = eight_layers
    exp, state, losses = train(
        small_config(offload__policy="auto", offload__device_gib=budget_gib, **kw)
    )
    assert exp.plan.policy == "optimizer" and exp.plan.tier_bytes(DEVICE) <= budget_gib * 2**30
    leaves = jax.tree.leaves((state.params, state.opt_state))
    kinds = {x.sharding.memory_kind for x in leaves}
    assert kinds == {DEVICE, HOST}, kinds
    # Every chunk's scalars (step counts) stay on the device; resident chunks' arrays too.
    resident = sum(
        x.addressable_shards[0].data.nbytes
        for x in leaves
        if x.sharding.memory_kind == DEVICE and x.ndim
    )
    # The plan counts resident chunks whole, with their two AdamW step counts.
    counts = 2 * 4 * len(exp.plan.resident)
    assert resident + counts == exp.plan.state_bytes["resident chunks"] > counts
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


@pytest.fixture(scope="module")
def wide_eight_layers(eight_layers):
    """Wider and on fewer rows: the states outweigh the activations, as in a large model.
    (overrides, mesh, `none`'s losses, the compiled optimizer step's temporaries)."""
    kw = dict(eight_layers[0], model__d_model=256, model__ffn_dim=512, train__batch_size=8)
    mesh = make_mesh(small_config(**kw).mesh)
    _, _, ref_losses = train(small_config(**kw))
    exp = build(small_config(offload__policy="optimizer", **kw), mesh)
    return kw, mesh, ref_losses, exp.steps.grad_step.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("outgrows", [True, False], ids=["outgrows", "undershoots"])
def test_auto_plans_again_with_the_compiled_steps_temporaries(
    wide_eight_layers, monkeypatch, outgrows
):
    """`build` compiles an `auto` plan's step with device-resident chunks and plans again with
    XLA's temporaries in place of the activation estimate: when they exceed it, fewer resident
    chunks and a step that fits (the same plan unfitted is refused at its first use); when
    they fall short of it, more. Either trains as `none` does, its step compiled once."""
    kw, mesh, ref_losses, temps = wide_eight_layers
    # An estimate 1.5 MiB off the temporaries: more than a fill leaves over, less than the
    # resident chunks' room.
    off, estimate = 3 * 2**19 * (-1 if outgrows else 1), activations.activation_bytes
    wrong = lambda inp, r: {**estimate(inp, r), "activations": temps + off - 2**18}
    assert estimate(plan_input(small_config(**kw), mesh), "none")["layer inputs"] == 2**18
    monkeypatch.setattr(activations, "activation_bytes", wrong)
    plan = lambda policy: (
        build(small_config(offload__policy=policy, **kw), mesh, fit_compiled=False).plan
    )
    between = (plan("optimizer").tier_bytes(DEVICE) + plan("none").tier_bytes(DEVICE)) / 2
    # On a CPU, an emulated device budget is not checked against compiled sizes: here it is.
    monkeypatch.setattr(steps.Step, "checks_compiled", property(lambda self: True))
    config = small_config(offload__policy="auto", offload__device_gib=between / 0.95 / 2**30, **kw)
    unfitted = build(config, mesh, fit_compiled=False)
    if outgrows:
        with pytest.raises(CompiledTooLarge, match="the compiled train step needs"):
            _ = unfitted.train_step
    compiles = []
    compile = jax.stages.Lowered.compile
    counted = lambda self, *args, **kw: compiles.append(self) or compile(self, *args, **kw)
    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    exp, _, losses = train(config)
    assert len(compiles) == 1  # Planned again for the same program: compiled once.
    assert exp.plan.state_bytes["activations"] == temps - 2**18
    fitted, first = len(exp.plan.resident), len(unfitted.plan.resident)
    assert 0 < fitted < first if outgrows else fitted > first > 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


# Wider, on more rows: remat policies' activations set the device's need.
WIDE = dict(offload__policy="none", model__d_model=128, model__ffn_dim=256, train__batch_size=32)


@pytest.fixture(scope="module")
def three_tiers(eight_layers):
    """Budgets under which `auto` uses all three tiers on the small model: the device between
    what `optimizer` and `none` need, host memory for about half of the update chunks."""
    kw, offloaded, device_gib, ref_params, ref_losses = eight_layers
    kw = dict(
        kw,
        offload__policy="auto",
        offload__device_gib=device_gib,
        offload__host_gib=offloaded.tier_bytes(HOST) * 0.6 / 0.95 / 2**30,
    )
    return kw, ref_params, ref_losses


def test_ssd_writes_while_initialising_stay_bounded(tmp_path, three_tiers, monkeypatch):
    """Init queues at most two layers' SSD writes behind the one it adds (else a slow disk lets
    every SSD chunk wait in memory: 44 GiB on the H200's 15B run)."""
    import time

    from angel_jax.offload import ssd

    write = ssd.SSDStore.write_file
    monkeypatch.setattr(ssd.SSDStore, "write_file", lambda *a: (time.sleep(0.05), write(*a))[1])
    kw, _, _ = three_tiers
    config = small_config(offload__ssd_dir=str(tmp_path), **kw)
    exp = build(config, make_mesh(config.mesh))
    put, in_flight = exp.ssd.put, []

    def counting_put(*args):
        futures = put(*args)
        in_flight.append(sum(not f.done() for f in exp.ssd.masters.pending_writes))
        return futures

    exp.ssd.put = counting_put
    exp.init_state()
    assert len(in_flight) == len(exp.ssd.chunks) > 3
    assert max(in_flight) <= 3, in_flight
    exp.ssd.close()


@pytest.mark.parametrize("compress", [False, True])
def test_ssd_tier_takes_what_host_memory_cannot(tmp_path, three_tiers, compress):
    kw, ref_params, ref_losses = three_tiers
    config = small_config(offload__ssd_dir=str(tmp_path), offload__ssd_compress=compress, **kw)
    exp, state, losses = train(config)
    plan = exp.plan
    assert plan.policy == "optimizer" and plan.fits()
    assert exp.ssd and 0 < len(exp.ssd.chunks) == len(plan.on_ssd) and plan.resident
    # Each chunk lives in exactly one tier: SSD chunks are absent from the state.
    leaves = jax.tree.leaves((state.params, state.opt_state))
    assert {x.sharding.memory_kind for x in leaves} == {DEVICE, HOST}
    stacked_masters = [
        m
        for m in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, tuple))
        if isinstance(m, tuple)
    ]
    assert sum(m is None for t in stacked_masters for m in t) == sum(
        c.layer is not None for c in exp.ssd.chunks
    )
    exp.ssd.wait()  # The last step's writes run in the background.
    on_disk = exp.ssd.nbytes
    assert on_disk == pytest.approx(plan.state_bytes["SSD chunks"] * 8, rel=0.05)
    params = exp.params_numpy(state)
    if not compress:  # The same arithmetic, wherever the chunks live.
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        assert_params_close(params, ref_params, config.train.lr)
    else:  # bf16 moments on disk: AdamW's direction shifts by about bf16's rounding.
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
        norm = assert_params_close(params, ref_params, config.train.lr, norm_bound=1e-2)
        print(f"bf16 optimizer state on disk: params within {norm:.1e} (norm) of fp32")
        assert norm > 0
    exp.ssd.close()


def assert_params_close(params, ref_params, lr: float, norm_bound: float = 1e-5) -> float:
    """Per leaf: the difference's norm over the reference's below `norm_bound`, and the
    largest difference below 3 lr; returns the largest norm. Adam divides by sqrt(v), so a
    near-zero grad's rounding (another fusion of the same sums, on another device) can move
    its element by up to lr a step: the largest difference is bounded by that; the norm shows
    the leaf as a whole (seen on this CPU with jax 0.11.2: 1.6e-5 on 2 of 32768 elements of
    SSD chunks, 1.8e-7 on 2 of 32768 of CPU-updated ones; single flips made the largest
    relative difference 6e-2 with bf16 state on disk)."""
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    diffs = [(np.linalg.norm(a - b) / np.linalg.norm(b), np.max(np.abs(a - b))) for a, b in leaves]
    norms, largest = [d[0] for d in diffs], [d[1] for d in diffs]
    assert max(norms) < norm_bound and max(largest) < 3 * lr, (max(norms), max(largest))
    return max(norms)


def test_ssd_tier_checkpoints_and_resumes(tmp_path, three_tiers):
    """The SSD chunks are saved inside the checkpoint and put back on disk on restore."""
    kw, _, _ = three_tiers
    config = small_config(offload__ssd_dir=str(tmp_path / "ssd"), **kw)
    # The fresh experiment (a new process would build one) on a fresh SSD directory.
    config2 = small_config(offload__ssd_dir=str(tmp_path / "ssd2"), **kw)
    assert_resumes_identically(config, config2, tmp_path / "run")


def assert_resumes_identically(config, config2, directory):
    """Two steps of `config` saved in `directory` and restored by a fresh experiment of
    `config2`: the same params, and the same next step (the chunks held outside the state
    tree included)."""
    exp, state, _ = train(config, steps=2)
    ckpt = Checkpointer(str(directory), every_steps=1, keep=1)
    ckpt.save(2, exp.checkpointed(state), 2, exp.plan.policy)
    ckpt.close()
    exp2 = build(config2, make_mesh(config2.mesh))
    restored, _ = Checkpointer(str(directory), 1, 1).restore(
        2, exp2.checkpoint_target(), exp2.plan.policy
    )
    restored = exp2.from_checkpointed(restored)
    jax.tree.map(
        np.testing.assert_array_equal, exp2.params_numpy(restored), exp.params_numpy(state)
    )
    batch = exp.global_batch(make_batches(config)[2])
    restored, m1 = exp2.train_step(restored, batch)
    state, m2 = exp.train_step(state, batch)
    assert float(m1["loss"]) == float(m2["loss"])
    jax.tree.map(
        np.testing.assert_array_equal, exp2.params_numpy(restored), exp.params_numpy(state)
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(zero_stage=1, mesh__data=8, model__num_layers=4),
        dict(zero_stage=3, mesh__data=4, mesh__tensor=2, train__optimizer="adafactor"),
        dict(
            zero_stage=2,
            mesh__data=8,
            microbatches=2,
            model__remat="full",
            offload__policy="params",  # Grads arrive in host memory, one array per layer.
        ),
    ],
)
def test_hybrid_update_equals_on_device(kw):
    """Half the host chunks' parameters updated by the host's cores (JAX's CPU backend) and
    the rest by the device: the losses and params of the on-device update."""
    kw = dict(kw)
    policy = kw.pop("offload__policy", "optimizer")
    _, ref_state, ref_losses = train(small_config(**kw))
    exp, state, losses = train(small_config(offload__policy=policy, offload__cpu_update=0.5, **kw))
    plan, cpu = exp.plan, exp.offloaded.cpu
    assert plan.on_cpu and cpu and len(cpu.chunks) == len(plan.on_cpu)
    assert {(jax.tree_util.keystr(c.path), c.layer) for c in cpu.chunks} == plan.on_cpu
    assert not set(exp.streamed_update.chunks) & set(cpu.chunks)  # Each updated once.
    # Half of the host chunks' parameters, give or take a chunk.
    cpu_bytes = plan.state_bytes["CPU-updated chunks"]
    host_bytes = cpu_bytes + plan.state_bytes["master params"] + plan.state_bytes["optimizer state"]
    largest = max(c.master.size * 4 for c in exp.offloaded.outside.chunks)
    assert abs(cpu_bytes / host_bytes - 0.5) * host_bytes < 4 * largest
    # The CPU tier's chunks are absent from the state tree and live whole on one CPU device.
    masters = jax.tree.leaves(state.params, is_leaf=lambda x: x is None)
    assert sum(m is None for m in masters) == len(cpu.chunks)
    for master, opt in cpu.values.values():
        assert {d.platform for x in jax.tree.leaves((master, opt)) for d in x.devices()} == {"cpu"}
        assert all(len(x.devices()) == 1 for x in jax.tree.leaves((master, opt)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    params = exp.params_numpy(state)
    assert_params_close(params, jax.device_get(ref_state.params), exp.config.train.lr)
    jax.tree.map(
        lambda c, p: np.testing.assert_array_equal(c, p.astype(c.dtype)),
        jax.device_get(state.compute_params),
        params,
    )


def test_hybrid_update_checkpoints_and_resumes(tmp_path):
    """The CPU tier's chunks are saved inside the checkpoint and put back on restore."""
    config = small_config(
        offload__policy="optimizer", offload__cpu_update=0.5, zero_stage=1, mesh__data=8
    )
    assert_resumes_identically(config, config, tmp_path)


def test_hybrid_share_is_spread_over_the_update():
    """The host's share is taken chunk by chunk as the update's order goes, so both the host
    and the device work from its start."""
    gib = 2**30
    plan = Plan(
        "optimizer",
        "none",
        {},
        {"master params": 4 * gib, "optimizer state": 8 * gib},
        {},
        2**30,
        1,
    )
    chunks = [((f"w{i}", None), gib // 8, gib // 4) for i in range(32)]
    out = with_cpu_update(plan, 0.25, chunks)
    assert len(out.on_cpu) == 8 and "25% of the host chunks" in out.cpu_note
    assert out.state_bytes["CPU-updated chunks"] == 8 * (gib // 8 + gib // 4)
    assert out.state_bytes["master params"] == 4 * gib - gib
    # Every fourth chunk, not a quarter of them in a row.
    assert sorted(int(k[0][1:]) for k in out.on_cpu) == list(range(1, 32, 4))
    assert with_cpu_update(plan, 0.0, chunks) is plan
    assert len(with_cpu_update(plan, 1.0, chunks).on_cpu) == 32


def test_hybrid_share_from_rates():
    """cpu_update=-1: with both paths sharing the link (a device-updated parameter moves its
    master and state down and back, a host-updated one its bf16 grad and weight), the share
    that finishes soonest at the rates measured together; 0 when that is not faster than the
    device alone."""
    gib = 2**30
    chunks = [((f"w{i}", None), gib // 8, gib // 4) for i in range(32)]  # 12 bytes a param.
    rates = dict(
        host_params_per_s=1.4e9,
        copy_bytes_per_s=38e9,
        host_params_per_s_both=1.4e9,
        copy_bytes_per_s_both=38e9,
    )

    def seconds(share, link=38e9, update=1.4e9):  # Per parameter, both paths at once.
        on_link = ((1 - share) * 12 + share * 4) / link  # 2 bytes down and 2 back.
        return max(on_link, share * (1 / update + 4 / link))

    share, note = hybrid_share(rates, chunks, 2)
    grid = np.linspace(0, 1, 1001)
    assert seconds(share) <= min(seconds(s) for s in grid) + 1e-15
    assert 0.2 < share < 0.4 and f"picked {share:.0%}" in note and "1.40G params/s" in note
    # The same host beside copies that halve when both run (as on the H200): it does not pay.
    slowed = dict(rates, host_params_per_s_both=0.7e9, copy_bytes_per_s_both=19e9)
    share, note = hybrid_share(slowed, chunks, 2)
    best = min(seconds(s, 19e9, 0.7e9) for s in grid)
    assert best > 0.95 * seconds(0.0)  # Against the device alone at its own rates.
    assert share == 0 and "picked 0" in note and "together 0.70G and 19.0 GB/s" in note
    assert hybrid_share(dict(rates, host_params_per_s_both=0.0), chunks, 2)[0] == 0


def test_hybrid_share_is_measured_when_asked(monkeypatch):
    """The plan measures the rates (here, on the CPU: a real measurement, whatever it picks)
    and says what it picked; with rates where the host pays, it takes chunks."""
    from angel_jax.offload import cpu

    rates = cpu.measure_rates(
        planner_optimizer(), (jax.tree_util.DictKey("kernel"),), np.dtype("bfloat16"), 0.05
    )
    assert all(r > 0 for r in rates.values()), rates
    config = small_config(offload__policy="optimizer", offload__cpu_update=-1.0)
    plan = build(config, make_mesh(config.mesh)).plan
    assert "cpu_update=-1 picked" in plan.cpu_note
    fast_host = dict(
        host_params_per_s=1e12,
        copy_bytes_per_s=1e9,
        host_params_per_s_both=1e12,
        copy_bytes_per_s_both=1e9,
    )
    monkeypatch.setattr(cpu, "measure_rates", lambda *a, **k: fast_host)
    monkeypatch.setattr("angel_jax.state_layout.measure_rates", lambda *a, **k: fast_host)
    plan = build(config, make_mesh(config.mesh)).plan
    assert plan.on_cpu and "cpu_update=-1 picked" in plan.cpu_note, plan.cpu_note


def planner_optimizer():
    from angel_jax.optim import make_optimizer

    return make_optimizer(small_config().train)


def test_ssd_tier_is_offered_when_nothing_fits(three_tiers):
    kw, _, _ = three_tiers
    with pytest.raises(ConfigError, match=r"an SSD tier \(config.offload.ssd_dir"):
        build(small_config(**kw), make_mesh(small_config(**kw).mesh))


def test_layer_streaming_needs_remat():
    with pytest.raises(ConfigError, match="offload.policy=params .* config.model.remat"):
        config = small_config(offload__policy="params", mesh__data=8)
        build(config, make_mesh(config.mesh))


def test_optimizer_offload_equals_on_device_in_bfloat16():
    """With bf16 compute the device copy must still compute exactly what the masters do."""
    kw = dict(zero_stage=1, mesh__data=8, model__dtype="bfloat16")
    _, _, ref_losses = train(small_config(**kw), steps=3)
    _, _, losses = train(small_config(offload__policy="optimizer", **kw), steps=3)
    # Not bitwise: the update fuses differently on and off the device, and a last-bit change in
    # an fp32 master can flip a bf16 rounding, which later steps amplify (jax 0.11.2: 1.3e-6 at
    # step 3, 5.8e-5 at step 4). A real difference shows sooner: an update 0.1% too large gave
    # 7e-5 by step 3.
    np.testing.assert_allclose(losses, ref_losses, rtol=5e-6)


DELAYED = dict(zero_stage=1, mesh__data=8, offload__policy="optimizer", offload__cpu_update=0.5)


# The streamed update's reference for config.offload.update_in_step (unrolled layers).
IN_STEP = dict(model__scan_layers=False, offload__policy="optimizer")


def assert_updated_alike(state, ref, check=None):
    """`state`'s masters, optimizer state and compute copy against `ref`'s (arrays or numpy),
    by `check`: within the update's tolerance unless given."""
    # As the on-device update's test: Adafactor's factored moments sum in another order inside
    # the larger program (2e-8 apart after three steps).
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    for tree in ("params", "opt_state", "compute_params"):
        pair = (jax.device_get(getattr(x, tree)) for x in (state, ref))
        jax.tree.map(check or close, *pair)


SPECULATING = dict(IN_STEP, offload__update_in_step=True, offload__speculative_update=True)


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload__policy="optimizer"),
        dict(offload__policy="params"),
        dict(IN_STEP, offload__update_in_step=True),
        SPECULATING,
    ],
    ids=["optimizer", "params", "optimizer in step", "speculative in step"],
)
def test_offloaded_state_checkpoints_and_resumes(tmp_path, kw):
    config = small_config(zero_stage=3, mesh__data=8, model__remat="full", **kw)
    exp, state, _ = train(config, steps=2)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
    ckpt.save(2, exp.checkpointed(state), 2)
    ckpt.close()
    restored, index = Checkpointer(str(tmp_path), 1, 1).restore(2, exp.checkpoint_target())
    restored = exp.from_checkpointed(restored)
    assert index == 2
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b),
        jax.device_get(restored),
        jax.device_get(state),
    )
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.params)} == {HOST}
    # Training continues identically from the restored state.
    batch = exp.global_batch(make_batches(config)[2])
    _, m1 = exp.train_step(restored, batch)
    _, m2 = exp.train_step(state, batch)
    assert float(m1["loss"]) == float(m2["loss"])


@pytest.mark.parametrize("in_flight", [1, 3])
def test_update_bounds_chunks_in_flight(in_flight):
    """The grad norm pass fetches grads in host memory (layer streaming's) a layer at a time,
    each after the first `in_flight` behind a barrier on an earlier one, and reads those on
    the device whole; the streamed update holds at most `in_flight` chunks on the device."""

    def grad_step_text(policy):
        config = small_config(
            offload__policy=policy, offload__chunks_in_flight=in_flight, model__remat="full"
        )
        config.mesh.data = 8
        exp = build(config, make_mesh(config.mesh))
        state = exp.init_state()
        batch = exp.global_batch(make_batches(config)[0])
        with sharding.use_rules(exp.mesh, exp.rules):
            grad_step = jax.jit(exp.steps.grads_of_batch)
            text = grad_step.lower(state.step, state.compute_params, batch).as_text()
        return exp, state, batch, text

    # small_config: 2 layers x 9 stacked weights, streamed with policy params.
    streamed = grad_step_text("params")[3]
    assert streamed.count("optimization_barrier") == 2 * 9 - in_flight
    exp, state, batch, text = grad_step_text("optimizer")
    assert text.count("optimization_barrier") == 0
    exp.train_step(state, batch)
    assert exp.streamed_update.most_in_flight == in_flight


def test_update_moves_and_updates_chunks_in_groups():
    """Consecutive chunks move in one copy call each way and update in one program (on the
    H200 each chunk cost the host about 1.2 ms of runtime calls), holding no more bytes on
    the device than the planner's bound for the chunks in flight."""
    from angel_jax.offload.stream import chunk_bytes

    config = small_config(offload__policy="optimizer", offload__chunks_in_flight=2)
    exp = build(config, make_mesh(config.mesh))
    update, calls = exp.streamed_update, collections.Counter()
    program, move = update.programs.get, update.moves.move
    update.programs.get = lambda *a: calls.update(["program"]) or program(*a)
    update.moves.move = lambda *a, **k: calls.update(["copy"]) or move(*a, **k)
    state = exp.init_state()
    for rows in make_batches(config)[:2]:
        state, _ = exp.train_step(state, exp.global_batch(rows))
    groups, chunks = len(update.groups), len(update.chunks)
    assert chunks == 2 * 9 + 3 and groups < chunks / 2, update.groups
    assert calls == {"program": 2 * groups, "copy": 2 * 2 * groups}  # Two steps.
    sizes = sorted(chunk_bytes(c) for c in update.chunks)
    # Two in flight: the planner counts the largest chunk fetched ahead and the two largest
    # leaving; groups of at most the second largest's bytes stay within that.
    bound = sizes[-1] + sum(sizes[-2:])
    assert exp.plan.state_bytes["update chunks"] == bound
    assert sizes[-1] < update.most_bytes_in_flight <= bound


def test_buffers_copies_read_are_deleted_only_when_the_copies_are_done(monkeypatch):
    """A group's device outputs stay until their copies home are done, and the old host
    copies until the update that read them has run: on the GPU a buffer deleted while a copy
    still reads it makes the compute stream wait for the copies (the next grad step waited
    60-105 ms for the update's copies home on the H200). Here no copy is done until waited
    for: after a step the last groups' outputs are all still there, as many as the planner
    counts leaving (`beside_step_groups`), and they go once their copies are done."""
    from jax._src.array import ArrayImpl

    config = small_config(offload__policy="optimizer", offload__chunks_in_flight=4)
    exp = build(config, make_mesh(config.mesh))
    update = exp.streamed_update
    done, block = {}, ArrayImpl.block_until_ready  # id -> array: held, so ids stay unique.
    finish = lambda arrays: done.update((id(x), x) for x in arrays)
    monkeypatch.setattr(ArrayImpl, "is_ready", lambda x: done.get(id(x)) is x)
    monkeypatch.setattr(ArrayImpl, "block_until_ready", lambda x: finish([x]) or block(x))
    state = exp.init_state()
    batches = make_batches(config)
    state, _ = exp.train_step(state, exp.global_batch(batches[0]))
    leaving = list(update.homebound)
    assert len(update.groups) >= 6 and len(leaving) == 4 - 2 + 1
    assert not any(x.is_deleted() for _, outs, old, _ in leaving for x in [*outs, *old])
    # The next step's prefetch leaves a group whose copies home are not done.
    masters, states = (exp.steps.flat(t) for t in (state.params, state.opt_state))
    first = update.moves.moved(
        update.groups[0], [update.moves.leaves(k, masters, states) for k in update.groups[0]]
    )
    for x in first:
        del done[id(x)]
    assert list(update.prefetch(masters, states)) == [1]
    finish(first)
    old = list(leaving[2][2])
    finish(leaving[2][1])  # Its update has run, its copies home have not: the old copies go.
    finish(leaving[1][0])  # Copies home done out of order: that group goes.
    update.homebound.delete_ready()
    assert list(update.homebound) == [leaving[0], leaving[2]]
    assert all(x.is_deleted() for x in [*leaving[1][1], *old])
    assert not any(x.is_deleted() for x in [*leaving[0][1], *leaving[0][2], *leaving[2][1]])
    for home, *_ in leaving:  # Their copies home are done: the next step deletes them.
        finish(home)
    state, _ = exp.train_step(state, exp.global_batch(batches[1]))
    assert all(x.is_deleted() for _, outs, old, _ in leaving for x in [*outs, *old])
    # A step after one whose last groups are not home: those count against the bound.
    update.most_in_flight = 0
    state, _ = exp.train_step(state, exp.global_batch(batches[2]))
    assert 0 < update.most_in_flight <= 4 + 1  # The planner counts in_flight + 1.


@gpu
def test_update_holds_at_most_chunks_in_flight_in_device_memory(monkeypatch):
    """The device's own count: bytes in use, sampled as each chunk's update is dispatched,
    grow by about `in_flight` chunks and no more (without the wait the host runs ahead of
    the GPU and every chunk's buffers are allocated at once)."""
    from angel_jax.offload.programs import GroupPrograms

    device, samples = jax.devices()[0], []
    make_fn = GroupPrograms.get

    def sampled_fn(self, *args):
        fn = make_fn(self, *args)

        def run(*a):
            samples.append(device.memory_stats()["bytes_in_use"])
            return fn(*a)

        return run

    monkeypatch.setattr(GroupPrograms, "get", sampled_fn)
    grown = {}
    for in_flight in (2, 6):
        config = small_config(
            mesh__data=1,
            offload__policy="optimizer",
            offload__chunks_in_flight=in_flight,
            model__num_layers=12,
            model__d_model=1024,
            model__ffn_dim=4096,
            train__batch_size=1,
            train__seq_len=64,
        )
        exp, state, _ = train(config, steps=1)
        samples.clear()
        exp.train_step(state, exp.global_batch(make_batches(config)[1]))
        chunk = max(c.master.size * 4 * 3 for c in exp.streamed_update.chunks)  # fp32 + Adam.
        grown[in_flight] = (max(samples) - samples[0]) / chunk
    # Chunks beyond the first sample's: at most in_flight (+1 leaving), and more with more.
    assert grown[2] <= 3.5 and grown[6] <= 7.5 and grown[6] > grown[2] + 1, grown


def grads_and_jaxpr(config):
    exp = build(config, make_mesh(config.mesh))
    state = exp.init_state()
    batch = exp.global_batch(make_batches(config)[0])
    with sharding.use_rules(exp.mesh, exp.rules):
        jaxpr = str(jax.make_jaxpr(exp.grads.loss_and_grads)(state.params, batch))
        metrics, grads = jax.jit(exp.grads.loss_and_grads)(state.params, batch)
    return float(metrics["loss"]), jax.device_get(grads), jaxpr


def test_offloaded_activations_give_the_same_grads():
    """remat=offload_dots saves the matmul outputs as host-memory residuals (`<host>` in the
    jaxpr; XLA:CPU then keeps them in RAM anyway, so where they live is checked on the GPU)."""
    kw = dict(zero_stage=3, mesh__data=4, mesh__tensor=2)
    loss, grads, _ = grads_and_jaxpr(small_config(model__remat="none", **kw))
    loss_dots, _, jaxpr_dots = grads_and_jaxpr(small_config(model__remat="dots_no_batch", **kw))
    loss_off, grads_off, jaxpr_off = grads_and_jaxpr(
        small_config(model__remat="offload_dots", **kw)
    )
    assert loss_off == pytest.approx(loss, rel=1e-6) and loss_dots == pytest.approx(loss, rel=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_off, grads
    )
    # q, k, v, the attention output, gate and up: six host residuals per layer.
    assert jaxpr_off.count("<host>") >= 6 and "<host>" not in jaxpr_dots


def _stacked_inputs(jaxpr: str, config, memory: str) -> int:
    """How many (layers, batch, seq, d_model) float32 arrays in `memory` ("" for the device,
    "<host>") the jaxpr holds: the scan's stacked layer inputs, saved for the backward pass."""
    m, t = config.model, config.train
    shape = f"[{m.num_layers},{t.batch_size},{t.seq_len},{m.d_model}]"
    return len(re.findall(rf"f32{re.escape(memory)}{re.escape(shape)}", jaxpr))


@pytest.mark.parametrize("mlp_chunks", [1, 4])
def test_layer_inputs_in_host_memory_give_the_same_grads(mlp_chunks):
    """offload.activations=host: under full remat each layer's input is the one saved value;
    it becomes a host-memory residual of the layer scan (no device copy of the stack remains)
    and the grads are those of the device run. mlp_chunks slices the MLP over the sequence:
    the same grads again. (XLA:CPU keeps host residuals in RAM either way: where they live in
    the compiled program is checked on the GPU, test_layer_inputs_live_in_host_memory_on_gpu.)"""
    kw = dict(zero_stage=3, mesh__data=4, mesh__tensor=2, model__remat="full")
    device = small_config(offload__activations="device", **kw)
    loss, grads, jaxpr = grads_and_jaxpr(device)
    host = small_config(offload__activations="host", model__mlp_chunks=mlp_chunks, **kw)
    loss_host, grads_host, jaxpr_host = grads_and_jaxpr(host)
    assert loss_host == pytest.approx(loss, rel=1e-6)
    # Sliced, the weight grads sum over the slices in another order: float32 rounding.
    atol = 1e-7 if mlp_chunks == 1 else 1e-6
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol), grads_host, grads
    )
    assert _stacked_inputs(jaxpr, device, "") >= 1 and _stacked_inputs(jaxpr, device, "<host>") == 0
    assert _stacked_inputs(jaxpr_host, host, "<host>") >= 1
    assert _stacked_inputs(jaxpr_host, host, "") == 0


@gpu
@pytest.mark.parametrize(
    "remat, activations, host_state",
    [("full", "host", "layer inputs"), ("offload_dots", "device", "offloaded activations")],
)
def test_offloaded_activations_live_in_host_memory_on_gpu(remat, activations, host_state):
    """The compiled step's host-memory temporaries are the plan's host activations (the
    stacked layer inputs, or offload_dots's matmul outputs), and the device's temporaries
    shrink by at least half as much against keeping them there (remat full, or dots_no_batch,
    with the layer inputs on the device)."""

    def compiled(remat, activations):
        config = small_config(
            mesh__data=1,
            model__remat=remat,
            model__dtype="bfloat16",
            model__d_model=512,
            model__ffn_dim=1024,
            model__num_layers=16,
            offload__activations=activations,
            train__batch_size=2,
            train__seq_len=8192,
        )
        exp = build(config, make_mesh(config.mesh, jax.devices()[:1]))
        return exp.plan, exp.steps.lowered().compile()

    plan, program = compiled(remat, activations)
    _, on_device = compiled("full" if remat == "full" else "dots_no_batch", "device")
    assert plan.placement[host_state] == HOST
    host, memory = plan.state_bytes[host_state], program.memory_analysis()
    # The plan's bytes are exact: 16 layers x 16384 tokens x 512 (layer inputs) or x 3584
    # (q, k, v, attention output, gate, up) x 2 bytes.
    assert host == pytest.approx(memory.host_temp_size_in_bytes, rel=0.02)
    # Not all of it: some stays on the device, the copies in flight each way.
    saved = on_device.memory_analysis().temp_size_in_bytes - memory.temp_size_in_bytes
    assert saved >= 0.5 * host, (saved, host)
    assert "S(5)" in program.as_text()  # Host memory space in the compiled HLO's layouts.


def test_checkpoint_names_the_offload_policy_it_was_saved_under(tmp_path):
    config = small_config(mesh__data=8)
    exp, state, _ = train(config, steps=1)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
    ckpt.save(1, exp.checkpointed(state), 1, exp.plan.policy)
    ckpt.close()
    with pytest.raises(ConfigError, match=r"laid out for config.offload.policy=none, but this"):
        Checkpointer(str(tmp_path), 1, 1).restore(1, exp.abstract_state, "optimizer")
