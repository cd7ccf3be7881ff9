"""The streamed update's groups of chunks (a chunk: one weight, or a layer's slice of a
stacked one, with its optimizer state): which go together into one program, which the device
holds beside the step, and the slots of an update between microbatches.
"""

from angel_jax.planning.tiers import DEVICE, HOST, SSD

# The streamed update's groups: a group's program holds each of its chunks' update unrolled
# (this bounds its compile time), and past this many bytes a group's copies (5 ms at a host
# link's 50 GB/s) outweigh the runtime calls that grouping saves (about 1.2 ms a chunk).
MOST_CHUNKS_A_GROUP = 64
MOST_BYTES_A_GROUP = 256 * 2**20
# An update between microbatches spreads its moved chunks over the slots between them in
# groups this much larger than an even share, since whole chunks leave gaps as they pack.
SLOT_MARGIN = 1.1


def flight(in_flight: int) -> tuple[int, int]:
    """(groups fetched ahead, groups left on their way home after an update) of the streamed
    update with `in_flight` groups on the device: the first are fetched before the step that
    makes their grads, the others go home beside the next step."""
    ahead = max(1, in_flight // 2)
    return ahead, in_flight - ahead + 1


def in_flight_bytes(chunks, in_flight: int) -> int:
    """Bytes the streamed update may hold on the device at once (`StreamedUpdate`): the
    `flight` groups ahead and leaving, each no larger than the largest chunks (each one
    weight, or one layer's slice of a weight, with its optimizer state); with fewer chunks
    than that a chunk can be both. `chunks`: `_chunks`'."""
    sizes = sorted(m + s for _, m, s in chunks)
    ahead, leaving = flight(in_flight)
    if max(ahead, leaving) >= len(sizes):  # Groups without a byte cap (`group_chunks`): the
        return 2 * sum(sizes)  # fetched ones may hold the state beside the last update's.
    return sum(sizes[-ahead:]) + sum(sizes[-leaving:])


def chunk_part(key: str) -> str:
    """The top-level part of the params a chunk's weight is in (`keystr` of its path's first
    key: an unrolled layer, the embedding, ...), from its key path's `keystr`."""
    return key.split("]", 1)[0] + "]"


def group_chunks(
    sizes: list[int], tiers: list[str], parts: list[str], in_flight: int, slot_bytes: int = 0
) -> list[list[int]]:
    """The streamed update's groups (lists of chunk indices): consecutive chunks of one tier
    and one part of the params (`chunk_part`: unrolled layers' groups alike, so that they
    share their update's program, `GroupPrograms`), each group of at most
    `MOST_CHUNKS_A_GROUP` chunks and, unless every chunk is in flight, `MOST_BYTES_A_GROUP`
    bytes (a larger chunk is a group of its own) and the bytes of the smallest of the largest
    chunks `in_flight_bytes` counts (the larger of its ahead and leaving), so that any such
    number of groups holds no more than that many of the largest chunks. SSD chunks stay
    alone (their reads and writes are per chunk).

    `slot_bytes` (an update between microbatches, `Plan.slot_bytes`): groups of at most that
    many bytes moved, the device's resident chunks with them (they move nothing), across parts
    and of any number of chunks (each group has a program of its own anyway), so that the
    update takes as few groups, one a slot, as its moved bytes need."""
    if not sizes:
        return []
    counted = max(flight(in_flight))
    # With every chunk counted (all in flight) the bound is the whole state, and every group
    # is beside the step anyway: no byte cap.
    cap = min(sorted(sizes)[-counted], MOST_BYTES_A_GROUP) if counted < len(sizes) else sum(sizes)
    most_chunks = MOST_CHUNKS_A_GROUP
    if slot_bytes:
        cap, most_chunks = slot_bytes, len(sizes)
        sizes = [0 if tier == DEVICE else size for tier, size in zip(tiers, sizes, strict=True)]
        tiers = [HOST if tier == DEVICE else tier for tier in tiers]
        parts = [""] * len(parts)
    groups, total = [], 0
    for k, (tier, size) in enumerate(zip(tiers, sizes, strict=True)):
        joins = (
            groups
            and tier != SSD
            and tiers[groups[-1][-1]] == tier
            and parts[groups[-1][-1]] == parts[k]
            and len(groups[-1]) < most_chunks
            and total + size <= cap
        )
        if joins:
            groups[-1].append(k)
            total += size
        else:
            groups.append([k])
            total = size
    return groups


def beside_step_groups(tiers: list[str], groups: list[list[int]], in_flight: int):
    """(groups fetched before the step, groups still on their way home from the last update)
    of the streamed update, which hold device memory beside the step's activations: of the
    first `flight` ahead groups those in host memory (an SSD group is read into host memory,
    a resident one does not move), and the last `flight` leaving groups that move."""
    ahead, leaving = flight(in_flight)
    tier = [tiers[ks[0]] for ks in groups]
    fetched = [g for g in range(min(ahead, len(groups))) if tier[g] == HOST]
    moved = [g for g in range(len(groups)) if tier[g] != DEVICE]
    return fetched, moved[-leaving:]


def new_compute_bytes(groups: list[list[int]], weights: list[str], weight_bytes: dict) -> int:
    """What the new compute copy of an update between microbatches holds beyond the waiting
    float32 grads, at its most: each group's program makes its chunks' parts of the copy
    (`StreamedUpdate.stages`), which wait until the last group has run, a weight's grads go
    once its last group has run, and then the host cores' parts join them. `groups`: the
    device's groups of chunk indices into `weights` (each chunk's weight); `weight_bytes`:
    weight -> (its compute copy's bytes, its chunks (a stacked weight's layers, else 1), its
    float32 grads' bytes)."""
    last = {weights[k]: g for g, ks in enumerate(groups) for k in ks}
    freed = [0] * len(groups)  # Per group, the grads that go once it has run.
    for w, g in last.items():
        freed[g] += weight_bytes[w][2]
    made = gone = most = 0
    for g, ks in enumerate(groups):
        made += sum(weight_bytes[weights[k]][0] // weight_bytes[weights[k]][1] for k in ks)
        most = max(most, made - gone)
        gone += freed[g]
    every_part = sum(c for c, _, _ in weight_bytes.values())  # The host cores' too.
    return max(most, every_part - gone)


def slot_size(moved: list[int], slots: int) -> int:
    """The bytes of a slot for the `moved` chunks' bytes: an even share of theirs over the
    `slots` with `SLOT_MARGIN`, at least their largest."""
    return int(max(max(moved), SLOT_MARGIN * sum(moved) / slots))


def slot_order(sizes: list[int], tiers: list[str], slot_bytes: int) -> list[int]:
    """The order of an update between microbatches' chunks (indices into `sizes`, their
    bytes, and `tiers`): the update's own order for those that fit a slot (resident ones
    move nothing), then the larger ones, which run after the last microbatch (on the 8B,
    the embedding's and the LM head's, 5.9 GiB each against slots of 4.8)."""
    fits = [tier == DEVICE or size <= slot_bytes for tier, size in zip(tiers, sizes, strict=True)]
    first = [k for k, f in enumerate(fits) if f]
    return first + [k for k, f in enumerate(fits) if not f]
