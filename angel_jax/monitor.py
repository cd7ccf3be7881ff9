"""Fault handling for runs that last weeks: numeric anomalies, stragglers and hangs.

The train loop hands every step's metrics to a `Monitor`, which reads them one step late (after
the next step is dispatched, so the device never waits for the host):

- **Anomalies**: a non-finite loss or grad norm, or a loss spike (above mean + z * std of the
  last `spike_window` accepted losses). `config.monitor.on_anomaly`: `skip` drops the update
  inside the jitted step (`skip_if_anomalous`; the step count and the data still advance),
  `rollback` restores the last checkpoint and moves the data past the anomalous batch, `log`
  only records it. Too many anomalies in a row, or too many rollbacks, stop the run
  (`Diverged`, exit status 4): the supervisor does not restart a run that diverges.
- **Stragglers**: a step slower than `straggler_factor` x the median of the last
  `straggler_window` steps is logged with this process's host.
- **Hangs**: a watchdog thread; no step for `hang_timeout_s` (`first_step_timeout_s` before the
  first) dumps every thread's Python stack and exits with status 3, for the supervisor to
  restart. A C-level faulthandler timer backs it up where the main thread holds the GIL.

Events go to `WORKDIR/events.jsonl`, one JSON object a line. `ANGEL_FAULTS` injects faults for
tests (angel_jax/faults.py).
"""

import collections
import dataclasses
import faulthandler
import math
import os
import pathlib
import signal
import socket
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from angel_jax.faults import Faults
from angel_jax.metrics import json_line

EXIT_HANG = 3  # The watchdog found no step for hang_timeout_s: restart.
EXIT_DIVERGED = 4  # Anomalies beyond the configured bounds: do not restart.
EXIT_OUT_OF_MEMORY = 5  # XLA's RESOURCE_EXHAUSTED: the same settings would fail again.
EXIT_SAVE_FAILED = 6  # A checkpoint could not be written (a full disk): a restart would too.


class Diverged(RuntimeError):
    """Anomalies beyond `max_consecutive_anomalies` or `max_rollbacks`: the run stops."""


class Stopped(RuntimeError):
    """SIGINT or SIGTERM: the run saved its last step and stops, exit status 128 + signal
    (130, 143), which the supervisor does not restart."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before a kill) become a
    request that the train loop honours after its current step: it saves a checkpoint and
    stops. A second signal ends the process at once. With several processes, SIGTERM goes
    through JAX's preemption sync point, so every process stops after the same step."""

    def __init__(self):
        self.signum = None
        self._previous = {}
        if jax.process_count() > 1:
            return  # JAX's preemption service handles SIGTERM for the processes together.
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:  # The second one: the default action, now.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def after(self, step: int) -> bool:
        """Whether to stop after `step` (every process gets the same answer)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
        return self.signum is not None

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


@dataclasses.dataclass(frozen=True)
class Rollback:
    step: int  # The anomalous step.
    data_index: int  # Where the data resumes: past the anomalous batch (and any skipped).


def is_anomalous(loss, grad_norm, ceiling):
    """Whether a step's update is to be left out: its loss or grad norm is not finite, or its
    loss is above `ceiling` (traced)."""
    return ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (loss <= ceiling))


def skip_if_anomalous(step_fn):
    """`step_fn(state, batch) -> (state, metrics)` as `(state, batch, ceiling) -> (state,
    metrics)` that keeps the old params and optimizer state when the loss or the grad norm is
    not finite or the loss is above `ceiling`. The step count still advances (the batch is
    used up). `metrics["skipped"]` is 1 for a dropped update, else 0.

    The choice is a `where` per element, fused into the update's own elementwise pass: no
    extra memory (the state is donated) and no host round trip.
    """

    def step(state, batch, ceiling):
        new, metrics = step_fn(state, batch)
        ok = jnp.logical_not(is_anomalous(metrics["loss"], metrics["grad_norm"], ceiling))
        keep = lambda n, o: jnp.where(ok, n, o)
        new = new.replace(
            params=jax.tree.map(keep, new.params, state.params),
            opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
        )
        return new, {**metrics, "skipped": jnp.logical_not(ok).astype(jnp.int32)}

    return step


class LossWindow:
    """The last `size` accepted losses and the spike test on them."""

    def __init__(self, size: int, zscore: float):
        self.losses = collections.deque(maxlen=size)
        self.zscore = zscore

    def ceiling(self) -> float:
        """Losses above this are spikes; inf until the window is full or with the test off."""
        if not self.zscore or len(self.losses) < self.losses.maxlen:
            return math.inf
        values = np.asarray(self.losses, np.float64)
        return float(values.mean() + self.zscore * values.std())

    def judge(self, loss: float, grad_norm: float = 0.0) -> str | None:
        """None for a normal loss, else the kind of anomaly: nonfinite or spike."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite"
        return "spike" if loss > self.ceiling() else None

    def add(self, loss: float) -> None:
        self.losses.append(loss)


class EventLog:
    """`WORKDIR/events.jsonl`: what went wrong and when, one JSON object a line. Events every
    process sees alike (anomalies) are written by process 0; per-host ones (stragglers, hangs)
    by the process they happened on."""

    def __init__(self, workdir: str):
        self.path = pathlib.Path(workdir) / "events.jsonl"
        self.process = jax.process_index()
        self.host = socket.gethostname()

    def write(self, kind: str, step: int | None, every_process: bool = False, **fields) -> None:
        if not every_process and self.process != 0:
            return
        record = dict(
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
            kind=kind,
            step=step,
            process=self.process,
            host=self.host,
            **fields,
        )
        # One write of one line with O_APPEND: lines from several processes do not interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json_line(record) + "\n").encode())
        finally:
            os.close(fd)

    def say(self, text: str) -> None:
        """A line on this process's stderr, whichever process it is."""
        print(f"[process {self.process} on {self.host}] {text}", file=sys.stderr, flush=True)


class Watchdog:
    """Exits with EXIT_HANG (after dumping every thread's stack) when `beat` is not called
    for `timeout_s` (`first_timeout_s` before the first beat)."""

    GRACE_S = 60.0  # The C-level backstop fires this much later than the Python thread.

    def __init__(self, timeout_s: float, first_timeout_s: float, events: EventLog):
        self.timeout_s, self.events = timeout_s, events
        self.step = None
        self._deadline = time.monotonic() + max(timeout_s, first_timeout_s)
        self._stop = threading.Event()
        self._arm_backstop(max(timeout_s, first_timeout_s))
        self._thread = threading.Thread(target=self._watch, name="angel-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int | None = None) -> None:
        self.step = step if step is not None else self.step
        self._deadline = time.monotonic() + self.timeout_s
        self._arm_backstop(self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()

    def _arm_backstop(self, seconds: float) -> None:
        # A thread in C: it dumps the stacks and exits (status 1) even if the GIL is never
        # released, where the Python thread below cannot run. To the process's own stderr: a
        # replaced sys.stderr (a notebook's, pytest's capture) may have no file descriptor.
        faulthandler.dump_traceback_later(seconds + self.GRACE_S, exit=True, file=sys.__stderr__)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() > self._deadline:
                self._trip()

    def _trip(self) -> None:
        after = f"step {self.step}" if self.step is not None else "the start"
        self.events.say(
            f"hang: no training step finished within the watchdog's timeout after {after} "
            f"(config.monitor.hang_timeout_s={self.timeout_s}); Python stacks follow, then exit "
            f"status {EXIT_HANG}"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.events.write("hang", self.step, every_process=True, timeout_s=self.timeout_s)
        sys.stderr.flush()
        os._exit(EXIT_HANG)


class StragglerClock:
    """Step times as the steps are read: a step slower than `factor` x the median of the last
    `window` is logged with this process's host (a straggler)."""

    def __init__(self, factor: float, window: int, events: EventLog):
        self.factor, self.events = factor, events
        self.step_times = collections.deque(maxlen=window)
        self._last_read = None  # (step, time) of the last step read.
        self._untimed_until = 0  # Steps up to this one are not timed (start, saves, rollbacks).

    def restart(self, step: int) -> None:
        """Training (re)starts after `step`: its first step is not timed."""
        self._last_read = None
        self._untimed_until = step + 1

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was just started: the next step's time includes it."""
        self._untimed_until = step + 1

    def read(self, step: int, now: float) -> None:
        """Step `step` was read at `now`: time it against the last one read."""
        previous, self._last_read = self._last_read, (step, now)
        if previous is None or previous[0] != step - 1 or step <= self._untimed_until:
            return
        took = now - previous[1]
        if self.factor and len(self.step_times) >= max(2, self.step_times.maxlen // 2):
            median = float(np.median(self.step_times))
            if took > self.factor * median:
                self.events.say(
                    f"straggler: step {step} took {took:.3f} s, {took / median:.1f}x the median "
                    f"{median:.3f} s"
                )
                self.events.write(
                    "straggler", step, every_process=True, step_s=took, median_s=median
                )
        self.step_times.append(took)


class AnomalyPolicy:
    """Decides what a step's loss and grad norm mean: accepted into the spike window, or an
    anomaly to skip, roll back or log (`config.monitor.on_anomaly`), or the end (`Diverged`)."""

    def __init__(self, cfg: ml_collections.ConfigDict, events: EventLog):
        self.cfg, self.events = cfg, events
        self.window = LossWindow(cfg.spike_window, cfg.spike_zscore)
        self.rollbacks = 0
        self._consecutive = 0

    def judge(self, step, loss, norm, skipped, data_index) -> Rollback | None:
        """A `Rollback` when the run must go back to its last checkpoint, else None.
        `skipped`: the step already dropped its update."""
        if skipped:  # Dropped inside the step.
            kind = "nonfinite" if not (math.isfinite(loss) and math.isfinite(norm)) else "spike"
            return self._anomaly(step, kind, loss, norm, data_index, "skipped the update")
        kind = self.window.judge(loss, norm)
        if kind is None:
            self.window.add(loss)
            self._consecutive = 0
            return None
        if self.cfg.on_anomaly == "rollback":
            return self._anomaly(step, kind, loss, norm, data_index, "rolling back")
        return self._anomaly(step, kind, loss, norm, data_index, "logged only")

    def _anomaly(self, step, kind, loss, norm, data_index, action) -> Rollback | None:
        self._consecutive += 1
        ceiling = self.window.ceiling()
        self.events.write(
            kind,
            step,
            loss=loss,
            grad_norm=norm,
            ceiling=None if math.isinf(ceiling) else ceiling,
            action=self.cfg.on_anomaly,
        )
        limit = f" (> {ceiling:.4f}, mean + {self.cfg.spike_zscore} std)" if kind == "spike" else ""
        if self.events.process == 0:
            self.events.say(
                f"anomaly at step {step}: {kind} loss {loss:.4g}{limit}, grad norm {norm:.4g}; "
                f"{action}"
            )
        if self._consecutive > self.cfg.max_consecutive_anomalies:
            raise Diverged(
                f"{self._consecutive} anomalous steps in a row up to step {step} (more than "
                f"config.monitor.max_consecutive_anomalies={self.cfg.max_consecutive_anomalies})"
                "; the run stops: lower config.train.lr, or roll back further by hand"
            )
        if self.cfg.on_anomaly != "rollback":
            return None
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_rollbacks:
            raise Diverged(
                f"rollback {self.rollbacks} at step {step} is more than "
                f"config.monitor.max_rollbacks={self.cfg.max_rollbacks}; the run stops"
            )
        return Rollback(step, data_index + self.cfg.rollback_skip_batches)


class Monitor:
    """Watches a training run: see the module docstring. Create it before the slow start
    (compiling, restoring): the hang watchdog runs from then on."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.cfg = config.monitor
        self.events = EventLog(workdir)
        self.anomalies = AnomalyPolicy(self.cfg, self.events)
        self.clock = StragglerClock(
            self.cfg.straggler_factor, self.cfg.straggler_window, self.events
        )
        self.faults = Faults(os.environ.get("ANGEL_FAULTS", ""), workdir, config.model.vocab_size)
        self.watchdog = None
        if self.cfg.hang_timeout_s > 0:
            self.watchdog = Watchdog(
                self.cfg.hang_timeout_s, self.cfg.first_step_timeout_s, self.events
            )
        self._unread = []  # (step, metrics, data index) dispatched but not yet read.
        self._next_step = 0  # The step the next dispatch computes,
        self._next_batch = 0  # and the batch it reads.

    @property
    def skips_in_step(self) -> bool:
        return self.cfg.on_anomaly == "skip"

    def step_fn(self, exp):
        """`(state, batch) -> (state, metrics)`: the experiment's step, guarded when anomalies
        are skipped. Compiles it."""
        step_fn = exp.loop_step  # Guarded when anomalies are skipped in the step.

        def run(state, batch):
            self._next_step += 1
            self._next_batch += 1
            batch = self.faults.before_step(self._next_step, self._next_batch - 1, batch)
            if self.skips_in_step:
                return step_fn(state, batch, self.anomalies.window.ceiling())
            return step_fn(state, batch)

        return run

    def start(self, step: int, data_index: int) -> None:
        """Training (re)starts after `step` with batch `data_index`; its first step is not
        timed."""
        self._next_step, self._next_batch = step, data_index
        self._unread.clear()
        self.clock.restart(step)
        self._beat(step)

    def observe(self, step: int, metrics: dict, data_index: int, sync: bool = False):
        """Takes step `step`'s (device) metrics and reads the previous step's, or this one's
        too with `sync` (before a checkpoint, which must not hold an anomalous state).
        `data_index`: the batch index after this step's batch. Returns a `Rollback` when the
        run must go back to its last checkpoint, else None."""
        self._unread.append((step, metrics, data_index))
        ready = len(self._unread) if sync else len(self._unread) - 1
        for _ in range(ready):
            verdict = self._read(*self._unread.pop(0))
            if verdict is not None:
                self._unread.clear()
                return verdict
        return None

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was just started: the next step's time includes it."""
        self.clock.saved(step)
        self.faults.after_save(step)

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.stop()

    def _beat(self, step: int) -> None:
        if self.watchdog:
            self.watchdog.beat(step)

    def _read(self, step: int, metrics: dict, data_index: int) -> Rollback | None:
        names = [n for n in ("loss", "grad_norm", "skipped") if n in metrics]
        values = {k: float(v) for k, v in jax.device_get({n: metrics[n] for n in names}).items()}
        self._beat(step)
        self.clock.read(step, time.perf_counter())
        loss, norm = values["loss"], values.get("grad_norm", 0.0)
        return self.anomalies.judge(step, loss, norm, values.get("skipped"), data_index)

    def rolled_back(self, step: int, rollback: Rollback) -> None:
        """The state is back at `step` after `rollback`."""
        self.events.write("rollback", rollback.step, to_step=step, data_index=rollback.data_index)
        if self.events.process == 0:
            self.events.say(
                f"rolled back to step {step}; the data resumes at batch {rollback.data_index}, "
                f"past the anomalous step {rollback.step}"
            )
        self.start(step, rollback.data_index)
