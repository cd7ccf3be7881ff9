"""Orbax checkpoints of the train state and the data position.

Saves are asynchronous and atomic (orbax writes `STEP.orbax-checkpoint-tmp` and renames it to
`STEP` on commit), so a process killed mid-save leaves the previous checkpoint as the latest
complete one; the leftover temporary directory is removed when the next run opens the
directory. `restore_latest` goes back past checkpoints that cannot be read.
"""

import dataclasses
import logging
import pathlib
import re
import sys
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


@dataclasses.dataclass
class Restored:
    step: int
    state: object
    data_index: int  # The next batch to read.
    unreadable: list  # (step, reason) of newer checkpoints that could not be read, set aside.


class Checkpointer:
    def __init__(self, workdir: str, every_steps: int, keep: int, async_save: bool = True):
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.every_steps = every_steps
        # lightweight_initialize: list steps without reading each one's metadata file, which
        # orbax would log (not raise) about when damaged; restore() then reports it once.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            lightweight_initialize=True,
            cleanup_tmp_directories=True,  # Saves cut short by a crash.
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise ConfigError(
                f"--workdir {workdir}: cannot create {self.directory} ({e}); pass a writable "
                "directory as --workdir"
            ) from None

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
    ) -> None:
        """`offload_policy` and `split_masters` name the state's layout: offloaded optimizer
        state is stored per layer (offload/stream.py), and split masters as their low halves
        beside the compute copy (offload/masters.py), so it restores only under the same."""
        meta = {
            "next_batch_index": data_index,
            "offload_policy": offload_policy,
            "split_masters": split_masters,
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(meta)
            ),
        )

    def restore(
        self, step: int, abstract_state, offload_policy: str = "none", split_masters: bool = False
    ):
        """(state, next batch index) saved at `step`, placed as `abstract_state` says."""
        previous_hook = sys.unraisablehook
        sys.unraisablehook = _drop_closed_loop_callbacks(previous_hook)
        _quiet_abandoned_futures()
        try:
            meta = self.manager.restore(
                step, args=ocp.args.Composite(data=ocp.args.JsonRestore())
            ).data
        except Exception as e:
            _quiet_abandoned_reads()
            raise self._unreadable(step, e) from None
        saved_policy = meta.get("offload_policy", "none")
        if saved_policy != offload_policy:
            sys.unraisablehook = previous_hook
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} holds state laid out for "
                f"config.offload.policy={saved_policy}, but this run plans {offload_policy}; "
                f"resume with --config.offload.policy={saved_policy} (and a budget it fits)"
            )
        saved_split = meta.get("split_masters", False)
        if saved_split != split_masters:
            sys.unraisablehook = previous_hook
            held = {True: "split in halves", False: "whole"}
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} holds the float32 masters "
                f"{held[saved_split]}, but this run keeps them {held[split_masters]}; resume "
                f"with --config.offload.split_masters={str(saved_split).lower()} (masters split "
                "only beside a bfloat16 compute copy on the device: config.model.dtype=bfloat16, "
                "no layer streaming)"
            )
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # Orbax raises many types for damaged files.
            # The filters stay: reads still in flight fail after this, until the process exits.
            _quiet_abandoned_reads()
            raise self._unreadable(step, e) from None
        sys.unraisablehook = previous_hook
        return restored.state, int(restored.data["next_batch_index"])

    def restore_latest(
        self, abstract_state, offload_policy: str = "none", split_masters: bool = False
    ) -> Restored | None:
        """The newest checkpoint that can be read, or None when there is none.

        A checkpoint that cannot be read (damaged files) is passed over for the one before it;
        once an older one restores, the unreadable newer ones are renamed `STEP.unreadable` so
        that new saves can take their steps. When none can be read, the newest's error is
        raised and nothing is renamed: the cause is then more likely the config (a changed
        model) than the files. Every process takes the same decision.
        """
        failed = []  # (step, UnreadableCheckpoint), newest first.
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data_index = self.restore(
                    step, abstract_state, offload_policy, split_masters
                )
                error = None
            except UnreadableCheckpoint as e:
                error = e
            if not _everywhere(error is None):
                error = error or self._unreadable(step, RuntimeError("unreadable elsewhere"))
                failed.append((step, error))
                continue
            if failed:
                self._set_aside([s for s, _ in failed])
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

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            for step in steps:
                source = self.directory / str(step)
                target = self.directory / f"{step}.unreadable"
                n = 1
                while target.exists():
                    n += 1
                    target = self.directory / f"{step}.unreadable.{n}"
                source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("angel_jax checkpoints set aside")
        self.manager.reload()

    def _unreadable(self, step: int, error: Exception) -> ConfigError:
        reason = one_line_reason(error)
        return UnreadableCheckpoint(
            f"checkpoint {self.directory / str(step)} is unreadable ({reason}); delete that "
            "directory to start over, or pass a new --workdir (also if the model config changed "
            "since it was saved)",
            reason,
        )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


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


class _AbandonedFutures(logging.Filter):
    """Drops asyncio's reports of futures whose exception nobody retrieved: a damaged file
    fails orbax's reads in flight, each reported when collected, which can come before the
    failure reaches the checkpointer (seen on a loaded CPU) or long after; the failure itself
    is reported once, as one line. Only that report: asyncio's other errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


def _quiet_abandoned_futures() -> None:
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedFutures) for f in log.filters):
        log.addFilter(_AbandonedFutures())


def _quiet_abandoned_reads() -> None:
    """After a failed read, orbax abandons its other reads' coroutines unawaited; Python warns
    of each when it collects them (often at exit), after the one-line error."""
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)


def _drop_closed_loop_callbacks(previous_hook):
    """An unraisable-exception hook that drops tensorstore callbacks into a closed event loop.

    When one read of a damaged checkpoint fails, orbax closes its event loop while other reads
    are still in flight; each of those later prints a "RuntimeError: Event loop is closed"
    traceback. The failure itself is reported as one line, so those are noise.
    """

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous_hook(unraisable)

    return hook
