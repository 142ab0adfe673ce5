"""What fits under a memory cap: the longest sequence (and the largest batch)
each checkpoint strategy trains the GPT with, one remat-train process per
strategy and question (--max-seq-len-under / --max-batch-under). Each answer
is a prediction (profiled chain + plan::simulate; for auto the leanest
whole-step plan of auto_checkpoint's profiled step)
verified by one measured training step at the answer and at answer + step
(offload, which the op model leaves out, is searched by measured steps).
Writes a markdown table, a CSV and a PNG (docs/img/what_fits.png).
Leaves out: timing (the figures are bytes and lengths; see make bench).
"""
import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STRATEGIES = [  # (key, label, remat-train flags)
    ("none", "plain (none)", ["--checkpoint", "none"]),
    ("block", "per-block", ["--checkpoint", "block"]),
    ("sqrt", "sqrt", ["--checkpoint", "sqrt"]),
    ("auto", "auto (budget = cap)", ["--checkpoint", "auto"]),
    ("selective", "selective (megatron)", ["--checkpoint", "selective", "--policy", "megatron"]),
    # Not modeled (its bytes in flight follow the disk): remat-train searches it by measurement.
    ("offload", "offload (disk, measured)", ["--checkpoint", "offload", "--offload-dir", "{offload_dir}"]),
]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def to_bytes(text):
    num, unit = text.split()
    return int(float(num) * UNITS[unit])


def size(b):
    """As remat's format_bytes prints it (remat-train's output has 3 digits)."""
    return f"{b / (1 << 30):.2f} GiB" if b >= 1 << 30 else f"{b / (1 << 20):.2f} MiB"


def load_csv(path):
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if not r["max_seq_len"]:
                continue
            row = {"strategy": r["strategy"],
                   "seq_len": {"value": int(r["max_seq_len"]),
                               "at": (0, int(r["predicted_bytes"]), int(r["measured_bytes"])),
                               "next": (0, int(r["next_predicted_bytes"]), int(r["next_measured_bytes"]))}}
            if r["max_batch"]:
                row["batch"] = {"value": int(r["max_batch"]),
                                "at": (0, int(r["batch_predicted_bytes"]), int(r["batch_measured_bytes"]))}
            rows.append(row)
    return rows


def parse(out, what):
    """The figures format_fit prints: answer, then predicted/measured at it and at answer + step."""
    m = re.search(rf"^max {what} under .*?: (\d+)", out, re.M)
    if not m:
        raise SystemExit(f"no answer in remat-train's output:\n{out[-3000:]}")
    # offload is searched by measurement: "measured peak X" stands for both
    rows = [(v, p or m, meas or m) for v, p, meas, m in re.findall(
        rf"^  {what} (\d+): (?:predicted peak ([\d.]+ \w+)(?:, measured ([\d.]+ \w+))?|measured peak ([\d.]+ \w+))",
        out, re.M)]
    r = {"value": int(m.group(1)), "predictions": len(re.findall(r"^  predict ", out, re.M)),
         "measurements": len(re.findall(r"^  measure ", out, re.M))}
    for key, (v, pred, meas) in zip(["at", "next"], rows):
        r[key] = (int(v), to_bytes(pred), to_bytes(meas) if meas else -1)
    budget = re.search(r"(?:planner budget for the blocks|auto's budget \(the whole step, above its start\)): ([\d.]+ \w+)", out)
    r["budget"] = to_bytes(budget.group(1)) if budget else 0
    fixed = re.search(r"AdamW moments add ([\d.]+ \w+)", out)
    r["fixed"] = to_bytes(fixed.group(1)) if fixed else 0
    moved = re.search(r"\(predicted (\d+), stepped (down|up) by measurement\)", out)
    r["predicted_value"] = int(moved.group(1)) if moved else r["value"]
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "remat-train", "remat-train"))
    ap.add_argument("--cap", default="1GiB", help="the cap on a step's peak above its start")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="fixed batch of the sequence question")
    ap.add_argument("--seq-step", type=int, default=16, help="granularity of the sequence answer, tokens")
    ap.add_argument("--batch-seq-len", type=int, default=512, help="fixed seq_len of the batch question (0: skip it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "what_fits.png"))
    ap.add_argument("--csv", default="", help="also write the table here")
    ap.add_argument("--quick", action="store_true", help="toy model (smoke run only)")
    ap.add_argument("--strategies", default="none,block,sqrt,auto,selective,offload", help="comma-separated subset")
    ap.add_argument("--offload-dir", default="", help="directory for offload's files (default: a fresh temporary one)")
    ap.add_argument("--from-csv", default="", help="redraw the table and chart from a --csv of an earlier run")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.d_model, a.heads, a.batch, a.cap, a.batch_seq_len = 2, 64, 2, 2, "8MiB", 64
    if a.from_csv:
        report(a, load_csv(a.from_csv))
        return
    if not os.path.exists(a.exe):
        raise SystemExit(f"{a.exe} not found; build remat-train first (or pass --exe)")
    model = ["--model", "gpt", "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
             "--threads", str(a.threads)]
    print(f"gpt {a.layers} blocks, d_model {a.d_model}, {a.heads} heads; cap {a.cap}; {a.threads} thread(s)",
          flush=True)
    rows = []
    offload_dir = a.offload_dir or tempfile.mkdtemp(prefix="remat_what_fits_")
    for key, label, flags in STRATEGIES:
        if key not in a.strategies.split(","):
            continue
        flags = [f.format(offload_dir=offload_dir) for f in flags]
        row = {"strategy": label}
        questions = [("seq_len", ["--batch", str(a.batch), "--max-seq-len-under", a.cap, "--fit-step",
                                  str(a.seq_step)])]
        if a.batch_seq_len > 0:
            questions.append(("batch", ["--seq-len", str(a.batch_seq_len), "--max-batch-under", a.cap]))
        for what, q in questions:
            t0 = time.time()
            p = subprocess.run([a.exe] + model + flags + q, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"remat-train failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            row[what] = parse(p.stdout, what)
            r = row[what]
            print(f"  {label:22s} max {what} {r['value']:6d}  predicted {size(r['at'][1])}, measured "
                  f"{size(r['at'][2])}; at {r['next'][0]}: {size(r['next'][1])} / {size(r['next'][2])}  "
                  f"({r['predictions']} predictions, {r['measurements']} measured steps, {time.time() - t0:.0f} s)",
                  flush=True)
        rows.append(row)
    fixed = rows[0]["seq_len"]["fixed"]
    print(f"\ncap {a.cap} on the step's peak above its start; parameters, gradients and AdamW moments add "
          f"{size(fixed)} at the first row's seq_len (outside the cap).")
    for r in rows:
        if r["seq_len"]["budget"]:
            print(f"{r['strategy']}: auto's budget (the whole step, above its start) at its answer: "
                  f"{size(r['seq_len']['budget'])}")
    report(a, rows)


def report(a, rows):
    """Prints the markdown table, writes --csv and the chart."""
    head = (f"| strategy | max seq_len (batch {a.batch}) | predicted / measured peak | at +{a.seq_step}: "
            f"predicted / measured |")
    sep = "|---|---:|---:|---:|"
    if a.batch_seq_len > 0:
        head += f" max batch (seq_len {a.batch_seq_len}) | predicted / measured peak |"
        sep += "---:|---:|"
    lines = [head, sep]
    for row in rows:
        s = row["seq_len"]
        line = (f"| {row['strategy']} | {s['value']} | {size(s['at'][1])} / {size(s['at'][2])} | "
                f"{size(s['next'][1])} / {size(s['next'][2])} |")
        if "batch" in row:
            b = row["batch"]
            line += f" {b['value']} | {size(b['at'][1])} / {size(b['at'][2])} |"
        elif a.batch_seq_len > 0:
            line += " not run | |"
        lines.append(line)
    print()
    print("\n".join(lines))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["strategy", "max_seq_len", "predicted_bytes", "measured_bytes", "next_predicted_bytes",
                        "next_measured_bytes", "max_batch", "batch_predicted_bytes", "batch_measured_bytes"])
            for row in rows:
                s, b = row["seq_len"], row.get("batch", {"value": "", "at": ("", "", "")})  # "": not run
                w.writerow([row["strategy"], s["value"], s["at"][1], s["at"][2], s["next"][1], s["next"][2],
                            b["value"], b["at"][1], b["at"][2]])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: chart skipped (scripts/setup.sh installs it)")
        return
    panels = [("seq_len", f"longest sequence, batch {a.batch} (tokens)")]
    if a.batch_seq_len > 0:
        panels.append(("batch", f"largest batch, seq_len {a.batch_seq_len} (sequences)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 3.8), squeeze=False)
    labels = [r["strategy"] for r in rows]
    for ax, (what, title) in zip(axes[0], panels):
        vals = [r[what]["value"] if what in r else 0 for r in rows]
        bars = ax.barh(labels, vals, color=["#888888", "#4477aa", "#66ccee", "#228833", "#ccbb44", "#aa3377"][:len(rows)])
        for bar, r in zip(bars, rows):
            if what not in r:
                ax.text(0, bar.get_y() + bar.get_height() / 2, " not run", va="center", fontsize=8)
                continue
            at = r[what]["at"]
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {r[what]['value']}  ({size(at[2])} measured)", va="center", fontsize=8)
        ax.set_xlim(0, max(vals) * 1.45)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"What fits under {a.cap} (GPT {a.layers} blocks, d_model {a.d_model}, {a.heads} heads; "
                 f"step peak above its start, measured)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"chart: {a.out}")


if __name__ == "__main__":
    sys.exit(main())
