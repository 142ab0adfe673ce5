"""Merges what bench/gpu/check.sh collected into results.json and summary.md.

Usage: summarize.py WORK OUT ELAPSED_S. WORK holds phases.txt ("name|status|
seconds|detail" lines), missing.txt, torch.txt and the benchmarks' JSON
(cpp.json from remat_gpu_bench, py.json and py_compile.json from
gpu_bench.py); each may be absent. Figures are printed as measured; nothing
is filled in for what did not run.
"""
import json
import os
import sys

GIB = float(1 << 30)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def lines(path):
    try:
        with open(path) as f:
            return [ln.rstrip("\n") for ln in f if ln.strip()]
    except OSError:
        return []


def gib(b):
    """Bytes as GiB with 2 decimals, or MiB below 1 GiB (toy sizes)."""
    if not isinstance(b, (int, float)) or b < 0:
        return "-"
    return f"{b / GIB:.2f} GiB" if b >= GIB / 2 else f"{b / (1 << 20):.1f} MiB"


def main():
    work, out, elapsed = sys.argv[1], sys.argv[2], sys.argv[3]
    phases = [dict(zip(("name", "status", "seconds", "detail"), (p.split("|", 3) + [""] * 4)[:4]))
              for p in lines(os.path.join(work, "phases.txt"))]
    missing = lines(os.path.join(work, "missing.txt"))
    torch_info = dict(ln.split(" ", 1) for ln in lines(os.path.join(work, "torch.txt")) if " " in ln)
    benches = {k: load(os.path.join(work, f"{k}.json")) for k in ("cpp", "py", "py_compile")}
    results = dict(elapsed_s=int(elapsed), torch=torch_info, phases=phases, missing=missing, bench=benches)
    md = ["# bench/gpu/check.sh", ""]
    md.append(f"torch {torch_info.get('version', '?')} (CUDA {torch_info.get('cuda', '?')}), "
              f"GPU {torch_info.get('gpu', '?').replace('_', ' ')}; {elapsed} s in all.")
    md += ["", "| phase | status | s | detail |", "| --- | --- | ---: | --- |"]
    md += [f"| {p['name']} | {p['status']} | {p['seconds']} | {p['detail'].replace('|', '/')} |" for p in phases]
    tests = [ln for ln in lines(os.path.join(out, "tests.log"))
             if ln.startswith(("[  PASSED  ]", "[  SKIPPED ]", "[  FAILED  ]")) and "test" in ln and "," not in ln[:14]]
    tests = [ln for ln in tests if ln[13:14].isdigit()]
    results["tests"] = tests
    if tests:
        md += ["", "test_cuda: " + " ".join(t.replace(", listed below:", "").strip() for t in tests)]
    if missing:
        md += ["", "Missing on this machine:", ""] + [f"- {m}" for m in missing]
    runs = []
    for k, b in benches.items():
        if b:
            for r in b.get("runs", []):
                runs.append((("C++ remat" if b["lang"] == "cpp" else "Python"), b, r))
    if runs:
        b0 = runs[0][1]
        md += ["", f"GPT blocks: d_model {b0['d_model']}, {b0['heads']} heads, T {b0['seq_len']}, batch "
                   f"{b0['batch']}, {b0['blocks']} blocks, autocast {b0['autocast']}, device {b0['device']}; "
                   f"forward + backward of the stack (.sum() loss), no optimizer. Peak: allocated bytes of one "
                   f"step (parameters, gradients and input included). Step: median of the timed steps. "
                   f"Largest batch: peak within {gib(b0['budget_bytes'])}.", ""]
        if benches.get("cpp") and benches["cpp"].get("sdpa_vs_explicit_max_abs_diff", -1) >= 0:
            md += [f"C++ GptBlock, SDPA against explicit attention (one block, float32, same weights): max |diff| "
                   f"{benches['cpp']['sdpa_vs_explicit_max_abs_diff']:.3g}.", ""]
        md += ["| attention | side | strategy | peak | step ms | tokens/s | largest batch | note |",
               "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for attention in ("explicit", "sdpa"):
            for side, b, r in runs:
                if r["attention"] != attention:
                    continue
                mb = r.get("max_batch", -1)
                mbs = "-" if mb is None or mb < 0 else str(mb)
                if r.get("search_note"):
                    mbs += f" ({r['search_note']})"
                ms = f"{r['median_ms']:.1f}" if r.get("median_ms", -1) > 0 else "-"
                tok = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s", -1) > 0 else "-"
                note = r.get("note", "")
                if r.get("predicted_bytes", -1) >= 0:
                    # step@...: the whole-step planner predicts the step's peak; auto: the chain's activations.
                    what = "step peak" if r["strategy"].startswith("step@") else "of activations"
                    note = (note + "; " if note else "") + f"plan predicted {gib(r['predicted_bytes'])} {what}"
                md.append(f"| {attention} | {side} | {r['strategy']} | {gib(r.get('peak_bytes', -1))} | {ms} | {tok} "
                          f"| {mbs} | {note.replace('|', '/')} |")
    else:
        md += ["", "No benchmark figures (see the phases above)."]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
