#!/usr/bin/env python3
"""Chart of remat_demo's results: peak activation memory against median step
time, one point per checkpoint strategy. Reads the CSV the demo writes
(strategy,peak_bytes,step_ms,overhead,final_loss). Leaves out: error bars
(the demo times one run). Exits 3 with a message when matplotlib is missing."""
import argparse
import csv
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--csv", required=True, help="demo.csv written by remat_demo")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot_demo.py: matplotlib is not available ({e}); chart skipped", file=sys.stderr)
        return 3
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print(f"plot_demo.py: {args.csv} has no rows", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for r in rows:
        mib = int(r["peak_bytes"]) / 2**20
        ms = float(r["step_ms"])
        ax.scatter([ms], [mib], s=60)
        ax.annotate(f"{r['strategy']}\n{float(r['overhead']):.2f}x time",
                    (ms, mib), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title("remat: memory vs time per checkpoint strategy")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
