"""The training loop: from the latest checkpoint in a workdir (or from scratch) to
config.train.steps, with metrics, checkpoints, rollbacks on anomalies and a clean stop on a
signal. `train_loop` is what the launcher runs; the step it repeats comes from `train.build`.
"""

import pathlib
import signal
import time

import jax
import ml_collections
import numpy as np

from angel_jax import kernels, lora
from angel_jax.config import ConfigError
from angel_jax.elastic import Reshard, layout_of, settings_of
from angel_jax.lock import hold_workdir
from angel_jax.models import validate
from angel_jax.monitor import Stopped, StopRequest
from angel_jax.state_layout import TrainState
from angel_jax.train import Experiment, build


def train_loop(config: ml_collections.ConfigDict, workdir: str, devices=None) -> dict | None:
    """Trains from the latest checkpoint in `workdir` (or from scratch) to `config.train.steps`,
    watched by a `monitor.Monitor` (anomalies, stragglers, hangs), on a mesh over `devices`
    (default: all). The checkpoint may come from another mesh (docs/hosts.md, "Resume on
    another mesh").

    Returns the last logged metrics.
    """
    from angel_jax.monitor import Monitor

    validate(config)
    try:
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--workdir {workdir}: cannot create it ({e}); pass a writable directory"
        ) from None
    with hold_workdir(workdir):
        monitor = Monitor(config, workdir)  # Its hang watchdog runs from here on.
        stop = StopRequest()
        try:
            return _train_loop(config, workdir, monitor, stop, devices)
        finally:
            stop.close()
            monitor.close()


def restore_or_init(exp: Experiment, ckpt, monitor, say) -> tuple[TrainState, int]:
    """(state, next batch index) from the newest readable checkpoint, or a fresh state."""
    # Through a Reshard: a checkpoint saved on another mesh or layout resumes here.
    target, reshard = exp.checkpoint_target(), Reshard(exp)
    found = ckpt.restore_latest(target, *exp.checkpoint_layout, reshard) if ckpt else None
    if found is None:
        return exp.init_state(), 0
    for step, reason in found.unreadable:
        say(
            f"warning: checkpoint {ckpt.directory / str(step)} is unreadable ({reason}); set "
            f"aside as {step}.unreadable, resuming from the one before"
        )
        monitor.events.write("unreadable_checkpoint", step, reason=reason)
    say(f"resumed from {ckpt.directory / str(found.step)}")
    return exp.from_checkpointed(found.state), found.data_index


def _train_loop(
    config: ml_collections.ConfigDict, workdir: str, monitor, stop: StopRequest, devices=None
) -> dict | None:
    from angel_jax.checkpoint import Checkpointer
    from angel_jax.data import make_batches
    from angel_jax.data.loader import process_rows
    from angel_jax.mesh import make_mesh
    from angel_jax.metrics import MetricsWriter, say

    t = config.train
    mesh = make_mesh(config.mesh, devices)
    exp = build(config, mesh)
    # This process's rows of each batch; checks the data before any device memory is taken.
    batches = make_batches(config, process_rows(exp.batch_sharding, t.batch_size))
    ckpt = None
    if config.checkpoint.every_steps > 0:
        ckpt = Checkpointer(
            workdir,
            config.checkpoint.every_steps,
            config.checkpoint.keep,
            config.checkpoint.async_save,
        )
    train_step = monitor.step_fn(exp)  # Compiled before the state takes the device's memory.
    if ckpt:  # Before any step: a checkpoint that cannot fit its disk would stop the run later.
        ckpt.check_space(exp.checkpoint_target())
    state, data_index = restore_or_init(exp, ckpt, monitor, say)
    start = int(jax.device_get(state.step))
    if start >= t.steps:
        say(
            f"nothing to do: the run is at step {start} and config.train.steps="
            f"{t.steps}; raise config.train.steps to train further"
        )
        if ckpt:
            ckpt.close()
        return None

    announce(config, exp, mesh, start)
    writer = MetricsWriter(workdir, t.tensorboard)
    if jax.process_index() == 0:  # What this run was, for whoever reads the workdir later.
        (pathlib.Path(workdir) / "config.json").write_text(config.to_json_best_effort(indent=1))
    logger = _Logger(config, exp, mesh.size, writer, start)
    pending = None
    batch_iter = batches.iterate(data_index)
    step = start
    monitor.start(step, data_index)
    while step < t.steps:
        batch = exp.global_batch(next(batch_iter))
        with jax.transfer_guard("disallow"):
            state, metrics = train_step(state, batch)
        step, data_index = step + 1, data_index + 1
        if ckpt:  # A save in flight that failed stops the run at the next step.
            ckpt.check()
        if pending:  # Step t's metrics are read after step t+1 is dispatched.
            logger.log(*pending)
            pending = None
        if logger.due(step):
            pending = (step, metrics)
        stopping = stop.after(step)
        saving = ckpt is not None and (stopping or ckpt.should_save(step, t.steps))
        # Reads the previous step's loss (and this one's before a save: no anomalous state is
        # ever saved).
        rollback = monitor.observe(step, metrics, data_index, sync=saving)
        if rollback:
            ckpt.wait()  # Then free the state before restoring.
            exp.steps.discard()  # A delayed update of the steps rolled back: dropped.
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state)
            state, _ = restore_or_init(exp, ckpt, monitor, say)
            step, data_index = int(jax.device_get(state.step)), rollback.data_index
            monitor.rolled_back(step, rollback)
            batch_iter = batches.iterate(data_index)
            pending = None
            logger.restart(step)
            continue
        if saving:
            if pending:  # Read already: metrics.jsonl is complete up to every checkpoint.
                logger.log(*pending)
                pending = None
            state = exp.settled(state)  # A delayed update goes in first: resume is exact.
            about = {"pipeline": layout_of(exp)["pipeline"], "settings": settings_of(config)}
            ckpt.save(step, exp.checkpointed(state), data_index, *exp.checkpoint_layout, about)
            monitor.saved(step)
        if stopping:
            break
    if pending:
        logger.log(*pending)
    if ckpt:
        ckpt.close()  # Waits for the last save.
    writer.close()
    if stop.signum is not None and step < t.steps:
        name = signal.Signals(stop.signum).name
        where = (
            f", saved in {ckpt.directory / str(step)}; the same command resumes from there"
            if ckpt
            else "; nothing saved (config.checkpoint.every_steps=0)"
        )
        say(f"stopped by {name} after step {step}{where}")
        raise Stopped(stop.signum)
    return logger.last


def announce(config: ml_collections.ConfigDict, exp: Experiment, mesh, start: int) -> None:
    """The run's banner: model, mesh, kernels, the ZeRO-Cache plan, and a note for each
    setting that changes what a step computes or reports."""
    from angel_jax.metrics import peak_tflops, say

    t = config.train
    cfg = exp.model_config
    params = exp.abstract_state.params
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    n_params, trained = count(params), count(lora.adapters(params))
    lora_text = f" ({trained / 1e6:.2f}M of them LoRA adapters, trained)" if trained else ""
    mesh_text = " x ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "1 device"
    say(
        f"angel-jax: {n_params / 1e6:.1f}M params{lora_text}, {cfg.num_layers} layers, "
        f"mesh {mesh_text} "
        f"({mesh.size} {jax.devices()[0].platform} devices), ZeRO-{config.zero_stage}, "
        f"batch {t.batch_size} x {t.seq_len}, steps {start} -> {t.steps}"
    )
    for line in kernels.banner(config.model, mesh.shape["context"] > 1):
        say(line)
    say(exp.plan.table())
    if config.offload.delayed_update:
        say(
            "note: config.offload.delayed_update=true: each step's update runs during the next "
            "step, which computes on weights one update behind"
        )
    if config.offload.update_in_step and exp.steps.waits_for_the_norm:
        say(
            f"note: with {' and '.join(exp.steps.waits_for_the_norm)} the update in the step "
            "waits for the whole step's grad norm and runs after the backward pass, not beside "
            'it (docs/zero-cache.md, "The update"); config.offload.speculative_update=true, or '
            "config.train.grad_clip=0 and config.monitor.on_anomaly=log, let it overlap the "
            "backward pass"
        )
    if config.offload.speculative_update:
        say(
            "note: config.offload.speculative_update=true: each step's update assumes it "
            "neither clips nor is anomalous; a step that clips is updated again after it "
            '(metrics "update_redone"), and the steps after it run the exact update until one '
            'does not clip (metrics "speculated")'
        )
    if exp.pipeline:
        say(exp.pipeline.table())
    if t.lr_scaling != "none":
        from angel_jax.optim.scaling import lr_and_warmup

        lr, warmup = lr_and_warmup(t)
        say(
            f"learning rate {lr:.3g}, warmup {warmup} steps: config.train.lr={t.lr:g} and "
            f"warmup_steps={t.warmup_steps} moved from batch {t.lr_base_batch or t.batch_size} "
            f"to {t.batch_size} by lr_scaling={t.lr_scaling}"
        )
    if peak_tflops(t.peak_tflops) is None:
        say(
            f"note: no known peak FLOP/s for device kind {jax.devices()[0].device_kind!r}: MFU "
            "is reported as null; set config.train.peak_tflops to report it"
        )


class _Logger:
    """Writes a step's metrics (metrics.jsonl, TensorBoard, the progress line) with its
    throughput and MFU over the steps since the last one logged."""

    def __init__(self, config, exp: Experiment, devices: int, writer, start: int):
        from angel_jax.metrics import peak_tflops

        self.train, self.writer, self.start = config.train, writer, start
        t = self.train
        per_token = lora.flops_per_token(exp.model_config, exp.abstract_state.params, t.seq_len)
        self.flops_per_step = per_token * t.batch_size * t.seq_len
        peak = peak_tflops(t.peak_tflops)
        self.peak_flops = None if peak is None else peak * 1e12 * devices
        self.last = None  # The last logged metrics.
        self.restart(start)

    def restart(self, step: int) -> None:
        """Times from `step` on (after a rollback, the steps before it are not counted)."""
        self.t_last, self.step_last = time.perf_counter(), step

    def due(self, step: int) -> bool:
        t = self.train
        return step % t.log_every_steps == 0 or step == t.steps or step == self.start + 1

    def log(self, step: int, device_metrics: dict) -> None:
        from angel_jax.metrics import host_metrics, progress_line, say

        t = self.train
        metrics = host_metrics(device_metrics, t.microbatches)
        now = time.perf_counter()
        step_time = (now - self.t_last) / (step - self.step_last)
        flops = None if self.peak_flops is None else self.flops_per_step / step_time
        metrics.update(
            step_time_s=step_time,
            tokens_per_s=t.batch_size * t.seq_len / step_time,
            mfu=None if flops is None else flops / self.peak_flops,
        )
        if step == self.start + 1:
            metrics["includes_compile"] = True
        self.writer.write(step, metrics)
        say(progress_line(step, t.steps, metrics))
        self.last, self.t_last, self.step_last = metrics, now, step
