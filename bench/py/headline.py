"""The README's headline table (fragment readme-headline) from the result
files of bench/results/: compare.json (the three reference workloads,
remat against torch.utils.checkpoint), longctx.json (the GPT step with a
32k vocabulary), long_context_fits.json (what fits under 2 GiB),
auto-levers.json (auto with every lever at its leanest), fits-d-model.json
(the widest model under one whole-step cap) and gpu-h200.json (the GPU check). A row whose result file is absent is left
out; with none of them there is no fragment and the README keeps its table.
Leaves out: measuring (make bench, bench/py/long_context_fits.py,
bench/gpu/check.sh) and the method (docs/BENCHMARKS.md).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, load_json  # noqa: E402
from report import paired  # noqa: E402  (docs/BENCHMARKS.md's "time / plain (paired)")

# The reference workloads (docs/BENCHMARKS.md) as bench/py/models.py builds them.
WORKLOADS = {
    "mlp-ref": "MLP, 24 x (Linear 1024 + GELU), batch 2048",
    "gpt-ref": "GPT stack (8 blocks, d_model 512, T 512, batch 4)",
    "resnet-ref": "ResNet (3 stages x 2 basic blocks, width 32, batch 100)",
}


def run(side, name):
    return next((r for r in side["runs"] if r["name"] == name), None)


def x(v):
    return f"{v:.2f}x" if v == v else "-"  # NaN: not measured


def x3(v):
    """A compare.json ratio as docs/BENCHMARKS.md's tables print it (3 decimals), so the two cannot disagree."""
    return f"{v:.3f}x" if v == v else "-"


def compare_rows(res):
    """Per reference workload: peak / plain and the paired time / plain (report.paired: the figures of
    docs/BENCHMARKS.md's compare-*-ref tables, from the same compare.json)."""
    rows = []
    for key, title in WORKLOADS.items():
        m = res["models"].get(key)
        if not m:
            continue
        rb, pb = run(m["cpp"], "block"), run(m["py"], "nonreentrant")
        if rb and pb:
            rows.append(f"| {title} | checkpoint per block, remat / `torch.utils.checkpoint` | "
                        f"{x3(rb['peak_x'])} / {x3(pb['peak_x'])} | {x3(paired(rb))} / {x3(paired(pb))} |")
        opt = run(m["cpp"], "opt:0.25")
        if key == "gpt-ref" and opt and opt["peak_x"] == opt["peak_x"]:
            rows.append(f"| {title} | planner at a 0.25 budget | {x3(opt['peak_x'])} | {x3(paired(opt))} |")
    return rows


def longctx_rows():
    path = os.path.join(RESULTS, "longctx.json")
    if not os.path.exists(path):
        return []
    import longctx
    _, recs = longctx.load(path)
    by = {r["name"]: r for r in recs if r["lang"] == "cpp"}
    both, block = by.get("chunk_block"), by.get("block")
    if not both or not block:
        return []
    return [f"| GPT step, 32k vocabulary (same stack, embedding, head, loss, AdamW) | chunked head + loss with "
            f"per-block checkpointing | {x(both['peak_x'])} (per-block alone {x(block['peak_x'])}) | "
            f"{x(both['time_x'])} (per-block alone {x(block['time_x'])}) |"]


def fits_rows():
    path = os.path.join(RESULTS, "long_context_fits.json")
    if not os.path.exists(path):
        return []
    rows = [r for r in load_json(path)["rows"] if r["cap"] == "2GiB"]
    by = {r["key"]: r["max_seq_len"] for r in rows}
    keys = [k for k in ("none", "block", "loss_block") if k in by]
    if len(keys) < 2:
        return []
    names = {"none": "plain", "block": "per-block", "loss_block": "chunked head + loss with per-block"}
    return [f"| GPT step, 32k vocabulary, under 2 GiB | {' / '.join(names[k] for k in keys)} | "
            f"{' / '.join(str(by[k]) for k in keys)} tokens | |"]


def levers_rows():
    """auto with every lever at its leanest (auto-levers.json), and the widest model under one whole-step cap
    (fits-d-model.json)."""
    rows = []
    path = os.path.join(RESULTS, "auto-levers.json")
    if os.path.exists(path):
        import json
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        autos = [r for r in recs if r["kind"] == "strategy" and r["name"] != "plain"]
        if autos:
            lean = min(autos, key=lambda r: r["peak"])
            t = lean["time_ratio"]
            rows.append(f"| GPT whole step (parameters, gradients, AdamW state, activations; 8 blocks, d_model 512, "
                        f"T 512, batch 4, vocabulary 8192) | `auto_checkpoint` with every lever (updates in backward, "
                        f"state on disk, loss chunks) at its leanest | {x(lean['peak_ratio'])} (whole step) | "
                        f"{t['median']:.2f}x [{t['min']:.2f}-{t['max']:.2f}] |")
    path = os.path.join(RESULTS, "fits-d-model.json")
    if os.path.exists(path):
        res = load_json(path)
        by = {r["key"]: r for r in res["rows"]}
        keys = [k for k in ("none", "block", "auto_all") if k in by]
        if len(keys) >= 2:
            names = {"none": "plain", "block": "per-block", "auto_all": "auto with every lever"}

            def width(r):
                return (">= " if r.get("at_limit") else "") + f"{r['max_d_model']} ({r['parameters'] / 1e6:.1f}M)"
            rows.append(f"| GPT, widest model under {res['rows'][0]['cap']} on the whole step (8 blocks, T 512, batch "
                        f"4) | {' / '.join(names[k] for k in keys)} | d_model {' / '.join(width(by[k]) for k in keys)} "
                        f"| |")
    return rows


def gpu_rows():
    path = os.path.join(RESULTS, "gpu-h200.json")
    if not os.path.exists(path):
        return []
    res = load_json(path)
    cpp = {(r["attention"], r["strategy"]): r for r in (res.get("cpp") or {}).get("runs", [])}
    py = {(r["attention"], r["strategy"]): r for r in (res.get("python") or {}).get("runs", [])}
    rb, pb = cpp.get(("sdpa", "block")), py.get(("sdpa", "nonreentrant"))
    rp, pp = cpp.get(("sdpa", "plain")), py.get(("sdpa", "plain"))
    if not (rb and pb and rp and pp):
        return []
    gib = 1 << 30
    return [f"| H200, GPT blocks (d_model 2048, T 2048, batch 8, 24 blocks, bf16) | checkpoint per block, remat / "
            f"`torch.utils.checkpoint` | {rb['peak_bytes'] / gib:.1f} / {pb['peak_bytes'] / gib:.1f} GiB (plain "
            f"{rp['peak_bytes'] / gib:.1f} / {pp['peak_bytes'] / gib:.1f}) | {rb['median_ms']:.0f} / "
            f"{pb['median_ms']:.0f} ms (plain {rp['median_ms']:.0f} / {pp['median_ms']:.0f}) |"]


def fragments():
    rows = []
    path = os.path.join(RESULTS, "compare.json")
    if os.path.exists(path):
        rows += compare_rows(load_json(path))
    rows += longctx_rows() + fits_rows() + levers_rows() + gpu_rows()
    if not rows:
        return {}
    head = ["| Workload | Strategy | Memory (x plain, CPU: activations) | Step time (x plain; CPU: paired) |",
            "|---|---|---|---|"]
    return {"readme-headline": "\n".join(head + rows)}


if __name__ == "__main__":
    print(fragments().get("readme-headline", "(no results)"))
