"""The floors of docs/design/architecture.md, read from the sources' imports: what may import
what."""

import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

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
        ("planning/memory.py", {"angel_jax.remat"}),
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


# What planning may not import: the executors that carry out its plans, the steps and the
# trainer (the settle loop reads what a build's compiled step took through `settle.Built`).
ABOVE_PLANNING = (
    "angel_jax.offload",
    "angel_jax.steps",
    "angel_jax.grads",
    "angel_jax.state_layout",
    "angel_jax.train",
    "angel_jax.loop",
)


def test_planning_imports_no_executor_step_or_trainer():
    above = lambda m: any(m == a or m.startswith(a + ".") for a in ABOVE_PLANNING)
    offenders = {
        relative: sorted(filter(above, imports(path)))
        for relative, path in sources()
        if relative.startswith("planning/") and any(map(above, imports(path)))
    }
    assert not offenders, offenders


# The planning modules that decide: an executor reads a plan (`planning.plan`), its tiers and
# groups, and never makes one.
DECIDING = ("placement", "chunks", "activations", "stage_plan", "compiled", "settle", "inputs")


def test_offload_holds_the_executors_and_parallel_the_shard_map_regions():
    """What decides (the placement, the remat choice, the stage plan, the compiled check, the
    settle loop) lives in planning/: offload/ keeps the executors, which make no plan, and
    parallel/ the code inside shard_map."""
    deciding = {f"angel_jax.planning.{m}" for m in DECIDING}
    makes_plans = {
        relative: sorted(imports(path) & deciding)
        for relative, path in sources()
        if relative.startswith("offload/") and imports(path) & deciding
    }
    assert not makes_plans, makes_plans
    no_shard_map = [
        p.name
        for p in (PACKAGE / "parallel").glob("*.py")
        if p.stem != "__init__" and "shard_map" not in p.read_text()
    ]
    assert not no_shard_map, no_shard_map


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


# Below the trainer: what the train step runs. Each takes what it uses, typed (`StepSetup`,
# `GradSetup`, `TrainingLoss`, the plan's chunks), never the `Experiment` that holds them.
BELOW_TRAIN = ("steps.py", "grads.py", "losses.py", "state_layout.py", "offload/")


def experiment_uses(path: pathlib.Path) -> list[str]:
    """Where `path` reaches an `Experiment`: a name, argument or attribute `exp` (the
    trainer's name for one) or the name `Experiment`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = (
            node.id
            if isinstance(node, ast.Name)
            else node.attr
            if isinstance(node, ast.Attribute)
            else node.arg
            if isinstance(node, ast.arg)
            else None
        )
        if name in ("exp", "Experiment"):
            found.append(f"{node.lineno}: {name}")
    return found


def test_nothing_below_the_trainer_calls_into_the_experiment():
    trainer = lambda m: m.split(".")[:2] in (["angel_jax", "train"], ["angel_jax", "loop"])
    offenders = {
        relative: sorted(filter(trainer, imports(path))) + experiment_uses(path)
        for relative, path in sources()
        if relative.startswith(BELOW_TRAIN)
        and (any(map(trainer, imports(path))) or experiment_uses(path))
    }
    assert not offenders, offenders


def comments_and_docstrings(path: pathlib.Path):
    """(line, text) of each comment and docstring of `path`."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if (text := ast.get_docstring(node, clean=False)) is not None:
                yield node.body[0].lineno, text


# Comments say why, not when or where: a measurement diary (dates, the machine it ran on, the
# results file it wrote, a README section) belongs in git and the docs' design notes.
DIARY = re.compile(r"20\d\d-\d\d-\d\d|\bon (an?|one|the) H[12]00\b|results/|README")


def test_library_comments_carry_no_measurement_diary():
    found = [
        f"{relative}:{line}: {DIARY.search(text).group()}"
        for root in (PACKAGE, PACKAGE.parent / "kernels_pallas")
        for path in sorted(root.rglob("*.py"))
        for relative in [path.relative_to(PACKAGE.parent).as_posix()]
        for line, text in comments_and_docstrings(path)
        if DIARY.search(text)
    ]
    assert not found, found


# A reader holds a definition (a class or a function) whole. default_config is the settings
# table, one line a setting.
LONGEST_DEFINITION = 120
TABLES = {"config.py:default_config"}


def test_no_definition_is_longer_than_a_reader_can_hold():
    long = [
        f"{relative}:{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for relative, path in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_DEFINITION
        and f"{relative}:{node.name}" not in TABLES
    ]
    assert not long, long
