"""Selective checkpointing on the GPT block stack: remat (C++) against PyTorch SAC
(docs/BENCHMARKS.md, "Selective checkpointing").

Builds nothing: takes --build DIR with remat_selective_bench and
libremat_preload.so built (ninja -C DIR remat_selective_bench remat_preload).
First checks that the C++ and Python blocks run the same ops (the sequence
each policy sees in one block's first run, at a tiny size); then runs the C++
worker (bench/selective/remat_selective.cpp) and the Python worker
(selective_worker.py) alternately, C++ round, Python round, for --rounds
rounds, both under LD_PRELOAD of bench/preload's counter and with one
intra-op thread. Pools each strategy's step times over the rounds (medians;
ratios to the same language's plain run) and prints a markdown table of
activation memory (peak bytes during forward + backward above the bytes alive
before the forward: parameters, their zeroed gradients and the input are
excluded; activations, backward temporaries, activation gradients and the
input's gradient are in), the bytes held after the forward, and step time.
Writes bench/results/selective.json (with the run-metadata record,
common.py) and selective.md (--quick: selective-quick.json / .md, not checked
in); gen_docs.py renders its table as the fragment selective-results.
--malloc keep runs both workers with glibc told to keep freed memory
(common.MALLOC_KEEP: no step faults its heap in again) and writes
selective-keep.json / .md instead, fragment selective-keep-results. Prints
the target line (one remat selective setting at <= 0.5x plain activation
memory and <= 1.10x plain step time). --quick: a toy size for smoke runs only.
"""
import argparse
import difflib
import json
import os
import subprocess
import sys
import time

from common import HERE, MALLOC_KEEP, RESULTS, ROOT, load_json, med, metadata, result_path, run_line, write_json
REFERENCE = dict(d_model=512, heads=8, seq_len=512, batch=4, blocks=8)  # the CPU reference (docs/BENCHMARKS.md)
QUICK = dict(d_model=64, heads=4, seq_len=64, batch=2, blocks=2)
OPS_SIZE = dict(d_model=32, heads=2, seq_len=8, batch=2, blocks=1)
CPP = ["plain", "full", "nothing", "matmuls", "megatron", "qkv_fc", "megatron_ctx"]
PY = ["plain", "full", "sac_nothing", "sac_matmuls", "sac_addmm"]
SELECTIVE = ["matmuls", "megatron", "qkv_fc", "megatron_ctx"]  # the remat settings the target is about
LABELS = {
    "cpp:plain": "plain",
    "cpp:full": "full recompute per block (enable_checkpointing, no policy)",
    "cpp:nothing": "policy save_nothing (full recompute through the interception)",
    "cpp:matmuls": "policy save_matmuls",
    "cpp:megatron": "megatron_policy = save_names(attn_qkv, attn_out, mlp_fc)",
    "cpp:qkv_fc": "save_names(attn_qkv, mlp_fc)",
    "cpp:megatron_ctx": "save_names(attn_qkv, attn_out, mlp_fc, attn_context)",
    "py:plain": "plain",
    "py:full": "torch.utils.checkpoint per block (non-reentrant)",
    "py:sac_nothing": "SAC, empty op list (full recompute through the dispatch mode)",
    "py:sac_matmuls": "SAC, save_matmuls' op list (mm, addmm, bmm, baddbmm, conv, sdpa)",
    "py:sac_addmm": "SAC, save aten.addmm (the linear layers)",
}
TARGET_MEM, TARGET_TIME = 0.5, 1.10


def size_args(s):
    return ["--d-model", str(s["d_model"]), "--heads", str(s["heads"]), "--seq-len", str(s["seq_len"]),
            "--batch", str(s["batch"]), "--blocks", str(s["blocks"])]


def run(cmd, env, timeout):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in p.stderr.splitlines():
        if line.startswith("gradients of"):
            print(f"    {'cpp' if cmd[0].endswith('bench') else 'py '}: {line}", flush=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:2])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    print(f"  {os.path.basename(cmd[0] if cmd[0].endswith('bench') else cmd[1])} ... {time.time() - t0:.0f} s",
          flush=True)
    return json.loads(p.stdout)


def op_check(exe, env):
    cpp = run([exe, "--ops", *size_args(OPS_SIZE)], env, 120)["ops"]
    py = run([sys.executable, os.path.join(HERE, "selective_worker.py"), "--ops", *size_args(OPS_SIZE)], env,
             120)["ops"]
    diff = [d for d in difflib.unified_diff(cpp, py, "cpp", "py", lineterm="", n=1)]
    return dict(cpp=cpp, py=py, equal=cpp == py, diff=diff)


def pool(outs):
    """One language's rounds -> per strategy: pooled medians, ratios, per-round ratios."""
    names = [r["name"] for r in outs[0]["runs"]]
    res = {}
    for n in names:
        rs = [next(r for r in o["runs"] if r["name"] == n) for o in outs]
        ms = [v for r in rs for v in r["ms"]]
        peaks = [v for r in rs for v in r["peak"]]
        held = [v for r in rs for v in r["held"]]
        res[n] = dict(name=n, median_ms=med(ms), fwd_ms=med([v for r in rs for v in r["fwd_ms"]]),
                      bwd_ms=med([v for r in rs for v in r["bwd_ms"]]), peak=med(peaks), peak_spread=max(peaks) -
                      min(peaks), held=med(held), held_spread=max(held) - min(held),
                      minflt=med([v for r in rs for v in r.get("minflt", [])]),
                      grads_equal=all(r["grads_equal"] for r in rs), round_ms=[med(r["ms"]) for r in rs],
                      policy=rs[0].get("policy", ""), ops=dict(saved=rs[0].get("ops_saved", 0),
                                                             replayed=rs[0].get("ops_replayed", 0),
                                                             recomputed=rs[0].get("ops_recomputed", 0)))
    p = res["plain"]
    for r in res.values():
        r["time_x"] = r["median_ms"] / p["median_ms"]
        r["fwd_x"] = r["fwd_ms"] / p["fwd_ms"]
        r["bwd_x"] = r["bwd_ms"] / p["bwd_ms"]
        r["mem_x"] = r["peak"] / p["peak"]
        r["held_x"] = r["held"] / p["held"] if p["held"] else float("nan")
        r["round_time_x"] = [a / b for a, b in zip(r["round_ms"], p["round_ms"])]
    # Paired: each step against plain's step of the same sweep (the strategies
    # run in turn, one step each), median over all sweeps; cancels drift in
    # the machine's speed between sweeps and rounds.
    for n, r in res.items():
        pairs = [[a / b for a, b in zip(next(x for x in o["runs"] if x["name"] == n)["ms"],
                                        next(x for x in o["runs"] if x["name"] == "plain")["ms"])] for o in outs]
        r["paired_x"] = med([v for q in pairs for v in q])
        r["round_paired_x"] = [med(q) for q in pairs]
    return res


def target(cpp):
    ok = [n for n in SELECTIVE if cpp[n]["mem_x"] <= TARGET_MEM and cpp[n]["time_x"] <= TARGET_TIME]
    if ok:
        best = min(ok, key=lambda n: cpp[n]["time_x"])
        r = cpp[best]
        also = [n for n in ok if n != best]
        return True, (f"target MET: remat {best} ({r['policy']}) at {r['mem_x']:.3f}x plain activation memory and "
                      f"{r['time_x']:.3f}x plain step time (paired {r['paired_x']:.3f}x; target <= {TARGET_MEM}x at "
                      f"<= {TARGET_TIME:.2f}x)" + (f"; also met by {', '.join(also)}" if also else ""))
    parts = []
    fits = [n for n in SELECTIVE if cpp[n]["mem_x"] <= TARGET_MEM]
    if fits:
        n = min(fits, key=lambda n: cpp[n]["time_x"])
        parts.append(f"fastest at <= {TARGET_MEM}x memory: {n} at {cpp[n]['time_x']:.3f}x time "
                     f"({(cpp[n]['time_x'] - TARGET_TIME) * 100:+.1f} points over)")
    fast = [n for n in SELECTIVE if cpp[n]["time_x"] <= TARGET_TIME]
    if fast:
        n = min(fast, key=lambda n: cpp[n]["mem_x"])
        parts.append(f"smallest at <= {TARGET_TIME:.2f}x time: {n} at {cpp[n]['mem_x']:.3f}x memory "
                     f"({(cpp[n]['mem_x'] - TARGET_MEM) * 100:+.1f} points over)")
    if not parts:
        n = min(SELECTIVE, key=lambda n: max(cpp[n]["mem_x"] / TARGET_MEM, cpp[n]["time_x"] / TARGET_TIME))
        parts.append(f"closest: {n} at {cpp[n]['mem_x']:.3f}x memory, {cpp[n]['time_x']:.3f}x time")
    return False, f"target MISSED (<= {TARGET_MEM}x memory at <= {TARGET_TIME:.2f}x time): " + "; ".join(parts)


def mib(b):
    return f"{b / 2**20:.1f}"


def render(res):
    s = res["size"]
    out = [f"{run_line(res['meta'], res.get('load'))} "
           f"GPT block stack: d_model {s['d_model']}, {s['heads']} heads, T {s['seq_len']}, batch {s['batch']}, "
           f"{s['blocks']} blocks, float32, dropout 0, explicit attention, 1 intra-op thread; "
           f"{res['rounds']} rounds x {res['steps']} timed steps per strategy (after {res['warmup']} warm-up), "
           f"C++ and Python processes alternating; medians of the pooled steps, ratios to the same language's "
           f"plain run. Activation memory: peak bytes during forward + backward above the bytes alive before the "
           f"forward (preload counter, both processes); held: bytes alive after the forward above the same base. "
           f"time x plain: pooled median / plain's pooled median; per round: the same within each round (min-max); "
           f"paired: median over all sweeps of step / plain's step in the same sweep.",
           *([f"glibc malloc settings: {res['malloc_env']}"] if res.get("malloc_env") else []),
           "",
           "| | strategy | act. peak MiB | x plain | held after fwd MiB | x plain | step ms | time x plain "
           "| per round | paired | fwd x | bwd x | page faults / step | grads |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for lang, label in (("cpp", "remat"), ("py", "PyTorch")):
        for n, r in res[lang].items():
            rounds = "-".join(f"{v:.3f}" for v in (min(r["round_time_x"]), max(r["round_time_x"])))
            grads = "ref" if n == "plain" else ("bitwise =" if r["grads_equal"] else "DIFFER")
            out.append(f"| {label} | {LABELS.get(f'{lang}:{n}', n)} | {mib(r['peak'])} | {r['mem_x']:.3f} | "
                       f"{mib(r['held'])} | {r['held_x']:.3f} | {r['median_ms']:.0f} | {r['time_x']:.3f} | "
                       f"{rounds} | {r['paired_x']:.3f} | {r['fwd_x']:.2f} | {r['bwd_x']:.2f} | {r['minflt']:.0f} | {grads} |")
    out += ["", "remat's op counters per step (all blocks): saved in the first run / handed back in recompute / "
            "recomputed:", ""]
    for n, r in res["cpp"].items():
        if r["ops"]["saved"] or r["ops"]["recomputed"]:
            o = r["ops"]
            out.append(f"- {n}: {o['saved']} / {o['replayed']} / {o['recomputed']}")
    oc = res["op_check"]
    out += ["", f"op sequence (one block, first run, as each policy sees it; {len(oc['cpp'])} C++ ops, "
            f"{len(oc['py'])} Python ops): " + ("identical" if oc["equal"] else "differs:"), ""]
    if not oc["equal"]:
        out += ["```", *oc["diff"], "```", ""]
    spread = max(max(r["peak_spread"], r["held_spread"]) for lang in ("cpp", "py") for r in res[lang].values())
    moved = max(max(r["round_time_x"]) - min(r["round_time_x"]) for lang in ("cpp", "py") for r in res[lang].values())
    out += [f"memory figures varied by at most {spread} bytes between steps and rounds; time ratios moved by at most "
            f"{moved:.3f} between rounds.", "", res["target"], ""]
    return "\n".join(out)


def fragments(res):
    """The docs' generated fragments of a selective result (gen_docs.py): NAME -> markdown."""
    return {"selective-keep-results" if res.get("malloc") == "keep" else "selective-results": render(res)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per strategy per round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="toy size, for smoke runs only")
    ap.add_argument("--report-only", action="store_true", help="re-pool and re-render bench/results/selective.json")
    ap.add_argument("--malloc", choices=["default", "keep"], default="default",
                    help="default: glibc malloc as the OS sets it; keep: both workers keep freed memory "
                         "(MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=64 GiB), into selective-keep.json")
    a = ap.parse_args()
    name = "selective-keep" if a.malloc == "keep" else "selective"
    b = os.path.join(a.build, "bench")
    exe, preload = os.path.join(b, "remat_selective_bench"), os.path.join(b, "libremat_preload.so")
    path = result_path(name, a.quick)
    if a.report_only:  # re-pools the raw step data (also from the old <build>/bench/selective/results.json)
        res = load_json(path, os.path.join(b, "selective", "results.json"))
        res["cpp"], res["py"] = pool(res["raw"]["cpp"]), pool(res["raw"]["py"])
        res["met"], res["target"] = target(res["cpp"])
        write_json(path, res)
    else:
        for f in (exe, preload):
            if not os.path.exists(f):
                sys.exit(f"{f} is missing: ninja -C {a.build} remat_selective_bench remat_preload")
        env = dict(os.environ, LD_PRELOAD=preload, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if a.malloc == "keep":
            env.update(MALLOC_KEEP)
        size = QUICK if a.quick else REFERENCE
        t0 = time.time()
        meta = metadata(dict(size=size, quick=a.quick, rounds=a.rounds, steps=a.steps, warmup=a.warmup,
                             malloc=a.malloc))  # at the start: its date and commit are the run's
        print("op sequence check (one block, tiny size)", flush=True)
        oc = op_check(exe, env)
        print(f"  {'identical' if oc['equal'] else 'DIFFERENT'} ({len(oc['cpp'])} / {len(oc['py'])} ops)", flush=True)
        common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", "1", *size_args(size)]
        outs = {"cpp": [], "py": []}
        load = [os.getloadavg()[0]]
        for i in range(a.rounds):
            print(f"round {i + 1}/{a.rounds}", flush=True)
            outs["cpp"].append(run([exe, *common, "--strategies", ",".join(CPP)], env, 1200))
            outs["py"].append(run([sys.executable, os.path.join(HERE, "selective_worker.py"), *common,
                                   "--strategies", ",".join(PY)], env, 1200))
            load.append(os.getloadavg()[0])
        import torch
        res = dict(meta=meta, size=size, quick=a.quick, rounds=a.rounds, steps=a.steps, warmup=a.warmup, op_check=oc,
                   torch=torch.__version__, nproc=os.cpu_count(), malloc=a.malloc, load=load,
                   malloc_env={k: v for k, v in env.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
                   param_bytes=outs["cpp"][0]["param_bytes"], input_bytes=outs["cpp"][0]["input_bytes"],
                   cpp=pool(outs["cpp"]), py=pool(outs["py"]), raw=outs)
        res["met"], res["target"] = target(res["cpp"])
        res["wall_s"] = time.time() - t0
        write_json(path, res)
    md = render(res)
    md_path = os.path.join(RESULTS, f"{name}{'-quick' if a.quick else ''}.md")
    with open(md_path, "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {path}, {md_path}")
    print(res["target"])


if __name__ == "__main__":
    main()
