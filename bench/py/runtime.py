"""The planned runtime against the hook runtime, and plans against hand-placed
strategies (docs/BENCHMARKS.md, "Planned runtime against hook runtime"):
drives bench/compare's remat_compare and renders its results.

Builds nothing: takes --build DIR with remat_compare built. Runs remat_compare
once per group below, 1 intra-op thread, `--hold-output 0` (the chain's output
released before backward), glibc malloc as the OS sets it, the strategies of a
group interleaved (one step each in turn, after the warm-up):
  placement   per model, CheckpointedSequential on `segments(k)` (useg:k)
              against remat::checkpoint_sequential(seq, k) (seq:k), the same
              checkpoints placed by the planned and by the hook runtime;
  dominated   the optimal plans at 0.5 and 0.25 of plain against
              checkpoint_sequential, segments(4) and per-block checkpointing
              on the reference GPT stack, and the 0.5 plan against sqrt and
              k = 2, 4 on the reference MLP.
"Paired" ratios divide each step by the other strategy's step of the same
round, then take the median over rounds. Writes bench/results/runtime.json
(this driver's run-metadata record; each remat_compare output keeps its own;
--quick: the toy models, runtime-quick.json); gen_docs.py renders the
fragments runtime-placement and runtime-dominated.
Leaves out: the Python side (make bench compares with PyTorch).
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import med, metadata, result_path, run, run_line, write_json  # noqa: E402

# (group, model, strategies, timed steps)
REF = [("placement", "gpt-ref", "plain,seq:8,useg:8,block", 6),
       ("placement", "resnet-ref", "plain,seq:6,useg:6,seq:3,useg:3", 6),
       ("placement", "mlp-ref", "plain,seq:24,useg:24,seq:4,useg:4", 6),
       ("dominated", "gpt-ref", "plain,opt:0.5,seq:4,useg:4,opt:0.25,block", 5),
       ("dominated", "mlp-ref", "plain,opt:0.5,sqrt,seq:4,seq:2", 6)]
QUICK = [("placement", "gpt", "plain,seq:16,useg:16,block", 3),
         ("placement", "resnet", "plain,seq:8,useg:8,seq:4,useg:4", 3),
         ("placement", "mlp", "plain,seq:24,useg:24,seq:4,useg:4", 3),
         ("dominated", "gpt", "plain,opt:0.5,seq:4,useg:4,opt:0.25,block", 3),
         ("dominated", "mlp", "plain,opt:0.5,sqrt,seq:4,seq:2", 3)]


def name_of(n):
    if n.startswith("seq:"):
        return f"checkpoint_sequential k={n[4:]}"
    if n.startswith("useg:"):
        return f"CheckpointedSequential segments({n[5:]})"
    if n.startswith("opt:"):
        return f"optimal plan at {n[4:]} of plain"
    return {"plain": "plain", "block": "checkpoint per block", "sqrt": "CheckpointedSequential sqrt"}.get(n, n)


def paired(a, b):
    """Per round a / b (the strategies ran one step each in turn): (median, min, max)."""
    q = [x / y for x, y in zip(a["ms"], b["ms"])]
    return med(q), min(q), max(q)


def head(res, group):
    gs = [g for g in res["groups"] if g["group"] == group]
    steps = sorted({g["steps"] for g in gs})
    load = [g["load"] for g in gs]
    return (f"{run_line(res['meta'], load)} remat_compare, 1 intra-op thread, `--hold-output 0`, glibc malloc as the OS sets it; per model one "
            f"process, the strategies interleaved, 1 warm-up and {' or '.join(map(str, steps))} timed steps each. "
            f"Peak: remat::memory's tracked peak of the step above the level before it, plus the chain input "
            f"(MB = 10^6 bytes). Paired: per round one strategy's step over the other's in the same round, median "
            f"[min-max] over the rounds.")


def render_placement(res):
    out = [head(res, "placement"), "",
           "| model | k | hook peak MB | planned peak MB | planned / hook peak | predicted MB | hook ms | planned ms "
           "| planned / hook, paired [range] | hook / plain, paired | planned / plain, paired |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for g in res["groups"]:
        if g["group"] != "placement":
            continue
        by = {r["name"]: r for r in g["out"]["runs"]}
        for n, r in by.items():
            if not n.startswith("seq:") or f"useg:{n[4:]}" not in by:
                continue
            u, p = by[f"useg:{n[4:]}"], by["plain"]
            m, lo, hi = paired(u, r)
            out.append(f"| {g['model']} | {n[4:]} | {r['peak'] / 1e6:.2f} | {u['peak'] / 1e6:.2f} | "
                       f"{u['peak'] / r['peak']:.5f} | {u['predicted'] / 1e6:.1f} | {med(r['ms']):.0f} | "
                       f"{med(u['ms']):.0f} | {m:.3f} [{lo:.3f}-{hi:.3f}] | {paired(r, p)[0]:.3f} | "
                       f"{paired(u, p)[0]:.3f} |")
        if "block" in by:
            b, p = by["block"], by["plain"]
            out.append(f"| {g['model']} | per block (remat::checkpoint) | {b['peak'] / 1e6:.2f} | | | | "
                       f"{med(b['ms']):.0f} | | | {paired(b, p)[0]:.3f} | |")
    return "\n".join(out) + "\n"


def render_dominated(res):
    out = [head(res, "dominated"), "",
           "| model | strategy | peak / plain | time / plain, paired [range] | step ms | predicted ms "
           "| minor faults / step |",
           "|---|---|---:|---|---:|---:|---:|"]
    for g in res["groups"]:
        if g["group"] != "dominated":
            continue
        by = {r["name"]: r for r in g["out"]["runs"]}
        p = by["plain"]
        for n, r in by.items():
            if r["note"]:
                out.append(f"| {g['model']} | {name_of(n)} | {r['note']} | | | | |")
                continue
            m, lo, hi = paired(r, p)
            pred = f"{r['predicted_ms']:.0f}" if r["predicted_ms"] > 0 else ""
            out.append(f"| {g['model']} | {name_of(n)} | {r['peak'] / p['peak']:.3f} | {m:.3f} [{lo:.3f}-{hi:.3f}] | "
                       f"{med(r['ms']):.0f} | {pred} | {med(r['faults']):.0f} |")
    return "\n".join(out) + "\n"


def fragments(res):
    """The docs' generated fragments of a runtime result (gen_docs.py): NAME -> markdown."""
    return {"runtime-placement": render_placement(res), "runtime-dominated": render_dominated(res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--quick", action="store_true", help="the toy models, seconds (smoke runs)")
    ap.add_argument("--report-only", action="store_true", help="re-render bench/results/runtime.json")
    a = ap.parse_args()
    path = result_path("runtime", a.quick)
    if a.report_only:
        with open(path) as f:
            res = json.load(f)
    else:
        exe = os.path.join(a.build, "bench", "remat_compare")
        if not os.path.exists(exe):
            sys.exit(f"{exe} is missing: cmake --build {a.build} --target remat_compare")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        groups = QUICK if a.quick else REF
        t0 = time.time()
        res = dict(meta=metadata(dict(quick=a.quick, groups=groups)), groups=[])
        for group, model, strategies, steps in groups:
            p = run([exe, "--model", model, "--strategies", strategies, "--steps", str(steps), "--sweep-steps",
                     str(steps), "--warmup", "1", "--hold-output", "0", "--threads", "1"], env, 3600,
                    label=f"{group}: remat_compare --model {model} --strategies {strategies}")
            res["groups"].append(dict(group=group, model=model, strategies=strategies, steps=steps,
                                      load=os.getloadavg()[0], plans=p.stderr.strip().splitlines(),
                                      out=json.loads(p.stdout)))
            res["wall_s"] = time.time() - t0
            write_json(path, res)
    print(render_placement(res))
    print(render_dominated(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
