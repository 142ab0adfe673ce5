#!/usr/bin/env python3
"""Data-parallel step time: one process against --nproc 2 at the same global
batch, with remat-train (remat::parallel over Gloo on 127.0.0.1).

Each configuration runs `--steps` steps; the first is dropped (profiling,
bucket rebuild) and the median of the rest is reported, per rank for the
data-parallel runs, with the all-reduce figures remat-train prints:
all-reduce ms summed over buckets (launch to completion, including waiting
for the slower rank), the part left after backward's compute (exposed),
and the overlapped share. Runs are interleaved over --rounds. Writes every
round's figures with the run-metadata record to bench/results/ddp_scaling.json.

  python bench/py/ddp_scaling.py --build build [--rounds 2] [--checkpoint block]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, result_path, write_json  # noqa: E402

STEP = re.compile(r"^(?:\[rank (\d+)/(\d+)\] )?step +(\d+)/\d+ .*? ([\d.]+) ms  peak ([\d.]+ \w+)"
                  r"(?:  all-reduce ([\d.]+) ms in (\d+) buckets \(([\d.]+) ms exposed, (\d+)% overlapped\))?")


def run(exe, args):
    out = subprocess.run([exe] + args, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"remat-train {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    rows = []
    for line in out.stdout.splitlines():
        m = STEP.match(line)
        if m:
            rows.append(m.groups())
    return rows


def summarize(rows):
    steps = [r for r in rows if int(r[2]) > 1]
    ms = statistics.median(float(r[3]) for r in steps)
    ar = [float(r[5]) for r in steps if r[5] is not None]
    ex = [float(r[7]) for r in steps if r[7] is not None]
    ov = [float(r[8]) for r in steps if r[8] is not None]
    buckets = [int(r[6]) for r in steps if r[6] is not None]
    return {
        "step_ms": ms,
        "allreduce_ms": statistics.median(ar) if ar else None,
        "exposed_ms": statistics.median(ex) if ex else None,
        "overlap_pct": statistics.median(ov) if ov else None,
        "buckets": max(buckets) if buckets else None,
        "peak": steps[-1][4],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint", default="block")
    p.add_argument("--model", default="--layers 6 --d-model 256 --heads 8 --seq-len 256")
    p.add_argument("--global-batch", type=int, default=8)
    a = p.parse_args()
    exe = f"{a.build}/tools/remat-train/remat-train"
    base = a.model.split() + ["--steps", str(a.steps), "--checkpoint", a.checkpoint, "--optimizer", "sgd"]
    configs = {
        "1 process, 2 threads": base + ["--batch", str(a.global_batch), "--threads", "2"],
        "1 process, 1 thread": base + ["--batch", str(a.global_batch), "--threads", "1"],
        "2 processes, 1 thread each": base + ["--nproc", "2", "--batch", str(a.global_batch // 2),
                                              "--threads", "1", "--master-port", "29731"],
    }
    results = {k: [] for k in configs}
    for rnd in range(a.rounds):
        for name, args in configs.items():
            rows = run(exe, args)
            if "--nproc" in args:
                for rank in ("0", "1"):
                    s = summarize([r for r in rows if r[0] == rank])
                    s["rank"] = rank
                    results[name].append(s)
            else:
                results[name].append(summarize(rows))
            print(f"round {rnd + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    tokens = a.global_batch * int(re.search(r"--seq-len (\d+)", a.model).group(1))
    print(f"| configuration ({a.checkpoint}, global batch {a.global_batch}) | step ms (median per round) | "
          "tokens/s | all-reduce ms | exposed ms | overlapped | buckets | peak per process |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        ms = [r["step_ms"] for r in rs]
        med = statistics.median(ms)
        ar = [r["allreduce_ms"] for r in rs if r["allreduce_ms"] is not None]
        ex = [r["exposed_ms"] for r in rs if r["exposed_ms"] is not None]
        ov = [r["overlap_pct"] for r in rs if r["overlap_pct"] is not None]
        bk = [r["buckets"] for r in rs if r["buckets"] is not None]
        f = lambda v, fmt: (fmt % statistics.median(v)) if v else "-"
        print(f"| {name} | {med:.0f} ({', '.join(f'{x:.0f}' for x in ms)}) | {tokens / (med / 1e3):.0f} | "
              f"{f(ar, '%.1f')} | {f(ex, '%.1f')} | {f(ov, '%.0f%%')} | {f(bk, '%d')} | {rs[-1]['peak']} |")
    path = result_path("ddp_scaling")
    write_json(path, dict(meta=metadata(vars(a)), tokens_per_step=tokens, configurations=results))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
