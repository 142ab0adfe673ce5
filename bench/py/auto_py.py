"""The Python anchors of the whole-step benchmark (docs/BENCHMARKS.md, "Whole training step under a budget").

The same whole training step as bench/auto/remat_auto.cpp (the reference GPT of docs/BENCHMARKS.md with an
8192-token vocabulary: embedding, 8 blocks with explicit attention, final LayerNorm, LM head tied to the
embedding, cross-entropy, backward, AdamW lr 1e-3, gradients zeroed in place) in Python PyTorch on the
same LibTorch (the model of bench/py/longctx.py), under PyTorch's own strategies, in two phases.
Eager:
  plain           no checkpointing
  block           torch.utils.checkpoint per block (use_reentrant=False)
  sac_addmm       selective activation checkpointing per block saving aten.addmm (MUST_SAVE)
  sac_matmuls     the same saving aten.mm, aten.addmm and aten.bmm
  seqK            torch.utils.checkpoint.checkpoint_sequential over the blocks in K segments (non-reentrant;
                  K = round(sqrt(blocks)), 2 and blocks / 2; its last segment runs plain, as it does in PyTorch)
  plain+ib        the optimizer step in backward, PyTorch's recipe: one AdamW per parameter (same settings),
                  stepped in the parameter's register_post_accumulate_grad_hook, its gradient set to None
                  after; no optimizer step after backward (remat_auto's plain+ib)
  block+ib        the same with torch.utils.checkpoint per block (use_reentrant=False) (remat_auto's block+ib)
torch.compile (inductor on the CPU), phase two:
  compile:B       the forward and loss (embedding to cross-entropy) compiled whole with
                  torch._functorch.config.activation_memory_budget B, for B = 1.0 (its own plain step) and each
                  of --fractions (default: 0 and the budgets of remat_auto's evenly spaced points as fractions of
                  its profiled peak, read from auto.json, else 0.5 to 0.9); the backward and AdamW as in eager.
                  Each compiles cold (an empty inductor cache); compile_s is its first step's time less its
                  median later step.
Each strategy has its own model from the same seed; one warm-up step each (the compile, for compiled ones), then
the strategies of a phase interleaved, one step each in turn, for --warmup-rounds untimed rounds (1) and --rounds
timed ones (3); phase two runs the eager plain step too, for
compiled plain against eager plain. Per step: wall time, and the peak of the preload counter (bench/preload,
LD_PRELOAD) above the bytes alive at the step's start, plus the model's parameter, gradient and AdamW-state
bytes, so that the figure covers what remat_auto's does (everything of one model; with the step in backward
the gradients are not alive between steps, so only the parameters and AdamW state are added: the gradients
alive during the step are in the counter's figure; each record's "covers" says so); eager strategies are
reported relative to this script's own eager plain step, compiled ones to the compiled plain step (budget 1.0)
of the same rounds. Writes JSON lines to bench/results/auto-py.json (--quick: auto-py-quick.json): a meta
record, one record per eager strategy, then one per compiled budget.
Leaves out: compiling the optimizer step; torch.compile's other settings (defaults throughout).
"""
import argparse
import functools
import gc
import json
import math
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
IN_BACKWARD = {"plain+ib": "PyTorch plain, optimizer step in backward (post-accumulate-grad hooks)",
               "block+ib": "PyTorch checkpoint per block, optimizer step in backward (post-accumulate-grad hooks)"}
COVERS = {False: "parameters, gradients (alive throughout the step), AdamW state, activations, the loss",
          True: "parameters, AdamW state, gradients from their accumulation to their parameter's update, "
                "activations, the loss"}


def segment_counts(blocks):
    """checkpoint_sequential's segment counts: round(sqrt(blocks)), 2 and blocks / 2 (those from 2 to blocks)."""
    return sorted(k for k in {round(math.sqrt(blocks)), 2, blocks // 2} if 2 <= k <= blocks)


def remat_fractions(quick):
    """The budgets of remat_auto's evenly spaced points ('auto@i') as fractions of its profiled peak, below 1,
    from auto.json (auto-quick.json); None when it is absent."""
    path = os.path.join(RESULTS, "auto-quick.json" if quick else "auto.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    prof = next((r for r in recs if r["kind"] == "profile"), None)
    if prof is None:
        return None
    out = sorted({round(r["budget"] / prof["profiled_peak"], 3) for r in recs
                  if r["kind"] == "strategy" and r["name"].startswith("auto@")})
    return [f for f in out if f < 1] or None


def paired(ms, base_ms):
    """Per-round ratios to the baseline: median, min, max."""
    ratio = [x / y for x, y in zip(ms, base_ms)]
    return dict(median=statistics.median(ratio), min=min(ratio), max=max(ratio))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed interleaved rounds before the timed ones")
    ap.add_argument("--fractions", help="torch.compile's activation_memory_budget values below 1.0, comma-separated "
                    "('none': no torch.compile phase); default 0 and remat_auto's (auto.json)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import torch
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                        create_selective_checkpoint_contexts)
    import longctx
    from common import Meter, compile_with_budget
    os.environ.pop("LD_PRELOAD", None)  # loaded already; keep it out of the compiler's subprocesses
    torch.set_num_threads(a.threads)
    meter = Meter("auto_py.py")
    size = QUICK if a.quick else REFERENCE
    rounds = a.rounds or (2 if a.quick else 3)
    aten = torch.ops.aten
    if a.fractions == "none":
        fractions, source = [], "none"
    elif a.fractions:
        fractions, source = sorted(float(f) for f in a.fractions.split(",")), "--fractions"
    else:
        remat = remat_fractions(a.quick)
        source = "auto-quick.json" if a.quick else "auto.json"
        if remat is None:
            remat, source = [0.5, 0.6, 0.7, 0.8, 0.9], "default (no auto.json)"
        fractions = [0.0] + remat
    fractions = [f for f in fractions if f < 1]

    def sac(ops):
        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
        return functools.partial(create_selective_checkpoint_contexts, policy)

    contexts = {"sac_addmm": sac({aten.addmm.default}),
                "sac_matmuls": sac({aten.mm.default, aten.addmm.default, aten.bmm.default})}
    labels = dict(LABELS)
    segs = segment_counts(size["blocks"])
    for k in segs:
        sqrt = " (round(sqrt(blocks)))" if k == round(math.sqrt(size["blocks"])) else ""
        labels[f"seq{k}"] = f"PyTorch checkpoint_sequential, {k} segments{sqrt}"
    labels.update(IN_BACKWARD)

    def blocks_of(name, net):
        """The blocks as one function (B, T, C) -> (B, T, C) under the eager strategy `name`."""
        name = name.removesuffix("+ib")  # the step in backward: the same forward
        if name.startswith("seq"):
            return lambda h: checkpoint_sequential(net.blocks, int(name[3:]), h, use_reentrant=False)

        def run(h):
            for b in net.blocks:
                if name == "plain":
                    h = b(h)
                elif name == "block":
                    h = checkpoint(b, h, use_reentrant=False)
                else:
                    h = checkpoint(b, h, use_reentrant=False, context_fn=contexts[name])
            return h
        return run

    def forward_loss(name, net):
        """(x, y) -> loss: the step's forward under an eager strategy."""
        blocks = blocks_of(name, net)

        def whole_step(x, y):
            return net.loss(blocks(net.embed(x)), y)
        return whole_step

    def in_backward(net):
        """PyTorch's optimizer step in backward: an AdamW per parameter, stepped in its post-accumulate-grad hook
        (once its gradient is final: after every use, the tied embedding's too), the gradient freed after."""
        opts = {p: torch.optim.AdamW([p], lr=1e-3, foreach=False) for p in net.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return opts

    def new_run(name, label):
        net = longctx.build(size, a.seed)
        ib = name.endswith("+ib")
        opt = None if ib else torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
        r = dict(name=name, label=label, net=net, opt=opt, ib=ib, fn=forward_loss("plain" if name.startswith(
            "compile:") else name, net), ms=[], peak=[])
        if ib:
            r["opts"] = in_backward(net)
        return r

    def step(r, idx):
        net, opt = r["net"], r["opt"]
        x, y = idx[:, :-1], idx[:, 1:]
        t0 = time.perf_counter()
        if opt is not None:
            opt.zero_grad(set_to_none=False)
        base = meter.current()
        meter.reset()
        loss = r["fn"](x, y)
        loss.backward()  # with the step in backward, every parameter is updated in here
        if opt is not None:
            opt.step()
        ms = (time.perf_counter() - t0) * 1e3
        # The model's own state (parameters, gradients, AdamW's two moments) is alive throughout; with the step in
        # backward the gradients are not (they are in the counter's figure while they live).
        state = sum(p.nbytes for p in net.parameters()) * (3 if r["ib"] else 4)
        return ms, meter.peak() - base + state

    gen = torch.Generator().manual_seed(7)

    def batch():
        return torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1), generator=gen)

    def measure(runs, phase):
        """--warmup-rounds untimed rounds (the heap settles: a step's first run after the others' warm-ups pays
        for pages they took), then `rounds` timed, the strategies interleaved in each."""
        for rnd in range(a.warmup_rounds + rounds):
            idx = batch()
            timed = rnd >= a.warmup_rounds
            for r in runs:
                ms, peak = step(r, idx)
                if timed:
                    r["ms"].append(ms)
                    r["peak"].append(peak)
                r["last_ms"] = ms
            what = f"round {rnd - a.warmup_rounds + 1}/{rounds}" if timed else "warm-up round"
            print(f"  {phase} {what}: " + ", ".join(f"{r['name']} {r['last_ms']:.0f} ms" for r in runs),
                  file=sys.stderr, flush=True)

    # Phase 1: eager.
    runs = [new_run(name, label) for name, label in labels.items()]
    idx = batch()
    for r in runs:
        step(r, idx)  # warm-up: allocates the gradients and AdamW's state
    measure(runs, "eager")
    plain = runs[0]
    lines = []
    for r in runs:
        peak = max(r["peak"])
        lines.append(dict(kind="strategy", name=r["name"], label=r["label"], ms=r["ms"], peaks=r["peak"],
                          time_ratio=paired(r["ms"], plain["ms"]), peak=peak, peak_ratio=peak / max(plain["peak"]),
                          in_backward=r["ib"], covers=COVERS[r["ib"]]))
        print(f"{r['label']:<60} {lines[-1]['time_ratio']['median']:.3f}x time  {lines[-1]['peak_ratio']:.3f}x peak",
              flush=True)

    # Phase 2: torch.compile at each budget, with the eager plain step beside it.
    compiled = []
    if fractions:
        for r in runs[1:]:
            del r["net"], r["opt"], r["fn"]
            r.pop("opts", None)
        gc.collect()
        eager = dict(plain, name="plain", ms=[], peak=[])
        idx = batch()
        for i, b in enumerate([1.0] + fractions):
            r = new_run(f"compile:{b:g}", f"torch.compile, activation_memory_budget {b:g}")
            r["budget"] = b
            r["fn"], scope = compile_with_budget(r["fn"], b, f"budget{i}")
            t0 = time.perf_counter()
            with scope():
                step(r, idx)  # compiles the forward (and partitions the joint graph under the budget), then backward
            r["first_s"] = time.perf_counter() - t0
            print(f"  compiled {r['name']}: first step {r['first_s']:.1f} s", file=sys.stderr, flush=True)
            compiled.append(r)
        measure([eager] + compiled, "compile")
        base = compiled[0]
        for r in compiled:
            peak = max(r["peak"])
            rec = dict(kind="compile", name=r["name"], label=r["label"], budget=r["budget"], ms=r["ms"],
                       peaks=r["peak"], first_s=r["first_s"],
                       compile_s=r["first_s"] - statistics.median(r["ms"]) / 1e3,
                       time_ratio=paired(r["ms"], base["ms"]), peak=peak, peak_ratio=peak / max(base["peak"]))
            if r is base:  # compiled plain against eager plain, in the same rounds
                rec.update(eager_ms=eager["ms"], eager_peak=max(eager["peak"]),
                           eager_time_ratio=paired(r["ms"], eager["ms"]), eager_peak_ratio=peak / max(eager["peak"]))
            lines.append(rec)
            print(f"{r['label']:<60} {rec['time_ratio']['median']:.3f}x time  {rec['peak_ratio']:.3f}x peak  "
                  f"compile {rec['compile_s']:.1f} s", flush=True)
    settings = dict(rounds=rounds, warmup_rounds=a.warmup_rounds, threads=torch.get_num_threads(), seed=a.seed,
                    meter="preload", segments=segs, compile_budgets=fractions, compile_budgets_from=source,
                    compile="torch.compile(fullgraph=True), inductor defaults, forward and loss; cold cache each")
    lines.insert(0, dict(kind="meta", meta=metadata(settings), size=dict(size, quick=a.quick), rounds=rounds))
    out = a.out or os.path.join(RESULTS, f"auto-py{'-quick' if a.quick else ''}.json")
    with open(out + ".tmp", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
