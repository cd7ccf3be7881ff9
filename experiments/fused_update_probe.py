"""Probe for the ZeRO-Cache update inside the step's program (the ZeRO-Cache issue's item 1):
can XLA overlap each layer's optimizer update (its fp32 master and AdamW moments fetched from
pinned host memory, updated, sent back) with the layers' compute, in a scan over layers and
with the layers unrolled?

    python experiments/fused_update_probe.py [--layers 8 --d 4096 --ffn 14336 --tokens 8192] \
        [--trace] [--out FILE]

Programs over the same MLP layers (a stand-in for a decoder's), scanned (stacked weights):
  compute  forward/backward with the weights already on the device;
  update   the streamed update alone: each layer's state fetched, updated and sent back;
  fused    each layer's state fetched and updated with the previous step's grads, its new bf16
           weights used at once, the new state sent back, then the backward pass; and the same
           with each layer's state fetched one iteration ahead (carried);
and unrolled (a list of layers): compute and update alike, fused, and the update beside the
backward pass (the forward/backward, then each layer's update with its grads, one program:
what config.offload.update_in_step does without clipping).
If the copies overlap the compute, a program takes about max(compute, update); if not, their
sum. `--trace` (GPU) profiles one call of each: its copies' time beside compute kernels, and a
time line beside --out.
Measured on an H200: scanned (fused_update_probe.json, 8 layers), fused 493 ms against
80 + 417, 520 ms with XLA_FLAGS=--xla_gpu_enable_pipelined_host_offloading=true, the prefetched
form slower still (536 / 563 ms), no copy-start in any compiled program (XLA:GPU runs the
in-scan host copies synchronously); unrolled (fused_update_probe_unrolled.json, 2026-12-04),
96 copy-start pairs, fused 415 ms and the update beside the backward pass 425 ms against
66 + 429: the compute ran beside the copies, which ran one at a time at 55 GB/s.
Each fused program's grads, new masters and moments are checked against its parts run one
after the other, and its asynchronous copies and host-memory arrays are counted.
"""

import argparse
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from profile_step import summarize, timeline
from throughput import ROOT, timed, write_results

Space = jax.memory.Space
B1, B2, EPS, LR = 0.9, 0.95, 1e-8, 1e-4


def adamw(master, mu, nu, grad, count):
    """One AdamW step (no weight decay) of float32 state with a compute-dtype grad."""
    g = grad.astype(jnp.float32)
    mu = B1 * mu + (1 - B1) * g
    nu = B2 * nu + (1 - B2) * g * g
    step = LR * (mu / (1 - B1**count)) / (jnp.sqrt(nu / (1 - B2**count)) + EPS)
    return master - step, mu, nu


def layer(h, w1, w2):
    return h + jax.nn.gelu(h @ w1) @ w2


def loss_of(stack, h):
    """Sum of squares after the layers (weights (L, ...) on the device, in the compute dtype)."""
    h, _ = jax.lax.scan(lambda h, w: (layer(h, *w), None), h, stack)
    return jnp.sum(h.astype(jnp.float32) ** 2)


def compute(weights, h):
    return jax.value_and_grad(loss_of)(weights, h)


def update(state, grads, count):
    """The streamed update alone: per layer, fetch, update, send back; new bf16 weights too."""

    def body(_, xs):
        *host, grad = xs
        master, mu, nu = (jax.device_put(x, Space.Device) for x in host)
        new = adamw(master, mu, nu, grad, count)
        return None, (*(jax.device_put(x, Space.Host) for x in new), new[0].astype(grad.dtype))

    # w1's and w2's (master, mu, nu, grad), each scanned over layers.
    outs = [jax.lax.scan(body, None, part)[1] for part in zip(*state, grads, strict=True)]
    new_state = tuple(tuple(o[i] for o in outs) for i in range(3))
    return new_state, tuple(o[3] for o in outs)


def fused(state, grads, count, h):
    """Each layer: fetch its state, update it, use its new weights, send the state back; the
    loss's grads are taken with respect to a zero added to the new weights."""

    def forward(deltas, h):
        def body(h, xs):
            (m1, u1, n1, g1), (m2, u2, n2, g2), (d1, d2) = xs
            new1 = adamw(*(jax.device_put(x, Space.Device) for x in (m1, u1, n1)), g1, count)
            new2 = adamw(*(jax.device_put(x, Space.Device) for x in (m2, u2, n2)), g2, count)
            w1 = jax.lax.stop_gradient(new1[0].astype(g1.dtype)) + d1
            w2 = jax.lax.stop_gradient(new2[0].astype(g2.dtype)) + d2
            back = tuple(jax.device_put(x, Space.Host) for x in (*new1, *new2))
            return layer(h, w1, w2), back

        xs = (
            (state[0][0], state[1][0], state[2][0], grads[0]),
            (state[0][1], state[1][1], state[2][1], grads[1]),
            deltas,
        )
        h, back = jax.lax.scan(body, h, xs)
        return jnp.sum(h.astype(jnp.float32) ** 2), back

    deltas = tuple(jnp.zeros(g.shape, g.dtype) for g in grads)
    (loss, back), dw = jax.value_and_grad(forward, has_aux=True)(deltas, h)
    new_state = ((back[0], back[3]), (back[1], back[4]), (back[2], back[5]))
    return loss, dw, new_state


def fused_prefetch(state, grads, count, h):
    """As `fused`, with layer i + 1's state fetched in iteration i and carried, so its copy
    depends on nothing the iteration computes (a whole layer's compute to hide behind)."""
    last = grads[0].shape[0] - 1
    parts = [tuple(state[s][w] for s in range(3)) for w in range(2)]  # w1's, w2's.

    def fetch(i):
        take = lambda x: jax.device_put(jax.lax.dynamic_index_in_dim(x, i, 0, False), Space.Device)
        return tuple(tuple(take(x) for x in part) for part in parts)

    def forward(deltas, h):
        def body(carry, xs):
            h, fetched, i = carry
            (g1, g2), (d1, d2) = xs
            ahead = fetch(jnp.minimum(i + 1, last))
            new1, new2 = adamw(*fetched[0], g1, count), adamw(*fetched[1], g2, count)
            w1 = jax.lax.stop_gradient(new1[0].astype(g1.dtype)) + d1
            w2 = jax.lax.stop_gradient(new2[0].astype(g2.dtype)) + d2
            back = tuple(jax.device_put(x, Space.Host) for x in (*new1, *new2))
            return (layer(h, w1, w2), ahead, i + 1), back

        (h, _, _), back = jax.lax.scan(body, (h, fetch(0), 0), (grads, deltas))
        return jnp.sum(h.astype(jnp.float32) ** 2), back

    deltas = tuple(jnp.zeros(g.shape, g.dtype) for g in grads)
    (loss, back), dw = jax.value_and_grad(forward, has_aux=True)(deltas, h)
    new_state = ((back[0], back[3]), (back[1], back[4]), (back[2], back[5]))
    return loss, dw, new_state


def loss_unrolled(weights, h):
    """`loss_of` with the layers as straight-line code (a list of (w1, w2)), no scan."""
    for w1, w2 in weights:
        h = layer(h, w1, w2)
    return jnp.sum(h.astype(jnp.float32) ** 2)


def compute_unrolled(weights, h):
    return jax.value_and_grad(loss_unrolled)(weights, h)


def update_layer(state, grads, count):
    """One layer's update: its (w1, w2) state fetched from host memory, updated with `grads`;
    the new state for host memory and the new compute-dtype weights."""
    new = [
        adamw(*(jax.device_put(x, Space.Device) for x in part), g, count)
        for part, g in zip(state, grads, strict=True)
    ]
    back = tuple(tuple(jax.device_put(x, Space.Host) for x in n) for n in new)
    return back, tuple(n[0].astype(g.dtype) for n, g in zip(new, grads, strict=True))


def update_unrolled(state, grads, count):
    """`update` over per-layer arrays (a list of ((m1, u1, n1), (m2, u2, n2)) in host memory)."""
    outs = [update_layer(s, g, count) for s, g in zip(state, grads, strict=True)]
    return [o[0] for o in outs], [o[1] for o in outs]


def fused_unrolled(state, grads, count, h):
    """`fused` with the layers unrolled: XLA's scheduler may start layer i + 1's fetch while
    layer i computes, which it does not do inside a scan's body."""

    def forward(deltas, h):
        back = []
        for s, g, d in zip(state, grads, deltas, strict=True):
            new_state, weights = update_layer(s, g, count)
            back.append(new_state)
            w1, w2 = (jax.lax.stop_gradient(w) + dw for w, dw in zip(weights, d, strict=True))
            h = layer(h, w1, w2)
        return jnp.sum(h.astype(jnp.float32) ** 2), back

    deltas = [tuple(jnp.zeros(x.shape, x.dtype) for x in g) for g in grads]
    (loss, back), dw = jax.value_and_grad(forward, has_aux=True)(deltas, h)
    return loss, dw, back


def backward_update_unrolled(state, weights, count, h):
    """The issue's item 1 without clipping: the forward/backward, and each layer's update
    from its grads in the same program, so the update of a layer the backward pass has left
    can run beside the backward pass of the layers before it."""
    loss, dw = compute_unrolled(weights, h)
    new_state, new_weights = update_unrolled(state, dw, count)
    return loss, dw, new_state, new_weights


def unstacked(state, grads):
    """Per-layer arrays of stacked ones: state in host memory, grads on the device."""
    on_host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    on_device = SingleDeviceSharding(jax.devices()[0])
    layers = grads[0].shape[0]
    # Each stacked array visits the device once, sliced there.
    sliced = [[list(jax.device_put(x, on_device)) for x in part] for part in state]
    per_layer_state = [
        tuple(tuple(jax.device_put(sliced[s][w][i], on_host) for s in range(3)) for w in range(2))
        for i in range(layers)
    ]
    return per_layer_state, [tuple(g[i] for g in grads) for i in range(layers)]


def inputs(layers: int, a):
    """(state in pinned host memory, bf16 grads, input rows) of `layers` stacked MLP layers."""
    on_host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = ((layers, a.d, a.ffn), (layers, a.ffn, a.d))
    masters = tuple(
        jax.random.normal(k, s, jnp.float32) * 0.02 for k, s in zip(keys, shapes, strict=False)
    )
    state = tuple(
        tuple(jax.device_put(x, on_host) for x in part)
        for part in (
            masters,
            tuple(jnp.zeros_like(m) for m in masters),
            tuple(jnp.full_like(m, 1e-6) for m in masters),
        )
    )
    grads = tuple((m * 0.1).astype(jnp.bfloat16) for m in masters)
    return state, grads, jax.random.normal(keys[3], (a.tokens, a.d), jnp.bfloat16)


def assert_agree(got, want) -> None:
    """Same tree of values: the loss (a sum over bf16 products; another fusion order, XLA's
    pipelined host offloading, moved it by 1.02e-5 on the H200) and the arrays."""
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-4)
    for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=1e-6
        )


def traced(program, args, hlo: str, timeline_file: pathlib.Path) -> dict:
    """One call of `program` under the profiler: its copies' milliseconds and the share of them
    that ran beside compute kernels (`profile_step.summarize`); the trace's time line is
    written to `timeline_file`."""
    trace_dir = tempfile.mkdtemp(prefix="fused_update_probe_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(program(*args))
    with gzip.open(next(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))) as f:
        trace = json.load(f)
    timeline_file.write_text("\n".join(timeline(trace)) + "\n")
    s = summarize(trace, 1, hlo, top=0)
    keys = ("span_ms_per_step", "busy_ms_per_step", "copy_ms_per_step")
    return {**{k: s[k] for k in keys}, "copy_overlapped_fraction": s["copy_overlapped_fraction"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/fused_update_probe.json"))
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace one call of each program (GPU): its copies beside compute, and a time line "
        "beside --out (.<program>.timeline.txt)",
    )
    a = p.parse_args()
    compute_jit, update_jit = jax.jit(compute), jax.jit(update)
    unrolled_compute_jit, unrolled_update_jit = jax.jit(compute_unrolled), jax.jit(update_unrolled)
    fused_jit, prefetch_jit = jax.jit(fused), jax.jit(fused_prefetch)
    fused_unrolled_jit = jax.jit(fused_unrolled)
    backward_update_jit = jax.jit(backward_update_unrolled)

    # Equal math, checked on two layers (the full stack's three states and their numpy copies
    # outgrow the host): the update, then the forward/backward with its weights; and the
    # forward/backward, then the update with its grads.
    state, grads, h = inputs(2, a)
    count = jnp.float32(2.0)
    ref_state, ref_weights = update_jit(state, grads, count)
    ref_loss, ref_dw = compute_jit(ref_weights, h)
    for program in (fused_jit, prefetch_jit):
        assert_agree(program(state, grads, count, h), (ref_loss, ref_dw, ref_state))
    layer_state, layer_grads = unstacked(state, grads)
    # Against programs of the same unrolled layers: the scanned ones sum their bf16 products
    # in another order (15% of the first layer's grads differed by over 2% on the H200).
    ref_state, layer_weights = unrolled_update_jit(layer_state, layer_grads, count)
    assert_agree(
        fused_unrolled_jit(layer_state, layer_grads, count, h),
        (*unrolled_compute_jit(layer_weights, h), ref_state),
    )
    loss, dw = unrolled_compute_jit(layer_weights, h)
    assert_agree(
        backward_update_jit(layer_state, layer_weights, count, h),
        (loss, dw, *unrolled_update_jit(layer_state, dw, count)),
    )
    del state, grads, ref_state, ref_dw, layer_state, layer_grads

    state, grads, h = inputs(a.layers, a)
    _, ref_weights = update_jit(state, grads, count)
    layer_state, layer_grads = unstacked(state, grads)
    layer_weights = [tuple(w[i] for w in ref_weights) for i in range(a.layers)]
    _, layer_dw = unrolled_compute_jit(layer_weights, h)
    scanned = dict(
        compute_s=timed(compute_jit, ref_weights, h, reps=a.reps),
        update_s=timed(update_jit, state, grads, count, reps=a.reps),
    )
    unrolled = dict(
        compute_s=timed(unrolled_compute_jit, layer_weights, h, reps=a.reps),
        update_s=timed(unrolled_update_jit, layer_state, layer_dw, count, reps=a.reps),
    )
    runs = (
        ("fused", scanned, fused_jit, (state, grads, count, h)),
        ("fused, next layer prefetched", scanned, prefetch_jit, (state, grads, count, h)),
        (
            "fused, unrolled layers",
            unrolled,
            fused_unrolled_jit,
            (layer_state, layer_grads, count, h),
        ),
        (
            "update beside the backward pass, unrolled layers",
            unrolled,
            backward_update_jit,
            (layer_state, layer_weights, count, h),
        ),
    )
    results = []
    for name, base, program, args in runs:
        hlo = program.lower(*args).compile().as_text()
        seconds = timed(program, *args, reps=a.reps)
        shorter = min(base.values())
        if a.trace:
            slug = re.sub(r"\W+", "_", name)
            profile = traced(
                program, args, hlo, pathlib.Path(a.out).with_suffix(f".{slug}.timeline.txt")
            )
        results.append(
            dict(
                **base,
                fused_s=seconds,
                hidden_share_of_the_shorter=(sum(base.values()) - seconds) / shorter,
                **({"profile": profile} if a.trace else {}),
                # Asynchronous copies (copy-start) and arrays in host memory (S(5)) compiled.
                hlo_counts={"copy-start": hlo.count(" copy-start("), "S(5)": hlo.count("S(5)")},
                shape=dict(layers=a.layers, d=a.d, ffn=a.ffn, tokens=a.tokens),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                system=name,
            )
        )
        print(json.dumps(results[-1]), flush=True)
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
