"""The Python (torch 2.13) half of the side-by-side comparison with remat.

Mirrors bench/compare/remat_compare.cpp: builds one model's block chain
(models.py), runs the given strategies interleaved after warm-up and prints
one JSON object with each strategy's peak activation bytes (from the
LD_PRELOAD counter bench/preload, which must be loaded) and step times.
Strategies: plain, nonreentrant, reentrant (torch.utils.checkpoint per block),
seq:K (checkpoint_sequential, non-reentrant), sac (selective activation
checkpointing per block, saving mm/addmm/bmm outputs), compile:B (torch.compile
with activation_memory_budget B; slow to compile, run on its own).
Leaves out: the loss head and optimizer (the chain ends in .sum()).
"""
import argparse
import functools
import json
import os
import resource
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from common import Meter, metadata, status_kib  # noqa: E402


def per_block(seq, wrap):
    def run(x):
        h = x
        for b in seq:
            h = wrap(b, h)
        return h
    return run


SAC_OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]


def strategy(name, seq):
    if name == "plain":
        return seq, False
    if name == "nonreentrant":
        return per_block(seq, lambda b, h: checkpoint(b, h, use_reentrant=False)), False
    if name == "reentrant":
        return per_block(seq, lambda b, h: checkpoint(b, h, use_reentrant=True)), False
    if name == "sac":
        ctx = functools.partial(create_selective_checkpoint_contexts, SAC_OPS)
        return per_block(seq, lambda b, h: checkpoint(b, h, use_reentrant=False, context_fn=ctx)), False
    if name.startswith("seq:"):
        k = int(name[4:])
        return (lambda x: checkpoint_sequential(seq, k, x, use_reentrant=False)), True
    if name.startswith("compile:"):
        import torch._functorch.config as fconfig
        torch._dynamo.reset()
        fconfig.activation_memory_budget = float(name[8:])
        return torch.compile(seq), False
    raise SystemExit(f"unknown strategy {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--strategies", default="plain,nonreentrant")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sweep-steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rss", default="0")
    a = ap.parse_args()
    os.environ.pop("LD_PRELOAD", None)  # loaded already; keep it out of compiler subprocesses
    torch.set_num_threads(a.threads)
    meter = Meter("worker.py")
    seq, x = models.build(a.model)
    seq.train()
    # RSS cross-check: reset the high-water mark (VmHWM, what ru_maxrss reports)
    # after set-up, so the growth is this run's own; baseline = RSS now.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss0 = status_kib("VmRSS:")
    params = list(seq.parameters())

    def step(fn):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        x.grad = None
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = fn(x).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        # minor page faults of the step, as remat_compare counts them
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, faults

    def peak_of(fn):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        x.grad = None
        meter.reset()
        base = meter.current()
        fn(x).sum().backward()
        return meter.peak() - base + x.nbytes

    plain_peak = 0
    if a.rss != "1":  # --rss 1: only the given strategy runs, so ru_maxrss is its own
        step(seq)
        plain_peak = peak_of(seq)
    runs = []
    for name in a.strategies.split(","):
        r = dict(name=name, peak=-1, predicted=-1, note="", ms=[], fwd_ms=[], bwd_ms=[], faults=[])
        try:
            fn, sweep = strategy(name, seq)
            t0 = time.perf_counter()
            for _ in range(a.warmup):
                step(fn)
            if name.startswith("compile:"):
                r["note"] = f"compile+warm-up {time.perf_counter() - t0:.0f} s"
            r["peak"] = peak_of(fn)
        except Exception as e:  # report, keep going
            r["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            fn, sweep = None, False
        r["fn"], r["sweep"] = fn, sweep
        runs.append(r)
    for s in range(a.steps):
        for r in runs:
            if r["fn"] is None or (r["sweep"] and s >= a.sweep_steps):
                continue
            f, b, faults = step(r["fn"])
            r["ms"].append(f + b)
            r["fwd_ms"].append(f)
            r["bwd_ms"].append(b)
            r["faults"].append(faults)
    rss1 = max(status_kib("VmHWM:"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if rss0 < 0 else 0)
    for r in runs:
        del r["fn"], r["sweep"]
    print(json.dumps(dict(lang="py", model=a.model, threads=torch.get_num_threads(), meter="preload",
                          plain_peak=plain_peak, blocks=len(seq), input_bytes=x.nbytes,
                          param_bytes=sum(p.nbytes for p in params), rss_delta_kib=rss1 - rss0,
                          rss_mode=a.rss == "1", torch=torch.__version__, runs=runs, meta=metadata())))


if __name__ == "__main__":
    main()
