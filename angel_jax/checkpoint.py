"""Orbax checkpoints of the train state and the data position.

Saves are asynchronous and atomic (orbax writes a temporary directory and renames it on
commit), so a process killed mid-save leaves the previous checkpoint as the latest complete one.
"""

import pathlib
import sys

import orbax.checkpoint as ocp

from angel_jax.config import ConfigError


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

    def save(self, step: int, state, data_index: int, offload_policy: str = "none") -> None:
        """`offload_policy` names the state's layout: offloaded optimizer state is stored per
        layer (offload/stream.py), so it restores only under the same policy."""
        meta = {"next_batch_index": data_index, "offload_policy": offload_policy}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, step: int, abstract_state, offload_policy: str = "none"):
        """(state, next batch index) saved at `step`, placed as `abstract_state` says."""
        previous_hook = sys.unraisablehook
        sys.unraisablehook = _drop_closed_loop_callbacks(previous_hook)
        try:
            meta = self.manager.restore(
                step, args=ocp.args.Composite(data=ocp.args.JsonRestore())
            ).data
        except Exception as e:
            raise self._unreadable(step, e) from None
        saved_policy = meta.get("offload_policy", "none")
        if saved_policy != offload_policy:
            sys.unraisablehook = previous_hook
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} holds state laid out for "
                f"config.offload.policy={saved_policy}, but this run plans {offload_policy}; "
                f"resume with --config.offload.policy={saved_policy} (and a budget it fits)"
            )
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # Orbax raises many types for damaged files.
            # The filter stays: reads still in flight fail after this, until the process exits.
            raise self._unreadable(step, e) from None
        sys.unraisablehook = previous_hook
        return restored.state, int(restored.data["next_batch_index"])

    def _unreadable(self, step: int, error: Exception) -> ConfigError:
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return ConfigError(
            f"checkpoint {self.directory / str(step)} is unreadable ({reason}); delete that "
            "directory to resume from the one before, or pass a new --workdir (also if the "
            "model config changed since it was saved)"
        )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


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
