"""The counting allocator's cost per allocation (docs/BENCHMARKS.md, "Counting
allocator"): runs bench/alloc's remat_alloc_bench and renders its result.

Builds nothing: takes --build DIR with remat_alloc_bench built. One process,
four phases (LibTorch alone; after a Probe has ended; a Probe alive; after
enable_tracking()), each --rounds rounds of 1 and 2 threads in turn. Writes
bench/results/alloc.json (the program's run-metadata record and every
round's ns per alloc+free; --quick: fewer allocations, alloc-quick.json);
gen_docs.py renders the fragment alloc.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import med, result_path, run, run_line, write_json  # noqa: E402


def render(res):
    out = [f"{run_line(res['meta'], res['load'])} ns per alloc+free of `torch::empty({{64}})` ({res['bytes']} B), {res['iters']} per thread and round; "
           f"{res['rounds']} rounds per phase, 1 and 2 threads in turn; median (min-max) over the rounds; one process.",
           "",
           "| phase | 1 thread | 2 threads |",
           "|---|---|---|"]
    cell = lambda v: f"{med(v):.0f} ({min(v):.0f}-{max(v):.0f})"  # noqa: E731
    for p in res["phases"]:
        out.append(f"| {p['name']} | {cell(p['ns_1_thread'])} | {cell(p['ns_2_threads'])} |")
    return "\n".join(out) + "\n"


def fragments(res):
    """The docs' generated fragment of an alloc result (gen_docs.py): NAME -> markdown."""
    return {"alloc": render(res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="20000 allocations per round (seconds)")
    a = ap.parse_args()
    exe = os.path.join(a.build, "bench", "remat_alloc_bench")
    if not os.path.exists(exe):
        sys.exit(f"{exe} is missing: cmake --build {a.build} --target remat_alloc_bench")
    load0 = os.getloadavg()[0]
    p = run([exe, "--rounds", str(a.rounds), "--iters", "20000" if a.quick else "200000"], dict(os.environ), 1800)
    res = json.loads(p.stdout)
    res["load"] = [min(load0, os.getloadavg()[0]), max(load0, os.getloadavg()[0])]
    path = result_path("alloc", a.quick)
    write_json(path, res)
    print(render(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
