"""Tests run on 8 emulated CPU devices; the flags must be set before JAX is imported.

The tests' models are tiny, so compiling dominates their time: LLVM's optimisation level 0
compiles about a third faster (the MoE expert-parallel test: 29 s -> 18 s) and changes no HLO,
and one persistent compilation cache for the run compiles each program once, though many
tests build the same reference runs (the offload tests, one file then: 348 s -> 201 s on 2
workers). The cache's key is the program and the compile options, so a test never gets
another's program; launcher subprocesses inherit it.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A fresh cache per run (never the user's own), made by the first process, removed after it.
if "ANGEL_JAX_TESTS_CACHE" not in os.environ:
    os.environ["ANGEL_JAX_TESTS_CACHE"] = tempfile.mkdtemp(prefix="angel-jax-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["ANGEL_JAX_TESTS_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ANGEL_JAX_TESTS_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


import pytest  # noqa: E402


def hf_reference(test):
    """Marks a test compared against Hugging Face transformers in PyTorch: `-m hf_reference`
    selects them (.ci/run runs them in a Python 3.11 environment, where the machine's CPU wheel
    of torch is); skipped, with the reason, where torch is not installed."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        missing = False
    except ImportError:
        missing = True
    reason = "needs PyTorch: pip install -r requirements-torch.txt"
    skip = pytest.mark.skipif(missing, reason=reason)
    return pytest.mark.hf_reference(skip(test))
