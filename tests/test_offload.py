"""ZeRO-Cache: the planner's placements and refusals, and offloaded training equal to on-device."""

import collections
import copy
import dataclasses
import functools
import json
import pathlib
import re
import sys
import types

import jax
import jax.extend.core
import numpy as np
import pytest

from angel_jax import sharding, steps
from angel_jax.checkpoint import Checkpointer
from angel_jax.config import ConfigError, load_config
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.offload import planner, stream, tiers
from angel_jax.offload.groups import (
    SLOT_MARGIN,
    beside_step_groups,
    chunk_part,
    group_chunks,
    new_compute_bytes,
    slot_order,
    slot_size,
)
from angel_jax.offload.planner import CompiledTooLarge, check_compiled
from angel_jax.offload.tiers import DEVICE, HOST, USABLE
from angel_jax.optim import Optimizer
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


@pytest.fixture(scope="module")
def eight_layers():
    """The small model with eight layers and one chunk in flight, trained on the device: its
    settings, its `optimizer` plan, the budget halfway between what `optimizer` and `none`
    need on the device (room for some update chunks), and the reference params and losses."""
    kw = dict(
        zero_stage=3,
        mesh__data=8,
        model__num_layers=8,
        offload__host_gib=64,
        offload__chunks_in_flight=1,
    )
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
    off, estimate = 3 * 2**19 * (-1 if outgrows else 1), planner.activation_bytes
    wrong = lambda c, m, r: {**estimate(c, m, r), "activations": temps + off - 2**18}
    assert estimate(small_config(**kw), mesh, "none")["layer inputs"] == 2**18
    monkeypatch.setattr(planner, "activation_bytes", wrong)
    plan = lambda policy: (
        build(small_config(offload__policy=policy, **kw), mesh, fit_compiled=False).plan
    )
    between = (plan("optimizer").tier_bytes(DEVICE) + plan("none").tier_bytes(DEVICE)) / 2
    # On a CPU, an emulated device budget is not checked against compiled sizes: here it is.
    monkeypatch.setattr(steps._Step, "checks_compiled", property(lambda self: True))
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


def test_auto_remat_is_the_fastest_that_fits():
    """config.model.remat=auto: the plan takes the first of dots_no_batch and full (no
    dots_attention on XLA's attention) whose activations fit beside the states, and the model
    is built with it: its step lowers to the program the same remat set by hand gives. The
    layer inputs go to host memory only when no remat fits without."""
    mesh = make_mesh(small_config(**WIDE).mesh)
    exp = lambda remat, gib=0, inputs="device": build(
        small_config(
            model__remat=remat, offload__device_gib=gib, offload__activations=inputs, **WIDE
        ),
        mesh,
        fit_compiled=False,
    )
    need = {r: exp(r).plan.tier_bytes(DEVICE) for r in ("dots_no_batch", "full")}
    inputs = exp("full").plan.state_bytes["layer inputs"]
    assert need["dots_no_batch"] - inputs / 2 > need["full"]
    gib = lambda nbytes: nbytes * 1.001 / USABLE / 2**30
    # Short of dots_no_batch's need by half the layer inputs.
    room = {"dots_no_batch": need["dots_no_batch"], "full": need["dots_no_batch"] - inputs / 2}
    for remat, device in room.items():
        picked = exp("auto", gib(device))
        assert picked.plan.remat == picked.model_config.remat == remat
        assert f"remat {remat})" in picked.plan.table()
        lowered = lambda e: e.steps.lowered().as_text()
        assert lowered(picked) == lowered(exp(remat))
    assert not exp("auto", gib(room["full"]), inputs="auto").plan.layer_inputs_on_host
    inputs_moved = exp("auto", gib(need["full"] - inputs / 2), inputs="auto").plan
    assert inputs_moved.remat == "full" and inputs_moved.layer_inputs_on_host
    with pytest.raises(ConfigError, match="do not fit"):
        exp("auto", gib(need["full"] * 0.9))


def test_auto_remat_tries_the_policies_by_what_they_recompute():
    """remat=auto tries its policies by the forward FLOPs their backward pass recomputes at
    the config's sequence length: at long context, where attention outweighs the weight
    matmuls, `attention` (the matmuls recomputed) before dots_no_batch (the attention's
    forward recomputed), at short context after it. With no attention results to keep (XLA's
    attention, no ring) neither dots_attention nor attention is offered; a ring has its own."""

    def choices(seq, context, data):
        config = small_config(
            model__remat="auto", train__seq_len=seq, mesh__context=context, mesh__data=data
        )
        return planner.remat_choices(config, make_mesh(config.mesh))

    # small_config's layer: 73,728 matmul FLOPs a token; attention 128 a key position.
    assert choices(32, 4, 2) == ("dots_attention", "dots_no_batch", "attention", "full")
    assert choices(4096, 4, 2) == ("dots_attention", "attention", "dots_no_batch", "full")
    # XLA's attention on the CPU, and no ring: context=-1 takes what data leaves, here 1.
    assert choices(4096, -1, 8) == ("dots_no_batch", "full")


@pytest.mark.parametrize("seq_len", [16384, 524288])
def test_auto_remat_weighs_the_inputs_copies_against_the_recompute_they_spare(seq_len):
    """With room on the device for full remat, or for attention with the layer inputs in host
    memory (the same bytes on llama_1b: its attention output is d_model wide), auto takes the
    one that costs less: at long context the inputs' copies cost less than recomputing the
    attention forward, at short context more (a ring over 8 devices: its results are kept)."""
    mesh_overrides = ["--config.mesh.data=1", "--config.mesh.context=8"]
    overrides = [
        *mesh_overrides,
        f"--config.train.seq_len={seq_len}",
        "--config.train.batch_size=1",
    ]
    overrides += ["--config.model.logits_chunks=8", "--config.offload.host_gib=64"]

    def plan(remat, inputs, gib=1000):
        config = load_config(
            "configs/llama_1b.py",
            [
                *overrides,
                f"--config.model.remat={remat}",
                f"--config.offload.activations={inputs}",
                f"--config.offload.device_gib={gib}",
            ],
        )
        return build(config, make_mesh(config.mesh), fit_compiled=False).plan

    need = lambda remat, inputs: plan(remat, inputs).tier_bytes(DEVICE)
    room = max(need("full", "device"), need("attention", "host"))
    assert room < need("attention", "device")
    picked = plan("auto", "auto", room * 1.001 / USABLE / 2**30)
    expected = ("attention", True) if seq_len > 65536 else ("full", False)
    assert (picked.remat, picked.layer_inputs_on_host) == expected


def test_auto_remat_takes_the_next_when_the_compiled_step_outgrows_the_device(monkeypatch):
    """An estimate that lets dots_no_batch fit where its compiled step does not: `build`
    compiles the step the loop runs, finds it too large before anything is allocated, and
    plans again with what it took: the next remat, which trains."""
    kw = dict(WIDE, monitor__on_anomaly="log")  # The loop's step is `train_step`, as compiled here.
    mesh = make_mesh(small_config(**kw).mesh)
    plan = lambda remat: build(small_config(model__remat=remat, **kw), mesh, fit_compiled=False)
    compiled_need = {}
    for remat in ("dots_no_batch", "full"):
        exp = plan(remat)
        temps = exp.steps.lowered().compile().memory_analysis().temp_size_in_bytes
        estimate = exp.plan.state_bytes["activations"] + exp.plan.state_bytes["layer inputs"]
        compiled_need[remat] = exp.plan.tier_bytes(DEVICE) - estimate + temps
    assert compiled_need["dots_no_batch"] > compiled_need["full"]
    # Room between the two compiled steps' needs, and no activations in dots_no_batch's
    # estimate.
    between = sum(compiled_need.values()) / 2 / USABLE / 2**30
    estimate = planner.activation_bytes
    wrong = lambda c, m, r: {**estimate(c, m, r), **({"activations": 0} if r != "full" else {})}
    monkeypatch.setattr(planner, "activation_bytes", wrong)
    monkeypatch.setattr(steps._Step, "checks_compiled", property(lambda self: True))
    config = small_config(model__remat="auto", offload__device_gib=between, **kw)
    assert build(config, mesh, fit_compiled=False).plan.remat == "dots_no_batch"
    exp, _, losses = train(config)
    assert exp.plan.remat == exp.model_config.remat == "full"
    assert np.isfinite(losses).all()


def test_auto_remat_takes_a_faster_one_when_the_compiled_step_leaves_room(monkeypatch):
    """Estimates three times too large: they let only full fit; its compiled step comes in
    under the estimate, the faster dots_no_batch's estimate scaled alike fits, and so does its
    compiled step: `build` takes it."""
    kw = dict(WIDE, monitor__on_anomaly="log")
    mesh = make_mesh(small_config(**kw).mesh)
    plan = lambda remat: build(small_config(model__remat=remat, **kw), mesh, fit_compiled=False)
    exp = plan("dots_no_batch")
    b = exp.plan.state_bytes
    temps = exp.steps.lowered().compile().memory_analysis().temp_size_in_bytes
    compiled_need = exp.plan.tier_bytes(DEVICE) - b["activations"] - b["layer inputs"] + temps
    inflated = lambda e: e.plan.tier_bytes(DEVICE) + 2 * e.plan.state_bytes["activations"]
    usable = (inflated(plan("full")) + inflated(exp)) / 2  # Between their inflated needs.
    assert compiled_need < usable
    estimate = planner.activation_bytes
    wrong = lambda c, m, r: {**(e := estimate(c, m, r)), "activations": 3 * e["activations"]}
    monkeypatch.setattr(planner, "activation_bytes", wrong)
    monkeypatch.setattr(steps._Step, "checks_compiled", property(lambda self: True))
    config = small_config(model__remat="auto", offload__device_gib=usable / USABLE / 2**30, **kw)
    assert build(config, mesh, fit_compiled=False).plan.remat == "full"
    compiles = []
    compile = jax.stages.Lowered.compile
    counted = lambda self, *args, **kw: compiles.append(self) or compile(self, *args, **kw)
    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    exp, _, losses = train(config)
    assert exp.plan.remat == exp.model_config.remat == "dots_no_batch"
    assert len(compiles) == 2  # full's step, then the one trained.
    assert np.isfinite(losses).all()


def test_microbatch_grads_are_planned_in_the_steps_temporaries():
    """Accumulating, the grads kept are the float32 sum; each microbatch's compute-dtype
    grads live in the compiled step's temporaries, counted with the step's activations and
    not during the update (on the H200 the 8B 128k step peaked 14.6 GiB under a plan that
    counted them as lasting grads)."""
    kw = dict(offload__policy="optimizer", model__d_model=256, model__ffn_dim=512)
    config = small_config(microbatches=2, model__dtype="bfloat16", **kw)
    exp = build(config, make_mesh(config.mesh))
    b, params = exp.plan.state_bytes, exp.plan.num_params
    assert b["grads"] == 4 * params and b["microbatch grads"] == 2 * params
    compute_dtype_only = dataclasses.replace(
        exp.plan, state_bytes={**b, "activations": 0, "layer inputs": 0}
    )
    lasting = b["compute params"] + b["grads"]
    step = b["microbatch grads"] + b["chunks beside the step"]
    assert compute_dtype_only.tier_bytes(DEVICE) == lasting + max(step, b["update chunks"])
    temps = exp.steps.grad_step.memory_analysis().temp_size_in_bytes
    assert temps >= b["microbatch grads"]


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

    write = ssd.SSDStore._write
    monkeypatch.setattr(ssd.SSDStore, "_write", lambda *a: (time.sleep(0.05), write(*a))[1])
    kw, _, _ = three_tiers
    config = small_config(offload__ssd_dir=str(tmp_path), **kw)
    exp = build(config, make_mesh(config.mesh))
    put, in_flight = exp.ssd.put, []

    def counting_put(*args):
        futures = put(*args)
        in_flight.append(sum(not f.done() for f in exp.ssd.masters._writes))
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
    for master, opt in cpu._values.values():
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
    plan = planner.Plan(
        "optimizer",
        "none",
        {},
        {"master params": 4 * gib, "optimizer state": 8 * gib},
        {},
        2**30,
        1,
    )
    chunks = [((f"w{i}", None), gib // 8, gib // 4) for i in range(32)]
    out = planner._with_cpu_update(plan, 0.25, chunks)
    assert len(out.on_cpu) == 8 and "25% of the host chunks" in out.cpu_note
    assert out.state_bytes["CPU-updated chunks"] == 8 * (gib // 8 + gib // 4)
    assert out.state_bytes["master params"] == 4 * gib - gib
    # Every fourth chunk, not a quarter of them in a row.
    assert sorted(int(k[0][1:]) for k in out.on_cpu) == list(range(1, 32, 4))
    assert planner._with_cpu_update(plan, 0.0, chunks) is plan
    assert len(planner._with_cpu_update(plan, 1.0, chunks).on_cpu) == 32


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

    share, note = planner.hybrid_share(rates, chunks, 2)
    grid = np.linspace(0, 1, 1001)
    assert seconds(share) <= min(seconds(s) for s in grid) + 1e-15
    assert 0.2 < share < 0.4 and f"picked {share:.0%}" in note and "1.40G params/s" in note
    # The same host beside copies that halve when both run (as on the H200): it does not pay.
    slowed = dict(rates, host_params_per_s_both=0.7e9, copy_bytes_per_s_both=19e9)
    share, note = planner.hybrid_share(slowed, chunks, 2)
    best = min(seconds(s, 19e9, 0.7e9) for s in grid)
    assert best > 0.95 * seconds(0.0)  # Against the device alone at its own rates.
    assert share == 0 and "picked 0" in note and "together 0.70G and 19.0 GB/s" in note
    assert planner.hybrid_share(dict(rates, host_params_per_s_both=0.0), chunks, 2)[0] == 0


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


@pytest.mark.parametrize(
    "guarded, kw",
    [
        (False, DELAYED),
        (True, DELAYED),
        # The update between the next step's microbatches.
        (False, dict(DELAYED, microbatches=4, train__batch_size=32)),
        (True, dict(DELAYED, microbatches=4, train__batch_size=32)),
        (
            False,
            dict(
                DELAYED,
                zero_stage=2,
                microbatches=2,
                model__remat="full",
                offload__policy="params",  # Grads arrive in host memory, one array per layer.
            ),
        ),
    ],
)
def test_delayed_update_applies_each_steps_grads_a_step_late(guarded, kw):
    """config.offload.delayed_update: step t+1 computes on the weights without step t's update,
    which runs while it computes (ZeRO-Offload's DPU), on the host's cores for half the host
    chunks and on the device for the rest; in the plain step and in the one that skips
    anomalies (the loop's default), between the next step's microbatches (whose later ones
    must not see the groups updated before them), and with layer streaming. The losses and the
    settled params are that schedule run by hand with the undelayed experiment's parts."""
    config = small_config(offload__delayed_update=True, **kw)
    exp = build(config, make_mesh(config.mesh))
    between = kw.get("microbatches", 1) > 1 and kw["offload__policy"] == "optimizer"
    assert exp.steps.between_microbatches == between
    state, losses = exp.init_state(), []
    for rows in make_batches(config)[:3]:
        args = (np.inf,) if guarded else ()
        step = exp.guarded_train_step if guarded else exp.train_step
        state, metrics = step(state, exp.global_batch(rows), *args)
        losses.append(float(metrics["loss"]))
    params = exp.params_numpy(exp.settled(state))

    ref = build(small_config(**kw), make_mesh(config.mesh))
    batch = [ref.global_batch(b) for b in make_batches(config)[:3]]
    grad_step, apply, s = ref.steps.grad_step, ref.steps.apply, ref.init_state()
    with sharding.use_rules(ref.mesh, ref.rules):
        n1, g1, c1, m1 = grad_step(s.step, s.compute_params, batch[0])
        n2, g2, c2, m2 = grad_step(n1, s.compute_params, batch[1])  # Still the first weights.
        s = apply(s, n1, g1, c1)
        n3, g3, c3, m3 = grad_step(n2, s.compute_params, batch[2])
        s = apply(apply(s, n2, g2, c2), n3, g3, c3)
    assert losses == [float(m["loss"]) for m in (m1, m2, m3)]
    assert int(s.step) == 3
    jax.tree.map(np.testing.assert_array_equal, params, ref.params_numpy(s))


@pytest.mark.parametrize("delayed", [False, True])
def test_update_fetches_its_first_chunks_before_the_step_is_dispatched(delayed):
    """The runtime starts a copy only after the device work queued before it: the update's
    first in_flight // 2 chunks are fetched before the forward/backward whose grads they take
    (delayed: the one they run beside) is dispatched, the rest after it."""
    config = small_config(
        offload__policy="optimizer", offload__chunks_in_flight=6, offload__delayed_update=delayed
    )
    exp = build(config, make_mesh(config.mesh))
    update, events = exp.streamed_update, []
    grad_step, fetch = exp.steps.grad_step, update._fetch

    def logged_grad_step(*args):
        events.append("step")
        return grad_step(*args)

    def logged_fetch(k, *args):
        events.append(k)
        return fetch(k, *args)

    exp.steps.grad_step = logged_grad_step  # Before train_step is built: it keeps this one.
    update._fetch = logged_fetch
    state = exp.init_state()
    for rows in make_batches(config)[:2]:
        state, _ = exp.train_step(state, exp.global_batch(rows))
    prefetched = [0, 1, 2, "step", *range(3, len(update.groups))]
    # Delayed: the first step's dispatch has no update waiting to fetch for.
    assert events == (["step"] if delayed else prefetched) + prefetched, events


def _logged_dispatches(exp) -> list[str]:
    """What `exp`'s offloaded steps dispatch from here on, in order: "microbatch" (a
    microbatch's program), "fetch g" and "update g" (group g's copies up and program), "home
    g" (group g waited home)."""
    update, events = exp.streamed_update, []
    group = {tuple(ks): g for g, ks in enumerate(update.groups)}
    microbatch, fetch, fn, send_off = exp.steps.program, update._fetch, update._fn, update._send_off

    def logged(event, call):
        def run(*args):
            events.append(event(*args))
            return call(*args)

        return run

    exp.steps.program = logged(lambda *_: "microbatch", microbatch)
    update._fetch = logged(lambda g, *_: f"fetch {g}", fetch)
    update._fn = logged(lambda ks, *_: f"update {group[tuple(ks)]}", fn)
    update._send_off = logged(lambda entry: f"home {entry[3]}", send_off)
    return events


@pytest.mark.parametrize("microbatches, tight", [(4, False), (2, True)])
def test_delayed_update_runs_between_the_next_steps_microbatches(microbatches, tight):
    """With microbatches the waiting update's groups are dispatched between the next step's
    microbatch programs, one after each but the last (`Plan.slot_bytes`): a group is fetched
    before the microbatch before it is dispatched, so that its copies run beside it, as do
    the copies home of the group before; the groups past the slots (here with room for two
    of the largest chunks only) run after the last."""
    config = small_config(
        microbatches=microbatches,
        train__batch_size=8 * microbatches,
        offload__delayed_update=True,
        **DELAYED,
    )
    mesh = make_mesh(config.mesh)
    if tight:
        loose = build(config, mesh, fit_compiled=False)
        largest = max(stream.chunk_bytes(c) for c in loose.streamed_update.chunks)
        # And for the new compute copy, which smaller groups may make larger.
        new_copy = loose.plan.state_bytes["new compute params"]
        whole_copy = loose.plan.state_bytes["compute params"]
        need = loose.plan.tier_bytes(DEVICE) - 2 * loose.plan.slot_bytes + 2 * largest
        need += whole_copy - new_copy
        config.offload.device_gib = need * 1.001 / USABLE / 2**30
    exp = build(config, mesh)
    assert exp.plan.update_between_microbatches and exp.steps.between_microbatches
    update, events = exp.streamed_update, _logged_dispatches(exp)
    state = exp.init_state()
    for rows in make_batches(config)[:2]:
        state, _ = exp.train_step(state, exp.global_batch(rows))
        events.append("end")
    dispatched = " ".join(e for e in events if not e.startswith("home"))
    first, second = (s.strip() for s in dispatched.split("end")[:2])
    assert first == " ".join(["microbatch"] * microbatches), first  # Nothing waits yet.
    n, slots = len(update.groups), microbatches - 1
    assert update.slots(slots) == [1] * slots
    assert n > slots if tight else n == slots, update.groups
    then = lambda g: [f"update {g}", *([f"fetch {g + 1}"] if g + 1 < n else [])]
    expected = ["fetch 0"]
    for j in range(microbatches):
        expected += ["microbatch", *(then(j) if j < slots else [])]
    expected += [e for g in range(slots, n) for e in then(g)]
    assert second == " ".join(expected), second


def _budget_for_slots(config, slot_bytes) -> tuple[float, list[int]]:
    """(The device budget, GiB, whose room beside the microbatches takes two slots of
    `slot_bytes(sizes)` bytes and the new compute copy of their groups, as the planner makes
    them; the moved chunks' bytes `sizes`, in the update's order) for `config`'s delayed
    update between microbatches."""
    loose = build(config, make_mesh(config.mesh), fit_compiled=False)
    assert loose.plan.update_between_microbatches
    chunks = loose.streamed_update.chunks
    sizes, chunk_tiers = [stream.chunk_bytes(c) for c in chunks], [c.tier for c in chunks]
    slot = slot_bytes(sizes)
    order = slot_order(sizes, chunk_tiers, slot)
    keys = [jax.tree_util.keystr(chunks[k].path) for k in order]
    parts = [chunk_part(key) for key in keys]
    in_order = ([x[k] for k in order] for x in (sizes, chunk_tiers))
    groups = group_chunks(*in_order, parts, 2, slot)
    compute = jax.tree_util.tree_leaves_with_path(loose.abstract_state.compute_params)
    weight_bytes = {jax.tree_util.keystr(k): (planner.local_bytes(p),) * 2 for k, p in compute}
    new_copy = new_compute_bytes(groups, keys, weight_bytes)
    held = loose.plan.state_bytes
    without = loose.plan.tier_bytes(DEVICE) - held["chunks beside the step"]
    without -= held["new compute params"]
    return (without + 2 * slot + new_copy) / USABLE / 2**30, sizes


def _slots_without_the_largest_chunks(data: int = 8):
    """(The delayed update's config between 4 microbatches, on `data` devices, with a device
    budget whose room takes slots of the other chunks' even share, the largest chunk's bytes):
    its two largest chunks are the embedding's and the LM head's, the update's first and
    last."""
    kw = dict(DELAYED, offload__cpu_update=0, mesh__data=data)
    config = small_config(microbatches=4, train__batch_size=32, offload__delayed_update=True, **kw)
    # The slots of the other chunks' even share, as the planner makes them.
    others = lambda sizes: slot_size([n for n in sizes if n < max(sizes)], 3)
    config.offload.device_gib, sizes = _budget_for_slots(config, others)
    largest = max(sizes)
    assert [k for k, n in enumerate(sizes) if n == largest] == [0, len(sizes) - 1]
    return config, largest


def test_update_between_microbatches_needs_most_of_the_update_beside_them():
    """Slots that leave most of the moved bytes after the last microbatch (here the one slot
    of 2 microbatches takes a third of them: the groups past it wait too) leave the update
    after the step, and the room to resident chunks."""
    kw = dict(DELAYED, microbatches=2, offload__delayed_update=True, offload__cpu_update=0)
    config = small_config(**kw)
    config.offload.device_gib, sizes = _budget_for_slots(config, lambda sizes: sum(sizes) // 3)
    assert max(sizes) <= sum(sizes) // 3
    plan = build(config, make_mesh(config.mesh), fit_compiled=False).plan
    assert not plan.update_between_microbatches, plan.slot_bytes


def test_update_between_microbatches_runs_chunks_larger_than_a_slot_after_the_last_one():
    """Where the room beside the microbatches takes slots smaller than the largest chunks (as
    the 8B's embedding and LM head), those come last, each a group of its own (the embedding
    is the update's first chunk): they are fetched once the last microbatch is dispatched, not
    beside it, and the last goes home before the next step, whose microbatches count slots
    beside them only. The plan counts the two of them after the microbatches."""
    config, largest = _slots_without_the_largest_chunks()
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)
    plan, update = exp.plan, exp.streamed_update
    assert plan.update_between_microbatches and plan.slot_bytes < largest
    n = len(update.groups)
    last = len(update.chunks) - 1
    assert update.groups[-2:] == [[last - 1], [last]], update.groups
    assert [stream.chunk_bytes(c) for c in update.chunks[-2:]] == [largest] * 2
    # Not between microbatches, however many there are.
    assert update.between_groups == n - 2 and update.slots(n + 1) == [1] * (n - 2) + [0] * 3
    assert plan.state_bytes["update chunks"] == 2 * largest

    events = _logged_dispatches(exp)
    state = exp.init_state()
    for rows in make_batches(config)[:2]:  # The second step runs the first one's update.
        events.clear()
        state, _ = exp.train_step(state, exp.global_batch(rows))
    last_microbatch = max(i for i, e in enumerate(events) if e == "microbatch")
    assert events.index(f"fetch {n - 2}") > last_microbatch, events
    assert events[-1] == f"home {n - 1}", events  # Home before the next step.


@pytest.mark.parametrize("data", [8, pytest.param(1, marks=gpu, id="gpu")])
def test_update_between_microbatches_with_chunks_after_them_trains_alike(data, monkeypatch):
    """The update with its largest chunks after the microbatches (`slot_order`) is the same
    update in another order: the same losses and state as the one that runs them between.
    On a GPU too, where copies take their time and a group's old host copies are deleted as
    its copies up may still run."""
    # The budget is the planner's estimate's (as on the CPU, where a set budget is not
    # checked): a GPU's compiled step may take more than that tight room.
    monkeypatch.setattr(steps._Step, "checks_compiled", property(lambda self: False))
    tail_config, _ = _slots_without_the_largest_chunks(data)
    loose_config = copy.deepcopy(tail_config)
    loose_config.offload.device_gib = 0.0
    runs = []
    for config in (tail_config, loose_config):
        exp = build(config, make_mesh(config.mesh), fit_compiled=False)
        assert exp.steps.between_microbatches
        state, losses = exp.init_state(), []
        for rows in make_batches(config)[:3]:
            state, metrics = exp.train_step(state, exp.global_batch(rows))
            losses.append(float(metrics["loss"]))
        groups = exp.streamed_update
        runs.append((losses, exp.settled(state), groups.between_groups < len(groups.groups)))
    (tail_losses, tail_state, after), (losses, state, none_after) = runs
    assert after and not none_after
    assert tail_losses == losses
    assert_updated_alike(tail_state, state)


def _device_bytes(device) -> int:
    """The bytes of the live arrays' buffers on `device`'s device memory (once each: an
    array's shards are arrays too)."""
    buffers = {}
    for x in jax.live_arrays():
        if x.is_deleted() or x.sharding.memory_kind not in (None, "device"):
            continue
        for shard in x.addressable_shards:
            if shard.device == device:
                buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


@pytest.mark.parametrize("larger_chunks_after", [False, True])
def test_update_between_microbatches_holds_no_more_than_its_plan(larger_chunks_after, monkeypatch):
    """What the device holds as the runtime sees it (its live arrays, the allocator's view)
    is within the plan, each phase against its own count: at each microbatch's dispatch, with
    that program's temporaries, the step's peak as `check_compiled` counts it (the fetched
    group and the one on its way home: "chunks beside the step"); at each group's dispatch the
    update's ("update chunks": two groups, the larger ones after the last microbatch); and
    beside the next step's first microbatch at most a slot on its way home. Besides, the
    waiting grads as they go and the new compute copy as it comes. (On the H200 the 8B's
    first delayed run had three groups on the device, and a new copy the plan undercounted:
    out of device memory at its third step.)

    As on a GPU, no copy is found done before it is waited for (on the CPU they are done at
    once, and the groups on their way home would go early)."""
    monkeypatch.setattr(stream, "_done", lambda x: not isinstance(x, jax.Array) or x.is_deleted())
    if larger_chunks_after:
        config, _ = _slots_without_the_largest_chunks()
    else:  # The host cores' chunks stay out: on the CPU they are the device's arrays.
        kw = dict(DELAYED, offload__cpu_update=0)
        config = small_config(
            microbatches=4, train__batch_size=32, offload__delayed_update=True, **kw
        )
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)
    plan, update, device = exp.plan, exp.streamed_update, jax.devices()[0]
    assert exp.steps.between_microbatches
    assert (update.between_groups < len(update.groups)) == larger_chunks_after
    microbatch, fn = exp.steps.program, update._fn
    temps = microbatch.memory_analysis().temp_size_in_bytes
    at_microbatches, at_groups, left_beside_next = [], [], []

    def logged_microbatch(*args):
        at_microbatches.append(_device_bytes(device) + temps)
        return microbatch(*args)

    def logged_fn(ks, *args):
        at_groups.append(_device_bytes(device))
        return fn(ks, *args)

    exp.steps.program, update._fn = logged_microbatch, logged_fn
    before = _device_bytes(device)  # Other tests' arrays still alive in this process.
    state = exp.init_state()
    for rows in make_batches(config)[:3]:
        state, _ = exp.train_step(state, exp.global_batch(rows))
        left_beside_next.append(sum(update.group_bytes[e[3]] for e in update._leaving))
    phase = lambda zeroed: {s: 0 if s in zeroed else n for s, n in plan.state_bytes.items()}
    step = dataclasses.replace(plan, state_bytes=phase(planner.UPDATE_ONLY))
    after_step = dataclasses.replace(plan, state_bytes=phase(planner.STEP_ONLY))
    before += 2**14  # The batch, metrics, counters and layer indices: not in the plan.
    step_peak = planner.compiled_peak(step, temps)
    assert max(at_microbatches) - before <= step_peak, (at_microbatches, before, step_peak)
    update_peak = after_step.tier_bytes(DEVICE)
    assert max(at_groups) - before <= update_peak, (at_groups, before, update_peak)
    assert update.most_in_flight <= 2
    assert update.most_bytes_in_flight <= plan.state_bytes["update chunks"]
    assert max(left_beside_next) <= plan.slot_bytes, (left_beside_next, plan.slot_bytes)


def test_update_between_microbatches_frees_a_groups_host_copies_before_its_new_ones(
    monkeypatch,
):
    """A slot's group is large: once on the device its old host copies go, before its copies
    home are made, so that the pinned pool holds it once (the 8B's ran the pool out)."""
    config = small_config(
        microbatches=4, train__batch_size=32, offload__delayed_update=True, **DELAYED
    )
    exp = build(config, make_mesh(config.mesh))
    update, events = exp.streamed_update, []
    move, delete = update._move, stream._delete

    def logged_move(ks, leaves, to_device):
        events.append("home" if not to_device else "fetch")
        return move(ks, leaves, to_device)

    def logged_delete(arrays):
        events.append("delete" if arrays else "nothing")
        return delete(arrays)

    monkeypatch.setattr(update, "_move", logged_move)
    monkeypatch.setattr(stream, "_delete", logged_delete)
    state = exp.init_state()
    for rows in make_batches(config)[:2]:
        state, _ = exp.train_step(state, exp.global_batch(rows))
    homes = [i for i, e in enumerate(events) if e == "home"]
    assert len(homes) == len(update.groups), events
    assert all(events[i - 1] == "delete" for i in homes), events


def test_delayed_update_is_settled_before_a_checkpoint(tmp_path):
    """The training loop applies the waiting update before it saves: a run stopped at its
    checkpoint and resumed logs the uninterrupted run's losses, bitwise."""
    from angel_jax.loop import train_loop

    def run(workdir, steps):
        config = small_config(offload__delayed_update=True, **DELAYED)
        config.train.update(steps=steps, log_every_steps=1)
        config.checkpoint.every_steps = 2
        train_loop(config, str(workdir))
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, lines))}

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "resumed", 2)
    assert run(tmp_path / "resumed", 4) == whole


def test_delayed_update_plans_the_waiting_grads():
    """The waiting grads are the compute-dtype grads, or their float32 sum when accumulating:
    what the plan's "grads" count."""
    for microbatches in (1, 2):
        config = small_config(microbatches=microbatches, offload__delayed_update=True, **DELAYED)
        plan = build(config, make_mesh(config.mesh)).plan
        grads = plan.state_bytes["grads"]
        assert plan.state_bytes["delayed grads"] == pytest.approx(grads, 1e-3)
        assert plan.placement["delayed grads"] == DEVICE


def test_update_between_microbatches_plans_its_chunks_and_new_compute_copy():
    """Between the next step's microbatches the update's groups spread its moved chunks over
    the slots (one fetched and one on its way home beside each microbatch), and the plan
    counts the new compute copy beyond the waiting grads that go as it is made, as the
    runtime's groups make it (a weight's copy at its first group, its grads gone after its
    last). Without room for two of the largest moved chunks the update runs after the step,
    holding neither."""
    # One slot: its even share is more than the largest chunk.
    kw = dict(DELAYED, microbatches=2, offload__delayed_update=True)
    mesh = make_mesh(small_config().mesh)
    exp = build(small_config(**kw), mesh)
    plan, update = exp.plan, exp.streamed_update
    assert plan.update_between_microbatches and exp.steps.between_microbatches
    # The new copy as the runtime's groups make it (the planner's are the same groups).
    # ZeRO-1: grads and the float32 compute copy alike, replicated.
    compute = jax.tree_util.tree_leaves_with_path(exp.abstract_state.compute_params)
    weight_bytes = {jax.tree_util.keystr(k): (planner.local_bytes(p),) * 2 for k, p in compute}
    keys = [jax.tree_util.keystr(c.path) for c in update.chunks]
    new_copy = new_compute_bytes(update.groups, keys, weight_bytes)
    assert plan.state_bytes["new compute params"] == new_copy > 0
    moved = [stream.chunk_bytes(c) for c in update.chunks if c.tier == HOST]
    group_bytes = lambda u: [sum(stream.chunk_bytes(u.chunks[k]) for k in ks) for ks in u.groups]
    assert plan.slot_bytes == int(SLOT_MARGIN * sum(moved)), (plan.slot_bytes, moved)
    assert max(group_bytes(update)) <= plan.slot_bytes and update.in_flight == 2
    for held in ("chunks beside the step", "update chunks"):
        assert plan.state_bytes[held] == 2 * plan.slot_bytes
    without = plan.tier_bytes(DEVICE) - 2 * plan.slot_bytes - new_copy
    tight = (without + 2 * max(moved) - 1) / USABLE / 2**30  # Not even a new copy.
    exp = build(small_config(offload__device_gib=tight, **kw), mesh)
    assert not (exp.plan.update_between_microbatches or exp.steps.between_microbatches)
    assert "new compute params" not in exp.plan.state_bytes


def test_update_between_microbatches_taken_once_the_compiled_step_gives_room(monkeypatch):
    """An estimate of the step's temporaries that leaves no room for the delayed update
    between microbatches, where the compiled step's leave it: `build` plans again with them
    and takes the update between microbatches, its own program (a microbatch's) compiled and
    checked against the plan made again."""
    kw = dict(DELAYED, microbatches=2, offload__delayed_update=True)
    mesh = make_mesh(small_config().mesh)
    exact = build(small_config(**kw), mesh)
    temps = exact.steps.program.memory_analysis().temp_size_in_bytes
    held = {s: exact.plan.state_bytes[s] for s in ("layer inputs", "microbatch grads")}
    estimate, over = planner.activation_bytes, 2 * exact.plan.slot_bytes
    over += exact.plan.state_bytes["new compute params"]  # No room for slots at all.
    wrong = lambda c, m, r: {**estimate(c, m, r), "activations": temps + over - sum(held.values())}
    monkeypatch.setattr(planner, "activation_bytes", wrong)
    monkeypatch.setattr(steps._Step, "checks_compiled", property(lambda self: True))
    # Room for the update between microbatches with the compiled temporaries, not the estimate.
    need = exact.plan.tier_bytes(DEVICE) + temps - sum(held.values())
    need -= exact.plan.state_bytes["activations"]
    budget = need * 1.01 / USABLE / 2**30
    config = small_config(offload__device_gib=budget, **kw)
    assert not build(config, mesh, fit_compiled=False).plan.update_between_microbatches
    exp = build(config, mesh)
    assert exp.plan.update_between_microbatches and exp.steps.between_microbatches
    assert "finish_program" in vars(exp.steps)  # The step's last program, checked too.
    assert exp.plan.state_bytes["activations"] == pytest.approx(
        temps - sum(held.values()), rel=0.05
    )


def test_a_plan_made_again_between_microbatches_reuses_the_program_that_ends_the_step():
    """A plan made again for the same programs (`build`'s re-plans) takes the compiled
    microbatch program and the one that ends the step from the plan before, not compiled
    again; the latter is checked against the new plan when used."""
    kw = dict(DELAYED, microbatches=2, offload__delayed_update=True)
    mesh = make_mesh(small_config().mesh)
    before = build(small_config(**kw), mesh, fit_compiled=False)
    _ = before.steps.program  # Both compiled (and checked).
    again = build(small_config(**kw), mesh, fit_compiled=False)
    assert again.steps.between_microbatches and again.steps.reuse_program(before.steps)
    assert again.steps._finish_unchecked is before.steps._finish_unchecked
    assert again.steps.finish_program is before.steps._finish_unchecked


def test_delayed_update_needs_an_offloaded_update():
    with pytest.raises(ConfigError, match="delayed_update=true delays the offloaded"):
        build(small_config(offload__delayed_update=True), make_mesh(small_config().mesh))


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


def test_unrolled_layers_share_the_streamed_updates_programs():
    """With the layers unrolled each layer's weights are other weights, yet the streamed
    update compiles as many programs for 4 layers as for 2: the groups are cut at the
    layers' bounds and a program is keyed by what it computes, not by which weights."""
    programs = {}
    for layers in (2, 4):
        config = small_config(**IN_STEP, model__num_layers=layers, offload__chunks_in_flight=4)
        exp = build(config, make_mesh(config.mesh))
        state = exp.init_state()
        exp.train_step(state, exp.global_batch(make_batches(config)[0]))
        update = exp.streamed_update
        programs[layers] = len(update._fns)
        assert programs[layers] < len(update.groups), (programs, update.groups)
        parts = [{chunk_part(update.chunks[k].key) for k in ks} for ks in update.groups]
        assert all(len(p) == 1 for p in parts), parts  # No group spans two layers.
    assert programs[2] == programs[4], programs


@pytest.mark.parametrize(
    "kw",
    [
        dict(zero_stage=1, mesh__data=8, offload__chunks_in_flight=3),
        dict(
            zero_stage=3,
            mesh__data=4,
            mesh__tensor=2,
            train__optimizer="adafactor",
            train__grad_clip=0.0,
        ),
    ],
)
def test_update_in_step_equals_the_streamed_update(kw, monkeypatch):
    """config.offload.update_in_step: the update inside the forward/backward's program gives
    the streamed update's losses and params (this step's grads, clipped alike), and the
    streamed update never runs."""
    _, ref_state, ref_losses = train(small_config(**IN_STEP, **kw))

    def streamed(*args, **kwargs):
        raise AssertionError("the streamed update ran")

    monkeypatch.setattr(stream.StreamedUpdate, "__call__", streamed)
    exp, state, losses = train(small_config(**IN_STEP, offload__update_in_step=True, **kw))
    assert isinstance(exp.steps, steps.InStepUpdate)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    assert_updated_alike(state, ref_state)


def test_update_in_step_leaves_out_an_anomalous_steps_update():
    """The guarded step (the loop's default) keeps the state of a skipped step bitwise, and
    runs the streamed update's guarded steps otherwise."""
    ceilings = (0.0, np.inf, np.inf)  # Every loss is above 0: the first step is skipped.
    runs, initial = [], None
    for in_step in (True, False):
        config = small_config(**IN_STEP, offload__update_in_step=in_step)
        exp = build(config, make_mesh(config.mesh))
        state = exp.init_state()
        before = jax.device_get(state)
        initial = before.params if initial is None else initial
        batch = exp.global_batch(make_batches(config)[0])
        skipped = []
        for ceiling in ceilings:
            state, metrics = exp.guarded_train_step(state, batch, ceiling)
            skipped.append(int(metrics["skipped"]))
            if len(skipped) == 1 and in_step:
                assert_updated_alike(state, before, np.testing.assert_array_equal)
        runs.append((skipped, exp.params_numpy(state)))
    assert runs[0][0] == runs[1][0] == [1, 0, 0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), *(p for _, p in runs)
    )
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), runs[0][1], initial)
    assert all(jax.tree.leaves(moved))


SPECULATING = dict(IN_STEP, offload__update_in_step=True, offload__speculative_update=True)


@pytest.mark.parametrize("guarded", [False, True], ids=["train_step", "guarded"])
@pytest.mark.parametrize(
    "clip, speculated, redone",
    [
        # Every step clips at 1e-3: the first is speculated and redone, the rest exact.
        (1e-3, [1, 0, 0, 0], [1, 0, 0, 0]),
        # The norms (about 16, 14.5, 3.8, 2.0) pass 10 twice: the first step is redone, the
        # second (exact) clips too, the third (exact) does not, so the fourth speculates.
        (10.0, [1, 0, 0, 1], [1, 0, 0, 0]),
        (1e6, [1, 1, 1, 1], [0, 0, 0, 0]),  # None clips.
    ],
)
def test_speculative_update_in_step_equals_the_exact_one(clip, speculated, redone, guarded):
    """config.offload.speculative_update: a speculated step that clips is updated again from
    the old state, one that does not keeps its speculated update, and a step after one that
    clipped runs the exact program; either way losses and state equal the update in the step
    that waits for the norm. Guarded (the loop's default step), with no step anomalous,
    alike."""
    kw = dict(zero_stage=1, mesh__data=8, offload__chunks_in_flight=3, train__grad_clip=clip)
    config = small_config(**IN_STEP, offload__update_in_step=True, **kw)
    _, ref_state, ref_losses = train(config, steps=4)
    config = small_config(**SPECULATING, **kw)
    exp = build(config, make_mesh(config.mesh))
    # A redo sends every group home: no later step would send one off. (On the CPU the copies
    # are done at once, so `_leaving` below is empty either way.)
    assert not exp.streamed_update.beside_step
    state, losses, flags = exp.init_state(), [], []
    step = functools.partial(exp.guarded_train_step, ceiling=np.inf) if guarded else exp.train_step
    for rows in make_batches(config)[:4]:
        state, metrics = step(state, exp.global_batch(rows))
        losses.append(float(metrics["loss"]))
        flags.append((int(metrics["speculated"]), int(metrics["update_redone"])))
        # A redo leaves nothing on its way home: no later step would send it off.
        assert not exp.streamed_update._leaving
    assert flags == list(zip(speculated, redone, strict=True))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_updated_alike(state, ref_state)


def test_speculative_update_in_step_keeps_an_anomalous_steps_state():
    """A skipped step (its loss above the ceiling) keeps the old state bitwise, not the
    speculated update; later steps equal the update that waits for the norm."""
    finals = []
    for speculative in (False, True):
        config = small_config(**IN_STEP, offload__update_in_step=True, train__grad_clip=1e6)
        config.offload.speculative_update = speculative
        exp = build(config, make_mesh(config.mesh))
        state = exp.init_state()
        before = jax.device_get(state)
        batch = exp.global_batch(make_batches(config)[0])
        flags = []
        for ceiling in (0.0, np.inf, np.inf):  # Every loss is above 0: the first is skipped.
            state, metrics = exp.guarded_train_step(state, batch, ceiling)
            flags.append((int(metrics["skipped"]), int(metrics.get("update_redone", 0))))
            if len(flags) == 1:
                assert_updated_alike(state, before, np.testing.assert_array_equal)
        assert flags == [(1, 0), (0, 0), (0, 0)]
        finals.append(exp.params_numpy(state))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), *finals)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), finals[1], before.params)
    assert all(jax.tree.leaves(moved))


def _depends_on(jaxpr, sources) -> set:
    """The variables of `jaxpr` computed from any of `sources` (an equation's outputs depend
    on all its inputs: nested programs count as one equation)."""
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jax.extend.core.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return reached


@pytest.mark.parametrize("speculative", [False, True])
def test_speculative_update_in_step_never_waits_for_the_norm(speculative):
    """Speculating, no chunk's new master or state is computed from the global grad norm or
    the loss ceiling, so XLA may update each chunk as soon as the backward pass leaves it;
    the update that waits for the norm reads both."""
    config = small_config(**IN_STEP, offload__update_in_step=True, train__grad_clip=1.0)
    config.offload.speculative_update = speculative
    exp = build(config, make_mesh(config.mesh))
    ceiling = jax.ShapeDtypeStruct((), np.float32)
    with sharding.use_rules(exp.mesh, exp.rules):
        # The step's program as the trainer compiles it (`InStepUpdate._lowered`).
        update = functools.partial(exp.steps.update, speculate=exp.steps.speculative)
        closed = jax.make_jaxpr(update, return_shape=True)(
            exp.abstract_state, exp.steps.abstract_batch(), ceiling
        )
    (jaxpr, shapes), args = closed, (exp.abstract_state, exp.steps.abstract_batch(), ceiling)
    jaxpr = jaxpr.jaxpr
    new_state, metrics = jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.outvars)[:2]
    norm = metrics["grad_norm"]
    ceiling_var = jax.tree.unflatten(jax.tree.structure(args), jaxpr.invars)[2]
    updated = jax.tree.leaves((new_state.params, new_state.opt_state, new_state.compute_params))
    updated = [v for v in updated if isinstance(v, jax.extend.core.Var)]
    assert len(updated) > 4 * len(exp.streamed_update.chunks) // 2
    for source in (norm, ceiling_var):
        reached = _depends_on(jaxpr, [source])
        assert any(v in reached for v in updated) != speculative, source


def test_speculative_update_in_step_plans_the_old_state_it_keeps():
    """The step keeps the old state beside the new one until its norm is read: the moved
    chunks in host memory, the compute copy and any resident chunks on the device."""
    config = small_config(**SPECULATING)
    plan = build(config, make_mesh(config.mesh)).plan
    exact = build(small_config(**IN_STEP, offload__update_in_step=True), make_mesh(config.mesh))
    kept = plan.state_bytes["old state kept"]
    assert kept == plan.state_bytes["master params"] + plan.state_bytes["optimizer state"] > 0
    assert plan.state_bytes["old device state kept"] == plan.state_bytes["compute params"]
    assert plan.tier_bytes(HOST) == exact.plan.tier_bytes(HOST) + kept


def test_speculative_update_in_step_keeps_resident_chunks_twice_in_an_auto_plan():
    """`auto` fills the device's spare room with chunks counted twice when the step
    speculates (a resident chunk's old copy stays beside the new one), and the plan fits."""
    base = dict(zero_stage=3, mesh__data=8, model__num_layers=8, offload__host_gib=64)
    kw = dict(SPECULATING, offload__chunks_in_flight=1, **base)
    mesh = make_mesh(small_config(**kw).mesh)
    offloaded = build(small_config(**kw), mesh)
    none = build(small_config(offload__policy="none", **base), mesh).plan
    # Halfway between what `optimizer` and `none` need on the device.
    between = (offloaded.plan.tier_bytes(DEVICE) + none.tier_bytes(DEVICE)) / 2
    auto = small_config(**{**kw, "offload__policy": "auto"})
    auto.offload.device_gib = between / 0.95 / 2**30
    plan = build(auto, mesh).plan
    assert plan.policy == "optimizer" and plan.fits()
    assert 0 < len(plan.resident) < len(offloaded.streamed_update.chunks)
    b = plan.state_bytes
    assert b["old device state kept"] == b["compute params"] + b["resident chunks"]


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_speculative_update_compiles_its_exact_steps_before_anything_is_allocated(clip):
    """With clipping on, the exact program that follows a clipped speculating step is
    compiled and checked against the plan in `build`, with the speculating one, not at the
    first clipped step, when the state fills the device; without clipping it never runs."""
    config = small_config(**SPECULATING, train__grad_clip=clip, monitor__on_anomaly="skip")
    exp = build(config, make_mesh(config.mesh))
    assert exp.steps.checks_compiled
    assert ("exact_compiled" in vars(exp.steps)) == (clip > 0)


def test_speculative_update_needs_the_update_in_step_and_something_to_speculate_past():
    config = small_config(**IN_STEP, offload__speculative_update=True)
    with pytest.raises(ConfigError, match="update_in_step=true too"):
        build(config, make_mesh(config.mesh))
    config = small_config(**SPECULATING, train__grad_clip=0.0, monitor__on_anomaly="log")
    with pytest.raises(ConfigError, match="has neither"):
        build(config, make_mesh(config.mesh))


def test_update_in_step_takes_the_chunks_in_the_backward_passes_order():
    """A layer's grads are done when the backward pass leaves it: last layer first, after
    the head's weights; the embedding's (the tied LM head's too) are done last."""
    for tie in (False, True):
        config = small_config(**IN_STEP, offload__update_in_step=True, model__tie_embeddings=tie)
        exp = build(config, make_mesh(config.mesh))
        names = [exp.streamed_update.chunks[k].key.split("]")[0] for k in exp.steps.order]
        groups = list(dict.fromkeys(names))
        head = ["['final_norm'"] + ([] if tie else ["['lm_head'"])
        assert groups == [*head, "['layer_1'", "['layer_0'", "['embed'"], tie


def test_update_in_step_follows_the_order_and_bounds_the_chunks_on_the_device(monkeypatch):
    """The step updates the chunks in `backward_order`'s order, and fetches a chunk only once
    the chunk chunks_in_flight before it is home: the barrier waits for its copies to host
    memory, not for its update on the device."""
    config = small_config(**IN_STEP, offload__update_in_step=True, offload__chunks_in_flight=3)
    exp = build(config, make_mesh(config.mesh))
    paths, bounds = [], []
    update_leaf, real_pipelined = Optimizer.update_leaf, stream.pipelined

    def recorded_update_leaf(self, path, *args):
        paths.append(path)
        return update_leaf(self, path, *args)

    def recorded_pipelined(fn, chunks, in_flight):
        done = real_pipelined(fn, chunks, in_flight)
        if chunks and len(chunks[0]) == 3:  # The update's (master, state, grad), not the norm's.
            waited = jax.tree.leaves([out[-1] for out in done])
            bounds.append((in_flight, {jax.typeof(x).memory_space for x in waited if x.ndim}))
        return done

    monkeypatch.setattr(Optimizer, "update_leaf", recorded_update_leaf)
    monkeypatch.setattr(stream, "pipelined", recorded_pipelined)
    exp.steps.lowered()
    assert paths == [exp.streamed_update.chunks[k].path for k in exp.steps.order]
    assert bounds == [(3, {jax.memory.Space.Host})]


def test_update_in_step_plans_its_chunks_in_flight_beside_the_step():
    """The update inside the step holds at most chunks_in_flight moved chunks in the step, and
    has no update after it."""
    config = small_config(**IN_STEP, offload__update_in_step=True, offload__chunks_in_flight=3)
    exp = build(config, make_mesh(config.mesh))
    sizes = sorted(stream.chunk_bytes(c) for c in exp.streamed_update.chunks)
    # In the step's temporaries, as the compiled step's check counts them.
    assert exp.plan.state_bytes["chunks in the step"] == sum(sizes[-3:])
    assert not {"chunks beside the step", "update chunks"} & set(exp.plan.state_bytes)
    assert "chunks in the step" in planner.IN_TEMPORARIES


@pytest.mark.parametrize(
    "clip, on_anomaly, waits",
    [
        (1.0, "skip", ["config.train.grad_clip=1", "config.monitor.on_anomaly=skip"]),
        (0.5, "log", ["config.train.grad_clip=0.5"]),
        (0.0, "skip", ["config.monitor.on_anomaly=skip"]),
        (0.0, "log", []),
    ],
)
def test_update_in_step_names_the_settings_that_hold_it_after_the_backward_pass(
    clip, on_anomaly, waits
):
    config = small_config(**IN_STEP, offload__update_in_step=True, monitor__on_anomaly=on_anomaly)
    config.train.grad_clip = clip
    for speculative in (False, True):
        step = types.SimpleNamespace(
            exp=types.SimpleNamespace(config=config),
            guarded=on_anomaly == "skip",
            speculative=speculative,
        )
        # Speculating, nothing waits (config.offload.speculative_update).
        assert steps.InStepUpdate.waits_for_the_norm.fget(step) == ([] if speculative else waits)


@pytest.mark.parametrize(
    "kw, needs",
    [
        (dict(offload__policy="optimizer"), "scan_layers=false"),
        (dict(IN_STEP, offload__policy="none"), "config.offload.policy=optimizer"),
        (dict(IN_STEP, offload__policy="params", model__remat="full"), "policy=optimizer"),
        (dict(IN_STEP, offload__delayed_update=True), "delayed_update=false"),
        (dict(IN_STEP, offload__cpu_update=0.5), "cpu_update=0"),
    ],
)
def test_update_in_step_names_what_it_needs(kw, needs):
    config = small_config(offload__update_in_step=True, **kw)
    with pytest.raises(ConfigError, match=re.escape(needs)):
        build(config, make_mesh(config.mesh))


@gpu
@pytest.mark.parametrize("speculative", [False, True], ids=["exact", "speculative"])
def test_update_in_step_copies_are_asynchronous_on_gpu(speculative):
    """On a GPU the step's host copies compile to copy-start/copy-done pairs that XLA's
    scheduler can run beside the compute (a scanned layer's would be synchronous); speculating
    (clipping on), in both the speculating program and the exact one that follows a clipped
    step, each compiled and checked against the plan in `build`."""
    config = small_config(**IN_STEP, offload__update_in_step=True, mesh__data=1)
    config.offload.speculative_update = speculative
    exp = build(config, make_mesh(config.mesh))
    programs = [exp.steps.program]
    if speculative:
        assert "exact_compiled" in vars(exp.steps)
        programs.append(exp.steps.exact_compiled)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    from throughput import most_copies_open

    for text in (p.as_text() for p in programs):
        # Each moved leaf down and home: master and both AdamW moments of every chunk.
        moved = 3 * len(exp.streamed_update.chunks)
        assert text.count(" copy-start(") == text.count(" copy-done(") >= 2 * moved
        # More than XLA's default 2 open at once (steps.COPIES_IN_FLIGHT).
        assert most_copies_open(text) > 2, most_copies_open(text)


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


def llama_1b(*overrides):
    """llama_1b on one device (batch 8 x 2048): 4.1 GiB of fp32 masters, 8.2 GiB of Adam state."""
    config = load_config("configs/llama_1b.py", ["--config.offload.host_gib=64", *overrides])
    return config, make_mesh(config.mesh, jax.devices()[:1])


def test_planner_auto_offloads_only_when_the_device_is_too_small():
    fits = build(*llama_1b("--config.offload.policy=auto", "--config.offload.device_gib=40"))
    assert fits.plan.policy == "none"
    exp = build(*llama_1b("--config.offload.policy=auto", "--config.offload.device_gib=32"))
    assert exp.plan.policy == "optimizer"
    table = exp.plan.table()
    assert re.search(r"master params +pinned_host", table) and re.search(r"grads +device", table)
    # The device is filled first: what is left of it is less than the largest update chunk.
    on_device = exp.plan.tier_bytes(DEVICE)
    assert 0.95 * 32 * 2**30 - 3 * 32000 * 2048 * 4 < on_device <= 0.95 * 32 * 2**30
    assert 0.95 * 32 * 2**30 < fits.plan.tier_bytes(DEVICE)
    b = exp.plan.state_bytes
    assert b["resident chunks"] > 0
    optimizer = ("--config.offload.policy=optimizer", "--config.offload.device_gib=32")
    b = build(*llama_1b(*optimizer)).plan.state_bytes
    # The compute copy is bf16: half the bytes of the fp32 masters.
    assert 2 * b["compute params"] == b["master params"]
    # The update streams chunks: with 2 in flight, one fetched ahead and two on their way
    # home, the largest (the 32000 x 2048 embedding and LM head, with two moments and two int32
    # step counts each) are on the device at once, not the whole state.
    largest = 3 * (3 * 32000 * 2048 * 4 + 2 * 4)
    assert b["update chunks"] == largest < b["optimizer state"] / 3


def test_planner_refuses_what_fits_nowhere_before_allocating():
    config, mesh = llama_1b(
        "--config.offload.policy=auto",
        "--config.offload.device_gib=8",
        "--config.offload.host_gib=8",
    )
    with pytest.raises(
        ConfigError, match=r"do not fit \(device .* GiB of 7\.6 usable, pinned_host"
    ):
        build(config, mesh)
    with pytest.raises(ConfigError, match="config.offload.policy='bogus'"):
        build(*llama_1b("--config.offload.policy=bogus"))


def test_compiled_step_that_outgrows_the_plan_is_refused_before_allocating():
    """On a GPU, `build`'s compiled step is checked so: XLA's temporaries replace the
    planner's activation estimate in the device total."""
    overrides = ["--config.offload.policy=optimizer", "--config.offload.device_gib=32"]
    plan = build(*llama_1b(*overrides, "--config.offload.activations=device")).plan
    b = plan.state_bytes
    states = b["compute params"] + b["grads"] + b["chunks beside the step"]
    room = 0.95 * 32 * 2**30 - states  # For the temporaries (above the update's chunks here).
    check_compiled(plan, types.SimpleNamespace(temp_size_in_bytes=int(room) - 1))
    with pytest.raises(
        ConfigError, match=r"compiled train step needs 31\.4 GiB .* 30\.4 GiB usable"
    ):
        check_compiled(plan, types.SimpleNamespace(temp_size_in_bytes=int(room) + 2**30))


def test_the_steps_activations_and_the_updates_chunks_are_not_counted_together():
    """The streamed update runs after the step has freed its activations: the device's peak
    is the lasting states plus the larger of the step's (activations, with the update's
    groups beside it) and the update's chunks (on an H200 the 8B step peaked at 80 GiB where
    their sum planned 105)."""
    overrides = ["--config.offload.policy=optimizer", "--config.offload.device_gib=32"]
    plan = build(*llama_1b(*overrides, "--config.offload.activations=device")).plan
    b = plan.state_bytes
    lasting = b["compute params"] + b["grads"]
    step = b["activations"] + b["layer inputs"] + b["chunks beside the step"]
    assert step > b["update chunks"] > b["chunks beside the step"] > 0
    assert plan.tier_bytes(DEVICE) == lasting + step
    short_step = {**b, "activations": b["update chunks"] // 4, "layer inputs": 0}
    short_step = dataclasses.replace(plan, state_bytes=short_step)
    assert short_step.tier_bytes(DEVICE) == lasting + b["update chunks"]
    assert "a peak counts the step's activations and microbatch grads, with the" in plan.table()


def test_the_updates_groups_beside_the_step_are_the_plans(monkeypatch):
    """The groups the update holds on the device while the step runs (fetched before it, and
    the last update's on their way home) are the ones the planner counts beside the step's
    activations (on the H200, llama_1b with every chunk in flight peaked at 33.1 GiB where the
    plan, counting them as the update's alone, said 28.7). Without room for them beside the
    step the plan switches them off, and the update then ends with its copies home."""
    from jax._src.array import ArrayImpl

    config = small_config(offload__policy="optimizer", offload__chunks_in_flight=4)
    exp = build(config, make_mesh(config.mesh))
    plan, update = exp.plan, exp.streamed_update
    chunk_tiers = [c.tier for c in update.chunks]
    fetched, leaving = beside_step_groups(chunk_tiers, update.groups, 4)
    assert plan.copies_beside_step and fetched == [0, 1] and len(leaving) == 3
    beside = plan.state_bytes["chunks beside the step"]
    assert beside == sum(update.group_bytes[g] for g in {*fetched, *leaving})
    done = {}  # id -> array: held, so ids stay unique. Copies are done when waited for.
    block = ArrayImpl.block_until_ready
    monkeypatch.setattr(ArrayImpl, "is_ready", lambda x: done.get(id(x)) is x)
    monkeypatch.setattr(
        ArrayImpl, "block_until_ready", lambda x: done.update({id(x): x}) or block(x)
    )
    state = exp.init_state()
    batches = make_batches(config)
    state, _ = exp.train_step(state, exp.global_batch(batches[0]))
    assert [e[3] for e in update._leaving] == leaving
    masters, states = (exp.steps._flat(t) for t in (state.params, state.opt_state))
    for entry in update._leaving:  # Home now: the next step's prefetch may fetch them.
        done.update((id(x), x) for x in entry[0])
    assert list(update.prefetch(masters, states)) == fetched
    update.drain()

    # A device with room for the step but not for the groups beside it.
    room = plan.budget[DEVICE] * USABLE - plan.tier_bytes(DEVICE) + beside // 2
    gib = (plan.budget[DEVICE] - room / USABLE) / 2**30
    config = small_config(
        offload__policy="optimizer", offload__chunks_in_flight=4, offload__device_gib=gib
    )
    exp = build(config, make_mesh(config.mesh))
    plan, update = exp.plan, exp.streamed_update
    assert not plan.copies_beside_step and plan.state_bytes["chunks beside the step"] == 0
    assert plan.fits() and "no room beside the step" in plan.table()
    state = exp.init_state()
    state, _ = exp.train_step(state, exp.global_batch(batches[0]))
    assert not update._leaving
    masters, states = (exp.steps._flat(t) for t in (state.params, state.opt_state))
    assert update.prefetch(masters, states) == {}


def test_the_groups_left_beside_the_step_are_the_last_ones_and_do_not_pile_up(monkeypatch):
    """What stays on its way home beside the next step is at most the planner's groups: the
    update's last ones, not an older one left in place of a newer one whose copies finished
    first, and, with fewer groups than may be left (every chunk in flight), not the last
    update's beside this one's."""
    from jax._src.array import ArrayImpl

    done = {}  # id -> array: held, so ids stay unique. Copies are done when waited for.
    block = ArrayImpl.block_until_ready
    monkeypatch.setattr(ArrayImpl, "is_ready", lambda x: done.get(id(x)) is x)
    monkeypatch.setattr(
        ArrayImpl, "block_until_ready", lambda x: done.update({id(x): x}) or block(x)
    )
    batches = None
    for in_flight in (4, 100):
        config = small_config(offload__policy="optimizer", offload__chunks_in_flight=in_flight)
        exp = build(config, make_mesh(config.mesh))
        update, batches = exp.streamed_update, batches or make_batches(config)
        chunk_tiers = [c.tier for c in update.chunks]
        _, leaving = beside_step_groups(chunk_tiers, update.groups, in_flight)
        early = update.groups[-2] if in_flight == 4 else None  # Its copies home end first.
        move = update._move

        def moved(ks, leaves, to_device, move=move, early=early, update=update):
            out = move(ks, leaves, to_device)
            if ks == early and not to_device:
                done.update((id(x), x) for x in update._moved(ks, out))
            return out

        update._move = moved
        state = exp.init_state()
        for rows in batches[:2]:
            state, _ = exp.train_step(state, exp.global_batch(rows))
            held = [e[3] for e in update._leaving]
            assert set(held) <= set(leaving) and len(held) == len(set(held)), (held, leaving)
        expected = [g for g in leaving if update.groups[g] != early]
        # Every chunk in flight: each part of the params one group, all left.
        assert held == expected and len(expected) == (2 if in_flight == 4 else len(update.groups))


def test_a_pinned_pool_that_would_outgrow_the_host_is_refused(monkeypatch):
    """XLA's pinned-host pool keeps its doubling regions up to its cap (on the H200 a 110 GiB
    cap was held whole for a 94.7 GiB plan, and the kernel killed the run after minutes of
    initialisation): the planner refuses a plan whose pool, with the host cores' chunks and
    the process's own memory, passes what the host has, and names the cap that fits."""
    assert tiers.pinned_pool_hold(3 * 2**20, 2**40) == 6 * 2**20  # Regions of 2 and 4 MiB.
    assert tiers.pinned_pool_hold(65 * 2**30, 110 * 2**30) == 110 * 2**30
    overrides = ("--config.offload.policy=optimizer", "--config.offload.device_gib=32")
    plan = build(*llama_1b(*overrides)).plan  # A CPU: no pool.
    need = plan.tier_bytes(HOST)  # 12.3 GiB: the pool's regions reach 16 GiB.
    assert 8 * 2**30 < need < 15 * 2**30
    monkeypatch.setattr(tiers, "_host_available", lambda: 38 * 2**30)  # 16 + 24 beside > 38.
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
    overflow = tiers.pool_overflow(plan, 1, backend="gpu")
    assert "would hold 16.0 GiB" in overflow and "LIMIT_GB=13," in overflow
    on_gpu = functools.partial(tiers.pool_overflow, backend="gpu")
    monkeypatch.setattr(tiers, "pool_overflow", on_gpu)
    with pytest.raises(ConfigError, match="would hold 16.0 GiB .*LIMIT_GB=13,"):
        build(*llama_1b(*overrides))
    # With less than 13 + 24 GiB available no cap fits: none is named (on the H200 the 8B
    # 1M-token plan was told to set the 95 GiB cap it had).
    monkeypatch.setattr(tiers, "_host_available", lambda: 36 * 2**30)
    overflow = tiers.pool_overflow(plan, 1)
    assert "no cap fits this host" in overflow and "LIMIT_GB=13," not in overflow
    monkeypatch.setattr(tiers, "_host_available", lambda: 38 * 2**30)
    # The host cores' chunks live beside the pool, in plain memory: they count too.
    hybrid = build(*llama_1b(*overrides, "--config.offload.cpu_update=0.5")).plan
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "13")
    assert tiers.pool_overflow(plan, 1) == ""
    assert "GiB of host-updated chunks" in tiers.pool_overflow(hybrid, 2)
    assert tiers.pool_overflow(plan, 1, backend="cpu") == ""


def test_a_preallocated_pinned_pool_is_counted_as_held(monkeypatch):
    """With XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE the pool holds its whole cap from the start, out
    of what the host has available: the host tier is the cap (on the H200 the planner, taking
    what was left for the pool, found 0 GiB and refused every plan), and the check asks only
    that the process's memory fits beside it."""
    monkeypatch.setattr(tiers, "_host_available", lambda: 30 * 2**30)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "95")
    assert tiers.host_budget(200 * 2**30, backend="gpu") == 6 * 2**30  # 30 - 24 beside.
    assert tiers.host_budget(200 * 2**30, backend="cpu") == 200 * 2**30
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "true")
    assert tiers.host_budget(200 * 2**30, backend="gpu") == 95 * 2**30
    overrides = ("--config.offload.policy=optimizer", "--config.offload.device_gib=32")
    plan = build(*llama_1b(*overrides)).plan
    assert tiers.pool_overflow(plan, 1, backend="gpu") == ""
    monkeypatch.setattr(tiers, "_host_available", lambda: 20 * 2**30)
    assert "lower the cap" in tiers.pool_overflow(plan, 1, backend="gpu")


def test_gpu_allocator_pools_that_shrink_a_tier_are_named_in_the_fix(monkeypatch):
    """The H200's 8B offload run was refused for the allocators' defaults (75% of the GPU,
    64 GB pinned): the error must name the two settings, and only where they bind."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0.5")
    fixes = " ".join(tiers.pool_fixes({DEVICE, HOST}, backend="gpu"))
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in fixes
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, now 0.5" in fixes
    assert tiers.pool_fixes({DEVICE, HOST}, backend="cpu") == []
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(2**20))  # Above any host.
    assert tiers.pool_fixes({DEVICE, HOST}, backend="gpu") == []


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
            grad_step = jax.jit(exp.steps._grad_step)
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
    program, move = update._fn, update._move
    update._fn = lambda *a: calls.update(["program"]) or program(*a)
    update._move = lambda *a, **k: calls.update(["copy"]) or move(*a, **k)
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
    leaving = list(update._leaving)
    assert len(update.groups) >= 6 and len(leaving) == 4 - 2 + 1
    assert not any(x.is_deleted() for _, outs, old, _ in leaving for x in [*outs, *old])
    # The next step's prefetch leaves a group whose copies home are not done.
    masters, states = (exp.steps._flat(t) for t in (state.params, state.opt_state))
    first = update._moved(
        update.groups[0], [update._leaves(k, masters, states) for k in update.groups[0]]
    )
    for x in first:
        del done[id(x)]
    assert list(update.prefetch(masters, states)) == [1]
    finish(first)
    old = list(leaving[2][2])
    finish(leaving[2][1])  # Its update has run, its copies home have not: the old copies go.
    finish(leaving[1][0])  # Copies home done out of order: that group goes.
    update._delete_ready()
    assert list(update._leaving) == [leaving[0], leaving[2]]
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
    from angel_jax.offload.stream import StreamedUpdate

    device, samples = jax.devices()[0], []
    make_fn = StreamedUpdate._fn

    def sampled_fn(self, *args):
        fn = make_fn(self, *args)

        def run(*a):
            samples.append(device.memory_stats()["bytes_in_use"])
            return fn(*a)

        return run

    monkeypatch.setattr(StreamedUpdate, "_fn", sampled_fn)
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


def test_planner_puts_layer_inputs_on_the_host_when_the_device_is_too_small():
    """offload.activations=auto: the device while the plan fits there, else the host (before
    any optimizer offload); the plan's bytes are the stacked inputs' exactly; =device refuses
    with the fix named."""
    long = ["--config.model.remat=full", "--config.train.batch_size=1"]
    long += ["--config.train.seq_len=262144", "--config.model.logits_chunks=32"]
    fits = build(*llama_1b(*long, "--config.offload.device_gib=140")).plan
    assert not fits.layer_inputs_on_host and fits.policy == "none"
    plan = build(*llama_1b(*long, "--config.offload.device_gib=50")).plan
    assert plan.layer_inputs_on_host and plan.policy == "none"
    assert plan.state_bytes["layer inputs"] == 22 * 262144 * 2048 * 2  # bf16, all 22 layers.
    assert re.search(r"layer inputs +pinned_host", plan.table())
    assert plan.tier_bytes(DEVICE) == fits.tier_bytes(DEVICE) - plan.state_bytes["layer inputs"]
    with pytest.raises(ConfigError, match=r"offload.activations=auto or host"):
        build(
            *llama_1b(
                *long, "--config.offload.device_gib=50", "--config.offload.activations=device"
            )
        )
    with pytest.raises(
        ConfigError, match=r"activations=host keeps each layer's input .*remat=none"
    ):
        build(*llama_1b("--config.model.remat=none", "--config.offload.activations=host"))


def test_bytes_per_parameter_of_adamw_and_adafactor():
    """Model-state density: fp32 masters 4 + fp32 grads 4 + AdamW 8 bytes per parameter;
    Adafactor's factored moments are well under 1% of AdamW's; offload adds the bf16 copy but
    takes grads in bf16 (2 + 2 + 4 + 8)."""

    def plan(*overrides):
        return build(*llama_1b("--config.offload.device_gib=1000", *overrides)).plan

    adamw, adafactor = plan(), plan("--config.train.optimizer=adafactor")
    assert adamw.bytes_per_param() == pytest.approx(16.0, rel=1e-4)
    assert adafactor.bytes_per_param() == pytest.approx(8.0, rel=1e-2)
    assert adafactor.state_bytes["optimizer state"] < 0.01 * adamw.state_bytes["optimizer state"]
    offloaded = plan("--config.offload.policy=optimizer")
    b = offloaded.state_bytes
    transient = b["update chunks"] / offloaded.num_params
    assert offloaded.bytes_per_param() == pytest.approx(16.0 + transient, rel=1e-4)
    # Three chunks (of two in flight, one fetched ahead and two leaving) of the largest: the
    # 32000 x 2048 embedding, fp32, with AdamW's two moments and two step counts.
    assert b["update chunks"] == 3 * (32000 * 2048 * 4 * 3 + 2 * 4)
    assert "bytes per parameter" in offloaded.table()


def test_checkpoint_names_the_offload_policy_it_was_saved_under(tmp_path):
    config = small_config(mesh__data=8)
    exp, state, _ = train(config, steps=1)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
    ckpt.save(1, exp.checkpointed(state), 1, exp.plan.policy)
    ckpt.close()
    with pytest.raises(ConfigError, match=r"laid out for config.offload.policy=none, but this"):
        Checkpointer(str(tmp_path), 1, 1).restore(1, exp.abstract_state, "optimizer")


def test_a_gpu_allocator_without_a_limit_asks_for_the_device_budget(monkeypatch):
    """An allocator that reports no memory limit (XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async may
    not) must not leave the plan to take the host's RAM as the GPU's budget: the error names
    the setting."""
    config, mesh = llama_1b("--config.offload.policy=optimizer")
    gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_in_use": 0})
    monkeypatch.setattr(tiers.jax, "local_devices", lambda: [gpu])
    with pytest.raises(ConfigError, match="config.offload.device_gib"):
        tiers.measured_budget(config, mesh)
    config.offload.device_gib = 40
    assert tiers.measured_budget(config, mesh)[DEVICE] == 40 * 2**30
