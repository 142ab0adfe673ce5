"""CheckpointedSequential with and without its per-stage menu (selective
levels and disk offload, ProfileOptions), on the reference chains of
docs/BENCHMARKS.md: the ResNet split into half blocks and the GPT stack.
Runs bench/compare's remat_compare per model (strategies interleaved step by
step: plain, opt:F without the menu, menu:F with it) and writes
bench/results/chain-menu.json; fragments() renders `chain-menu` (peaks,
predictions and paired time ratios) and `chain-menu-floor`.

    python bench/py/chain_menu.py --build build [--steps 4] [--quick]

Leaves out: the loss head and optimizer (the chains end in .sum(), as in
the compare benchmark) and PyTorch (it has no menu to compare).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MALLOC_KEEP, metadata, result_path, run_line  # noqa: E402

MODELS = {  # model -> budgets (fractions of plain) for opt:F and menu:F
    "resnet-ref-split": [0.5, 0.47, 0.46],
    "gpt-ref": [0.5, 0.25, 0.2, 0.15],
}
QUICK = {"resnet": [0.7, 0.5, 0.45], "gpt": [0.5, 0.25, 0.15]}


def run(build, model, budgets, steps, warmup):
    strategies = ["plain"] + [f"{k}:{f}" for f in budgets for k in ("opt", "menu")]
    cmd = [os.path.join(build, "bench", "remat_compare"), "--model", model, "--strategies", ",".join(strategies),
           "--steps", str(steps), "--warmup", str(warmup), "--sweep-steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **MALLOC_KEEP)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    res = json.loads(p.stdout)
    res["plans"] = [l for l in p.stderr.splitlines() if re.match(r"^(opt|menu):", l)]  # also "menu:F final: ..."
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the toy models (bench/results/chain-menu-quick.json)")
    a = ap.parse_args(argv)
    models = QUICK if a.quick else MODELS
    out = {"models": {}, "meta": metadata()}
    for model, budgets in models.items():
        print(f"chain_menu: {model}", file=sys.stderr, flush=True)
        out["models"][model] = run(a.build, model, budgets, a.steps, a.warmup)
    path = result_path("chain-menu", a.quick)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"chain_menu: wrote {path}", file=sys.stderr)


def _ratios(run, plain):
    """Per step: this strategy's ms / the plain step's of the same round (steps interleave)."""
    return [m / p for m, p in zip(run["ms"], plain["ms"])]


def _floor(note, plain_peak):
    """The smallest feasible peak a note names, as a fraction of the plain peak."""
    m = re.search(r"smallest feasible peak (?:is )?([\d.]+) ([KMG]iB|bytes)", note)
    if not m:
        return "?"
    scale = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
    return f"{float(m.group(1)) * scale / plain_peak:.3f} x plain"


def fragments(result):
    label = {"resnet-ref-split": "ResNet (half blocks)", "gpt-ref": "GPT stack", "resnet": "ResNet (toy)",
             "gpt": "GPT (toy)"}
    rows = ["| chain | budget x plain | menu | peak x plain | predicted x plain | time x plain (paired) | range | "
            "options used (first plan; after repricing) |", "|---|---:|---|---:|---:|---:|---|---|"]
    for model, res in result["models"].items():
        runs = {r["name"]: r for r in res["runs"]}
        plain = runs["plain"]
        pp = res["plain_peak"]
        first, final = {}, {}
        for line in res["plans"]:
            name = line.split(" ", 1)[0].rstrip(":")
            (final if line.startswith(name + " final:") else first)[name] = line
        for r in res["runs"]:
            if r["name"] == "plain":
                continue
            kind, frac = r["name"].split(":")
            menu = "yes" if kind == "menu" else "no"
            if r["peak"] < 0:
                rows.append(f"| {label.get(model, model)} | {float(frac):.2f} | {menu} | infeasible: smallest peak "
                            f"{_floor(r['note'], pp)} | | | | |")
                continue
            x = _ratios(r, plain)
            used = "-"

            def options(line):
                return line.split("options used:", 1)[1].split(";", 1)[0].strip() if "options used:" in line else ""

            if kind == "menu":
                used = options(first.get(r["name"], "")) or "?"
                last = final.get(r["name"], "")
                if "disk offload repriced" in last:
                    m = re.search(r"repriced (\d+)x from measured steps: \+(\d+) ms per GiB", last)
                    used += (f"; after {m.group(1)} repricing(s) (+{int(m.group(2)) / 1000:.1f} s per GiB sent): "
                             if m else "; repriced: ") + options(last)
            rows.append(f"| {label.get(model, model)} | {float(frac):.2f} | {menu} | {r['peak'] / pp:.3f} | "
                        f"{r['predicted'] / pp:.3f} | {statistics.median(x):.3f} | {min(x):.3f}-{max(x):.3f} | "
                        f"{used} |")
    meta = result["meta"]
    steps = max(len(r["ms"]) for res in result["models"].values() for r in res["runs"])
    head = (f"Peaks: remat::memory's peak of the step (forward and backward of the chain, ending in .sum()) above what "
            f"was live before it (parameters and their zeroed gradients), plus the chain input, as fractions of the "
            f"plain step's; predicted: the plan's. Times are medians of per-step ratios to the "
            f"plain step of the same round ({steps} rounds, strategies interleaved), with their range. Disk offload: "
            f"kDisk under /tmp, 16 MiB in flight. {run_line(meta)}")
    return {"chain-menu": head + "\n\n" + "\n".join(rows)}


if __name__ == "__main__":
    main()
