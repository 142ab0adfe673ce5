"""The long-context benchmark: its Python anchor, its driver and its table (docs/BENCHMARKS.md, "Long context").

Anchor (the default; needs LD_PRELOAD of bench/preload's counter): the
reference GPT whole training step (docs/BENCHMARKS.md) with a 32k vocabulary in
Python PyTorch on the same LibTorch, mirroring remat::models::Gpt
(src/models/models.cpp: token + position embedding, pre-LayerNorm blocks
with explicit causal attention and a GELU MLP, dropout 0, final LayerNorm,
LM head tied to the token embedding, GPT-2 initialisation), mean
cross-entropy, backward, torch.optim.AdamW (lr 1e-3, weight decay 1e-2,
foreach=False: one parameter at a time, as LibTorch's AdamW), gradients zeroed
in place. Strategies: plain and torch.utils.checkpoint per block
(use_reentrant=False); each its own model from the same seed; one warm-up
step each (its loss checked against plain's: relative 1e-5, else exit 3),
then interleaved, one step each in turn, for --rounds rounds. Per step: wall
time and the peak of the preload counter above the bytes alive at the step's
start, measured as bench/longctx/remat_longctx.cpp measures it. PyTorch
itself has no chunked LM head + loss (that takes an extra library: Liger
Kernel, Apple's Cut Cross-Entropy), so there are no chunked Python rows.
Writes JSON lines (a meta record, then one record per strategy, the keys of
remat_longctx's records) to bench/results/longctx-py.json (--quick:
longctx-py-quick.json).

--drive: runs remat_longctx (bench/results/longctx.json) and then the anchor,
both under the preload counter, one intra-op thread and the glibc malloc
settings of run_all.py (`make bench` calls drive() from run_all.py).
fragments(): the docs' fragment `longctx` (gen_docs.py).
Leaves out: the chunked strategies in Python, real text, SDPA, mixed precision.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import MALLOC_KEEP, RESULTS, ROOT, metadata  # noqa: E402

REFERENCE = dict(d_model=512, heads=8, blocks=8, seq_len=512, batch=4, vocab=32000)  # as remat_longctx's kReference
QUICK = dict(d_model=64, heads=4, blocks=2, seq_len=128, batch=2, vocab=2000)  # as its kQuick
LABELS = {"plain": "plain", "block": "torch.utils.checkpoint per block (use_reentrant=False)"}
TARGET_TIME = 1.05


def path(lang, quick):
    """bench/results/longctx.json (C++) or longctx-py.json (Python); -quick before .json for --quick."""
    return os.path.join(RESULTS, f"longctx{'-py' if lang == 'py' else ''}{'-quick' if quick else ''}.json")


# --- the anchor ----------------------------------------------------------------
def build(size, seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import models

    class Gpt(nn.Module):
        """remat::models::GptImpl, dropout 0, explicit attention."""

        def __init__(self, c):
            super().__init__()
            self.wte = nn.Embedding(c["vocab"], c["d_model"])
            self.wpe = nn.Embedding(c["seq_len"], c["d_model"])
            self.blocks = nn.Sequential(*[models.GptBlock(c["d_model"], c["heads"]) for _ in range(c["blocks"])])
            self.ln_f = nn.LayerNorm(c["d_model"])
            resid_std = 0.02 / math.sqrt(2.0 * c["blocks"])  # GPT-2 initialisation, as GptImpl's constructor
            with torch.no_grad():
                for name, m in self.named_modules():
                    if isinstance(m, nn.Linear):
                        m.weight.normal_(0.0, resid_std if name.endswith(".proj") else 0.02)
                        m.bias.zero_()
                    elif isinstance(m, nn.Embedding):
                        m.weight.normal_(0.0, 0.02)

        def embed(self, idx):  # (B, T) -> (B, T, C)
            return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))

        def loss(self, h, targets):  # (B, T, C), (B, T) -> ()
            logits = F.linear(self.ln_f(h), self.wte.weight)  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    torch.manual_seed(seed)
    net = Gpt(size)
    net.train()
    return net


def anchor(a):
    import torch
    from torch.utils.checkpoint import checkpoint
    from common import Meter
    os.environ.pop("LD_PRELOAD", None)  # loaded already
    torch.set_num_threads(a.threads)
    meter = Meter("longctx.py")
    size = QUICK if a.quick else REFERENCE
    rounds = a.rounds or (3 if a.quick else 5)
    runs = []
    for name in ("plain", "block"):
        net = build(size, a.seed)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2, foreach=False)
        runs.append(dict(name=name, net=net, opt=opt, ms=[], fwd_ms=[], bwd_ms=[], opt_ms=[], peak=[], held=[],
                         peak_fwd=[], peak_bwd=[], peak_opt=[]))
    param_bytes = sum(p.nbytes for p in runs[0]["net"].parameters())

    def batch(rnd):  # (B, T) inputs and next-token targets
        torch.manual_seed(a.seed + 1000 + rnd)
        tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(r, idx, tgt):
        net, opt = r["net"], r["opt"]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated
        base = meter.current()
        meter.reset()
        peaks = []

        def phase():  # the phase's peak above the step's start; restarts the peak
            peaks.append(meter.peak() - base)
            meter.reset()

        h = net.embed(idx)
        for b in net.blocks:
            h = checkpoint(b, h, use_reentrant=False) if r["name"] == "block" else b(h)
        loss = net.loss(h, tgt)
        del h
        t1 = time.perf_counter()
        phase()
        loss.backward()
        t2 = time.perf_counter()
        phase()
        opt.step()
        t3 = time.perf_counter()
        phase()
        value = loss.item()
        del loss
        return dict(ms=(t3 - t0) * 1e3, fwd_ms=(t1 - t0) * 1e3, bwd_ms=(t2 - t1) * 1e3, opt_ms=(t3 - t2) * 1e3,
                    loss=value, peak=max(peaks), held=meter.current() - base, peak_fwd=peaks[0], peak_bwd=peaks[1],
                    peak_opt=peaks[2])

    print(f"longctx.py: {size}, {torch.get_num_threads()} threads, {param_bytes / 2**20:.1f} MiB of parameters, "
          f"{rounds} rounds", file=sys.stderr, flush=True)
    idx, tgt = batch(0)
    for r in runs:
        m = step(r, idx, tgt)
        r["loss1"], r["warmup_peak"] = m["loss"], m["peak"]
        print(f"  warm-up {r['name']:<6} loss {m['loss']:.8f}  {m['ms']:.0f} ms", file=sys.stderr, flush=True)
    plain = runs[0]
    for r in runs:
        rel = abs(r["loss1"] - plain["loss1"]) / abs(plain["loss1"])
        if not rel <= 1e-5:
            sys.exit(f"longctx.py: LOSS MISMATCH: {r['name']}'s step-1 loss {r['loss1']:.8f} differs from plain's "
                     f"{plain['loss1']:.8f} by {rel:.3g} (relative; at most 1e-5 allowed)")
        r["loss_rel_diff"] = rel
    for rnd in range(1, rounds + 1):
        idx, tgt = batch(rnd)
        for r in runs:
            m = step(r, idx, tgt)
            for k in ("ms", "fwd_ms", "bwd_ms", "opt_ms", "peak", "held", "peak_fwd", "peak_bwd", "peak_opt"):
                r[k].append(m[k])
        print(f"  round {rnd}/{rounds}: plain {plain['ms'][-1]:.0f} ms", file=sys.stderr, flush=True)
    settings = dict(rounds=rounds, warmup=1, threads=torch.get_num_threads(), seed=a.seed,
                    optimizer="AdamW(lr 1e-3, weight_decay 1e-2, foreach=False)", zero_grad="in place",
                    meter="preload")
    lines = [dict(kind="meta", meta=metadata(settings), size=dict(size, dtype="float32", attention="explicit",
                                                                     quick=a.quick),
                  settings=settings, param_bytes=param_bytes)]
    print(f"{'strategy':<56} {'peak MiB':>9} {'vs plain':>8} {'step s':>7} {'time vs plain [range]':>24}")
    for r in runs:
        ratio = [x / y for x, y in zip(r["ms"], plain["ms"])]
        peak, plain_peak = statistics.median(r["peak"]), statistics.median(plain["peak"])
        rec = dict(kind="strategy", lang="py", name=r["name"], label=LABELS[r["name"]], loss_chunks=0, mlp_chunks=0,
                   block=r["name"] == "block", loss_step1=r["loss1"], loss_rel_diff=r["loss_rel_diff"],
                   median_step_ms=statistics.median(r["ms"]), time_x=statistics.median(ratio),
                   time_x_min=min(ratio), time_x_max=max(ratio), peak_bytes=int(peak), peak_x=peak / plain_peak,
                   peak_preload_bytes=int(peak), warmup_peak_bytes=r["warmup_peak"], step_ms=r["ms"],
                   fwd_ms=r["fwd_ms"], bwd_ms=r["bwd_ms"], opt_ms=r["opt_ms"], time_x_rounds=ratio, peaks=r["peak"],
                   held_bytes=r["held"], peak_fwd_bytes=r["peak_fwd"], peak_bwd_bytes=r["peak_bwd"],
                   peak_opt_bytes=r["peak_opt"])
        lines.append(rec)
        print(f"{r['name'] + ': ' + LABELS[r['name']]:<56} {peak / 2**20:9.1f} {peak / plain_peak:7.2f}x "
              f"{rec['median_step_ms'] / 1e3:7.2f} {rec['time_x']:8.3f}x [{min(ratio):.3f}-{max(ratio):.3f}]")
    out = a.out or path("py", a.quick)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


# --- the driver ------------------------------------------------------------------
def drive(build_dir, quick, env=None, rounds=None, timeout=3600):
    """remat_longctx, then the anchor, under the preload counter (env: run_all.py's, else made here)."""
    import common
    b = os.path.join(build_dir, "bench")
    exe, preload = os.path.join(b, "remat_longctx"), os.path.join(b, "libremat_preload.so")
    for f in (exe, preload):
        if not os.path.exists(f):
            sys.exit(f"{f} is missing: cmake --build {build_dir} --target remat_longctx remat_preload")
    if env is None:
        env = dict(os.environ, LD_PRELOAD=preload, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **MALLOC_KEEP)
    extra = (["--quick"] if quick else []) + (["--rounds", str(rounds)] if rounds else []) + ["--threads", "1"]
    print(f"long context ({'quick' if quick else 'reference'} size): remat_longctx, then the Python anchor", flush=True)
    for cmd in ([exe, *extra], [sys.executable, os.path.abspath(__file__), *extra]):
        p = common.run(cmd, env, timeout, label=os.path.basename(cmd[0] if cmd[0] == exe else cmd[1]))
        print(p.stdout, end="", flush=True)


# --- the table -------------------------------------------------------------------
def load(p):
    """(meta record, [strategy records]) of a JSON-lines result, None when absent."""
    if not os.path.exists(p):
        return None
    with open(p) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return next(r for r in recs if r["kind"] == "meta"), [r for r in recs if r["kind"] == "strategy"]


def paired(a, b):
    """Per round a's step time / b's (same round), as (median, min, max)."""
    q = [x / y for x, y in zip(a["step_ms"], b["step_ms"])]
    return statistics.median(q), min(q), max(q)


def phase(r):
    """Which phase of the step sets the peak: forward (with the loss), backward or the optimizer step."""
    peaks = {k: statistics.median(r.get(f"peak_{k}_bytes") or [0]) for k in ("fwd", "bwd", "opt")}
    if not any(peaks.values()):
        return "-"
    return {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}[max(peaks, key=peaks.get)]


def render(cpp, py):
    meta, rows = cpp
    s, st = meta["size"], meta["settings"]
    preload = all("peak_preload_bytes" in r for r in rows)
    key = "peak_preload_bytes" if preload else "peak_bytes"
    plain = next(r for r in rows if r["name"] == "plain")
    out = [f"GPT whole training step: d_model {s['d_model']}, {s['heads']} heads, {s['blocks']} blocks, "
           f"T {s['seq_len']}, batch {s['batch']}, vocabulary {s['vocab']}, float32, explicit attention, dropout 0; "
           f"embedding, blocks, final LayerNorm, tied LM head, cross-entropy, backward, "
           f"{st['optimizer']}; random token ids; {st['threads']} intra-op thread(s). Chunks: head+loss "
           f"{st['loss_chunks']} slices of the B*T tokens, MLP {st['mlp_chunks']} slices of T. One warm-up step "
           f"per strategy (its loss equals plain's within 1e-5 relative), then {st['rounds']} rounds, the "
           f"strategies one step each in turn. Peak: bytes of c10's CPU allocator above those alive at the step's "
           f"start ({'the LD_PRELOAD counter of bench/preload in both languages' if preload else 'remat::memory'}); "
           f"gradients are zeroed in place, so parameters, their gradients and AdamW's state are alive at the start "
           f"and not in the peak (fresh gradients before they are accumulated are). Step: zero_grad to the end of "
           f"the optimizer step, median over the rounds; peak in: the phase whose own peak is the step's (forward "
           f"with the loss, backward, optimizer step); time vs plain: the median over rounds of the step time / "
           f"plain's in the same round [min-max], against the same language's plain.", "",
           "| | strategy | peak MiB | peak vs plain | peak in | step s | time vs plain, median [range] |",
           "|---|---|---:|---:|---|---:|---|"]

    def row(lang, r, p):
        step_s = r["median_step_ms"] / 1e3
        out.append(f"| {lang} | {r['label']} | {r[key] / 2**20:.1f} | {r[key] / p[key]:.3f} | {phase(r)} | "
                   f"{step_s:.{2 if step_s >= 0.1 else 4}f} | {r['time_x']:.3f} [{r['time_x_min']:.3f}-{r['time_x_max']:.3f}] |")

    for r in rows:
        row("remat", r, plain)
    if py:
        py_plain = next(r for r in py[1] if r["name"] == "plain")
        for r in py[1]:
            row("PyTorch", r, py_plain)
    out += ["", "PyTorch has no chunked LM head + loss or chunked MLP without an extra library (Liger Kernel, "
            "Cut Cross-Entropy), so its rows are plain and per-block checkpointing only."
            + ("" if py else " (No Python run in these results.)")]
    by = {r["name"]: r for r in rows}
    if "block" in by and "chunk_block" in by:
        m, lo, hi = paired(by["chunk_block"], by["block"])
        mem = by["chunk_block"][key] / by["block"][key]
        out += ["", f"Chunking's own cost at block checkpointing's memory or less: chunked head+loss + block takes "
                f"{m:.3f}x block's step time [{lo:.3f}-{hi:.3f} over rounds] at {mem:.3f}x its peak "
                f"({by['chunk_block'][key] / 2**20:.1f} MiB against {by['block'][key] / 2**20:.1f} MiB): "
                f"target <= {TARGET_TIME:.2f}x {'MET' if m <= TARGET_TIME else 'MISSED'}."]
    if py:
        pb = {r["name"]: r for r in py[1]}
        if "plain" in pb and "plain" in by:
            out += ["", f"Across languages (separate processes, not interleaved): PyTorch plain "
                    f"{pb['plain']['median_step_ms'] / 1e3:.2f} s and {pb['plain'][key] / 2**20:.1f} MiB against "
                    f"remat plain {by['plain']['median_step_ms'] / 1e3:.2f} s and {by['plain'][key] / 2**20:.1f} MiB."]
    return "\n".join(out) + "\n"


def fragments(quick):
    """NAME -> markdown (gen_docs.py): `longctx` when remat_longctx's results exist."""
    cpp = load(path("cpp", quick))
    if cpp is None:
        return {}
    return {"longctx": render(cpp, load(path("py", quick)))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy size (seconds), longctx*-quick.json")
    ap.add_argument("--rounds", type=int, help="interleaved rounds after the warm-up (5; --quick 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="the anchor's result file (bench/results/longctx-py[-quick].json)")
    ap.add_argument("--drive", action="store_true", help="run remat_longctx and the anchor, then print the table")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="with --drive: the build folder")
    ap.add_argument("--report-only", action="store_true", help="print the table of the results there are")
    a = ap.parse_args()
    if a.drive:
        drive(a.build, a.quick, rounds=a.rounds)
    if a.drive or a.report_only:
        frag = fragments(a.quick)
        print(frag.get("longctx", f"no results: {path('cpp', a.quick)}"))
        return
    anchor(a)


if __name__ == "__main__":
    main()
