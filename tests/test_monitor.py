"""Anomaly skipping inside the step, the monitor's decisions, stragglers and the hang watchdog.

Whole runs with injected faults (through the launcher and the supervisor) are in
test_supervise.py.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from angel_jax import monitor as monitor_lib
from angel_jax.config import ConfigError, load_config, validate
from angel_jax.mesh import make_mesh
from angel_jax.monitor import Diverged, LossWindow, Monitor, Rollback
from angel_jax.train import build
from tests.test_train_parity import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def monitor_config(**monitor):
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    config.monitor.update(hang_timeout_s=0.0, **monitor)
    return config


# --- the guard inside the jitted step --------------------------------------------------------


@pytest.fixture(scope="module")
def exp():
    config = small_config(zero_stage=3, mesh__data=4, mesh__tensor=2, train__batch_size=4)
    config.model.num_layers = 1
    return build(config, make_mesh(config.mesh))


def random_state(exp):
    """A state laid out like `exp`'s, built on the host (no init program to compile): small
    random weights, zero moments and counts."""
    rng = np.random.default_rng(0)

    def leaf(path, abstract):
        if abstract is None:
            return None
        floating = np.issubdtype(abstract.dtype, np.floating)
        is_param = jax.tree_util.keystr(path).startswith((".params", ".compute_params"))
        if floating and is_param:
            value = (0.05 * rng.standard_normal(abstract.shape)).astype(abstract.dtype)
        else:
            value = np.zeros(abstract.shape, abstract.dtype)
        return jax.device_put(value, abstract.sharding)

    return jax.tree_util.tree_map_with_path(leaf, exp.abstract_state)


def same(a, b) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_skip_keeps_params_and_moments(exp):
    rows = np.random.default_rng(0).integers(0, 512, (4, 33)).astype(np.int32)
    bad = rows.copy()
    bad[1, 0] = 10**6  # An out-of-range token: NaN embeddings, NaN loss and grads.
    step = exp.guarded_train_step
    state, metrics = step(random_state(exp), exp.global_batch(rows), np.inf)
    assert jax.device_get(metrics["skipped"]) == 0.0
    before = jax.device_get((state.params, state.opt_state))

    state, metrics = step(state, exp.global_batch(bad), np.inf)
    m = jax.device_get(metrics)
    assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"]) and m["skipped"] == 1.0
    assert int(state.step) == 2  # The batch is used up,
    # but params, moments and the optimizer's counts (its schedule) are as before.
    assert same(jax.device_get((state.params, state.opt_state)), before)

    state, metrics = step(state, exp.global_batch(rows), np.inf)
    assert jax.device_get(metrics["skipped"]) == 0.0 and int(state.step) == 3
    after = jax.device_get(state.params)
    assert not same(after, before[0])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))

    # A finite loss above the ceiling (a spike) is skipped too.
    state, metrics = step(state, exp.global_batch(rows), 1.0)
    assert np.isfinite(jax.device_get(metrics["loss"]))
    assert jax.device_get(metrics["skipped"]) == 1.0
    assert same(jax.device_get(state.params), after)


@pytest.mark.parametrize("delayed", [False, True])
def test_skip_with_offloaded_optimizer_state(delayed):
    """Offloaded states are updated outside the jitted step: the loss and grad norm are read on
    the host first, and an anomalous step's streamed update is left out (delayed: it is not
    left waiting either)."""
    config = small_config(
        offload__policy="optimizer",
        offload__delayed_update=delayed,
        mesh__data=2,
        train__batch_size=4,
    )
    config.model.num_layers = 1
    exp = build(config, make_mesh(config.mesh, jax.devices()[:2]))
    rows = np.random.default_rng(0).integers(0, 512, (4, 33)).astype(np.int32)
    bad = rows.copy()
    bad[3, 0] = 10**6
    state, metrics = exp.guarded_train_step(random_state(exp), exp.global_batch(rows), np.inf)
    assert float(metrics["skipped"]) == 0.0
    state = exp.settled(state)
    before = jax.device_get((exp.params_numpy(state), state.opt_state, state.compute_params))
    state, metrics = exp.guarded_train_step(state, exp.global_batch(bad), np.inf)
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 2
    state = exp.settled(state)
    after = jax.device_get((exp.params_numpy(state), state.opt_state, state.compute_params))
    assert same(after, before)


# --- decisions on the host -----------------------------------------------------------------


def test_loss_window_spike_test():
    window = LossWindow(size=4, zscore=3.0)
    for loss in (2.0, 2.2, 1.8):
        assert window.judge(loss) is None and window.ceiling() == np.inf  # Not full yet.
        window.add(loss)
    window.add(2.0)
    assert window.ceiling() == pytest.approx(2.0 + 3.0 * np.std([2.0, 2.2, 1.8, 2.0]))
    assert window.judge(2.3) is None
    assert window.judge(2.5) == "spike"
    assert window.judge(float("nan")) == "nonfinite"
    assert window.judge(2.0, grad_norm=float("inf")) == "nonfinite"
    assert LossWindow(size=2, zscore=0.0).ceiling() == np.inf  # z = 0: no spike test.


def feed(mon: Monitor, losses, start=0, sync_at=()):
    """Observes one step per loss (host numbers stand in for device metrics); returns the
    first Rollback and the step it came at."""
    mon.start(start, start)
    for i, loss in enumerate(losses):
        step = start + i + 1
        rollback = mon.observe(step, {"loss": loss, "grad_norm": 1.0}, step, step in sync_at)
        if rollback:
            return rollback, step
    return None, None


def test_rollback_past_a_spike(tmp_path):
    mon = Monitor(
        monitor_config(
            on_anomaly="rollback", spike_zscore=4.0, spike_window=5, rollback_skip_batches=2
        ),
        str(tmp_path),
    )
    rollback, seen_at = feed(mon, [3.0, 3.1, 2.9, 3.05, 2.95, 3.0, 9.0, 3.0])
    # Step 7 spiked; it is read after step 8 is dispatched. The data resumes past its batch
    # (index 7) and the two after it.
    assert (rollback, seen_at) == (Rollback(step=7, data_index=9), 8)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["action"]) for e in events] == [("spike", 7, "rollback")]
    # A checkpoint step reads its own loss at once: a NaN there is caught before the save.
    rollback, seen_at = feed(mon, [3.0, float("nan")], start=20, sync_at={22})
    assert (rollback, seen_at) == (Rollback(step=22, data_index=24), 22)


def test_log_only_and_the_limit_on_anomalies_in_a_row(tmp_path):
    config = monitor_config(on_anomaly="log", max_consecutive_anomalies=3)
    nan = float("nan")
    assert feed(Monitor(config, str(tmp_path)), [3.0, nan, nan, 3.0, nan, nan, nan, 3.0]) == (
        None,
        None,
    )
    with pytest.raises(Diverged, match="4 anomalous steps in a row up to step 5"):
        feed(Monitor(config, str(tmp_path)), [3.0, nan, nan, nan, nan, nan])


def test_rollbacks_are_bounded(tmp_path):
    mon = Monitor(monitor_config(on_anomaly="rollback", max_rollbacks=1), str(tmp_path))
    assert feed(mon, [3.0, float("nan"), 3.0])[0] == Rollback(2, 2)
    with pytest.raises(Diverged, match="rollback 2 at step 2 is more than"):
        feed(mon, [3.0, float("nan"), 3.0])


def test_straggler_is_logged_with_its_host(tmp_path, monkeypatch):
    mon = Monitor(monitor_config(straggler_factor=3.0, straggler_window=6), str(tmp_path))
    times = iter([0.0, 1.0, 2.0, 3.1, 4.0, 5.0, 6.0, 15.0, 16.0, 17.0])  # Step 8 takes 9 s.
    monkeypatch.setattr(monitor_lib.time, "perf_counter", lambda: next(times))
    mon.start(0, 0)
    for step in range(1, 12):
        mon.observe(step, {"loss": 3.0, "grad_norm": 1.0}, step)
    mon.saved(11)  # The step after a checkpoint is not timed; nor is the first.
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in events] == [("straggler", 8)]
    assert events[0]["host"] == os.uname().nodename and events[0]["step_s"] == 9.0


def test_watchdog_dumps_stacks_and_exits(tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from angel_jax.monitor import EventLog, Watchdog

        def stuck_in_a_collective():
            dog = Watchdog(0.5, 1.0, EventLog({str(tmp_path)!r}))
            dog.beat(41)
            time.sleep(30)

        stuck_in_a_collective()
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == monitor_lib.EXIT_HANG, result.stderr
    assert "hang: no training step finished" in result.stderr and "after step 41" in result.stderr
    assert "in stuck_in_a_collective" in result.stderr  # The main thread's stack.
    (event,) = [
        json.loads(line) for line in (tmp_path / "events.jsonl").read_text().split("\n")[:1]
    ]
    assert event["kind"] == "hang" and event["step"] == 41


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.monitor.on_anomaly=retry"], "use one of skip, rollback, log"),
        (
            ["--config.monitor.on_anomaly=rollback", "--config.checkpoint.every_steps=0"],
            "needs checkpoints to roll back to",
        ),
        (["--config.monitor.spike_window=1"], "spike_window=1: must be at least 2"),
        (["--config.monitor.hang_timeout_s=-1"], "hang_timeout_s=-1.0: must be 0 (off) or more"),
    ],
)
def test_monitor_settings_are_checked(overrides, message):
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"), overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config)


def test_metric_and_event_lines_are_strict_json_even_when_the_loss_is_nan():
    import math

    from angel_jax.metrics import json_line

    line = json_line({"step": 3, "loss": math.nan, "grad_norm": math.inf, "skipped": 1})
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))
    assert record == {"step": 3, "loss": "nan", "grad_norm": "inf", "skipped": 1}
