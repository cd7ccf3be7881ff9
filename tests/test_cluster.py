"""Multi-controller settings (flags, environment, SLURM, Open MPI) and the host-major mesh."""

import dataclasses

import jax
import numpy as np
import pytest

from angel_jax.cluster import Cluster, detect, first_host
from angel_jax.config import ConfigError, default_config
from angel_jax.data.loader import process_rows
from angel_jax.mesh import AXES, device_grid, make_mesh, mesh_shape, split_over_hosts
from angel_jax.sharding import axis_rules, logical_to_spec

SLURM = {  # Task 5 of a 2-node x 4-task job step.
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


def test_single_process_without_settings():
    assert detect(environ={}) is None
    assert detect(coordinator="h:1", environ={}) is None  # An address alone is not a run.
    assert detect(num_processes=1, process_id=0, environ={}) is None
    assert detect(num_processes=1, environ=SLURM) is None  # One process, whatever SLURM says.


def test_explicit_flags_and_env():
    assert detect("node1:1234", 4, 2, environ={}) == Cluster("node1:1234", 4, 2, None, "flags")
    env = {"JAX_COORDINATOR_ADDRESS": "n:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert detect(environ=env) == Cluster("n:9", 2, 1, None, "env")
    # Flags win over the environment.
    assert detect("m:8", None, 0, "0,1", environ=env) == Cluster("m:8", 2, 0, (0, 1), "flags")


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        (dict(num_processes=2), {}, "--num-processes is set but --process-id is not"),
        (dict(process_id=1), {}, "--process-id is set but --num-processes is not"),
        (dict(num_processes=2, process_id=2, coordinator="h:1"), {}, "--process-id=2: must be"),
        (dict(num_processes=0, process_id=0), {}, "--num-processes=0: must be at least 1"),
        (dict(num_processes=2, process_id=0), {}, "2 processes but no coordinator"),
        (dict(num_processes=2, process_id=0, coordinator="nohost"), {}, "--coordinator=nohost"),
        (dict(num_processes=2, process_id=0, coordinator="h:99999"), {}, "--coordinator=h:99999"),
        (dict(), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two': not a whole number"),
        (dict(num_processes=4), SLURM, "--num-processes=4 contradicts slurm, which gives 8"),
        (dict(process_id=3), SLURM, "--process-id=3 contradicts slurm, which gives 5"),
        (dict(local_device_ids="0,x"), SLURM, "--local-device-ids=0,x: expected"),
        (dict(), {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}, "not in a job step: start"),
        (dict(), {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "no coordinator"),
    ],
)
def test_inconsistent_settings_are_errors(kwargs, env, message):
    with pytest.raises(ConfigError) as e:
        detect(**kwargs, environ=env)
    assert message in str(e.value)


def test_slurm_step():
    run = detect(environ=SLURM)
    # Coordinator: the step's first node, on the port JAX would derive from the job id; four
    # tasks on this node each take the GPU of their local rank.
    assert run == Cluster(f"gpu007:{123456 % 4096 + 61440}", 8, 5, (1,), "slurm")
    one_task_per_node = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x8)"}
    assert detect(environ=one_task_per_node).local_device_ids is None  # All of the node's GPUs.
    bound = {**SLURM, "CUDA_VISIBLE_DEVICES": "1"}  # --gpus-per-task already narrowed them.
    assert detect(environ=bound).local_device_ids is None
    assert detect(coordinator="x:5", environ=SLURM).coordinator == "x:5"
    single = {**SLURM, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert detect(environ=single) is None


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    }
    port = 1531576320 // 4096 % 4096 + 61440
    assert detect(environ=env) == Cluster(f"10.96.0.1:{port}", 4, 3, (1,), "openmpi")


@pytest.mark.parametrize(
    "nodelist, host",
    [("node001", "node001"), ("a1,b2", "a1"), ("gpu[003-005,9],cpu1", "gpu003"), ("x[7]", "x7")],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


# --- the mesh over hosts -------------------------------------------------------------------


@pytest.mark.parametrize(
    "axes, per_host, inside, across",
    [
        (dict(data=2, tensor=8), 8, dict(tensor=8), dict(data=2)),
        (dict(data=8, tensor=2), 4, dict(data=2, tensor=2), dict(data=4)),
        (
            dict(data=2, expert=2, sequence=2, tensor=2),
            8,
            dict(expert=2, sequence=2, tensor=2),
            dict(data=2),
        ),
        (dict(data=2, tensor=16), 8, dict(tensor=8), dict(data=2, tensor=2)),  # tensor spans.
        (dict(data=3, tensor=4), 6, dict(data=3, tensor=2), dict(tensor=2)),
    ],
)
def test_split_over_hosts(axes, per_host, inside, across):
    sizes = {a: axes.get(a, 1) for a in AXES}
    got_inside, got_across = split_over_hosts(sizes, per_host)
    assert got_inside == {a: inside.get(a, 1) for a in AXES}
    assert got_across == {a: across.get(a, 1) for a in AXES}


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"


def test_device_grid_keeps_tensor_inside_hosts():
    # Two hosts of 8 GPUs listed host-interleaved, as a device list may come.
    devices = [FakeDevice(8 * p + i, p) for i in range(8) for p in range(2)]
    config = default_config().mesh
    config.update(data=-1, tensor=4)
    grid = device_grid(mesh_shape(config, 16), devices).reshape(4, 4)  # (data, tensor)
    hosts = np.vectorize(lambda d: d.process_index)(grid)
    np.testing.assert_array_equal(hosts, [[0] * 4, [0] * 4, [1] * 4, [1] * 4])
    assert len({d.id for d in grid.flat}) == 16


def test_device_grid_refuses_uneven_processes():
    devices = [FakeDevice(i, 0) for i in range(3)] + [FakeDevice(3, 1)]
    with pytest.raises(ConfigError, match="different device counts"):
        device_grid({a: 4 if a == "data" else 1 for a in AXES}, devices)


def test_process_rows_single_process():
    config = default_config()
    config.mesh.update(data=4, tensor=2)
    mesh = make_mesh(config.mesh)
    spec = logical_to_spec(("batch", None), axis_rules(config, mesh))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    assert process_rows(sharding, 8) == (0, 8)
