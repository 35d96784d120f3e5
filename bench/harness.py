"""
bench/harness.py: what the benchmarks share (gemm.py, forward.py, fp8.py, ep.py): blocked and
interleaved timing with CUDA events and SM clock samples (time_ms, docs/performance.md, "Blocked
and interleaved timing"), the --timing options, case selection by --cases, the columns and
loading of --lib-b libraries, the commit id of a row, and the relative error of a result.
"""
import os
import random
import statistics
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_libs(paths, loader):
    """The libraries of a --lib-b list ("PATH[,PATH...]", or None), each loaded by `loader`."""
    return [loader(path) for path in paths.split(",")] if paths else []


def case_selected(name, cases):
    """Whether a case runs under --cases: every case for "", else those whose name contains one of
    the comma list's parts."""
    return not cases or any(c in name for c in cases.split(","))


def lib_b_name(i):
    """Column of the i-th --lib-b library: mok_lib_b_ms, then mok_lib_b2_ms, mok_lib_b3_ms, ..."""
    return "mok_lib_b_ms" if i == 0 else f"mok_lib_b{i + 1}_ms"


def default_rounds(args):
    """--rounds when given, else 3 in blocked timing; interleaved: one launch per round (--reps)
    with --lib-b, else 3 (coarser rounds gave A/B results that flipped sign: docs/performance.md,
    "A/B of two builds")."""
    if args.rounds:
        return max(1, args.rounds)
    return 3 if TIMING["mode"] == "blocked" or not args.lib_b else max(1, args.reps)


# How time_ms times (set_timing): "blocked" (default) or "interleaved", and blocked's block length.
TIMING = {"mode": "blocked", "block_ms": 800.0}
# The median SM clock (MHz) of each function of the last blocked time_ms call (NVML samples), or
# None for each where NVML is not available or the timing was interleaved.
LAST_MHZ = []

try:
    import pynvml
    pynvml.nvmlInit()
    _NVML = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()
                                              if torch.cuda.is_available() else 0)
except Exception:  # no NVML: blocked timing without clock samples
    _NVML = None


def set_timing(mode, block_ms=800.0):
    TIMING.update(mode=mode, block_ms=block_ms)


def add_timing_args(ap):
    ap.add_argument("--timing", choices=("blocked", "interleaved"), default="blocked",
                    help="blocked (default): each function in blocks of back-to-back launches "
                         "(see --block-ms), timing the second half of each, so that each runs at "
                         "the clock its own power draw allows (the H200 sits at its 700 W limit "
                         "under these kernels); interleaved: the functions alternate launch by "
                         "launch (or in reps/rounds groups) and share one clock "
                         "(docs/performance.md, \"Blocked and interleaved timing\")")
    ap.add_argument("--block-ms", type=float, default=800.0,
                    help="blocked timing: milliseconds of the first timed function's block "
                         "(default 800; the others run as many launches)")


def _sm_mhz():
    return pynvml.nvmlDeviceGetClockInfo(_NVML, pynvml.NVML_CLOCK_SM) if _NVML else None


def _time_launches(fn, n, after=None):
    """ms of each of n back-to-back launches of fn (CUDA events around each); after(i), when
    given, runs on the host after launch i is enqueued."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        starts[i].record()
        fn()
        ends[i].record()
        if after:
            after(i)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_ms(fns, warmup, reps, rounds):
    """Median ms of each function, in TIMING's mode.
    blocked: `rounds` rounds; in each, every function runs a block of back-to-back launches, and
    the launches of the block's second half are timed (and the SM clock sampled), so that each
    function runs at the clock its own power draw allows. Every block has the same launch count,
    sized so that the first function's takes about block_ms (one timed launch of it); a function
    k times slower runs k times as long. The H200 sits at its 700 W limit under
    these kernels and its power control follows the draw over many milliseconds, so in an
    interleaved run a function that draws less lends clock to its neighbours: MoK's fused forward
    against torch's pipeline (many light kernels) at Qwen3-235B read 2.30x interleaved and 1.88x
    blocked (docs/performance.md, "Blocked and interleaved timing").
    interleaved: alternating rounds of reps/rounds launches in an order shuffled every round, so
    that a drift affects all functions alike: finer A/B comparisons of kernels that draw alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    mhz = [[] for _ in fns]
    if TIMING["mode"] == "blocked":
        block = max(20, int(TIMING["block_ms"] / max(_time_launches(fns[0], 1)[0], 1e-3)))
        for _ in range(rounds):
            for fn, t, m in zip(fns, times, mhz):
                def sample(i, m=m):  # NVML calls hold up the launches: every 8th of the 2nd half
                    if i >= block // 2 and i % 8 == 0 and _NVML:
                        m.append(_sm_mhz())
                t.extend(_time_launches(fn, block, sample)[block // 2:])
    else:
        per = max(1, reps // rounds)
        order = list(range(len(fns)))
        rng = random.Random(0)
        for _ in range(rounds):
            rng.shuffle(order)
            for i in order:
                times[i].extend(_time_launches(fns[i], per))
    LAST_MHZ[:] = [statistics.median(m) if m else None for m in mhz]
    return [statistics.median(t) for t in times]


def clock_fields(names):
    """{"NAME_mhz": median SM clock} of the last time_ms call's first functions, named in order;
    {} where it sampled none."""
    return {f"{n}_mhz": v for n, v in zip(names, LAST_MHZ) if v is not None}


def rel_err(x, ref):
    x, ref = x.float(), ref.float()
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)).item()


def git_commit(arg):
    if arg:
        return arg
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return "unknown"
