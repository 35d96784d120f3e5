"""
bench/fp8.py: MoK's fp8-block layer against MoK's BF16 layer (W = 1), in the same process on the
same inputs: the forward, and forward + backward, at Qwen3-30B-A3B, Qwen3-235B-A22B and
DeepSeek-V3 (with its shared expert), T = 16384 tokens, top-8 routing drawn uniformly at random.

With --precision mxfp8 the fp8 layer is an MXFP8 one (1x32 blocks, E8M0 scales): it
quantize-dequantizes its activations to bf16 and runs bf16 grouped GEMMs whose e4m3 weights are
dequantized in shared memory (src/gpu/forward.c's gpu_forward_mx, the MXFP8 steps of
src/gpu/backward.c).

The fp8-block layer (fp32 scales; --scale pow2 for power-of-two ones) reads its weights quantized
once by mok_quantize_weights (not timed: once per optimizer step), quantizes its activations per
row in 1x128 blocks and runs e4m3 grouped GEMMs (src/gpu/forward.c's gpu_forward_fp8, the fp8
steps of src/gpu/backward.c); the BF16 layer runs its defaults (the fused forward kernel and the
backward chain). Both write bf16 weight gradients (the PyTorch pipeline's dtype; DeepSeek-V3's
fp32 ones do not fit twice beside its weights). Each case first checks the fp8 layer against the
BF16 one (relative L2 error of y, dx and the weight gradients, which must be of e4m3's size:
above 0.1 the case is reported as wrong and not timed), then times both (bench/harness.py's
time_ms: blocked by default). speedup = bf16_ms / fp8_ms. Appends one JSON object per case to
--jsonl (default bench/results/fp8.jsonl).

    python3 bench/fp8.py [--commit SHA] [--cases substring] [--precision fp8-block|mxfp8]
                         [--scale fp32|pow2]
                         [--timing blocked|interleaved] [--profile]
"""
import argparse
import json
import os
import sys

import torch  # before the binding's library (src/gpu/nccl_loader.h)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("MOK_LIBRARY", os.path.join(ROOT, "build", "libmok.so"))
from harness import (TIMING, add_timing_args, case_selected, clock_fields,  # noqa: E402
                     git_commit, rel_err, set_timing, time_ms)
from forward import MODELS, T, print_kernel_times  # noqa: E402
import mok  # noqa: E402


def run_case(model, args, gen):
    H, I, E, K, Is = MODELS[model]
    dev = torch.device("cuda", 0)
    x = (torch.randn(T, H, device=dev, generator=gen) * 0.5).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(T, K, device=dev, generator=gen), dim=1)
    w = {"wg": (torch.randn(E, I, H, device=dev, generator=gen) * H ** -0.5).bfloat16(),
         "wu": (torch.randn(E, I, H, device=dev, generator=gen) * H ** -0.5).bfloat16(),
         "wd": (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).bfloat16()}
    if Is:
        w["wsg"] = (torch.randn(Is, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w["wsu"] = (torch.randn(Is, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w["wsd"] = (torch.randn(H, Is, device=dev, generator=gen) * Is ** -0.5).bfloat16()
    shape = dict(hidden=H, intermediate=I, num_experts=E, top_k=K, max_tokens=T,
                 shared_intermediate=Is, device="cuda:0", wgrad_fp32=False)
    bf = mok.Layer(**shape)
    f8 = mok.Layer(**shape, precision=args.precision, fp8_scale=args.scale)
    q = torch.empty(f8.quantized_weights_bytes(), device=dev, dtype=torch.uint8)
    f8.quantize_weights(w, q)
    stream = torch.cuda.current_stream(dev).cuda_stream
    y_b, y_f = torch.empty_like(x), torch.empty_like(x)
    ctx_b = torch.empty(bf.context_bytes(), device=dev, dtype=torch.uint8)
    ctx_f = torch.empty(f8.context_bytes(), device=dev, dtype=torch.uint8)

    def fwd_b():
        bf.forward(x, idx, tw, w, y_b, ctx_b, stream=stream)

    def fwd_f():
        f8.forward(x, idx, tw, None, y_f, ctx_f, quantized=q, stream=stream)

    fwd_b()
    fwd_f()
    bf.check()
    f8.check()
    err = rel_err(y_f, y_b)
    flops = 6.0 * T * K * H * I + 6.0 * T * H * Is
    row = {"bench": "fp8", "case": f"{model}/T{T}", "device": torch.cuda.get_device_name(dev),
           "precision": args.precision, "commit": git_commit(args.commit),
           "torch": torch.__version__, "rel_err_vs_bf16": err,
           "mok_path": ("fp8: quantize x + fp8 gather + e4m3 grouped GEMMs, a quantized in the SwiGLU "
                        "epilogue (kernel chain); "
                        if args.precision == "fp8-block" else
                        "mxfp8: quantize-dequantize x, gather, bf16 grouped GEMMs on e4m3 weights "
                        "dequantized in shared memory (kernel chain); ") +
                       "bf16: layout + fused persistent kernel"}
    if args.precision == "fp8-block":
        row["fp8_scale"] = args.scale
    rows = [row]
    if not err < 0.1:
        row["wrong"] = True
        print(f"{model}: WRONG, fp8 y against bf16 y: relative error {err:.3g}")
    else:
        bf_ms, f8_ms = time_ms([fwd_b, fwd_f], args.warmup, args.reps, args.rounds)
        bf.check()
        f8.check()
        row.update(bf16_ms=bf_ms, fp8_ms=f8_ms, speedup=bf_ms / f8_ms,
                   bf16_tflops=flops / bf_ms * 1e-9, fp8_tflops=flops / f8_ms * 1e-9,
                   timing=TIMING["mode"], **clock_fields(["bf16", "fp8"]))
        if args.profile:
            print_kernel_times(model, "fp8 forward", fwd_f)

    # forward + backward: one set of gradient buffers, written by each layer in turn
    dy = (torch.randn(T, H, device=dev, generator=gen) * 0.1).bfloat16()
    grads = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(tw)}
    for k, v in w.items():
        grads["d" + k] = torch.empty_like(v)

    def step_b():
        fwd_b()
        bf.backward(x, idx, tw, w, ctx_b, dy, grads, stream=stream)

    def step_f():
        fwd_f()
        f8.backward(x, idx, tw, None, ctx_f, dy, grads, quantized=q, stream=stream)

    # compared: dx, and the weight gradients of the first 8 experts (all of them would not fit
    # twice beside DeepSeek-V3's weights)
    def part(k):
        return grads[k] if k == "dx" else grads[k][:8]
    step_b()
    bf.check()
    ref = {k: part(k).clone() for k in ("dx", "dwd", "dwg")}
    step_f()
    f8.check()
    errs = {k: rel_err(part(k), ref[k]) for k in ref}
    ref = None
    brow = dict(row, case=f"{model}/T{T}/fwd+bwd", rel_err_vs_bf16=max(errs.values()),
                rel_errs=errs, wgrad="bf16")
    for k in ("bf16_ms", "fp8_ms", "speedup", "bf16_tflops", "fp8_tflops", "wrong",
              *[k for k in brow if k.endswith("_mhz")]):
        brow.pop(k, None)
    if not max(errs.values()) < 0.1:
        brow["wrong"] = True
        print(f"{model} fwd+bwd: WRONG, fp8 against bf16: relative errors {errs}")
    else:
        bf_ms, f8_ms = time_ms([step_b, step_f], args.warmup, args.reps, args.rounds)
        bf.check()
        f8.check()
        brow.update(bf16_ms=bf_ms, fp8_ms=f8_ms, speedup=bf_ms / f8_ms,
                    bf16_tflops=3 * flops / bf_ms * 1e-9, fp8_tflops=3 * flops / f8_ms * 1e-9,
                    timing=TIMING["mode"], **clock_fields(["bf16", "fp8"]),
                    bf16_mem_bytes=bf.workspace_bytes() + bf.context_bytes(),
                    fp8_mem_bytes=f8.workspace_bytes() + f8.context_bytes())
        if args.profile:
            print_kernel_times(model, "fp8 fwd+bwd", step_f)
    rows.append(brow)
    bf.close()
    f8.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", default=os.path.join(HERE, "results", "fp8.jsonl"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--cases", default="", help="models whose name contains this (comma list)")
    ap.add_argument("--precision", choices=("fp8-block", "mxfp8"), default="fp8-block",
                    help="the fp8 layer's precision")
    ap.add_argument("--scale", choices=("fp32", "pow2"), default="fp32",
                    help="the fp8-block layer's scale rounding (mok_fp8_scale_t)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="print the device time of each kernel of the fp8 layer's calls")
    add_timing_args(ap)
    args = ap.parse_args()
    set_timing(args.timing, args.block_ms)
    gen = torch.Generator(device="cuda").manual_seed(2026)
    print(f"{'case':34s} {'bf16 ms':>8s} {'TF/s':>6s} {'fp8 ms':>8s} {'TF/s':>6s} "
          f"{'speedup':>7s} {'rel err':>8s}")
    rows = []
    for model in MODELS:
        if not case_selected(model, args.cases):
            continue
        for r in run_case(model, args, gen):
            rows.append(r)
            os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
            if "fp8_ms" in r:
                print(f"{r['case']:34s} {r['bf16_ms']:8.3f} {r['bf16_tflops']:6.0f} "
                      f"{r['fp8_ms']:8.3f} {r['fp8_tflops']:6.0f} {r['speedup']:7.2f} "
                      f"{r['rel_err_vs_bf16']:8.3g}")
        torch.cuda.empty_cache()
    return 1 if any(r.get("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
