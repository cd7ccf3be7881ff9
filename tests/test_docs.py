"""The user's manual runs: every runnable command of docs/ and README.md exits 0, the site
builds with `mkdocs build --strict`, and the README's benchmark table is the records'.

Runnable blocks. A fenced block is runnable when the line just before its opening fence is
`<!-- runnable -->` (an HTML comment: invisible on GitHub and on the site):

    <!-- runnable -->
    ```sh
    python -m angel_jax.launch --config configs/tiny.py --workdir /tmp/angel-tiny \
      --config.train.steps=2
    ```

- `sh`, `bash` and `shell` blocks run under `bash -euo pipefail`, `python` blocks as
  `python -` (the block on stdin), from the repository root, with this interpreter first on
  PATH, `JAX_PLATFORMS=cpu`, and the suite's `XLA_FLAGS` (8 emulated devices, conftest.py) and
  compilation cache.
- Outputs: a block writes only under paths `/tmp/angel-NAME...`, which a reader can paste as
  they are. The test moves every such path into a fresh directory of its own (the prefix
  `/tmp/angel-` becomes `TMP/angel-`), so blocks share nothing and run in any order, in
  parallel. A block is self-contained: one that reads a run's outputs trains that run itself.
- `XLA_FLAGS=--xla_force_host_platform_device_count=8` in a block is what the suite already
  sets: the test gives the block the suite's `XLA_FLAGS` there, which keep its faster compile
  options.
- A block must exit 0: show a refusal with `... || echo "exit status $?"`.
- Keep blocks tiny (configs/tiny.py, `--config.train.steps=2`, reusing a layout another block
  compiles where it makes no difference): all of them together should take about 90 s on the
  suite's 2 workers.
- Every top-level page, docs/*.md, has at least one (a how-to opens with a command that runs);
  design notes, docs/design/, need none.

The README's benchmark table sits between `<!-- bench-table -->` and `<!-- /bench-table -->`;
`python experiments/bench.py --table` makes it from experiments/records/ (bench.README_BENCH
picks the figures).
"""

import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench  # noqa: E402

MARK = "<!-- runnable -->"
SHELLS = ("sh", "bash", "shell")
WORKDIRS = "/tmp/angel-"
DEVICES_FLAG = "XLA_FLAGS=--xla_force_host_platform_device_count=8"
COORDINATOR = "localhost:12355"  # A page's fixed port, a free one in the test (runs side by side).
TIMEOUT_S = 300  # One block; most take 5-20 s.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, code) of each runnable block in `path`."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = re.match(r"\s*(`{3,}|~{3,})\s*(\w*)", lines[i + 1] if i + 1 < len(lines) else "")
        if not fence:
            raise ValueError(f"{path}:{i + 1}: {MARK} is not followed by a fenced block")
        ticks, language = fence.groups()
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise ValueError(f"{path}:{i + 2}: the runnable block is not closed")
        if language not in (*SHELLS, "python"):
            raise ValueError(f"{path}:{i + 2}: runnable blocks are sh or python, not {language!r}")
        blocks.append((i + 2, language, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


BLOCKS = [
    pytest.param(path, line, language, code, id=f"{path.relative_to(ROOT)}:{line}")
    for path in pages()
    for line, language, code in runnable_blocks(path)
]


def test_every_page_has_a_runnable_command():
    with_blocks = {p for p, *_ in (b.values for b in BLOCKS)}
    bare = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p not in with_blocks]
    assert not bare, f"pages without a {MARK} block: {bare}"


@pytest.mark.parametrize("path, line, language, code", BLOCKS)
def test_runnable_block(path, line, language, code, tmp_path):
    code = code.replace(WORKDIRS, f"{tmp_path}/angel-")
    code = code.replace(DEVICES_FLAG, 'XLA_FLAGS="$XLA_FLAGS"')
    code = code.replace(COORDINATOR, f"localhost:{free_port()}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = ["bash", "-euo", "pipefail", "-s"] if language in SHELLS else [sys.executable, "-"]
    done = subprocess.run(
        command,
        input=code,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    where = f"{path.relative_to(ROOT)}:{line}"
    assert done.returncode == 0, (
        f"{where} exited {done.returncode}:\n{code}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )


def test_the_runnable_marker_is_found_and_read(tmp_path):
    """The extraction itself: a marked block is found with its language and line, an unmarked
    one is not, and a marker without a block, or on another language, is an error."""
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```sh\nno\n```\n\n<!-- runnable -->\n```python\nprint(1)\n```\n")
    assert runnable_blocks(page) == [(8, "python", "print(1)\n")]
    page.write_text("<!-- runnable -->\ntext\n")
    with pytest.raises(ValueError, match="not followed by a fenced block"):
        runnable_blocks(page)
    page.write_text("<!-- runnable -->\n```text\nhello\n```\n")
    with pytest.raises(ValueError, match="sh or python"):
        runnable_blocks(page)


def test_mkdocs_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"needs mkdocs-material ({', '.join(missing)} missing): pip install mkdocs-material"
        )
    nav = (ROOT / "mkdocs.yml").read_text()
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f" {p.name}" not in nav]
    assert not unlisted, f"docs pages missing from mkdocs.yml's nav: {unlisted}"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-5000:]}"
    assert (tmp_path / "index.html").is_file()


def test_readme_bench_table_is_the_records():
    text = (ROOT / "README.md").read_text()
    assert text == bench.with_readme_table(text, ROOT / "experiments/records"), (
        "README.md's benchmark table differs from experiments/records/; rewrite it with "
        "python experiments/bench.py --table"
    )


def test_bench_table_follows_the_records(tmp_path):
    """A new record changes the table; a missing one shows as '-'."""
    (tmp_path / "h200").mkdir()
    record = dict(recipe="llama_1b", status="ok", metrics={"ours MFU": 0.5, "x plain JAX": 1.25})
    bench.record_path(tmp_path, "h200", "llama_1b").write_text(json.dumps(record))
    rows = bench.readme_table(tmp_path).splitlines()
    llama = next(r for r in rows if r.startswith("| `llama_1b`"))
    assert llama.endswith("| - | ours MFU 0.5; x plain JAX 1.25 |"), llama
    assert all(r.endswith("| - | - |") for r in rows[2:] if r != llama)
