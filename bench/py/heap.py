"""glibc's heap trimming and plain steps (docs/BENCHMARKS.md, "glibc's heap
trimming"): the plain step of each reference model in the C++ worker
(remat_compare) and the Python worker (worker.py), with glibc malloc as the OS
sets it and with freed memory kept (common.MALLOC_KEEP), counting each step's
minor page faults.

Builds nothing: takes --build DIR with remat_compare and libremat_preload.so
built. Per model and heap setting, --rounds rounds of C++ then Python, each
process running plain only (1 warm-up and --steps timed steps), both under
LD_PRELOAD of bench/preload's counter, 1 intra-op thread, as `make bench`
runs them. Writes bench/results/heap.json (this driver's run-metadata
record; each worker's output keeps its own; --quick: the toy models,
heap-quick.json); gen_docs.py renders the fragment heap-faults.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import MALLOC_KEEP, med, metadata, result_path, run, run_line, write_json  # noqa: E402

HEAPS = {"default": "glibc default", "keep": "kept (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`)"}


def render(res):
    s = res["meta"]["settings"]
    load = res["load"]
    out = [f"{run_line(res['meta'], load)} Plain steps only: per model and heap, {s['rounds']} rounds of the C++ process (remat_compare) then the "
           f"Python one (worker.py), 1 warm-up and {s['steps']} timed steps each; minor page faults per step "
           f"(getrusage) and step ms, range over every timed step (median); C++ / Python: ratio of the medians. "
           f"1 intra-op thread, preload counter in both.",
           "",
           "| model | heap | C++ minor faults / step | Python minor faults / step | C++ plain ms, range (median) "
           "| Python plain ms, range (median) | C++ / Python |",
           "|---|---|---|---|---|---|---:|"]
    for model, heaps in res["models"].items():
        for heap, langs in heaps.items():
            cell = {}
            for lang in ("cpp", "py"):
                runs = [next(r for r in o["runs"] if r["name"] == "plain") for o in langs[lang]]
                ms = [v for r in runs for v in r["ms"]]
                f = [int(v) for r in runs for v in r["faults"]]
                cell[lang] = (f"{min(f):,}-{max(f):,}" if min(f) != max(f) else f"{min(f):,}",
                              f"{min(ms):.0f}-{max(ms):.0f} ({med(ms):.0f})", med(ms))
            out.append(f"| {model} | {HEAPS[heap]} | {cell['cpp'][0]} | {cell['py'][0]} | {cell['cpp'][1]} | "
                       f"{cell['py'][1]} | {cell['cpp'][2] / cell['py'][2]:.2f} |")
    return "\n".join(out) + "\n"


def fragments(res):
    """The docs' generated fragment of a heap result (gen_docs.py): NAME -> markdown."""
    return {"heap-faults": render(res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true", help="the toy models, seconds (smoke runs)")
    ap.add_argument("--models", help="mlp-ref,gpt-ref,resnet-ref (--quick: mlp,gpt,resnet)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    a.models = a.models or ("mlp,gpt,resnet" if a.quick else "mlp-ref,gpt-ref,resnet-ref")
    b = os.path.join(a.build, "bench")
    exe, preload = os.path.join(b, "remat_compare"), os.path.join(b, "libremat_preload.so")
    for f in (exe, preload):
        if not os.path.exists(f):
            sys.exit(f"{f} is missing: cmake --build {a.build} --target remat_compare remat_preload")
    env = dict(os.environ, LD_PRELOAD=preload, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(k, None)
    common = ["--strategies", "plain", "--steps", str(a.steps), "--warmup", "1", "--threads", "1"]
    t0 = time.time()
    res = dict(meta=metadata(dict(models=a.models, rounds=a.rounds, steps=a.steps, quick=a.quick)), models={},
               load=[os.getloadavg()[0]])
    path = result_path("heap", a.quick)
    for model in a.models.split(","):
        res["models"][model] = {}
        for heap in HEAPS:
            e = dict(env, **MALLOC_KEEP) if heap == "keep" else env
            langs = {"cpp": [], "py": []}
            for _ in range(a.rounds):
                for lang, cmd in (("cpp", [exe]), ("py", [sys.executable, os.path.join(HERE, "worker.py")])):
                    p = run([*cmd, "--model", model, *common], e, 1800, label=f"{model} {heap} {lang}")
                    langs[lang].append(json.loads(p.stdout))
            res["models"][model][heap] = langs
            res["load"].append(os.getloadavg()[0])
        res["wall_s"] = time.time() - t0
        write_json(path, res)
    print(render(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
