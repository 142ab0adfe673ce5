"""What fits at a real vocabulary: the longest sequence each strategy trains
the GPT with under each memory cap, with a subword vocabulary (SentencePiece,
32k by default), where the (B, T, vocab) logits and their gradient, not the
blocks, are the largest tensors of a step. One remat-train
--max-seq-len-under run per (cap, strategy): a prediction (profiled chain +
plan::simulate; the planner for auto) verified by measured steps at the
answer and at answer + step (what_fits.py describes the search).
Writes bench/results/long_context_fits.json (one row per cap and strategy,
with the run's metadata), a markdown table per cap on stdout, and a PNG of
the longest context against the cap per strategy
(docs/img/long_context_fits.png).
Leaves out: timing (see bench/longctx for step times at equal sizes).
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
from what_fits import parse, size, to_bytes  # noqa: E402

# (key, label, remat-train flags); {lc}/{mc}: --loss-chunks / --mlp-chunks values.
STRATEGIES = [
    ("none", "plain", ["--checkpoint", "none"]),
    ("block", "per-block", ["--checkpoint", "block"]),
    ("loss", "chunked head+loss", ["--checkpoint", "none", "--loss-chunks", "{lc}"]),
    ("loss_mlp", "chunked head+loss+MLP", ["--checkpoint", "none", "--loss-chunks", "{lc}", "--mlp-chunks", "{mc}"]),
    ("loss_block", "chunked head+loss + per-block", ["--checkpoint", "block", "--loss-chunks", "{lc}"]),
    ("loss_mlp_block", "chunked head+loss+MLP + per-block",
     ["--checkpoint", "block", "--loss-chunks", "{lc}", "--mlp-chunks", "{mc}"]),
    ("loss_auto", "chunked head+loss + auto", ["--checkpoint", "auto", "--loss-chunks", "{lc}"]),
    ("loss_offload", "chunked head+loss + offload (disk)",
     ["--checkpoint", "offload", "--offload-dir", "{offload_dir}", "--loss-chunks", "{lc}"]),
    # auto choosing the head+loss chunks itself, chunked MLP, the optimizer
    # step in backward and its state on disk: every lever remat-train has.
    ("auto_every", "auto, every lever",
     ["--checkpoint", "auto", "--loss-chunks", "auto", "--mlp-chunks", "{mc}", "--optimizer-in-backward",
      "--optimizer-state", "disk", "--offload-dir", "{offload_dir}"]),
]


def run(a, key, label, flags, cap, offload_dir):
    flags = [f.format(lc=a.loss_chunks, mc=a.mlp_chunks, offload_dir=offload_dir) for f in flags]
    cmd = [a.exe, "--model", "gpt", "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads",
           str(a.heads), "--threads", str(a.threads), "--data", a.data, "--batch", str(a.batch),
           "--max-seq-len-under", cap, "--fit-step", str(a.seq_step)] + a.tok_flags + flags
    if a.sdpa:
        cmd.append("--sdpa")
    limit = a.limits.get(key, 0)
    if limit:
        cmd += ["--fit-max", str(limit)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"remat-train failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    r = parse(p.stdout, "seq_len")
    at_limit = bool(re.search(r"^max seq_len under .*\(the largest tried", p.stdout, re.M))
    if "next" not in r:  # the search stopped at --fit-max: nothing above the answer was tried
        r["next"] = (0, -1, -1)
    row = {"cap": cap, "cap_bytes": to_bytes(cap.replace("GiB", " GiB").replace("MiB", " MiB")), "strategy": label,
           "key": key, "max_seq_len": r["value"], "predicted_bytes": r["at"][1], "measured_bytes": r["at"][2],
           "next_seq_len": r["next"][0], "next_predicted_bytes": r["next"][1], "next_measured_bytes": r["next"][2],
           "predictions": r["predictions"], "measurements": r["measurements"], "fit_max": limit, "at_limit": at_limit,
           "seconds": round(time.time() - t0)}
    print(f"  {cap:>7s} {label:36s} max seq_len {answer(row):>7s}  predicted {size(row['predicted_bytes'])},"
          f" measured {size(row['measured_bytes'])}; at +step: {next_peaks(row)}  ({row['predictions']} predictions, {row['measurements']}"
          f" measured steps, {row['seconds']} s)", flush=True)
    return row


def load(path):
    return load_json(path)["rows"] if os.path.exists(path) else []


def measured(b):
    """A measured peak; below 0: not measured (no auto plan fits there, so a run would refuse it)."""
    return "no plan fits" if b is None or b < 0 else size(b)


def answer(r):
    """The longest sequence; ">= N" where the search's limit (--fit-max), not the cap, stopped it."""
    return f">= {r['max_seq_len']}" if r.get("at_limit") else str(r["max_seq_len"])


def next_peaks(r):
    if r.get("at_limit"):
        return "not tried (search limit)"
    return f"{size(r['next_predicted_bytes'])} / {measured(r['next_measured_bytes'])}"


def table(rows, cap):
    """Markdown table of one cap's rows, with the ratios to plain and per-block."""
    at = [r for r in rows if r["cap"] == cap]
    base = {r["key"]: r["max_seq_len"] for r in at}
    lines = [f"| strategy (cap {cap}) | max seq_len | vs plain | vs per-block | predicted / measured peak "
             f"| at +step: predicted / measured |", "|---|---:|---:|---:|---:|---:|"]
    for r in at:
        ge = ">= " if r.get("at_limit") else ""
        vs = lambda k: f"{ge}{r['max_seq_len'] / base[k]:.2f}x" if base.get(k) else "-"  # noqa: E731
        lines.append(f"| {r['strategy']} | {answer(r)} | {vs('none')} | {vs('block')} | "
                     f"{size(r['predicted_bytes'])} / {size(r['measured_bytes'])} | {next_peaks(r)} |")
    return "\n".join(lines)


def fragments(res):
    """gen_docs.py's fragments: long-context-fits (a table per cap, with how the rows were taken)."""
    rows, m = res["rows"], res["metadata"]
    st = m.get("settings", {})
    attention = f", {st['attention']} attention" if "attention" in st else ""
    parts = [f"{st.get('model', '?').replace('gpt', 'GPT', 1)}{attention}, batch {st.get('batch', '?')}, SentencePiece vocabulary "
             f"{st.get('vocab_size', '?')}, --loss-chunks {st.get('loss_chunks', '?')}, --mlp-chunks "
             f"{st.get('mlp_chunks', '?')}, answers in steps of {st.get('seq_step', '?')} tokens; "
             f"{m.get('cpu', '?')}, remat-train with {st.get('threads', '?')} intra-op thread(s), commit "
             f"{m.get('git_commit', '?')[:7]}, "
             f"{m.get('date_utc', '?')[:10]}. Each answer is predicted, then verified by measured steps at it and at "
             "the next step up (\"at +step\"); offload is searched by measured steps alone."]
    later = [r for r in rows if r.get("run") and r["run"]["git_commit"] != m.get("git_commit")]
    if later:
        parts[0] += (" Rows from a later run of the same settings: " + "; ".join(
            f"{r['strategy']} (commit {r['run']['git_commit'][:7]}, {r['run']['date_utc'][:10]})" for r in later) + ".")
    for cap in dict.fromkeys(r["cap"] for r in rows):
        parts.append(table(rows, cap))
        by = {r["key"]: r["max_seq_len"] for r in rows if r["cap"] == cap}
        if "none" in by and "loss_mlp_block" in by:
            vs_block = (f" and {by['loss_mlp_block'] / by['block']:.2f}x per-block checkpointing's alone"
                        if by.get("block") else "")
            parts.append(f"Under {cap}, chunked head+loss+MLP with per-block checkpointing trains "
                         f"{by['loss_mlp_block'] / by['none']:.2f}x plain's sequence{vs_block}.")
        every = next((r for r in rows if r["cap"] == cap and r["key"] == "auto_every"), None)
        if every is not None and by.get("none"):
            bound = (f" (its search stopped at {every['max_seq_len']} tokens, --fit-max, to bound the run's time: "
                     "the cap did not stop it)") if every.get("at_limit") else ""
            parts.append(f"Under {cap}, auto with every lever trains {answer(every)} tokens, "
                         f"{'at least ' if every.get('at_limit') else ''}{every['max_seq_len'] / by['none']:.2f}x "
                         f"plain's sequence{bound}; target >= 8x: "
                         f"{'met' if every['max_seq_len'] >= 8 * by['none'] else 'not shown'}.")
        if all(k in by for k in ("none", "block", "loss_block")):
            parts.append(f"Under {cap}, chunked head+loss with per-block checkpointing trains "
                         f"{by['loss_block'] / by['none']:.2f}x plain's sequence and {by['loss_block'] / by['block']:.2f}x "
                         "per-block checkpointing's alone.")
    return {"long-context-fits": "\n\n".join(parts)}


def chart(rows, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: chart skipped (scripts/setup.sh installs it)")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for key, label, _ in STRATEGIES:
        pts = sorted((r["cap_bytes"], r["max_seq_len"]) for r in rows if r["key"] == key)
        if not pts:
            continue
        ax.plot([c / (1 << 30) for c, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("memory cap on the step's peak above its start (GiB)")
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"chart: {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "remat-train", "remat-train"))
    ap.add_argument("--caps", default="2GiB", help="comma-separated caps, e.g. 512MiB,1GiB,2GiB")
    ap.add_argument("--strategies", default=",".join(k for k, _, _ in STRATEGIES), help="comma-separated subset")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-step", type=int, default=64, help="granularity of the answers, tokens")
    ap.add_argument("--loss-chunks", type=int, default=16)
    ap.add_argument("--mlp-chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fit-max", default="",
                    help="KEY=TOKENS,...: the longest sequence a strategy's search tries (bounds its time; its "
                         "answer then reads '>= N')")
    ap.add_argument("--sdpa", action="store_true",
                    help="attention through scaled_dot_product_attention (no T x T scores); results go to "
                         "long_context_fits-sdpa.json")
    ap.add_argument("--data", default="", help="text to train on (default: scripts/make-corpus.sh's corpus)")
    ap.add_argument("--tokenizer", default="", help="a SentencePiece .model (trained on --data when missing)")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--results", default="", help="results file (default bench/results/long_context_fits.json)")
    ap.add_argument("--append", action="store_true", help="keep --results' other rows (re-run some caps/strategies)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "long_context_fits.png"))
    ap.add_argument("--quick", action="store_true", help="toy model and caps (smoke run only)")
    ap.add_argument("--from-results", action="store_true", help="only redraw the tables and chart from --results")
    a = ap.parse_args()
    a.limits = {k: int(v) for k, v in (kv.split("=") for kv in a.fit_max.split(",") if kv)}
    if a.quick:
        a.layers, a.d_model, a.heads, a.batch, a.caps, a.vocab_size = 2, 64, 2, 2, "4MiB,8MiB", 1000
        a.seq_step = 16
        a.out = os.path.join(ROOT, "bench", "results", "long_context_fits-quick.png")
    a.results = a.results or result_path("long_context_fits-sdpa" if a.sdpa else "long_context_fits", a.quick)
    title = (f"GPT {a.layers} blocks, d_model {a.d_model}, {a.heads} heads, batch {a.batch}, vocabulary "
             f"{a.vocab_size}; measured")
    if a.from_results:
        rows = load(a.results)
        for cap in dict.fromkeys(r["cap"] for r in rows):
            print(table(rows, cap) + "\n")
        chart(rows, a.out, title)
        return
    work = tempfile.mkdtemp(prefix="remat_long_context_")  # corpus, model, offload files: removed at the end
    try:
        run_all(a, work, title)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_all(a, work, title):
    if not a.data:
        a.data = os.path.join(work, "corpus.txt")
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "make-corpus.sh"), a.data], check=True)
    if not a.tokenizer:
        a.tokenizer = os.path.join(work, f"sp{a.vocab_size}.model")
    if os.path.exists(a.tokenizer):
        a.tok_flags = ["--tokenizer", a.tokenizer]
    else:  # train it once, then every run loads it
        t0 = time.time()
        subprocess.run([a.exe, "--data", a.data, "--vocab-size", str(a.vocab_size), "--tokenizer", a.tokenizer,
                        "--steps", "1", "--layers", "1", "--d-model", "32", "--heads", "1", "--seq-len", "16",
                        "--batch", "1"], check=True, capture_output=True)  # one toy step: it writes the model
        print(f"tokenizer: {a.vocab_size} pieces trained on {a.data} in {time.time() - t0:.0f} s", flush=True)
        a.tok_flags = ["--tokenizer", a.tokenizer]
    offload_dir = tempfile.mkdtemp(prefix="remat_long_context_offload_", dir=work)
    print(title + f"; caps {a.caps}; {a.threads} thread(s)", flush=True)
    rows = load(a.results) if a.append else []
    for cap in a.caps.split(","):
        for key, label, flags in STRATEGIES:
            if key in a.strategies.split(","):
                rows = [r for r in rows if not (r["cap"] == cap and r["key"] == key)]
                row = run(a, key, label, flags, cap, offload_dir)
                if a.append:  # which run measured it, as the file's metadata is the last run's
                    row["run"] = {k: metadata({})[k] for k in ("git_commit", "date_utc")}
                rows.append(row)
                write(a, rows)
    for cap in dict.fromkeys(r["cap"] for r in rows):
        print("\n" + table(rows, cap))
    chart(rows, a.out, title)


def write(a, rows):
    meta = metadata({"model": f"gpt {a.layers} blocks, d_model {a.d_model}, {a.heads} heads", "batch": a.batch,
                     "vocab_size": a.vocab_size, "tokenizer": a.tokenizer, "loss_chunks": a.loss_chunks,
                     "mlp_chunks": a.mlp_chunks, "seq_step": a.seq_step, "threads": a.threads,
                     "attention": "sdpa" if a.sdpa else "matmul + softmax (T x T scores kept)"})
    write_json(a.results, {"metadata": meta, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
