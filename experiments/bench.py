"""The headline records, re-run: one recipe per record, one current record per GPU kind.

    python experiments/bench.py --list                 # the recipes, where they fit, how long
    python experiments/bench.py [--only NAME,...] [--gpu h100|h200] [--budget 560]
    python experiments/bench.py --table                # RESULTS.md and docs/benchmarks.md
    python experiments/bench.py --not-run WHY --only NAME --gpu h100   # say why it did not run

A recipe runs one experiment script (each variant in a child process of its own, as the script
does), reads the JSON it writes, and keeps its headline figures in
`experiments/records/<gpu>/<recipe>.json` with the command, the machine, the versions and the
commit: one current file per recipe and GPU kind (git keeps the history). A re-run prints each
compared figure over the record's; a failed run, a figure more than 5% under its record, or one
under its goal ends with exit status 1. Recipes whose expected time passes what is left of
`--budget` (seconds for the whole call, a device call's ~560 s by default) are skipped and said
so: split them across calls with `--only`.

On the GPU machine, carry the wheels as experiments/gpu_job.sh says (`.whl`, installed here
when they are not yet), and a copy of ../shared/baselines as `.baselines` for the peers:

    run(carry=[".whl", ".baselines"], command="python3 experiments/bench.py --only llama_1b \
        --out $OUT/records --logs $OUT/logs")
"""

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

from recipes import KINDS, RECIPES, Failed, Recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "experiments/records"
RESULTS_MD = ROOT / "experiments/RESULTS.md"
README_MD = ROOT / "README.md"
DOCS_MD = ROOT / "docs/benchmarks.md"  # The user's manual's page: the table without the diary.
RUNNABLE = "<!-- runnable -->"  # Marks a command that tests/test_docs.py runs on a CPU.
TOLERANCE = 0.05  # A re-run's compared figure may be this much under its record.


def detect_kind() -> str:
    """h100 or h200, from nvidia-smi (this process must not start a GPU client of its own)."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        names = ""
    for kind in KINDS:
        if kind in names.lower():
            return kind
    raise SystemExit(
        f"error: no H100 or H200 found ({names.strip() or 'no nvidia-smi'}): pass --gpu"
    )


def commit() -> str:
    """The commit measured: BENCH_COMMIT (a device machine's copy has no .git), else git's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    if not (ROOT / ".git").exists():  # A copy of the tree inside another repository: not its.
        return "unknown"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "") or "unknown"


def record_path(root: pathlib.Path, kind: str, name: str) -> pathlib.Path:
    return root / kind / f"{name}.json"


def load(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def install_wheels() -> None:
    """The GPU machine lacks some packages: install the carried wheels (gpu_job.sh's setup)
    where they are missing, and hand them to every child."""
    site = pathlib.Path("/tmp/site")
    if importlib.util.find_spec("ml_collections") is None and (ROOT / ".whl").is_dir():
        print("installing .whl/ into /tmp/site", flush=True)
        setup = f"source {ROOT}/experiments/gpu_job.sh && setup"
        subprocess.run(["bash", "-c", setup], check=True, env={**os.environ, "OUT": "/tmp"})
    if site.exists():
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), os.environ.get("PYTHONPATH")])
        )


def judge(recipe: Recipe, kind: str, figures: dict, before: dict | None) -> tuple[str, dict]:
    """(status, {figure: new / recorded}) of a run that produced `figures`."""
    vs = {}
    recorded = (before or {}).get("metrics") or {}
    for name in recipe.compare:
        if recorded.get(name):
            vs[name] = figures[name] / recorded[name]
    for name, (least, most) in recipe.goals.get(kind, {}).items():
        if least is not None and figures[name] < least or most is not None and figures[name] > most:
            return "off goal", vs
    if any(ratio < 1 - TOLERANCE for ratio in vs.values()):
        return "regressed", vs
    return "ok", vs


def run_recipe(recipe: Recipe, kind: str, args, before: dict | None) -> dict:
    """Runs one recipe on this machine and returns its record."""
    logs = pathlib.Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "results.json"
        cmd = [sys.executable, *recipe.command(kind, str(out), args.baselines)]
        env = {**os.environ, **recipe.env, "RUN_LOG_DIR": str(logs / f"{recipe.name}.{kind}")}
        limit = recipe.seconds[kind] * 2  # A run far past its expected time is stuck.
        env.setdefault("RUN_TIMEOUT_S", str(limit))
        line = " ".join([*(f"{k}={v}" for k, v in recipe.env.items()), "python", *cmd[1:]])
        print(f"\n== {recipe.name} on {kind}: {line}", flush=True)
        start = time.perf_counter()
        with open(logs / f"{recipe.name}.{kind}.log", "w") as log:
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=limit + 60,
                )
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timed out"
        wall = time.perf_counter() - start
        written = load(out) or {}
    record = dict(
        recipe=recipe.name,
        gpu=kind,
        what=recipe.what,
        command=line.replace(str(out), "RESULTS.json"),
        commit=commit(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=written.get("machine", {}),
        wall_s=round(wall, 1),
        expected_s=recipe.seconds[kind],
        goals=recipe.goals.get(kind, {}),
        results=written.get("results", []),
    )
    try:
        if not written:
            raise Failed(f"exit {code}, no results written (log: {recipe.name}.{kind}.log)")
        record["metrics"] = recipe.metrics(written["results"])
    except Failed as e:
        record.update(status="failed", error=str(e))
        if before and before.get("metrics"):
            record["last_good"] = {k: before[k] for k in ("metrics", "commit", "date")}
        return record
    record["status"], record["vs_record"] = judge(recipe, kind, record["metrics"], before)
    return record


def shown(value) -> str:
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def goal_text(goal) -> str:
    least, most = goal
    return " and ".join(
        part
        for part in (least is not None and f">= {least:g}", most is not None and f"<= {most:g}")
        if part
    )


def report(record: dict) -> str:
    """A run's figures, in a line each, with the ratio to the record's."""
    lines = [f"{record['recipe']} on {record['gpu']}: {record['status']} ({record['wall_s']} s)"]
    if "error" in record:
        lines.append(f"  error: {record['error']}")
    for name, value in record.get("metrics", {}).items():
        vs = record.get("vs_record", {}).get(name)
        goal = record.get("goals", {}).get(name)
        lines.append(
            f"  {name:<44} {shown(value):>12}"
            + (f"   x{vs:.3f} of the record" if vs else "")
            + (f"   (goal {goal_text(goal)})" if goal else "")
        )
    return "\n".join(lines)


def cell(record: dict | None, recipe: Recipe, kind: str) -> str:
    """One recipe on one GPU kind, for the table."""
    if kind not in recipe.seconds:
        return f"does not fit: {recipe.unfit.get(kind, 'not planned')}"
    if record is None:
        return "not run: no record yet"
    if record["status"] == "not run":
        return f"not run: {record['why']}"
    if record["status"] == "failed":
        return f"**failed**: {record['error']}"
    text = "; ".join(f"{k} {shown(v)}" for k, v in record["metrics"].items())
    flag = "" if record["status"] == "ok" else f" **{record['status']}**"
    # A record kept from the one-off runs before the bench: its notes say what differed.
    earlier = " (an earlier run's record)" if record.get("converted_from") else ""
    return f"{text}{flag}{earlier}"


def records_table(root: pathlib.Path, why_not_run: bool = True) -> tuple[list[str], list[dict]]:
    """(the lines of the table of every recipe on every kind, the records of the runs in it);
    without `why_not_run`, a recipe that has not run yet says only that."""
    lines = [
        "| recipe | record | " + " | ".join(k.upper() for k in KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    runs = []
    for recipe in RECIPES:
        cells = []
        for kind in KINDS:
            record = load(record_path(root, kind, recipe.name))
            if not why_not_run and record and record["status"] == "not run":
                record = None
            fits_unrun = kind in recipe.seconds and record is None
            cells.append(
                "not run yet" if fits_unrun and not why_not_run else cell(record, recipe, kind)
            )
            if record and record["status"] != "not run":
                runs.append(record)
        lines.append(f"| `{recipe.name}` | {recipe.what} | " + " | ".join(cells) + " |")
    return lines, runs


def notes(runs: list[dict]) -> list[str]:
    """What differed in the runs whose records say so."""
    return [f"- `{r['recipe']}` on {r['gpu']}: {r['note']}." for r in runs if r.get("note")]


def table(root: pathlib.Path) -> str:
    """experiments/RESULTS.md: every recipe on every kind, from the record files, and each
    run's machine, commit, date and command."""
    records, runs = records_table(root)
    lines = [
        "# Benchmark records",
        "",
        "Generated by `python experiments/bench.py --table` from `experiments/records/`; do not",
        "edit. Re-run a record with `python experiments/bench.py --only NAME` on the GPU",
        "machine; the recipes are in `experiments/recipes.py`.",
        "",
        *records,
    ]
    lines += [
        "",
        "## Runs",
        "",
        "| recipe | GPU | device | jax | commit | date | wall s | command |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in runs:
        m = r.get("machine", {})
        lines.append(
            f"| `{r['recipe']}` | {r['gpu']} | {m.get('device', '?')} | {m.get('jax', '?')} | "
            f"{r['commit']} | {r['date'][:10]} | {shown(r['wall_s'] or '-')} | `{r['command']}` |"
        )
    return "\n".join([*lines, "", *notes(runs)]) + "\n"


# The README's benchmark table: a recipe and the figures of its records shown.
README_BENCH = [
    ("llama_1b", ("ours MFU", "x plain JAX")),
    ("fp8_8b_8layers", ("FP8 MFU", "x bf16")),
    ("moe_1b_dropless", ("MoE MFU", "x dense twin")),
    ("offload_8b_128k", ("delayed MFU", "delayed x exact")),
    ("offload_llama_1b", ("exact x DeepSpeed", "delayed x DeepSpeed")),
    ("capacity_adamw", ("parameters (B)",)),
    ("capacity_adafactor", ("parameters (B)",)),
]
TABLE_START, TABLE_END = "<!-- bench-table -->", "<!-- /bench-table -->"


def readme_table(root: pathlib.Path) -> str:
    """The README's benchmark table from the record files under `root`."""
    known = {r.name: r for r in RECIPES}
    lines = [
        "| recipe | what | " + " | ".join(k.upper() for k in KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    for name, figures in README_BENCH:
        cells = []
        for kind in KINDS:
            metrics = (load(record_path(root, kind, name)) or {}).get("metrics", {})
            shown_ = [f"{f} {shown(metrics[f])}" for f in figures if f in metrics]
            cells.append("; ".join(shown_) or "-")
        lines.append(f"| `{name}` | {known[name].what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_readme_table(readme: str, root: pathlib.Path) -> str:
    """`readme` with the text between its table markers made from the records under `root`."""
    if TABLE_START not in readme or TABLE_END not in readme:
        raise ValueError(f"README.md lacks the markers {TABLE_START} and {TABLE_END}")
    head, rest = readme.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    return f"{head}{TABLE_START}\n{readme_table(root)}\n{TABLE_END}{tail}"


def recipe_command(recipe: Recipe, kind: str) -> str:
    """The experiment's command line that bench.py runs for `recipe` on `kind`, quoted for a
    shell (the peers' scripts in .baselines, the results to RESULTS.json)."""
    words = [*(f"{k}={v}" for k, v in recipe.env.items()), "python"]
    return shlex.join([*words, *recipe.command(kind, "RESULTS.json", ".baselines")])


def page(root: pathlib.Path) -> str:
    """docs/benchmarks.md: how to re-run the records, their table, and what each ran on; the
    commits, dates and one-off commands stay in experiments/RESULTS.md."""
    records, runs = records_table(root, why_not_run=False)
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python experiments/bench.py --table` from experiments/records/;",
        "do not edit. -->",
        "",
        "Every figure on this page is a record that re-runs. A recipe in",
        "`experiments/recipes.py` names an experiment script and its flags, the GPU kinds it",
        "fits and how long it takes there; `experiments/bench.py` runs it and keeps one current",
        "record per recipe and GPU kind in `experiments/records/` (the figures, the command, the",
        "machine and the versions). Peers run in the same job as ours, so a ratio to a peer",
        "compares runs on one machine at one time.",
        "",
        "List the recipes, with the GPU kinds each fits and its expected time:",
        "",
        RUNNABLE,
        "```sh",
        "python experiments/bench.py --list",
        "```",
        "",
        "On a GPU machine (H100 or H200), re-run some of them, then rebuild this page and",
        "`experiments/RESULTS.md` from the records:",
        "",
        "```sh",
        "python experiments/bench.py --only llama_1b,fp8_8b_8layers   # --gpu h100|h200",
        "python experiments/bench.py --table",
        "```",
        "",
        "A re-run prints each figure beside its record's and exits 1 when a run fails, when a",
        "compared figure is more than 5% under its record, or when one leaves its goal (marked",
        "**off goal** below). Each variant of an experiment runs in a child process of its",
        "own; `RUN_TIMEOUT_S=N` stops a child after N seconds and goes on. Recipes that would",
        "not finish in what is left of `--budget` (seconds for the whole call, 560 by default)",
        "are skipped and named, so split a long list across calls with `--only`. The peers'",
        "scripts are read from `.baselines` (`--baselines DIR`). MFU is against the GPU's dense",
        "bf16 peak (989 TFLOP/s for H100 and H200) and counts 6 FLOPs a matmul parameter and",
        "token plus causal attention; remat's recompute is not counted.",
        "",
        "## Records",
        "",
        *records,
        "",
        "A record marked *an earlier run's record* was converted from a run made before the",
        "bench existed; the notes below say what differed from the recipe.",
        "`experiments/RESULTS.md` has the same table with each run's commit and exact command.",
        "",
        "## What they ran on",
        "",
        "| recipe | GPU | device | jax | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        m = r.get("machine", {})
        lines.append(
            f"| `{r['recipe']}` | {r['gpu']} | {m.get('device', '?')} | {m.get('jax', '?')} | "
            f"{shown(r['wall_s'] or '-')} |"
        )
    lines += ["", *notes(runs), "", "## The experiments behind them", ""]
    lines += [
        "| recipe | GPU | `python experiments/bench.py --only RECIPE` runs |",
        "|---|---|---|",
    ]
    for recipe in RECIPES:
        kinds = {}  # Command -> the kinds it runs on.
        for kind in recipe.seconds:
            kinds.setdefault(recipe_command(recipe, kind), []).append(kind)
        for command, on in kinds.items():
            lines.append(f"| `{recipe.name}` | {', '.join(on)} | `{command}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated recipe names (default: all)")
    p.add_argument("--gpu", choices=KINDS, help="the GPU kind (default: nvidia-smi's)")
    p.add_argument("--budget", type=float, default=560, help="seconds for the whole call")
    p.add_argument("--records", default=str(RECORDS), help="the records compared with")
    p.add_argument("--out", help="where new records go (default: --records)")
    p.add_argument("--logs", default=str(ROOT / "runs/bench_logs"))
    p.add_argument("--baselines", default=str(ROOT / ".baselines"), help="the peers' scripts")
    p.add_argument("--list", action="store_true", help="list the recipes")
    p.add_argument("--table", action="store_true", help="write RESULTS.md and docs/benchmarks.md")
    p.add_argument("--not-run", metavar="WHY", help="record that --only's recipes did not run")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    known = {r.name: r for r in RECIPES}
    for n in names:
        if n not in known:
            p.error(f"no recipe {n!r}; the recipes: {', '.join(known)}")
    chosen = [known[n] for n in names] if names else RECIPES
    records = pathlib.Path(args.records)
    out = pathlib.Path(args.out or args.records)
    if args.list:
        for r in chosen:
            fits = ", ".join(f"{k} ~{s} s" for k, s in r.seconds.items())
            print(f"{r.name:<26} {fits:<24} {r.what}")
        return 0
    if args.table:
        RESULTS_MD.write_text(table(records))
        DOCS_MD.parent.mkdir(exist_ok=True)
        DOCS_MD.write_text(page(records))
        README_MD.write_text(with_readme_table(README_MD.read_text(), records))
        print(f"wrote {RESULTS_MD}, {DOCS_MD} and {README_MD}'s benchmark table")
        return 0
    kind = args.gpu or detect_kind()
    if args.not_run:
        for r in chosen:
            path = record_path(out, kind, r.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            note = dict(recipe=r.name, gpu=kind, what=r.what, status="not run", why=args.not_run)
            path.write_text(json.dumps(note, indent=1) + "\n")
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ["PYTHONUNBUFFERED"] = "1"
    install_wheels()
    start, bad = time.perf_counter(), []
    for recipe in chosen:
        if kind not in recipe.seconds:
            print(f"\n== {recipe.name}: not on {kind}: {recipe.unfit.get(kind, 'not planned')}")
            continue
        left = args.budget - (time.perf_counter() - start)
        if recipe.seconds[kind] > left:
            print(f"\n== {recipe.name}: skipped, ~{recipe.seconds[kind]} s > {left:.0f} s left")
            bad.append(recipe.name)
            continue
        before = load(record_path(records, kind, recipe.name))
        record = run_recipe(recipe, kind, args, before)
        path = record_path(out, kind, recipe.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(report(record), flush=True)
        if record["status"] != "ok":
            bad.append(recipe.name)
    print(f"\n{len(bad)} of {len(chosen)} not ok: {', '.join(bad)}" if bad else "\nall ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
