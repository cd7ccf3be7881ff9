"""Tests run on 8 emulated CPU devices; the flags must be set before JAX is imported.

The tests' models are tiny, so compiling dominates their time: LLVM's optimisation level 0
compiles about a third faster (the MoE expert-parallel test: 29 s -> 18 s) and changes no HLO.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def compile_cache_env(tmp_path_factory) -> dict[str, str]:
    """Environment for launcher subprocesses that share one persistent compilation cache, so
    restarts and repeated runs of one program compile it once."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


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
