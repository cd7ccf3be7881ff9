"""The suite's persistent compilation cache (tests/conftest.py) changes nothing the tests read:
a program loaded from it reports the memory and the optimised HLO of a fresh compile."""

import os
import subprocess
import sys

PROGRAM = """
import json
import jax, jax.numpy as jnp

def f(x, w):
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return x.sum()

compiled = jax.jit(jax.grad(f)).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
m = compiled.memory_analysis()
print(json.dumps([m.temp_size_in_bytes, m.argument_size_in_bytes, compiled.as_text()]))
"""


def test_a_cached_program_reports_what_a_fresh_compile_does(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    run = lambda: (
        subprocess.run(
            [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    fresh = run()
    assert any(p.name.startswith("jit_f-") for p in tmp_path.iterdir())  # Written, then read.
    assert run() == fresh
