"""Orbax checkpoints of the train state and the data position.

Saves are asynchronous and atomic (orbax writes a temporary directory and renames it on
commit), so a process killed mid-save leaves the previous checkpoint as the latest complete one.
"""

import pathlib

import orbax.checkpoint as ocp

from angel_jax.config import ConfigError


class Checkpointer:
    def __init__(self, workdir: str, every_steps: int, keep: int, async_save: bool = True):
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self.every_steps = every_steps
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int, last_step: int) -> bool:
        return self.every_steps > 0 and (step % self.every_steps == 0 or step == last_step)

    def save(self, step: int, state, data_index: int) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"next_batch_index": data_index}),
            ),
        )

    def restore(self, step: int, abstract_state):
        """(state, next batch index) saved at `step`, placed as `abstract_state` says."""
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # Orbax raises many types for damaged files.
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} is unreadable ({reason}); delete that "
                "directory to resume from the one before, or pass a new --workdir"
            ) from None
        return restored.state, int(restored.data["next_batch_index"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
