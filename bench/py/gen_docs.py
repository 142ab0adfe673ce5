"""Renders the docs' benchmark tables and figures from bench/results/ (`make bench` ends with it).

Each result file gives named markdown fragments: report.fragments for
compare.json, and for compare-toy.json (run_all.py --toy) with "-toy" after
each name; for each file of ONE_FILE its module's fragments(): selective.json
and selective-keep.json `selective-results` and `selective-keep-results`,
offload.json `offload-strategies` and `offload-codecs`, accuracy.json
`planner-accuracy`, runtime.json `runtime-placement` and `runtime-dominated`,
alloc.json `alloc`, ddp_scaling.json and ddp_scaling-small.json
`ddp-reference` and `ddp-small`, heap.json `heap-faults`, chain-menu.json `chain-menu`, fits-d-model.json
`fits-d-model`; longctx.fragments
for longctx.json with longctx-py.json: `longctx`; long_context_fits.fragments
for long_context_fits.json: `long-context-fits`; gpu_results.fragments for
gpu-h200.json: `gpu-blocks`, `gpu-longctx`; auto_results.fragments for
auto.json, auto-resnet.json, auto-py.json, auto-levers.json, auto-resnet-levers.json and step_solve.json:
`auto-frontier`, `auto-targets`, `auto-compile`, `auto-in-backward`, `auto-frontier-resnet`, `auto-targets-resnet`,
`auto-in-backward-resnet`, `auto-levers`, `auto-levers-resnet`, `auto-solver`; optim_state.fragments for optim-state.json: `optim-state-accuracy`; shard_results.fragments for
shard.json: `shard-reference`; pipeline_results.fragments for pipeline.json: `pipeline-reference`;
headline.fragments: `readme-headline` from all of them. In the docs a fragment stands between
    <!-- generated: NAME -->
    ...
    <!-- /generated -->
and is replaced (a blank line on either side, for markdown), markers kept; a
marker whose result file is absent is left as it is (and listed). Images:
docs/img/frontier.png from compare.json, docs/img/frontier-toy.png from
compare-toy.json, docs/img/long_context_fits.png from long_context_fits.json,
docs/img/auto-frontier.png (the README's chart: auto's whole-step frontier
against every hand-placed strategy, PyTorch's eager ones and torch.compile)
from auto.json and auto-py.json.
--quick reads the *-quick.json files and writes nowhere in docs/: copies of
the docs with the fragments substituted, every fragment as NAME.md and the
images go to bench/results/docs-quick/ (or --out), to check the generator
and look at a smoke run; there the toy models' sections fill the reference
models' markers (compare-gpt for compare-gpt-ref). --check only lists markers
and fragments.
Leaves out: measuring (run_all.py and the drivers named above) and the prose
around the tables (written by hand, citing only figures the tables show).
"""
import argparse
import importlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, ROOT, load_json  # noqa: E402

DOCS = ["docs/BENCHMARKS.md", "docs/long-context.md", "docs/gpu.md", "docs/auto.md", "docs/offload.md",
        "docs/parallel.md", "README.md"]
# result file (bench/results/NAME.json) -> the module whose fragments(result) renders it
ONE_FILE = [("selective", "selective"), ("selective-keep", "selective"), ("offload", "offload"),
            ("accuracy", "accuracy"), ("runtime", "runtime"), ("alloc", "alloc"), ("ddp_scaling", "ddp_scaling"),
            ("ddp_scaling-small", "ddp_scaling"), ("heap", "heap"), ("chain-menu", "chain_menu"),
            ("fits-d-model", "fits_d_model")]
MARKER = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def fragments(quick):
    """NAME -> markdown from every result file there is, and NAME -> (draw, file name) for the images."""
    suffix = "-quick" if quick else ""
    frags, images = {}, {}
    path = os.path.join(RESULTS, f"compare{suffix}.json")
    if os.path.exists(path):
        import report
        res = load_json(path)
        frags.update(report.fragments(res))
        if quick:  # the toy models stand in for the reference ones: every marker is exercised (in the copy)
            frags.update({f"{k}-ref": v for k, v in list(frags.items()) if f"{k}-ref" not in frags and
                          k[len("compare-"):] in res["models"]})
        images["frontier.png"] = lambda out, res=res: report.chart(res, out)
    path = os.path.join(RESULTS, "compare-toy.json")  # run_all.py --toy: the toy sizes, checked in
    if not quick and os.path.exists(path):
        import report
        res = load_json(path)
        frags.update({f"{k}-toy": v for k, v in report.fragments(res).items()})
        images["frontier-toy.png"] = lambda out, res=res: report.chart(res, out)
    for name, module in ONE_FILE:  # a result file, a renderer module with fragments(result)
        path = os.path.join(RESULTS, f"{name}{suffix}.json")
        if os.path.exists(path):
            frags.update(importlib.import_module(module).fragments(load_json(path)))
    path = os.path.join(RESULTS, f"long_context_fits{suffix}.json")
    if os.path.exists(path):
        import long_context_fits
        res = load_json(path)
        frags.update(long_context_fits.fragments(res))
        title = "longest trainable sequence per memory cap, measured"
        images["long_context_fits.png"] = lambda out, res=res: long_context_fits.chart(res["rows"], out, title)
    path = os.path.join(RESULTS, f"long_context_fits-sdpa{suffix}.json")
    if os.path.exists(path):  # the same search with SDPA attention (long_context_fits.py --sdpa)
        import long_context_fits
        frags.update({f"{k}-sdpa": v for k, v in long_context_fits.fragments(load_json(path)).items()})
    if not quick:  # figures of a GPU run (bench/gpu/check.sh on a lent machine); nothing to smoke-test
        import gpu_results
        frags.update(gpu_results.fragments())
    if not quick:
        import headline  # the README's table, from whichever of the files above exist
        frags.update(headline.fragments())
    import longctx  # JSON lines: longctx.json (remat_longctx) and longctx-py.json (the Python anchor)
    frags.update(longctx.fragments(quick))
    import auto_results  # JSON lines: auto.json (remat_auto) and step_solve.json (remat_step_solve)
    frags.update(auto_results.fragments(quick))
    images.update(auto_results.images(quick))  # auto-frontier.png: the README's chart
    import optim_state  # JSON lines: optim-state.json (optim_state.py --run: remat-train's loss curves)
    frags.update(optim_state.fragments(quick))
    import shard_results  # JSON lines: shard.json (remat_shard)
    frags.update(shard_results.fragments(quick))
    import pipeline_results  # JSON lines: pipeline.json (remat_pipeline)
    frags.update(pipeline_results.fragments(quick))
    return frags, images


def substitute(text, frags):
    """`text` with every known fragment in place; (new text, names replaced, names left)."""
    done, left = [], []

    def one(m):
        name = m.group(2)
        if name not in frags:
            left.append(name)
            return m.group(0)
        done.append(name)
        return m.group(1) + "\n" + frags[name].strip("\n") + "\n\n" + m.group(4)

    return MARKER.sub(one, text), done, left


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="render the *-quick.json results into --out, not docs/")
    ap.add_argument("--out", help="where --quick writes (bench/results/docs-quick)")
    ap.add_argument("--check", action="store_true", help="list markers and fragments, write nothing")
    a = ap.parse_args(argv)
    frags, images = fragments(a.quick)
    if not frags:
        print(f"gen_docs: no results in {RESULTS} ({'*-quick.json' if a.quick else '*.json'}); docs left as they are")
        return 0
    out = a.out or os.path.join(RESULTS, "docs-quick")
    used = set()
    for rel in DOCS:
        src = os.path.join(ROOT, rel)
        if not os.path.exists(src):
            continue
        with open(src) as f:
            text = f.read()
        new, done, left = substitute(text, frags)
        used.update(done)
        print(f"{rel}: {len(done)} generated ({', '.join(done) or '-'})" +
              (f"; no results for {', '.join(left)}, kept" if left else ""))
        if a.check or not done:
            continue
        dst = os.path.join(out, rel) if a.quick else src
        if a.quick or new != text:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "w") as f:
                f.write(new)
    unused = sorted(set(frags) - used)
    if unused:
        print(f"fragments with no marker in the docs: {', '.join(unused)}")
    if a.check:
        return 0
    if a.quick:  # every fragment on its own, for a look
        os.makedirs(os.path.join(out, "fragments"), exist_ok=True)
        for name, md in frags.items():
            with open(os.path.join(out, "fragments", f"{name}.md"), "w") as f:
                f.write(md.rstrip("\n") + "\n")
    img = os.path.join(out, "img") if a.quick else os.path.join(ROOT, "docs", "img")
    os.makedirs(img, exist_ok=True)
    for name, draw in images.items():
        draw(os.path.join(img, name))
        print(f"drew {os.path.join(img, name)}")
    if a.quick:
        print(f"wrote {out} (docs/ untouched)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
