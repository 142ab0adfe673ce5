"""The docs' fragment `shard-reference` from bench/results/shard.json (bench/parallel/remat_shard: JSON lines,
a run-metadata record, then one record per configuration, round and rank).

Step time per configuration and round: the median over that run's timed steps of the slower rank's step;
ratios are paired by round against data parallel with the same checkpointing (median of the rounds, range in
brackets). Model state: what remat::memory counts live on a rank after a step, less what was live before the
model (parameters, gradients, AdamW moments, the strategy's own buffers). Step peak: the most bytes above the
step's start during it (activations, and for FullyShard the gathered units and full gradients in flight).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, run_line  # noqa: E402

LABELS = {"dp": "data parallel", "dp+block": "data parallel, blocks checkpointed", "shard": "FullyShard",
          "shard+block": "FullyShard, blocks checkpointed"}
BASE = {"dp": "dp", "dp+block": "dp+block", "shard": "dp", "shard+block": "dp+block"}
MIB = float(1 << 20)


def load(path):
    meta, rows = None, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta = rec["meta"]
            else:
                rows.append(rec)
    return meta, rows


def summarize(rows):
    """config -> {round: step ms (median over steps of the slower rank)}, and per config the figures of rank 0."""
    by = {}
    for r in rows:
        by.setdefault(r["config"], {}).setdefault(r["round"], []).append(r)
    out = {}
    for config, rounds in by.items():
        ms = {}
        for rnd, ranks in rounds.items():
            slower = [max(vals) for vals in zip(*(x["ms"] for x in ranks))]
            ms[rnd] = statistics.median(slower)
        first = rounds[min(rounds)]
        out[config] = dict(
            ms=ms, state=max(x["model_state"] for x in first), peak=max(max(x["step_peak"]) for x in first),
            comm=statistics.median(v for x in first for v in x["comm_ms"]),
            exposed=statistics.median(v for x in first for v in x["exposed_ms"]),
            gathers=first[0]["allgathers"], reductions=first[0]["reductions"])
    return out


def ratio(s, config, base):
    rs = [s[config]["ms"][r] / s[base]["ms"][r] for r in s[config]["ms"] if r in s[base]["ms"]]
    return statistics.median(rs), min(rs), max(rs)


def render(meta, rows):
    s = summarize(rows)
    lines = [run_line(meta) + " " + ("Reference GPT (8 blocks, d_model 512, 8 heads, T 512, vocabulary 256), "
                                     "AdamW, global batch 4 over 2 processes (2 each, 1 thread each, Gloo).")]
    nrounds = len(next(iter(s.values()))["ms"])
    lines.append(f"{nrounds} rounds, the four configurations run one after another in each; step ms: median of "
                 "the rounds (each round: the median over its timed steps of the slower rank).")
    lines.append("")
    lines.append("| configuration | step ms | x data parallel (range) | model state per rank | x data parallel "
                 "| step peak per rank | all-gathers / reductions per step | comm ms | exposed ms |")
    lines.append("|---|---:|---|---:|---:|---:|---|---:|---:|")
    for config in ["dp", "dp+block", "shard", "shard+block"]:
        if config not in s:
            continue
        c, base = s[config], BASE[config]
        med, lo, hi = ratio(s, config, base)
        lines.append(
            f"| {LABELS[config]} | {statistics.median(c['ms'].values()):.0f} | "
            + ("1" if config == base else f"{med:.3f} ({lo:.3f}-{hi:.3f})")
            + f" | {c['state'] / MIB:.1f} MiB | {c['state'] / s[base]['state']:.3f} | {c['peak'] / MIB:.1f} MiB | "
            f"{c['gathers']} / {c['reductions']} | {c['comm']:.0f} | {c['exposed']:.0f} |")
    lines.append("")
    if "shard+block" in s and "dp+block" in s:
        state = s["shard+block"]["state"] / s["dp+block"]["state"]
        med, lo, hi = ratio(s, "shard+block", "dp+block")
        lines.append(f"Target: FullyShard with block checkpointing holds at most 0.55x of data parallel with block "
                     f"checkpointing's model state per rank, at most 1.15x its step time: model state {state:.3f}x "
                     f"({'met' if state <= 0.55 else 'missed'}), step time {med:.3f}x (rounds {lo:.3f}-{hi:.3f}; "
                     f"{'met' if med <= 1.15 else 'missed'}).")
    return "\n".join(lines) + "\n"


def fragments(quick=False):
    path = os.path.join(RESULTS, f"shard{'-quick' if quick else ''}.json")
    if not os.path.exists(path):
        return {}
    meta, rows = load(path)
    return {"shard-reference": render(meta, rows)}


if __name__ == "__main__":
    print(fragments().get("shard-reference", "no bench/results/shard.json"))
