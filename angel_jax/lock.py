"""One run at a time in a workdir.

Two trainers on one workdir (a job submitted twice) would interleave their metrics and
overwrite each other's checkpoints without a word. Process 0 of a run holds an exclusive
`flock` on `WORKDIR/.lock` while it trains: the kernel drops the lock when the process ends,
however it ends, so a crashed run never leaves the workdir stuck; only process 0 takes it, so
the hosts of one multi-controller run do not lock each other out. The file names the holder
(host, pid, start) for the error a second run prints.
"""

import contextlib
import datetime
import fcntl
import os
import pathlib
import socket

import jax
import numpy as np

from angel_jax.config import ConfigError

LOCK_NAME = ".lock"


class WorkdirBusy(ConfigError):
    """Another run holds the workdir."""


@contextlib.contextmanager
def hold_workdir(workdir: str):
    """Holds `workdir` for this run (process 0 takes the lock, every process learns whether
    it did); raises WorkdirBusy naming the holder when another run has it."""
    path = pathlib.Path(workdir) / LOCK_NAME
    handle, why = None, ""
    if jax.process_index() == 0:
        try:
            handle = open(path, "a+")  # Not truncated: the holder's line stays until we own it.
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a run that has not yet named itself"
            handle.close()
            handle = None
            why = (
                f"--workdir {workdir} is in use by another run ({holder}); wait for it to end, "
                "stop it, or pass another --workdir"
            )
        except OSError as e:
            why = f"--workdir {workdir}: cannot write there ({e.strerror}); pass a writable one"
    if not _agreed(not why):  # Every process stops, not only process 0.
        raise WorkdirBusy(why or f"--workdir {workdir}: process 0 could not take it (its error)")
    if handle is not None:
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        handle.truncate(0)
        handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n")
        handle.flush()
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # Releases the lock; the file stays, naming the last holder.


def _agreed(ok: bool) -> bool:
    """Whether process 0 holds the lock, known to every process."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
