"""The README's headline figures agree with docs/BENCHMARKS.md's tables.

For each reference workload (GPT stack, MLP, ResNet), the README's row
"checkpoint per block, remat / torch.utils.checkpoint" gives peak / plain and
step time / plain for remat and PyTorch, and the GPT's "planner at a 0.25
budget" row remat's optimal plan; docs/BENCHMARKS.md's compare-<model>-ref
table gives the same runs' "peak / plain" and "time / plain (paired)". Each
README figure must equal the BENCHMARKS one to the README's precision, and
the README's block must be what bench/py/headline.py renders from the result
files now.
Usage: check_headline.py <source dir>. Exit 0: all agree; 1: a figure
disagrees or is missing (printed).
"""
import re
import sys

WORKLOADS = {"gpt-ref": "GPT stack (", "mlp-ref": "MLP, 24 x", "resnet-ref": "ResNet (3 stages"}


def block(text, name):
    m = re.search(r"<!-- generated: " + re.escape(name) + r" -->\n(.*?)<!-- /generated -->", text, re.S)
    return m.group(1) if m else None


def numbers(cell):
    """'0.549x / 0.540x' -> [(0.549, 3), (0.540, 3)]: values with their decimals."""
    return [(float(v), len(v.split(".")[1]) if "." in v else 0) for v in re.findall(r"\d+(?:\.\d+)?", cell)]


def bench_row(table, tool, strategy):
    """(peak / plain, time / plain (paired)) of a compare-*-ref main-table row."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == tool and cells[1] == strategy:
            try:
                return float(cells[3]), float(cells[5])
            except ValueError:  # not measured (an empty cell)
                return None
    return None


def main(root):
    readme = open(f"{root}/README.md").read()
    bench = open(f"{root}/docs/BENCHMARKS.md").read()
    head = block(readme, "readme-headline")
    if head is None:
        print("README.md: no readme-headline block")
        return 1
    bad, checked = [], 0

    def agree(what, shown, ref):
        nonlocal checked
        value, decimals = shown
        checked += 1
        if abs(value - ref) > 0.5 * 10 ** -decimals + 1e-9:
            bad.append(f"{what}: README {value:.{decimals}f}, docs/BENCHMARKS.md {ref}")

    for key, title in WORKLOADS.items():
        table = block(bench, f"compare-{key}")
        rows = [line for line in head.splitlines() if line.startswith(f"| {title}")]
        if table is None or not rows:
            bad.append(f"{key}: no table in docs/BENCHMARKS.md or no row in the README")
            continue
        remat = bench_row(table, "remat", "remat::checkpoint per block")
        torch = bench_row(table, "PyTorch", "checkpoint per block, non-reentrant")
        planner = bench_row(table, "remat", "CheckpointedSequential optimal, budget 0.25")
        for line in rows:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            mem, time = numbers(cells[2]), numbers(cells[3])
            if cells[1].startswith("checkpoint per block") and remat and torch and len(mem) == 2 and len(time) == 2:
                agree(f"{key} remat per block, peak", mem[0], remat[0])
                agree(f"{key} PyTorch per block, peak", mem[1], torch[0])
                agree(f"{key} remat per block, time", time[0], remat[1])
                agree(f"{key} PyTorch per block, time", time[1], torch[1])
            elif cells[1].startswith("planner at a 0.25 budget") and planner and mem and time:
                agree(f"{key} planner at 0.25, peak", mem[0], planner[0])
                agree(f"{key} planner at 0.25, time", time[0], planner[1])
            else:
                bad.append(f"{key}: cannot read the README row '{line}'")
    # The block is what bench/py/headline.py renders from bench/results/ now
    # (gen_docs.py writes it), so a hand edit or a stale block shows too.
    sys.path.insert(0, f"{root}/bench/py")
    import headline
    fresh = headline.fragments().get("readme-headline")
    if fresh is not None and fresh.strip() != head.strip():
        bad.append("README.md's readme-headline block differs from what bench/py/headline.py renders from "
                   "bench/results/ (run bench/py/gen_docs.py)")
    for b in bad:
        print("DISAGREES:", b)
    print(f"{checked} README figures checked against docs/BENCHMARKS.md; {len(bad)} disagree")
    return 1 if bad or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
