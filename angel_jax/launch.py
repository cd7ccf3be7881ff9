"""Trains a model from a config file.

    python -m angel_jax.launch --config configs/tiny.py --workdir /tmp/run [--config.KEY=VALUE ...]

Resumes from the latest complete checkpoint in --workdir when there is one. Under SLURM (srun),
Open MPI (mpirun) or with --coordinator/--num-processes/--process-id (or the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) each process runs this same command
and they train together as one multi-controller JAX program (angel_jax/cluster.py).
"""

import argparse
import sys

import jax

from angel_jax import cluster, monitor
from angel_jax.checkpoint import SaveFailed
from angel_jax.cli import Parser
from angel_jax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--config", required=True, help="a config file or a shipped config's name, e.g. tiny"
    )
    parser.add_argument("--workdir", required=True, help="metrics, TensorBoard logs, checkpoints")
    group = parser.add_argument_group("multi-process runs (default: from SLURM or Open MPI)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0, the same on every process")
    group.add_argument("--num-processes", type=int, help="processes in the run")
    group.add_argument("--process-id", type=int, help="this process, 0 .. num_processes-1")
    group.add_argument("--local-device-ids", help="this process's devices, e.g. 0,1 (default all)")
    group.add_argument(
        "--init-timeout-s", type=int, default=300, help="how long to wait for every process"
    )
    args, overrides = parser.parse_known_args(argv)
    jax.config.update("jax_threefry_partitionable", True)
    try:
        config = load_config(args.config, overrides)
        run = cluster.detect(
            args.coordinator, args.num_processes, args.process_id, args.local_device_ids
        )
        cluster.initialize(run, args.init_timeout_s)
        from angel_jax.loop import train_loop
        from angel_jax.metrics import say

        if run:
            say(cluster.describe(run))
        train_loop(config, args.workdir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except monitor.Diverged as e:
        print(f"error: diverged: {e}", file=sys.stderr)
        return monitor.EXIT_DIVERGED
    except monitor.Stopped as e:  # Saved and said so: nothing more to print.
        return e.exit_code
    except SaveFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return monitor.EXIT_SAVE_FAILED
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"error: {out_of_memory(e)}", file=sys.stderr)
        return monitor.EXIT_OUT_OF_MEMORY
    return 0


def out_of_memory(e: BaseException) -> str:
    """One line for an allocation that failed: XLA's first line, and what to change."""
    first = (str(e).strip().splitlines() or ["MemoryError"])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return (
        f"out of memory ({first}); use a smaller config.train.batch_size or more "
        "config.train.microbatches, more remat (config.model.remat=full), "
        "config.offload.policy=auto, or more devices"
    )


if __name__ == "__main__":
    sys.exit(main())
