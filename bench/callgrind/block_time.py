"""The Python twin of `remat_block_cg time`: a stack of reference GPT blocks
(bench/py/models.py), plain and per-block torch.utils.checkpoint
(use_reentrant=False) steps alternated, each step's thread CPU time.
Arguments: T batch pairs blocks."""
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))
import models  # noqa: E402

T, B, pairs, blocks = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(1)
torch.manual_seed(0)
stack = [models.GptBlock(512, 8) for _ in range(blocks)]
x = torch.randn(B, T, 512).requires_grad_(True)


def step(ckpt):
    for b in stack:
        for p in b.parameters():
            if p.grad is not None:
                p.grad.zero_()
    x.grad = None
    t0 = time.thread_time()
    h = x
    for b in stack:
        h = checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
    h.sum().backward()
    return (time.thread_time() - t0) * 1e3


step(False)
step(True)
ratios = []
for i in range(pairs):
    p, c = step(False), step(True)
    ratios.append(c / p)
    print(f"py pair {i}: plain {p:.1f} ms, ckpt {c:.1f} ms, ratio {c / p:.4f}")
print(f"py median ratio {statistics.median(ratios):.4f} range {min(ratios):.4f}-{max(ratios):.4f} "
      f"({pairs} pairs, thread CPU time)")
