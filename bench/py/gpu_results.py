"""Docs fragments from bench/results/gpu-h200.json, the figures of a run of
bench/gpu/check.sh and bench/gpu/remat_longctx_gpu on a lent H200:
gpu-blocks (the reference GPU GPT block stack, remat against PyTorch) and
gpu-longctx (remat's whole GPT step with a 32k vocabulary, plain, per-block
and the chunked head + loss and MLP).
Leaves out: running anything (bench/gpu/check.sh does, on the GPU machine).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, load_json  # noqa: E402

GIB = 1 << 30
LABELS = {"plain": "plain", "block": "checkpoint per block", "matmuls": "selective, save_matmuls",
          "nonreentrant": "torch.utils.checkpoint per block", "sac": "SAC, save mm/addmm/bmm",
          "megatron": "Megatron policy per block", "offload": "per block, inputs to pinned host",
          "step@0.5": "whole-step planner at 0.5",
          "step@lean": "whole-step planner, leanest plan"}


def blocks(res):
    rows = ["| attention | library | strategy | peak GiB | step ms | tokens/s | largest batch under 40 GiB |",
            "|---|---|---|---:|---:|---:|---:|"]
    for side, name in (("cpp", "remat"), ("python", "PyTorch")):
        part = res.get(side) or {}
        for r in part.get("runs", []):
            mb = r.get("max_batch", -1)
            rows.append(f"| {r['attention']} | {name} | {LABELS.get(r['strategy'], r['strategy'])} | "
                        f"{r['peak_bytes'] / GIB:.2f} | {r['median_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                        f"{mb if mb > 0 else 'not searched'} |")
    m = res["metadata"]
    return (f"{m['device']}, PyTorch {m['torch']} (its LibTorch for remat), commit {m['git_commit']}, "
            f"{m['date_utc']}. GPT blocks: d_model 2048, 16 heads, T 2048, batch 8, 24 blocks, bf16 autocast; "
            "forward + backward of the stack, no optimizer. Peak: the CUDA caching allocator's allocated bytes "
            "of one step, parameters and gradients included (torch.cuda.max_memory_allocated). Step: median of "
            "the timed steps (3 for remat, 5 for PyTorch), one process per library, not interleaved.\n\n"
            + "\n".join(rows))


def longctx(res):
    lc = res["longctx"]
    runs = {r["strategy"]: r for r in lc["runs"]}
    plain, block = runs.get("plain"), runs.get("block")
    names = {"plain": "plain", "block": "checkpoint per block", "loss": "chunked head+loss",
             "loss+block": "chunked head+loss + per block", "all": "chunked head+loss+MLP + per block"}
    rows = ["| strategy | peak above start GiB | vs plain | vs per block | whole step GiB | step ms | vs plain | loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in runs.items():
        if r["error"]:
            rows.append(f"| {names.get(key, key)} | failed: {r['error'][:80]} | | | | | | |")
            continue
        rows.append(f"| {names.get(key, key)} | {r['peak_bytes'] / GIB:.2f} | {r['peak_bytes'] / plain['peak_bytes']:.3f} | "
                    f"{r['peak_bytes'] / block['peak_bytes']:.3f} | {r['total_peak_bytes'] / GIB:.2f} | "
                    f"{r['step_s'] * 1000:.1f} | {r['step_s'] / plain['step_s']:.3f} | {r['loss']:.4f} |")
    return (f"remat's whole GPT step (embedding, blocks, final LayerNorm, tied head, cross-entropy, backward; no "
            f"optimizer) on the {res['metadata']['device'].split(' (')[0]}: d_model {lc['d_model']}, {lc['heads']} "
            f"heads, {lc['blocks']} blocks, T 2048, batch 8, vocabulary {lc['vocab']}, SDPA attention, bf16 "
            f"autocast; head+loss in {lc['loss_chunks']} slices, MLP in {lc['mlp_chunks']}. Peak above start: "
            "the CUDA caching allocator's peak minus the bytes live before the step (parameters and gradients); "
            "whole step: the peak with them. Step: median of 3 synchronized steps after one warm-up, one process, "
            "strategies one after the other. The same loss in every row (same model and data).\n\n"
            + "\n".join(rows))


def fragments():
    path = os.path.join(RESULTS, "gpu-h200.json")
    if not os.path.exists(path):
        return {}
    res = load_json(path)
    return {"gpu-blocks": blocks(res), "gpu-longctx": longctx(res)}


if __name__ == "__main__":
    for name, md in fragments().items():
        print(f"<!-- {name} -->\n{md}\n")
