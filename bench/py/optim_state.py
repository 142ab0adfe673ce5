"""Accuracy of compressed optimizer state (docs/BENCHMARKS.md, "Compressed optimizer state: accuracy").

--run trains remat-train's default GPT (character level on its default text, d_model 128, 6 blocks, 4 heads, T 128,
batch 8, AdamW lr 1e-3, seed 1337) for --steps steps (300) four ways from the same seed, one after the other:
  plain       the optimizer step after backward
  ib          --optimizer-in-backward (remat::StepInBackward, the state in memory: lossless, the same training bit
              for bit as plain)
  ib+bf16     --optimizer-in-backward --optimizer-state bf16 (each parameter's AdamW moments kept between its
              updates in a memory store as bfloat16: half the bytes, rounded)
  ib+int8     --optimizer-in-backward --optimizer-state int8 (the moments as 8-bit codes with a float32 scale per 256
              values, Codec::kInt8Block: 0.27 of the bytes, rounded)
and writes their loss curves as JSON lines to bench/results/optim-state.json (--quick: 30 steps,
optim-state-quick.json): a meta record (run metadata, the shared flags), then one {"kind": "run"} per way with its
extra flags, the loss of every step as remat-train prints it (6 decimals; remat-train has no machine-readable log,
so its step lines are parsed), its step time and peak, and a digest of the tensors of the checkpoint it saved at
the end (--save: parameters, AdamW state, step count, RNG states): the SHA-256 of the sorted SHA-256s of the
archive's tensor payloads (its data/N entries). Not the file's own bytes: every archive has a random
serialization id, and the optimizer's states are stored in the order they were created, which the step in
backward changes (the last parameters first); equal digests mean the same tensors, byte for byte. Without --run it prints the table that
fragments() renders (bench/py/gen_docs.py: fragment `optim-state-accuracy`): the loss at steps 50, 100, 200 and
300, the mean loss of the last 50 steps, the largest and the mean |loss - plain's loss| over the whole curve, the
steps whose printed loss equals plain's, and whether the saved checkpoint's tensors are plain's.
Leaves out: the disk store (lossless, like the in-memory state), other models and optimizers, more seeds.
"""
import argparse
import json
import os
import re
import hashlib
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, ROOT, metadata  # noqa: E402

WAYS = [("plain", "the optimizer step after backward", []),
        ("ib", "--optimizer-in-backward (state in memory, lossless)", ["--optimizer-in-backward"]),
        ("ib+bf16", "--optimizer-in-backward --optimizer-state bf16",
         ["--optimizer-in-backward", "--optimizer-state", "bf16"]),
        ("ib+int8", "--optimizer-in-backward --optimizer-state int8",
         ["--optimizer-in-backward", "--optimizer-state", "int8"])]
STEP = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+([-+0-9.eE]+|nan|inf)\s.*?([0-9.]+) ms\s+peak\s+(.+?)(\s{2}|$)")
MARKS = (50, 100, 200, 300)


def _lines(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def parse(stdout):
    """remat-train's step lines -> (losses, step ms, peaks as printed), in step order."""
    losses, ms, peaks = [], [], []
    for line in stdout.splitlines():
        m = STEP.match(line.strip())
        if m:
            if int(m.group(1)) != len(losses) + 1:
                sys.exit(f"optim_state.py: step {m.group(1)} after {len(losses)} steps in remat-train's output")
            losses.append(float(m.group(3)))
            ms.append(float(m.group(4)))
            peaks.append(m.group(5))
    return losses, ms, peaks


def tensors_digest(path):
    """SHA-256 over the sorted SHA-256s of a LibTorch archive's tensor payloads (entries .../data/N)."""
    with zipfile.ZipFile(path) as z:
        blobs = sorted(hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()
                       if re.search(r"/data/\d+$", n))
    return hashlib.sha256("\n".join(blobs).encode()).hexdigest(), len(blobs)


def run(a):
    exe = os.path.join(a.build, "tools", "remat-train", "remat-train")
    if not os.path.exists(exe):
        sys.exit(f"{exe} is missing: cmake --build {a.build} --target remat-train")
    steps = a.steps or (30 if a.quick else 300)
    common_flags = ["--steps", str(steps), "--seed", str(a.seed), "--threads", str(a.threads)]
    settings = dict(steps=steps, seed=a.seed, threads=a.threads, flags=common_flags,
                    model="remat-train's default GPT: character level on /usr/share/common-licenses/GPL-3, "
                          "d_model 128, 6 blocks, 4 heads, T 128, batch 8, AdamW lr 1e-3")
    lines = [dict(kind="meta", meta=metadata(settings), steps=steps, seed=a.seed,
                  version=subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip())]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    tmp = tempfile.mkdtemp(prefix="optim_state.")
    for name, label, extra in WAYS:
        cmd = [exe] + common_flags + extra
        print(f"optim_state.py: {name}: {' '.join(cmd)}", flush=True)
        ckpt = os.path.join(tmp, f"{name}.pt")
        p = subprocess.run(cmd + ["--save", ckpt], capture_output=True, text=True, env=env, cwd=ROOT)
        if p.returncode != 0:
            sys.exit(f"optim_state.py: {name} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        losses, ms, peaks = parse(p.stdout)
        if len(losses) != steps:
            sys.exit(f"optim_state.py: {name}: {len(losses)} step lines, expected {steps}:\n{p.stdout[-2000:]}")
        digest, count = tensors_digest(ckpt)
        os.remove(ckpt)
        lines.append(dict(kind="run", name=name, label=label, flags=extra, losses=losses, step_ms=ms, peaks=peaks,
                          checkpoint_tensors_sha256=digest, checkpoint_tensors=count))
        print(f"  final loss {losses[-1]:.6f}", flush=True)
    out = a.out or os.path.join(RESULTS, f"optim-state{'-quick' if a.quick else ''}.json")
    with open(out + ".tmp", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(out + ".tmp", out)
    os.rmdir(tmp)
    print(f"wrote {out}")


def table(recs):
    """The markdown of fragment optim-state-accuracy from optim-state.json's records."""
    meta = next(r for r in recs if r["kind"] == "meta")
    runs = [r for r in recs if r["kind"] == "run"]
    plain = next(r for r in runs if r["name"] == "plain")
    marks = [s for s in MARKS if s <= meta["steps"]] or [meta["steps"]]
    if meta["steps"] not in marks:
        marks.append(meta["steps"])
    rows = ["| run | " + " | ".join(f"loss at step {s}" for s in marks) + " | max abs difference to plain over "
            f"the {meta['steps']} steps (at step) | mean abs difference to plain | mean loss, last 50 steps | "
            "steps whose printed loss equals plain's | final checkpoint's tensors equal to plain's |",
            "|---|" + "---|" * len(marks) + "---|---|---|---|---|"]
    for r in runs:
        diff = [abs(x - y) for x, y in zip(r["losses"], plain["losses"])]
        worst = max(range(len(diff)), key=lambda i: diff[i])
        same = sum(x == y for x, y in zip(r["losses"], plain["losses"]))
        last = r["losses"][-50:]
        ckpt = ("-" if "checkpoint_tensors_sha256" not in r else
                f"yes, all {r['checkpoint_tensors']} byte for byte"
                if r["checkpoint_tensors_sha256"] == plain.get("checkpoint_tensors_sha256") else "no")
        rows.append(f"| {r['label']} | " + " | ".join(f"{r['losses'][s - 1]:.6f}" for s in marks) +
                    f" | {diff[worst]:.6f} (step {worst + 1}) | {sum(diff) / len(diff):.6f} | "
                    f"{sum(last) / len(last):.6f} | {same} of {len(diff)} | {ckpt} |")
    m = meta["meta"]
    text = (f"{meta['meta']['settings']['model']}; {meta['steps']} steps, seed {meta['seed']}, "
            f"{m['settings']['threads']} intra-op thread(s); losses as remat-train prints them (6 decimals). "
            f"Run {m['date_utc']}, commit {m['git_commit'][:10]}, torch {m['torch']}.")
    # What each rounded run did to the curve, in words, from the same figures.
    notes = []
    for r in runs:
        if r["name"] in ("plain", "ib"):
            continue
        diff = [abs(x - y) for x, y in zip(r["losses"], plain["losses"])]
        worst = max(range(len(diff)), key=lambda i: diff[i])
        last, plast = r["losses"][-50:], plain["losses"][-50:]
        notes.append(f"- {r['label']}: ends at {r['losses'][-1]:.6f} against plain's {plain['losses'][-1]:.6f} "
                     f"({sum(last) / len(last):.6f} against {sum(plast) / len(plast):.6f} over the last 50 steps); "
                     f"the largest gap is {diff[worst]:.6f} at step {worst + 1}, the mean gap {sum(diff) / len(diff):.6f}.")
    return text + "\n\n" + "\n".join(rows) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def fragments(quick=False):
    recs = _lines(os.path.join(RESULTS, f"optim-state{'-quick' if quick else ''}.json"))
    return {"optim-state-accuracy": table(recs)} if recs else {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="train the four ways and write the result file")
    ap.add_argument("--quick", action="store_true", help="30 steps, optim-state-quick.json")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.run:
        run(a)
    frags = fragments(a.quick) if not a.out else {"optim-state-accuracy": table(_lines(a.out))}
    for md in frags.values():
        print(md)


if __name__ == "__main__":
    main()
