"""Dropless MoE's row gathers at moe_1b's shape (16,384 tokens x 6 experts of d 2048, bf16):
how XLA:GPU runs them written several ways (parallel/expert.py takes the fastest).

    python experiments/row_gathers.py [--out FILE]

Sorted rows: each assignment's token row (M = N * K rows from N), as bf16, or bitcast to 32-
or 64-bit words (the same bytes); summed rows: each token's K rows summed in float32, as one
gather-and-reduce, as K gathers added, or reduced over a minor axis. Bandwidth counts the
bytes read and written once; a plain (M, D) elementwise pass is the reference.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from throughput import ROOT, timed, write_results

sys.path.insert(0, str(ROOT))
from angel_jax.parallel.expert import sorted_rows, summed_rows  # noqa: E402

N, K, D = 16384, 6, 2048
M = N * K


def as_words(x, idx, word):
    words = jax.lax.bitcast_convert_type(x.reshape(N, -1, word.itemsize // 2), word)
    rows = words.at[idx].get(mode="promise_in_bounds")
    return jax.lax.bitcast_convert_type(rows, x.dtype).reshape(M, D)


def gathered(d, position):
    return d.at[position].get(unique_indices=True, mode="promise_in_bounds")


SORTED = {
    "sorted rows, bf16": lambda x, idx: x.at[idx].get(mode="promise_in_bounds"),
    # The trainer's gathers: token order // K of each sorted row (`idx * K` gives idx).
    "sorted rows, 32-bit words (the trainer's)": lambda x, idx: sorted_rows(x, idx * K, None),
    "sorted rows, 64-bit words": lambda x, idx: as_words(x, idx, jnp.dtype(jnp.uint64)),
    "sorted rows, jnp.take": lambda x, idx: jnp.take(x, idx, axis=0, mode="clip"),
}
SUMMED = {
    "summed rows, one reduce (the trainer's)": lambda d, p: summed_rows(d, None, p, N),
    "summed rows, K gathers added": lambda d, p: sum(
        gathered(d, p.reshape(N, K)[:, j]).astype(jnp.float32) for j in range(K)
    ),
    "summed rows, minor-axis reduce": lambda d, p: jnp.sum(
        gathered(d, p).reshape(N, K, D).astype(jnp.float32).transpose(0, 2, 1), axis=-1
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/row_gathers.json"))
    a = p.parse_args()
    jax.config.update("jax_enable_x64", True)  # For the 64-bit words.
    key = jax.random.key(0)
    x = jax.random.normal(key, (N, D), jnp.bfloat16)
    d = jax.random.normal(key, (M, D), jnp.bfloat16)
    order = jax.random.permutation(key, M).astype(jnp.int32)  # Sorted row -> assignment.
    position = jnp.zeros_like(order).at[order].set(jnp.arange(M, dtype=jnp.int32))
    moved = (M * D + N * D) * 2  # Bytes of the M rows and the N rows, once each.
    cases = [(name, fn, (x, order // K)) for name, fn in SORTED.items()]
    cases += [(name, fn, (d, position)) for name, fn in SUMMED.items()]
    cases += [("(M, D) elementwise pass (reference)", lambda d: d * 2, (d,))]
    results, first = [], {}
    for name, fn, args in cases:
        jitted = jax.jit(fn)
        out = np.asarray(jitted(*args), np.float32)
        kind = name.split(",")[0]
        equal = bool(np.array_equal(out, first.setdefault(kind, out)))
        seconds = timed(jitted, *args, reps=20)
        nbytes = 2 * M * D * 2 if name.startswith("(M, D)") else moved
        results.append(dict(system=name, ms=seconds * 1e3, tb_per_s=nbytes / seconds / 1e12))
        results[-1]["equal_to_first"] = equal
        print(f"{name:40s} {seconds * 1e3:7.3f} ms {nbytes / seconds / 1e12:5.2f} TB/s {equal}")
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
