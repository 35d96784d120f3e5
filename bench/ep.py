"""
bench/ep.py: the MoE layer with expert parallelism (EP): W = 1, 2, 4 ranks over the same tokens,
checked for EP-invariance and timed, forward and forward + backward (BF16 unless --precision
fp8-block or mxfp8, fp32 weight gradients unless --wgrad bf16).

One GPU (python3 bench/ep.py): W virtual ranks (mok.Comm.virtual) share the GPU, each rank's calls
on its own stream, all enqueued from this thread. The W ranks share the SMs, so W > 1 cannot be
faster than W = 1: the ratio to W = 1 measures the overhead of expert parallelism (the transport's
layout, dispatch and combine and the reduce as kernels of their own beside each rank's fused
kernel, src/gpu/forward_ep.c, more and smaller launches; fp8 layers run kernel chains; w1_chain_ms
is W = 1's own chain, timed in the same run, for comparison), not scaling. Several GPUs
(NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=W bench/ep.py): W real ranks, one per GPU, over Comm.from_process_group; each
rank also runs the W = 1 layer on all tokens on its own GPU, as the reference and the ratio's
denominator.

Shapes: bench/forward.py's Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 (shared expert), top-8
routing drawn uniformly at random, --tokens in all (default 16384; rank r holds tokens [r T/W,
(r + 1) T/W) and experts [r E/W, (r + 1) E/W)). Each W is first checked against W = 1 over the
same tokens: y bitwise (forward); dx and dtopk_w bitwise and each routed expert's weight gradients
by a 64-bit digest of their bits (forward + backward; a copy of DeepSeek-V3's would not fit; the
shared expert's gradients are per rank by design and not compared). A W that differs is reported
as wrong and not timed. Then forward, and forward + backward, are timed with CUDA events
(median; harness.py's time_ms, blocked by default); for W virtual ranks one call is every rank's
call enqueued on its stream, timed from an event on the current stream before the first (which
every rank's stream waits for) to after the current stream has waited for every rank's stream.
Under torchrun the timing is interleaved with a fixed number of launches (--reps), since blocked
timing sizes its blocks by each rank's own clock and every rank must make the same calls; the time
is the slowest rank's. FLOPs over all tokens, as forward.py counts them: 6 T K H I + 6 T H Is (3x
for forward + backward). Printed and in the rows: ms, TF/s, vs_w1 = W = 1's ms / this ms (1: as
fast as W = 1; below 1: slower) and, for the forward, vs_w1_chain = W = 1's chain ms / this ms;
with virtual ranks (BF16) also the forward with the dispatch inside each rank's fused kernel,
each rank's kernel on (SMs - W) / W CTAs as that needs (dispatch_in_kernel_ms, its vs_w1, its
bits checked against W = 1's).
Appends one JSON object per (model, W, forward or forward + backward) to --jsonl (default
bench/results/ep.jsonl), with the commit; a W that was skipped gets one row with the reason.

    python3 bench/ep.py [--tokens 16384] [--cases substring] [--ranks 1,2,4] [--wgrad fp32|bf16]
                        [--precision bf16|fp8-block|mxfp8] [--capacity-factor 0]
                        [--timing blocked|interleaved] [--commit SHA] [--profile]

Memory: every rank's layer has its own workspace and context, sized for T/W tokens and, with
--capacity-factor 0 (the library's default, never overflows), W T/W K = T K received rows, so
W virtual ranks hold about W times the W = 1 layer's (DeepSeek-V3 at T = 16384: about 12 GB per
rank) beside the weights (22.5 GB bf16) and the routed weight gradients (45 GB fp32), all on one
GPU. A W that does not fit is skipped with the reason printed (its row says so); --wgrad bf16 or
a --capacity-factor near 1 (uniform routing needs about 1.1) make room.
"""
import argparse
import json
import os
import sys

# torch before the binding's library (src/gpu/nccl_loader.h: the first libnccl.so.2 wins)
import torch

if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: this rank's GPU before any CUDA call
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# forward.py sets MOK_LIBRARY to build/libmok_bench.so (the W = 1 chain is a tuned layer)
from forward import (FORWARD_CHAIN, MODELS, declare_tuning, print_kernel_times,  # noqa: E402
                     tuned_layer)
from harness import (TIMING, add_timing_args, case_selected, clock_fields,  # noqa: E402
                     default_rounds, git_commit, set_timing, time_ms)
import mok  # noqa: E402

ROUTED = ("wg", "wu", "wd")


class Problem:
    """One model's inputs over all T tokens and its E experts' weights (bf16), on `dev`; the same
    on every process for the same seed."""

    def __init__(self, model, T, dev, seed):
        self.model, self.T, self.dev = model, T, dev
        self.H, self.I, self.E, self.K, self.Is = H, I, E, K, Is = MODELS[model]
        gen = torch.Generator(device=dev).manual_seed(seed)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev, generator=gen)  # noqa: E731
                                     * scale).bfloat16()
        self.x = rnd(T, H, scale=0.5)                                                # [T, H]
        self.idx = (torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices
                    .to(torch.int32))                                                # [T, K]
        self.tw = torch.softmax(torch.randn(T, K, device=dev, generator=gen), dim=1)  # [T, K]
        self.dy = rnd(T, H, scale=0.1)                                               # [T, H]
        self.w = {"wg": rnd(E, I, H, scale=H ** -0.5), "wu": rnd(E, I, H, scale=H ** -0.5),
                  "wd": rnd(E, H, I, scale=I ** -0.5)}
        if Is:
            self.w.update(wsg=rnd(Is, H, scale=H ** -0.5), wsu=rnd(Is, H, scale=H ** -0.5),
                          wsd=rnd(H, Is, scale=Is ** -0.5))
        self.flops = 6.0 * T * K * H * I + 6.0 * T * H * Is


class Outputs:
    """y, dx [T, H], dtopk_w [T, K] and the routed weight gradients [E, ...] of all tokens and
    experts; every W writes into them (rank r its tokens' rows and its experts)."""

    def __init__(self, p, wgrad_fp32):
        self.y, self.dx = torch.empty_like(p.x), torch.empty_like(p.x)
        self.dtw = torch.empty_like(p.tw)
        dt = torch.float32 if wgrad_fp32 else torch.bfloat16
        self.dw = {"d" + k: torch.empty(p.w[k].shape, device=p.dev, dtype=dt) for k in ROUTED}
        self.shared_dtype = dt

    def poison(self):
        for t in (self.y, self.dx, self.dtw, *self.dw.values()):
            t.fill_(float("nan"))


def wgrad_digest(dw, experts):
    """[3, len(experts)] int64: for each routed weight gradient and expert, the sum over its
    elements of bits_i * (i mod 65521 + 1) (wrapping). Equal bits give equal digests; a
    differing element changes it (by a nonzero multiple below 2^48) unless differences cancel."""
    out = []
    for k in ("dwg", "dwu", "dwd"):
        t = dw[k]
        n = t[0].numel()
        mult = torch.arange(n, device=t.device, dtype=torch.int64) % 65521 + 1
        bits = torch.int32 if t.element_size() == 4 else torch.int16
        out.append(torch.stack([(t[e].reshape(-1).view(bits).to(torch.int64) * mult).sum()
                                for e in experts]))
    return torch.stack(out)


class Team:
    """The ranks this process drives, ranks[i] of W on comms[i] (comms None: one W = 1 layer of
    its own, the fused forward). Rank r holds tokens [r T_r, (r + 1) T_r), T_r = T / W, and
    experts [r EL, (r + 1) EL); its y, dx, dtopk_w and routed weight gradients are views of
    `out`, its shared-expert gradients its own. Several ranks (virtual ones) each get a stream."""

    def __init__(self, p, out, W, ranks, comms, args, tuning=None):
        self.W, self.ranks, self.layers, self.calls = W, ranks, [], []
        Tr, EL = p.T // W, p.E // W
        kw = dict(hidden=p.H, intermediate=p.I, num_experts=p.E, top_k=p.K, max_tokens=Tr,
                  shared_intermediate=p.Is, wgrad_fp32=out.shared_dtype == torch.float32,
                  capacity_factor=args.capacity_factor, precision=args.precision)
        self.streams = [torch.cuda.Stream(p.dev) for _ in ranks] if len(ranks) > 1 else None
        try:
            for i, r in enumerate(ranks):
                if comms is None:
                    layer = tuned_layer(tuning, device=p.dev, **kw) if tuning else \
                        mok.Layer(device=p.dev, **kw)
                else:
                    layer = mok.Layer(comm=comms[i], **kw)
                self.layers.append(layer)
                tok, exp = slice(r * Tr, (r + 1) * Tr), slice(r * EL, (r + 1) * EL)
                w = {k: (v[exp] if k in ROUTED else v) for k, v in p.w.items()}
                g = {"dx": out.dx[tok], "dtopk_w": out.dtw[tok]}
                g.update({k: v[exp] for k, v in out.dw.items()})
                for k in ("wsg", "wsu", "wsd") if p.Is else ():
                    g["d" + k] = torch.empty(p.w[k].shape, device=p.dev, dtype=out.shared_dtype)
                ctx = torch.empty(layer.context_bytes(), device=p.dev, dtype=torch.uint8)
                q = None  # fp8 layers: this rank's experts quantized by its layer
                if args.precision != "bf16":
                    q = torch.empty(layer.quantized_weights_bytes(), device=p.dev,
                                    dtype=torch.uint8)
                    layer.quantize_weights(w, q)
                fwd = (p.x[tok], p.idx[tok], p.tw[tok], w)
                self.calls.append((layer, fwd, out.y[tok], ctx, p.dy[tok], g, q))
        except BaseException:
            self.close()
            raise
        self.workspace_bytes = self.layers[0].workspace_bytes()
        self.context_bytes = self.layers[0].context_bytes()

    def _each(self, fn):
        """fn(call, stream) for every rank: on the current stream for one rank; for several,
        each on its stream, forked from and joined into the current one."""
        if self.streams is None:
            fn(self.calls[0], torch.cuda.current_stream().cuda_stream)
            return
        cur = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(cur)
        for c, s in zip(self.calls, self.streams):
            fn(c, s.cuda_stream)
        for s in self.streams:
            cur.wait_stream(s)

    def forward(self):
        self._each(lambda c, s: c[0].forward(*c[1], c[2], c[3], quantized=c[6], stream=s))

    def step(self):
        """forward, then backward, of every rank."""
        self.forward()
        self._each(lambda c, s: c[0].backward(*c[1], c[3], c[4], c[5], quantized=c[6], stream=s))

    def check(self):
        for layer in self.layers:
            layer.check()

    def tune(self, tuning):
        """Sets `tuning` ({field: value}, mok_bench_layer_tune) on every rank's layer."""
        for layer in self.layers:
            for field, value in tuning.items():
                mok._lib.check(layer._lib.mok_bench_layer_tune(layer._layer, field.encode(),
                                                                value))

    def close(self):
        for layer in self.layers:
            layer.close()
        self.layers = []


class Dist:
    """torchrun: this process is rank `rank` of `world` GPUs; else one process, rank 0 of 1."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank, self.local = 0, 0
        if self.world > 1:
            import torch.distributed as dist
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # MoK never uses NVLink multicast
            self.rank, self.local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(self.local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", self.local))
            self.dist = dist

    def all(self, value, op="min"):
        """value (a number or bool) reduced over the ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([float(value)], device="cuda")
        self.dist.all_reduce(t, op=getattr(self.dist.ReduceOp, op.upper()))
        return type(value)(t.item())

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)


def bits_equal(a, b):
    kind = torch.int32 if a.element_size() == 4 else torch.int16
    return a.shape == b.shape and bool(torch.equal(a.view(kind), b.view(kind)))


def common_row(p, W, team, args, d, virtual):
    fp8 = "" if args.precision == "bf16" else "/" + args.precision  # its own cases
    return {"bench": "ep", "case": f"{p.model}/T{p.T}/W{W}{fp8}", "model": p.model, "ranks": W,
            "virtual": virtual and W > 1, "gpus": 1 if virtual or W == 1 else d.world,
            "tokens": p.T,
            "tokens_per_rank": p.T // W, "device": torch.cuda.get_device_name(p.dev),
            "commit": git_commit(args.commit), "torch": torch.__version__,
            "precision": args.precision,
            "wgrad": "fp32" if team.calls[0][5]["dwg"].dtype == torch.float32 else "bf16",
            "capacity_factor": args.capacity_factor, "timing": TIMING["mode"],
            "workspace_bytes_per_rank": team.workspace_bytes,
            "context_bytes_per_rank": team.context_bytes}


def run_w(p, out, W, ref, args, d, comms=None):
    """Rows of W ranks (W = 1: the reference, which `ref` is filled with)."""
    virtual = d.world == 1
    ranks = [0] if W == 1 else list(range(W)) if virtual else [d.rank]
    torch.cuda.empty_cache()  # what torch cached, free for the library's cudaMalloc
    team = Team(p, out, W, ranks, comms, args)
    rows = []
    try:
        row = common_row(p, W, team, args, d, virtual)
        mine = slice(ranks[0] * p.T // W, (ranks[-1] + 1) * p.T // W)  # this process's tokens
        experts = range(ranks[0] * p.E // W, (ranks[-1] + 1) * p.E // W)
        out.poison()
        team.forward()
        team.check()
        if W == 1:
            ref["y"] = out.y.clone()
        same = {"y": d.all(bits_equal(out.y[mine], ref["y"][mine]))}
        out.poison()
        team.step()
        team.check()
        if W == 1:
            ref.update(dx=out.dx.clone(), dtw=out.dtw.clone(), dw=wgrad_digest(out.dw, experts))
        e0 = experts[0]
        same_b = {"dx": d.all(bits_equal(out.dx[mine], ref["dx"][mine])),
                  "dtopk_w": d.all(bits_equal(out.dtw[mine], ref["dtw"][mine])),
                  "routed_wgrad_digest": d.all(bool(torch.equal(
                      wgrad_digest(out.dw, experts), ref["dw"][:, e0:e0 + len(experts)])))}
        fwd, step = dict(row, equals_w1=same), dict(row, case=row["case"] + "/fwd+bwd",
                                                    equals_w1=same_b)
        for r, s in ((fwd, same), (step, same_b)):
            if not all(s.values()):
                r["wrong"] = True
                d.say(f"{r['case']}: WRONG, not the W = 1 layer's bits: {s}")
        chain = None
        if W == 1 and not fwd.get("wrong") and args.precision == "bf16":
            # W = 1's own kernel chain, the EP forward's kind (fp8 layers run a chain anyway)
            chain = Team(p, out, 1, [0], None, args, tuning=FORWARD_CHAIN)
        if not fwd.get("wrong"):
            fns = [team.forward] + ([chain.forward] if chain else [])
            times = time_ms(fns, args.warmup, args.reps, args.rounds)
            team.check()
            ms = d.all(times[0], "max")
            fwd.update(mok_ms=ms, tflops=p.flops / ms * 1e-9, **clock_fields(["mok"]))
            if args.profile and d.rank == 0:
                print_kernel_times(p.model, f"W = {W} forward", team.forward)
            if chain:
                chain.check()
                ref.update(fwd_ms=ms, chain_ms=d.all(times[1], "max"))
            if W == 1 and not chain:
                ref["fwd_ms"] = ms
            fwd.update(w1_ms=ref["fwd_ms"], vs_w1=ref["fwd_ms"] / ms)
            if "chain_ms" in ref:
                fwd.update(w1_chain_ms=ref["chain_ms"], vs_w1_chain=ref["chain_ms"] / ms)
        if chain:
            chain.close()
        if virtual and W > 1 and args.precision == "bf16" and not fwd.get("wrong"):
            # The dispatch inside each rank's fused kernel, which virtual ranks run only with
            # (SMs - W) / W CTAs each (src/gpu/forward_ep.c, ep_dispatch_in_kernel): checked
            # and timed in the same run, then the default again.
            sms = (torch.cuda.get_device_properties(p.dev).multi_processor_count - W) // W
            team.tune({"forward_sms": sms})
            out.poison()
            team.forward()
            team.check()
            same_ik = bits_equal(out.y[mine], ref["y"][mine])
            ms = time_ms([team.forward], args.warmup, args.reps, args.rounds)[0]
            team.check()
            team.tune({"forward_sms": 0})
            fwd.update(dispatch_in_kernel_sms=sms, dispatch_in_kernel_equals_w1=same_ik,
                       dispatch_in_kernel_ms=ms, vs_w1_dispatch_in_kernel=ref["fwd_ms"] / ms)
            if not same_ik:
                fwd["wrong"] = True
                d.say(f"{fwd['case']}: WRONG with the dispatch in the fused kernel")
        if not step.get("wrong"):
            ms = d.all(time_ms([team.step], args.warmup, args.reps, args.rounds)[0], "max")
            team.check()
            if W == 1:
                ref["step_ms"] = ms
            step.update(mok_ms=ms, tflops=3 * p.flops / ms * 1e-9, w1_ms=ref["step_ms"],
                        vs_w1=ref["step_ms"] / ms, **clock_fields(["mok"]))
            if args.profile and d.rank == 0:
                print_kernel_times(p.model, f"W = {W} forward + backward", team.step)
        rows = [fwd, step]
    finally:
        team.close()
    return rows


def skipped(p, W, args, d, why):
    free, total = torch.cuda.mem_get_info(p.dev)
    reason = f"{why.splitlines()[0]} ({free / 2 ** 30:.1f} of {total / 2 ** 30:.1f} GiB free)"
    d.say(f"{p.model}/T{p.T}/W{W}: skipped: {reason}")
    return {"bench": "ep", "case": f"{p.model}/T{p.T}/W{W}", "model": p.model, "ranks": W,
            "tokens": p.T, "commit": git_commit(args.commit), "skipped": reason}


def run_model(model, args, d):
    dev = torch.device("cuda", d.local)
    p = Problem(model, args.tokens, dev, args.seed)
    out = Outputs(p, args.wgrad == "fp32")
    """[(forward row, forward + backward row) or (skipped row,)] of each W."""
    ref, entries = {}, []
    counts = [1] + ([d.world] if d.world > 1 else [w for w in args.ranks if w > 1])
    for W in counts:
        comms = None
        try:
            if W > 1:
                comms = (mok.Comm.virtual(W, d.local) if d.world == 1
                         else [mok.Comm.from_process_group(device=d.local)])
            entries.append(tuple(run_w(p, out, W, ref, args, d, comms)))
        except (torch.cuda.OutOfMemoryError, mok.MokError) as e:
            if isinstance(e, mok.MokError) and e.code != "OUT_OF_MEMORY":
                raise
            entries.append((skipped(p, W, args, d, str(e)),))
            if W == 1:  # no reference: nothing to compare the others with
                break
        finally:
            for c in comms or []:
                c.close()
    return entries


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", default=os.path.join(HERE, "results", "ep.jsonl"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--cases", default="",
                    help="run only models whose name contains this (or one of these, comma list)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens over all ranks")
    ap.add_argument("--ranks", default="1,2,4",
                    help="virtual rank counts on one GPU (W = 1 always runs: the reference); "
                         "ignored under torchrun, where W is the world size")
    ap.add_argument("--wgrad", choices=("fp32", "bf16"), default="fp32",
                    help="the weight gradients' dtype")
    ap.add_argument("--precision", choices=("bf16", "fp8-block", "mxfp8"), default="bf16",
                    help="the layers' precision (fp8 layers: each rank's experts quantized by "
                         "mok_quantize_weights once, before the timed calls)")
    ap.add_argument("--capacity-factor", type=float, default=0.0,
                    help="mok_layer_desc_t.capacity_factor of every layer (0: W, never overflows)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--profile", action="store_true",
                    help="after timing, each W's kernels (torch.profiler, summed per kernel name: "
                         "with virtual ranks the ranks' kernels overlap in time)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20,
                    help="launches per function with --timing interleaved (and under torchrun)")
    ap.add_argument("--rounds", type=int, default=None)
    add_timing_args(ap)
    args = ap.parse_args()
    args.lib_b = None
    args.ranks = sorted({int(w) for w in args.ranks.split(",")} | {1})
    d = Dist()
    if d.world > 1 and args.timing == "blocked":
        d.say("torchrun: interleaved timing (every rank must make the same calls; blocked timing "
              "sizes its blocks by each rank's clock)")
        args.timing = "interleaved"
    set_timing(args.timing, args.block_ms)
    args.rounds = default_rounds(args)
    for W in ([d.world] if d.world > 1 else args.ranks):
        if args.tokens % W:
            ap.error(f"--tokens {args.tokens} is not a multiple of W = {W}")
    declare_tuning()  # the W = 1 chain is a tuned layer (bench/driver)
    d.say(f"{'case':28s} {'T/rank':>6s} {'fwd ms':>8s} {'TF/s':>5s} {'vs W=1':>6s} "
          f"{'vs chain':>8s} {'in-kernel dispatch':>18s} {'f+b ms':>8s} {'TF/s':>5s} "
          f"{'vs W=1':>6s}  same bits as W = 1")
    rows = []
    for model in MODELS:
        if not case_selected(model, args.cases):
            continue
        entries = run_model(model, args, d)
        rows += [r for e in entries for r in e]
        if d.rank == 0:
            os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
            with open(args.jsonl, "a") as f:
                for e in entries:
                    for r in e:
                        f.write(json.dumps(r) + "\n")
        nan = float("nan")
        for f, b in (e for e in entries if len(e) == 2):
            d.say(f"{f['case']:28s} {f['tokens_per_rank']:6d} {f.get('mok_ms', nan):8.3f} "
                  f"{f.get('tflops', nan):5.0f} {f.get('vs_w1', nan):6.2f} "
                  f"{f.get('vs_w1_chain', nan):8.2f} "
                  f"{f.get('dispatch_in_kernel_ms', nan):9.3f} ms "
                  f"{f.get('vs_w1_dispatch_in_kernel', nan):4.2f}x "
                  f"{b.get('mok_ms', nan):8.3f} "
                  f"{b.get('tflops', nan):5.0f} {b.get('vs_w1', nan):6.2f}  "
                  f"{'yes' if not f.get('wrong') and not b.get('wrong') else 'NO'}")
        torch.cuda.empty_cache()
    if d.world > 1:
        d.dist.destroy_process_group()
    return 1 if any(r.get("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
