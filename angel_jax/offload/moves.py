"""The streamed update's copies between tiers (`Moves`: which of a chunk's leaves move, and
the copies of a group's leaves in one call each way) and its groups on their way home
(`Homebound`: what their copies read, deleted once they are done)."""

import collections
import concurrent.futures as futures

import jax

from angel_jax.planning.tiers import DEVICE, HOST, SSD


def home_kind(tier: str, leaf) -> str:
    """The memory kind a chunk's leaf lives in between steps, for a chunk on DEVICE or HOST:
    scalars (step counts) stay on the device, where moving them would cost more than keeping
    them."""
    return DEVICE if tier == DEVICE or leaf.ndim == 0 else HOST


class Moves:
    """Per chunk (a `stream.Chunk`), its leaves [master, *state] flat: the ones to move
    between tiers, with their shardings on the device and at home. Built once: the update's
    loop is Python-bound on small chunks."""

    def __init__(self, chunks: list):
        self.chunks = chunks
        # Per chunk: (its state's treedef, the indices of the leaves that move, their
        # shardings on the device, at home).
        self.tables = []
        for c in chunks:
            leaves = [c.master, *jax.tree.leaves(c.state)]
            ssd = c.tier == SSD
            moved = [i for i, x in enumerate(leaves) if ssd or home_kind(c.tier, x) != DEVICE]
            on_device = [leaves[i].sharding for i in moved]
            home = [x.with_memory_kind(HOST) for x in on_device]
            self.tables.append((jax.tree.structure(c.state), moved, on_device, home))

    def moving(self, k: int) -> list[int]:
        """The indices of chunk k's leaves [master, *state] that move between tiers."""
        return self.tables[k][1]

    def state(self, k: int, leaves: list):
        """Chunk k's optimizer state from its state's leaves."""
        return self.tables[k][0].unflatten(leaves)

    def leaves(self, k: int, masters: list, states: list) -> list:
        """Chunk k's [master, *state leaves] as they are between steps."""
        c = self.chunks[k]
        get = lambda tree: tree[c.weight] if c.layer is None else tree[c.weight][c.layer]
        return [get(masters), *jax.tree.leaves(get(states))]

    def moved(self, ks: list[int], leaves: list[list]) -> list:
        """Of chunks ks' leaves, the ones that move between tiers, flat."""
        return [x[i] for k, x in zip(ks, leaves, strict=True) for i in self.tables[k][1]]

    def move(self, ks: list[int], leaves: list[list], to_device: bool) -> list[list]:
        """Chunks ks' leaves with the moving ones copied to the device or home, in one call."""
        sources, targets = [], []
        for k, chunk_leaves in zip(ks, leaves, strict=True):
            _, moved, on_device, home = self.tables[k]
            sources += [chunk_leaves[i] for i in moved]
            targets += on_device if to_device else home
        copies = iter(jax.device_put(sources, targets) if sources else [])
        out = []
        for k, chunk_leaves in zip(ks, leaves, strict=True):
            chunk_leaves = list(chunk_leaves)
            for i in self.tables[k][1]:
                chunk_leaves[i] = next(copies)
            out.append(chunk_leaves)
        return out


class Homebound:
    """The groups on their way home, in update order: per group [its host copies (or SSD
    writes), its device outputs, the caller's old host copies, the group], deleted by
    `delete_ready` once the copies that read them are done."""

    def __init__(self):
        self.entries = collections.deque()

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, entry: list) -> None:
        self.entries.append(entry)

    def delete_ready(self) -> None:
        """Deletes what the copies of the groups on their way home have read, without
        waiting: the caller's old host copies once the group's update has run (its copies up
        are done), its device outputs once their copies home are done.

        On the GPU (PJRT's compute-synchronized allocation) a buffer deleted while a copy
        stream still reads it makes the compute stream wait for that copy stream: the next
        program, a grad step or an update, would start only when the copies queued so far
        are done (a grad step's first kernel waited 60-105 ms so for the update's copies
        home)."""
        ready = lambda xs: all(copy_done(x) for x in xs)
        still = collections.deque()
        for entry in self.entries:
            home, device_outs, old, _ = entry
            if old and ready(device_outs):
                delete(old)
                entry[2] = []
            if ready(home):
                delete([*entry[2], *device_outs])
            else:
                still.append(entry)
        self.entries = still

    def make_room(self, fetched: dict, in_flight: int) -> None:
        """Sends off groups on their way home (this update's, or the last one's) until one
        more fetched leaves at most `in_flight` on the device, the oldest waited for (not
        those found home meanwhile: the schedule does not depend on the copies' timing)."""
        while self.entries and len(self.entries) + len(fetched) >= in_flight:
            self.send_off(self.entries.popleft())

    def send_off(self, entry: list) -> None:
        """Waits for a group's copies home, then deletes what they read."""
        home, device_outs, old, _ = entry
        wait([x for x in home if isinstance(x, futures.Future) or not x.is_deleted()])
        delete([*old, *device_outs])

    def keep_last(self, keep: int, older: list) -> None:
        """Sends off all but the last `keep` groups, and any of the `older` entries (an
        update before this one's) still among them."""
        is_older = lambda entry: any(entry is e for e in older)
        while self.entries and (len(self.entries) > keep or is_older(self.entries[0])):
            self.send_off(self.entries.popleft())

    def drain(self) -> None:
        """Waits for every group on its way home and deletes what its copies read (before
        the state is replaced, e.g. restored after a rollback)."""
        while self.entries:
            self.send_off(self.entries.popleft())


def copy_done(x) -> bool:
    """Whether an SSD write is done, or an array ready; a ready array may be deleted since
    (the next update read and deleted it)."""
    if isinstance(x, futures.Future):
        return x.done()
    return x.is_deleted() or x.is_ready()


def delete(arrays: list) -> None:
    for x in arrays:
        x.delete()


def wait(pending) -> None:
    """Blocks until a chunk is home: its arrays ready, or its SSD writes done."""
    for x in jax.tree.leaves(pending):
        if isinstance(x, futures.Future):
            x.result()
        else:
            x.block_until_ready()
