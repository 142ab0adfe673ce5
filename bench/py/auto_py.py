"""The Python anchors of the whole-step benchmark (docs/BENCHMARKS.md, "Whole training step under a budget").

The same whole training step as bench/auto/remat_auto.cpp (the reference GPT of DESIGN.md with an
8192-token vocabulary: embedding, 8 blocks with explicit attention, final LayerNorm, LM head tied to the
embedding, cross-entropy, backward, AdamW lr 1e-3, gradients zeroed in place) in Python PyTorch on the
same LibTorch (the model of bench/py/longctx.py), under PyTorch's own strategies:
  plain           no checkpointing
  block           torch.utils.checkpoint per block (use_reentrant=False)
  sac_addmm       selective activation checkpointing per block saving aten.addmm (MUST_SAVE)
  sac_matmuls     the same saving aten.mm, aten.addmm and aten.bmm
Each strategy has its own model from the same seed; one warm-up step each, then the strategies interleaved,
one step each in turn, for --rounds rounds (3). Per step: wall time, and the peak of the preload counter
(bench/preload, LD_PRELOAD) above the bytes alive at the step's start, plus the model's parameter,
gradient and AdamW-state bytes, so that the figure covers what remat_auto's does (everything of one model);
each strategy is reported relative to this script's own plain step. Writes JSON lines to
bench/results/auto-py.json (--quick: auto-py-quick.json): a meta record, then one record per strategy.
Leaves out: torch.compile's activation_memory_budget (BENCHMARKS.md's comparison section has its own run).
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, metadata  # noqa: E402

REFERENCE = dict(d_model=512, heads=8, blocks=8, seq_len=512, batch=4, vocab=8192)  # remat_auto's kReference
QUICK = dict(d_model=64, heads=4, blocks=4, seq_len=64, batch=4, vocab=512)  # its kQuick
LABELS = {"plain": "PyTorch plain", "block": "PyTorch checkpoint per block",
          "sac_addmm": "PyTorch SAC saving addmm", "sac_matmuls": "PyTorch SAC saving mm, addmm, bmm"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    import longctx
    from common import Meter
    os.environ.pop("LD_PRELOAD", None)  # loaded already
    torch.set_num_threads(a.threads)
    meter = Meter("auto_py.py")
    size = QUICK if a.quick else REFERENCE
    rounds = a.rounds or (2 if a.quick else 3)
    aten = torch.ops.aten

    def sac(ops):
        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
        return functools.partial(create_selective_checkpoint_contexts, policy)

    contexts = {"sac_addmm": sac({aten.addmm.default}),
                "sac_matmuls": sac({aten.mm.default, aten.addmm.default, aten.bmm.default})}
    runs = []
    for name in LABELS:
        net = longctx.build(size, a.seed)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
        runs.append(dict(name=name, net=net, opt=opt, ms=[], peak=[]))
    gen = torch.Generator().manual_seed(7)

    def step(r, idx):
        net, opt = r["net"], r["opt"]
        x, y = idx[:, :-1], idx[:, 1:]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        base = meter.current()
        meter.reset()
        h = net.embed(x)
        for b in net.blocks:
            if r["name"] == "plain":
                h = b(h)
            elif r["name"] == "block":
                h = checkpoint(b, h, use_reentrant=False)
            else:
                h = checkpoint(b, h, use_reentrant=False, context_fn=contexts[r["name"]])
        loss = net.loss(h, y)
        del h
        loss.backward()
        opt.step()
        ms = (time.perf_counter() - t0) * 1e3
        # The model's own state (parameters, gradients, AdamW's two moments) is alive throughout.
        state = sum(p.nbytes for p in net.parameters()) * 4
        return ms, meter.peak() - base + state

    idx = torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1), generator=gen)
    for r in runs:
        step(r, idx)  # warm-up: allocates the gradients and AdamW's state
    for rnd in range(rounds):
        idx = torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1), generator=gen)
        for r in runs:
            ms, peak = step(r, idx)
            r["ms"].append(ms)
            r["peak"].append(peak)
        print(f"  round {rnd + 1}/{rounds}: " + ", ".join(f"{r['name']} {r['ms'][-1]:.0f} ms" for r in runs),
              file=sys.stderr, flush=True)
    plain = runs[0]
    settings = dict(rounds=rounds, threads=torch.get_num_threads(), seed=a.seed, meter="preload")
    lines = [dict(kind="meta", meta=metadata(settings), size=dict(size, quick=a.quick), rounds=rounds)]
    for r in runs:
        ratio = [x / y for x, y in zip(r["ms"], plain["ms"])]
        peak = max(r["peak"])
        lines.append(dict(kind="strategy", name=r["name"], label=LABELS[r["name"]], ms=r["ms"], peaks=r["peak"],
                          time_ratio=dict(median=statistics.median(ratio), min=min(ratio), max=max(ratio)),
                          peak=peak, peak_ratio=peak / max(plain["peak"])))
        print(f"{LABELS[r['name']]:<40} {statistics.median(ratio):.3f}x time  {peak / max(plain['peak']):.3f}x peak")
    out = a.out or os.path.join(RESULTS, f"auto-py{'-quick' if a.quick else ''}.json")
    with open(out + ".tmp", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
