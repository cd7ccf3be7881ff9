"""The benchmark records (experiments/bench.py, experiments/recipes.py): a re-run is judged
against its record, every recipe names runs its script has, and RESULTS.md and the manual's
benchmarks page (docs/benchmarks.md) are the records'."""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench  # noqa: E402
import recipes  # noqa: E402

# A stand-in experiment: writes the results JSON its --out names, tokens/s from its arguments.
FAKE = """
import json, sys
ours, theirs, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[sys.argv.index("--out") + 1]
rows = [dict(system="ours", tokens_per_s=ours, mfu=0.5), dict(system="peer", tokens_per_s=theirs)]
if ours < 0:
    rows[0] = dict(system="ours", error=["exit code 1", "RESOURCE_EXHAUSTED: out of memory"])
json.dump(dict(command="fake", machine=dict(device="fake GPU"), results=rows), open(out, "w"))
"""


def fake_recipe(script, ours: float, theirs: float) -> recipes.Recipe:
    return recipes.Recipe(
        "fake",
        "a stand-in",
        str(script),
        (str(ours), str(theirs)),
        {"h200": 60},
        lambda results: recipes.against(results, "ours", "peer", "ours", "peer"),
        ("x peer",),
        goals={"h200": {"x peer": (1.1, None)}},
    )


def test_a_rerun_is_judged_against_its_record_and_a_failure_keeps_the_last_good(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    args = type("Args", (), dict(logs=str(tmp_path / "logs"), baselines=""))

    first = bench.run_recipe(fake_recipe(script, 200, 100), "h200", args, None)
    assert first["status"] == "ok" and first["metrics"]["x peer"] == 2.0, first
    assert first["machine"] == {"device": "fake GPU"} and first["command"].endswith("RESULTS.json")

    same = bench.run_recipe(fake_recipe(script, 196, 100), "h200", args, first)
    assert same["status"] == "ok" and same["vs_record"] == {"x peer": pytest.approx(0.98)}

    slower = bench.run_recipe(fake_recipe(script, 180, 100), "h200", args, first)
    assert slower["status"] == "regressed" and slower["vs_record"]["x peer"] == pytest.approx(0.9)
    assert "x0.900 of the record" in bench.report(slower)

    under_goal = bench.run_recipe(fake_recipe(script, 105, 100), "h200", args, None)
    assert under_goal["status"] == "off goal"

    failed = bench.run_recipe(fake_recipe(script, -1, 100), "h200", args, first)
    assert failed["status"] == "failed" and "RESOURCE_EXHAUSTED" in failed["error"]
    assert failed["last_good"]["metrics"] == first["metrics"]


def test_the_bench_exits_1_on_a_regression_and_0_when_the_records_hold(tmp_path, monkeypatch):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    records = tmp_path / "records"
    argv = ["bench.py", "--gpu", "h200", "--records", str(records), "--logs", str(tmp_path)]
    monkeypatch.setattr(bench, "RECIPES", [fake_recipe(script, 200, 100)])
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    assert json.loads((records / "h200/fake.json").read_text())["status"] == "ok"
    monkeypatch.setattr(bench, "RECIPES", [fake_recipe(script, 150, 100)])
    assert bench.main() == 1
    assert json.loads((records / "h200/fake.json").read_text())["status"] == "regressed"
    # A recipe that does not fit this kind is not run, nor counted against the call.
    monkeypatch.setattr(sys, "argv", [*argv[:1], "--gpu", "h100", *argv[3:]])
    assert bench.main() == 0 and not (records / "h100").exists()


def _names(recipe: recipes.Recipe, kind: str) -> tuple[list[str], list[str]]:
    """(the names the recipe's command selects, the names its script can run)."""
    import fp8_throughput
    import moe_throughput
    import offload_throughput
    import throughput

    args = list(recipe.command(kind, "out.json", "peers"))
    script = pathlib.Path(args[0]).stem
    chosen = args[args.index("--only") + 1] if "--only" in args else ""
    if script == "throughput":
        known = [v[0] for v in throughput.VARIANTS] + [b[0] for b in throughput.BASELINES]
        return chosen.split(","), known
    if script == "fp8_throughput":
        return chosen.split(","), [v[0] for v in fp8_throughput.fp8_variants(1, [])[1]]
    if script == "offload_throughput":
        return [p.removeprefix("=") for p in chosen.split(";")], [
            v[0] for v in offload_throughput.VARIANTS
        ]
    if script == "moe_throughput":
        batch = int(args[args.index("--batch-per-device") + 1])
        runs = moe_throughput.moe_runs(1, batch, "dropless", "1", "auto", [])
        return [recipes.MOE, recipes.TWIN], [r[0] for r in runs]
    if script == "capacity":
        import capacity

        return chosen.split(","), [f"{o}/{p}" for o, p in capacity.CASES]
    return [], []  # long_context.py runs lengths, not names.


@pytest.mark.parametrize("recipe", recipes.RECIPES, ids=lambda r: r.name)
def test_every_recipe_selects_runs_its_script_has_and_fits_one_device_call(recipe):
    assert recipe.seconds and set(recipe.seconds) | set(recipe.unfit) == set(recipes.KINDS)
    assert max(recipe.seconds.values()) < 560, "split it: a device call runs ~560 s"
    for kind in recipe.seconds:
        chosen, known = _names(recipe, kind)
        assert set(chosen) <= set(known), (kind, set(chosen) - set(known))
        assert (ROOT / recipe.command(kind, "x", "y")[0]).exists()
    goals = {n for g in recipe.goals.values() for n in g}
    assert set(recipe.compare) | goals, "a recipe compares or aims at something"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments/records").glob("*/*.json")), ids=lambda p: p.stem
)
def test_each_records_figures_come_from_its_results_by_its_recipe(path):
    record = json.loads(path.read_text())
    recipe = {r.name: r for r in recipes.RECIPES}[record["recipe"]]
    assert path.parent.name == record["gpu"] and path.stem == recipe.name
    if record["status"] in ("not run", "failed"):
        return
    assert recipe.metrics(record["results"]) == record["metrics"]


def test_results_md_and_the_benchmarks_page_are_made_from_the_records():
    assert bench.RESULTS_MD.read_text() == bench.table(bench.RECORDS), (
        "run `python experiments/bench.py --table`"
    )
    page = bench.DOCS_MD.read_text()
    assert page == bench.page(bench.RECORDS), "run `python experiments/bench.py --table`"
    # The manual's page is the table and how to re-run it; dates and one-off result files stay
    # in RESULTS.md.
    assert not re.search(r"\b20\d\d-\d\d-\d\d|/root/out|experiments/results/", page)
