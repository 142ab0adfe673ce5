#!/usr/bin/env python3
"""Cost-model accuracy at reference sizes: the planner's predicted peak and step
time against one measured step (docs/BENCHMARKS.md, "Planner: predicted
against measured").

For each model (bench/compare/remat_compare's mlp-ref, gpt-ref, resnet-ref:
the CPU reference shapes of docs/BENCHMARKS.md, and resnet-ref-split, resnet-ref's blocks
cut in two stages each) runs CheckpointedSequential with the optimal plan at
budgets of a fraction of the plain peak (mlp-ref and gpt-ref 1.0, 0.5, 0.25;
resnet-ref 1.0, 0.8, 0.6, 0.5; resnet-ref-split 1.0, 0.5, 0.25, with 5 timed
steps), interleaved with plain, and prints per budget: predicted vs measured
peak (measured = the step's tracked peak above the level before it, plus the
chain input, which the prediction includes; the chain's output is released
before backward, as the model assumes) and predicted vs measured step time
(median of the timed steps); an infeasible budget gives the smallest feasible
peak instead. Targets: peak within 5%, time within 10%. Writes the rows, each
remat_compare run (with its run-metadata record) and this driver's record to
bench/results/accuracy.json (--quick: the toy models, accuracy-quick.json);
fragments() renders the table for gen_docs.py (fragment planner-accuracy).

  python3 bench/py/accuracy.py --build build [--quick] [--models M,M --fractions F,F --steps 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, result_path, run_line, write_json  # noqa: E402

# (model, budgets as fractions of the plain peak, timed steps): the reference run
REF = [("mlp-ref", "1.0,0.5,0.25", 3), ("gpt-ref", "1.0,0.5,0.25", 3), ("resnet-ref", "1.0,0.8,0.6,0.5", 3),
       ("resnet-ref-split", "1.0,0.5,0.25", 5)]
QUICK = [("mlp", "1.0,0.5,0.25", 3), ("gpt", "1.0,0.5,0.25", 3), ("resnet", "1.0,0.8,0.6", 3)]


def run(build, model, strategies, steps, warmup):
    cmd = [f"{build}/bench/remat_compare", "--model", model, "--strategies", ",".join(strategies),
           "--steps", str(steps), "--warmup", str(warmup), "--hold-output", "0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def table(res):
    """The markdown table of an accuracy result."""
    out = ["| model | budget / plain | predicted MB | measured MB | measured / predicted | predicted s | measured s "
           "| measured / predicted time | plain s | time / plain |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "note" in r:
            out.append(f"| {r['model']} | {r['budget']} | {r['note']} | | | | | | | |")
            continue
        out.append(f"| {r['model']} | {r['budget']} | {r['predicted_bytes'] / 1e6:.1f} | {r['measured_bytes'] / 1e6:.1f} | "
                   f"{r['measured_bytes'] / r['predicted_bytes']:.3f} | {r['predicted_ms'] / 1e3:.2f} | "
                   f"{r['measured_ms'] / 1e3:.2f} | {r['measured_ms'] / r['predicted_ms']:.3f} | "
                   f"{r['plain_ms'] / 1e3:.2f} | {r['measured_ms'] / r['plain_ms']:.3f} |")
    return "\n".join(out)


def render(res):
    runs = res.get("runs", [])
    steps = sorted({g["steps"] for g in runs}) or [res["meta"]["settings"].get("steps")]
    load = res.get("load", [])
    head = (f"{run_line(res['meta'], load)} remat_compare per model, `--hold-output 0`, 1 intra-op thread; plain and each budget's plan interleaved, "
            f"1 warm-up and {' or '.join(str(s) for s in steps)} timed steps each (medians; one run per row). "
            f"Measured peak: remat::memory's tracked peak of the step above the level before it, plus the chain input. "
            f"MB = 10^6 bytes.")
    met = lambda e, t: "met" if e <= t else "MISSED"  # noqa: E731
    tail = (f"Worst peak error {100 * res['worst_peak_error']:.1f}% (target 5%: {met(res['worst_peak_error'], 0.05)}), "
            f"worst time error {100 * res['worst_time_error']:.1f}% (target 10%: "
            f"{met(res['worst_time_error'], 0.10)}).")
    plains = "; ".join(f"{g['model']} {g['out']['plain_peak'] / 1e6:.2f} MB ({g['out']['plain_peak']:,} bytes)"
                       for g in runs)
    if plains:
        tail += f" Measured plain peaks (the budgets' base): {plains}."
    return "\n".join([head, "", table(res), "", tail]) + "\n"


def fragments(res):
    """The docs' generated fragment of an accuracy result (gen_docs.py): NAME -> markdown."""
    return {"planner-accuracy": render(res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true", help="toy sizes (mlp, gpt, resnet): a smoke run only")
    ap.add_argument("--steps", type=int, help="timed steps (3; resnet-ref-split 5)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--models", default="", help="these models, each at --fractions (default: the reference run)")
    ap.add_argument("--fractions", default="1.0,0.5,0.25", help="budgets, of the plain peak, with --models")
    a = ap.parse_args()
    groups = ([(m, a.fractions, a.steps or 3) for m in a.models.split(",")] if a.models else
              [(m, f, a.steps or s) for m, f, s in (QUICK if a.quick else REF)])
    meta = metadata(dict(vars(a), groups=groups))  # at the start: its date and commit are the run's
    worst_peak = worst_time = 0.0
    rows, runs, load = [], [], [os.getloadavg()[0]]
    for model, fractions, steps in groups:
        res = run(a.build, model, ["plain"] + [f"opt:{f}" for f in fractions.split(",")], steps, a.warmup)
        load.append(os.getloadavg()[0])
        runs.append(dict(model=model, fractions=fractions, steps=steps, out=res))
        plain = next(r for r in res["runs"] if r["name"] == "plain")
        plain_s = statistics.median(plain["ms"]) / 1e3
        for r in res["runs"]:
            if r["name"] == "plain":
                continue
            if r["predicted"] < 0:
                rows.append(dict(model=model, budget=r["name"][4:], note=r["note"]))
                continue
            measured = r["peak"]  # remat_compare adds the chain input, which the prediction includes
            t = statistics.median(r["ms"]) / 1e3
            worst_peak = max(worst_peak, abs(measured / r["predicted"] - 1))
            worst_time = max(worst_time, abs(t / (r["predicted_ms"] / 1e3) - 1))
            rows.append(dict(model=model, budget=r["name"][4:], predicted_bytes=r["predicted"], measured_bytes=measured,
                             predicted_ms=r["predicted_ms"], measured_ms=t * 1e3, plain_ms=plain_s * 1e3))
        print(f"{model} done", file=sys.stderr, flush=True)
    out = dict(meta=meta, rows=rows, worst_peak_error=worst_peak,
               worst_time_error=worst_time, load=load, runs=runs)
    print(render(out))
    path = result_path("accuracy", a.quick)
    write_json(path, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
