"""The docs' fragment `pipeline-reference` from bench/results/pipeline.json (bench/parallel/remat_pipeline: JSON
lines, a run-metadata record, then one record per configuration, round and rank).

Step time per configuration and round: the slower rank's median over that run's timed steps; the table gives the
median over the rounds, and ratios paired by round (against one process, and for the planned pipelines against the
same schedule without checkpointing: median of the rounds, range in brackets). Peak: the most bytes remat::memory
counts live in the process during a timed step (parameters, gradients, AdamW moments, activations, the pipeline's
boundary tensors), the highest over rounds and steps. Model state: what is live after a step less what was live
before the model. Bubble: Pipeline::stats().bubble (the share of the step a stage computed nothing), median over
rounds and steps; in flight: the most micro-batches whose forward had run and backward had not.
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, run_line  # noqa: E402

CONFIGS = ["one", "gpipe", "1f1b", "gpipe+plan", "1f1b+plan"]
LABELS = {"one": "one process", "gpipe": "GPipe", "1f1b": "1F1B", "gpipe+plan": "GPipe, planned checkpointing",
          "1f1b+plan": "1F1B, planned checkpointing"}
SCHEDULE_LABEL = {"gpipe": "GPipe", "1f1b": "1F1B"}
MIB = float(1 << 20)
TARGET_FIT = 1.02  # measured peak <= budget + 2%
TARGET_TIME = 1.2  # x the same pipeline without checkpointing


def load(path):
    meta, rows = None, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta = rec
            else:
                rows.append(rec)
    return meta, rows


def summarize(rows):
    """config -> ms per round (the slower rank's median step), and per rank (stage) its figures over the rounds."""
    by = {}
    for r in rows:
        by.setdefault(r["config"], {}).setdefault(r["round"], {})[r["rank"]] = r
    out = {}
    for config, rounds in by.items():
        ranks = sorted({k for rr in rounds.values() for k in rr})
        stage = {}
        for k in ranks:
            recs = [rr[k] for rr in rounds.values() if k in rr]
            st = dict(peak=max(x["peak_max"] for x in recs), state=max(x["model_state"] for x in recs))
            if "bubble" in recs[0]:
                st["bubble"] = statistics.median(v for x in recs for v in x["bubble"])
                st["in_flight"] = max(v for x in recs for v in x["max_in_flight"])
                st["planned_in_flight"] = recs[0]["planned_in_flight"]
            if "budget_bytes" in recs[0]:
                # per round: measured peak over budget (the worst of the round's timed steps)
                st["fit"] = [x["peak_max"] / x["budget_bytes"] for x in recs]
                st["budget"] = max(x["budget_bytes"] for x in recs)
                st["predicted"] = max(x["predicted_peak_bytes"] for x in recs)
                st["changed"] = sorted({x["units_changed"] for x in recs})
                st["units"] = recs[0]["units"]
                st["replans"] = max(x["replans"] for x in recs)
            stage[k] = st
        ms = {rnd: max(statistics.median(x["ms"]) for x in rr.values()) for rnd, rr in rounds.items()}
        out[config] = dict(ms=ms, stages=[stage[k] for k in ranks])
    return out


def ratio(s, config, base):
    rs = [s[config]["ms"][r] / s[base]["ms"][r] for r in s[config]["ms"] if r in s[base]["ms"]]
    return statistics.median(rs), min(rs), max(rs)


def per_stage(s, config, fmt):
    return " / ".join(fmt(st) for st in s[config]["stages"])


def render(meta, rows):
    s = summarize(rows)
    m = meta["meta"]
    wall = f" The run took {meta['wall_s'] / 60:.1f} minutes." if "wall_s" in meta else ""
    size = ("Toy GPT (--quick: 4 blocks, d_model 64, T 64; a smoke run, not a measurement)" if "--quick" in m["args"]
            else "Reference GPT as a whole training step (8 blocks, d_model 512, 8 heads, T 512, vocabulary 256, "
            "embedding tied to the head)")
    lines = [run_line(m, [v for v in meta.get("load", []) if v >= 0]) + f" {size}, AdamW, global batch 4, 1 thread "
             f"per process; pipelines: {meta.get('stages', 2)} stages of equal blocks (Gloo), "
             f"{meta.get('microbatches', 4)} micro-batches."]
    nrounds = len(s["one"]["ms"]) if "one" in s else 0
    frac = meta.get("budget_fraction", 0.5)
    lines.append(f"{nrounds} rounds, the five configurations run one after another in each; step ms: median of the "
                 "rounds (each round: the slower rank's median over its timed steps). Figures per stage are "
                 "stage 0 / stage 1. Planned: each rank's step planned by auto_checkpoint over its blocks with a "
                 f"budget of {frac:g}x one process's peak in the same round." + wall)
    lines.append("")
    lines.append("| configuration | step ms | x one process (range) | x same schedule unplanned (range) "
                 "| peak per stage | x one's peak | model state per stage | bubble per stage "
                 "| micro-batches in flight per stage |")
    lines.append("|---|---:|---|---|---:|---:|---:|---:|---:|")
    one_peak = s["one"]["stages"][0]["peak"] if "one" in s else None
    for config in CONFIGS:
        if config not in s:
            continue
        c = s[config]
        step = statistics.median(c["ms"].values())
        vs_one = "1" if config == "one" else "%.3f (%.3f-%.3f)" % ratio(s, config, "one")
        base = config.split("+")[0]
        vs_base = "%.3f (%.3f-%.3f)" % ratio(s, config, base) if "+plan" in config and base in s else "-"
        peak = per_stage(s, config, lambda st: f"{st['peak'] / MIB:.1f}") + " MiB"
        vs_peak = per_stage(s, config, lambda st: f"{st['peak'] / one_peak:.3f}") if one_peak else "-"
        state = per_stage(s, config, lambda st: f"{st['state'] / MIB:.1f}") + " MiB"
        bubble = per_stage(s, config, lambda st: f"{100 * st['bubble']:.0f}%") if config != "one" else "-"
        flight = per_stage(s, config, lambda st: str(st["in_flight"])) if config != "one" else "-"
        lines.append(f"| {LABELS[config]} | {step:.0f} | {vs_one} | {vs_base} | {peak} | {vs_peak} | {state} | "
                     f"{bubble} | {flight} |")
    planned = [c for c in ["gpipe+plan", "1f1b+plan"] if c in s]
    if planned:
        lines.append("")
        lines.append("| planned pipeline | budget per rank | predicted peak per stage | measured peak per stage "
                     "| measured / budget (worst round) | units changed per stage |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for config in planned:
            c = s[config]
            budget = f"{max(st['budget'] for st in c['stages']) / MIB:.1f} MiB"
            pred = per_stage(s, config, lambda st: f"{st['predicted'] / MIB:.1f}") + " MiB"
            meas = per_stage(s, config, lambda st: f"{st['peak'] / MIB:.1f}") + " MiB"
            fit = per_stage(s, config, lambda st: f"{max(st['fit']):.3f}")
            changed = per_stage(s, config, lambda st: "-".join(map(str, st["changed"])) + f" of {st['units']}")
            lines.append(f"| {LABELS[config]} | {budget} | {pred} | {meas} | {fit} | {changed} |")
    lines.append("")
    parts = []
    for sched in ["gpipe", "1f1b"]:
        config = sched + "+plan"
        if config not in s or sched not in s:
            continue
        worst = max(max(st["fit"]) for st in s[config]["stages"])
        fits = worst <= TARGET_FIT
        med, lo, hi = ratio(s, config, sched)
        fast = med <= TARGET_TIME
        parts.append(f"{SCHEDULE_LABEL[sched]}: {'met' if fits and fast else 'missed'} (measured peak at most "
                     f"{worst:.3f}x the budget on every stage and round, {'fits' if fits else 'over'}; step time "
                     f"{med:.3f}x the unplanned {SCHEDULE_LABEL[sched]}, rounds {lo:.3f}-{hi:.3f})")
    if parts:
        lines.append(f"Target: with a per-rank budget of {frac:g}x one process's plain peak, the pipeline with planned "
                     "checkpointing fits on every stage (measured peak <= budget +2%) and its step time is within "
                     f"{TARGET_TIME:g}x of the same pipeline without checkpointing. " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def fragments(quick=False):
    path = os.path.join(RESULTS, f"pipeline{'-quick' if quick else ''}.json")
    if not os.path.exists(path):
        return {}
    meta, rows = load(path)
    return {"pipeline-reference": render(meta, rows)}


if __name__ == "__main__":
    print(fragments("--quick" in sys.argv).get("pipeline-reference", "no bench/results/pipeline.json"))
