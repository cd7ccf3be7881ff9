"""Tests run on 8 emulated CPU devices; the flag must be set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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
