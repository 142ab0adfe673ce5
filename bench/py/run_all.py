"""`make bench`: remat (C++) against PyTorch (Python) on the same LibTorch.

For each model (mlp, gpt, resnet) runs the C++ worker (bench/compare/
remat_compare) and the Python worker (worker.py) alternately, A B A B, for
--rounds rounds, both under LD_PRELOAD of bench/preload's counter; pools the
step times of all rounds (medians, ratios to the same process's plain run);
then the per-call overhead (Google Benchmark vs timeit, alternately), an RSS
cross-check (one process per strategy) and, with --compile, torch.compile at
activation-memory budgets. Writes <build>/bench/compare/results.json and
results.md, and docs/img/frontier.png; prints the tables and targets.
Leaves out: multi-threaded runs (one intra-op thread throughout).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BLOCKS = {"mlp": 24, "gpt": 16, "resnet": 8}
BUDGETS = [0.5, 0.35, 0.25, 0.15]


def run(cmd, env, timeout):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    print(f"  {os.path.basename(cmd[0])} {' '.join(cmd[1:5])} ... {time.time() - t0:.0f} s", flush=True)
    return p.stdout


def med(v):
    return statistics.median(v) if v else float("nan")


def merge(outs):
    """Pools the runs of several rounds: step times concatenated, last peak."""
    d = json.loads(outs[0])
    by = {r["name"]: r for r in d["runs"]}
    for o in outs[1:]:
        for r in json.loads(o)["runs"]:
            for k in ("ms", "fwd_ms", "bwd_ms"):
                by[r["name"]][k] += r[k]
    plain = by["plain"]
    for r in d["runs"]:
        r["median_ms"] = med(r["ms"])
        r["time_x"] = r["median_ms"] / plain["median_ms"] if r["ms"] else float("nan")
        r["peak_x"] = r["peak"] / plain["peak"] if r["peak"] > 0 else float("nan")
    d["f_ms"], d["b_ms"] = med(plain["fwd_ms"]), med(plain["bwd_ms"])
    return d


def compare_model(model, a, env):
    n = BLOCKS[model]
    sweep = [f"seq:{k}" for k in range(1, n + 1)]
    cpp = ["plain", "block", "select", "sqrt"] + [f"opt:{b}" for b in BUDGETS] + sweep
    py = ["plain", "nonreentrant", "reentrant", "sac"] + sweep
    if model == "mlp":
        cpp.remove("select")
    common = ["--model", model, "--steps", str(a.steps), "--sweep-steps", str(a.sweep_steps), "--warmup", "2",
              "--threads", "1"]
    outs = {"cpp": [], "py": []}
    print(f"{model}: {a.rounds} rounds, C++ and Python alternately", flush=True)
    for _ in range(a.rounds):
        outs["cpp"].append(run([a.compare, *common, "--strategies", ",".join(cpp)], env, 900))
        outs["py"].append(run([sys.executable, os.path.join(HERE, "worker.py"), *common, "--strategies",
                               ",".join(py)], env, 900))
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
    """ru_maxrss growth of a process running one strategy on the GPT stack."""
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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7, help="timed steps per round (main strategies)")
    ap.add_argument("--sweep-steps", type=int, default=3, help="timed steps per round (checkpoint_sequential k)")
    ap.add_argument("--models", default="mlp,gpt,resnet")
    ap.add_argument("--compile", action="store_true", help="also torch.compile at budgets (minutes per budget)")
    ap.add_argument("--compile-budgets", default="1.0,0.5,0.15")
    ap.add_argument("--compile-only", action="store_true", help="only torch.compile, into results.json")
    ap.add_argument("--report-only", action="store_true", help="re-render results.json")
    ap.add_argument("--chart", default=os.path.join(ROOT, "docs", "img", "frontier.png"))
    a = ap.parse_args()
    b = os.path.join(a.build, "bench")
    a.compare, a.overhead = os.path.join(b, "remat_compare"), os.path.join(b, "remat_overhead")
    outdir = os.path.join(b, "compare")
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "results.json")
    env = dict(os.environ, LD_PRELOAD=os.path.join(b, "libremat_preload.so"), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    if a.compile_only:  # add torch.compile to an earlier run's results
        res = json.load(open(path))
        res["compile"] = compile_runs(a, env)
        json.dump(res, open(path, "w"), indent=1)
    elif a.report_only:
        res = json.load(open(path))
    else:
        t0 = time.time()
        res = {"models": {}, "machine": machine()}
        for m in a.models.split(","):
            res["models"][m] = compare_model(m, a, env)
        res["overhead_us"] = overhead(a, env)
        res["rss"] = rss(a, env)
        if a.compile:
            res["compile"] = compile_runs(a, env)
        elif os.path.exists(path):  # keep an earlier torch.compile run
            old = json.load(open(path))
            if "compile" in old:
                res["compile"] = old["compile"]
        res["wall_s"] = time.time() - t0
        json.dump(res, open(path, "w"), indent=1)
    import report
    md = report.render(res, a.chart)
    open(os.path.join(outdir, "results.md"), "w").write(md)
    print(md)
    print(f"wrote {path}, {os.path.join(outdir, 'results.md')}, {a.chart}")


def machine():
    import torch
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return dict(nproc=os.cpu_count(), cpu=model, torch=torch.__version__, threads=1,
                parallel=torch.__config__.parallel_info().splitlines()[-1].strip())


if __name__ == "__main__":
    main()
