"""
bench/forward.py: MoK's GPU forward of a whole MoE layer (W = 1, BF16) against the plain PyTorch
pipeline, in the same process on the same inputs.

The PyTorch pipeline (written here, the usual way): sort the routed (token, slot) pairs by expert,
gather the token rows, torch._grouped_mm with the concatenated gate and up weights, SwiGLU with
the router weight in fp32, torch._grouped_mm with the down weights, index_add_ into an fp32
output, plus the shared expert as dense matmuls; y in bf16. MoK runs what mok_forward and mok_backward
run by default: the forward is the layout kernel plus one fused persistent kernel
(src/cuda/forward/fused.cu), the backward the kernel chain of src/gpu/backward.c. The forward's
unfused kernel chain (a second layer tuned to forward_path = 1, the chain) is timed in the same
run (chain_ms); y must be the same bits both ways (fused_equals_chain). Each model also gets a
forward + backward case against the pipeline under torch.autograd (FLOPs 3x the forward's), with
the fused backward kernel (tuning backward_path = 1, src/cuda/backward/fused.cu) timed in the same
rounds (bwd_fused_ms, bwd_fused_vs_chain = chain / fused; its gradients must be the chain's bits,
fused_bwd_equals_chain) and any --variant of backward_* fields on top of it, and
fp32 weight gradients, or bf16 ones (the pipeline's dtype; the row's "wgrad") where fp32 ones do
not fit beside the pipeline, or as --wgrad says.

Shapes: Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 (with its shared expert), T = 16384 tokens,
top-8 routing drawn uniformly at random. Each case first checks MoK's y against the pipeline's
(relative L2 error; above 1e-2 the case is reported as wrong and not timed), then times both with
CUDA events after warm-up (median; --timing blocked by default: each function runs back to back in
blocks of launches, about --block-ms for the first, and the second half of each block is timed, so
that each runs at the clock its own power draw allows; see harness.py's time_ms).
FLOPs: 6 T K H I + 6 T H Is. The same run times the dense ceiling: the layer's GEMMs as dense
cuBLAS matmuls with all T K routed rows as one expert (dense_ceiling), forward and forward +
backward; ceiling_ratio = ceiling_ms / mok_ms (1.0 would be dense-GEMM speed). The forward +
backward row also gives the memory: MoK's workspace + context bytes (mok_mem_bytes) against the
pipeline's peak allocation above its starting point during a step (baseline_mem_bytes). Appends
one JSON object per case to --jsonl (default bench/results/forward.jsonl).

    python3 bench/forward.py [--commit SHA] [--cases substring] [--timing blocked|interleaved]
                             [--variant NAME:FIELD=VALUE ...] [--profile] [--wgrad auto]
                             [--lib-b PATH[,PATH...]]

The binding (python/mok) loads the library MOK_LIBRARY names; unless it is set, this benchmark
sets it to build/libmok_bench.so (`make all`), which has the public API and the tuning entry point
mok_bench_layer_tune (bench/driver/mok_bench.h) that the chain and --variant need. Tuning values
belong to a layer (src/common/tuning.h: a layer copies the defaults when it is created), so each
configuration is a layer of its own, tuned once when it is created, and the default layer is
never tuned: the timed calls are plain mok_forward calls. The extra layers are closed before the
forward + backward case. The --lib-b builds (a libmok.so of any version the binding takes, or a
libmok_bench.so) are loaded through the binding too, and timed through the public API with their
own defaults: no tuning calls on them.

--profile also prints the device time of every kernel of the fused forward, the chain, the
pipeline, each --variant / --lib-b and MoK's forward + backward step, with the chain backward and
with the fused one (torch.profiler, mean of a few launches). (The fused
kernel's task trace is gone; docs/performance.md, "Fused forward: where the time goes", keeps
what it showed.)

--variant NAME:FIELD=VALUE[,FIELD=VALUE] times the fused forward again on a layer tuned so
(variant_NAME_ms), after checking that its y is the chain's bits too. FIELDs are
mok_bench_layer_tune's names of src/common/tuning.h: forward_path (0 fused, 1 chain),
forward_sms, fused_lag, fused_shared_band, fused_help_pct, tile_group_m (0 = by B's size against
the L2, -1 = none, n), timeout_s. Example: --variant lag2:fused_lag=2,fused_help_pct=100. A
variant of only backward_* fields (backward_sms, backward_lag) instead times the forward +
backward case's fused backward step with those values (bwd_variant_NAME_ms), after checking its
gradients' bits. Example: --variant lagE:backward_lag=1000

--lib-b PATH[,PATH...] times the fused forward of other libmok.so builds in the same rounds
(mok_lib_b_ms, mok_lib_b2_ms, ...), after checking that each gives the chain's bits: an A/B of
two builds on the same machine in the same thermal state. In the forward + backward case each
build's step is timed too, with its default backward (bwd_lib_b_ms, ...) and, for a
libmok_bench.so, its fused one (bwd_lib_b_fused_ms, ...); their gradients are checked against the
pipeline's (relative error: another build may sum in another order) and the fused one against
the build's own default, bitwise. Separate processes on the same machine
measured the same build 1-2% apart; with --timing interleaved, one launch of each function per
round (--rounds = --reps, the default with --lib-b) is the protocol that gave the same answer in
both positions (docs/performance.md, "A/B of two builds").
"""
import argparse
import ctypes
import json
import os
import sys

# torch before the binding's library, the order src/gpu/nccl_loader.h asks for: the first to load
# libnccl.so.2 decides for the process
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
# The binding loads MOK_LIBRARY (python/mok/_lib.py): the benchmarks' library, which has
# mok_bench_layer_tune, unless the user named another.
os.environ.setdefault("MOK_LIBRARY", os.path.join(ROOT, "build", "libmok_bench.so"))
from harness import (TIMING, add_timing_args, case_selected, clock_fields,  # noqa: E402
                     default_rounds, git_commit, lib_b_name, load_libs, rel_err, set_timing,
                     time_ms)
import mok  # noqa: E402
import mok._lib  # noqa: E402

MODELS = {  # name: (H, I, E, K, Is)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0),
    "deepseek-v3": (7168, 2048, 256, 8, 2048),
}
T = 16384


def torch_pipeline(x, idx, tw, wgu_t, wd_t, shared):
    """y [T, H] bf16 of the MoE layer, plain PyTorch. wgu_t [E, H, 2I] and wd_t [E, I, H] are
    transposed views of the Linear-layout weights, as torch._grouped_mm wants them."""
    T_, K = idx.shape
    E, I = wgu_t.shape[0], wd_t.shape[1]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    gu = torch._grouped_mm(x[tok], wgu_t, offs=offs)                          # [R, 2I]
    a = (F.silu(gu[:, :I].float()) * gu[:, I:].float() * tw.flatten()[order, None]).bfloat16()
    yk = torch._grouped_mm(a, wd_t, offs=offs)                                # [R, H]
    y = torch.zeros(T_, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, tok, yk.float())
    if shared is not None:
        wsg, wsu, wsd = shared
        as_ = (F.silu((x @ wsg.t()).float()) * (x @ wsu.t()).float()).bfloat16()
        y += (as_ @ wsd.t()).float()
    return y.bfloat16()


def dense_ceiling(T_, H, I, K, Is, dev, gen):
    """(forward, forward + backward): functions running the layer's GEMMs as dense cuBLAS bf16
    matmuls (torch.matmul into preallocated outputs) with all T K routed rows as one expert and
    the shared expert on the T tokens: the same FLOPs with none of the MoE's gathers, groups or
    epilogues, the ceiling MoK is measured against (ceiling_ratio = ceiling_ms / mok_ms).
    Forward: [M, H]·[H, 2I] and [M, I]·[I, H] (M = T K); backward adds ds = [M, H]·[H, I],
    dx = [M, 2I]·[2I, H] (one reduction of 2I, as MoK's), dWd = [H, M]·[M, I] and
    dWgu = [2I, M]·[M, H]; the shared expert the same with T rows and Is."""
    def r(*shape):
        return torch.randn(*shape, device=dev, generator=gen).bfloat16()
    parts = [(T_ * K, I)] + ([(T_, Is)] if Is else [])
    bufs = []
    for M, N in parts:
        b = dict(x=r(M, H), wgu=r(H, 2 * N), gu=r(M, 2 * N), wd=r(N, H), a=r(M, N), y=r(M, H),
                 wdt=r(H, N), ds=r(M, N), wgut=r(2 * N, H), dx=r(M, H), dwd=r(H, N),
                 dwgu=r(2 * N, H))
        bufs.append(b)

    def fwd():
        for b in bufs:
            torch.matmul(b["x"], b["wgu"], out=b["gu"])
            torch.matmul(b["a"], b["wd"], out=b["y"])

    def fwd_bwd():
        fwd()
        for b in bufs:
            torch.matmul(b["y"], b["wdt"], out=b["ds"])
            torch.matmul(b["gu"], b["wgut"], out=b["dx"])
            torch.matmul(b["y"].t(), b["a"], out=b["dwd"])
            torch.matmul(b["gu"].t(), b["x"], out=b["dwgu"])
    return fwd, fwd_bwd, bufs


# mok_bench_layer_tune's field names (bench/driver/mok_bench.h, src/common/tuning.h)
TUNING_FIELDS = ("forward_path", "forward_sms", "fused_lag", "fused_shared_band",
                 "fused_help_pct", "backward_path", "backward_sms", "backward_lag",
                 "tile_group_m", "timeout_s")
FORWARD_CHAIN = {"forward_path": 1}  # MOK_FORWARD_CHAIN of src/common/tuning.h


def parse_variant(spec):
    """(NAME, {field: value}) of a --variant NAME:FIELD=VALUE[,FIELD=VALUE]; argparse's error for
    a malformed one or a field mok_bench_layer_tune does not know."""
    name, _, fields = spec.partition(":")
    tuning = {}
    for kv in (kv for kv in fields.split(",") if kv):
        field, eq, value = kv.partition("=")
        if not eq or field not in TUNING_FIELDS:
            raise argparse.ArgumentTypeError(f"{spec!r}: {kv!r} is not FIELD=VALUE with a FIELD "
                                             f"of {', '.join(TUNING_FIELDS)}")
        try:
            tuning[field] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{spec!r}: {field} = {value!r} is not a number")
    if not name or not tuning:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE]")
    return name, tuning


def declare_tuning():
    """Declares mok_bench_layer_tune on the binding's library; SystemExit when that library has
    none (MOK_LIBRARY names a libmok.so, which exports only include/mok.h)."""
    try:
        lib = mok._lib.lib()
    except OSError as e:
        raise SystemExit(f"MOK_LIBRARY={os.environ['MOK_LIBRARY']}: {e} (`make all` builds "
                         f"build/libmok_bench.so)")
    if not hasattr(lib, "mok_bench_layer_tune"):
        raise SystemExit(f"MOK_LIBRARY={os.environ['MOK_LIBRARY']} has no mok_bench_layer_tune: "
                         f"the chain and --variant need a libmok_bench.so (`make all` builds "
                         f"build/libmok_bench.so)")
    lib.mok_bench_layer_tune.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_double]
    lib.mok_bench_layer_tune.restype = ctypes.c_int


def tuned_layer(tuning, *args, **kwargs):
    """A mok.Layer(*args, **kwargs) of the binding's library with the values of `tuning`
    ({field: value}) set on its handle by mok_bench_layer_tune, once, before any call on it."""
    layer = mok.Layer(*args, **kwargs)
    try:
        for field, value in tuning.items():
            mok._lib.check(layer._lib.mok_bench_layer_tune(layer._layer, field.encode(), value))
    except Exception:
        layer.close()
        raise
    return layer


def load_lib_b(path):
    """Another build (an A/B library), loaded and declared as the binding loads its own: the
    binding reads MOK_LIBRARY, set to `path` for this load only."""
    default = os.environ["MOK_LIBRARY"]
    os.environ["MOK_LIBRARY"] = path
    try:
        return mok._lib.load()
    finally:
        os.environ["MOK_LIBRARY"] = default


def with_lib(fn, lib):
    """fn run with the binding's current library (mok._lib.lib()) set to `lib` (a load_lib_b
    library), restored afterwards: a Layer keeps the library current when it is created, and the
    binding's error messages come from the current one."""
    def run():
        old = mok._lib._LIB
        mok._lib._LIB = lib
        try:
            return fn()
        finally:
            mok._lib._LIB = old
    return run


def same_bits(fn, check, y, y_ref):
    """Whether fn (a forward writing y, then its layer's check) writes y_ref's bits into y, which
    is filled with NaN first so that a forward that writes nothing cannot pass."""
    y.fill_(float("nan"))
    fn()
    check()
    return torch.equal(y.view(torch.int16), y_ref.view(torch.int16))


def kernel_times(fn, iters=3):
    """[(kernel name, mean device ms per call)] of fn's kernels in launch order, by torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total, order = {}, []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if ev.name not in total:
            order.append(ev.name)
            total[ev.name] = 0.0
        total[ev.name] += ev.time_range.elapsed_us() / 1e3 / iters
    return [(name, total[name]) for name in order]


def print_kernel_times(model, label, fn):
    rows = kernel_times(fn)
    print(f"{model} {label}: {sum(t for _, t in rows):.3f} ms of kernels")
    for name, t in rows:
        print(f"    {t:8.3f} ms  {name[:100]}")


def run_case(model, args, gen):
    H, I, E, K, Is = MODELS[model]
    dev = torch.device("cuda", 0)
    x = (torch.randn(T, H, device=dev, generator=gen) * 0.5).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(T, K, device=dev, generator=gen), dim=1)
    w = {"wg": (torch.randn(E, I, H, device=dev, generator=gen) * H ** -0.5).bfloat16(),
         "wu": (torch.randn(E, I, H, device=dev, generator=gen) * H ** -0.5).bfloat16(),
         "wd": (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).bfloat16()}
    shared = None
    if Is:
        w["wsg"] = (torch.randn(Is, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w["wsu"] = (torch.randn(Is, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w["wsd"] = (torch.randn(H, Is, device=dev, generator=gen) * Is ** -0.5).bfloat16()
        shared = (w["wsg"], w["wsu"], w["wsd"])
    wgu_t = torch.cat([w["wg"], w["wu"]], dim=1).transpose(1, 2)             # [E, H, 2I] view
    wd_t = w["wd"].transpose(1, 2)                                            # [E, I, H] view

    shape = dict(hidden=H, intermediate=I, num_experts=E, top_k=K, max_tokens=T,
                 shared_intermediate=Is, device="cuda:0")
    layer = mok.Layer(**shape)  # the defaults, never tuned: what mok_forward runs
    # the chain on a layer of its own (tuning belongs to a layer); closed with the --variant
    # layers before the forward + backward case
    chain_layer = tuned_layer(FORWARD_CHAIN, **shape)
    tuned = [chain_layer]
    y = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    ctx = torch.empty(layer.context_bytes(), device=dev, dtype=torch.uint8)
    stream = torch.cuda.current_stream(dev).cuda_stream

    def forward_of(lay):
        return lambda: lay.forward(x, idx, tw, w, y, ctx, stream=stream)
    mok_fwd, chain_fwd = forward_of(layer), forward_of(chain_layer)

    def base():
        return torch_pipeline(x, idx, tw, wgu_t, wd_t, shared)

    chain_fwd()
    chain_layer.check()
    y_chain = y.clone()
    mok_fwd()
    layer.check()
    same = bool(torch.equal(y.view(torch.int16), y_chain.view(torch.int16)))
    if not same:
        print(f"{model}: the fused forward's y differs from the chain's")
    err = rel_err(y, base())
    row = {"bench": "forward", "case": f"{model}/T{T}", "device": torch.cuda.get_device_name(dev),
           "baseline": "PyTorch pipeline: argsort + torch._grouped_mm + SwiGLU + index_add_",
           "commit": git_commit(args.commit), "torch": torch.__version__,
           "rel_err_vs_baseline": err, "fused_equals_chain": same,
           "mok_path": "layout + fused persistent kernel (src/cuda/forward/fused.cu)"}
    if not err < 1e-2:
        row["wrong"] = True
        print(f"{model}: WRONG, relative error {err:.3g} against the PyTorch pipeline")
        for lay in [layer, *tuned]:
            lay.close()
        return [row]
    # --variant NAME:FIELD=VALUE[,FIELD=VALUE]: the fused forward of a layer tuned so, same bits
    # required
    variants = {}
    for name, tuning in args.variant:
        if all(f.startswith("backward_") for f in tuning):
            continue  # a backward variant: timed in the forward + backward case
        lay = tuned_layer(tuning, **shape)
        tuned.append(lay)
        fn = forward_of(lay)
        if not same_bits(fn, lay.check, y, y_chain):
            print(f"{model}: variant {name} ({tuning}) gives other bits than the chain")
            row["variant_differs"] = name
        variants[f"variant_{name}_ms"] = fn
    # --lib-b: the fused forward through another build, its own layer (same inputs and outputs)
    layers_b = []
    for i, lib_b in enumerate(args.lib_b):
        # (a Layer keeps the library it was created with)
        layer_b = with_lib(lambda: mok.Layer(**shape), lib_b)()
        layers_b.append((layer_b, lib_b))
        fn = with_lib(lambda lb=layer_b: lb.forward(x, idx, tw, w, y, ctx, stream=stream), lib_b)
        if not same_bits(fn, with_lib(layer_b.check, lib_b), y, y_chain):
            print(f"{model}: --lib-b {i + 1} gives other bits than the chain")
            row["variant_differs"] = lib_b_name(i)
        variants[lib_b_name(i)] = fn
    times = time_ms([mok_fwd, chain_fwd, base] + list(variants.values()), args.warmup,
                    args.reps, args.rounds)
    mok_ms, chain_ms, base_ms = times[:3]
    row.update(zip(variants, times[3:]))
    for lay in [layer, *tuned]:
        lay.check()
    for layer_b, lib_b in layers_b:
        with_lib(layer_b.check, lib_b)()
    if args.profile:
        for label, fn in (("fused", mok_fwd), ("chain", chain_fwd), ("pipeline", base)):
            print_kernel_times(model, label, fn)
        for name, fn in variants.items():  # variant_NAME_ms, mok_lib_b_ms, ...
            label = name[8:-3] if name.startswith("variant_") else name[4:-3]
            print_kernel_times(model, label, fn)
    # before the forward + backward, which needs the memory (a workspace each)
    for lay in tuned:
        lay.close()
    for layer_b, lib_b in layers_b:
        with_lib(layer_b.close, lib_b)()
    flops = 6.0 * T * K * H * I + 6.0 * T * H * Is
    # the dense ceiling, forward and forward + backward, timed here where its buffers fit
    dense_fwd, dense_fwd_bwd, dense_bufs = dense_ceiling(T, H, I, K, Is, dev, gen)
    ceiling_ms, ceiling_fb_ms = time_ms([dense_fwd, dense_fwd_bwd], args.warmup, args.reps,
                                        args.rounds)
    dense_bufs.clear()
    dense_fwd = dense_fwd_bwd = None
    torch.cuda.empty_cache()
    row.update(ceiling_ms=ceiling_ms, ceiling_ratio=ceiling_ms / mok_ms,
               ceiling_tflops=flops / ceiling_ms * 1e-9)
    row.update(mok_ms=mok_ms, baseline_ms=base_ms, ratio=base_ms / mok_ms,
               tflops=flops / mok_ms * 1e-9, baseline_tflops=flops / base_ms * 1e-9,
               chain_ms=chain_ms, chain_ratio=base_ms / chain_ms,
               timing=TIMING["mode"], **clock_fields(["mok", "chain", "baseline"]))
    rows = [row]

    # Forward + backward: mok_forward + mok_backward (fp32 weight gradients; bf16 ones, like the
    # pipeline's, where fp32 ones do not fit beside the pipeline's autograd state: DeepSeek-V3's
    # are 45 GB) against the same pipeline under torch.autograd (leaves x, topk_w and the weights;
    # the gate/up concatenation is inside the timed region, as in a training step that keeps
    # separate weights).
    wgu_t = None  # the forward case's concatenated gate/up weights (15 GB at DeepSeek-V3)
    torch.cuda.empty_cache()
    dy = (torch.randn(T, H, device=dev, generator=gen) * 0.1).bfloat16()
    leaves = {k: v.detach().requires_grad_() for k, v in w.items()}
    xl, twl = x.detach().requires_grad_(), tw.detach().requires_grad_()

    def mok_step():
        layer.forward(x, idx, tw, w, y, ctx, stream=stream)
        layer.backward(x, idx, tw, w, ctx, dy, grads, stream=stream)

    def base_step():
        for t in [xl, twl, *leaves.values()]:
            t.grad = None
        sh = (leaves["wsg"], leaves["wsu"], leaves["wsd"]) if Is else None
        wgu = torch.cat([leaves["wg"], leaves["wu"]], dim=1).transpose(1, 2)
        torch_pipeline(xl, idx, twl, wgu, leaves["wd"].transpose(1, 2), sh).backward(dy)

    for wgrad_fp32 in {"auto": (True, False), "fp32": (True,), "bf16": (False,)}[args.wgrad]:
        if not wgrad_fp32:  # a layer whose backward writes bf16 weight gradients
            layer.close()
            layer = mok.Layer(H, I, E, K, max_tokens=T, shared_intermediate=Is, device="cuda:0",
                              wgrad_fp32=False)
            if layer.context_bytes() > ctx.numel():
                ctx = torch.empty(layer.context_bytes(), device=dev, dtype=torch.uint8)
        grads = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(tw)}
        for k, v in w.items():
            grads["d" + k] = torch.empty(v.shape, device=dev,
                                         dtype=torch.float32 if wgrad_fp32 else torch.bfloat16)
        try:
            mok_step()
            layer.check()
            base_step()
            break
        except torch.cuda.OutOfMemoryError as e:
            grads = None
            for t in [xl, twl, *leaves.values()]:
                t.grad = None
            torch.cuda.empty_cache()
            what = "fp32" if wgrad_fp32 else "bf16"
            retry = wgrad_fp32 and args.wgrad == "auto"
            print(f"{model} fwd+bwd: out of device memory with {what} weight gradients "
                  f"({str(e).splitlines()[0]})" + ("; trying bf16 ones" if retry else "; skipped"))
            if not wgrad_fp32 or args.wgrad == "fp32":
                layer.close()
                return rows
    errs = {"dx": rel_err(grads["dx"], xl.grad), "dtopk_w": rel_err(grads["dtopk_w"], twl.grad),
            "dwd": rel_err(grads["dwd"], leaves["wd"].grad.float()),
            "dwg": rel_err(grads["dwg"], leaves["wg"].grad.float())}
    brow = dict(row, case=f"{model}/T{T}/fwd+bwd",
                mok_path="fused forward kernel + backward kernel chain (src/gpu/backward.c)",
                wgrad="fp32" if wgrad_fp32 else "bf16",
                rel_err_vs_baseline=max(errs.values()),
                rel_errs=errs, baseline=row["baseline"] + ", torch.autograd backward")
    for k in ("mok_ms", "baseline_ms", "ratio", "tflops", "baseline_tflops", "chain_ms",
              "chain_ratio", "fused_equals_chain", "ceiling_ms", "ceiling_ratio",
              "ceiling_tflops", *variants,
              *[k for k in brow if k.endswith("_mhz")]):
        brow.pop(k, None)
    if not max(errs.values()) < 2e-2:
        brow["wrong"] = True
        print(f"{model} fwd+bwd: WRONG, relative errors {errs}")
    else:
        # The fused backward kernel (backward_path = 1; the default, 0, is the chain, its
        # oracle) on the same layer: the same gradient bits, timed in the same rounds. --variant
        # NAME:backward_FIELD=VALUE,...: the fused step with those values too (back to 0 after).
        def tune(fields):
            for f, v in fields.items():
                mok._lib.check(layer._lib.mok_bench_layer_tune(layer._layer, f.encode(), v))

        def fused_step_of(fields):
            def step():
                try:
                    tune(dict(fields, backward_path=1))
                    mok_step()
                finally:
                    tune({f: 0 for f in dict(fields, backward_path=1)})
            return step
        mok_step()
        layer.check()
        chain_bits = grad_fingerprint(grads)
        bwd_fused = {"bwd_fused_ms": fused_step_of({})}
        for name, tuning in args.variant:
            if all(f.startswith("backward_") for f in tuning):
                bwd_fused[f"bwd_variant_{name}_ms"] = fused_step_of(tuning)
        same_bwd = True
        for key, step in list(bwd_fused.items()):
            step()
            layer.check()
            if grad_fingerprint(grads) != chain_bits:
                print(f"{model} fwd+bwd: {key[:-3]}'s gradients differ from the chain's")
                same_bwd = False
                del bwd_fused[key]
        # --lib-b: each other build's forward + backward step on a layer of its own (same
        # weight-gradient dtype, a context of its own, the same inputs and gradient buffers),
        # with its default backward (bwd_lib_b_ms, ...) and with its fused one if it is a
        # libmok_bench.so (bwd_lib_b_fused_ms, ...), in the same rounds. Another build may sum
        # in another order (a branch under test), so its gradients are checked against the
        # pipeline's by relative error, and its fused backward against its own default bitwise.
        layers_fb = []
        for i, lib_b in enumerate(args.lib_b):
            col = lib_b_name(i)[4:-3]  # lib_b, lib_b2, ...
            lb = with_lib(lambda: mok.Layer(H, I, E, K, max_tokens=T, shared_intermediate=Is,
                                             device="cuda:0", wgrad_fp32=wgrad_fp32), lib_b)()
            ctx_b = torch.empty(with_lib(lb.context_bytes, lib_b)(), device=dev,
                                dtype=torch.uint8)
            layers_fb.append((lb, lib_b, ctx_b))

            def step_b(lb=lb, lib_b=lib_b, ctx_b=ctx_b, fused=False):
                def run():
                    if fused:
                        mok._lib.check(lb._lib.mok_bench_layer_tune(lb._layer, b"backward_path", 1))
                    try:
                        lb.forward(x, idx, tw, w, y, ctx_b, stream=stream)
                        lb.backward(x, idx, tw, w, ctx_b, dy, grads, stream=stream)
                    finally:
                        if fused:
                            mok._lib.check(
                                lb._lib.mok_bench_layer_tune(lb._layer, b"backward_path", 0))
                return with_lib(run, lib_b)
            step = step_b()
            step()
            with_lib(lb.check, lib_b)()
            errs_b = {"dx": rel_err(grads["dx"], xl.grad),
                      "dtopk_w": rel_err(grads["dtopk_w"], twl.grad)}
            brow[f"{col}_rel_errs"] = errs_b
            if not max(errs_b.values()) < 2e-2:
                print(f"{model} fwd+bwd: --lib-b {i + 1} WRONG, relative errors {errs_b}")
                continue
            bwd_fused[f"bwd_{col}_ms"] = step
            if hasattr(lb._lib, "mok_bench_layer_tune"):
                bits_b = grad_fingerprint(grads)
                fused_b = step_b(fused=True)
                fused_b()
                with_lib(lb.check, lib_b)()
                brow[f"{col}_fused_equals_chain"] = grad_fingerprint(grads) == bits_b
                if brow[f"{col}_fused_equals_chain"]:
                    bwd_fused[f"bwd_{col}_fused_ms"] = fused_b
                else:
                    print(f"{model} fwd+bwd: --lib-b {i + 1}'s fused backward differs from its "
                          f"chain")
        times = time_ms([mok_step, base_step] + list(bwd_fused.values()), args.warmup, args.reps,
                        args.rounds)
        mok_ms, base_ms = times[:2]
        brow.update(zip(bwd_fused, times[2:]), fused_bwd_equals_chain=same_bwd)
        for lb, lib_b, _ in layers_fb:
            with_lib(lb.check, lib_b)()
            with_lib(lb.close, lib_b)()
        del layers_fb
        if "bwd_fused_ms" in brow:
            brow["bwd_fused_vs_chain"] = mok_ms / brow["bwd_fused_ms"]
        layer.check()
        brow.update(mok_ms=mok_ms, baseline_ms=base_ms, ratio=base_ms / mok_ms,
                    tflops=3 * flops / mok_ms * 1e-9, baseline_tflops=3 * flops / base_ms * 1e-9,
                    ceiling_ms=ceiling_fb_ms, ceiling_ratio=ceiling_fb_ms / mok_ms,
                    **clock_fields(["mok", "baseline", "bwd_fused"]))
        # memory: MoK's workspace and context (the library's own allocations) against the
        # pipeline's peak above what the step starts with (its saved activations and temporaries)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        base_step()
        torch.cuda.synchronize()
        brow.update(mok_mem_bytes=layer.workspace_bytes() + layer.context_bytes(),
                    baseline_mem_bytes=torch.cuda.max_memory_allocated(dev) - start)
        if args.profile:
            print_kernel_times(model, "fwd+bwd", mok_step)
            if "bwd_fused_ms" in bwd_fused:  # the same step with the fused backward kernel
                print_kernel_times(model, "fwd+bwd, fused backward", bwd_fused["bwd_fused_ms"])
    rows.append(brow)
    layer.close()
    return rows


def grad_fingerprint(grads):
    """Per gradient and per slice along dim 0, the int64 sum of its bit patterns (bf16 as int16,
    fp32 as int32): equal fingerprints for equal bits, without a copy of the gradients (DeepSeek-V3's
    fp32 weight gradients are 45 GB)."""
    out = {}
    for k, g in grads.items():
        v = g.view(torch.int16 if g.element_size() == 2 else torch.int32)
        v = v.reshape(v.shape[0] if v.dim() == 3 else 1, -1)  # an expert's slice at a time
        out[k] = torch.stack([v[i].sum(dtype=torch.int64) for i in range(v.shape[0])]).tolist()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", default=os.path.join(HERE, "results", "forward.jsonl"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--cases", default="",
                    help="run only models whose name contains this (or one of these, comma list)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20,
                    help="launches per function with --timing interleaved (blocked timing "
                         "sizes its blocks by --block-ms)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternate the timed functions this many times (reps / rounds each; "
                         "default 3, or --reps with --lib-b)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                    help="also time the fused forward of a layer with these tuning values "
                         "(mok_bench_layer_tune; FIELD: " + ", ".join(TUNING_FIELDS) +
                         "; same bits required; column variant_NAME_ms)")
    ap.add_argument("--lib-b", default=None, metavar="PATH[,PATH...]",
                    help="A/B: also time the fused forward of these other builds (a libmok.so or "
                         "libmok_bench.so, through the binding, with their defaults) in the same "
                         "rounds (each must give the same bits; columns lib_b, lib_b2, ...)")
    ap.add_argument("--wgrad", choices=("auto", "fp32", "bf16"), default="auto",
                    help="MoK's weight gradients in the forward + backward case: fp32, bf16 (the "
                         "pipeline's dtype), or auto: fp32, bf16 where fp32 ones do not fit")
    ap.add_argument("--profile", action="store_true",
                    help="print the device time of each kernel of the fused forward, the chain, "
                         "the pipeline, each --variant and --lib-b, and MoK's forward + backward")
    add_timing_args(ap)
    args = ap.parse_args()
    set_timing(args.timing, args.block_ms)
    args.rounds = default_rounds(args)
    declare_tuning()
    args.lib_b = load_libs(args.lib_b, load_lib_b)
    gen = torch.Generator(device="cuda").manual_seed(2026)
    rows = []
    print(f"{'case':28s} {'mok ms':>8s} {'TF/s':>6s} {'torch ms':>9s} {'TF/s':>6s} {'ratio':>6s} "
          f"{'rel err':>8s} {'chain ms':>9s} {'ceiling':>8s}")
    for model in MODELS:
        if not case_selected(model, args.cases):
            continue
        for r in run_case(model, args, gen):
            rows.append(r)
            os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
            with open(args.jsonl, "a") as f:  # row by row: a later failure keeps what was measured
                f.write(json.dumps(r) + "\n")
            if "mok_ms" in r:
                print(f"{r['case']:28s} {r['mok_ms']:8.3f} {r['tflops']:6.0f} {r['baseline_ms']:9.3f} "
                      f"{r['baseline_tflops']:6.0f} {r['ratio']:6.2f} {r['rel_err_vs_baseline']:8.2g} "
                      f"{r.get('chain_ms', float('nan')):9.3f} "
                      f"{r.get('ceiling_ratio', float('nan')):8.3f}" +
                      "".join(f" | {k[8:-3]} {v:.3f}" for k, v in r.items()
                              if k.startswith("variant_") and k.endswith("_ms")) +
                      "".join(f" | {k[:-3]} {v:.3f}" for k, v in r.items()
                              if k.startswith("bwd_") and k.endswith("_ms")) +
                      "".join(f" | {k[4:-3]} {v:.3f}" for k, v in r.items()
                              if k.startswith("mok_lib_b")))
        torch.cuda.empty_cache()
    return 1 if any(r.get("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
