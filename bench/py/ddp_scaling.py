#!/usr/bin/env python3
"""Data-parallel step time: one process against --nproc 2 at the same global
batch, with remat-train (remat::parallel over Gloo on 127.0.0.1).

Each configuration runs `--steps` steps; the first is dropped (profiling,
bucket rebuild) and the median of the rest is reported, per rank for the
data-parallel runs, with the all-reduce figures remat-train prints:
all-reduce ms summed over buckets (launch to completion, including waiting
for the slower rank), the part left after backward's compute (exposed),
and the overlapped share. Runs are interleaved over --rounds. Sizes: the
reference GPT (8 blocks, d_model 512, 8 heads, T 512), global
batch 4, 2 rounds of 5 steps, into bench/results/ddp_scaling.json; --small: 6
blocks, d_model 256, T 256, global batch 8, 3 rounds of 6 steps, into
ddp_scaling-small.json; --quick: a toy size, ddp_scaling-quick.json. Each
file holds every round's figures, the model line remat-train prints and the
run-metadata record; gen_docs.py renders the fragments ddp-reference and
ddp-small.

  python bench/py/ddp_scaling.py --build build [--small | --quick] [--rounds 2] [--checkpoint block]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_json, metadata, result_path, run_line, write_json  # noqa: E402

SIZES = {"reference": dict(model="--layers 8 --d-model 512 --heads 8 --seq-len 512", global_batch=4, rounds=2, steps=5),
         "small": dict(model="--layers 6 --d-model 256 --heads 8 --seq-len 256", global_batch=8, rounds=3, steps=6),
         "quick": dict(model="--layers 2 --d-model 64 --heads 4 --seq-len 64", global_batch=4, rounds=1, steps=3)}
NAMES = {"reference": "ddp_scaling", "small": "ddp_scaling-small", "quick": "ddp_scaling"}

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
    head = next((line for line in out.stdout.splitlines() if " params" in line), "")
    return rows, head


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


def render(res):
    """The markdown table of a ddp_scaling result, with the ratios the docs cite."""
    a = res["meta"]["settings"]
    tokens = res["tokens_per_step"]
    cfg = res["configurations"]
    out = [f"{run_line(res['meta'], res['load'])} `remat-train {a['model']}`, `--checkpoint {a['checkpoint']} --optimizer sgd`, global batch "
           f"{a['global_batch']}; model: {res.get('model_line', '?')}. {a['rounds']} rounds of {a['steps'] - 1} timed "
           f"steps (step 1 dropped), configurations interleaved; step ms: median (each round's median in brackets; "
           f"the data-parallel row per rank and round).",
           "",
           "| configuration | step ms (per round) | tokens/s | all-reduce ms | exposed ms | overlapped | buckets "
           "| peak per process |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    meds = {}
    for name, rs in cfg.items():
        ms = [r["step_ms"] for r in rs]
        meds[name] = statistics.median(ms)
        f = lambda k, fmt: (fmt % statistics.median(v)) if (v := [r[k] for r in rs if r[k] is not None]) else "-"  # noqa
        per = a["global_batch"] // 2 if "2 processes" in name else a["global_batch"]
        out.append(f"| {name}, batch {per}{' each' if '2 processes' in name else ''} | {meds[name]:.0f} "
                   f"({', '.join(f'{x:.0f}' for x in ms)}) | {tokens / (meds[name] / 1e3):.0f} | "
                   f"{f('allreduce_ms', '%.1f')} | {f('exposed_ms', '%.1f')} | {f('overlap_pct', '%.0f%%')} | "
                   f"{f('buckets', '%d')} | {rs[-1]['peak']} |")
    dp, two, one = meds["2 processes, 1 thread each"], meds["1 process, 2 threads"], meds["1 process, 1 thread"]
    ex = [r["exposed_ms"] for r in cfg["2 processes, 1 thread each"] if r["exposed_ms"] is not None]
    out += ["", f"Two processes against one with 2 threads: {two / dp:.2f}x the throughput; against one with 1 thread: "
            f"{one / dp:.2f}x." + (f" Exposed all-reduce: {100 * statistics.median(ex) / dp:.1f}% of the data-parallel "
                                   f"step." if ex else "")]
    return "\n".join(out) + "\n"


def fragments(res):
    """The docs' generated fragment of a ddp_scaling result (gen_docs.py): NAME -> markdown."""
    return {"ddp-small" if res.get("size") == "small" else "ddp-reference": render(res)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--small", action="store_true", help="6 blocks, d_model 256, T 256, global batch 8")
    p.add_argument("--quick", action="store_true", help="a toy size, seconds (smoke runs)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--checkpoint", default="block")
    p.add_argument("--model", help="remat-train's model flags (the size's)")
    p.add_argument("--global-batch", type=int)
    p.add_argument("--report-only", action="store_true", help="re-render the size's result file")
    a = p.parse_args()
    size = "quick" if a.quick else "small" if a.small else "reference"
    for k, v in SIZES[size].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    path = result_path(NAMES[size], a.quick)
    if a.report_only:
        print(render(load_json(path)))
        return
    exe = f"{a.build}/tools/remat-train/remat-train"
    base = a.model.split() + ["--steps", str(a.steps), "--checkpoint", a.checkpoint, "--optimizer", "sgd"]
    configs = {
        "1 process, 2 threads": base + ["--batch", str(a.global_batch), "--threads", "2"],
        "1 process, 1 thread": base + ["--batch", str(a.global_batch), "--threads", "1"],
        "2 processes, 1 thread each": base + ["--nproc", "2", "--batch", str(a.global_batch // 2),
                                              "--threads", "1", "--master-port", "29731"],
    }
    meta = metadata(vars(a))  # at the start: its date and commit are the run's
    results = {k: [] for k in configs}
    load, model_line = [os.getloadavg()[0]], ""
    for rnd in range(a.rounds):
        for name, args in configs.items():
            rows, head = run(exe, args)
            model_line = model_line or head
            if "--nproc" in args:
                for rank in ("0", "1"):
                    s = summarize([r for r in rows if r[0] == rank])
                    s["rank"] = rank
                    results[name].append(s)
            else:
                results[name].append(summarize(rows))
            load.append(os.getloadavg()[0])
            print(f"round {rnd + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    tokens = a.global_batch * int(re.search(r"--seq-len (\d+)", a.model).group(1))
    res = dict(meta=meta, size=size, tokens_per_step=tokens, model_line=model_line.split(";")[0].strip(), load=load,
               configurations=results)
    print(render(res))
    write_json(path, res)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
