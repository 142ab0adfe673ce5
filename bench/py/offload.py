"""Offload and compression of saved activations on the reference GPT block stack
(docs/BENCHMARKS.md, "Offload and compression"): drives bench/offload's
remat_offload_bench and renders its results.

Builds nothing: takes --build DIR with remat_offload_bench built. Runs, one
after the other, with one intra-op thread:
  1. the strategies (plain, full recompute per block, disk offload with and
     without prefetch, checkpoints to disk), each in its own process, with
     glibc malloc as the OS sets it: peak, held, RSS and step time;
  2. the same strategies with MALLOC_MMAP_THRESHOLD_=1048576 (every tensor
     of 1 MiB or more unmapped when freed), for the RSS column only: that
     run's step times fault every page in again and are not compared;
  3. --codecs: every codec on the same activations, one step each.
Writes bench/results/offload.json (the run-metadata record of this driver,
each program's own under its part; --quick: offload-quick.json, the binary's
toy size) and prints the tables; gen_docs.py renders them as the fragments
offload-strategies and offload-codecs.
Leaves out: interleaved rounds (each strategy is its own process) and the
GPU (kHost is a no-op on CPU tensors).
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import metadata, result_path, run, run_line, write_json  # noqa: E402

LABELS = {"plain": "plain", "full": "full (checkpoint per block)", "disk": "disk (prefetch depth 2)",
          "disk_nopf": "disk, prefetch off (depth 0)", "ckpt_disk": "ckpt_disk (checkpoints to disk, recompute)"}


def part(exe, args, env, timeout):
    """One run of the binary: its meta record and its JSON lines."""
    p = run([exe, *args], env, timeout, label=f"remat_offload_bench {' '.join(args)}")
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return dict(meta=lines[0]["meta"], rows=lines[1:], load=os.getloadavg()[0])


def mib(b):
    return f"{b / 2**20:.1f}"


def render_strategies(res):
    s = res["settings"]
    size = ("toy size (--quick)" if s["quick"] else
            "8 x GptBlock, d_model 512, 8 heads, T 512, batch 4, float32, dropout 0, explicit attention")
    d = {r["strategy"]: r for r in res["strategies"]["rows"]}
    mm = {r["strategy"]: r for r in res["strategies_mmap"]["rows"]} if res.get("strategies_mmap") else {}
    plain = d["plain"]
    load = [res["load_start"]] + [res[p]["load"] for p in ("strategies", "strategies_mmap", "codecs") if p in res]
    out = [f"{run_line(res['meta'], load)} {size}; the stack ends in `.square().mean()`; 1 intra-op thread; each strategy in its own process, "
           f"1 warm-up step, then {s['steps']} timed steps (step: median). Peak: remat::memory's tracked peak above "
           f"the bytes live before the forward (parameter gradients preallocated); held: tracked bytes right after "
           f"the forward; RSS: VmHWM at the process's exit (its growth over VmRSS before the first step in brackets). "
           f"Offload directory: {res['dir_fs']}. Gradients of every "
           f"strategy equal plain's bitwise (hashes): {'yes' if res['grads_equal'] else 'NO'}.",
           "",
           "| strategy | peak MiB | / plain | held MiB | RSS MiB, default malloc | RSS MiB, mmap threshold 1 MiB "
           "| step s | / plain |",
           "|---|---:|---:|---:|---|---|---:|---:|"]
    for n, r in d.items():
        rss = lambda r: f"{r['hwm_kb'] / 1024:.0f} (+{(r['hwm_kb'] - r['rss_before_kb']) / 1024:.0f})"  # noqa: E731
        out.append(f"| {LABELS.get(n, n)} | {mib(r['peak_bytes'])} | {r['peak_bytes'] / plain['peak_bytes']:.3f} | "
                   f"{mib(r['held_bytes'])} | {rss(r)} | {rss(mm[n]) if n in mm else '-'} | "
                   f"{r['step_ms'] / 1e3:.2f} | {r['step_ms'] / plain['step_ms']:.2f}x |")
    if mm:
        out += ["", f"The mmap-threshold column is from a second run of the same strategies "
                f"(MALLOC_MMAP_THRESHOLD_=1048576, {res['settings']['rss_steps']} timed step): only its RSS is shown "
                f"(freed tensors are unmapped, so every step faults its pages in again)."]
    return "\n".join(out) + "\n"


def render_codecs(res):
    rows = res["codecs"]["rows"]
    plain = next(r for r in rows if r["codec"] == "plain")
    out = ["Every codec on the same activations (`--codecs`: OffloadScope around the forward, min_bytes 64 KiB), one "
           f"step each, after a warm-up step and one timed plain step of {plain['step_ms'] / 1e3:.2f} s; error: max |g - g_plain| / "
           "max |g_plain| over every parameter gradient and the input's.",
           "",
           "| codec | raw MiB | stored MiB | ratio | step s | / plain | bitwise | error |",
           "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["codec"] == "plain":
            continue
        t = (r["fwd_ms"] + r["bwd_ms"]) / 1e3
        out.append(f"| {r['codec']} | {mib(r['raw_bytes'])} | {mib(r['stored_bytes'])} | {r['ratio']:.3f} | {t:.2f} | "
                   f"{t / (plain['step_ms'] / 1e3):.2f}x | {'yes' if r['bitwise'] else 'no'} | "
                   f"{r['grad_rel_error']:.1e} |")
    return "\n".join(out) + "\n"


def fragments(res):
    """The docs' generated fragments of an offload result (gen_docs.py): NAME -> markdown."""
    return {"offload-strategies": render_strategies(res), "offload-codecs": render_codecs(res)}


def fs_of(path):
    """'ext4 on /dev/vda' for the mount that holds `path` (/proc/mounts), '?' if not found."""
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if (path + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                    best = (mnt, fs, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true", help="the binary's toy size, seconds (smoke runs)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per strategy")
    ap.add_argument("--rss-steps", type=int, default=1, help="timed steps per strategy of the mmap-threshold run")
    ap.add_argument("--dir", help="the offload directory (a fresh one under /var/tmp: on disk, not tmpfs)")
    ap.add_argument("--report-only", action="store_true", help="re-render bench/results/offload.json")
    a = ap.parse_args()
    path = result_path("offload", a.quick)
    if a.report_only:
        with open(path) as f:
            res = json.load(f)
    else:
        exe = os.path.join(a.build, "bench", "remat_offload_bench")
        if not os.path.exists(exe):
            sys.exit(f"{exe} is missing: cmake --build {a.build} --target remat_offload_bench")
        d = a.dir or tempfile.mkdtemp(prefix="remat-offload-", dir="/var/tmp")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        size = ["--quick"] if a.quick else []
        t0 = time.time()
        res = dict(meta=metadata(dict(quick=a.quick, steps=a.steps, rss_steps=a.rss_steps)),
                   settings=dict(quick=a.quick, steps=a.steps, rss_steps=a.rss_steps), dir_fs=fs_of(d),
                   load_start=os.getloadavg()[0])
        res["strategies"] = part(exe, [*size, "--dir", d, "--steps", str(a.steps)], env, 3600)
        res["strategies_mmap"] = part(exe, [*size, "--dir", d, "--steps", str(a.rss_steps)],
                                      dict(env, MALLOC_MMAP_THRESHOLD_="1048576"), 3600)
        res["codecs"] = part(exe, [*size, "--codecs", "--dir", d], env, 3600)
        hashes = {r["grad_hash"] for p in ("strategies", "strategies_mmap") for r in res[p]["rows"]}
        res["grads_equal"] = len(hashes) == 1
        res["wall_s"] = time.time() - t0
        write_json(path, res)
        if not a.dir:
            try:
                os.rmdir(d)  # the scopes delete their files
            except OSError:
                pass
    print(render_strategies(res))
    print(render_codecs(res))
    print(f"{'read' if a.report_only else 'wrote'} {path}")


if __name__ == "__main__":
    main()
