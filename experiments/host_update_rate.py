"""How fast the host's cores run the optimizer update (ZeRO-Cache's hybrid update), per way of
running it, beside the copies the device's update needs.

    python experiments/host_update_rate.py [--params 268435456] [--out FILE]
    python experiments/host_update_rate.py --transfers [--threads 1,8] [--out FILE]

Each way runs in its own process (the CPU device count and dispatch mode are set at start):
  xla, K threads          jitted AdamW on the CPU backend, one CPU device, K Python threads
  xla, K threads, sync    the same with CPU async dispatch off (each call runs on its thread)
  xla, K CPU devices      K CPU devices (jax_num_cpu_devices), chunk i on device i mod K
  numpy, K threads        in-place AdamW in numpy over K slices of each chunk
Rates are parameters per second (an AdamW step reads grad, master, m and v and writes the
last three and a 16-bit copy: about 30 bytes per parameter). The device's streamed update
moves 12 bytes per parameter each way instead (`offload_throughput.py`'s copy rates).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from throughput import ROOT, write_results

CHUNK = 2**24  # Parameters per chunk: about a llama_1b layer's MLP weight.


def child(way: str, threads: int, params: int) -> dict:
    import concurrent.futures as cf

    import jax
    import numpy as np

    if way == "numpy":
        return _numpy(threads, params)
    jax.config.update("jax_cpu_enable_async_dispatch", way != "xla sync")
    if way == "xla devices":
        jax.config.update("jax_num_cpu_devices", threads)
    import jax.numpy as jnp
    import optax

    tx = optax.adamw(1e-4, weight_decay=0.1)

    def update(g, p, s):
        u, s = tx.update(g.astype(jnp.float32), s, p)
        p = optax.apply_updates(p, u)
        return p, s, p.astype(jnp.bfloat16)

    fn = jax.jit(update, donate_argnums=(1, 2))
    cpus = jax.devices("cpu")
    chunks = []
    for i in range(params // CHUNK):
        d = cpus[i % len(cpus)]
        p = jax.device_put(np.ones(CHUNK, np.float32), d)
        g = jax.device_put(np.full(CHUNK, 1e-3, np.float32), d).astype(jnp.bfloat16)
        chunks.append([g, p, jax.jit(tx.init)(p)])

    def run(c):
        p, s, _ = jax.block_until_ready(fn(*c))
        c[1], c[2] = p, s

    pool = cf.ThreadPoolExecutor(threads)
    list(pool.map(run, chunks))  # Compile, touch every page.
    start = time.perf_counter()
    for _ in range(3):
        list(pool.map(run, chunks))
    seconds = (time.perf_counter() - start) / 3
    return dict(params_per_s=len(chunks) * CHUNK / seconds, cpu_devices=len(cpus))


def _numpy(threads: int, params: int) -> dict:
    import concurrent.futures as cf

    import numpy as np

    n = params // threads
    parts = [
        [np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)]
        for _ in range(threads)
    ]
    g = np.full(n, 1e-3, np.float32)

    def adamw(part):
        p, m, v = part
        t = np.empty_like(p)
        m *= 0.9
        np.multiply(g, 0.1, out=t)
        m += t
        v *= 0.999
        np.multiply(g, g, out=t)
        t *= 0.001
        v += t
        np.sqrt(v, out=t)
        t += 1e-8
        np.divide(m, t, out=t)
        t += 0.1 * p
        t *= 1e-4
        p -= t

    pool = cf.ThreadPoolExecutor(threads)
    list(pool.map(adamw, parts))
    start = time.perf_counter()
    for _ in range(3):
        list(pool.map(adamw, parts))
    seconds = (time.perf_counter() - start) / 3
    return dict(params_per_s=params / seconds)


def transfers(threads: int) -> dict:
    """GB/s of a step's worth of grads (32 x 12M bf16) from the GPU to JAX's CPU backend and
    of new weights back, by `threads` Python threads, per way of copying: what the hybrid
    update's host share moves (a rate that falls as threads are added means the copies are
    serialised, e.g. by the GIL)."""
    import concurrent.futures as cf

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    pinned = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    n, count = 12 * 2**20, 32
    on_gpu = [jnp.full(n, i, jnp.bfloat16, device=gpu) for i in range(count)]
    on_cpu = [
        jax.device_put(np.ones(n, np.float32), cpu).astype(jnp.bfloat16) for _ in range(count)
    ]
    ways = {
        "gpu -> cpu backend (device_put)": (on_gpu, lambda x: jax.device_put(x, cpu)),
        "gpu -> numpy (device_get)": (on_gpu, lambda x: jax.device_get(x)),
        "gpu -> pinned host -> numpy": (
            on_gpu,
            lambda x: np.asarray(jax.block_until_ready(jax.device_put(x, pinned))),
        ),
        "cpu backend -> gpu (device_put)": (on_cpu, lambda x: jax.device_put(x, gpu)),
    }
    out = {}
    with cf.ThreadPoolExecutor(threads) as pool:
        for name, (arrays, fn) in ways.items():
            run = lambda fn=fn, arrays=arrays: list(
                pool.map(lambda x: jax.block_until_ready(fn(x)), arrays)
            )
            run()
            start = time.perf_counter()
            run()
            out[name] = count * n * 2 / 1e9 / (time.perf_counter() - start)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=int, default=2**28)
    p.add_argument("--threads", default="1,4,8,12")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/host_update_rate.json"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--transfers", action="store_true", help="the copies' rates instead")
    a = p.parse_args()
    if a.transfers:  # On the GPU machine.
        results = []
        for k in map(int, a.threads.split(",")):
            results.append(dict(threads=k, gbps=transfers(k)))
            for name, rate in results[-1]["gbps"].items():
                print(f"{k:>3} threads  {name:<34} {rate:6.1f} GB/s", flush=True)
        write_results(a.out, results)
        return 0
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.params)))
        return 0
    results = []
    for way in ("xla", "xla sync", "xla devices", "numpy"):
        for k in map(int, a.threads.split(",")):
            cmd = [sys.executable, __file__, "--params", str(a.params), "--child", way, str(k)]
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            if out.returncode:
                record = dict(way=way, threads=k, error=out.stderr.strip().splitlines()[-1:])
            else:
                record = dict(way=way, threads=k, **json.loads(out.stdout.splitlines()[-1]))
            results.append(record)
            rate = record.get("params_per_s")
            print(
                f"{way:<12} {k:>3} threads  "
                + (f"{rate / 1e9:6.2f} Gparam/s" if rate else f"failed: {record['error']}"),
                flush=True,
            )
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
