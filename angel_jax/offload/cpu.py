"""The hybrid update of ZeRO-Cache: update chunks whose master and optimizer state live in plain
host memory and are updated by the host's cores, while the device updates the others.

The device's update moves a chunk's master and state to the device and back (12 bytes a
parameter each way for AdamW); the host's moves only the grad down and the new compute copy up
(2 bytes each in bf16), and runs the same optimizer code jitted for JAX's CPU backend (the same
math, one fused loop per chunk). XLA:CPU runs one program on one core, so a pool of threads
updates several chunks at once: on the H200 machine's 16 cores, AdamW reached 0.69G parameters/s
on one thread and 1.4-1.5G on 4 to 14, where the memory bus saturates
(`experiments/results/host_update_rate.json`).
"""

import concurrent.futures as futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.optim import Optimizer

THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))  # Past 4 the memory bus is the limit.


def _done(value=None) -> futures.Future:
    f = futures.Future()
    f.set_result(value)
    return f


class CPUTier:
    """The chunks the plan gave the host's cores (`stream.Chunk`s of tier CPU), their masters
    and states as arrays of JAX's CPU backend. Outside the state tree, like the SSD tier, with
    the same interface (`put`, `read`, `read_all`, `wait`); `update` runs a step's updates."""

    def __init__(self, optimizer: Optimizer, chunks: list, dtype):
        self.optimizer, self.chunks, self.dtype = optimizer, chunks, dtype
        self.by_key = {(jax.tree_util.keystr(c.path), c.layer): c for c in chunks}
        self.cpu = jax.devices("cpu")[0]
        self._values = {}  # Chunk key -> (master, state) on the CPU backend.
        self._pool = futures.ThreadPoolExecutor(THREADS, thread_name_prefix="cpu-update")
        self._fns = {}

    def put(self, chunk, master, state) -> tuple[futures.Future, futures.Future]:
        self._values[chunk.key] = jax.device_put((master, state), self.cpu)
        return _done(), _done()

    def read(self, chunk) -> tuple[futures.Future, futures.Future]:
        master, state = self._values[chunk.key]
        return _done(master), _done(state)

    def read_all(self) -> list:
        """Every chunk's (master, state) as numpy arrays, in order: copies, since the next
        update writes into its inputs' buffers (donated: fresh buffers would cost a page fault
        a page, and ran at a fifth of the speed on the CPU)."""
        return [jax.tree.map(np.array, self._values[c.key]) for c in self.chunks]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self._values))

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def update(self, grads: list, scale) -> list[tuple[object, futures.Future]]:
        """Starts every chunk's update with its grad times `scale` on the pool; returns, per
        chunk in order, (chunk, future of its new compute-dtype weight on the host's CPU
        device). `grads` are flat over the params' leaves, stacked for stacked weights (or
        tuples of layers); each chunk's grad is cut out on its device before it is copied."""
        scale = jax.device_put(scale, self.cpu)
        pending = []
        for c in self.chunks:
            grad = grads[c.weight]
            if isinstance(grad, tuple):
                grad = grad[c.layer]
            elif c.layer is not None:
                grad = _layer(grad, c.layer)
            pending.append((c, self._pool.submit(self._update, c, grad, scale)))
        return pending

    def _update(self, c, grad, scale):
        if grad.sharding.memory_kind != "device":  # Layer streaming's, in pinned host memory:
            grad = jax.device_get(grad)  # no direct copy from there to another backend.
        grad = jax.device_put(grad, self.cpu)
        master, state = self._values[c.key]
        master, state, new = self._fn(c)(grad, scale, master, state)
        self._values[c.key] = (master, state)
        return jax.block_until_ready(new)  # The thread's core runs it: block here, not later.

    def _fn(self, c):
        if c.weight not in self._fns:

            def update(grad, scale, master, state):
                master, state = self.optimizer.update_leaf(
                    c.path, grad.astype(jnp.float32) * scale, state, master
                )
                return master, state, master.astype(self.dtype)

            self._fns[c.weight] = jax.jit(update, donate_argnums=(2, 3))
        return self._fns[c.weight]


@jax.jit
def _layer_of(grad, layer):
    return jax.lax.dynamic_index_in_dim(grad, layer, keepdims=False)


def _layer(grad, layer: int):
    """Layer `layer` of a stacked grad, cut on its devices."""
    index = jax.device_put(np.int32(layer), NamedSharding(grad.sharding.mesh, P()))
    return _layer_of(grad, index)


def measured_rates(optimizer: Optimizer) -> tuple[float, float]:
    """(parameters per second the host's cores update with `optimizer` on the pool's threads,
    bytes per second of host<->device copies each way with both directions at once): the
    hybrid update's share comes from these. Each is timed after a warm-up pass (XLA compiles;
    the pinned-host pool grows, and its first copies crawl)."""
    cpu, n, count = jax.devices("cpu")[0], 2**22, 2 * THREADS
    path = (jax.tree_util.DictKey("kernel"),)

    def update(grad, master, state):
        return optimizer.update_leaf(path, grad.astype(jnp.float32), state, master)

    fn = jax.jit(update, donate_argnums=(1, 2))
    chunks = []
    for _ in range(count):
        master = jax.device_put(np.ones(n, np.float32), cpu)
        grad = jax.device_put(np.full(n, 1e-3, np.float32), cpu).astype(jnp.bfloat16)
        chunks.append([grad, master, jax.jit(lambda m: optimizer.init_leaf(path, m))(master)])

    def run(c):
        c[1], c[2] = jax.block_until_ready(fn(*c))

    with futures.ThreadPoolExecutor(THREADS) as pool:
        cpu_rate = n * count / _best_time(lambda: list(pool.map(run, chunks)))
    device = jax.local_devices()[0]
    on_device = NamedSharding(jax.sharding.Mesh([device], "x"), P())
    on_host = on_device.with_memory_kind("pinned_host")
    pieces = [jnp.ones(2**24, jnp.float32, device=on_device) for _ in range(4)]
    host = jax.device_put(pieces, on_host)

    def both_ways():
        jax.block_until_ready((jax.device_put(host, on_device), jax.device_put(pieces, on_host)))

    copy_rate = 4 * 2**24 * 4 / _best_time(both_ways)
    return cpu_rate, copy_rate


def _best_time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
