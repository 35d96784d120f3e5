"""
bench/forward.py: MoK's GPU forward of a whole MoE layer (W = 1, BF16) against the plain PyTorch
pipeline, in the same process on the same inputs.

The PyTorch pipeline (written here, the usual way): sort the routed (token, slot) pairs by expert,
gather the token rows, torch._grouped_mm with the concatenated gate and up weights, SwiGLU with
the router weight in fp32, torch._grouped_mm with the down weights, index_add_ into an fp32
output, plus the shared expert as dense matmuls; y in bf16. MoK runs what mok_forward and mok_backward
run by default: the forward is the layout kernel plus one fused persistent kernel
(src/cuda/forward/fused.cu), the backward the kernel chain of src/gpu/backward.c. The forward's
unfused kernel chain (MOK_FORWARD=chain) is timed in the same run (chain_ms), and so is the fused
kernel reading rows gathered by a kernel first (fused_pregathered_ms); y must be the same bits
every way (fused_equals_chain). Each model also gets a forward + backward case against the
pipeline under torch.autograd (FLOPs 3x the forward's), with fp32 weight gradients, or bf16 ones
(the pipeline's dtype; the row's "wgrad") where fp32 ones do not fit beside the pipeline, or as
--wgrad says.

Shapes: Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 (with its shared expert), T = 16384 tokens,
top-8 routing drawn uniformly at random. Each case first checks MoK's y against the pipeline's
(relative L2 error; above 1e-2 the case is reported as wrong and not timed), then times both with
CUDA events after warm-up (median; --timing blocked by default: each function runs back to back in
blocks of launches, about --block-ms for the first, and the second half of each block is timed, so
that each runs at the clock its own power draw allows; see gemm.py's time_ms).
FLOPs: 6 T K H I + 6 T H Is. Appends one JSON object per case to --jsonl (default
bench/results/forward.jsonl).

    python3 bench/forward.py [--commit SHA] [--cases substring] [--timing blocked|interleaved]
                             [--variant NAME:VAR=VALUE ...] [--profile] [--wgrad auto]

--profile also prints the device time of every kernel of the fused forward and of the chain
(torch.profiler, mean of a few launches), and the fused kernel's task trace (MOK_FUSED_TRACE):
how much of the CTAs' time went to each task kind's mainloops and epilogues, to waiting, and to
the tail.

--variant times the fused forward again under other environment knobs (variant_NAME_ms), after
checking that its y is the chain's bits too.

--lib-b PATH[,PATH...] times the fused forward of other libmok.so builds in the same rounds
(mok_lib_b_ms, mok_lib_b2_ms, ...), after checking that each gives the chain's bits: an A/B of
two builds on the same machine in the same thermal state. Separate processes on the same machine
measured the same build 1-2% apart; with --timing interleaved, one launch of each function per
round (--rounds = --reps, the default with --lib-b) is the protocol that gave the same answer in
both positions (docs/performance.md, "A/B of two builds").
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from gemm import (TIMING, add_timing_args, case_selected, clock_fields,  # noqa: E402
                  default_rounds, git_commit, lib_b_name, load_libs, rel_err, set_timing, time_ms,
                  with_env)
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


def load_lib_b(path):
    """Another libmok.so (an A/B build), loaded and declared as the binding loads its own."""
    return with_env(mok._lib.load, {"MOK_LIBRARY": path})()


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


TRACE_PER_CTA, TRACE_FIELDS = 2048, 8  # src/cuda/forward/fused.cu: FK_TRACE_*
TASK_KINDS = ("SHARED_GATE_UP", "GATE_UP", "DOWN", "SHARED_DOWN", "REDUCE")  # src/common/task_plan.h


def print_fused_trace(model, fn):
    """Runs fn (a fused forward) once with the kernel's task trace on and prints where each CTA's
    time went: per task kind its mainloops and epilogues, the idle time before its tasks (the
    consumers waiting for the first stage), and the idle tail; and, for the idle time, when the
    producer could start loading the task (its dependency met) and when its first stage was
    issued, against the end of the consumers' previous task; and for tiles stored through the
    staging buffer, how their epilogue splits into the first store round (GATE_UP: a), the other
    rounds (g and u; DOWN's second half) and the release."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(sms * TRACE_PER_CTA * TRACE_FIELDS, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with_env(fn, {"MOK_FUSED_TRACE": hex(buf.data_ptr())})()
    end.record()
    torch.cuda.synchronize()
    rec = buf.view(sms, TRACE_PER_CTA, TRACE_FIELDS).cpu().tolist()
    ctas = [[r for r in cta if r[1] > 0] for cta in rec]
    ctas = [c for c in ctas if c]
    t0 = min(c[0][1] for c in ctas)
    t1 = max(c[-1][3] for c in ctas)
    span = (t1 - t0) / 1e3
    # per kind: tasks, mainloop, epilogue, idle before; producer: dependency met, first stage
    # issued, first stage ready (each after the previous task's end; tile tasks only)
    stats = {k: [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for k in TASK_KINDS}
    rounds = {k: [0, 0.0, 0.0, 0.0] for k in TASK_KINDS}  # staged tiles: first / others / release
    tail = 0.0
    for c in ctas:
        prev_end = t0
        for r in c:
            st = stats[TASK_KINDS[r[0] >> 56]]
            st[0] += 1
            st[1] += (r[2] - r[1]) / 1e3
            st[2] += (r[3] - r[2]) / 1e3
            st[3] += (r[1] - prev_end) / 1e3
            if r[4] > 0 and r[5] > 0:
                st[4] += (r[4] - prev_end) / 1e3
                st[5] += (r[5] - prev_end) / 1e3
                st[6] += (r[1] - prev_end) / 1e3
            if r[6] > 0 and r[7] > 0:
                rd = rounds[TASK_KINDS[r[0] >> 56]]
                rd[0] += 1
                rd[1] += (r[6] - r[2]) / 1e3
                rd[2] += (r[7] - r[6]) / 1e3
                rd[3] += (r[3] - r[7]) / 1e3
            prev_end = r[3]
        tail += (t1 - prev_end) / 1e3
    total = span * len(ctas)
    print(f"{model} fused trace: {len(ctas)} CTAs, {span / 1e3:.3f} ms from the first task to the "
          f"last of a {start.elapsed_time(end):.3f} ms forward; per kind: tasks, mean mainloop + "
          f"epilogue us, share of CTA time (mainloop / epilogue / idle before); after the "
          f"previous task's end, mean us to: dependency met / first stage issued / ready")
    for k, (n, ml, ep, idle, dep, iss, rdy) in stats.items():
        if n:
            print(f"    {k:15s} {n:6d}  {ml / n:8.1f} + {ep / n:6.1f} us   {100 * ml / total:5.1f}% "
                  f"/ {100 * ep / total:4.1f}% / {100 * idle / total:4.1f}%   "
                  f"{dep / n:6.1f} / {iss / n:6.1f} / {rdy / n:6.1f}")
    for k, (n, first, rest, rel) in rounds.items():
        if n:
            print(f"    {k:15s} {n:6d} staged epilogues, mean us: first store round {first / n:.2f}"
                  f", other rounds {rest / n:.2f}, release {rel / n:.2f}")
    print(f"    idle after the CTA's last task: {100 * tail / total:.1f}%")


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

    layer = mok.Layer(H, I, E, K, max_tokens=T, shared_intermediate=Is, device="cuda:0")
    y = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    ctx = torch.empty(layer.context_bytes(), device=dev, dtype=torch.uint8)
    stream = torch.cuda.current_stream(dev).cuda_stream

    def mok_fwd():
        layer.forward(x, idx, tw, w, y, ctx, stream=stream)

    chain_fwd = with_env(mok_fwd, {"MOK_FORWARD": "chain"})
    xg_fwd = with_env(mok_fwd, {"MOK_FUSED_GATHER": "kernel"})

    def base():
        return torch_pipeline(x, idx, tw, wgu_t, wd_t, shared)

    chain_fwd()
    layer.check()
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
        return [row]
    # --variant NAME:VAR=VALUE[,VAR=VALUE]: the fused kernel under other knobs, same bits required
    variants = {}
    for spec in args.variant:
        name, _, envs = spec.partition(":")
        fn = with_env(mok_fwd, dict(kv.split("=", 1) for kv in envs.split(",") if kv))
        if not same_bits(fn, layer.check, y, y_chain):
            print(f"{model}: variant {name} ({envs}) gives other bits than the chain")
            row["variant_differs"] = name
        variants[f"variant_{name}_ms"] = fn
    # --lib-b: the fused forward through another build, its own layer (same inputs and outputs)
    layers_b = []
    for i, lib_b in enumerate(args.lib_b):
        # (a Layer keeps the library it was created with)
        layer_b = with_lib(lambda: mok.Layer(H, I, E, K, max_tokens=T, shared_intermediate=Is,
                                             device="cuda:0"), lib_b)()
        layers_b.append((layer_b, lib_b))
        fn = with_lib(lambda lb=layer_b: lb.forward(x, idx, tw, w, y, ctx, stream=stream), lib_b)
        if not same_bits(fn, with_lib(layer_b.check, lib_b), y, y_chain):
            print(f"{model}: --lib-b {i + 1} gives other bits than the chain")
            row["variant_differs"] = lib_b_name(i)
        variants[lib_b_name(i)] = fn
    times = time_ms([mok_fwd, chain_fwd, xg_fwd, base] + list(variants.values()), args.warmup,
                    args.reps, args.rounds)
    mok_ms, chain_ms, xg_ms, base_ms = times[:4]
    row.update(zip(variants, times[4:]))
    layer.check()
    for layer_b, lib_b in layers_b:
        with_lib(layer_b.check, lib_b)()
    if args.profile:
        for label, fn in (("fused", mok_fwd), ("chain", chain_fwd), ("pipeline", base)):
            print_kernel_times(model, label, fn)
        print_fused_trace(model, mok_fwd)
        for name, fn in variants.items():  # variant_NAME_ms, mok_lib_b_ms, ...
            label = name[8:-3] if name.startswith("variant_") else name[4:-3]
            print_fused_trace(f"{model} [{label}]", fn)
    for layer_b, lib_b in layers_b:  # before the forward + backward, which needs the memory
        with_lib(layer_b.close, lib_b)()
    flops = 6.0 * T * K * H * I + 6.0 * T * H * Is
    row.update(mok_ms=mok_ms, baseline_ms=base_ms, ratio=base_ms / mok_ms,
               tflops=flops / mok_ms * 1e-9, baseline_tflops=flops / base_ms * 1e-9,
               chain_ms=chain_ms, chain_ratio=base_ms / chain_ms, fused_pregathered_ms=xg_ms,
               timing=TIMING["mode"], **clock_fields(["mok", "chain", "pregathered", "baseline"]))
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
              "chain_ratio", "fused_equals_chain", "fused_pregathered_ms", *variants,
              *[k for k in brow if k.endswith("_mhz")]):
        brow.pop(k, None)
    if not max(errs.values()) < 2e-2:
        brow["wrong"] = True
        print(f"{model} fwd+bwd: WRONG, relative errors {errs}")
    else:
        mok_ms, base_ms = time_ms([mok_step, base_step], args.warmup, args.reps, args.rounds)
        layer.check()
        brow.update(mok_ms=mok_ms, baseline_ms=base_ms, ratio=base_ms / mok_ms,
                    tflops=3 * flops / mok_ms * 1e-9, baseline_tflops=3 * flops / base_ms * 1e-9,
                    **clock_fields(["mok", "baseline"]))
    rows.append(brow)
    layer.close()
    return rows


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
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="also time the fused forward with these environment knobs (same bits)")
    ap.add_argument("--lib-b", default=None, metavar="PATH[,PATH...]",
                    help="A/B: also time the fused forward of these other libmok.so builds in the "
                         "same rounds (each must give the same bits; columns lib_b, lib_b2, ...)")
    ap.add_argument("--wgrad", choices=("auto", "fp32", "bf16"), default="auto",
                    help="MoK's weight gradients in the forward + backward case: fp32, bf16 (the "
                         "pipeline's dtype), or auto: fp32, bf16 where fp32 ones do not fit")
    ap.add_argument("--profile", action="store_true",
                    help="print the device time of each kernel of the fused forward and the chain, "
                         "and the fused kernel's task trace")
    add_timing_args(ap)
    args = ap.parse_args()
    set_timing(args.timing, args.block_ms)
    args.rounds = default_rounds(args)
    args.lib_b = load_libs(args.lib_b, load_lib_b)
    gen = torch.Generator(device="cuda").manual_seed(2026)
    rows = []
    print(f"{'case':28s} {'mok ms':>8s} {'TF/s':>6s} {'torch ms':>9s} {'TF/s':>6s} {'ratio':>6s} "
          f"{'rel err':>8s} {'chain ms':>9s} {'pregath ms':>10s}")
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
                      f"{r.get('fused_pregathered_ms', float('nan')):10.3f}" +
                      "".join(f" | {k[8:-3]} {v:.3f}" for k, v in r.items()
                              if k.startswith("variant_") and k.endswith("_ms")) +
                      "".join(f" | {k[4:-3]} {v:.3f}" for k, v in r.items()
                              if k.startswith("mok_lib_b")))
        torch.cuda.empty_cache()
    return 1 if any(r.get("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
