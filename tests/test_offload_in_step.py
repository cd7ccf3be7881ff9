"""The update inside the step (config.offload.update_in_step), exact and speculative: equal to
the streamed update, its order, its chunks in flight and what it needs."""

import functools
import pathlib
import re
import sys
import types

import jax
import jax.extend.core
import numpy as np
import pytest

from angel_jax import sharding, steps
from angel_jax.config import ConfigError
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.offload import stream
from angel_jax.optim import Optimizer
from angel_jax.planning.groups import chunk_part
from angel_jax.planning.plan import IN_TEMPORARIES
from angel_jax.planning.tiers import DEVICE, HOST
from angel_jax.train import build
from tests.test_offload import IN_STEP, SPECULATING, assert_updated_alike, gpu, train
from tests.test_train_parity import small_config


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
        programs[layers] = len(update.programs)
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
        assert not exp.streamed_update.homebound
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
        # The step's program as the trainer compiles it (`InStepUpdate.lowered`).
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
    # Weights that outweigh the activations (full remat, 8 tokens a row), so that offloading
    # the optimizer frees the device: the unrolled layers' grads come after the activations,
    # and speculating keeps the old params beside the new.
    model = dict(model__ffn_dim=1024, model__remat="full", train__seq_len=8)
    base = dict(zero_stage=3, mesh__data=8, model__num_layers=8, offload__host_gib=64, **model)
    kw = dict(SPECULATING, offload__chunks_in_flight=1, **base)
    mesh = make_mesh(small_config(**kw).mesh)
    offloaded = build(small_config(**kw), mesh)
    # The plan auto tries first: the same model, with nothing offloaded.
    not_offloaded = dict(offload__update_in_step=False, offload__speculative_update=False)
    none = build(small_config(**{**kw, "offload__policy": "none", **not_offloaded}), mesh).plan
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
    assert "chunks in the step" in IN_TEMPORARIES


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
            setup=types.SimpleNamespace(grad_clip=config.train.grad_clip),
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
