"""The benchmarks' shared child runner (experiments/throughput.py `run`)."""

import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import throughput  # noqa: E402


def test_a_child_past_run_timeout_is_recorded_and_the_caller_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("RUN_TIMEOUT_S", "1")
    code = "import sys, time; print('begun', file=sys.stderr, flush=True); time.sleep(30)"
    slow = [sys.executable, "-c", code]
    log = tmp_path / "child.log"
    result = throughput.run(slow, tmp_path, str(log))
    assert result["error"][0] == "timed out after 1 s (RUN_TIMEOUT_S)", result
    assert "begun" in log.read_text()
    quick = [sys.executable, "-c", "print('{\"tokens_per_s\": 1}')"]
    assert throughput.run(quick, tmp_path) == {"tokens_per_s": 1}


def test_a_childs_log_is_written_while_it_runs(tmp_path):
    """A runner killed from outside (a job's time limit) leaves what its child printed."""
    log = tmp_path / "child.log"
    code = "import sys, time; print('begun', file=sys.stderr, flush=True); time.sleep(3)"
    runner = threading.Thread(
        target=throughput.run, args=([sys.executable, "-c", code], tmp_path, str(log))
    )
    runner.start()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline and not (log.exists() and "begun" in log.read_text()):
        time.sleep(0.05)
    assert runner.is_alive() and "begun" in log.read_text()
    runner.join()
