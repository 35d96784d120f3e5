"""
bench/gemm.py: MoK's persistent grouped GEMM (build/libmok_bench.so, mok_bench_gemm of
bench/driver/mok_bench.h) against torch._grouped_mm, in the same process on the same inputs.

Cases: the gate/up and down GEMMs of Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 with T = 16384
tokens and top-k 8 (R = 131072 routed rows), balanced routing and skewed routing (4 experts take
half of the rows); gate/up with MoK's fused SwiGLU epilogue against torch's plain GEMM (the ratio;
baseline_act_ms and ratio_act add torch's GEMM followed by the activation it replaces); and the
backward data-gradient GEMMs, whose weights are read N-major: ds = dy · Wd[e] (Wd [E, H, I]) and
dx = [dg du] · [Wg; Wu][e] ([E, 2I, H]). Weight gradients (mok_bench_gemm's kind 1, the groups
split the reduction over rows) for Qwen3-235B-A22B and DeepSeek-V3: dWd[e] = dy_eᵀ · a_e ([H, I]) and
dWg[e] = dg_eᵀ · x_e ([I, H]), bf16 outputs, against torch._grouped_mm(dy.t(), a, offs) (its
2D x 2D form: offsets split the reduction, output [E, N, K]); when torch rejects that form, against
a loop of torch.mm per expert (the row says which). Correctness of the weight gradients is checked
against the torch.mm loop in every case. fp8: the gate/up and down GEMMs with MoK's fp8-block path
(1x128 activation and 128x128 weight scales) against torch._scaled_grouped_mm with rowwise scales
(use_fast_accum=True), each on its own quantization of the same bf16 operands (group sizes rounded
to multiples of 16).

Each case: check MoK's output against torch's (relative L2 error; a case whose error is above 1e-2
is reported as wrong and not timed), then time both with CUDA events after warm-up (median; --timing
blocked by default: each function back to back in blocks of launches, about --block-ms for the
first, the second half of each block timed, see harness.py's time_ms; the operands are far larger
than L2, so no rotation is needed). Prints a table and appends one JSON object per case to --jsonl
(default bench/results/gemm.jsonl).

    python3 bench/gemm.py [--commit SHA] [--cases substring] [--timing blocked|interleaved]
                          [--variants [NAMES]] [--lib-b PATH[,PATH...]]

--variants times MoK again in the other configurations the kernels still have: tile bands through
mok_bench_gemm_t's group_m (band0: none, band4, band8, band16; the default picks 8 or none by the
size of B against the L2) and, for fp8, row-major activation scales (a_scale_ld 0); each must
write the default's bits.

--lib-b times the same launches through other builds: a libmok_bench.so, or a libmok.so older
than bench/driver, which exported the internal launchers with their structs of that time (the
compatibility loader PreDriverLib, for A/B runs against such builds only; it takes its tile bands
from its own defaults).
"""
import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (TIMING, add_timing_args, case_selected, clock_fields,  # noqa: E402
                     default_rounds, git_commit, lib_b_name, load_libs, rel_err, set_timing,
                     time_ms)

# The --variants columns (describe() prints them).
variants_names = ("mok_band8_ms", "mok_band0_ms", "mok_band4_ms", "mok_band16_ms",
                  "mok_rowmajor_scales_ms")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {  # name: (H, I, E)
    "qwen3-30b-a3b": (2048, 768, 128),
    "qwen3-235b-a22b": (4096, 1536, 128),
    "deepseek-v3": (7168, 2048, 256),
}
T, TOPK = 16384, 8

# enums of src/cuda/gemm/gemm.h
BF16, FP8_BLOCK, KMAJOR, NMAJOR = 0, 1, 0, 1
EPI_STORE_BF16, EPI_STORE_F32, EPI_ACCUM_F32, EPI_SWIGLU = 0, 1, 2, 3
# mok_bench_gemm_t's kind: the grouped GEMM, the weight-gradient (k-grouped) GEMM
KIND_GEMM, KIND_WGRAD = 0, 1
# --variants' tile bands: group_m row tiles per band. band0 is no bands (-1): group_m 0 is the
# default's choice by B's size against the L2, which is band8 or band0 depending on the case.
BANDS = {"band8": 8, "band0": -1, "band4": 4, "band16": 16}


class BenchGemm(ctypes.Structure):  # mok_bench_gemm_t (bench/driver/mok_bench.h), field for field
    _fields_ = [("struct_size", ctypes.c_size_t), ("kind", ctypes.c_int),
                ("dtype", ctypes.c_int), ("b_layout", ctypes.c_int), ("epilogue", ctypes.c_int),
                ("offsets_int64", ctypes.c_int), ("num_sms", ctypes.c_int),
                ("group_m", ctypes.c_int), ("num_groups", ctypes.c_int64),
                ("m_total", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("c", ctypes.c_void_p),
                ("row_scale", ctypes.c_void_p), ("g_out", ctypes.c_void_p),
                ("u_out", ctypes.c_void_p), ("a_scale", ctypes.c_void_p),
                ("b_scale", ctypes.c_void_p), ("a_scale_ld", ctypes.c_int64)]

    def __init__(self, **fields):
        # the driver checks struct_size, so a drift from the header is MOK_ERROR_VERSION_MISMATCH
        super().__init__(struct_size=ctypes.sizeof(BenchGemm), **fields)


def with_group_m(g, group_m):
    """A copy of g (a BenchGemm) whose tile order takes group_m row tiles per band (-1: none)."""
    q = BenchGemm.from_buffer_copy(g)
    q.group_m = group_m
    return q


class GemmLib:
    """A loaded library and how it launches a BenchGemm: prepare(g) gives (C function, its first
    argument, its name) for a copy of g, so that a timed launch converts nothing. This class: a
    libmok_bench.so, through mok_bench_gemm."""

    def __init__(self, path, cdll):
        self.path, self.cdll = path, cdll
        cdll.mok_error_string.argtypes = [ctypes.c_int]
        cdll.mok_error_string.restype = ctypes.c_char_p
        cdll.mok_last_error.argtypes = []
        cdll.mok_last_error.restype = ctypes.c_char_p
        self.declare()

    def declare(self):
        self.cdll.mok_bench_gemm.argtypes = [ctypes.POINTER(BenchGemm), ctypes.c_void_p]
        self.cdll.mok_bench_gemm.restype = ctypes.c_int

    def prepare(self, g):
        copy = BenchGemm.from_buffer_copy(g)
        return self.cdll.mok_bench_gemm, ctypes.byref(copy), "mok_bench_gemm"

    def error(self, rc):
        """What result rc means, and the library's last recorded error (the launchers' argument
        checks return a code without recording one, so it may be an earlier call's)."""
        what = (self.cdll.mok_error_string(rc) or b"?").decode(errors="replace")
        last = (self.cdll.mok_last_error() or b"").decode(errors="replace")
        return what + (f" (last recorded error: {last})" if last else "")


class PreDriverLib(GemmLib):
    """Compatibility loader, for A/B runs (--lib-b) against a libmok.so older than bench/driver,
    which exported the internal launchers mok_grouped_gemm_launch and mok_grouped_wgrad_launch.
    Their parameter structs of that time are mirrored here and nowhere else: the grouped GEMM's
    has no group_m, so such a library takes its tile bands from its own defaults (by B's size
    against the L2; it also read MOK_* knobs from the environment, which this benchmark no longer
    sets), and a BenchGemm that asks for bands is refused. The default library never goes through
    this class."""

    class GemmParams(ctypes.Structure):  # mok_grouped_gemm_params_t before the driver
        _fields_ = [("dtype", ctypes.c_int), ("b_layout", ctypes.c_int), ("epilogue", ctypes.c_int),
                    ("offsets_int64", ctypes.c_int), ("num_groups", ctypes.c_int64),
                    ("m_total", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                    ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                    ("offsets", ctypes.c_void_p), ("c", ctypes.c_void_p),
                    ("row_scale", ctypes.c_void_p), ("g_out", ctypes.c_void_p),
                    ("u_out", ctypes.c_void_p), ("num_sms", ctypes.c_int),
                    ("a_scale", ctypes.c_void_p), ("b_scale", ctypes.c_void_p),
                    ("a_scale_ld", ctypes.c_int64)]

    class WgradParams(ctypes.Structure):  # mok_grouped_wgrad_params_t before the driver
        _fields_ = [("epilogue", ctypes.c_int), ("offsets_int64", ctypes.c_int),
                    ("num_groups", ctypes.c_int64), ("m_total", ctypes.c_int64),
                    ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                    ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                    ("c", ctypes.c_void_p), ("num_sms", ctypes.c_int)]

    def declare(self):
        for name, params in (("mok_grouped_gemm_launch", self.GemmParams),
                             ("mok_grouped_wgrad_launch", self.WgradParams)):
            getattr(self.cdll, name).argtypes = [ctypes.POINTER(params), ctypes.c_void_p]
            getattr(self.cdll, name).restype = ctypes.c_int

    def prepare(self, g):
        if g.group_m != 0:
            raise ValueError(f"{self.path} is older than bench/driver: it has no group_m "
                             f"(asked for {g.group_m}) and takes its tile bands from its defaults")
        if g.kind == KIND_GEMM:
            p, name = self.GemmParams(), "mok_grouped_gemm_launch"
        elif g.kind == KIND_WGRAD:
            p, name = self.WgradParams(), "mok_grouped_wgrad_launch"
        else:
            raise ValueError(f"mok_bench_gemm_t kind {g.kind}")
        for field, _ in p._fields_:
            setattr(p, field, getattr(g, field))
        return getattr(self.cdll, name), ctypes.byref(p), name


def load_lib(path):
    """The library of --lib: a libmok_bench.so (default build/libmok_bench.so, which `make all`
    builds); libmok.so exports only include/mok.h, not the GEMMs."""
    cdll = ctypes.CDLL(path)
    if not hasattr(cdll, "mok_bench_gemm"):
        raise SystemExit(f"{path} has no mok_bench_gemm: --lib takes a libmok_bench.so "
                         f"(`make all` builds build/libmok_bench.so)")
    return GemmLib(path, cdll)


def load_lib_b(path):
    """A library of --lib-b: a libmok_bench.so (mok_bench_gemm), or a libmok.so older than
    bench/driver (mok_grouped_gemm_launch, through PreDriverLib)."""
    cdll = ctypes.CDLL(path)
    if hasattr(cdll, "mok_bench_gemm"):
        return GemmLib(path, cdll)
    if hasattr(cdll, "mok_grouped_gemm_launch"):
        return PreDriverLib(path, cdll)
    raise SystemExit(f"--lib-b {path}: exports neither mok_bench_gemm (a libmok_bench.so) nor "
                     f"mok_grouped_gemm_launch (a libmok.so older than bench/driver); a libmok.so "
                     f"of this tree exports only include/mok.h: take its build's libmok_bench.so")


def counts_for(routing, rows, experts, gen, align=1):
    c = counts_unaligned(routing, rows, experts, gen)
    if align > 1:  # round down to multiples of align, give the remainder to expert 0
        c = c // align * align
        c[0] += rows - int(c.sum())
    return c


def group_offsets(routing, rows, experts, gen, align=1):
    """The groups' row boundaries on the device: torch's [E] ends (int32) and MoK's [E + 1]
    offsets (int32, from 0)."""
    ends = torch.cumsum(counts_for(routing, rows, experts, gen, align), 0)
    offs_torch = ends.to(torch.int32).to("cuda")
    offs_mok = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32).to("cuda")
    return offs_torch, offs_mok


def gemm_launcher(lib, g, stream):
    """A function that launches the GEMM of `g` (a BenchGemm of either kind, as it is now) through
    `lib` (load_lib's or load_lib_b's), raising on an error code."""
    fn, arg, name = lib.prepare(g)
    s = ctypes.c_void_p(stream)

    def run():
        rc = fn(arg, s)
        if rc != 0:
            raise RuntimeError(f"{lib.path}: {name} returned {rc}: {lib.error(rc)}")
    return run


def selected_variants(args, table):
    """The entries of table ({"mok_NAME_ms": fn}) that --variants selects ({} without it)."""
    if not args.variants:
        return {}
    if args.variants == "all":
        return table
    keep = args.variants.split(",")
    return {k: v for k, v in table.items() if k[4:-3] in keep}


def check_same_bits(table, out, what):
    """table ({name: fn}), after checking that each fn writes into `out` the bits `out` holds now
    (the default configuration's output), which it holds again afterwards."""
    first = out.clone()
    for name, fn in table.items():
        out.fill_(float("nan"))
        fn()
        if not torch.equal(out.view(torch.int16), first.view(torch.int16)):
            raise RuntimeError(f"{what}: {name} gives other bits")
    out.copy_(first)
    return table


def lib_b_variant(args, params, stream, out, what):
    """{"mok_lib_b_ms": fn, ...}: the same launch through each --lib-b library, after checking that
    each writes into `out` the bits `out` holds now (the default library's output); {} without."""
    return check_same_bits({lib_b_name(i): gemm_launcher(lib_b, params, stream)
                            for i, lib_b in enumerate(args.lib_b)}, out, what)


def counts_unaligned(routing, rows, experts, gen):
    if routing == "balanced":
        c = torch.full((experts,), rows // experts, dtype=torch.int64)
        c[: rows - int(c.sum())] += 1
        return c
    # skewed: 4 experts share half of the rows, the rest is spread at random over the others
    hot = 4
    c = torch.zeros(experts, dtype=torch.int64)
    c[:hot] = rows // 2 // hot
    rest = rows - int(c.sum())
    picks = torch.randint(hot, experts, (rest,), generator=gen)
    c += torch.bincount(picks, minlength=experts)
    perm = torch.randperm(experts, generator=gen)  # hot experts not all at the front
    return c[perm]


def run_case(lib, model, gemm, routing, args, gen):
    H, I, E = MODELS[model]
    R = T * TOPK
    dev = "cuda"
    offs_torch, offs_mok = group_offsets(routing, R, E, gen)
    if gemm == "down":
        N, K = H, I
    elif gemm == "bwd_ds":  # dy [R, H] · Wd[e] [H, I]
        N, K = I, H
    elif gemm == "bwd_dx":  # dgu [R, 2I] · Wgu[e] [2I, H]
        N, K = H, 2 * I
    elif gemm == "gate_up":
        N, K = 2 * I, H
    else:  # gate_up_swiglu: output I columns from gate and up weights
        N, K = I, H
    a = (torch.randn(R, K, device=dev) * 0.5).to(torch.bfloat16)             # [R, K]
    wscale = K ** -0.5
    if gemm == "gate_up_swiglu":
        wg = (torch.randn(E, I, H, device=dev) * wscale).to(torch.bfloat16)  # [E, I, H]
        wu = (torch.randn(E, I, H, device=dev) * wscale).to(torch.bfloat16)  # [E, I, H]
        w_base = torch.cat([wg, wu], dim=1)                                  # [E, 2I, H]
        router = torch.rand(R, device=dev, dtype=torch.float32)              # [R]
        out = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
    elif gemm.startswith("bwd"):
        w = (torch.randn(E, K, N, device=dev) * wscale).to(torch.bfloat16)   # [E, K, N]
        out = torch.empty(R, N, device=dev, dtype=torch.bfloat16)
    else:
        w = (torch.randn(E, N, K, device=dev) * wscale).to(torch.bfloat16)   # [E, N, K]
        w_base = w
        out = torch.empty(R, N, device=dev, dtype=torch.bfloat16)

    p = BenchGemm(kind=KIND_GEMM, dtype=BF16, offsets_int64=0)
    p.b_layout = NMAJOR if gemm.startswith("bwd") else KMAJOR
    p.num_groups, p.m_total, p.n, p.k = E, R, N, K
    p.a, p.offsets, p.c = a.data_ptr(), offs_mok.data_ptr(), out.data_ptr()
    if gemm == "gate_up_swiglu":
        p.epilogue = EPI_SWIGLU
        p.b, p.b2, p.row_scale = wg.data_ptr(), wu.data_ptr(), router.data_ptr()
    else:
        p.epilogue = EPI_STORE_BF16
        p.b = w.data_ptr()
    p.num_sms = args.sms
    stream = torch.cuda.current_stream().cuda_stream

    mok = gemm_launcher(lib, p, stream)

    # MoK in its other configurations, for docs/performance.md (same bits as the default): the
    # tile bands; the kernel configuration itself follows from the epilogue
    variants = {f"mok_{name}_ms": gemm_launcher(lib, with_group_m(p, group_m), stream)
                for name, group_m in BANDS.items()}

    # torch takes b as [E, K, N]: a transposed view of [E, N, K] weights (K-major per expert), or
    # the N-major weights themselves for the backward cases
    wt = w if gemm.startswith("bwd") else w_base.transpose(1, 2)

    def base():
        return torch._grouped_mm(a, wt, offs=offs_torch)

    def base_act():  # what the SwiGLU epilogue replaces: the GEMM, then a = bf16(w · silu(g) · u)
        gu = torch._grouped_mm(a, wt, offs=offs_torch)
        return (router[:, None] * torch.nn.functional.silu(gu[:, :I].float()) *
                gu[:, I:].float()).to(torch.bfloat16)

    # correctness against torch on these inputs (poison first: every row must be written)
    out.fill_(float("nan"))
    mok()
    ref = base()
    if gemm == "gate_up_swiglu":
        g, u = ref[:, :I].float(), ref[:, I:].float()
        ref = (router[:, None] * torch.nn.functional.silu(g) * u).to(torch.bfloat16)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    nan = bool(torch.isnan(out.float()).any().item())
    flops = 2.0 * R * K * (2 * N if gemm == "gate_up_swiglu" else N)
    row = {"bench": "gemm", "case": f"{model}/{gemm}/{routing}", "device":
           torch.cuda.get_device_name(), "dtype": "bf16", "M": R, "N": N, "K": K, "E": E,
           "rel_err_vs_baseline": err, "baseline": "torch._grouped_mm" +
           (" (gemm only, no activation)" if gemm == "gate_up_swiglu" else ""),
           "commit": args.commit_resolved, "torch": torch.__version__}
    if nan or not err < 1e-2:
        row.update({"mok_ms": None, "baseline_ms": None, "ratio": None, "tflops": None,
                    "baseline_tflops": None, "error": f"wrong result: rel err {err:.3g}, nan={nan}"})
        return row
    # every configuration computes each tile in the same K order: the same bits (out: mok's)
    variants = check_same_bits(selected_variants(args, variants), out, row["case"])
    variants.update(lib_b_variant(args, p, stream, out, row["case"]))
    if gemm == "gate_up_swiglu":  # the ratio stays against the GEMM alone, the stricter baseline
        variants["baseline_act_ms"] = base_act
    if variants:
        times = time_ms([mok, base] + list(variants.values()), args.warmup, args.reps,
                        args.rounds)
        mok_ms, base_ms = times[:2]
        for name, t in zip(variants, times[2:]):
            row[name] = t
        if "baseline_act_ms" in row:
            row["baseline_act"] = "torch._grouped_mm, then w · silu(g) · u in fp32 to bf16"
            row["ratio_act"] = row["baseline_act_ms"] / times[0]
    else:
        mok_ms, base_ms = time_ms([mok, base], args.warmup, args.reps, args.rounds)
    row.update({"mok_ms": mok_ms, "baseline_ms": base_ms, "ratio": base_ms / mok_ms,
                "tflops": flops / mok_ms / 1e9, "baseline_tflops": flops / base_ms / 1e9,
                "timing": TIMING["mode"], **clock_fields(["mok", "baseline"])})
    return row


WGRAD_MODELS = ("qwen3-235b-a22b", "deepseek-v3")


def run_case_wgrad(lib, model, gemm, routing, args, gen):
    """Weight gradient C[e] [N, K] = A_eᵀ · B_e over the rows of expert e (A [R, N], B [R, K])."""
    H, I, E = MODELS[model]
    R = T * TOPK
    dev = "cuda"
    offs_torch, offs_mok = group_offsets(routing, R, E, gen)
    N, K = (H, I) if gemm == "wgrad_dwd" else (I, H)   # dWd: dy [R, H], a [R, I]; dWg: dg, x
    a = (torch.randn(R, N, device=dev) * 0.5).to(torch.bfloat16)             # [R, N]
    b = (torch.randn(R, K, device=dev) * 0.5).to(torch.bfloat16)             # [R, K]
    out = torch.empty(E, N, K, device=dev, dtype=torch.bfloat16)             # [E, N, K]
    out32 = torch.empty(E, N, K, device=dev, dtype=torch.float32)

    p = BenchGemm(kind=KIND_WGRAD, epilogue=EPI_STORE_BF16, offsets_int64=0)
    p.num_groups, p.m_total, p.n, p.k = E, R, N, K
    p.a, p.b, p.offsets, p.c = a.data_ptr(), b.data_ptr(), offs_mok.data_ptr(), out.data_ptr()
    p.num_sms = args.sms
    p32 = BenchGemm.from_buffer_copy(p)
    p32.epilogue, p32.c = EPI_STORE_F32, out32.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream

    mok, mok32 = gemm_launcher(lib, p, stream), gemm_launcher(lib, p32, stream)

    bounds = offs_mok.tolist()

    def loop():  # one torch.mm per expert (cuBLAS), written into a preallocated [E, N, K]
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            torch.mm(a[lo:hi].t(), b[lo:hi], out=loop_out[e])
    loop_out = torch.empty(E, N, K, device=dev, dtype=torch.bfloat16)

    at = a.t()  # [N, R], column-major view

    def grouped():
        return torch._grouped_mm(at, b, offs=offs_torch)

    # correctness against the torch.mm loop (poison first: every element must be written)
    out.fill_(float("nan"))
    out32.fill_(float("nan"))
    mok()
    mok32()
    loop()
    torch.cuda.synchronize()
    ref = loop_out
    err = rel_err(out, ref)
    err32 = rel_err(out32, ref)
    nan = bool(torch.isnan(out.float()).any().item() or torch.isnan(out32).any().item())
    baseline, base, base_err = "torch._grouped_mm (2D x 2D, k-grouped)", grouped, None
    try:
        base_err = rel_err(grouped(), ref)
        torch.cuda.synchronize()
        if not base_err < 1e-2:
            raise RuntimeError(f"torch._grouped_mm disagrees with the torch.mm loop: {base_err:.3g}")
    except Exception as ex:  # report, never fake a number
        baseline, base = f"loop of torch.mm per expert ({type(ex).__name__}: {ex})"[:300], loop
    flops = 2.0 * R * N * K
    row = {"bench": "gemm", "case": f"{model}/{gemm}/{routing}", "device":
           torch.cuda.get_device_name(),
           "dtype": "bf16 in, bf16 out (mok_f32_ms and the --lib-b columns: fp32 out)",
           "M": R, "N": N, "K": K, "E": E, "rel_err_vs_baseline": err,
           "rel_err_f32_vs_mm_loop": err32, "baseline_rel_err_vs_mm_loop": base_err,
           "reference": "loop of torch.mm per expert (rel_err_vs_baseline is against it)",
           "baseline": baseline, "commit": args.commit_resolved, "torch": torch.__version__}
    if nan or not err < 1e-2 or not err32 < 1e-2:
        row.update({"mok_ms": None, "baseline_ms": None, "ratio": None, "tflops": None,
                    "baseline_tflops": None,
                    "error": f"wrong result: rel err {err:.3g} (f32 {err32:.3g}), nan={nan}"})
        return row
    # --lib-b: the fp32 launch through each other build (same bits as this build's fp32 output)
    extra = lib_b_variant(args, p32, stream, out32, row["case"])
    times = time_ms([mok, base, mok32, *extra.values()], args.warmup, args.reps, args.rounds)
    mok_ms, base_ms, mok32_ms = times[:3]
    row.update(zip(extra, times[3:]))
    row.update({"mok_ms": mok_ms, "baseline_ms": base_ms, "ratio": base_ms / mok_ms,
                "tflops": flops / mok_ms / 1e9, "baseline_tflops": flops / base_ms / 1e9,
                "mok_f32_ms": mok32_ms,
                "timing": TIMING["mode"], **clock_fields(["mok", "baseline"])})
    return row


E4M3_MAX = 448.0


def quant_blocks(x, br, bc):
    """x [R, C] -> (e4m3 [R, C], fp32 scales [R/br, C/bc]) with scale = amax / 448 per block."""
    R, C = x.shape
    xb = x.float().view(R // br, br, C // bc, bc)
    scale = xb.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (xb / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(R, C), scale


def dequant_blocks(q, scale, br, bc):
    R, C = q.shape
    return (q.float().view(R // br, br, C // bc, bc) * scale[:, None, :, None]).view(R, C)


def run_case_fp8(lib, model, gemm, routing, args, gen):
    H, I, E = MODELS[model]
    R = T * TOPK
    dev = "cuda"
    offs_torch, offs_mok = group_offsets(routing, R, E, gen, align=16)
    N, K = (2 * I, H) if gemm == "gate_up" else (H, I)
    a = (torch.randn(R, K, device=dev, dtype=torch.bfloat16) * 0.5)              # [R, K]
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * (K ** -0.5)     # [E, N, K]
    # MoK fp8-block operands, and torch's rowwise ones (per row of A, per (expert, column) of W);
    # weights expert by expert to keep the fp32 temporaries small
    a_q, a_s = quant_blocks(a, 1, 128)                                # [R, K], [R, K/128]
    a_deq = dequant_blocks(a_q, a_s, 1, 128).to(torch.bfloat16)
    w_q = torch.empty(E, N, K, device=dev, dtype=torch.float8_e4m3fn)
    w_s = torch.empty(E, N // 128, K // 128, device=dev, dtype=torch.float32)
    w_deq = torch.empty(E, N, K, device=dev, dtype=torch.bfloat16)
    w_rq = torch.empty(E, N, K, device=dev, dtype=torch.float8_e4m3fn)
    w_rs = torch.empty(E, N, device=dev, dtype=torch.float32)
    for e in range(E):
        w_q[e], w_s[e] = quant_blocks(w[e], 128, 128)
        w_deq[e] = dequant_blocks(w_q[e], w_s[e], 128, 128).to(torch.bfloat16)
        we = w[e].float()
        w_rs[e] = we.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
        w_rq[e] = (we / w_rs[e][:, None]).to(torch.float8_e4m3fn)
    a_rs = a.float().abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX              # [R]
    a_rq = (a.float() / a_rs[:, None]).to(torch.float8_e4m3fn)
    del w
    out = torch.empty(R, N, device=dev, dtype=torch.bfloat16)

    p = BenchGemm(kind=KIND_GEMM, dtype=FP8_BLOCK, b_layout=KMAJOR, epilogue=EPI_STORE_BF16,
                  offsets_int64=0)
    p.num_groups, p.m_total, p.n, p.k = E, R, N, K
    p.a, p.b, p.offsets, p.c = a_q.data_ptr(), w_q.data_ptr(), offs_mok.data_ptr(), out.data_ptr()
    p.b_scale = w_s.data_ptr()
    p.num_sms = args.sms
    stream = torch.cuda.current_stream().cuda_stream

    # activation scales K-block major, [K/128, R] (R % 4 == 0), the faster layout for MoK: it
    # loads each tile's with its operands, through shared memory
    a_s_t = a_s.t().contiguous()
    p.a_scale, p.a_scale_ld = a_s_t.data_ptr(), R
    p_r = BenchGemm.from_buffer_copy(p)  # the same scales row-major, [R, K/128]
    p_r.a_scale, p_r.a_scale_ld = a_s.data_ptr(), 0

    mok = gemm_launcher(lib, p, stream)
    mok_rowmajor_scales = gemm_launcher(lib, p_r, stream)

    w_rq_t = w_rq.transpose(1, 2)  # [E, K, N], column-major per expert

    def base():
        return torch._scaled_grouped_mm(a_rq, w_rq_t, a_rs, w_rs, offs=offs_torch,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    out.fill_(float("nan"))
    mok()
    ref = torch._grouped_mm(a_deq, w_deq.transpose(1, 2), offs=offs_torch)  # same quantized values
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    nan = bool(torch.isnan(out.float()).any().item())
    flops = 2.0 * R * K * N
    row = {"bench": "gemm", "case": f"{model}/{gemm}/{routing}/fp8", "device":
           torch.cuda.get_device_name(), "dtype": "fp8-block (mok) vs fp8 rowwise (torch)",
           "M": R, "N": N, "K": K, "E": E, "rel_err_vs_dequant_bf16": err,
           "baseline": "torch._scaled_grouped_mm rowwise, use_fast_accum=True",
           "commit": args.commit_resolved, "torch": torch.__version__}
    del ref
    try:
        base_out = base()
        for e in range(E):  # torch's own dequantized operands, for its error (w_deq is free now)
            w_deq[e] = (w_rq[e].float() * w_rs[e][:, None]).to(torch.bfloat16)
        a_deq = (a_rq.float() * a_rs[:, None]).to(torch.bfloat16)
        row["baseline_rel_err_vs_dequant_bf16"] = rel_err(
            base_out, torch._grouped_mm(a_deq, w_deq.transpose(1, 2), offs=offs_torch))
        del base_out
        base_ok = True
    except Exception as ex:  # report, never fake a number
        row["baseline_error"] = f"{type(ex).__name__}: {ex}"[:300]
        base_ok = False
    if nan or not err < 2e-2:
        row.update({"mok_ms": None, "baseline_ms": None, "ratio": None, "tflops": None,
                    "baseline_tflops": None, "error": f"wrong result: rel err {err:.3g}, nan={nan}"})
        return row
    if base_ok:
        # MoK in other configurations, for docs/performance.md (same bits as the default)
        extra = check_same_bits(selected_variants(args, {
            "mok_rowmajor_scales_ms": mok_rowmajor_scales,
            **{f"mok_{name}_ms": gemm_launcher(lib, with_group_m(p, BANDS[name]), stream)
               for name in ("band0", "band4", "band8", "band16")}}), out, row["case"])
        extra.update(lib_b_variant(args, p, stream, out, row["case"]))  # out: mok's, from above
        times = time_ms([mok, base] + list(extra.values()), args.warmup, args.reps,
                        args.rounds)
        mok_ms, base_ms = times[:2]
        row.update({"mok_ms": mok_ms, "baseline_ms": base_ms, "ratio": base_ms / mok_ms,
                    "tflops": flops / mok_ms / 1e9, "baseline_tflops": flops / base_ms / 1e9})
        row.update(dict(zip(extra, times[2:])))
    else:
        (mok_ms,) = time_ms([mok], args.warmup, args.reps, args.rounds)
        row.update({"mok_ms": mok_ms, "baseline_ms": None, "ratio": None,
                    "tflops": flops / mok_ms / 1e9, "baseline_tflops": None})
    row.update({"timing": TIMING["mode"], **clock_fields(["mok", "baseline"])})
    row["rel_err_vs_baseline"] = err
    return row


def describe(row):
    """One line of a case's results for the running log."""
    if row["mok_ms"] is None:
        return "WRONG " + row["error"]
    out = f"mok {row['mok_ms']:7.3f} ms {row['tflops']:6.1f} TF/s | "
    if row["baseline_ms"] is None:
        out += "torch failed: " + row.get("baseline_error", "?")
    else:
        out += (f"torch {row['baseline_ms']:7.3f} ms {row['baseline_tflops']:6.1f} TF/s | "
                f"ratio {row['ratio']:.3f}")
    err = row.get("rel_err_vs_dequant_bf16", row.get("rel_err_vs_baseline"))
    out += f" | err {err:.2e}"
    if "mok_f32_ms" not in row:  # --variants
        out += "".join(f" | {k[4:-3]} {v:.3f}" for k, v in row.items()
                       if k in variants_names or k.startswith("mok_lib_b"))
        if "ratio_act" in row:
            out += (f" | torch + activation {row['baseline_act_ms']:.3f} ms, "
                    f"ratio {row['ratio_act']:.3f}")
    else:  # weight gradients
        out += f" | mok fp32 out {row['mok_f32_ms']:.3f} ms" + "".join(
            f" | {k[4:-3]} fp32 out {v:.3f}" for k, v in row.items() if k.startswith("mok_lib_b"))
        out += f" | baseline {row['baseline']}"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libmok_bench.so"),
                    help="the libmok_bench.so to time (default build/libmok_bench.so, built by "
                         "`make all`)")
    ap.add_argument("--lib-b", default=None, metavar="PATH[,PATH...]",
                    help="A/B: also time the GEMMs (bf16 and fp8) through these other builds in "
                         "the same rounds (each must give the same bits; columns lib_b, lib_b2, "
                         "...): a libmok_bench.so, or a libmok.so older than bench/driver (it "
                         "exported mok_grouped_gemm_launch; its tile bands are its defaults)")
    ap.add_argument("--jsonl", default=os.path.join(ROOT, "bench", "results", "gemm.jsonl"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--cases", default="",
                    help="run only cases whose name contains this (or one of these, comma list)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30,
                    help="launches per function with --timing interleaved (blocked timing "
                         "sizes its blocks by --block-ms)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of the timing (blocked: rounds of one block per function, "
                         "default 3; interleaved: alternating rounds of reps/rounds launches, "
                         "default 3, or one launch per round (= --reps) with --lib-b: coarser "
                         "rounds gave A/B results that flipped sign: docs/performance.md, "
                         "\"A/B of two builds\")")
    ap.add_argument("--sms", type=int, default=0, help="persistent CTAs (0 = one per SM)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 cases")
    ap.add_argument("--variants", nargs="?", const="all", default=None, metavar="NAMES",
                    help="also time MoK in other configurations: rowmajor_scales (fp8: a_scale_ld "
                         "0), band0, band4, band8, band16 (bf16 and fp8: tile bands, group_m "
                         "-1 = none, 4, 8, 16; the default picks 8 or none by B's size); all of "
                         "them, or a comma list (each must write the default's bits)")
    add_timing_args(ap)
    args = ap.parse_args()
    set_timing(args.timing, args.block_ms)
    args.commit_resolved = git_commit(args.commit)
    args.rounds = default_rounds(args)
    lib = load_lib(args.lib)
    args.lib_b = load_libs(args.lib_b, load_lib_b)
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    cases = [(f"{m}/{g}/{r}", run_case, (m, g, r)) for m in MODELS
             for g in ("gate_up", "gate_up_swiglu", "down", "bwd_ds", "bwd_dx")
             for r in ("balanced", "skewed")]
    cases += [(f"{m}/{g}/{r}", run_case_wgrad, (m, g, r)) for m in WGRAD_MODELS
              for g in ("wgrad_dwd", "wgrad_dwg") for r in ("balanced", "skewed")]
    if not args.no_fp8:
        cases += [(f"{m}/{g}/{r}/fp8", run_case_fp8, (m, g, r)) for m in MODELS
                  for g in ("gate_up", "down") for r in ("balanced", "skewed")]
    rows = []
    for name, run, (model, gemm, routing) in cases:
        if not case_selected(name, args.cases):
            continue
        row = run(lib, model, gemm, routing, args, gen)
        rows.append(row)
        torch.cuda.empty_cache()
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name:44s} {describe(row)}", flush=True)
    print(f"\n{'case':44s} {'mok ms':>8s} {'TF/s':>7s} {'torch ms':>9s} {'TF/s':>7s} {'ratio':>6s}")
    for r in rows:
        if r["mok_ms"] is None:
            print(f"{r['case']:44s} WRONG ({r['error']})")
        elif r["baseline_ms"] is None:
            print(f"{r['case']:44s} {r['mok_ms']:8.3f} {r['tflops']:7.1f}   (baseline failed)")
        else:
            print(f"{r['case']:44s} {r['mok_ms']:8.3f} {r['tflops']:7.1f} {r['baseline_ms']:9.3f} "
                  f"{r['baseline_tflops']:7.1f} {r['ratio']:6.3f}")
    return 0 if all(r["mok_ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
