#!/usr/bin/env python3
"""Cost-model accuracy at reference sizes: the planner's predicted peak and step
time against one measured step (docs/BENCHMARKS.md, "Planner: predicted
against measured").

For each model (mlp-ref, gpt-ref, resnet-ref of bench/compare/remat_compare,
DESIGN.md's CPU reference shapes) runs CheckpointedSequential with the
optimal plan at budgets of 1.0, 0.5 and 0.25 of the plain peak, interleaved
with plain, and prints per budget: predicted vs measured peak (measured =
the step's tracked peak above the level before it, plus the chain input,
which the prediction includes; the chain's output is released before
backward, as the model assumes) and predicted vs measured step time (median
of the timed steps). Targets: peak within 5%, time within 10%. Writes the
rows with the run-metadata record to bench/results/accuracy.json
(--quick: accuracy-quick.json).

  python3 bench/py/accuracy.py --build build [--quick] [--steps 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, result_path, write_json  # noqa: E402


def run(build, model, strategies, steps, warmup):
    cmd = [f"{build}/bench/remat_compare", "--model", model, "--strategies", ",".join(strategies),
           "--steps", str(steps), "--warmup", str(warmup), "--hold-output", "0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true", help="toy sizes (mlp, gpt, resnet): a smoke run only")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--models", default="")
    ap.add_argument("--fractions", default="1.0,0.5,0.25", help="budgets, of the plain peak")
    a = ap.parse_args()
    models = a.models.split(",") if a.models else (["mlp", "gpt", "resnet"] if a.quick else
                                                    ["mlp-ref", "gpt-ref", "resnet-ref"])
    fractions = a.fractions.split(",")
    print("| model | budget | predicted MB | measured MB | measured / predicted | predicted s | measured s "
          "| measured / predicted | plain s |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst_peak = worst_time = 0.0
    rows = []
    for model in models:
        res = run(a.build, model, ["plain"] + [f"opt:{f}" for f in fractions], a.steps, a.warmup)
        plain = next(r for r in res["runs"] if r["name"] == "plain")
        plain_s = statistics.median(plain["ms"]) / 1e3
        for r in res["runs"]:
            if r["name"] == "plain":
                continue
            if r["predicted"] < 0:
                print(f"| {model} | {r['name'][4:]} | {r['note']} | | | | | | |")
                rows.append(dict(model=model, budget=r["name"][4:], note=r["note"]))
                continue
            measured = r["peak"]  # remat_compare adds the chain input, which the prediction includes
            peak_ratio = measured / r["predicted"]
            t = statistics.median(r["ms"]) / 1e3
            time_ratio = t / (r["predicted_ms"] / 1e3)
            worst_peak = max(worst_peak, abs(peak_ratio - 1))
            worst_time = max(worst_time, abs(time_ratio - 1))
            rows.append(dict(model=model, budget=r["name"][4:], predicted_bytes=r["predicted"], measured_bytes=measured,
                             predicted_ms=r["predicted_ms"], measured_ms=t * 1e3, plain_ms=plain_s * 1e3))
            print(f"| {model} | {r['name'][4:]} | {r['predicted'] / 1e6:.1f} | {measured / 1e6:.1f} | "
                  f"{peak_ratio:.3f} | {r['predicted_ms'] / 1e3:.2f} | {t:.2f} | {time_ratio:.3f} | {plain_s:.2f} |")
        sys.stdout.flush()
    print(f"\nworst peak error {100 * worst_peak:.1f}% (target 5%), worst time error {100 * worst_time:.1f}% "
          f"(target 10%)")
    path = result_path("accuracy", a.quick)
    write_json(path, dict(meta=metadata(vars(a)), rows=rows, worst_peak_error=worst_peak, worst_time_error=worst_time))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
