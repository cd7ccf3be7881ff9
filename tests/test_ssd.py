"""ZeRO-Cache's SSD tier: exact round trips, bfloat16 compression, per-key ordering, errors."""

import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from angel_jax.config import ConfigError
from angel_jax.offload.ssd import SSDStore, compression_error

BF16 = ml_dtypes.bfloat16


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w)
        assert isinstance(g, np.ndarray)
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(g, w)


def nested_tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "mu": (rng.standard_normal((3, 5)).astype(np.float32), [np.arange(7, dtype=np.int32)]),
        "nu": {"w": rng.standard_normal((4, 2)).astype(BF16), "empty": np.zeros((0, 3))},
        "count": np.int32(seed),  # Scalar leaves come back as 0-d arrays.
        "lr": 0.5,
        "bf16_scalar": np.array(1.5, BF16),
    }


def test_round_trip_nested_trees(tmp_path):
    store = SSDStore(tmp_path / "ssd")  # Created if missing.
    # Keys with path characters, and two that a plain character substitution would merge.
    keys = ["params/layers['w'][3].mu", "a/b", "a_b"]
    for i, key in enumerate(keys):
        store.write(key, nested_tree(i))
    for i, key in enumerate(keys):
        assert_trees_equal(store.read(key).result(), nested_tree(i))
    store.close()
    assert store.keys() == sorted(keys)
    names = os.listdir(tmp_path / "ssd")
    assert all(name.endswith(".npy") and "/" not in name and "[" not in name for name in names)
    assert len(names) == len(keys) * len(jax.tree.leaves(nested_tree(0)))


def test_compress_halves_float32_and_keeps_other_dtypes(tmp_path):
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 1e-3
    plain, packed = SSDStore(tmp_path / "plain"), SSDStore(tmp_path / "packed", compress=True)
    plain.write("m", {"m": x})
    packed.write("m", {"m": x})
    packed.close()
    plain.close()
    assert packed.nbytes == pytest.approx(plain.nbytes / 2, rel=1e-3)  # Up to the .npy header.

    packed = SSDStore(tmp_path / "packed", compress=True)
    others = {"step": np.arange(5, dtype=np.int32), "h": x[:8].astype(BF16), "d": x.astype(float)}
    packed.write("m", {"m": x, **others})
    got = packed.read("m").result()
    packed.close()
    assert got["m"].dtype == np.float32
    error = np.max(np.abs(got["m"] - x)) / np.max(np.abs(x))
    assert 0 < error <= 2**-8
    assert compression_error(x) == pytest.approx(error)
    assert_trees_equal({k: got[k] for k in others}, others)


def test_compression_error():
    assert compression_error(np.zeros(4, np.float32)) == 0.0
    assert compression_error(np.array([1.0, -2.0, 0.5], np.float32)) == 0.0  # Exact in bf16.
    # bf16 spacing at 1 is 2**-7: 1 + 2**-9 rounds to 1, an error of 2**-9 against max 2.
    assert compression_error(np.array([1 + 2**-9, 2.0], np.float32)) == pytest.approx(2**-10)


def test_reads_see_the_preceding_write_of_their_key(tmp_path):
    store = SSDStore(tmp_path, workers=8)
    reads = []
    for i in range(200):
        key = f"chunk{i % 3}"
        store.write(key, {"x": np.full(4096, i, np.int32), "tag": [np.int32(i)]})
        reads.append((i, store.read(key)))
    for i, future in reads:
        got = future.result()
        assert int(got["tag"][0]) == i and np.all(got["x"] == i)
    store.close()


def test_jax_arrays_are_converted_in_the_worker(tmp_path):
    threads = []

    class Leaf:
        def __array__(self, dtype=None, copy=None):
            threads.append(threading.current_thread())
            return np.arange(3.0)

    tree = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16), "probe": Leaf()}
    store = SSDStore(tmp_path)
    store.write("k", tree)
    got = store.read("k").result()
    store.close()
    assert_trees_equal(got, {"w": tree["w"], "b": tree["b"], "probe": np.arange(3.0)})
    assert threads and threads[0] is not threading.current_thread()


def test_unwritable_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"config\.offload\.ssd_dir=.*writable directory"):
        SSDStore(tmp_path / "file" / "ssd")
    with pytest.raises(ConfigError, match=r"config\.offload\.ssd_dir"):
        SSDStore(tmp_path / "file")


def test_read_only_directory_is_a_config_error(tmp_path):
    """An existing directory that refuses new files. Root writes through permission bits, so
    as root (CI runs so) sysfs stands in: root cannot create files there either."""
    target = tmp_path
    if os.geteuid() == 0:
        target = pathlib.Path("/sys/kernel")
        if not target.is_dir():
            pytest.skip("running as root without sysfs: no directory refuses root's writes")
    else:
        tmp_path.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"config\.offload\.ssd_dir=.*cannot write there"):
            SSDStore(target)
    finally:
        tmp_path.chmod(0o755)


def test_nbytes_counts_files_on_disk_and_drops_stale_leaves(tmp_path):
    store = SSDStore(tmp_path)
    store.write("a", [np.zeros(1000, np.float32), np.zeros(10, np.int32), np.float32(0)])
    store.write("b", {"x": np.zeros((8, 8), BF16)})
    store.wait()
    disk = lambda: sum(os.path.getsize(tmp_path / name) for name in os.listdir(tmp_path))
    assert store.nbytes == disk() >= 4000 + 40 + 4 + 128
    store.write("a", [np.zeros(10, np.float32)])  # Fewer leaves: the old extra files go.
    store.close()
    assert store.nbytes == disk() < 4000
    assert len(os.listdir(tmp_path)) == 2


def test_worker_exception_surfaces_from_wait(tmp_path):
    class Broken:
        def __array__(self, dtype=None, copy=None):
            raise ValueError("device buffer was donated")

    store = SSDStore(tmp_path)
    store.write("k", {"ok": np.ones(3)})
    store.wait()
    store.write("k", {"ok": np.ones(3), "bad": Broken()})
    with pytest.raises(ValueError, match="donated"):
        store.wait()
    store.wait()  # Reported once.
    # The failed write replaced the old value, so a read must not return stale data.
    with pytest.raises(KeyError, match="last write failed"):
        store.read("k").result()
    assert store.keys() == []
    store.close()


def test_a_truncated_file_is_an_error_not_garbage(tmp_path):
    store = SSDStore(tmp_path)
    store.write("k", {"x": np.arange(1000, dtype=np.float32)})
    store.wait()
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".npy"]
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(OSError, match="998 values, wrote 1000"):
        store.read("k").result()
    store.close()
