"""Renders the whole-step planner's results: auto.json and auto-resnet.json (bench/auto/remat_auto, --model gpt
and resnet, JSON lines), auto-py.json (bench/py/auto_py.py: PyTorch's own strategies on the same GPT step) and
step_solve.json (bench/plan/step_solve.cpp, JSON lines).

Fragments: `auto-frontier` (every strategy's step time and peak against plain, auto's budgets,
predictions and plans; PyTorch's eager strategies and torch.compile at each activation_memory_budget),
`auto-in-backward` and `auto-in-backward-resnet` (the strategies with the optimizer step in backward,
remat::StepInBackward and PyTorch's post-accumulate-grad hooks, beside their counterparts with the step after
backward, all of one run; the targets and the chart's frontier leave them out: they change what lives between
steps; from auto.json and auto-py.json (auto-resnet.json) when they hold such strategies, else from a run kept
apart in auto-ib.json and auto-py-ib.json (auto-resnet-ib.json), one that is not to replace the others' figures),
`auto-levers` and `auto-levers-resnet` (auto with every lever, auto-levers.json and auto-resnet-levers.json from
bench/auto/remat_auto_levers, with its targets), `auto-targets` (the targets, met or missed, computed from those
tables), `auto-compile` (auto's points
against torch.compile's at each budget fraction), `auto-frontier-resnet` and `auto-targets-resnet` (the same
for the ResNet, remat only) and `auto-solver` (solve time against the number of units).
--quick reads the -quick files.
Leaves out: measuring.
"""
import json
import os
import statistics
import sys

from common import RESULTS

NOISE = 0.02  # the "dominates" target's allowance for noise, as the target states it


def _lines(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mib(b):
    return f"{b / 2**20:.1f} MiB"


def _ib(r):
    """Whether the strategy steps the optimizer inside backward (records before it have no such field)."""
    return r.get("in_backward", False)


def _ratio(r):
    t = r["time_ratio"]
    return f"{t['median']:.3f} [{t['min']:.3f}-{t['max']:.3f}]"


def frontier(recs, py=None):
    meta = next(r for r in recs if r["kind"] == "meta")
    prof = next(r for r in recs if r["kind"] == "profile")
    prof_ib = next((r for r in recs if r["kind"] == "profile_ib"), None)
    strat = [r for r in recs if r["kind"] == "strategy"]
    s = meta["size"]
    if meta.get("model", "gpt") == "gpt":
        what = (f"GPT whole step: d_model {s['d_model']}, {s['heads']} heads, {s['blocks']} blocks, T {s['seq_len']}, "
                f"batch {s['batch']}, vocabulary {s['vocab']}, AdamW")
    else:
        what = (f"ResNet-{s['depth']} whole step: width {s['width']}, {s['image']}x{s['image']} images, batch "
                f"{s['batch']}, {s['classes']} classes, SGD with momentum")
    off = meta.get("offload")
    if off:
        what += (f"; offload to {off['target']} files on this machine's disk with "
                 f"{_mib(off['max_inflight_bytes'])} in flight")
    load = meta.get("load_1min")
    if load:
        what += f"; the machine's 1-minute load average {min(load):.1f}-{max(load):.1f} during the rounds"
    out = [f"{what}; 1 intra-op thread; {meta['rounds']} rounds, "
           f"strategies interleaved step by step; time ratios are medians of per-round ratios to plain "
           f"[min-max]; peaks are the step's tracked CPU bytes, everything counted (parameters, gradients, "
           f"{'AdamW' if meta['model'] == 'gpt' else 'momentum'} state, activations). Run {meta['meta']['date_utc']}, commit {meta['meta']['git_commit'][:10]}. "
           f"Profile: {prof['profile_s']:.0f} s for the warm-up and the profiled step, {prof['units']} units.",
           "",
           "| strategy | step time x plain | peak | x plain | budget | predicted peak | predicted time x plain |",
           "|---|---|---|---|---|---|---|"]
    plain_ms = next(r for r in strat if r["name"] == "plain")["ms"]
    plain_med = sorted(plain_ms)[len(plain_ms) // 2]
    for r in strat:
        budget = _mib(r["budget"]) if "budget" in r else "-"
        pred = _mib(r["predicted_peak"]) if "budget" in r else "-"
        own = prof_ib if _ib(r) and prof_ib else prof  # auto+ib: its own planner's plain step
        pt = f"{r['predicted_ms'] / own.get('plain_ms', own['profiled_ms']):.3f}" if "budget" in r else "-"
        out.append(f"| {r['label']} | {_ratio(r)} | {_mib(r['peak'])} | {r['peak_ratio']:.3f} | {budget} | {pred} "
                   f"| {pt} |")
    ib = [r for r in strat if _ib(r)]
    if ib and "covers" in ib[0]:
        out += ["", f"With the optimizer step in backward, the peak covers {ib[0]['covers']}"
                    + "".join(f"; with the state on disk, {r['covers']}" for r in ib if r.get("optimizer_state") == "disk")
                    + ". The auto row in backward has its own profile and budget (table \"optimizer step in backward\")."]
    if py:
        pmeta = next(r for r in py if r["kind"] == "meta")
        warm = pmeta["meta"].get("settings", {}).get("warmup_rounds")
        warm = f" after {warm} untimed" if warm else ""
        out += ["", f"PyTorch {pmeta['meta']['torch']} on the same step (bench/py/auto_py.py; run "
                    f"{pmeta['meta']['date_utc']}, {pmeta['rounds']} rounds{warm}, interleaved), each strategy "
                    f"relative to its own plain step; the peak is the preload counter's above the step's start plus "
                    f"the model's parameters, gradients and AdamW state:", "",
                "| strategy | step time x plain | peak | x plain |", "|---|---|---|---|"]
        for r in py:
            if r["kind"] == "strategy":
                out.append(f"| {r['label']} | {_ratio(r)} | {_mib(r['peak'])} | {r['peak_ratio']:.3f} |")
        out += compiled(py)
    out.append("")
    out.append("The plans (option per unit):")
    out.append("")
    for r in strat:
        if "plan" in r:
            out.append(f"- {r['label']}: {r['plan']}")
    del plain_med
    return "\n".join(out) + "\n"


def _compiled(py):
    """auto_py.py's torch.compile records, budget 1.0 (its plain step) first."""
    return sorted((r for r in py or [] if r["kind"] == "compile"), key=lambda r: (r["budget"] != 1.0, r["budget"]))


def compiled(py):
    """The torch.compile table of auto-frontier (lines; none without compile records)."""
    comp = _compiled(py)
    if not comp:
        return []
    base = comp[0]
    e = base["eager_time_ratio"]
    out = ["", "torch.compile (inductor, default settings) of the forward and loss, embedding to cross-entropy, as one "
               "graph, at each `torch._functorch.config.activation_memory_budget`; backward and AdamW as above. Each "
               "budget compiles its own model from an empty cache; its compile time is its first step's time less "
               "its median later step. The budgets run interleaved step by step with the compiled plain step "
               "(budget 1) and the eager plain step, each relative to the compiled plain step of the same rounds; "
               "peaks are measured as above:", "",
           "| activation_memory_budget | step time x compiled plain | peak | x compiled plain | step time x eager "
           "plain | peak x eager plain | compile s |",
           "|---|---|---|---|---|---|---|"]
    for r in comp:
        et, ep = _eager(r, base)
        out.append(f"| {r['budget']:g} | {_ratio(r)} | {_mib(r['peak'])} | {r['peak_ratio']:.3f} | "
                   f"{_ratio(dict(time_ratio=et))} | {ep:.3f} | {r['compile_s']:.0f} |")
    out += ["", f"The eager plain step of these rounds peaks at {_mib(base['eager_peak'])}; the compiled plain "
                f"step takes {e['median']:.3f} of its time."]
    return out


def _eager(c, base):
    """A torch.compile record against the eager plain step of the same rounds: (time ratio dict, peak ratio)."""
    ratio = [x / y for x, y in zip(c["ms"], base["eager_ms"])]
    t = dict(median=statistics.median(ratio), min=min(ratio), max=max(ratio))
    return t, c["peak"] / base["eager_peak"]


def compare_compile(recs, py):
    """auto's point at each of torch.compile's budget fractions, and auto's fastest point as lean as each of
    torch.compile's: torch.compile against the eager plain step of its rounds, remat against its own plain step
    (both eager, both the same model's bytes)."""
    prof = next(r for r in recs if r["kind"] == "profile")
    autos = [r for r in recs if r["kind"] == "strategy" and r["name"].startswith("auto") and not _ib(r)]
    at = {round(r["budget"] / prof["profiled_peak"], 3): r for r in autos if r["name"].startswith("auto@")}
    comp = _compiled(py)
    base = comp[0]
    rows = ["| budget fraction | torch.compile: peak x eager plain | time x eager plain | compile s | remat auto at the "
            "fraction: peak x plain | time x plain | auto / torch.compile: peak | time | remat auto's fastest as lean "
            "as torch.compile: time x plain (at peak x plain) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(comp, key=lambda r: r["budget"]):
        et, ep = _eager(c, base)
        row = f"| {c['budget']:g} | {ep:.3f} | {_ratio(dict(time_ratio=et))} | {c['compile_s']:.0f} | "
        f = round(c["budget"], 3)
        a = next((r for k, r in sorted(at.items()) if abs(k - f) <= 0.001), None)
        if a:
            row += (f"{a['peak_ratio']:.3f} | {_ratio(a)} | {a['peak_ratio'] / ep:.3f} | "
                    f"{a['time_ratio']['median'] / et['median']:.3f} | ")
        else:
            row += "- | - | - | - | "
        fit = [r for r in autos if r["peak_ratio"] <= ep]
        if fit:
            best = min(fit, key=lambda r: r["time_ratio"]["median"])
            row += f"{best['time_ratio']['median']:.3f} ({best['peak_ratio']:.3f}) |"
        else:
            row += "none as lean |"
        rows.append(row)
    return "\n".join(rows) + "\n"


def targets(recs, py=None):
    strat = [r for r in recs if r["kind"] == "strategy" and not _ib(r)]
    py = [r for r in py if not _ib(r)] if py else py
    prof = next(r for r in recs if r["kind"] == "profile")
    autos = [r for r in strat if r["name"].startswith("auto")]
    hand = [r for r in strat if not r["name"].startswith("auto") and r["name"] != "plain"]
    remat_hand = list(hand)
    compiled = []
    if py:  # PyTorch's points, by their ratios to their own plain step
        hand += [dict(r, name="PyTorch " + r["name"]) for r in py if r["kind"] == "strategy" and r["name"] != "plain"]
        comp = _compiled(py)  # against the eager plain step of their rounds: the same bytes as remat's plain
        compiled = [dict(r, name=f"torch.compile {r['budget']:g}", time_ratio=t, peak_ratio=p)
                    for r in comp[1:] for t, p in [_eager(r, comp[0])]]
    rows = ["| target | figure | |", "|---|---|---|"]

    def beaten_by(points):
        # The points with less or equal memory than auto's fastest as lean and less time (2% noise).
        out = []
        for h in points:
            fit = [a for a in autos if a["peak_ratio"] <= h["peak_ratio"]]
            if not fit:
                out.append(f"{h['name']} (no auto point as lean)")
                continue
            best = min(fit, key=lambda a: a["time_ratio"]["median"])
            if best["time_ratio"]["median"] > h["time_ratio"]["median"] * (1 + NOISE):
                out.append(f"{h['name']} ({h['time_ratio']['median']:.3f} vs auto's "
                           f"{best['time_ratio']['median']:.3f})")
        return out

    # 1. No hand-placed point has less or equal memory and less time than auto's frontier.
    dominated = beaten_by(hand)
    rows.append("| auto's frontier dominates every hand-placed point, remat's"
                + (" and PyTorch's (eager)" if py else "")
                + " (2% noise; by ratios to each library's eager plain step) | "
                + ("none faster at equal or less memory" if not dominated else "beaten by " + "; ".join(dominated))
                + f" | {'met' if not dominated else 'missed'} |")
    # Reported beside it: torch.compile's partitioner at each activation_memory_budget (compiled, not
    # hand-placed; its own speed-up of the plain step included).
    if compiled:
        behind = beaten_by(compiled)
        rows.append(f"| reported: auto's eager frontier against torch.compile at each budget (same rule) | "
                    f"as fast or faster at {len(compiled) - len(behind)} of {len(compiled)} budgets"
                    + ("" if not behind else "; behind " + "; ".join(behind)) + " | - |")

    # 2. At 0.5 of plain's peak, auto <= 1.03x plain time; at 0.25, <= 1.08x (offload allowed).
    # Where missed: what every plan holds (the bytes between steps) and where the leanest plan peaks.
    plain_peak = next(r for r in strat if r["name"] == "plain")["peak"]
    floor = ""
    if "state_bytes" in prof:
        floor = (f"; every plan holds {prof['state_bytes'] / plain_peak:.3f} of plain throughout (parameters, "
                 f"gradients, optimizer state), and the leanest plan peaks {prof['leanest_where']}")
    for frac, limit in ((0.5, 1.03), (0.25, 1.08)):
        at = [a for a in autos if a["peak_ratio"] <= frac]
        if at:
            best = min(at, key=lambda a: a["time_ratio"]["median"])
            met = best["time_ratio"]["median"] <= limit
            rows.append(f"| at {frac} of plain's peak, auto <= {limit:.2f}x plain time | "
                        f"{best['time_ratio']['median']:.3f}x at {best['peak_ratio']:.3f}{'' if met else floor} | "
                        f"{'met' if met else 'missed'} |")
        else:
            lean = min(a["peak_ratio"] for a in autos)
            rows.append(f"| at {frac} of plain's peak, auto <= {limit:.2f}x plain time | the leanest plan is "
                        f"{lean:.3f} of plain{floor} | missed (not reachable by any option of the menu) |")

    # 2b. Somewhere auto is >= 5% faster than remat's best hand-placed point of equal memory: for each
    # hand-placed point, auto's fastest point as lean.
    gains = []
    for h in remat_hand:
        fit = [a for a in autos if a["peak_ratio"] <= h["peak_ratio"]]
        if fit:
            a = min(fit, key=lambda x: x["time_ratio"]["median"])
            gains.append((h["time_ratio"]["median"] / a["time_ratio"]["median"] - 1, a, h))
    if gains:
        g, a, h = max(gains, key=lambda x: x[0])
        rows.append(f"| somewhere auto is >= 5% faster than remat's best hand-placed point of equal memory | "
                    f"{g * 100:+.1f}%: {a['label']} ({a['time_ratio']['median']:.3f}x at {a['peak_ratio']:.3f}) "
                    f"against {h['label']} ({h['time_ratio']['median']:.3f}x at {h['peak_ratio']:.3f}) | "
                    f"{'met' if g >= 0.05 else 'missed'} |")

    # 2c. Disk offload of every block with its in-flight bytes planned (auto with keep and offload only, at
    # the hand-placed offload's peak) <= 1.05x plain time.
    ao = next((r for r in strat if r["name"] == "auto-offload@every"), None) or \
        next((r for r in strat if r["name"] == "auto-offload=offload"), None)
    hand_off = next((r for r in strat if r["name"] == "offload"), None)
    if ao and hand_off:
        units = [u.split(": ", 1)[1] for u in ao["plan"].split(", ") if ": " in u]
        sent = sum(1 for o in units if o.startswith("offload"))
        every = sent == len(units)
        t = ao["time_ratio"]
        verdict = ("not shown (the plan keeps some blocks)" if not every else "met" if t["max"] <= 1.05 else
                   "missed" if t["min"] > 1.05 else "not resolved (the range straddles the target; median "
                   + ("under" if t["median"] <= 1.05 else "over") + " it)")
        rows.append(f"| disk offload of every block, its bytes in flight planned, <= 1.05x plain time | "
                    f"{ao['time_ratio']['median']:.3f}x [{ao['time_ratio']['min']:.3f}-{ao['time_ratio']['max']:.3f}] "
                    f"at {ao['peak_ratio']:.3f} of plain's peak, {sent} of {len(units)} blocks to disk with "
                    f"{_mib(ao.get('inflight', 0))} in flight ({ao['label']}); the same offload with a fixed "
                    f"{_mib(next(r for r in recs if r['kind'] == 'meta')['offload']['max_inflight_bytes'])}: "
                    f"{hand_off['time_ratio']['median']:.3f}x at {hand_off['peak_ratio']:.3f} | "
                    f"{verdict} |")

    # 3. Measured peak <= budget on every point; predicted peak within 3%, time within 10%.
    over = [a for a in autos if a["peak"] > 1.01 * a["budget"]]
    rows.append(f"| measured peak <= budget (+1% for allocator rounding) on every auto point | "
                f"{max(a['peak'] / a['budget'] for a in autos):.4f} of the budget at most | "
                f"{'met' if not over else 'missed'} |")
    # A plan that offloads to disk predicts its peak up to the bytes its
    # stores may hold in flight (the disk's pace decides): measured against
    # that interval, and the model alone said too.
    def off(a):
        lo, hi = a["predicted_peak"], a["predicted_peak"] + a.get("inflight", 0)
        return max(lo - a["peak"], a["peak"] - hi, 0) / a["peak"]
    perr = max(off(a) for a in autos)
    model_err = max(abs(a["predicted_peak"] / a["peak"] - 1) for a in autos)
    flying = max((a.get("inflight", 0) for a in autos), default=0)
    within = (f"{perr * 100:.1f}% at most outside [prediction, prediction + bytes in flight, "
              f"{flying / 2**20:.0f} MiB at most]; the prediction alone: {model_err * 100:.1f}%"
              if flying else f"{perr * 100:.1f}% at most")
    rows.append(f"| predicted peak within 3% of measured (plans that offload to disk: of the interval up to their "
                f"bytes in flight) | {within} | {'met' if perr <= 0.03 else 'missed'} |")
    plain_ms = sorted(next(r for r in strat if r["name"] == "plain")["ms"])
    terr = max(abs(a["predicted_ms"] / (a["time_ratio"]["median"] * plain_ms[len(plain_ms) // 2]) - 1)
               for a in autos)
    rows.append(f"| predicted time within 10% of measured | {terr * 100:.1f}% at most | "
                f"{'met' if terr <= 0.10 else 'missed'} |")
    return "\n".join(rows) + "\n"


IB_PAIRS = [("plain", "plain+ib"), ("block", "block+ib"), ("block", "block+ib+disk"), ("auto@0", "auto+ib@leanest")]


def in_backward(recs, py=None):
    """The strategies with the optimizer step in backward beside their counterparts stepping after backward: the
    whole step's peak (everything alive counted), against plain, and the step time against plain (median of
    per-round ratios [min-max]); PyTorch's against its own plain step."""
    meta = next(r for r in recs if r["kind"] == "meta")
    prof = next(r for r in recs if r["kind"] == "profile")
    prof_ib = next((r for r in recs if r["kind"] == "profile_ib"), None)
    by = {r["name"]: r for r in recs if r["kind"] == "strategy"}
    state = "AdamW" if meta.get("model", "gpt") == "gpt" else "momentum"
    load = meta.get("load_1min")
    head = (f"Run {meta['meta']['date_utc']}, commit {meta['meta']['git_commit'][:10]}, {meta['rounds']} rounds"
            + (f", the machine's 1-minute load average {min(load):.1f}-{max(load):.1f} during the rounds" if load
               else "") + "; time ratios: medians of per-round ratios to plain [min-max].")
    rows = [head, "","| strategy | optimizer step | optimizer state between updates | peak | x plain | step time x plain | "
            "state in the store after the step | states read when needed per step |",
            "|---|---|---|---|---|---|---|---|"]
    seen = []
    for pair in IB_PAIRS:
        for name in pair:
            r = by.get(name)
            if r is None or name in seen:
                continue
            seen.append(name)
            label = "auto at its leanest" if name == "auto@0" else r["label"]
            where = ("-" if not _ib(r) else "disk store" if r.get("optimizer_state") == "disk" else "memory")
            stored = (_mib(statistics.median(r["state_offloaded"])) if r.get("state_offloaded") and
                      max(r["state_offloaded"]) > 0 else "-")
            misses = (f"{statistics.median(r['state_misses']):g}" if r.get("optimizer_state") == "disk" and
                      "state_misses" in r else "-")
            rows.append(f"| {label} | {'in backward' if _ib(r) else 'after backward'} | {where} | {_mib(r['peak'])} | "
                        f"{r['peak_ratio']:.3f} | {_ratio(r)} | {stored} | {misses} |")
    if py:
        pmeta = next(r for r in py if r["kind"] == "meta")
        pby = {r["name"]: r for r in py if r["kind"] == "strategy"}
        for name in ("plain", "plain+ib", "block", "block+ib"):
            r = pby.get(name)
            if r is None:
                continue
            rows.append(f"| {r['label']} | "
                        f"{'in backward' if _ib(r) else 'after backward'} | {'memory' if _ib(r) else '-'} | "
                        f"{_mib(r['peak'])} | {r['peak_ratio']:.3f} | {_ratio(r)} | - | - |")
    if py:
        rows.append("")
        rows.append(f"PyTorch {pmeta['meta']['torch']}'s rows: bench/py/auto_py.py (its run "
                    f"{pmeta['meta']['date_utc']}), each against its own plain step; the peak is the preload "
                    f"counter's above the step's start plus the parameters and AdamW state (and the gradients, "
                    f"stepping after backward).")
    plain = by["plain"]
    notes = [f"Peaks: the step's tracked CPU bytes with everything alive counted: after backward, {plain['covers']}"
             if "covers" in plain else "Peaks: the step's tracked CPU bytes with everything alive counted"]
    for name in ("plain+ib", "block+ib+disk"):
        if name in by and "covers" in by[name]:
            notes.append(f"{name}: {by[name]['covers']}")
    text = "; ".join(notes) + "."
    text += (f" Between steps the tracked bytes are {_mib(prof['state_bytes'])} with the step after backward "
             f"(parameters, gradients, {state} state)")
    if prof_ib:
        text += (f" and {_mib(prof_ib['state_bytes'])} in backward (parameters, {state} state); auto's own profile "
                 f"with the step in backward peaked at {_mib(prof_ib['profiled_peak'])} (plain), its leanest plan "
                 f"{_mib(prof_ib['leanest_peak'])}, predicted to peak {prof_ib['leanest_where']}")
    off = meta.get("state_offload")
    if off:
        text += (f". The disk store: {off['target']} files with {_mib(off['max_inflight_bytes'])} in flight, "
                 f"{off['state_prefetch']} parameters' states read ahead")
    text += ". Every strategy of the run interleaved step by step."
    return "\n".join(rows) + "\n\n" + text + "\n"


def levers(recs, hand=None):
    """auto with every lever (bench/auto/remat_auto_levers: the optimizer step in backward, its state kept or in a
    disk store as the plan says, the loss head's chunk count) at budgets from its leanest plan to its profiled peak,
    each step paired with a plain step of the same round; then the targets of the leanest point and of the 0.5x and
    0.25x budgets, met or missed, and how the points compare with `hand` (remat_auto's records: every hand-placed
    strategy's peak and time against its own plain)."""
    meta = next(r for r in recs if r["kind"] == "meta")
    prof = next(r for r in recs if r["kind"] == "profile")
    strat = [r for r in recs if r["kind"] == "strategy"]
    plain = next(r for r in strat if r["name"] == "plain")
    gpt = meta.get("model", "gpt") == "gpt"
    s = meta["size"]
    what = (f"GPT whole step: d_model {s['d_model']}, {s['heads']} heads, {s['blocks']} blocks, T {s['seq_len']}, "
            f"batch {s['batch']}, vocabulary {s['vocab']}, AdamW" if gpt else
            f"ResNet-{s['depth']} whole step: width {s['width']}, {s['image']}x{s['image']} images, batch "
            f"{s['batch']}, {s['classes']} classes, SGD with momentum")
    load = meta.get("load_1min")
    rows = [f"{what}. Run {meta['meta']['date_utc']}, commit {meta['meta']['git_commit'][:10]}, {meta['rounds']} "
            f"rounds" + (f", the machine's 1-minute load average {min(load):.1f}-{max(load):.1f}" if load else "")
            + "; time ratios: medians of per-round ratios to plain [min-max].", "",
            "| strategy | budget | predicted peak | measured peak | x plain | step time x plain | predicted time x plain | "
            "state in the store | backward waited on it | room in flight | units not at keep | loss head |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain_median = statistics.median(plain["ms"])
    for r in strat:
        if r["name"] == "plain":
            rows.append(f"| plain (step after backward) | - | - | {_mib(r['peak'])} | 1.000 | {_ratio(r)} | - | - | - | - | - | - |")
            continue
        pt = f"{r['predicted_ms'] / plain_median:.3f}" if "predicted_ms" in r else "-"
        stored = _mib(statistics.median(r["state_in_store"])) if r.get("state_in_store") else "-"
        waited = f"{statistics.median(r['state_wait_ms']):.0f} ms" if r.get("state_wait_ms") else "-"
        inflight = _mib(r["inflight"]) if r.get("inflight") else "-"
        rows.append(f"| {r['label']} | {_mib(r['budget'])} | {_mib(r['predicted_peak'])} | {_mib(r['peak'])} | "
                    f"{r['peak_ratio']:.3f} | {_ratio(r)} | {pt} | {stored} | {waited} | {inflight} | {r['units'] - r['units_keep']} of "
                    f"{r['units']} | {r['loss_option'] or '-'} |")
    autos = [r for r in strat if r["name"] != "plain"]
    leanest = min(autos, key=lambda r: r["peak"])
    over = [r for r in autos if r["peak"] > 1.01 * r["budget"]]
    text = [f"Peaks: one model's whole step, everything alive counted (plain: {plain['covers']}; auto: "
            f"{autos[0]['covers']}). auto's profile (the step in backward, every unit plain) peaked at "
            f"{_mib(prof['profiled_peak'])}; its leanest plan is predicted at {_mib(prof['leanest_peak'])}, "
            f"{prof['leanest_where']}. Chunk counts offered to the loss: {meta.get('chunk_counts')}; the disk "
            f"store: {_mib(meta['offload']['max_inflight_bytes'])} in flight as given"
            + (", more or less where the plan chose it (\"room in flight\": the margin the plan keeps above its "
               "prediction for what its disk stores may hold in flight while the disk is behind: activations being "
               "written or read ahead, and, in plans from after the optimizer state's writes joined it, the states "
               "being written; '-' when there are none)." if any("inflight" in r for r in autos) else ".")
            + (" \"Backward waited on it\": the median over the rounds of what a step's backward waited on the "
               "state store (reads not back in time, the store at its cap, the writes finished as backward ends; "
               "StepInBackwardStats::state_wait_ms); the plan prices the store by that or, if more, by what the step "
               "took over its plan's prediction without the store (the store's threads share the disk and the cores)."
               if any(r.get("state_wait_ms") for r in autos) else "")]
    tgt = []
    lean_target = 0.22 if gpt else 0.35
    tgt.append(f"- the leanest plan <= {lean_target}x plain's peak: **{'met' if leanest['peak_ratio'] <= lean_target else 'missed'}** "
               f"({leanest['peak_ratio']:.3f}x at {leanest['time_ratio']['median']:.3f}x time)")
    if gpt:
        for frac, limit in ((0.5, 1.03), (0.25, 1.10)):
            fits = [r for r in autos if r["peak_ratio"] <= frac]
            best = min(fits, key=lambda r: r["time_ratio"]["median"]) if fits else None
            if best is None:
                tgt.append(f"- at {frac}x plain's peak, <= {limit}x plain's time: **missed** (no point at or under {frac}x)")
            else:
                t = best["time_ratio"]
                verdict = ("met" if t["max"] <= limit else "missed" if t["min"] > limit else
                           "not resolved (the range straddles the target)")
                tgt.append(f"- at {frac}x plain's peak, <= {limit}x plain's time: **{verdict}** ({best['label']}: "
                           f"{best['peak_ratio']:.3f}x peak, {_ratio(best)} time)")
    tgt.append(f"- measured peak <= budget (+1%) on every point: **{'met' if not over else 'missed'}**"
               + (f" ({', '.join(r['name'] for r in over)} over)" if over else ""))
    # As the frontier's rule: a step peaks between the prediction and the prediction plus the room in flight,
    # which the disk's pace decides; each point against that interval.
    def outside(r):
        lo, hi = r["predicted_peak"], r["predicted_peak"] + r.get("inflight", 0)
        return max(lo - r["peak"], r["peak"] - hi, 0) / r["peak"]
    off = [r for r in autos if outside(r) > 0.03]
    worst = max(autos, key=outside)
    tgt.append(f"- predicted peak within 3% of the measured one on every point (of the interval from the prediction "
               f"to the prediction plus the room in flight): **{'met' if not off else 'missed'}** ("
               + (", ".join(f"{r['name']}: predicted {_mib(r['predicted_peak'])} + {_mib(r.get('inflight', 0))} in "
                            f"flight, measured {_mib(r['peak'])}" for r in off) if off else
                  f"{outside(worst) * 100:.1f}% at most outside it; the prediction alone: "
                  f"{max(abs(r['predicted_peak'] / r['peak'] - 1) for r in autos) * 100:.1f}% at most")
               + ")")
    # The prediction against the median step of its point (its median ratio times plain's median step).
    if all("predicted_ms" in r for r in autos):
        def terr(r):
            return r["predicted_ms"] / (r["time_ratio"]["median"] * plain_median) - 1
        worst_t = max(autos, key=lambda r: abs(terr(r)))
        tgt.append(f"- predicted time within 10% of the measured one on every point: "
                   f"**{'met' if abs(terr(worst_t)) <= 0.10 else 'missed'}** ({abs(terr(worst_t)) * 100:.1f}% at most: "
                   f"{worst_t['label']}, predicted {worst_t['predicted_ms']:.0f} ms, measured "
                   f"{worst_t['time_ratio']['median'] * plain_median:.0f} ms)")
    if hand:
        hs = []
        for lib, recs_ in hand:
            for r in recs_ or []:
                if r["kind"] == "strategy" and not r["name"].startswith("auto") and r["name"] != "plain":
                    hs.append(dict(r, name=f"{lib} {r['name']}"))
        beaten = []
        for h in hs:
            dom = [a for a in autos if a["peak_ratio"] <= h["peak_ratio"] * (1 + NOISE)
                   and a["time_ratio"]["median"] <= h["time_ratio"]["median"] * (1 + NOISE)]
            if dom:
                beaten.append(h["name"])
        tgt.append(f"- dominates every hand-placed point of both libraries (remat_auto's and auto_py.py's runs, "
                   f"with and without the step in backward; peak and median time ratio within {NOISE:.0%}, each "
                   f"point against its own run's plain, so the times compare across runs): "
                   f"**{'met' if len(beaten) == len(hs) else 'missed'}** ({len(beaten)} of {len(hs)} dominated"
                   + (f"; not: {', '.join(h['name'] for h in hs if h['name'] not in beaten)}" if len(beaten) < len(hs)
                      else "") + ")")
    return "\n".join(rows) + "\n\n" + " ".join(text) + "\n\nTargets:\n\n" + "\n".join(tgt) + "\n"


SHAPES = {"chain": "a chain of blocks", "paired": "a chain of blocks, each sharing its input with the one before",
          "nested": "blocks with attention and MLP units inside",
          "twice": "a chain of blocks run for two micro-batches, one after the other (every unit called twice)",
          "both": "a chain of blocks run on two inputs before one backward (every unit called twice)"}


def solver(recs):
    solves = [r for r in recs if r["kind"] == "solve"]
    by = {}
    for r in solves:
        by.setdefault((r.get("shape", "chain"), r["units"]), []).append(r)
    rows = ["| step | units | slowest solve over 5 budgets | leanest-peak search | solvers | every solve optimal |",
            "|---|---|---|---|---|---|"]
    for shape, u in sorted(by, key=lambda k: (list(SHAPES).index(k[0]), k[1])):
        rs = by[(shape, u)]
        used = ", ".join(sorted({r["solver"] for r in rs if "solver" in r})) or "-"
        stopped = [r for r in rs if not r["optimal"]]
        if not stopped:
            optimal = "yes"
        elif any(r.get("relative_gap", 0) < 0 for r in stopped):  # -1: no bound (each unit's leanest option)
            optimal = f"no: {len(stopped)} of {len(rs)} stopped at the time limit, gap not known at some"
        else:
            optimal = (f"no: {len(stopped)} of {len(rs)} stopped at the time limit, gap "
                       f"{max(r['relative_gap'] for r in stopped) * 100:.2f}% at most")
        lean = "" if rs[0].get("leanest_optimal", True) else " (least found, not proven)"
        rows.append(f"| {SHAPES[shape]} | {u} | {max(r['solve_ms'] for r in rs):.1f} ms | {rs[0]['leanest_ms']:.1f} ms{lean} | "
                    f"{used} | {optimal} |")
    return "\n".join(rows) + "\n"



def _place_labels(ax, fig, items, avoid):
    """Puts each (x, y, text, color) label next to its point where it overlaps no label placed before, no
    point (avoid: display-space boxes) and stays inside the axes: candidate offsets in rings around the
    point, nearest first; a label set off farther than its first ring gets a leader line."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    placed = list(avoid)
    dirs = [(1, 0.3), (1, -1.2), (-1, 0.3), (-1, -1.2), (0, 1), (0, -1), (1, 1), (-1, 1), (1, -2), (-1, -2)]
    for x, y, text, color in items:
        best = None
        for ring, dist in enumerate((5, 12, 22, 34, 48, 64)):
            for dx, dy in dirs:
                ann = ax.annotate(text, (x, y), xytext=(dx * dist, dy * dist), textcoords="offset points",
                                  fontsize=7, color=color, ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                  va="center")
                bb = ann.get_window_extent(renderer).padded(1.5)
                inside = box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1
                if inside and not any(bb.overlaps(o) for o in placed):
                    best = (ann, bb, ring)
                    break
                ann.remove()
            if best:
                break
        if best is None:  # nowhere free: the nearest spot, flagged in the output for a look
            ann = ax.annotate(text, (x, y), xytext=(5, 2), textcoords="offset points", fontsize=7, color=color)
            best = (ann, ann.get_window_extent(renderer), 0)
            print(f"auto frontier chart: no free spot for the label '{text}'")
        ann, bb, ring = best
        if ring > 1:
            ann.arrow_patch = None
            ann.remove()
            ann = ax.annotate(text, (x, y), xytext=ann.get_position(), textcoords="offset points", fontsize=7,
                              color=color, ha=ann.get_ha(), va="center",
                              arrowprops=dict(arrowstyle="-", color=color, lw=0.5, alpha=0.6, shrinkA=0, shrinkB=3))
        placed.append(bb)


def chart(recs, py, path):
    """docs/img/auto-frontier.png: the whole training step, step time against peak, both relative to the
    plain step: remat auto's frontier (one point per budget), every hand-placed strategy of remat and of
    PyTorch (eager), and torch.compile at each activation_memory_budget (against the eager plain step of its
    rounds). Labels are placed where they overlap nothing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta = next(r for r in recs if r["kind"] == "meta")
    strat = [r for r in recs if r["kind"] == "strategy" and not _ib(r)]
    ib = [r for r in recs if r["kind"] == "strategy" and _ib(r)]
    autos = [r for r in strat if r["name"].startswith("auto")]
    hand = [r for r in strat if not r["name"].startswith("auto") and r["name"] != "plain"]
    t = lambda r: r["time_ratio"]["median"]  # noqa: E731
    fig, ax = plt.subplots(figsize=(9.5, 6.2))
    pts = []  # every marker, for the labels to avoid
    front, best = [], float("inf")  # auto's frontier: the points no other auto point beats on both
    for r in sorted(autos, key=lambda r: (r["peak_ratio"], t(r))):
        if t(r) < best:
            front.append(r)
            best = t(r)
    ax.plot([t(r) for r in front], [r["peak_ratio"] for r in front], "-", color="tab:blue", lw=1.6, zorder=2)
    ax.scatter([t(r) for r in autos], [r["peak_ratio"] for r in autos], s=36, color="tab:blue", zorder=3,
               label="remat auto: the whole-step plan at each budget (its frontier joined)")
    pts += [(t(r), r["peak_ratio"]) for r in autos]
    ax.scatter([t(r) for r in hand], [r["peak_ratio"] for r in hand], s=46, marker="D", color="tab:green",
               edgecolor="black", linewidth=0.5, zorder=3, label="remat, placed by hand")
    pts += [(t(r), r["peak_ratio"]) for r in hand]
    labels = [(t(r), r["peak_ratio"], r["label"], "darkgreen") for r in hand]
    if py:
        ib += [dict(r, short=f"PyTorch {r['name']}") for r in py if r["kind"] == "strategy" and _ib(r)]
    if ib:
        ax.scatter([t(r) for r in ib], [r["peak_ratio"] for r in ib], s=46, marker="P", color="tab:purple",
                   edgecolor="black", linewidth=0.5, zorder=3,
                   label="optimizer step in backward (remat and PyTorch; not on auto's frontier)")
        pts += [(t(r), r["peak_ratio"]) for r in ib]
        labels += [(t(r), r["peak_ratio"], r.get("short", r["name"]), "indigo") for r in ib]
    if py:
        eager = [r for r in py if r["kind"] == "strategy" and r["name"] != "plain" and not _ib(r)]
        ax.scatter([t(r) for r in eager], [r["peak_ratio"] for r in eager], s=46, marker="s", color="tab:orange",
                   edgecolor="black", linewidth=0.5, zorder=3, label="PyTorch eager, placed by hand")
        pts += [(t(r), r["peak_ratio"]) for r in eager]
        labels += [(t(r), r["peak_ratio"], r["label"], "saddlebrown") for r in eager]
        comp = _compiled(py)
        if comp:
            cpts = sorted(((_eager(c, comp[0])[0]["median"], _eager(c, comp[0])[1], c["budget"]) for c in comp),
                          key=lambda p: p[2])
            ax.scatter([p[0] for p in cpts], [p[1] for p in cpts], s=40, marker="^", color="tab:red",
                       edgecolor="black", linewidth=0.5, zorder=3,
                       label="PyTorch torch.compile at each activation_memory_budget (labelled)")
            pts += [(p[0], p[1]) for p in cpts]
            labels += [(p[0], p[1], f"compile {p[2]:g}", "darkred") for p in cpts]
    ax.scatter([1], [1], marker="*", s=160, color="black", zorder=4, label="plain (remat and PyTorch)")
    pts.append((1.0, 1.0))
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    ax.set_xlim(min(xs) - 0.04, max(xs) + 0.12)
    ax.set_ylim(min(ys) - 0.08, max(ys) + 0.06)
    ax.set_xlabel("step time / plain step (lower is better)")
    ax.set_ylabel("peak memory of the step / plain step's (everything counted)")
    s = meta["size"]
    ax.set_title(f"remat auto (the whole-step planner) against every hand-placed strategy and torch.compile\n"
                 f"GPT whole training step: d_model {s['d_model']}, {s['blocks']} blocks, T {s['seq_len']}, "
                 f"batch {s['batch']}, vocabulary {s['vocab']}, AdamW; CPU, 1 intra-op thread", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.transforms import Bbox
    avoid = []
    for x, y in pts:
        cx, cy = ax.transData.transform((x, y))
        avoid.append(Bbox.from_extents(cx - 4, cy - 4, cx + 4, cy + 4))
    avoid.append(ax.get_legend().get_window_extent(renderer))
    _place_labels(ax, fig, sorted(labels, key=lambda l: (-l[1], l[0])), avoid)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def drive(build_dir, quick, env=None, timeout=3600):
    """remat_auto (the frontier), then remat_step_solve (reference runs only: the solver's sizes)."""
    import common
    exe = os.path.join(build_dir, "bench", "remat_auto")
    solve = os.path.join(build_dir, "bench", "plan", "remat_step_solve")
    for f in (exe, solve):
        if not os.path.exists(f):
            sys.exit(f"{f} is missing: cmake --build {build_dir} --target remat_auto remat_step_solve")
    env = dict(env if env is not None else os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("LD_PRELOAD", None)  # remat::memory counts by itself
    print(f"whole step under a budget ({'quick' if quick else 'reference'} size): remat_auto", flush=True)
    out = os.path.join(RESULTS, "auto-quick.json" if quick else "auto.json")
    out_resnet = os.path.join(RESULTS, "auto-resnet-quick.json" if quick else "auto-resnet.json")
    rounds = [] if quick else ["--rounds", "5"]
    cmds = [[exe, "--threads", "1", "--out", out] + rounds + (["--quick"] if quick else []),
            [exe, "--model", "resnet", "--threads", "1", "--out", out_resnet] + rounds + (["--quick"] if quick else [])]
    if not quick:
        cmds.append([solve, "--out", os.path.join(RESULTS, "step_solve.json")])
    for cmd in cmds:
        p = common.run(cmd, env, timeout, label=os.path.basename(cmd[0]))
        print(p.stdout, end="", flush=True)
    preload = os.path.join(build_dir, "bench", "libremat_preload.so")
    py_env = dict(env, LD_PRELOAD=preload)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "auto_py.py")] + \
        (["--quick"] if quick else [])
    p = common.run(cmd, py_env, timeout, label="auto_py.py")
    print(p.stdout, end="", flush=True)


def images(quick=False):
    """Image file name -> draw(path): auto-frontier.png from auto.json and auto-py.json (none without them)."""
    recs = _lines(os.path.join(RESULTS, "auto-quick.json" if quick else "auto.json"))
    py = _lines(os.path.join(RESULTS, "auto-py-quick.json" if quick else "auto-py.json"))
    if not recs or not any(r["kind"] == "strategy" and r["name"].startswith("auto") for r in recs):
        return {}
    return {"auto-frontier.png": lambda out: chart(recs, py, out)}


def _with_ib(name, quick):
    """NAME.json's records if it holds strategies in backward, else NAME-ib.json's (a run kept apart), else None
    (-quick files with quick)."""
    q = "-quick" if quick else ""
    for path in (f"{name}{q}.json", f"{name}-ib{q}.json"):
        recs = _lines(os.path.join(RESULTS, path))
        if _has_ib(recs):
            return recs
    return None


def _has_ib(recs):
    """Whether a run's records hold strategies (or compiled points) with the step in backward."""
    return bool(recs) and any(r["kind"] in ("strategy", "compile") and _ib(r) for r in recs)


def fragments(quick=False):
    frags = {}
    recs = _lines(os.path.join(RESULTS, "auto-quick.json" if quick else "auto.json"))
    py = _lines(os.path.join(RESULTS, "auto-py-quick.json" if quick else "auto-py.json"))
    ib = _with_ib("auto", quick)
    if ib:
        frags["auto-in-backward"] = in_backward(ib, _with_ib("auto-py", quick))
    ib = _with_ib("auto-resnet", quick)
    if ib:
        frags["auto-in-backward-resnet"] = in_backward(ib)
    if recs:
        frags["auto-frontier"] = frontier(recs, py)
        frags["auto-targets"] = targets(recs, py)
        if _compiled(py):
            frags["auto-compile"] = compare_compile(recs, py)
    resnet = _lines(os.path.join(RESULTS, "auto-resnet-quick.json" if quick else "auto-resnet.json"))
    if resnet:
        frags["auto-frontier-resnet"] = frontier(resnet)
        frags["auto-targets-resnet"] = targets(resnet)
    q = "-quick" if quick else ""
    for name, frag, runs in (("auto-levers", "auto-levers", ("auto", "auto-ib", "auto-py", "auto-py-ib")),
                             ("auto-resnet-levers", "auto-levers-resnet", ("auto-resnet", "auto-resnet-ib"))):
        lv = _lines(os.path.join(RESULTS, f"{name}{q}.json"))
        if lv:
            # A run kept apart for the strategies in backward (NAME-ib) only where NAME's own run lacks them.
            hand = [("PyTorch" if "-py" in run else "remat", _lines(os.path.join(RESULTS, f"{run}{q}.json")))
                    for run in runs
                    if not (run.endswith("-ib") and _has_ib(_lines(os.path.join(RESULTS, f"{run[:-3]}{q}.json"))))]
            frags[frag] = levers(lv, hand)
    solves = _lines(os.path.join(RESULTS, "step_solve.json"))
    if solves and not quick:
        frags["auto-solver"] = solver(solves)
    return frags
