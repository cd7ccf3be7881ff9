"""Orbax checkpoints of the train state and the data position.

Saves are asynchronous and atomic (orbax writes `STEP.orbax-checkpoint-tmp` and renames it to
`STEP` on commit), so a process killed mid-save leaves the previous checkpoint as the latest
complete one; the leftover temporary directory is removed when the next run opens the
directory. `restore_latest` goes back past checkpoints that cannot be read.

A save that cannot be written (the disk full, a write refused) stops the run with one line
(`SaveFailed`) naming the directory and its free space, and the previous checkpoint is still
the latest complete one. Before each save the state's bytes are checked against the free
space, so a save that cannot fit stops the run before it writes; orbax's own reports of a
failed write (its threads' errors and tracebacks) go to `WORKDIR/orbax.log`, not the
console.
"""

import dataclasses
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import traceback
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from angel_jax.config import ConfigError


class UnreadableCheckpoint(ConfigError):
    """A checkpoint whose files are damaged (or do not fit the current model)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason  # What orbax said, in one line.


class SaveFailed(Exception):
    """A checkpoint could not be written; the run stops (a restart would fail the same way)."""


@dataclasses.dataclass
class Restored:
    step: int
    state: object
    data_index: int  # The next batch to read.
    unreadable: list  # (step, reason) of newer checkpoints that could not be read, set aside.


def saved_run(workdir: str, flag: str = "--checkpoint") -> str:
    """`workdir`, checked to be a training run's with a checkpoint in it (for readers, which
    create nothing): one line naming `flag` and the fix when it is not."""
    path = pathlib.Path(workdir).absolute()
    if path.name.isdigit() and path.parent.name == "checkpoints":
        raise ConfigError(
            f"{flag} {workdir} is one checkpoint's directory; pass the run's workdir, "
            f"{path.parent.parent} (its latest readable checkpoint is taken)"
        )
    if not path.is_dir():
        raise ConfigError(f"{flag} {workdir}: no such directory; pass a training run's --workdir")
    steps = path / "checkpoints"
    if not steps.is_dir() or not any(d.name.isdigit() for d in steps.iterdir()):
        raise ConfigError(
            f"{flag} {workdir}: no checkpoint there (a run's workdir holds checkpoints/STEP; "
            "config.checkpoint.every_steps=0 saves none)"
        )
    return str(path)


class Checkpointer:
    """A training run's checkpoints, WORKDIR/checkpoints/STEP under one orbax manager: what a
    run asks of them. `_Writer` carries out the saves, `_Reader` the restores."""

    def __init__(
        self,
        workdir: str,
        every_steps: int,
        keep: int,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.every_steps = every_steps
        self.manager, self.log = _open_manager(workdir, self.directory, keep, async_save, read_only)
        self._writer = _Writer(self.directory, self.manager, self.log)
        self._reader = _Reader(self.directory, self.manager, self.log)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int, last_step: int) -> bool:
        return self.every_steps > 0 and (step % self.every_steps == 0 or step == last_step)

    def save(
        self,
        step: int,
        state,
        data_index: int,
        offload_policy: str = "none",
        split_masters: bool = False,
        about: dict | None = None,
    ) -> None:
        """`offload_policy` and `split_masters` name the state's layout: offloaded optimizer
        state is stored per layer (offload/stream.py), and split masters as their low halves
        beside the compute copy (offload/masters.py), so it restores as it is only under the
        same, and through a `reshard` (`restore`) under another. `about`: what else the
        checkpoint records for that (JSON: the pipeline's stage layout, the settings that
        give the state its shapes; `elastic.layout_of`, `elastic.settings_of`).

        `data_index` is global: the next batch of the whole run, whatever the process count
        (each process reads its rows of batch i, data/loader.py)."""
        meta = {
            **(about or {}),
            "next_batch_index": data_index,
            "offload_policy": offload_policy,
            "split_masters": split_masters,
        }
        self._writer.save(step, state, meta)

    def check_space(self, state, step: int | None = None) -> None:
        """Stops the run (SaveFailed) when a checkpoint of `state` (arrays, or their shapes
        and dtypes) would not fit the free space of the checkpoints' disk: a write cut short
        by a full disk costs the run's progress since the last save, a check costs nothing.
        Every process takes the same decision."""
        self._writer.check_space(state, step)

    def check(self) -> None:
        """Raises SaveFailed when an asynchronous save in flight has failed."""
        self._writer.check()

    def wait(self) -> None:
        """Waits for the save in flight; SaveFailed when it failed."""
        self._writer.wait()

    def restore(
        self,
        step: int,
        abstract_state,
        offload_policy: str = "none",
        split_masters: bool = False,
        reshard=None,
    ):
        """(state, next batch index) saved at `step`, placed as `abstract_state` says.

        Without `reshard` the state restores only under the layout it was saved in (orbax
        reshards it to any mesh). With one (`elastic.Reshard`), a state saved under another
        layout is read in its own form and converted, and a state of other shapes (a changed
        model) is one line naming the settings that changed."""
        return self._reader.restore(step, abstract_state, offload_policy, split_masters, reshard)

    def restore_latest(
        self,
        abstract_state,
        offload_policy: str = "none",
        split_masters: bool = False,
        reshard=None,
    ) -> Restored | None:
        """The newest checkpoint that can be read, or None when there is none.

        A checkpoint that cannot be read (damaged files) is passed over for the one before it;
        once an older one restores, the unreadable newer ones are renamed `STEP.unreadable` so
        that new saves can take their steps. When none can be read, the newest's error is
        raised and nothing is renamed: the cause is then more likely the config (a changed
        model) than the files. Every process takes the same decision.
        """
        return self._reader.restore_latest(abstract_state, offload_policy, split_masters, reshard)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
            self.log.close()


def _open_manager(
    workdir: str, directory: pathlib.Path, keep: int, async_save: bool, read_only: bool
) -> tuple[ocp.CheckpointManager, "_OrbaxLog"]:
    """Orbax's manager of `directory`, and the log its reports go to; a reader (`read_only`)
    deletes, cleans up and writes nothing in the run's directory."""
    # lightweight_initialize: list steps without reading each one's metadata file, which
    # orbax would log (not raise) about when damaged; restore() then reports it once.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,  # A reader deletes nothing.
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=async_save,
        lightweight_initialize=True,
        cleanup_tmp_directories=not read_only,  # Saves cut short by a crash.
    )
    # A reader writes nothing into the run's directory, its log neither.
    log_dir = pathlib.Path(tempfile.gettempdir()) if read_only else directory.parent
    log = _OrbaxLog(log_dir / ("orbax.log" if not read_only else f"orbax-{os.getpid()}.log"))
    try:
        return ocp.CheckpointManager(directory, options=options), log
    except OSError as e:
        log.close()
        raise ConfigError(
            f"--workdir {workdir}: cannot create {directory} ({e}); pass a writable "
            "directory as --workdir"
        ) from None


class _Writer:
    """A Checkpointer's saves: the free-space check before each, the save in flight, and the
    one line that stops the run when one fails (orbax's own report goes to the log)."""

    def __init__(self, directory: pathlib.Path, manager: ocp.CheckpointManager, log: "_OrbaxLog"):
        self.directory, self.manager, self.log = directory, manager, log
        self._in_flight = None  # The step of the last save started.

    def save(self, step: int, state, meta: dict) -> None:
        """`Checkpointer.save`, `meta` being what it records beside the state."""
        self.wait()  # The previous save is on disk (or failed) before the space is counted.
        self.check_space(state, step)
        self._in_flight = step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(meta)
                ),
            )
        except Exception as e:  # A synchronous save's write error.
            raise self._save_failed(step, e) from None

    def check_space(self, state, step: int | None = None) -> None:
        """`Checkpointer.check_space`."""
        need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        free = shutil.disk_usage(self.directory).free
        if _everywhere(free >= need * SPACE_MARGIN):
            return
        what = "the next checkpoint" if step is None else f"checkpoint {self.directory / str(step)}"
        raise SaveFailed(
            f"{what} needs {_size(need)} and the disk holding {self.directory} has "
            f"{_size(free)} free; free space there or train in a --workdir on a larger disk"
            + self._last_good()
        )

    def check(self) -> None:
        """`Checkpointer.check`."""
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise self._save_failed(None, e) from None

    def wait(self) -> None:
        """`Checkpointer.wait`."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(None, e) from None

    def _save_failed(self, step: int | None, error: Exception) -> SaveFailed:
        step = self._in_flight if step is None else step
        self.log.failed(f"saving step {step} failed", error)
        free = shutil.disk_usage(self.directory).free
        return SaveFailed(
            f"saving checkpoint {self.directory / str(step)} failed ({_write_error(error)}); "
            f"{_size(free)} free on its disk; free space there or train in a --workdir on a "
            f"larger disk (orbax's report: {self.log.path})" + self._last_good()
        )

    def _last_good(self) -> str:
        steps = [s for s in self.manager.all_steps() if (self.directory / str(s)).is_dir()]
        if not steps:
            return "; no checkpoint was saved before"
        return f"; the last good checkpoint, {self.directory / str(max(steps))}, is intact"


class _Reader:
    """A Checkpointer's restores: a step read into this run's layout, the newest readable step,
    and the one line naming a step that cannot be read (orbax's own report goes to the log)."""

    def __init__(self, directory: pathlib.Path, manager: ocp.CheckpointManager, log: "_OrbaxLog"):
        self.directory, self.manager, self.log = directory, manager, log

    def restore(self, step: int, abstract_state, offload_policy: str, split_masters: bool, reshard):
        """`Checkpointer.restore`."""
        try:
            meta = self.manager.restore(
                step, args=ocp.args.Composite(data=ocp.args.JsonRestore())
            ).data
        except Exception as e:
            raise self._unreadable(step, e) from None
        if reshard is not None:
            return self._restore_resharded(step, meta, abstract_state, reshard)
        _check_layout(self.directory / str(step), meta, offload_policy, split_masters)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # Orbax raises many types for damaged files.
            raise self._unreadable(step, e) from None
        return restored.state, int(restored.data["next_batch_index"])

    def _restore_resharded(self, step: int, meta: dict, abstract_state, reshard):
        """`restore` through `reshard`: as it is when the saved layout has this run's form,
        else read into host memory in its own form and converted."""
        saved = {
            "offload_policy": meta.get("offload_policy", "none"),
            "split_masters": meta.get("split_masters", False),
            # Checkpoints from before it was recorded: resumed under the same pipeline.
            "pipeline": meta.get("pipeline", reshard.layout["pipeline"]),
        }
        expected = reshard.saved_target(saved)
        try:
            stored = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
            stored = getattr(stored, "item_metadata", stored)
        except Exception as e:
            raise self._unreadable(step, e) from None
        if reason := _shape_difference(stored, expected):
            _refuse_changed_settings(
                self.directory / str(step), meta.get("settings", {}), reshard.settings
            )
            # The same settings (or none recorded): damaged metadata, or an older checkpoint's
            # other settings; unreadable, so that `restore_latest` may go back past it.
            raise self._unreadable(step, ValueError(reason))
        as_is = _same_form(saved, reshard.layout)
        target = abstract_state if as_is else jax.tree.map(_host_array, expected)
        try:
            state = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            ).state
        except Exception as e:  # Orbax raises many types for damaged files.
            raise self._unreadable(step, e) from None
        if not as_is:
            state = reshard.convert(state, saved)
        return state, int(meta["next_batch_index"])

    def restore_latest(
        self, abstract_state, offload_policy: str, split_masters: bool, reshard
    ) -> Restored | None:
        """`Checkpointer.restore_latest`."""
        failed = []  # (step, UnreadableCheckpoint), newest first.
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data_index = self.restore(
                    step, abstract_state, offload_policy, split_masters, reshard
                )
                error = None
            except UnreadableCheckpoint as e:
                error = e
            if not _everywhere(error is None):
                error = error or self._unreadable(step, RuntimeError("unreadable elsewhere"))
                failed.append((step, error))
                continue
            if failed:
                _set_aside(self.directory, [s for s, _ in failed])
                self.manager.reload()
            return Restored(step, state, data_index, [(s, e.reason) for s, e in failed])
        if len(failed) == 1:
            raise failed[0][1]
        if failed:
            raise UnreadableCheckpoint(
                f"none of the checkpoints in {self.directory} (steps "
                f"{', '.join(str(s) for s, _ in failed)}) can be read; the newest, "
                f"{self.directory / str(failed[0][0])}: {failed[0][1].reason}. If the model "
                "config changed since they were saved, resume with the config they were saved "
                "with; else pass a new --workdir"
            )
        return None

    def _unreadable(self, step: int, error: Exception) -> ConfigError:
        self.log.failed(f"reading step {step} failed", error)
        reason = one_line_reason(error)
        return UnreadableCheckpoint(
            f"checkpoint {self.directory / str(step)} is unreadable ({reason}); delete that "
            "directory to start over, or pass a new --workdir (also if the model config changed "
            "since it was saved)",
            reason,
        )


SPACE_MARGIN = 1.05  # Orbax's metadata, and room for the disk's own rounding.


def _check_layout(path: pathlib.Path, meta: dict, offload_policy: str, split_masters: bool) -> None:
    """One line naming the setting to resume with when the checkpoint at `path` holds its state
    in another layout than this run's (a ConfigError: restored without a `reshard`, its
    arrays would not fit this run's state)."""
    saved_policy = meta.get("offload_policy", "none")
    if saved_policy != offload_policy:
        raise ConfigError(
            f"checkpoint {path} holds state laid out for "
            f"config.offload.policy={saved_policy}, but this run plans {offload_policy}; "
            f"resume with --config.offload.policy={saved_policy} (and a budget it fits)"
        )
    saved_split = meta.get("split_masters", False)
    if saved_split != split_masters:
        held = {True: "split in halves", False: "whole"}
        raise ConfigError(
            f"checkpoint {path} holds the float32 masters "
            f"{held[saved_split]}, but this run keeps them {held[split_masters]}; resume "
            f"with --config.offload.split_masters={str(saved_split).lower()} (masters split "
            "only beside a bfloat16 compute copy on the device: config.model.dtype=bfloat16, "
            "no layer streaming)"
        )


def _shape_difference(stored, expected) -> str | None:
    """None when the checkpoint's arrays (`stored`, their metadata) have the shapes this run's
    model has in the saved layout (`expected`), else the first that differs, as a reason."""
    shapes = lambda tree, is_leaf=None: {
        k: tuple(v.shape)
        for k, v in ocp.tree.to_flat_dict(tree, is_leaf=is_leaf).items()
        if hasattr(v, "shape")
    }
    have = shapes(stored, lambda x: hasattr(x, "shape"))
    want = shapes(expected)
    if have == want:
        return None
    first = next(k for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
    return (
        f"its arrays are not this model's shapes: {'/'.join(first)} is "
        f"{have.get(first, 'absent')} there, {want.get(first, 'absent')} here"
    )


def _refuse_changed_settings(path: pathlib.Path, saved: dict, settings: dict) -> None:
    """One line naming the settings that changed since the checkpoint at `path` was saved with
    `saved`, when some did (a ConfigError: every checkpoint of the run would fail alike)."""
    changed = sorted(k for k in settings if k in saved and saved[k] != settings[k])
    if changed:
        was = ", ".join(f"config.{k}={_value(saved[k])}" for k in changed)
        now = ", ".join(f"{_value(settings[k])}" for k in changed)
        fix = " ".join(f"--config.{k}={_value(saved[k])}" for k in changed)
        raise ConfigError(
            f"checkpoint {path} holds a model of other shapes: it was saved with {was} (this "
            f"run: {now}); resume with {fix}, or pass a new --workdir to start over"
        )


def _set_aside(directory: pathlib.Path, steps: list[int]) -> None:
    """Renames the unreadable `steps` to `STEP.unreadable` (process 0 renames, every process
    waits for it), so that new saves can take their steps."""
    if jax.process_index() == 0:
        for step in steps:
            source = directory / str(step)
            target = directory / f"{step}.unreadable"
            n = 1
            while target.exists():
                n += 1
                target = directory / f"{step}.unreadable.{n}"
            source.rename(target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("angel_jax checkpoints set aside")


def _same_form(a: dict, b: dict) -> bool:
    """Whether two layouts' checkpointed states have one form (orbax reshards between them):
    offloaded or not, masters split or whole, the same pipeline stage layout."""
    form = lambda x: (x["offload_policy"] != "none", x["split_masters"], x["pipeline"])
    return form(a) == form(b)


def _host_array(x) -> np.ndarray:
    """A restore target that orbax reads into host memory, whole."""
    return np.empty(x.shape, x.dtype)


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _write_error(error: Exception) -> str:
    """The operating system's reason when tensorstore names one (its message puts it last,
    after the paths), else the error's first line."""
    code = re.search(r"os_error_code='?(\d+)", str(error))
    return os.strerror(int(code[1])) if code else one_line_reason(error)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _OrbaxLog:
    """Where orbax's reports of a failed read or write go while a Checkpointer is open: the
    failure is reported once, as one line naming this file, not as the hundreds of lines that
    orbax and tensorstore print (each array's error with its TensorStore spec, tracebacks of
    callbacks into orbax's closed event loop, its abandoned coroutines when collected). After
    a failure the hooks stay until the process exits: reads and writes still in flight fail
    later, some only at exit."""

    def __init__(self, path: pathlib.Path):
        self.path, self._file, self._failed = path, None, False
        self._filter = _ToFile(self)
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(self._filter)
        self._thread_hook, threading.excepthook = threading.excepthook, self._thread_exception
        self._unraisable_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable

    def write(self, text: str) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a")
            self._file.write(text.rstrip("\n") + "\n")
            self._file.flush()
        except Exception:  # At interpreter exit, or the disk full: the report is best effort.
            pass

    def failed(self, what: str, error: Exception) -> None:
        self._failed = True
        self.write(f"{what}:\n{''.join(traceback.format_exception(error))}")
        # Orbax's abandoned coroutines, collected at exit, would warn of each.
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)

    def _thread_exception(self, args) -> None:
        if _from_orbax(args.exc_value):
            self.write("".join(traceback.format_exception(args.exc_value)))
        else:
            self._thread_hook(args)

    def _unraisable(self, unraisable) -> None:
        exc = unraisable.exc_value
        if _from_orbax(exc) or (isinstance(exc, RuntimeError) and "loop is closed" in str(exc)):
            self.write("".join(traceback.format_exception(exc)))
        else:
            self._unraisable_hook(unraisable)

    def close(self) -> None:
        if self._failed:
            return
        for name in ("absl", "asyncio"):
            logging.getLogger(name).removeFilter(self._filter)
        if threading.excepthook == self._thread_exception:
            threading.excepthook = self._thread_hook
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._unraisable_hook
        if self._file is not None:
            self._file.close()


def _from_orbax(error: BaseException | None) -> bool:
    tb = error.__traceback__ if error is not None else None
    return any("/orbax/" in frame.filename for frame in traceback.extract_tb(tb))


class _ToFile(logging.Filter):
    """Orbax's warnings and errors, and asyncio's reports of its futures whose failure nobody
    retrieved, into the log's file instead of the console."""

    def __init__(self, log: _OrbaxLog):
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        orbax = "orbax" in record.pathname and record.levelno >= logging.WARNING
        if not orbax and "exception was never retrieved" not in str(record.msg):
            return True
        self.log.write(record.getMessage())
        return False


def one_line_reason(error: Exception, limit: int = 200) -> str:
    """What a library's error says, as one short line: its first line, without object reprs
    (pybind11 bound methods, `<... at 0x...>`), cut at a word boundary."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text, object_repr = lines[0] if lines else "", r"\s*<[^<>]*(?:pybind11|bound method| at 0x)"
    while re.search(object_repr + "[^<>]*>", text):  # Innermost first: reprs nest.
        text = re.sub(object_repr + "[^<>]*>", "", text)
    text = " ".join(text.split()) or type(error).__name__
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return text


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (one small all-gather when there are several)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))
