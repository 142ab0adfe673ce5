"""`make bench`: remat (C++) against PyTorch (Python) on the same LibTorch.

At the reference sizes by default (mlp-ref, gpt-ref, resnet-ref: the
CPU reference GPT stack and an MLP and a ResNet of the same order; a reduced
strategy list, 2 rounds of 3 timed steps, ~35 minutes); with --quick at the
toy sizes (mlp, gpt, resnet: every strategy and every k, 3 rounds, minutes).
For each model runs the C++ worker (bench/compare/
remat_compare) and the Python worker (worker.py) alternately, A B A B, for
--rounds rounds, both under LD_PRELOAD of bench/preload's counter; pools the
step times of all rounds (medians, ratios to the same process's plain run);
then the per-call overhead (Google Benchmark vs timeit, alternately), an RSS
cross-check (one process per strategy) and, with --compile, torch.compile at
activation-memory budgets. Writes bench/results/compare.json (with the
run-metadata record, bench/py/common.py) and compare.md; `make bench` then
runs gen_docs.py, which renders the docs' generated tables and
docs/img/frontier.png from it (--quick: compare-quick.json, compare-quick.md
and frontier-quick.png in bench/results/, ignored by git); the JSON is rewritten
after every model, so a run stopped early keeps what it measured
(--report-only renders it; it also reads the old <build>/bench/compare/
results.json). Prints the tables and targets. Last, the long-context
benchmark (bench/py/longctx.py: remat_longctx and its Python anchor, same
environment; bench/results/longctx.json and longctx-py.json, --quick:
*-quick.json; --longctx skip leaves it out, --longctx only runs just it).
--toy: the toy sizes as --quick, but into compare-toy.json and .md, which are
checked in (gen_docs.py renders the docs' toy tables, fragments
compare-MODEL-toy and the like, and docs/img/frontier-toy.png from them).
Leaves out: multi-threaded runs (one intra-op thread throughout).
"""
import argparse
import json
import os
import sys
import time

from common import HERE, RESULTS, ROOT, load_json, med, metadata, result_path, write_json
import common
BLOCKS = {"mlp": 24, "gpt": 16, "resnet": 8, "mlp-ref": 24, "gpt-ref": 8, "resnet-ref": 6}
BUDGETS = [0.5, 0.35, 0.25, 0.15]
# Reference sizes: steps take seconds, so fewer strategies and 2-3 values of k.
REF_BUDGETS = [0.5, 0.25]
REF_SEQ = {"mlp-ref": [2, 4], "gpt-ref": [2, 4], "resnet-ref": [2, 3]}
QUICK = dict(models="mlp,gpt,resnet", rounds=3, steps=7, sweep_steps=3, warmup=2, timeout=900)
REF = dict(models="gpt-ref,resnet-ref,mlp-ref", rounds=2, steps=3, sweep_steps=3, warmup=1, timeout=3600)


def run(cmd, env, timeout):
    return common.run(cmd, env, timeout).stdout


def merge(outs):
    """Pools the runs of several rounds: step times concatenated, last peak;
    round_x: each round's median / that round's plain median."""
    d = json.loads(outs[0])
    by = {r["name"]: r for r in d["runs"]}
    rounds = [{r["name"]: r for r in json.loads(o)["runs"]} for o in outs]
    for rnd in rounds[1:]:
        for n, r in rnd.items():
            for k in ("ms", "fwd_ms", "bwd_ms"):
                by[n][k] += r[k]
    plain = by["plain"]
    for r in d["runs"]:
        r["median_ms"] = med(r["ms"])
        r["time_x"] = r["median_ms"] / plain["median_ms"] if r["ms"] else float("nan")
        r["round_x"] = [med(rnd[r["name"]]["ms"]) / med(rnd["plain"]["ms"]) for rnd in rounds if rnd[r["name"]]["ms"]]
        r["peak_x"] = r["peak"] / plain["peak"] if r["peak"] > 0 else float("nan")
    d["f_ms"], d["b_ms"] = med(plain["fwd_ms"]), med(plain["bwd_ms"])
    return d


def compare_model(model, a, env):
    if model in REF_SEQ:  # reference size: no selective in remat_compare, no reentrant
        sweep = [f"seq:{k}" for k in REF_SEQ[model]]
        cpp = ["plain", "block", "sqrt"] + [f"opt:{b}" for b in REF_BUDGETS] + sweep
        py = ["plain", "nonreentrant", "sac"] + sweep
    else:
        sweep = [f"seq:{k}" for k in range(1, BLOCKS[model] + 1)]
        cpp = ["plain", "block", "select", "sqrt"] + [f"opt:{b}" for b in BUDGETS] + sweep
        py = ["plain", "nonreentrant", "reentrant", "sac"] + sweep
        if model == "mlp":
            cpp.remove("select")
    common = ["--model", model, "--steps", str(a.steps), "--sweep-steps", str(a.sweep_steps), "--warmup",
              str(a.warmup), "--threads", "1"]
    outs = {"cpp": [], "py": []}
    print(f"{model}: {a.rounds} rounds, C++ and Python alternately", flush=True)
    for _ in range(a.rounds):
        outs["cpp"].append(run([a.compare, *common, "--strategies", ",".join(cpp)], env, a.timeout))
        outs["py"].append(run([sys.executable, os.path.join(HERE, "worker.py"), *common, "--strategies",
                               ",".join(py)], env, a.timeout))
    return {lang: merge(o) for lang, o in outs.items()}


def overhead(a, env):
    cpp, py = [], []
    print("per-call overhead: Google Benchmark and timeit alternately", flush=True)
    for _ in range(a.rounds):
        out = run([a.overhead, "--benchmark_min_time=0.2", "--benchmark_repetitions=5",
                   "--benchmark_enable_random_interleaving=true", "--benchmark_format=json"], env, 300)
        cpp.append({b["run_name"].replace("BM_", ""): b["real_time"] / 1e3 for b in json.loads(out)["benchmarks"]
                    if b.get("aggregate_name") == "median"})
        py.append(json.loads(run([sys.executable, os.path.join(HERE, "overhead.py")], env, 300))["us_per_call"])
    pool = lambda rs: {k: med([r[k] for r in rs]) for k in rs[0]}  # noqa: E731
    return {"cpp": pool(cpp), "py": pool(py)}


def rss(a, env):
    """ru_maxrss growth of a process running one strategy on the toy GPT stack (both sizes)."""
    out = {}
    for lang, exe, strat in [("cpp", [a.compare], "plain"), ("py", [sys.executable, os.path.join(HERE, "worker.py")],
                                                                "plain"),
                             ("cpp", [a.compare], "block"), ("py", [sys.executable, os.path.join(HERE, "worker.py")],
                                                                "nonreentrant")]:
        # plain is always run first (parameter gradients): its own run is the baseline strategy.
        d = json.loads(run([*exe, "--model", "gpt", "--steps", "2", "--warmup", "1", "--rss", "1", "--strategies",
                            strat], env, 300))
        r = d["runs"][-1]
        out[f"{lang}:{strat}"] = dict(rss_delta_kib=d["rss_delta_kib"], peak=r["peak"], param_bytes=d["param_bytes"])
    return out


def compile_runs(a, env):
    strategies = ["plain"] + [f"compile:{b}" for b in a.compile_budgets.split(",")]
    out = run([sys.executable, os.path.join(HERE, "worker.py"), "--model", "gpt", "--steps", "5", "--warmup", "2",
               "--strategies", ",".join(strategies)], env, 1800)
    return merge([out])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--quick", action="store_true", help="toy sizes, every strategy (smoke runs; minutes)")
    ap.add_argument("--toy", action="store_true",
                    help="the toy sizes as --quick, into bench/results/compare-toy.json (checked in: the docs' toy "
                         "tables and docs/img/frontier-toy.png); no long-context run")
    ap.add_argument("--rounds", type=int, help="C++/Python alternations per model (2; --quick 3)")
    ap.add_argument("--steps", type=int, help="timed steps per round, main strategies (3; --quick 7)")
    ap.add_argument("--sweep-steps", type=int, help="timed steps per round, checkpoint_sequential k (3)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per strategy (1; --quick 2)")
    ap.add_argument("--models", help="mlp-ref,gpt-ref,resnet-ref (--quick: mlp,gpt,resnet)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile at budgets (minutes per budget)")
    ap.add_argument("--compile-budgets", default="1.0,0.5,0.15")
    ap.add_argument("--compile-only", action="store_true", help="only torch.compile, into results.json")
    ap.add_argument("--report-only", action="store_true", help="re-render bench/results/compare.json")
    ap.add_argument("--auto", choices=["run", "skip", "only"], default="run",
                    help="the whole-step planner's benchmark (remat_auto, remat_step_solve, auto_py.py) after the "
                         "comparison: run (default; minutes at the reference size, seconds with --quick), skip, or "
                         "only it")
    ap.add_argument("--longctx", choices=["run", "skip", "only"], default="run",
                    help="the long-context benchmark (bench/py/longctx.py) after the comparison: run (default), "
                         "skip, or only it (minutes at the reference size, seconds with --quick)")
    ap.add_argument("--chart", help="a frontier PNG to draw (--quick: bench/results/frontier-quick.png; reference: "
                                    "none, gen_docs.py draws docs/img/frontier.png)")
    ap.add_argument("--malloc", choices=["keep", "default"], default="keep",
                    help="keep (default): both workers' glibc malloc keeps freed memory (MALLOC_MMAP_MAX_=0, "
                         "MALLOC_TRIM_THRESHOLD_=64 GiB), so neither process faults its heap in again every step "
                         "(the C++ one did, 5-8%% of a plain step: docs/BENCHMARKS.md); default: as the OS gives it. "
                         "Not for the RSS cross-check, which measures ru_maxrss as a user's process has it")
    a = ap.parse_args()
    if a.toy:
        a.quick, a.longctx, a.auto = True, "skip", "skip"
    for k, v in (QUICK if a.quick else REF).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    b = os.path.join(a.build, "bench")
    a.compare, a.overhead = os.path.join(b, "remat_compare"), os.path.join(b, "remat_overhead")
    suffix = "-toy" if a.toy else "-quick" if a.quick else ""
    path = result_path(f"compare{suffix}")
    old_path = os.path.join(b, "compare", f"results{suffix}.json")  # before bench/results/
    if a.chart is None and a.quick and not a.toy:
        a.chart = os.path.join(RESULTS, "frontier-quick.png")
    env = dict(os.environ, LD_PRELOAD=os.path.join(b, "libremat_preload.so"), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    rss_env = dict(env)
    if a.malloc == "keep":
        env.update(common.MALLOC_KEEP)
    if a.auto == "only":
        import auto_results
        auto_results.drive(a.build, a.quick, env)
        return
    if a.longctx == "only":
        import longctx
        longctx.drive(a.build, a.quick, env)
        return
    if a.compile_only:  # add torch.compile to an earlier run's results
        res = load_json(path, old_path)
        res["compile"] = compile_runs(a, env)
        write_json(path, res)
    elif a.report_only:
        res = load_json(path, old_path)
    else:
        t0 = time.time()
        settings = dict(rounds=a.rounds, steps=a.steps, sweep_steps=a.sweep_steps, warmup=a.warmup,
                        malloc=a.malloc, models=a.models)
        meta = metadata(settings)
        res = {"meta": meta, "models": {}, "machine": machine(meta), "size": "toy" if a.toy else "quick" if a.quick else "reference",
               "settings": settings, "load": [os.getloadavg()[0]]}
        # The short parts first, then one model at a time, saved after each.
        res["overhead_us"] = overhead(a, env)
        res["rss"] = rss(a, rss_env)
        for m in a.models.split(","):
            res["models"][m] = compare_model(m, a, env)
            res["load"].append(os.getloadavg()[0])
            res["wall_s"] = time.time() - t0
            write_json(path, res)
        if a.compile:
            res["compile"] = compile_runs(a, env)
        elif os.path.exists(path):  # keep an earlier torch.compile run
            old = json.load(open(path))
            if "compile" in old:
                res["compile"] = old["compile"]
        res["wall_s"] = time.time() - t0
        write_json(path, res)
    if a.longctx == "run" and not (a.report_only or a.compile_only):
        import longctx
        longctx.drive(a.build, a.quick, env)
    if a.auto == "run" and not (a.report_only or a.compile_only):
        import auto_results
        auto_results.drive(a.build, a.quick, env)
    import report
    md = report.render(res, a.chart)
    md_path = os.path.join(RESULTS, f"compare{suffix}.md")
    with open(md_path, "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {path}, {md_path}" + (f", {a.chart}" if a.chart else ""))


def machine(meta):
    """The machine line report.py renders (the run-metadata record has the rest)."""
    import torch
    return dict(nproc=meta["nproc"], cpu=meta["cpu"], torch=meta["torch"], threads=1,
                parallel=torch.__config__.parallel_info().splitlines()[-1].strip())


if __name__ == "__main__":
    main()
