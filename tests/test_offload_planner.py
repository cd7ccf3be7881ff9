"""ZeRO-Cache planning: remat picked by the plan, the plans' placements and refusals before
anything is allocated, the pinned pool and the tiers' budgets, the layer inputs' tier."""

import dataclasses
import functools
import re
import types

import jax
import jax.extend.core
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from angel_jax import machine, steps
from angel_jax.config import ConfigError, load_config
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.planning import activations, tiers
from angel_jax.planning.chunks import on_disk_bytes, update_chunks
from angel_jax.planning.compiled import check_compiled, compiled_peak
from angel_jax.planning.groups import beside_step_groups
from angel_jax.planning.inputs import plan_input
from angel_jax.planning.tiers import DEVICE, HOST, USABLE
from angel_jax.train import build
from tests.test_offload import WIDE, train
from tests.test_train_parity import small_config


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
        return activations.remat_choices(plan_input(config, make_mesh(config.mesh)))

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
        compiled_need[remat] = compiled_peak(exp.plan, temps)
    assert compiled_need["dots_no_batch"] > compiled_need["full"]
    # Room between the two compiled steps' needs, and no activations in dots_no_batch's
    # estimate.
    between = sum(compiled_need.values()) / 2 / USABLE / 2**30
    estimate = activations.activation_bytes
    wrong = lambda inp, r: {**estimate(inp, r), **({"activations": 0} if r != "full" else {})}
    monkeypatch.setattr(activations, "activation_bytes", wrong)
    monkeypatch.setattr(steps.Step, "checks_compiled", property(lambda self: True))
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
    temps = exp.steps.lowered().compile().memory_analysis().temp_size_in_bytes
    compiled_need = compiled_peak(exp.plan, temps)
    inflated = lambda e: e.plan.tier_bytes(DEVICE) + 2 * e.plan.state_bytes["activations"]
    usable = (inflated(plan("full")) + inflated(exp)) / 2  # Between their inflated needs.
    assert compiled_need < usable
    estimate = activations.activation_bytes
    wrong = lambda inp, r: {**(e := estimate(inp, r)), "activations": 3 * e["activations"]}
    monkeypatch.setattr(activations, "activation_bytes", wrong)
    monkeypatch.setattr(steps.Step, "checks_compiled", property(lambda self: True))
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
    # The compute copy is bf16: the fp32 masters' high halves, their tier holds the low ones.
    assert b["compute params"] == b["master params"]
    # The update streams chunks: with 2 in flight, one fetched ahead and two on their way
    # home, the largest (the 32000 x 2048 embedding and LM head, with two moments and two int32
    # step counts each) are on the device at once, not the whole state.
    largest = 3 * (32000 * 2048 * (2 + 8) + 2 * 4)
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


def test_the_device_steps_grads_are_among_its_temporaries():
    """Without an offloaded optimizer the step is one program, its grads neither argument nor
    output: XLA's temporaries replace them too in the device total. Over unrolled layers they
    come as the backward frees the activations: the plan counts the larger of the two."""
    scanned = build(*llama_1b("--config.offload.device_gib=40")).plan
    b = scanned.state_bytes
    lasting = b["compute params"] + b["optimizer state"]
    step = b["layer inputs"] + b["activations"]
    assert scanned.policy == "none" and not scanned.grads_after_activations
    assert scanned.tier_bytes(DEVICE) == lasting + b["grads"] + step
    room = 0.95 * 40 * 2**30 - lasting  # For the temporaries, the grads among them.
    check_compiled(scanned, types.SimpleNamespace(temp_size_in_bytes=int(room) - 1))
    with pytest.raises(ConfigError, match=r"compiled train step needs 38\.1 GiB .* 38\.0 GiB"):
        check_compiled(scanned, types.SimpleNamespace(temp_size_in_bytes=int(room) + 2**27))
    unrolled = build(
        *llama_1b("--config.offload.device_gib=40", "--config.model.scan_layers=false")
    )
    u = unrolled.plan.state_bytes
    step = u["layer inputs"] + u["activations"]
    assert unrolled.plan.grads_after_activations and step > u["grads"]
    assert unrolled.plan.tier_bytes(DEVICE) == lasting + step
    assert "grads are made as their activations are freed" in unrolled.plan.table()
    # The temporaries beyond the plan's estimate of them: the larger of the two.
    assert check_compiled(unrolled.plan, types.SimpleNamespace(temp_size_in_bytes=step)) == 0


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
    assert [e[3] for e in update.homebound] == leaving
    masters, states = (exp.steps.flat(t) for t in (state.params, state.opt_state))
    for entry in update.homebound:  # Home now: the next step's prefetch may fetch them.
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
    assert not update.homebound
    masters, states = (exp.steps.flat(t) for t in (state.params, state.opt_state))
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
        move = update.moves.move

        def moved(ks, leaves, to_device, move=move, early=early, update=update):
            out = move(ks, leaves, to_device)
            if ks == early and not to_device:
                done.update((id(x), x) for x in update.moves.moved(ks, out))
            return out

        update.moves.move = moved
        state = exp.init_state()
        for rows in batches[:2]:
            state, _ = exp.train_step(state, exp.global_batch(rows))
            held = [e[3] for e in update.homebound]
            assert set(held) <= set(leaving) and len(held) == len(set(held)), (held, leaving)
        expected = [g for g in leaving if update.groups[g] != early]
        # Every chunk in flight: each part of the params one group, all left.
        assert held == expected and len(expected) == (2 if in_flight == 4 else len(update.groups))


def test_a_pinned_pool_that_would_run_out_or_outgrow_the_host_is_refused(monkeypatch):
    """XLA's pinned-host pool as `tiers.replay_pool` runs it: the planner refuses a plan whose
    pool runs out at its cap (on the H200 the 8B 1M-token plan's did at the cap then named,
    its need over USABLE: tests/test_pinned_pool.py), or holds its regions (kept, pinned) with
    the host cores' chunks and the process's own memory past what the host has (on the H200 a
    110 GiB cap was held whole for a 94.7 GiB plan and the kernel killed the run), and names
    the cap that works, or says none fits."""
    overrides = (
        "--config.offload.policy=optimizer",
        "--config.offload.device_gib=32",
        "--config.offload.split_masters=false",
        "--config.train.steps=20",  # The replay's steps: a short run's.
    )
    plan = build(*llama_1b(*overrides)).plan  # A CPU: no pool.
    assert 12 * 2**30 < plan.tier_bytes(HOST) < 13 * 2**30
    gpu = functools.partial(tiers.pool_overflow, backend="gpu", available=64 * 2**30)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "13")  # The need over USABLE.
    overflow = gpu(plan, 1)
    assert "runs out in step 1: a 0.24 GiB allocation" in overflow
    assert "set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=17 (it holds 16.0 GiB)" in overflow
    monkeypatch.setattr(tiers, "pool_overflow", gpu)
    with pytest.raises(ConfigError, match="runs out .*LIMIT_GB=17 "):
        build(*llama_1b(*overrides))
    monkeypatch.undo()
    # A 110 GiB cap: the pool's regions reach 16 GiB, which with 24 GiB for the process
    # need 40 GiB available; with less no cap fits.
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
    overflow = tiers.pool_overflow(plan, 1, backend="gpu", available=39 * 2**30)
    assert "would hold 16.0 GiB" in overflow and "no cap fits this host" in overflow
    assert tiers.pool_overflow(plan, 1, backend="gpu", available=40 * 2**30) == ""
    # The host cores' chunks live beside the pool, in plain memory: they count too.
    hybrid = build(*llama_1b(*overrides, "--config.offload.cpu_update=0.5")).plan
    overflow = tiers.pool_overflow(hybrid, 2, backend="gpu", available=40 * 2**30)
    assert "11.6 GiB of host-updated chunks" in overflow
    assert tiers.pool_overflow(plan, 1, backend="cpu") == ""


def test_a_preallocated_pinned_pool_is_counted_as_held(monkeypatch):
    """With XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE the pool holds its whole cap from the start, out
    of what the host has available: the host tier is the cap (on the H200 the planner, taking
    what was left for the pool, found 0 GiB and refused every plan), and the check asks only
    that the process's memory fits beside it. Its default cap is then XLA's 16 GB."""
    monkeypatch.setattr(machine, "host_available", lambda: 30 * 2**30)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "95")
    assert tiers.host_budget(200 * 2**30, backend="gpu") == 6 * 2**30  # 30 - 24 beside.
    assert tiers.host_budget(200 * 2**30, backend="cpu") == 200 * 2**30
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "true")
    assert tiers.host_budget(200 * 2**30, backend="gpu") == 95 * 2**30
    overrides = (
        "--config.offload.policy=optimizer",
        "--config.offload.device_gib=32",
        "--config.train.steps=20",
    )
    plan = build(*llama_1b(*overrides)).plan
    assert tiers.pool_overflow(plan, 1, backend="gpu") == ""
    monkeypatch.setattr(machine, "host_available", lambda: 20 * 2**30)
    overflow = tiers.pool_overflow(plan, 1, backend="gpu")
    assert "holds its whole cap from the start, leaving 20.0 GiB" in overflow
    assert "set XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=false XLA_PJRT_GPU_HOST_MEMORY" in overflow
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    assert tiers.pinned_pool_cap_gb() == 16


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
    takes grads in bf16 and keeps the masters' low halves (2 + 2 + 2 + 8; 4 for whole ones)."""

    def plan(*overrides):
        return build(*llama_1b("--config.offload.device_gib=1000", *overrides)).plan

    adamw, adafactor = plan(), plan("--config.train.optimizer=adafactor")
    assert adamw.bytes_per_param() == pytest.approx(16.0, rel=1e-4)
    assert adafactor.bytes_per_param() == pytest.approx(8.0, rel=1e-2)
    assert adafactor.state_bytes["optimizer state"] < 0.01 * adamw.state_bytes["optimizer state"]
    for split, master in ((True, 2), (False, 4)):
        offloaded = plan(
            "--config.offload.policy=optimizer", f"--config.offload.split_masters={split}"
        )
        b = offloaded.state_bytes
        transient = b["update chunks"] / offloaded.num_params
        assert offloaded.bytes_per_param() == pytest.approx(12.0 + master + transient, rel=1e-4)
        # Three chunks (of two in flight, one fetched ahead and two leaving) of the largest:
        # the 32000 x 2048 embedding's master, AdamW's two fp32 moments and two step counts.
        assert b["update chunks"] == 3 * (32000 * 2048 * (master + 8) + 2 * 4)
    assert "bytes per parameter" in offloaded.table()


def test_a_gpu_allocator_without_a_limit_asks_for_the_device_budget(monkeypatch):
    """An allocator that reports no memory limit (XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async may
    not) must not leave the plan to take the host's RAM as the GPU's budget: the error names
    the setting."""
    config, mesh = llama_1b("--config.offload.policy=optimizer")
    gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_in_use": 0})
    monkeypatch.setattr(tiers.jax, "local_devices", lambda: [gpu])
    with pytest.raises(ConfigError, match="config.offload.device_gib"):
        tiers.measured_budget(config, mesh.size)
    config.offload.device_gib = 40
    assert tiers.measured_budget(config, mesh.size)[DEVICE] == 40 * 2**30


@pytest.mark.parametrize("mu_dtype", ["float32", "bfloat16"])
def test_compressed_ssd_state_halves_only_float32_leaves(mu_dtype):
    """config.offload.ssd_compress stores float32 optimizer state in bfloat16: AdamW's two
    moments take 2 + 2 bytes a parameter on disk whether the first is float32 or already
    bfloat16 (config.train.mu_dtype; halving the whole state counted 3 for the latter), the
    int32 step counts 4 bytes each."""
    from angel_jax.optim import make_optimizer

    on_one = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("data",)), P())
    placed = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_one), tree
    )
    params, stacked = placed({"w": jax.ShapeDtypeStruct((3, 256, 128), np.float32)}), {"w": True}
    optimizer = make_optimizer(small_config(train__mu_dtype=mu_dtype).train)
    opt = placed(jax.eval_shape(lambda p: optimizer.init(p, stacked), params))
    counts = 2 * 4  # The moments' count and the schedule's, per layer.
    on_disk = update_chunks(params, opt, stacked, on_disk_bytes)
    master, state = 256 * 128 * 4, 256 * 128 * (2 + 2) + counts
    assert on_disk == [(("['w']", i), master, state) for i in range(3)]
