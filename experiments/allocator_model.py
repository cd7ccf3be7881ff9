"""A model of XLA's GPU device pool (BFC, best fit) fed the allocations of the delayed update
between microbatches, step after step: does a microbatch's temporaries' block stay whole?

    python experiments/allocator_model.py [--steps 40] [--pool-gib 132.81] [--temps-gib 37.51]

It plans `llama3_8b` at 16 x 8192 tokens in 16 microbatches on one H200 (the plan the GPU run
made, on the CPU: the compiled step's temporaries are given, `--compiled-under-gib`), then
replays in host order what the device allocates and frees (PJRT allocates a program's
temporaries as it queues it and frees them at once, `StreamedUpdate.stages` fetches each group
before the microbatch it runs beside, and so on) in one preallocated region. Best fit, as XLA's
BFC allocator: the smallest free chunk that fits, the lowest address among equals, split when
the rest is at least 128 MiB or half, freed neighbours merged, nothing ever moved. Two ways of
making the new compute copy: `new buffers` (the code before 2026-12-05: each weight's made
at its first group, the old copy freed after the step) and `in place` (its parts wait beside
the copy the microbatches read and are written into it after the last one). Left out: the
spatial partitioning of XLA's pool (on by default in jaxlib 0.11.2), scalars, the update
programs' own temporaries and what initialisation leaves; a model, not a measurement.
"""

import argparse
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2**30


class BestFit:
    """One region; each allocation takes the smallest free chunk that fits."""

    def __init__(self, size: int):
        self.free, self.used, self.at = {0: size}, {}, {}

    def alloc(self, name: str, nbytes: int) -> None:
        nbytes = max(256, -(-nbytes // 256) * 256)
        fits = [(size, a) for a, size in self.free.items() if size >= nbytes]
        if not fits:
            holes = sorted(self.free.values(), reverse=True)
            raise MemoryError(
                f"{name}: {nbytes / GiB:.2f} GiB with {self.in_use() / GiB:.2f} in use and "
                f"{sum(holes) / GiB:.2f} free in {len(holes)} holes, the largest "
                f"{', '.join(f'{h / GiB:.2f}' for h in holes[:3])}"
            )
        size, a = min(fits)
        del self.free[a]
        if size - nbytes >= 128 * 2**20 or size >= 2 * nbytes:
            self.free[a + nbytes], size = size - nbytes, nbytes
        self.used[a], self.at[name] = size, a

    def release(self, name: str) -> None:
        a = self.at.pop(name)
        size = self.used.pop(a)
        if a + size in self.free:
            size += self.free.pop(a + size)
        before = next((p for p, n in self.free.items() if p + n == a), None)
        if before is None:
            self.free[a] = size
        else:
            self.free[before] += size

    def in_use(self) -> int:
        return sum(self.used.values())

    def largest_free(self) -> int:
        return max(self.free.values(), default=0)


# The GPU run this models (offload_throughput.py's variant), with the budgets and remat it had.
VARIANT = "llama3_8b auto, 16 x 8192 in 16 microbatches, delayed, device update"
ON_THE_H200 = [
    "--config.offload.device_gib=132.81",
    "--config.offload.host_gib=95",
    "--config.model.remat=dots_attention",  # What remat auto took there.
]


def plan_8b(compiled_under: float):
    """The variant's config and build, the compiled step's temporaries `compiled_under` GiB
    under the estimate, as on the GPU."""
    sys.path.insert(0, str(ROOT))
    from offload_throughput import VARIANTS

    from angel_jax import train
    from angel_jax.config import load_config
    from angel_jax.mesh import make_mesh

    _, name, overrides, _ = next(v for v in VARIANTS if v[0] == VARIANT)
    c = load_config(str(ROOT / f"configs/{name}.py"), [*overrides, *ON_THE_H200])
    extra = {(True, c.model.remat): -int(compiled_under * GiB)}
    return c, train.build(c, make_mesh(c.mesh), fit_compiled=False, extra_activations=extra)


class Replay:
    """The device allocations of the update between microbatches, in host order, in a
    `BestFit` pool: `run` steps of it."""

    def __init__(self, c, exp, pool: int, in_place: bool):
        import jax

        from angel_jax.planning.plan import local_bytes

        update = exp.streamed_update
        self.compute = [local_bytes(x) for x in jax.tree.leaves(exp.abstract_state.compute_params)]
        self.grads = [2 * n for n in self.compute]  # float32 sums of bf16 weights.
        self.chunks, self.groups = update.chunks, update.groups
        self.layers = collections.Counter(ch.weight for ch in self.chunks)
        # Per chunk, the bytes of the leaves it moves (its master and state, unless resident).
        self.moved = [
            [
                local_bytes([ch.master, *jax.tree.leaves(ch.state)][i])
                for i in update.moves.moving(k)
            ]
            for k, ch in enumerate(self.chunks)
        ]
        self.microbatches = c.train.microbatches
        self.between = min(update.between_groups, c.train.microbatches - 1)
        self.last = {self.chunks[k].weight: g for g, ks in enumerate(self.groups) for k in ks}
        self.in_place, self.m = in_place, BestFit(pool)
        for w, n in enumerate(self.compute):
            self.m.alloc(f"compute 0 {w}", n)
        self.copy = 0  # The step whose new compute copy the microbatches read.

    def fetch(self, g: int) -> None:
        for k in self.groups[g]:
            for i, n in enumerate(self.moved[k]):
                self.m.alloc(f"{self.step} group {g} {k} {i}", n)
        self.fetched.add(g)

    def home(self, g: int) -> None:
        for k in self.groups[g]:
            for i in range(len(self.moved[k])):
                self.m.release(f"{self.step} group {g} {k} {i}")

    def make_room(self) -> None:
        while len(self.leaving) >= 2:
            self.home(self.leaving.pop(0))

    def run_group(self, g: int) -> None:
        chunks, m = self.chunks, self.m
        for k in self.groups[g]:
            w = chunks[k].weight
            if self.in_place:
                m.alloc(f"part {self.step} {k}", self.compute[w] // self.layers[w])
            elif w not in self.made:
                m.alloc(f"compute {self.step} {w}", self.compute[w])
                self.made.add(w)
        for w in self.done:  # The last group's grads, held until now.
            m.release(f"sums {self.step - 1} {w}")
        self.done = {chunks[k].weight for k in self.groups[g] if self.last[chunks[k].weight] == g}
        self.leaving.append(g)
        # The first group after the slots waits for the last microbatch.
        if g + 1 < len(self.groups) and (g + 1 < self.between or g >= self.between):
            self.make_room()
            self.fetch(g + 1)

    def run(self, steps: int, temps: int) -> dict:
        """Where a microbatch's temporaries find no block: that step and microbatch."""
        m, least = self.m, []
        for step in range(1, steps + 1):
            self.step, self.fetched, self.leaving, self.made, self.done = (
                step,
                set(),
                [],
                set(),
                set(),
            )
            waiting = step > 1  # The first step's grads wait for the second.
            if waiting:
                self.fetch(0)
            for w, n in enumerate(self.grads):
                m.alloc(f"sums {step} {w}", n)
            for j in range(self.microbatches):
                least.append(m.largest_free())
                try:
                    m.alloc("temporaries", temps)
                except MemoryError as e:
                    return dict(ran_steps=step - 1, failed=f"step {step}, microbatch {j}: {e}")
                m.release("temporaries")
                if waiting and j < self.between:
                    self.run_group(j)
            if waiting:
                self.finish()
        return dict(ran_steps=steps, least_largest_free_gib=round(min(least) / GiB, 2))

    def finish(self) -> None:
        """The groups after the last microbatch, and the step's end."""
        m = self.m
        for g in range(self.between, len(self.groups)):
            if g not in self.fetched:
                self.make_room()
                self.fetch(g)
            self.run_group(g)
        for g in self.leaving:
            self.home(g)
        for name in [n for n in m.at if n.startswith(f"sums {self.step - 1} ")]:
            m.release(name)  # The last groups' grads, and any weight no group updates.
        if self.in_place:  # Written into the copy; the parts go.
            for k in range(len(self.chunks)):
                m.release(f"part {self.step} {k}")
        else:  # The old copy goes.
            for w in range(len(self.compute)):
                m.release(f"compute {self.copy} {w}")
            self.copy = self.step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pool-gib", type=float, default=132.81)  # BFC's at 0.95 on the H200.
    p.add_argument("--temps-gib", type=float, default=37.51)  # The failed allocation's.
    p.add_argument("--compiled-under-gib", type=float, default=10.5)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/allocator_model_8b.json"))
    args = p.parse_args()
    from throughput import write_results

    c, exp = plan_8b(args.compiled_under_gib)
    print(exp.plan.table())
    results = []
    for in_place in (False, True):
        model = Replay(c, exp, int(args.pool_gib * GiB), in_place)
        row = model.run(args.steps, int(args.temps_gib * GiB))
        row["system"] = "in place" if in_place else "new buffers"
        print(row)
        results.append(row)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
