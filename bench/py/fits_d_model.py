"""What fits: model width under one cap. The widest d_model each strategy
trains the reference GPT step with (8 blocks, 8 heads, T 512, batch 4, a
SentencePiece vocabulary of 8192 pieces, AdamW) when the cap covers the
whole step: parameters, their gradients and the optimizer state in memory
as well as the activations. One remat-train --max-d-model-under run per
strategy: plain (--checkpoint none), per-block checkpointing, and auto with
every lever (--checkpoint auto --optimizer-in-backward --optimizer-state
disk --loss-chunks 8). Each answer is predicted, then verified by measured
steps at it and at the next width (the whole process's tracked bytes at the
step's peak; optimizer state on disk is not counted, what is read back is).
Writes bench/results/fits-d-model.json (one row per strategy, with the run's
metadata) and prints a markdown table; fragments() renders it for gen_docs.py
(fragment `fits-d-model`, docs/BENCHMARKS.md), with the target: auto with
every lever trains >= 3x plain's parameter count, met or missed.
--fit-max bounds a strategy's search (KEY=WIDTH): its answer is then at
least that width, and the table says so.
Leaves out: step times (see the auto benchmark), other caps.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import load_json, metadata, result_path, write_json  # noqa: E402
from what_fits import size, to_bytes  # noqa: E402

# (key, label, remat-train flags); {offload_dir}: the optimizer state's files.
STRATEGIES = [
    ("none", "plain", ["--checkpoint", "none"]),
    ("block", "per-block", ["--checkpoint", "block"]),
    ("auto_all", "auto + every lever",
     ["--checkpoint", "auto", "--optimizer-in-backward", "--optimizer-state", "disk", "--offload-dir",
      "{offload_dir}", "--loss-chunks", "8"]),
]
TARGET = 3.0  # auto with every lever: at least this many times plain's parameters


def parse(out):
    """The figures format_fit prints for --max-d-model-under."""
    m = re.search(r"^max d_model under .*?: (\d+)(.*)$", out, re.M)
    if not m:
        raise SystemExit(f"no answer in remat-train's output:\n{out[-3000:]}")
    rows = re.findall(r"^  d_model (\d+): (\d+) parameters \([^)]*\), whole-step predicted peak ([\d.]+ \w+)"
                      r"(?:, measured ([\d.]+ \w+))?(, no auto plan fits it)?", out, re.M)
    r = {"value": int(m.group(1)), "at_limit": "the largest tried" in m.group(2),
         "predictions": len(re.findall(r"^  predict ", out, re.M)),
         "measurements": len(re.findall(r"^  measure ", out, re.M))}
    moved = re.search(r"\(predicted (\d+), stepped (down|up) by measurement\)", m.group(2))
    r["predicted_value"] = int(moved.group(1)) if moved else r["value"]
    for key, (v, params, pred, meas, no_plan) in zip(["at", "next"], rows):
        r[key] = (int(v), int(params), to_bytes(pred), to_bytes(meas) if meas else -1)
        r[key + "_no_plan"] = bool(no_plan)  # auto: no plan meets the cap there, nothing measured
    if "next" not in r:
        r["next"], r["next_no_plan"] = (0, 0, 0, -1), False
    start = re.search(r"at d_model \d+, ([\d.]+ \w+) live at the step's start", out)
    r["start"] = to_bytes(start.group(1)) if start else -1
    return r


def run(a, key, label, flags, offload_dir):
    flags = [f.format(offload_dir=offload_dir) for f in flags]
    cmd = [a.exe, "--model", "gpt", "--layers", str(a.layers), "--heads", str(a.heads), "--seq-len",
           str(a.seq_len), "--batch", str(a.batch), "--threads", str(a.threads), "--data", a.data,
           "--tokenizer", a.tokenizer, "--max-d-model-under", a.cap, "--fit-step", str(a.step)] + flags
    limit = a.limits.get(key, 0)
    if limit:
        cmd += ["--fit-max", str(limit)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"remat-train failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    r = parse(p.stdout)
    row = {"key": key, "strategy": label, "flags": " ".join(f for f in flags if not f.startswith(offload_dir)),
           "cap": a.cap, "cap_bytes": to_bytes(a.cap.replace("GiB", " GiB").replace("MiB", " MiB")),
           "max_d_model": r["value"], "parameters": r["at"][1], "predicted_bytes": r["at"][2],
           "measured_bytes": r["at"][3], "start_bytes": r["start"], "predicted_d_model": r["predicted_value"],
           "next_d_model": r["next"][0], "next_parameters": r["next"][1], "next_predicted_bytes": r["next"][2],
           "next_measured_bytes": r["next"][3], "next_no_plan": r["next_no_plan"], "fit_max": limit, "at_limit": r["at_limit"],
           "predictions": r["predictions"], "measurements": r["measurements"], "seconds": round(time.time() - t0),
           # remat-train's own lines: each prediction and measured step, then the answer
           "log": [ln for ln in p.stdout.splitlines() if re.match(r"^(  predict |  measure |max d_model|  d_model )", ln)]}
    print(f"  {label:22s} d_model {row['max_d_model']:5d} ({row['parameters'] / 1e6:.2f}M parameters"
          f"{', the search limit' if row['at_limit'] else ''}): predicted {size(row['predicted_bytes'])}, "
          f"measured {size(row['measured_bytes'])}; next {row['next_d_model']}: "
          f"{size(row['next_predicted_bytes'])} / "
          f"{'no plan fits' if row['next_no_plan'] else size(row['next_measured_bytes'])}  ({row['predictions']} "
          f"predictions, {row['measurements']} measured, {row['seconds']} s)", flush=True)
    return row


def table(rows):
    base = next((r["parameters"] for r in rows if r["key"] == "none"), 0)
    lines = ["| strategy | largest d_model | parameters | vs plain | whole-step peak: predicted / measured "
             "| next d_model: parameters, predicted / measured |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        at_least = ">= " if r["at_limit"] else ""
        vs = f"{at_least}{r['parameters'] / base:.2f}x" if base else "-"
        if not r["next_d_model"]:
            nxt = "- (the search's limit)"
        else:
            meas = ("no plan fits, not run" if r.get("next_no_plan") or r["next_measured_bytes"] < 0
                    else size(r["next_measured_bytes"]))
            nxt = f"{r['next_d_model']}: {r['next_parameters'] / 1e6:.2f}M, {size(r['next_predicted_bytes'])} / {meas}"
        lines.append(f"| {r['strategy']} | {at_least}{r['max_d_model']} | {at_least}{r['parameters'] / 1e6:.2f}M | "
                     f"{vs} | {size(r['predicted_bytes'])} / {size(r['measured_bytes'])} | {nxt} |")
    return "\n".join(lines)


def verdict(rows):
    by = {r["key"]: r for r in rows}
    if "none" not in by or "auto_all" not in by:
        return ""
    ratio = by["auto_all"]["parameters"] / by["none"]["parameters"]
    met = ratio >= TARGET
    bound = " (a lower bound: its search stopped at --fit-max)" if by["auto_all"]["at_limit"] else ""
    return (f"Target: auto with every lever trains >= {TARGET:g}x plain's parameter count under the same cap: "
            f"{'met' if met else 'missed'}, {ratio:.2f}x{bound} ({by['auto_all']['parameters'] / 1e6:.2f}M "
            f"parameters at d_model {by['auto_all']['max_d_model']} against {by['none']['parameters'] / 1e6:.2f}M "
            f"at d_model {by['none']['max_d_model']}).")


def fragments(res):
    """gen_docs.py's fragment fits-d-model: how the rows were taken, the table, the target."""
    rows, m = res["rows"], res["metadata"]
    st = m.get("settings", {})
    limits = ", ".join(f"{r['strategy']} searched up to d_model {r['fit_max']}" for r in rows if r["fit_max"])
    head = (f"GPT {st.get('layers', '?')} blocks, {st.get('heads', '?')} heads, T {st.get('seq_len', '?')}, batch "
            f"{st.get('batch', '?')}, SentencePiece vocabulary {st.get('vocab_size', '?')} (embedding tied to the "
            f"head), AdamW, float32; cap {st.get('cap', '?')} on the whole step; widths in steps of "
            f"{st.get('step', '?')}; {m.get('cpu', '?')}, remat-train with {st.get('threads', '?')} intra-op "
            f"thread(s), commit {m.get('git_commit', '?')[:7]}, {m.get('date_utc', '?')[:10]}. Each answer is "
            "predicted, then verified by measured steps at it and at the next width"
            + (f"; {limits} (to bound the run's time: \">=\" marks an answer the limit, not the cap, stopped)"
               if limits else "") + ".")
    early = m.get("earlier_run")
    if early and early["rows"]:
        names = ", ".join(r["strategy"] for r in rows if r["key"] in early["rows"])
        em = early["metadata"]
        head += (f" The {names} rows come from an earlier run of the same settings (commit "
                 f"{em.get('git_commit', '?')[:7]}, {em.get('date_utc', '?')[:10]}).")
    return {"fits-d-model": "\n\n".join(p for p in [head, table(rows), verdict(rows)] if p)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "remat-train", "remat-train"))
    ap.add_argument("--cap", default="1.5GiB", help="the cap on the whole step, e.g. 1.5GiB")
    ap.add_argument("--strategies", default=",".join(k for k, _, _ in STRATEGIES), help="comma-separated subset")
    ap.add_argument("--fit-max", default="", help="KEY=WIDTH,...: the widest d_model a strategy's search tries")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--step", type=int, default=64, help="granularity of the widths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default="", help="text to train on (default: scripts/make-corpus.sh's corpus)")
    ap.add_argument("--tokenizer", default="", help="a SentencePiece .model (trained on --data when missing)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--results", default="", help="results file (default bench/results/fits-d-model.json)")
    ap.add_argument("--append", action="store_true", help="keep --results' other rows (re-run some strategies)")
    ap.add_argument("--quick", action="store_true", help="toy model and cap (smoke run only)")
    ap.add_argument("--from-results", action="store_true", help="only print the table from --results")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.heads, a.seq_len, a.batch, a.cap, a.vocab_size, a.step = 2, 2, 64, 2, "64MiB", 1000, 16
    a.limits = {k: int(v) for k, v in (kv.split("=") for kv in a.fit_max.split(",") if kv)}
    a.results = a.results or result_path("fits-d-model", a.quick)
    if a.from_results:
        res = load_json(a.results)
        print(fragments(res)["fits-d-model"])
        return
    work = tempfile.mkdtemp(prefix="remat_fits_d_model_")  # corpus, model, state files: removed at the end
    try:
        run_all(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_all(a, work):
    if not a.data:
        a.data = os.path.join(work, "corpus.txt")
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "make-corpus.sh"), a.data], check=True)
    if not a.tokenizer:
        a.tokenizer = os.path.join(work, f"sp{a.vocab_size}.model")
    if not os.path.exists(a.tokenizer):  # train it once, then every run loads it
        t0 = time.time()
        subprocess.run([a.exe, "--data", a.data, "--vocab-size", str(a.vocab_size), "--tokenizer", a.tokenizer,
                        "--steps", "1", "--layers", "1", "--d-model", "32", "--heads", "1", "--seq-len", "16",
                        "--batch", "1"], check=True, capture_output=True)  # one toy step: it writes the model
        print(f"tokenizer: {a.vocab_size} pieces trained on {a.data} in {time.time() - t0:.0f} s", flush=True)
    offload_dir = tempfile.mkdtemp(prefix="remat_fits_d_model_state_", dir=work)
    print(f"GPT {a.layers} blocks, {a.heads} heads, T {a.seq_len}, batch {a.batch}, vocabulary {a.vocab_size}; "
          f"cap {a.cap} on the whole step; {a.threads} thread(s)", flush=True)
    rows, a.earlier = [], None
    if a.append and os.path.exists(a.results):
        old = load_json(a.results)
        rows = old["rows"]
        # The rows kept were measured by an earlier run: keep its record, and say which rows this run made.
        kept = [r["key"] for r in rows if r["key"] not in a.strategies.split(",")]
        earlier = old["metadata"].get("earlier_run")
        # Rows an earlier --append kept came from the run before it: name that run, not the one in between.
        a.earlier = (earlier if earlier and set(kept) <= set(earlier["rows"])
                     else {"metadata": old["metadata"], "rows": kept})
    for key, label, flags in STRATEGIES:
        if key in a.strategies.split(","):
            rows = [r for r in rows if r["key"] != key]
            rows.append(run(a, key, label, flags, offload_dir))
            rows.sort(key=lambda r: [k for k, _, _ in STRATEGIES].index(r["key"]))
            write(a, rows)
    print("\n" + table(rows) + "\n\n" + verdict(rows))


def write(a, rows):
    meta = metadata({"layers": a.layers, "heads": a.heads, "seq_len": a.seq_len, "batch": a.batch,
                     "vocab_size": a.vocab_size, "cap": a.cap, "step": a.step, "threads": a.threads,
                     "tokenizer": f"sentencepiece bpe {a.vocab_size} trained on scripts/make-corpus.sh's corpus"
                     if not a.tokenizer or "remat_fits_d_model_" in a.tokenizer else a.tokenizer})
    if a.earlier:
        meta["earlier_run"] = a.earlier
    write_json(a.results, {"metadata": meta, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
