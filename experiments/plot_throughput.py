"""Bar charts of tokens/s and MFU per system from benchmark results, one row per result file.

    python experiments/plot_throughput.py [RESULTS.json ...] [--out runs/experiments/x.png]

Reads the JSON that experiments/throughput.py, fp8_throughput.py, pipeline.py and
offload_throughput.py write (needs matplotlib, from requirements-dev.txt). Each file is one
shape; its title names the file. The peer baselines are grey, angel-jax runs blue.
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "results",
        nargs="*",
        default=[str(ROOT / "runs/experiments/throughput_llama_1b.json")],
    )
    p.add_argument("--out", default=str(ROOT / "runs/experiments/throughput.png"))
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")  # Files only, no display.
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.results), 2, figsize=(12, 2 + 2.5 * len(args.results)))
    axes = [axes] if len(args.results) == 1 else axes
    for (speed, mfu), path in zip(axes, args.results, strict=True):
        record = json.loads(pathlib.Path(path).read_text())
        rows = [r for r in record["results"] if "tokens_per_s" in r]
        names = [r["system"] for r in rows]
        colors = ["tab:gray" if n.startswith(("plain-jax", "hf-")) else "tab:blue" for n in names]
        speed.barh(names, [r["tokens_per_s"] for r in rows], color=colors)
        mfu.barh(names, [r["mfu"] for r in rows], color=colors)
        speed.set_xlabel("tokens/s")
        mfu.set_xlabel(f"MFU ({record['machine']['device']})")
        speed.set_title(pathlib.Path(path).name, loc="left", fontsize=9)
        for ax in (speed, mfu):
            ax.invert_yaxis()
        mfu.set_yticks([])
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
