"""Named points of an offloaded step's host-side schedule, for tools that watch the device's
allocator at each of them (experiments/throughput.py's TRACE_DISPATCH_MEMORY): a microbatch's
program dispatched, a group of the streamed update dispatched, a group fetched. Nothing is
called unless a tool listens."""

import contextlib
from collections.abc import Callable, Iterator

MICROBATCH, UPDATE_GROUP, FETCHED_GROUP = "microbatch", "update group", "after fetch group"
_listeners: list[Callable[[str], None]] = []


def mark(point: str) -> None:
    for listen in _listeners:
        listen(point)


@contextlib.contextmanager
def listening(listen: Callable[[str], None]) -> Iterator[None]:
    """Calls `listen(point)` at each point marked inside the block."""
    _listeners.append(listen)
    try:
        yield
    finally:
        _listeners.remove(listen)
