"""Multi-controller training: several CPU processes on localhost (gloo collectives), each with
two emulated devices, train on one mesh that spans them, checkpoint and resume; the losses equal
a single process's on the same mesh shape."""

import os
import socket

import numpy as np
import portpicker
import pytest

from angel_jax import lock
from tests.runs import SMALL, env, jsonl, losses, run, start

# data=2 across the processes, tensor=2 inside each. A NaN batch makes every process roll back
# to the last checkpoint at the same step, the data moving on past it.
ARGS = [
    *SMALL,
    "--config.mesh.data=2",
    "--config.mesh.tensor=2",
    "--config.monitor.on_anomaly=rollback",
]
NAN_BATCH = "nan@5"


def launch_all(workdir, n: int, args, faults="") -> list[tuple[int, str]]:
    """Runs `n` launcher processes of one run; (exit status, stderr) of each."""
    port = portpicker.pick_unused_port()
    flags = [f"--coordinator=localhost:{port}", f"--num-processes={n}"]
    procs = [
        start(
            "angel_jax.launch",
            workdir,
            [*flags, f"--process-id={i}", *args],
            env(2, faults),
        )
        for i in range(n)
    ]
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        results.append((proc.returncode, err))
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one")
    result = run("angel_jax.launch", workdir, ARGS, env(4, NAN_BATCH))
    assert result.returncode == 0, result.stderr
    assert "rolled back to step 4" in result.stderr
    return workdir


def test_two_processes_roll_back_crash_resume_and_match_one(tmp_path, one_process):
    """Both processes roll back at the NaN batch, die by SIGKILL at step 7 and resume from their
    last checkpoint; every step's loss equals the single process's (4 devices)."""
    faults = f"{NAN_BATCH},crash@7"
    first = launch_all(tmp_path, 2, ARGS, faults)
    assert [code for code, _ in first] == [-9, -9], first[0][1][-3000:]
    assert "distributed: 2 processes (flags)" in first[0][1]
    second = launch_all(tmp_path, 2, ARGS, faults)
    assert [code for code, _ in second] == [0, 0], second[0][1][-2000:] + second[1][1][-2000:]
    assert "resumed from" in second[0][1]
    assert losses(tmp_path) == losses(one_process)
    # (The killed run rolls back again if its checkpoint of step 6 was not finished.)
    for workdir in (tmp_path, one_process):
        events = jsonl(workdir / "events.jsonl")
        assert {(e["kind"], e["step"]) for e in events} == {("nonfinite", 5), ("rollback", 5)}
        rollbacks = [e for e in events if e["kind"] == "rollback"]
        assert all(e["to_step"] == 4 and e["data_index"] == 5 for e in rollbacks)


def test_four_processes_match_one(tmp_path):
    """data=4 across four processes, tensor=2 inside each, against one process of 8 devices
    (to float rounding: the data all-reduce of four adds in another order)."""
    args = [*SMALL, "--config.train.steps=2", "--config.mesh.data=4", "--config.mesh.tensor=2"]
    single = run("angel_jax.launch", tmp_path / "one", args, env(8))
    assert single.returncode == 0, single.stderr
    results = launch_all(tmp_path / "four", 4, args)
    assert [code for code, _ in results] == [0] * 4, results[0][1][-2000:]
    assert [p.name for p in (tmp_path / "four" / "checkpoints").iterdir()] == ["2"]
    four, one = losses(tmp_path / "four"), losses(tmp_path / "one")
    assert sorted(four) == sorted(one) == [1, 2]
    np.testing.assert_allclose([four[s] for s in (1, 2)], [one[s] for s in (1, 2)], rtol=1e-6)


def test_a_held_workdir_stops_every_process_of_a_second_run(tmp_path):
    """Process 0 of a run finds the workdir held (here by this test, as another run would
    hold it) and every process of the run exits 2, process 0 naming the holder. Only process 0
    takes the lock, so a run's own processes never lock each other out (the runs above)."""
    args = [*SMALL, "--config.train.steps=2", "--config.mesh.data=2", "--config.mesh.tensor=2"]
    with lock.hold_workdir(str(tmp_path)):
        results = launch_all(tmp_path, 2, args)
    assert [code for code, _ in results] == [2, 2], results[0][1][-2000:] + results[1][1][-2000:]
    assert (
        f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()},"
        in (results[0][1])
    )
    assert "process 0 could not take it" in results[1][1]
    assert not (tmp_path / "checkpoints").exists()
