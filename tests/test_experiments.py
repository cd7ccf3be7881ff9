"""The benchmarks' shared child runner (experiments/throughput.py `run`)."""

import pathlib
import sys

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
