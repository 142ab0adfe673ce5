"""The Python PyTorch half of the GPU benchmark (bench/gpu/check.sh runs it
next to remat_gpu_bench, the C++ half; same workload, same JSON fields).

The reference GPU workload: a stack of bench/py/models.py's
GptBlock (d_model 2048, 16 heads, T 2048, batch 8, 24 blocks) under bf16
autocast, with explicit attention and with SDPA; a float32 (B, T, C) input
that requires grad; the stack ends in .sum(). Strategies:
  plain         no checkpointing
  nonreentrant  torch.utils.checkpoint per block (use_reentrant=False)
  sac           selective activation checkpointing per block, saving the
                matmul and attention-kernel outputs (remat's save_matmuls)
  compile:B     torch.compile with torch._functorch.config.
                activation_memory_budget = B (slow to compile: check.sh runs
                it on its own, under a time limit)
Per strategy and attention: peak device memory of one step
(torch.cuda.max_memory_allocated, parameters, gradients and input included),
the median of --steps synchronized step times after --warmup, tokens/s and
the largest batch whose step peak stays within --budget-gib (doubling, then
bisection). --device cpu --quick is a smoke run at a toy size (memory only
with the LD_PRELOAD counter of bench/preload, else -1).
Leaves out: embeddings, the loss head and the optimizer step.
"""
import argparse
import ctypes
import functools
import json
import os
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))
import models  # noqa: E402


def sac_ops():
    """The aten overloads remat's policy::save_matmuls() saves that exist here."""
    names = ["mm.default", "addmm.default", "bmm.default", "baddbmm.default",
             "_scaled_dot_product_flash_attention.default",
             "_scaled_dot_product_flash_attention_for_cpu.default",
             "_scaled_dot_product_efficient_attention.default",
             "_scaled_dot_product_cudnn_attention.default",
             "convolution.default"]
    ops = []
    for n in names:
        packet, overload = n.split(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload):
            ops.append(getattr(op, overload))
    return ops


class Meter:
    """Device memory: the CUDA caching allocator, or on CPU the preload
    counter when loaded (else nothing: every reading is -1)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.lib = None
        if not self.cuda:
            try:
                lib = ctypes.CDLL(None)
                lib.remat_preload_current_bytes.restype = ctypes.c_int64
                lib.remat_preload_peak_bytes.restype = ctypes.c_int64
                self.lib = lib
            except AttributeError:
                pass
        self.name = ("torch.cuda.max_memory_allocated" if self.cuda
                     else "preload" if self.lib else "none (CPU without LD_PRELOAD)")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.lib:
            self.lib.remat_preload_reset_peak()

    def current(self):
        if self.cuda:
            return torch.cuda.memory_allocated()
        return self.lib.remat_preload_current_bytes() if self.lib else -1

    def peak(self):
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        return self.lib.remat_preload_peak_bytes() if self.lib else -1

    def empty(self):
        if self.cuda:
            torch.cuda.empty_cache()


def is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


class Bench:
    def __init__(self, a, device):
        self.a, self.device = a, device
        self.meter = Meter(device)
        self.start = time.perf_counter()
        self.budget = a.budget_gib * (1 << 30)

    def out_of_time(self):
        return time.perf_counter() - self.start > self.a.time_limit_s

    def build(self, sdpa):
        torch.manual_seed(0)
        a = self.a
        with self.device:  # initialised where it runs: seconds less per build at the reference size
            seq = torch.nn.Sequential(*[models.GptBlock(a.d_model, a.heads, sdpa) for _ in range(a.blocks)])
        seq = seq.train()
        for p in seq.parameters():  # gradients exist from the start, so every measured step has them live
            p.grad = torch.zeros_like(p)
        return seq

    def input(self, batch):
        torch.manual_seed(1)
        return torch.randn(batch, self.a.seq_len, self.a.d_model, device=self.device).requires_grad_(True)

    def strategy(self, name, seq):
        def per_block(wrap):
            def run(x):
                h = x
                for b in seq:
                    h = wrap(b, h)
                return h
            return run

        if name == "plain":
            return seq
        if name == "nonreentrant":
            return per_block(lambda b, h: checkpoint(b, h, use_reentrant=False))
        if name == "sac":
            ctx = functools.partial(create_selective_checkpoint_contexts, sac_ops())
            return per_block(lambda b, h: checkpoint(b, h, use_reentrant=False, context_fn=ctx))
        if name.startswith("compile:"):
            import torch._functorch.config as fconfig
            torch._dynamo.reset()
            fconfig.activation_memory_budget = float(name[8:])
            return torch.compile(seq)
        raise SystemExit(f"gpu_bench.py: unknown strategy {name} (plain, nonreentrant, sac, compile:B)")

    def step(self, seq, fn, x):
        for p in seq.parameters():
            if p.grad is not None:
                p.grad.zero_()
        x.grad = None
        self.meter.sync()
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.a.autocast == "bf16"):
            loss = fn(x).sum()
        loss.backward()
        self.meter.sync()
        return time.perf_counter() - t0

    def peak_of(self, seq, fn, x):
        for p in seq.parameters():
            if p.grad is not None:
                p.grad.zero_()
        self.meter.sync()
        self.meter.reset()
        base = self.meter.current()
        self.step(seq, fn, x)
        return self.meter.peak(), base

    def probe(self, seq, name, batch):
        """Peak of one step at this batch; -1 on out of memory."""
        try:
            x = self.input(batch)
            return self.peak_of(seq, self.strategy(name, seq), x)[0]
        except Exception as e:  # noqa: BLE001 - report and go on
            if not is_oom(e):
                raise
            for p in seq.parameters():
                p.grad = None if p.grad is None else p.grad.zero_()
            self.meter.empty()
            return -1

    def search(self, seq, r):
        """Largest batch within the budget: doubling up (or halving down)
        from the reference batch, then bisection."""
        a = self.a
        if self.meter.current() < 0:
            r["search_note"] = "no memory meter"
            return

        def fits(batch):
            p = self.probe(seq, r["strategy"], batch)
            r["probes"].append([batch, p])
            if 0 <= p <= self.budget:
                if batch > r["max_batch"]:
                    r["max_batch"], r["max_batch_peak_bytes"] = batch, p
                return True
            return False

        lo, hi, bt = 0, -1, 1
        if 0 <= r["peak_bytes"] <= self.budget:
            lo = r["max_batch"] = a.batch
            r["max_batch_peak_bytes"] = r["peak_bytes"]
            bt = 2 * lo
        elif r["peak_bytes"] >= 0 or r["note"] == "out of memory":
            hi, bt = a.batch, max(1, a.batch // 2)
        used = 0
        while used < a.search_probes and not self.out_of_time():
            if lo > 0 and hi >= 0:
                if hi - lo <= 1:
                    break
                mid = lo + (hi - lo) // 2
                used += 1
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
                continue
            if 0 <= hi <= 1 or bt > a.max_batch:
                break
            used += 1
            if fits(bt):
                lo = bt
                if hi < 0:
                    bt *= 2
            else:
                hi = bt
                if lo == 0:
                    bt = max(1, bt // 2)
        notes = []
        if hi >= 0 and lo > 0 and hi - lo > 1:
            notes.append(f"between {lo} and {hi}")
        if hi < 0 and lo > 0:
            notes.append(f"at least {lo} (search capped)")
        if lo == 0 and hi == 1:
            r["max_batch"] = 0
            notes.append("batch 1 does not fit")
        if self.out_of_time():
            notes.append("time limit reached")
        r["search_note"] = "; ".join(notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="toy size for smoke runs")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--blocks", type=int)
    ap.add_argument("--attention", default="explicit,sdpa")
    ap.add_argument("--strategies", default="plain,nonreentrant,sac")
    ap.add_argument("--search", default="plain,nonreentrant,sac", help="strategies whose largest batch is searched")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--search-probes", type=int, default=6)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--budget-gib", type=float)
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "off"])
    ap.add_argument("--time-limit-s", type=float, default=170)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    q = a.quick
    for k, full, toy in [("d_model", 2048, 64), ("heads", 16, 4), ("seq_len", 2048, 64), ("batch", 8, 2),
                         ("blocks", 24, 4), ("steps", 5, 2), ("warmup", 2, 1), ("budget_gib", 40.0, 0.05),
                         ("threads", 8, 1)]:
        if getattr(a, k) is None:
            setattr(a, k, toy if q else full)
    torch.set_num_threads(a.threads)
    os.environ.pop("LD_PRELOAD", None)  # loaded already; keep it out of compiler subprocesses
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench.py: --device cuda but torch.cuda.is_available() is False")
    device = torch.device(a.device)
    b = Bench(a, device)
    results = []
    for attention in a.attention.split(","):
        if attention not in ("explicit", "sdpa"):
            sys.exit("gpu_bench.py: --attention takes explicit and/or sdpa")
        seq = b.build(attention == "sdpa")
        x = b.input(a.batch)
        live = []
        for name in a.strategies.split(","):
            r = dict(attention=attention, strategy=name, peak_bytes=-1, base_bytes=-1, predicted_bytes=-1,
                     median_ms=-1.0, tokens_per_s=-1.0, ms=[], max_batch=-1, max_batch_peak_bytes=-1,
                     search_note="", probes=[], note="")
            fn = None
            if b.out_of_time():
                r["note"] = "skipped: time limit"
            else:
                try:
                    fn = b.strategy(name, seq)
                    t0 = time.perf_counter()
                    for _ in range(a.warmup):
                        b.step(seq, fn, x)
                    if name.startswith("compile:"):
                        r["note"] = f"compile+warm-up {time.perf_counter() - t0:.0f} s"
                    r["peak_bytes"], r["base_bytes"] = b.peak_of(seq, fn, x)
                except Exception as e:  # noqa: BLE001 - report, keep going
                    r["note"] = "out of memory" if is_oom(e) else \
                        f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    fn = None
                    b.meter.empty()
            live.append((r, fn))
        for _ in range(a.steps):  # interleaved: A B C A B C ...
            if b.out_of_time():
                break
            for r, fn in live:
                if fn is not None:
                    r["ms"].append(1e3 * b.step(seq, fn, x))
        for r, fn in live:
            if r["ms"]:
                r["median_ms"] = sorted(r["ms"])[len(r["ms"]) // 2]
                r["tokens_per_s"] = a.batch * a.seq_len / (r["median_ms"] / 1e3)
            results.append(r)
        fn = live = None  # the strategies' closures hold the model
        del seq, x
        b.meter.empty()
    # Largest batches, after every timing: first for the first two strategies
    # of --search on every attention, then for the rest, while time is left.
    order = [s for s in a.search.split(",") if s] if a.search not in ("", "none") else []
    for first in (True, False):
        for attention in a.attention.split(","):
            todo = [r for r in results if r["attention"] == attention and r["strategy"] in order
                    and (order.index(r["strategy"]) < 2) == first and not r["note"].startswith("skipped")]
            if not todo:
                continue
            if b.out_of_time():
                for r in todo:
                    r["search_note"] = "skipped: time limit"
                continue
            seq = b.build(attention == "sdpa")
            for r in todo:
                if b.out_of_time():
                    r["search_note"] = "skipped: time limit"
                else:
                    b.search(seq, r)
            del seq
            b.meter.empty()
    params = sum(p.numel() for p in models.GptBlock(a.d_model, a.heads).parameters()) * a.blocks
    out = dict(lang="py", torch=torch.__version__, device=a.device, meter=b.meter.name, autocast=a.autocast,
               d_model=a.d_model, heads=a.heads, seq_len=a.seq_len, batch=a.batch, blocks=a.blocks, params=params,
               budget_bytes=int(b.budget), elapsed_s=round(time.perf_counter() - b.start, 3), runs=results)
    text = json.dumps(out)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
