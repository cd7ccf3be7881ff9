"""Split masters (config.offload.split_masters, offload/masters.py): the offloaded float32
masters kept as their low 16 bits beside the bfloat16 compute copy, their high half. Exact:
each update path trains bit for bit as with whole masters, with 2 bytes less of each master
held and moved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.checkpoint import Checkpointer
from angel_jax.config import ConfigError, validate
from angel_jax.data import make_batches
from angel_jax.mesh import make_mesh
from angel_jax.offload import masters
from angel_jax.planning.plan import local_bytes
from angel_jax.planning.tiers import CPU, DEVICE, HOST, SSD
from angel_jax.train import build
from tests.test_offload import DELAYED, IN_STEP, train
from tests.test_train_parity import small_config

BF16 = dict(model__dtype="bfloat16")


def test_halves_join_into_the_master_bit_for_bit():
    """Every float32 but the NaNs comes back from its halves bit for bit, inside jit and in
    numpy; the compute copy is the master's `astype` but where its low 16 bits are a tie."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    special = [0, 0x80000000, 1, 0x8000, 0x80008000, 0x3F808000, 0x3F818000, 0x7F7FFFFF]
    special += [0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001]
    bits = np.concatenate([bits, np.array(special, np.uint32)])
    x = bits.view(np.float32)
    low, compute = jax.jit(lambda x: masters.split(x, jnp.bfloat16))(x)
    assert low.dtype == masters.LOW and compute.dtype == jnp.bfloat16
    number = ~np.isnan(x)
    for joined in (jax.jit(masters.join)(low, compute), masters.join_numpy(low, compute)):
        joined = np.asarray(joined)
        np.testing.assert_array_equal(joined.view(np.uint32)[number], bits[number])
        assert np.isnan(joined[~number]).all() and np.isnan(np.asarray(compute)[~number]).all()
    cast = np.asarray(x[number].astype(jnp.bfloat16)).view(np.uint16)
    differ = np.asarray(compute)[number].view(np.uint16) != cast
    assert ((bits[number][differ] & 0xFFFF) == 0x8000).all() and differ.any()


def _three_tiers(tmp_path) -> dict:
    """Budgets under which `auto` keeps update chunks on the device, in host memory and on
    disk (as test_offload's `three_tiers`, in bfloat16 with split masters)."""
    kw = dict(BF16, zero_stage=3, mesh__data=8, model__num_layers=8, offload__host_gib=64)
    mesh = make_mesh(small_config(**kw).mesh)
    plan = lambda policy: build(small_config(offload__policy=policy, **kw), mesh).plan
    offloaded = plan("optimizer")
    between = (offloaded.tier_bytes(DEVICE) + plan("none").tier_bytes(DEVICE)) / 2
    return dict(
        kw,
        offload__policy="auto",
        offload__device_gib=between / 0.95 / 2**30,
        offload__host_gib=offloaded.tier_bytes(HOST) * 0.6 / 0.95 / 2**30,
        offload__ssd_dir=str(tmp_path),
    )


# Path -> its settings (None: `_three_tiers`).
PATHS = {
    "optimizer, all in flight": dict(
        zero_stage=1, mesh__data=8, offload__policy="optimizer", offload__chunks_in_flight=100
    ),
    "ZeRO-3, tensor": dict(zero_stage=3, mesh__data=4, mesh__tensor=2, offload__policy="optimizer"),
    "Adafactor": dict(
        zero_stage=1, mesh__data=8, offload__policy="optimizer", train__optimizer="adafactor"
    ),
    # With the host's cores on half the chunks (whole masters).
    "delayed, between microbatches, hybrid": dict(
        DELAYED, microbatches=4, train__batch_size=32, offload__delayed_update=True
    ),
    "in the step": dict(IN_STEP, offload__update_in_step=True),
    "device, host and SSD": None,
}


def test_both_halves_read_one_evaluation_of_the_master():
    """The halves split one value of the master: an optimization barrier stands between the
    update that makes it and the halves' consumers, or XLA may fuse the update into each and
    compute it twice, two evaluations that can differ in the last bit (the CPU at -O0 did)."""
    x = jnp.ones((64, 64), jnp.float32)
    updated_then_split = lambda master, grad: masters.split(master - 1e-3 * grad, jnp.bfloat16)
    program = jax.jit(updated_then_split).lower(x, x).as_text()
    assert program.count("optimization_barrier") == 1


@pytest.mark.parametrize("path", list(PATHS))
def test_split_masters_train_as_whole_ones(path, tmp_path):
    """Each update path with split masters trains as with whole ones: the same losses,
    masters (joined) and optimizer state; every chunk the device updates keeps 2 bytes a
    parameter of its master (the host cores' keep 4), as the plan counts.

    Within 1e-5, not bit for bit: the programs that join and split the masters compile the
    same update arithmetic differently (at LLVM's -O0, as the tests run, one of 16k masters
    of "ZeRO-3, tensor" came out 1.4e-5 apart after three steps; at -O2 it was equal, and
    Adafactor's factored sums differed by 1.5e-8). A master that lost its low half is 2**-9
    off."""
    kw = dict(BF16, **(PATHS[path] or _three_tiers(tmp_path)))
    runs = {}
    for split in (False, True):
        config = small_config(offload__split_masters=split, **kw)
        if config.offload.ssd_dir:
            config.offload.ssd_dir += f"/{split}"
        exp, state, losses = train(config)
        state = exp.settled(state)
        kept = exp.checkpointed(state)  # The tiers' chunks filled in.
        runs[split] = exp, losses, state, exp.params_numpy(state), jax.device_get(kept.opt_state)
    (whole, whole_losses, _, *whole_state), (exp, losses, state, *split_state) = runs.values()
    assert exp.plan.split_masters and not whole.plan.split_masters
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-6)
    for a, b in zip(split_state, whole_state, strict=True):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), a, b)

    chunks = lambda e: (
        e.streamed_update.chunks + (e.offloaded.cpu.chunks if e.offloaded.cpu else [])
    )
    tiers = {DEVICE, HOST, SSD} if PATHS[path] is None else {HOST}
    assert {c.tier for c in chunks(exp)} >= tiers
    for c in chunks(exp):
        assert c.master.dtype == (np.float32 if c.tier == CPU else masters.LOW), c
    if PATHS[path] is not None:  # The same placement: half the masters' bytes, held and moved.
        local = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
        assert local(state.params) == exp.plan.state_bytes["master params"]
        assert 2 * exp.plan.state_bytes["master params"] == whole.plan.state_bytes["master params"]
        for a, b in zip(chunks(exp), chunks(whole), strict=True):
            halved = local_bytes(b.master) // (1 if a.tier == CPU else 2)
            assert (a.tier, local_bytes(a.master), local_bytes(a.state)) == (
                b.tier,
                halved,
                local_bytes(b.state),
            )
    for e in (exp, whole):
        if e.ssd:
            e.ssd.close()


def test_split_masters_checkpoint_and_resume(tmp_path):
    """A checkpoint holds the low halves (the host cores' masters too) and the compute copy;
    it resumes bit for bit, also in a run whose host cores take other chunks (their masters
    whole: the share may change between runs, `cpu_update=-1` measures it at each start),
    and a run that keeps its masters whole refuses it, naming the setting."""
    kw = dict(BF16, zero_stage=1, mesh__data=8, offload__policy="optimizer")
    config = small_config(offload__cpu_update=0.5, **kw)
    exp, state, _ = train(config, steps=2)
    assert exp.checkpoint_layout == ("optimizer", True) and exp.offloaded.cpu
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
    ckpt.save(2, exp.checkpointed(state), 2, *exp.checkpoint_layout)
    ckpt.close()
    batch, params = exp.global_batch(make_batches(config)[2]), exp.params_numpy(state)
    loss = float(exp.train_step(state, batch)[1]["loss"])  # Donates `state`'s device arrays.
    for share in (0.5, 0.0, 0.25):
        config.offload.cpu_update = share
        run = build(config, make_mesh(config.mesh))
        restored, _ = Checkpointer(str(tmp_path), 1, 1).restore(
            2, run.checkpoint_target(), *run.checkpoint_layout
        )
        restored = run.from_checkpointed(restored)
        jax.tree.map(np.testing.assert_array_equal, run.params_numpy(restored), params)
        assert float(run.train_step(restored, batch)[1]["loss"]) == loss, share
    config.offload.split_masters = False
    whole = build(config, make_mesh(config.mesh), fit_compiled=False)
    held = r"masters split in halves, .* --config.offload.split_masters=true"
    with pytest.raises(ConfigError, match=held):
        Checkpointer(str(tmp_path), 1, 1).restore(
            2, whole.checkpoint_target(), *whole.checkpoint_layout
        )


def test_bfloat16_first_moment_is_held_and_moved_in_two_bytes():
    """config.train.mu_dtype=bfloat16 (AdamW's first moment, optax's mu_dtype): the moment
    lives in bfloat16 on and off the device, the offloaded update moves 8 bytes a parameter
    each way with split masters (2 + 2 + 4), and the offloaded run trains as the on-device
    one with the same setting."""
    kw = dict(BF16, zero_stage=1, mesh__data=8, train__mu_dtype="bfloat16")
    _, _, ref_losses = train(small_config(**kw))
    exp, state, losses = train(small_config(offload__policy="optimizer", **kw))
    # Looser than float32 moments' 5e-6: a last-bit difference in the update's fusions flips
    # a moment's bfloat16 rounding (3e-5 apart at the third step).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    states = jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
    mus = [s.mu for s in states if hasattr(s, "mu")]
    assert mus and {m.dtype for m in mus} == {np.dtype(jnp.bfloat16)}
    for c in exp.streamed_update.chunks:  # Moved: the master's low half, mu and nu.
        adam = [x for x in jax.tree.leaves(c.state) if x.ndim]
        assert [c.master.dtype, *(x.dtype for x in adam)] == [masters.LOW, jnp.bfloat16, np.float32]
    with pytest.raises(ConfigError, match="mu_dtype=bfloat16 .*=adafactor keeps none"):
        validate(small_config(train__optimizer="adafactor", **kw))
