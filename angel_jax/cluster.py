"""Multi-controller JAX: which processes make up the run, and `jax.distributed.initialize`.

One process per host (or per GPU) runs the same program; together they see every device. The
settings come from, in order of precedence: the launcher's flags (`--coordinator`,
`--num-processes`, `--process-id`, `--local-device-ids`), the environment
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, `JAX_LOCAL_DEVICE_IDS`), then
the scheduler: a SLURM job step (`srun`) or Open MPI (`mpirun`). With none of them, or a single
process, the run is single-controller and `jax.distributed.initialize` is never called.
"""

import dataclasses
import os
import re
from collections.abc import Mapping

import jax

from angel_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Cluster:
    coordinator: str  # host:port of process 0's coordination service.
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device this process sees.
    source: str  # What the settings came from, for the log: flags, env, slurm, openmpi.


def detect(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Cluster | None:
    """The run's processes from flags, environment and scheduler; None for a single process.

    Raises ConfigError for settings that contradict each other or the scheduler.
    """
    env = os.environ if environ is None else environ
    explicit = dict(
        coordinator=coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=_int(num_processes, env, "JAX_NUM_PROCESSES", "--num-processes"),
        process_id=_int(process_id, env, "JAX_PROCESS_ID", "--process-id"),
    )
    ids = local_device_ids if local_device_ids is not None else env.get("JAX_LOCAL_DEVICE_IDS")
    device_ids = _device_ids(ids) if ids else None
    if explicit["num_processes"] == 1 and explicit["process_id"] in (None, 0):
        return None  # One process, whatever the scheduler says.
    scheduler = _slurm(env) or _openmpi(env)
    if scheduler is None:
        if explicit["num_processes"] is None and explicit["process_id"] is None:
            return None  # A coordinator alone does not make a multi-process run.
        source = "flags" if num_processes is not None or process_id is not None else "env"
        for name, flag in (("num_processes", "--num-processes"), ("process_id", "--process-id")):
            if explicit[name] is None:
                other = "--process-id" if flag == "--num-processes" else "--num-processes"
                raise ConfigError(
                    f"{other} is set but {flag} is not; pass both (or neither, for one process)"
                )
        settings = dict(explicit)
    else:
        source = scheduler.pop("source")
        settings = dict(scheduler)
        for name, value in explicit.items():
            if value is None:
                continue
            if name != "coordinator" and value != settings[name]:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag}={value} contradicts {source}, which gives {settings[name]} "
                    f"({scheduler_var(source, name)}); drop {flag} or fix the job's task count"
                )
            settings[name] = value
        if device_ids is None:
            device_ids = settings.pop("local_device_ids", None)
    settings.pop("local_device_ids", None)
    n, rank = settings["num_processes"], settings["process_id"]
    if n < 1:
        raise ConfigError(f"--num-processes={n}: must be at least 1")
    if not 0 <= rank < n:
        raise ConfigError(
            f"--process-id={rank}: must be in [0, {n}) for --num-processes={n}; processes are "
            "numbered 0 .. num_processes-1"
        )
    if n == 1:
        return None
    address = settings["coordinator"]
    if not address:
        raise ConfigError(
            f"{n} processes but no coordinator: pass --coordinator HOST:PORT (process 0's host "
            "and a free port, the same on every process) or set JAX_COORDINATOR_ADDRESS"
        )
    _check_address(address)
    return Cluster(address, n, rank, device_ids, source)


def initialize(cluster: Cluster | None, timeout_s: int = 300) -> None:
    """Joins the run's processes (a no-op for one process). Call before JAX touches a device."""
    if cluster is None:
        return
    jax.distributed.initialize(
        cluster.coordinator,
        cluster.num_processes,
        cluster.process_id,
        local_device_ids=list(cluster.local_device_ids) if cluster.local_device_ids else None,
        # Everything is decided above; JAX's own detection would fill in SLURM_LOCALID as the
        # only local device (one GPU per process even with one task per node).
        cluster_detection_method="deactivate",
        initialization_timeout=timeout_s,
    )


def describe(cluster: Cluster) -> str:
    return (
        f"distributed: {cluster.num_processes} processes ({cluster.source}), coordinator "
        f"{cluster.coordinator}, {jax.local_device_count()} devices per process"
    )


# --- schedulers ----------------------------------------------------------------------------


def _slurm(env: Mapping[str, str]) -> dict | None:
    """A SLURM job step's processes; None outside SLURM. In the batch script itself (no
    `srun`) a job of several tasks is an error: each task must run the launcher."""
    if "SLURM_JOB_ID" not in env:
        return None
    if "SLURM_STEP_NODELIST" not in env or "SLURM_PROCID" not in env:
        tasks = int(env.get("SLURM_NTASKS", "1"))
        if tasks > 1:
            raise ConfigError(
                f"SLURM job {env['SLURM_JOB_ID']} has {tasks} tasks, but this process is not in "
                "a job step: start the launcher with srun (one task per GPU or per host), or "
                "pass --num-processes=1 to train in this one process"
            )
        return None
    n = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    port = int(env["SLURM_JOB_ID"]) % 4096 + 61440  # As JAX picks it: the same on every task.
    tasks_here = _tasks_on_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")),
        int(env.get("SLURM_NODEID", "0")),
    )
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    # Several tasks on a node each take the GPU of their local rank, unless SLURM already
    # narrowed what each task sees (--gpus-per-task, --gpu-bind).
    device_ids = None
    if tasks_here > 1 and len(visible) != 1:
        device_ids = (int(env["SLURM_LOCALID"]),)
    return dict(
        source="slurm",
        coordinator=f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
        num_processes=n,
        process_id=int(env["SLURM_PROCID"]),
        local_device_ids=device_ids,
    )


def _openmpi(env: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    coordinator = None
    uri = env.get("OMPI_MCA_orte_hnp_uri")  # Open MPI 4: "jobid.0;tcp://ip,ip:port".
    if uri:
        match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        if match:
            job = int(uri.split(".", 1)[0]) // 4096
            coordinator = f"{next(g for g in match.groups() if g)}:{job % 4096 + 61440}"
    n = int(env["OMPI_COMM_WORLD_SIZE"])
    per_node = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    device_ids = None
    if per_node > 1 and len(visible) != 1:
        device_ids = (int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),)
    return dict(
        source="openmpi",
        coordinator=coordinator,  # Open MPI 5 exports no address: --coordinator is needed.
        num_processes=n,
        process_id=int(env["OMPI_COMM_WORLD_RANK"]),
        local_device_ids=device_ids,
    )


def scheduler_var(source: str, name: str) -> str:
    return {
        ("slurm", "num_processes"): "SLURM_STEP_NUM_TASKS",
        ("slurm", "process_id"): "SLURM_PROCID",
        ("openmpi", "num_processes"): "OMPI_COMM_WORLD_SIZE",
        ("openmpi", "process_id"): "OMPI_COMM_WORLD_RANK",
    }[source, name]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    head = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist)
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0]


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node `node` from SLURM's '2(x3),1' format; 1 when unknown."""
    counts = []
    for part in filter(None, tasks_per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return 1
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else 1


# --- parsing -------------------------------------------------------------------------------


def _int(value, env: Mapping[str, str], var: str, flag: str) -> int | None:
    if value is not None:
        return value
    text = env.get(var)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{var}={text!r}: not a whole number (it sets {flag})") from None


def _device_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"--local-device-ids={text}: expected comma-separated device numbers, e.g. 0,1"
        ) from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"--local-device-ids={text}: give distinct device numbers >= 0")
    return ids


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--coordinator={address}: expected HOST:PORT with a port in 1..65535, e.g. "
            "node001:12355"
        )
