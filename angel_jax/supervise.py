"""Runs the launcher and restarts it after a crash or a hang, from the last complete checkpoint.

    python -m angel_jax.supervise [--max-restarts 10] [--restart-delay-s 10] \\
        --config configs/tiny.py --workdir /tmp/run [launcher flags and --config.KEY=VALUE ...]

Every argument other than the supervisor's own goes to `python -m angel_jax.launch`. The
launcher's whole command line may follow the supervisor's flags instead, run as given (from its
first word that is not a flag, or after `--`):

    python -m angel_jax.supervise --max-restarts 3 \\
        python -m angel_jax.launch --config configs/tiny.py --workdir /tmp/run

The child resumes from the newest readable checkpoint by itself, so a restart is just a new
launch. What ends the child decides what happens next:

- exit 0: training finished; the supervisor exits 0.
- exit 2 (bad config or input, or the workdir held by another run), 4 (diverged: anomalies
  beyond config.monitor's bounds), 5 (out of device or host memory) or 6 (a checkpoint could
  not be written: the disk full): a restart would fail the same way; the supervisor exits
  with that status.
- anything else (a signal such as SIGKILL or SIGSEGV, an exception, exit 3 from the hang
  watchdog): an incident. It is appended to `WORKDIR/incidents.jsonl` (time, attempt, how the
  child ended, its last stderr lines, the checkpoint before and after) and the child is
  started again, at most --max-restarts times.

Restarts reuse compiled programs: unless JAX_COMPILATION_CACHE_DIR is set, the supervisor points
it at WORKDIR/jax_cache. SIGTERM or SIGINT to the supervisor goes on to the child and ends the
supervision (no restart). Multi-host: run one supervisor per process (e.g. under `srun`); when
one process dies the others stop at their hang watchdog or JAX's heartbeat, and every
supervisor restarts its own, which meet again in `jax.distributed.initialize`.
"""

import argparse
import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

# As angel_jax.launch and angel_jax.monitor.
EXIT_CONFIG, EXIT_HANG, EXIT_DIVERGED, EXIT_OUT_OF_MEMORY, EXIT_SAVE_FAILED = 2, 3, 4, 5, 6
FINAL = {
    0: "finished",
    EXIT_CONFIG: "bad config or input",
    EXIT_DIVERGED: "diverged",
    EXIT_OUT_OF_MEMORY: "out of memory",
    EXIT_SAVE_FAILED: "a checkpoint could not be written",
    130: "stopped by SIGINT, its step saved",  # 128 + signal: angel_jax.monitor.Stopped.
    143: "stopped by SIGTERM, its step saved",
}
TAIL_LINES = 30
TERM_GRACE_S = 30.0  # Between SIGTERM and SIGKILL when the supervisor is stopped.


OWN_FLAGS = ("--max-restarts", "--restart-delay-s")


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the supervisor's arguments, a whole command to run): the command follows the
    supervisor's own flags, after `--` or from the first word that is not a flag; None when the
    arguments are the launcher's flags."""
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if argv[i] in ("-h", "--help") or (flag in OWN_FLAGS and "=" in argv[i]):
            i += 1
        elif flag in OWN_FLAGS:
            i += 2  # The flag and its value.
        else:
            break
    rest = argv[i + 1 :] if argv[i : i + 1] == ["--"] else argv[i:]
    if rest and not rest[0].startswith("-"):
        return argv[:i], rest
    return argv[:i] + rest, None


def latest_checkpoint(workdir: pathlib.Path) -> int | None:
    """The newest committed checkpoint step (orbax renames a finished save to its step)."""
    ckpts = workdir / "checkpoints"
    steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.is_dir() else []
    return max(steps, default=None)


def unfinished_saves(workdir: pathlib.Path) -> list[str]:
    """Checkpoint directories still being written (orbax's temporary names)."""
    ckpts = workdir / "checkpoints"
    return sorted(p.name for p in ckpts.iterdir() if "tmp" in p.name) if ckpts.is_dir() else []


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_HANG:
        return "hang (watchdog, exit 3)"
    return f"exit {code}"


class Supervisor:
    def __init__(
        self,
        launch_args: list[str],
        workdir: str,
        max_restarts: int,
        delay_s: float,
        command: list[str] | None = None,
    ):
        """`command`: what to run (default: the launcher with `launch_args`)."""
        self.command = command or [sys.executable, "-m", "angel_jax.launch", *launch_args]
        self.workdir = pathlib.Path(workdir)
        self.max_restarts = max_restarts
        self.delay_s = delay_s
        self.child: subprocess.Popen | None = None
        self.stopping = False

    def run(self) -> int:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.workdir.absolute() / "jax_cache"))
        restarts = 0
        while True:
            before = latest_checkpoint(self.workdir)
            started = time.time()
            code, tail = self._run_child(env)
            if self.stopping:
                self._note(f"stopped by a signal; the child ended with {describe_exit(code)}")
                return code if code > 0 else 1
            if code in FINAL:
                if code:
                    self._note(f"the child ended: {FINAL[code]} (exit {code}); not restarting")
                return code
            incident = dict(
                time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                attempt=restarts + 1,
                ended=describe_exit(code),
                exit_code=code,
                runtime_s=round(time.time() - started, 1),
                checkpoint_before=before,
                checkpoint_after=latest_checkpoint(self.workdir),  # Where the restart resumes.
                unfinished_saves=unfinished_saves(self.workdir),  # Cut short: never resumed from.
                restarting=restarts < self.max_restarts,
                stderr_tail=tail,
            )
            with open(self.workdir / "incidents.jsonl", "a") as f:
                f.write(json.dumps(incident) + "\n")
            if restarts >= self.max_restarts:
                self._note(
                    f"the child ended ({describe_exit(code)}); {restarts} restarts used of "
                    f"--max-restarts={self.max_restarts}, giving up"
                )
                return code if code > 0 else 1
            restarts += 1
            resume = incident["checkpoint_after"]
            self._note(
                f"the child ended ({describe_exit(code)}) after {incident['runtime_s']} s; "
                f"restart {restarts}/{self.max_restarts} in {self.delay_s:g} s, from "
                + (f"checkpoint {resume}" if resume is not None else "the start")
            )
            if self._sleep(self.delay_s):
                return 1

    def stop(self, signum, _frame) -> None:
        """SIGTERM/SIGINT: pass it on to the child, then SIGKILL it after a grace period (JAX's
        preemption handler keeps a multi-process child alive on SIGTERM)."""
        self.stopping = True
        child = self.child
        if child and child.poll() is None:
            child.send_signal(signum)
            timer = threading.Timer(TERM_GRACE_S, lambda: child.poll() is None and child.kill())
            timer.daemon = True
            timer.start()

    def _run_child(self, env) -> tuple[int, list[str]]:
        """Runs the launcher once; its stderr passes through and its last lines are kept."""
        self.child = subprocess.Popen(self.command, env=env, stderr=subprocess.PIPE, text=True)
        tail = collections.deque(maxlen=TAIL_LINES)
        for line in self.child.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))
        return self.child.wait(), list(tail)

    def _sleep(self, seconds: float) -> bool:
        """Waits, unless stopped meanwhile (then True)."""
        end = time.monotonic() + seconds
        while not self.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.2, left))
        return self.stopping

    @staticmethod
    def _note(text: str) -> None:
        print(f"supervise: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-restarts", type=int, default=10, help="restarts before giving up")
    parser.add_argument(
        "--restart-delay-s", type=float, default=10.0, help="pause before each restart"
    )
    own, command = split_command(sys.argv[1:] if argv is None else list(argv))
    args, launch_args = parser.parse_known_args(own)
    workdir = argparse.ArgumentParser(add_help=False)
    workdir.add_argument("--workdir")
    known, _ = workdir.parse_known_args(command or launch_args)
    if not known.workdir or args.max_restarts < 0 or args.restart_delay_s < 0:
        print(
            "error: supervise needs the launcher's --workdir (and --max-restarts, "
            "--restart-delay-s >= 0); usage: python -m angel_jax.supervise [--max-restarts N] "
            "[python -m angel_jax.launch] --config FILE --workdir DIR [...]",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    supervisor = Supervisor(
        launch_args, known.workdir, args.max_restarts, args.restart_delay_s, command
    )
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
