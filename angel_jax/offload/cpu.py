"""The hybrid update of ZeRO-Cache: update chunks whose master and optimizer state live in plain
host memory and are updated by the host's cores, while the device updates the others.

The device's update moves a chunk's master and state to the device and back (12 bytes a
parameter each way for AdamW); the host's moves only the grad down and the new compute copy up
(2 bytes each in bf16), and runs the same optimizer code jitted for JAX's CPU backend (the same
math, one fused loop per chunk). XLA:CPU runs one program on one core, so a pool of threads
updates several chunks at once: AdamW's rate doubles from one thread to 4 and stops there,
where the memory bus saturates (experiments/host_update_rate.py).

On llama_1b the hybrid update was slower than the device's alone at every share tried
(24-37%), by a quarter to a half of a step. The
host's path is not what limits it (the device's chunks finish last), but the device's path
slows down beside it: both stream through the host's memory (the copies at about 2 x 38
GB/s, the update at about 30 bytes a parameter) and the device's Python-driven loop shares the
interpreter with the pool. So `config.offload.cpu_update` is 0 unless set.
"""

import collections
import concurrent.futures as futures
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.offload.masters import compute_copy
from angel_jax.offload.stream import layer_index
from angel_jax.optim import Optimizer
from angel_jax.planning.tiers import HOST

THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))  # Past 4 the memory bus is the limit.


def _done() -> futures.Future:
    f = futures.Future()
    f.set_result(None)
    return f


class CPUTier:
    """The chunks the plan gave the host's cores (`stream.Chunk`s of tier CPU), their masters
    and states as arrays of JAX's CPU backend. Outside the state tree, like the SSD tier, with
    what `state.Outside` needs of a tier (`chunks`, `by_key`, `put`, `read_all`, `wait`);
    `update` runs a step's updates."""

    def __init__(self, optimizer: Optimizer, chunks: list, dtype):
        self.optimizer, self.chunks, self.dtype = optimizer, chunks, dtype
        self.by_key = {(jax.tree_util.keystr(c.path), c.layer): c for c in chunks}
        self.cpu = jax.devices("cpu")[0]
        self.values = {}  # Chunk key -> (master, state) on the CPU backend.
        self._pool = futures.ThreadPoolExecutor(THREADS, thread_name_prefix="cpu-update")
        self._fns = {}
        # Thread-seconds spent, summed over the pool: where the host's share of a step goes.
        self.seconds = collections.Counter()
        self._lock = threading.Lock()

    def put(self, chunk, master, state) -> tuple[futures.Future, futures.Future]:
        self.values[chunk.key] = jax.device_put((master, state), self.cpu)
        return _done(), _done()

    def read_all(self) -> list:
        """Every chunk's (master, state) as numpy arrays, in order: copies, since the next
        update writes into its inputs' buffers (donated: fresh output buffers cost a page
        fault a page, and ran several times slower in a first try on a 2-core CPU)."""
        return [jax.tree.map(np.array, self.values[c.key]) for c in self.chunks]

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def update(self, grads: list, scale, compute: list) -> list[tuple[object, futures.Future]]:
        """Starts every chunk's update with its grad times `scale` on the pool; returns, per
        chunk in order, (chunk, future of its new compute-dtype weight in pinned host memory,
        laid out as its slice of `compute`, the compute copy's flat leaves). `grads` are flat
        over the params' leaves, stacked for stacked weights (or tuples of layers); each
        chunk's grad is cut out on its device and its copy down queued here, in this thread's
        dispatch order: the runtime starts a copy after the device work queued before it, so
        copies queued before the next step run beside it."""
        scale = jax.device_put(scale, self.cpu)
        pending = []
        for c in self.chunks:
            grad, up = grads[c.weight], compute[c.weight].sharding.with_memory_kind(HOST)
            if isinstance(grad, tuple):
                grad = grad[c.layer]
            elif c.layer is not None:
                grad = _layer(grad, c.layer)
            if c.layer is not None:
                up = NamedSharding(up.mesh, P(*up.spec[1:]), memory_kind=HOST)
            grad = jax.device_put(grad, grad.sharding.with_memory_kind(HOST))  # The device's DMA.
            pending.append((c, self._pool.submit(self._update, c, grad, scale, up)))
        return pending

    def _update(self, c, grad, scale, up):
        """Copies go through pinned host memory and numpy: a device_put between the GPU and
        the CPU backend ran at 1.1 GB/s a thread (4.4 the other way), through pinned memory at
        25."""
        start = time.perf_counter()
        grad = jax.device_put(np.asarray(grad), self.cpu)  # Waits for its copy down.
        copied = time.perf_counter()
        master, state = self.values[c.key]
        master, state, new = self._fn(c)(grad, scale, master, state)
        self.values[c.key] = (master, state)
        new = jax.block_until_ready(new)  # The thread's core runs it: block here, not later.
        updated = time.perf_counter()
        new = jax.block_until_ready(jax.device_put(np.asarray(new), up))
        with self._lock:
            self.seconds["grad copy"] += copied - start
            self.seconds["update"] += updated - copied
            self.seconds["weight copy"] += time.perf_counter() - updated
        return new

    def _fn(self, c):
        if c.weight not in self._fns:

            def update(grad, scale, master, state):
                master, state = self.optimizer.update_leaf(
                    c.path, grad.astype(jnp.float32) * scale, state, master
                )
                return master, state, compute_copy(master, master.dtype, self.dtype)[1]

            self._fns[c.weight] = jax.jit(update, donate_argnums=(2, 3))
        return self._fns[c.weight]


def measure_rates(optimizer: Optimizer, path, dtype, seconds: float = 0.25) -> dict:
    """What the hybrid share is picked from (`planner.hybrid_share`), measured here and now:
    the host's update rate (parameters/s: the optimizer's own update of `path`'s kind on JAX's
    CPU backend, donated as the tier's is, on the pool's THREADS threads at once) and copies
    between pinned host memory and this process's first device (bytes/s each way, down and
    back at once), each alone and then both together (they share the host's memory bus and the
    interpreter: the device's update slowed beside the host's, see above)."""
    cpu, device = jax.devices("cpu")[0], jax.local_devices()[0]
    shape = (1024, 4096)  # 4M parameters a thread: one chunk's worth of work, under a second.

    def update(grad, master, state):
        master, state = optimizer.update_leaf(path, grad, state, master)
        return master, state, master.astype(dtype)

    update = jax.jit(update, donate_argnums=(1, 2))
    own = []  # Each thread's grad, master and state.
    for _ in range(THREADS):
        master = jax.device_put(np.zeros(shape, np.float32), cpu)
        grad = jax.device_put(np.full(shape, 1e-3, np.float32), cpu)
        own.append([grad, master, jax.device_put(optimizer.init_leaf(path, master), cpu)])
    own[0][1:] = jax.block_until_ready(update(*own[0]))[:2]  # Compiled.
    host_memory = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST)
    host = jax.device_put(np.zeros(2**24, np.float32), host_memory)
    on_device = jax.sharding.SingleDeviceSharding(device)
    there = jax.device_put(host, on_device)
    # Down and back at once, as the update's chunks in flight move: copied one after the
    # other they measured about half the rate the update moves each way.
    round_trip = lambda: jax.block_until_ready(
        (jax.device_put(host, on_device), jax.device_put(there, host_memory))
    )

    def updates(mine, deadline):
        done = 0
        while time.perf_counter() < deadline:
            mine[1:] = jax.block_until_ready(update(*mine))[:2]
            done += mine[1].size
        return done

    def copies(deadline):
        done = 0
        while time.perf_counter() < deadline:
            round_trip()
            done += host.nbytes
        return done

    def run(host_side: bool, copy_side: bool) -> tuple[float, float]:
        start = time.perf_counter()
        deadline = start + seconds
        with futures.ThreadPoolExecutor(THREADS + 1) as pool:
            ups = [pool.submit(updates, mine, deadline) for mine in (own if host_side else [])]
            moved = pool.submit(copies, deadline) if copy_side else _done()
            total = sum(f.result() for f in ups)
            nbytes = moved.result() or 0
        wall = time.perf_counter() - start
        return total / wall, nbytes / wall

    run(False, True)  # The pinned pool's first copies crawl: warmed, not measured.
    host_rate, _ = run(True, False)
    _, copy_rate = run(False, True)
    host_both, copy_both = run(True, True)
    return dict(
        host_params_per_s=host_rate,
        copy_bytes_per_s=copy_rate,
        host_params_per_s_both=host_both,
        copy_bytes_per_s_both=copy_both,
    )


@jax.jit
def _layer_of(grad, layer):
    return jax.lax.dynamic_index_in_dim(grad, layer, keepdims=False)


def _layer(grad, layer: int):
    """Layer `layer` of a stacked grad, cut on its devices."""
    return _layer_of(grad, layer_index(grad.sharding.mesh, layer))
