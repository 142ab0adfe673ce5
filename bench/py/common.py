"""What the benchmark drivers and workers of bench/py share.

The run-metadata record (the same keys as bench/common/bench.h's metadata():
program, UTC date, git commit, nproc, CPU model, total memory, torch version,
intra-op threads, the program's arguments), the results folder bench/results/
and how a result file is written there, the LD_PRELOAD counter of
bench/preload (Meter), /proc/self/status fields, medians, running a
worker process, and torch.compile under an activation memory budget
(compile_with_budget).
Results: reference runs write bench/results/NAME.json (checked in; the docs'
tables and figures are generated from them by gen_docs.py); --quick runs write
bench/results/NAME-quick.json (ignored by git, for smoke runs and for checking
the generator).
Leaves out: measuring (the workers) and rendering (report.py, gen_docs.py).
"""
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "bench", "results")
# glibc malloc told to keep freed memory (no mmap'd chunks, no trimming of the heap's top), so that a process does
# not hand freed pages back to the kernel and fault them in again next step (docs/BENCHMARKS.md, "glibc's heap
# trimming"): run_all.py's and selective.py's --malloc keep, longctx.py's environment.
MALLOC_KEEP = dict(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(64 << 30))


def metadata(settings=None, argv=None):
    """The run-metadata record; `settings`: the program's own (a dict), else its arguments."""
    cpu, mem_kib = "?", -1
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            mem_kib = next((int(l.split()[1]) for l in f if l.startswith("MemTotal:")), -1)
    except OSError:
        pass
    try:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # git without the preload counter
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, env=env).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import torch
        version, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        version, threads = "", -1
    argv = sys.argv if argv is None else argv
    out = dict(program=os.path.basename(argv[0]) if argv else "?",
               date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               git_commit=commit, nproc=os.cpu_count(), cpu=cpu, mem_total_kib=mem_kib, torch=version,
               threads=threads, args=list(argv[1:]))
    if settings is not None:
        out["settings"] = settings
    return out


def run_line(meta, load=None):
    """'Run: DATE, commit C, N CPUs (MODEL), torch V[, 1-minute load average A-B].' from a run-metadata record
    (and load averages read during the run), the line a rendered table opens with."""
    out = (f"Run: {meta['date_utc'][:10]}, commit {meta['git_commit'][:7] or '?'}, {meta['nproc']} CPUs "
           f"({meta['cpu']}), torch {meta['torch']}")
    if load:
        out += f", 1-minute load average {min(load):.1f}-{max(load):.1f} during the run"
    return out + "."


def result_path(name, quick=False):
    """bench/results/NAME.json, or NAME-quick.json for a --quick run (the folder is created)."""
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, f"{name}{'-quick' if quick else ''}.json")


def write_json(path, obj):
    """Writes `obj` as indented JSON, through a temporary file (a stopped run never leaves half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_json(path, *fallbacks):
    """The first of `path`, *fallbacks that exists, read; exits naming them all when none does."""
    for p in (path, *fallbacks):
        if os.path.exists(p):
            with open(p) as f:
                return json.load(f)
    sys.exit(f"no results: {', '.join((path, *fallbacks))}")


def append_jsonl(path, obj):
    """Appends one JSON line."""
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def med(v):
    """The median, nan for none."""
    v = list(v)
    return statistics.median(v) if v else float("nan")


def run(cmd, env, timeout, label=None):
    """Runs a worker; its stdout, or exits with the end of its stderr when it fails."""
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:2])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    print(f"  {label or os.path.basename(cmd[0]) + ' ' + ' '.join(cmd[1:5])} ... {time.time() - t0:.0f} s", flush=True)
    return p


def status_kib(key):
    """A field of /proc/self/status in KiB ('VmRSS:', 'VmHWM:'), -1 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return -1


class Meter:
    """The preload library's counters, found in the process (LD_PRELOAD); exits
    (naming `program`) when they are absent or do not see torch's allocations."""

    def __init__(self, program):
        import torch
        lib = ctypes.CDLL(None)
        try:
            self.current = lib.remat_preload_current_bytes
            self.peak = lib.remat_preload_peak_bytes
            self.reset = lib.remat_preload_reset_peak
            installed = lib.remat_preload_installed()
        except AttributeError:
            sys.exit(f"{program}: run with LD_PRELOAD=<build>/bench/libremat_preload.so")
        self.current.restype = self.peak.restype = ctypes.c_int64
        # It must see torch's allocations: 4 MiB in, 4 MiB out.
        before = self.current()
        t = torch.empty(1 << 20, dtype=torch.float32)
        seen = self.current() - before
        del t
        if not installed or seen != 4 << 20 or self.current() != before:
            sys.exit(f"{program}: the preload counter does not see torch (installed={installed}, saw {seen} bytes)")


def compile_with_budget(fn, budget, tag):
    """(compiled, scope): torch.compile of `fn` (fullgraph) under torch._functorch.config.activation_memory_budget
    `budget` (the share, 0 to 1, of the activations that AOTAutograd's min-cut partitioner keeps for backward
    between saving only the graph's inputs (0) and its runtime-optimal choice (1, the default)). torch.compile
    compiles at the first call and the backward at the first backward: run both inside `scope()`, which sets the
    budget and an empty inductor cache (a cold compile, nothing reused from an earlier one); later calls keep what
    was compiled. `fn` gets a code object of its own (named after `tag`): torch.compile caches per code object, and
    two closures of one code over models of equal shapes would otherwise share one compiled graph, budget and all.
    """
    import contextlib
    import types

    import torch
    import torch._functorch.config as fconfig
    from torch._inductor.utils import fresh_cache
    own = types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{tag}"), fn.__globals__,
                             f"{fn.__name__}_{tag}", fn.__defaults__, fn.__closure__)

    @contextlib.contextmanager
    def scope():
        with fconfig.patch(activation_memory_budget=float(budget)), fresh_cache():
            yield

    return torch.compile(own, fullgraph=True), scope
