"""Per-call cost of torch.utils.checkpoint on a tiny layer, timeit (the twin of
bench/compare/remat_overhead.cpp): Linear(16, 16) on a (4, 16) input that
requires grad, forward + backward, one intra-op thread. Prints JSON with the
median microseconds per call of plain, non-reentrant and reentrant.
Leaves out: large layers (there the recompute, not the call, dominates).
"""
import json
import os
import statistics
import sys
import timeit

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
lin = torch.nn.Linear(16, 16)
x = torch.randn(4, 16, requires_grad=True)
cases = {
    "plain": lambda: lin(x).sum().backward(),
    "nonreentrant": lambda: checkpoint(lin, x, use_reentrant=False).sum().backward(),
    "reentrant": lambda: checkpoint(lin, x, use_reentrant=True).sum().backward(),
}
out = {}
for name, fn in cases.items():
    for _ in range(200):
        fn()
    n = 500
    reps = timeit.repeat(fn, number=n, repeat=5)
    out[name] = statistics.median(reps) / n * 1e6
print(json.dumps({"lang": "py", "us_per_call": out, "meta": metadata()}))
