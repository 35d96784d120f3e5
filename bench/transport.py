"""
bench/transport.py: dispatch and combine bandwidth of MoK's NVLink transport
(build/libmok_bench.so, mok_bench_transport_* of bench/driver/mok_bench.h) against NCCL all_to_all
(torch.distributed all_to_all_single) in the same run, two ranks on two GPUs
(torch.multiprocessing spawn, one process per GPU).

Shape: Qwen3-235B-A22B (H = 4096, E = 128, K = 8), T = 16384 tokens per rank (--tokens), uniform
random top-8 routing (distinct experts per token, a different seed per rank), bf16 rows.

Only bytes that cross NVLink count (and only those move): dispatch, the rows of this rank's tokens
that go to the other rank (a token once per rank, however many of its slots route there); combine,
the rows the other rank's tokens routed to this rank's experts, sent back. The baseline moves
exactly those bytes per rank with all_to_all_single and uneven splits (nothing to self). GB/s per
direction = the smaller of the two ranks' byte counts / the slower rank's time per call. A timing
is --calls back-to-back calls (CUDA events, median of --reps timings after warm-up; ranks aligned
before each), for MoK and NCCL alike: one call alone would also carry the ranks' launch skew after
the barrier, tens of microseconds. Cases: dispatch (MOK_TP_DISPATCH: send, wait for the peer's
rows), combine (MOK_TP_COMBINE: rows back home, wait) and combine+sum (MOK_TP_COMBINE |
MOK_TP_REDUCE: plus the home rank's slot-order sum, a local pass over the combined rows and x that
the persistent kernel runs as compute tasks; the baseline does no sum).

Before timing, one full call is checked bitwise against torch: y = bf16(sum over k of
bf16(x * (e_k % 4 + 1))) in fp32, slot order (the transport's stand-in expert).

    python3 bench/transport.py [--sms 20] [--tokens 16384] [--calls 8] [--reps 30] [--cases ...]
                               [--jsonl bench/results/transport.jsonl]
    (MOK_LIB overrides build/libmok_bench.so)

Prints a table and appends one JSON object per case to --jsonl.
"""
import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast; before any NCCL init
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.environ.get("MOK_LIB", os.path.join(ROOT, "build", "libmok_bench.so"))
# NOTE: PyTorch first. MoK links no NCCL: its first NCCL call binds the libnccl.so.2 already in the
# process (PyTorch's), which it accepts only at its headers' major.minor (else
# MOK_ERROR_NOT_AVAILABLE; src/gpu/nccl_loader.h). bench/transport_device.sh builds against
# PyTorch's wheel when that ships the device headers.
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

W = 2
H, E, K = 4096, 128, 8
DISPATCH, COMBINE, REDUCE = 1, 2, 4  # MOK_TP_DISPATCH, MOK_TP_COMBINE, MOK_TP_REDUCE


class UniqueId(ctypes.Structure):  # mok_unique_id_t
    _fields_ = [("internal", ctypes.c_char * 128)]


def load_lib(path):
    """The public communicator calls and the driver's scalar-argument transport wrappers
    (bench/driver/mok_bench.h); libmok.so exports only the former."""
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "mok_bench_transport_create"):
        raise SystemExit(f"{path} has no mok_bench_transport_create: the transport benchmark needs "
                         f"a libmok_bench.so (`make all` builds build/libmok_bench.so)")
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    sig = {
        "mok_get_unique_id": [ctypes.POINTER(UniqueId)],
        "mok_comm_create_unique_id": [ctypes.POINTER(vp), ctypes.POINTER(UniqueId), ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int],
        "mok_comm_destroy": [vp],
        # (out, comm, max_tokens, hidden, num_experts, top_k, tile_m, num_sms, timeout_s)
        "mok_bench_transport_create": [ctypes.POINTER(vp), vp, i64, i64, i64, i64, i64,
                                       ctypes.c_int, ctypes.c_double],
        "mok_bench_transport_destroy": [vp],
        "mok_bench_transport_layout": [vp, i64, vp, vp],
        "mok_bench_transport_run": [vp, ctypes.c_int, vp, vp, vp],
        "mok_bench_transport_check": [vp],
        "mok_bench_transport_remote_bytes": [vp, ctypes.POINTER(i64), ctypes.POINTER(i64)],
    }
    for name, args in sig.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib.mok_last_error.restype = ctypes.c_char_p
    lib.mok_last_error.argtypes = []
    return lib


def ok(lib, res, what):
    if res != 0:
        raise RuntimeError(f"{what}: result {res}: {lib.mok_last_error().decode()}")


def timed(fn, reps, stream, calls=1):
    """Median ms per call over reps timings of `calls` back-to-back calls of fn (CUDA events),
    after warm-up; ranks aligned before each timing. With calls > 1 the ranks' launch skew (tens
    of microseconds after a barrier) is spread over the calls instead of added to one."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(calls):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def max_over_ranks(v):
    t = torch.tensor([v], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_ints(vals):
    t = torch.tensor(vals, dtype=torch.int64, device="cuda")
    out = [torch.empty_like(t) for _ in range(W)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def expected_y(x, idx):
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for k in range(idx.shape[1]):
        e = idx[:, k:k + 1].long()
        yk = (xf * (e % 4 + 1).float()).bfloat16()
        acc += torch.where(e >= 0, yk.float(), torch.zeros_like(acc))
    return acc.bfloat16()


def a2a_baseline(nbytes_send, nbytes_recv, rank, reps, stream, calls):
    """all_to_all_single moving nbytes_send to the other rank and nothing to itself."""
    n_send, n_recv = nbytes_send // 2, nbytes_recv // 2
    inp = torch.empty(n_send, dtype=torch.bfloat16, device="cuda").normal_()
    out = torch.empty(n_recv, dtype=torch.bfloat16, device="cuda")
    in_splits = [0 if r == rank else n_send for r in range(W)]
    out_splits = [0 if r == rank else n_recv for r in range(W)]
    return timed(lambda: dist.all_to_all_single(out, inp, out_splits, in_splits), reps, stream,
                 calls)


def worker(rank, args, port, results):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=W, device_id=dev)
    lib = load_lib(LIB)
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)

    uid = UniqueId()
    if rank == 0:
        ok(lib, lib.mok_get_unique_id(ctypes.byref(uid)), "mok_get_unique_id")
    box = [ctypes.string_at(ctypes.addressof(uid), 128) if rank == 0 else None]  # .internal stops at NUL
    dist.broadcast_object_list(box, src=0)
    ctypes.memmove(ctypes.byref(uid), box[0], 128)
    comm = ctypes.c_void_p()
    ok(lib, lib.mok_comm_create_unique_id(ctypes.byref(comm), ctypes.byref(uid), rank, W, rank),
       "mok_comm_create_unique_id")

    rows = []
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        idx = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
        idx = idx.contiguous()
        x = (torch.randn(T, H, generator=g, device="cuda") * 0.5).bfloat16().contiguous()
        y = torch.empty_like(x)
        want = expected_y(x, idx)
        for sms in args.sms:
            tp = ctypes.c_void_p()
            ok(lib, lib.mok_bench_transport_create(ctypes.byref(tp), comm, T, H, E, K, 128, sms,
                                                   10.0), "mok_bench_transport_create")
            ok(lib, lib.mok_bench_transport_layout(tp, T, idx.data_ptr(), sp), "layout")
            ok(lib, lib.mok_bench_transport_run(tp, DISPATCH | COMBINE | REDUCE, x.data_ptr(),
                                                y.data_ptr(), sp), "run")
            ok(lib, lib.mok_bench_transport_check(tp), "check")
            correct = bool(torch.equal(y, want))
            correct = max_over_ranks(0.0 if correct else 1.0) == 0.0
            db, cb = ctypes.c_int64(), ctypes.c_int64()
            ok(lib, lib.mok_bench_transport_remote_bytes(tp, ctypes.byref(db), ctypes.byref(cb)),
               "bytes")
            sent = gather_ints([db.value, cb.value])  # [rank][dispatch, combine]

            for phase, name, col in ((DISPATCH, "dispatch", 0), (COMBINE, "combine", 1),
                                     (COMBINE | REDUCE, "combine+sum", 1)):
                if args.cases and name not in args.cases:
                    continue
                def call():
                    lib.mok_bench_transport_run(tp, phase, x.data_ptr(), y.data_ptr(), sp)
                ms = max_over_ranks(timed(call, args.reps, stream, args.calls))
                ok(lib, lib.mok_bench_transport_check(tp), f"{name} timing")
                mine, other = sent[rank][col], sent[1 - rank][col]
                base_ms = max_over_ranks(a2a_baseline(mine, other, rank, args.reps, stream,
                                                      args.calls))
                nbytes = min(s[col] for s in sent)
                rows.append({"case": f"qwen3-235b-a22b/{name}/T{T}/sms{sms}", "sms": sms,
                             "mok_ms": ms, "baseline_ms": base_ms,
                             "gbps": nbytes / ms / 1e6, "baseline_gbps": nbytes / base_ms / 1e6,
                             "bytes_per_direction": nbytes, "correct": correct})
            # Ranks leave the timed loops together; a late COMBINE-only call must not outlive the
            # window.
            torch.cuda.synchronize()
            dist.barrier()
            ok(lib, lib.mok_bench_transport_destroy(tp), "mok_bench_transport_destroy")
    ok(lib, lib.mok_comm_destroy(comm), "mok_comm_destroy")
    if rank == 0:
        results.extend(rows)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", default="20", help="comma-separated communication SM counts")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--jsonl", default=os.path.join(ROOT, "bench", "results", "transport.jsonl"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tokens", default="16384", help="comma-separated tokens per rank")
    ap.add_argument("--calls", type=int, default=8,
                    help="back-to-back calls per timing (MoK and NCCL alike)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    args.sms = [int(s) for s in args.sms.split(",")]
    args.cases = [c for c in args.cases.split(",") if c]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if torch.cuda.device_count() < W:
        print(f"needs {W} GPUs, found {torch.cuda.device_count()}")
        return 1
    with mp.Manager() as m:
        results = m.list()
        mp.spawn(worker, args=(args, free_port(), results), nprocs=W, join=True)
        results = list(results)
    device = f"{torch.cuda.get_device_name(0)} x{W}"
    commit = args.commit or git_commit()
    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    print(f"{'case':44s} {'mok ms':>8s} {'GB/s':>7s} {'a2a ms':>8s} {'GB/s':>7s} {'ratio':>6s}  ok")
    with open(args.jsonl, "a") as f:
        for r in results:
            rec = {"bench": "transport", "case": r["case"], "device": device,
                   "mok_ms": r["mok_ms"],
                   "baseline": "nccl all_to_all_single (torch.distributed), same remote bytes",
                   "baseline_ms": r["baseline_ms"], "ratio": r["baseline_ms"] / r["mok_ms"],
                   "gbps": r["gbps"], "baseline_gbps": r["baseline_gbps"], "commit": commit,
                   "sms": r["sms"], "calls_per_timing": args.calls,
                   "bytes_per_direction": r["bytes_per_direction"],
                   "correct": r["correct"], "torch": torch.__version__,
                   "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
            f.write(json.dumps(rec) + "\n")
            print(f"{r['case']:44s} {r['mok_ms']:8.3f} {r['gbps']:7.1f} {r['baseline_ms']:8.3f} "
                  f"{r['baseline_gbps']:7.1f} {rec['ratio']:6.2f}  {r['correct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
