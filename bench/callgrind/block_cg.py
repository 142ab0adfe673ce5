"""The Python twin of remat_block_cg: one reference GPT block (bench/py/models.py)
forward + backward, plain or torch.utils.checkpoint(use_reentrant=False), with
callgrind's instrumentation on only around the measured iterations
(<build>/bench/libremat_cg_toggle.so through ctypes; run valgrind with
--instr-atstart=no).
Arguments: plain|ckpt T batch iterations path/to/libremat_cg_toggle.so."""
import ctypes
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))
import models  # noqa: E402

mode, T, B, iters, lib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cg = ctypes.CDLL(lib)
torch.set_num_threads(1)
torch.manual_seed(0)
block = models.GptBlock(512, 8)
block.train()
x = torch.randn(B, T, 512).requires_grad_(True)


def run():
    for p in block.parameters():
        if p.grad is not None:
            p.grad.zero_()
    x.grad = None
    if mode == "plain":
        block(x).sum().backward()
    else:
        checkpoint(block, x, use_reentrant=False).sum().backward()


for _ in range(2):
    run()
cg.cg_start()
for _ in range(iters):
    run()
cg.cg_stop()
print(mode, T, B, iters)
