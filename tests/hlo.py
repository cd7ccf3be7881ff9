"""Reading compiled programs in tests: which collectives move how much."""

import collections
import math
import re


def collective_sizes(hlo: str) -> dict[str, list[int]]:
    """Elements of each collective's result in a compiled program, by kind."""
    found = collections.defaultdict(list)
    for line in hlo.splitlines():
        m = re.search(r" = (.*?) (all-to-all|all-gather|reduce-scatter|collective-permute)\(", line)
        if m:
            shapes = re.findall(r"\[([\d,]*)\]", m.group(1))
            sizes = (math.prod(int(n) for n in dims.split(",") if n) for dims in shapes)
            found[m.group(2)].append(sum(sizes))
    return found
