"""What of a compiled GPU program's collectives its schedule hides behind compute.

XLA's GPU compiler runs collectives asynchronously, an `...-start` and a `...-done` op, and its
latency-hiding scheduler places independent work between the two. Reading the scheduled
program text: a collective is hidden by the ops between its start and its done, as far as
they take longer than the transfer; what the transfer takes beyond them is exposed. The ops'
times are estimated: a matmul (a GEMM fusion or cuBLAS call) or cuDNN's attention by its
FLOPs at the calibrated efficiency, anything else by the bytes it reads and writes at HBM
speed. A collective with no start/done pair is exposed whole.
"""

import dataclasses
import math
import re
from collections.abc import Callable

from angel_jax.planning.cost_model import HBM_EFFICIENCY, Gpu, Link, all_gather_s, all_reduce_s

_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%(\S+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_FREE = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "partition-id"}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # One of COLLECTIVES.
    nbytes: int  # The larger side (gathered / unreduced) per rank.
    ranks: int  # Its group's size.
    innermost: bool  # Over the mesh's innermost axis (`tensor`: consecutive devices).
    in_loop: bool  # In a while loop's body (the layer scan, the microbatch loop: runs often).
    transfer_s: float  # Its time on its link alone (ring algorithms, as the cost model's).
    exposed_s: float  # What of that the compute scheduled beside it does not hide.


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
    ]


def _nbytes(arrays) -> int:
    return sum(_BYTES.get(dtype, 1) * math.prod(dims) for dtype, dims in arrays)


def _group(attrs: str) -> tuple[int, bool]:
    """(ranks, over the innermost axis: consecutive devices) of a collective's replica groups,
    in any of XLA's three spellings: the mesh and the axes spanned
    (mesh['data'=2,'tensor'=4] {'tensor'}, axes maybe renamed), an iota
    ([groups,ranks]<=[dims], transposed with T(...) when strided) or a list ({{0,1},{2,3}})."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if mesh:
        sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        axes = [a for a in re.findall(r"'([^']+)'", mesh.group(2)) if sizes[a] > 1]
        ranks = math.prod(sizes[a] for a in axes)
        return ranks, ranks > 1 and axes == [a for a in sizes if sizes[a] > 1][-1:]
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=\[[\d,]+\](T\(([\d,]+)\))?", attrs)
    if iota:
        perm = [int(d) for d in (iota.group(3) or "").split(",") if d]
        return int(iota.group(1)), perm == sorted(perm)
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        first = [int(d) for d in listed.group(1).split(",") if d]
        return len(first), first == list(range(first[0], first[0] + len(first)))
    return 1, False


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """Each computation's instructions in order: (name, result type, opcode, the rest)."""
    out, current = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = out.setdefault(header.group(1), [])
            continue
        op = _INSTRUCTION.match(line.strip())
        if op and current is not None:
            current.append(op.groups())
    return out


def _shapes(instructions) -> dict[str, tuple[int, ...]]:
    """Each instruction's result shape (a tuple's first array's)."""
    return {n: (_arrays(t) or [("", ())])[0][1] for n, t, _, _ in instructions}


def _dot_flops(instructions) -> float:
    """2 x output x contracted size of each dot in a computation."""
    types = _shapes(instructions)
    flops = 0.0
    for _, result, opcode, rest in instructions:
        if opcode != "dot":
            continue
        lhs = types.get(_operands(rest)[0], ())
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if lhs else 0
        flops += 2 * math.prod(_arrays(result)[0][1]) * k
    return flops


def _attention_flops(rest: str, shapes, target: str) -> float:
    """cuDNN's fused attention: 4 B N T S H for Q.K and P.V, halved when causal, the
    backward 2.5 times the forward; q is the first operand (B, N or T, ..., H)."""
    q, k = (shapes.get(n, ()) for n in _operands(rest)[:2])
    if len(q) != 4 or len(k) != 4:
        return 0.0
    flops = 4 * math.prod(q) * max(k[1], k[2])  # q's B N T H times S (k's length dim).
    if "CAUSAL" in rest:
        flops /= 2
    return flops * (2.5 if "Backward" in target else 1.0)


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def op_seconds(program: dict, name: str, gpu: Gpu, efficiency: float) -> dict[str, float]:
    """Estimated seconds of each instruction of computation `name` (0 for the free ones)."""
    instructions = program[name]
    results = {n: t for n, t, _, _ in instructions}
    shapes = _shapes(instructions)
    flops_s, bytes_s = gpu.peak_tflops * 1e12 * efficiency, gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY
    out = {}
    for n, result, opcode, rest in instructions:
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        called = re.search(r"calls=%([\w.\-]+)", rest)
        flops = 0.0
        if "fmha" in target:
            flops = _attention_flops(rest, shapes, target)
        elif "gemm" in target or "matmul" in target:  # cuBLAS: (M, K) x (K, N), K last of a.
            a = shapes.get(_operands(rest)[0], ())
            flops = 2 * math.prod(shapes[n]) * (a[-1] if a else 0)
        elif opcode == "fusion" and called and called.group(1) in program:
            flops = _dot_flops(program[called.group(1)])
        if opcode in _FREE or opcode.endswith(("-start", "-done")):
            out[n] = 0.0
        elif flops:
            out[n] = flops / flops_s
        else:  # Memory-bound: what it reads and writes.
            moved = _nbytes(_arrays(result)) + sum(
                _nbytes(_arrays(results.get(o, ""))) for o in _operands(rest)
            )
            out[n] = moved / bytes_s
    return out


def _kind(opcode: str) -> str:
    """The collective an opcode starts, runs or ends ("" for none)."""
    return next((k for k in COLLECTIVES if opcode.startswith(k)), "")


def counts(hlo_text: str) -> dict[str, dict]:
    """Per collective kind in a compiled program: how many ops, how many of them inside a loop
    body (a scan over layers: run every layer) and their element types."""
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    out: dict[str, dict] = {}
    for name, instructions in _computations(hlo_text).items():
        for _, result, opcode, _ in instructions:
            kind = _kind(opcode)
            if not kind or opcode.endswith("-done"):
                continue
            entry = out.setdefault(kind, {"ops": 0, "in_loops": 0, "dtypes": []})
            entry["ops"] += 1
            entry["in_loops"] += name in bodies
            dtype = _arrays(result)[0][0]
            if dtype not in entry["dtypes"]:
                entry["dtypes"].append(dtype)
    return out


def collectives(
    hlo_text: str, gpu: Gpu, efficiency: float, link_of: Callable[[int, bool], Link]
) -> list[Collective]:
    """Every collective of a compiled (scheduled) program, its transfer time on the link
    `link_of(ranks, innermost)` gives and what of it the ops between its start and done
    leave exposed. An op's time hides one transfer only: collectives done earlier take
    it first (two transfers beside one matmul share it)."""
    program = _computations(hlo_text)
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    found = []
    for name, instructions in program.items():
        kinds = [_kind(op) for _, _, op, _ in instructions]
        if not any(kinds):
            continue
        free = op_seconds(program, name, gpu, efficiency)
        started = {}
        for i, ((n, result, opcode, rest), kind) in enumerate(
            zip(instructions, kinds, strict=True)
        ):
            if not kind:
                continue
            if opcode.endswith("-done"):
                start = _operands(rest)[0]
                if start not in started:
                    continue
                j, size, (ranks, inner) = started.pop(start)
                between = [m for m, _, _, _ in instructions[j + 1 : i]]
            else:
                size, (ranks, inner) = max(_nbytes([a]) for a in _arrays(result)), _group(rest)
                if opcode.endswith("-start"):
                    started[n] = (i, size, (ranks, inner))
                    continue
                between = []  # Synchronous: nothing runs beside it.
            c = Collective(kind, size, ranks, inner, name in bodies, 0.0, 0.0)
            left = transfer_s(c, link_of(ranks, inner))
            c = dataclasses.replace(c, transfer_s=left)
            for m in between:
                used = min(free[m], left)
                free[m], left = free[m] - used, left - used
            found.append(dataclasses.replace(c, exposed_s=left))
    return found


def transfer_s(c: Collective, ln: Link) -> float:
    """A collective's time on `ln` alone."""
    if c.ranks <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return all_reduce_s(c.nbytes, c.ranks, ln)
    if c.kind == "collective-permute":
        return ln.alpha_s + c.nbytes / (ln.gbps * 1e9)
    return all_gather_s(c.nbytes, c.ranks, ln)


def exposed_share(found: list[Collective], tensor: int) -> float | None:
    """The share of the tensor axis's collectives' time in loops (the layer scan's and the
    microbatch loop's, the LM head's among them) that their schedule leaves exposed; None
    where there are none."""
    chosen = [c for c in found if c.in_loop and c.innermost and c.ranks == tensor]
    total = sum(c.transfer_s for c in chosen)
    return sum(c.exposed_s for c in chosen) / total if total else None
