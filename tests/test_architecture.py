"""The floors of docs/design/architecture.md, read from the sources' imports: what may import
what."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "angel_jax"
FAMILY_MODULES = {f"angel_jax.models.{m}" for m in ("llama", "gpt2", "bert", "t5", "classic")}


def imports(path: pathlib.Path) -> set[str]:
    """The angel_jax modules `path` imports (`from angel_jax.x import y` counts x and x.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("angel_jax")}


def sources(*skip: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(skip):
            yield relative, path


def test_only_models_and_interop_import_a_family():
    """The trainer, planners, pipeline and generator reach a family through angel_jax.family
    and the `angel_jax.models` registry, never by its module."""
    offenders = {
        relative: sorted(imports(path) & FAMILY_MODULES)
        for relative, path in sources("models/", "interop/")
        if imports(path) & FAMILY_MODULES
    }
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("family.py", set()),
        ("remat.py", set()),
        ("dispatch.py", set()),
        ("machine.py", set()),
        ("memory.py", {"angel_jax.remat"}),
        ("config.py", {"angel_jax.remat"}),
        ("mesh.py", {"angel_jax.config"}),
    ],
)
def test_the_lowest_floors_import_nothing_above_them(module, allowed):
    above = {
        m
        for m in imports(PACKAGE / module)
        if m.split(".")[:2] not in ([*a.split(".")[:2]] for a in allowed)
    }
    assert not above, above


def test_generation_covers_the_families_with_a_kv_cache_layer():
    from angel_jax.generate import DECODERS
    from angel_jax.models import FAMILIES

    assert DECODERS == ("llama", "gpt2")
    assert all(FAMILIES[name].pieces.decode_layer for name in DECODERS)
    assert FAMILIES["llama"].pieces.layer is not None  # The pipeline's stage layer.


def test_training_imports_no_hugging_face_reader():
    """The trainer and the generator reach the Hugging Face readers (safetensors) lazily, only
    when a config names a checkpoint: a run that names none imports none of it."""
    code = "import sys, angel_jax.loop, angel_jax.generate; print('safetensors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
