"""The Python (torch 2.13) half of the selective-checkpointing benchmark
(docs/BENCHMARKS.md, "Selective checkpointing").

Mirrors bench/selective/remat_selective.cpp: a stack of GPT blocks
(models.GptBlock, the port of remat::models::GptBlock: pre-LN, explicit causal
attention, GELU MLP, nn.Linear = aten::linear, dropout 0 so no dropout op
runs), the strategies interleaved one step each after warm-up, every step
measured with the LD_PRELOAD counter of bench/preload: peak bytes during
forward + backward above the bytes alive before the forward, and the bytes
held right after the forward (and each step's minor page faults). Strategies, each per block:
  plain       no checkpointing
  full        torch.utils.checkpoint.checkpoint(use_reentrant=False)
  sac_nothing SAC with an empty op list (full recompute through the dispatch mode)
  sac_matmuls SAC saving the ops of remat's save_matmuls() (all overloads)
  sac_addmm   SAC saving only aten.addmm: the linear layers' outputs
              (the op-list counterpart of the Megatron names policy)
Each warm-up step checks the gradients against plain's bitwise (exit 3 if not).
--ops prints the op sequence SAC's policy sees in one block's forward.
Prints one JSON object on stdout.
"""
import argparse
import functools
import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from common import Meter, metadata  # noqa: E402

# remat::policy::matmul_ops() (src/region/selective.cpp); linear and matmul are
# CompositeImplicitAutograd, so neither remat's policy nor SAC ever sees them.
MATMUL_OPS = ["mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
              "mkldnn_convolution", "cudnn_convolution", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
              "scaled_dot_product_attention"]


def overloads(names):
    out = []
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is not None:
            out += [getattr(packet, o) for o in packet.overloads()]
    return out


def sac(ops):
    return functools.partial(create_selective_checkpoint_contexts, ops)


def strategy(name, seq):
    """A function x -> output of the stack."""
    if name == "plain":
        return seq
    if name == "full":
        ctx = None
    elif name == "sac_nothing":
        ctx = sac([])
    elif name == "sac_matmuls":
        ctx = sac(overloads(MATMUL_OPS))
    elif name == "sac_addmm":
        ctx = sac(overloads(["addmm"]))
    else:
        raise SystemExit(f"unknown strategy {name}")
    kw = dict(use_reentrant=False) if ctx is None else dict(use_reentrant=False, context_fn=ctx)

    def run(x):
        h = x
        for b in seq:
            h = checkpoint(b, h, **kw)
        return h
    return run


def op_sequence(a):
    """The ops SAC's policy sees in one block's forward (ctx.is_recompute False)."""
    seen = []

    def log(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            name, _, overload = str(op).rpartition(".")  # aten.addmm.default
            seen.append(name.replace("aten.", "aten::", 1) + ("" if overload == "default" else "." + overload))
        return CheckpointPolicy.PREFER_RECOMPUTE

    block = models.GptBlock(a.d_model, a.heads)
    x = torch.randn(a.batch, a.seq_len, a.d_model, requires_grad=True)
    checkpoint(block, x, use_reentrant=False,
               context_fn=functools.partial(create_selective_checkpoint_contexts, log)).sum().backward()
    print(json.dumps(dict(lang="py", ops=seen)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategies", default="plain,full,sac_matmuls,sac_addmm")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--ops", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.ops:
        op_sequence(a)
        return
    meter = Meter("selective_worker.py")
    seq = nn.Sequential(*[models.GptBlock(a.d_model, a.heads) for _ in range(a.blocks)])
    seq.train()
    x = torch.randn(a.batch, a.seq_len, a.d_model, requires_grad=True)
    params = list(seq.parameters())
    names = a.strategies.split(",")
    if names[0] != "plain":
        names.insert(0, "plain")  # the reference
    runs = [dict(name=n, fn=strategy(n, seq), grads_equal=True, ms=[], fwd_ms=[], bwd_ms=[], peak=[], held=[],
                 minflt=[])
            for n in names]

    def step(r, record):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        x.grad = None
        meter.reset()
        base = meter.current()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = r["fn"](x).sum()
        t1 = time.perf_counter()
        held = meter.current() - base
        loss.backward()
        t2 = time.perf_counter()
        peak = meter.peak() - base
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        if record:
            r["minflt"].append(faults)
            r["ms"].append((t2 - t0) * 1e3)
            r["fwd_ms"].append((t1 - t0) * 1e3)
            r["bwd_ms"].append((t2 - t1) * 1e3)
            r["peak"].append(peak)
            r["held"].append(held)

    # One plain step allocates the parameter gradients (as in the C++ worker).
    step(runs[0], False)
    ref = None
    for r in runs:
        for _ in range(max(1, a.warmup)):
            step(r, False)
        g = [p.grad.clone() for p in params] + [x.grad.clone()]
        if ref is None:
            ref = g
            continue
        r["grads_equal"] = all(torch.equal(u.contiguous().view(torch.int32), v.contiguous().view(torch.int32))
                               for u, v in zip(g, ref))
        print(f"gradients of {r['name']} vs plain ({len(params)} parameters + input): "
              f"{'bitwise equal' if r['grads_equal'] else 'DIFFERENT'}", file=sys.stderr)
    ref = None
    for _ in range(a.steps):
        for r in runs:
            step(r, True)
    for r in runs:
        del r["fn"]
    print(json.dumps(dict(lang="py", threads=torch.get_num_threads(), d_model=a.d_model, heads=a.heads,
                          seq_len=a.seq_len, batch=a.batch, blocks=a.blocks, torch=torch.__version__,
                          param_bytes=sum(p.nbytes for p in params), input_bytes=x.nbytes, runs=runs,
                          meta=metadata())))
    sys.exit(0 if all(r["grads_equal"] for r in runs) else 3)


if __name__ == "__main__":
    main()
