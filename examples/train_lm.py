"""
examples/train_lm.py: a small MoE transformer language model trained twice from the same
initialization on the same batches, once with MoK's layer (mok.moe.MoE) as the experts and once
with a plain PyTorch MoE of the same math; both loss curves and tokens/s go to a JSON and a PNG.

    python3 examples/train_lm.py --device cuda            # one H200; the defaults below
    python3 examples/train_lm.py --device cpu --steps 3 --layers 2 --hidden 128 --intermediate 128 \
        --experts 4 --top-k 2 --batch 2 --seq 32          # MoK's CPU reference: a few seconds
    python3 examples/train_lm.py --replot docs/img/train_lm.json   # the PNG again from a JSON

The data: bytes (vocabulary 256) of the Python standard library's own source, the *.py files under
os.path.dirname(os.__file__) (site-packages excluded) in sorted order of their relative paths;
every 20th file is validation, the rest training (so the text differs between Python versions,
never between the two runs). A batch is `batch` windows of seq + 1 bytes at offsets drawn from a
generator seeded with --seed, made afresh for each run: both runs see the same batches in the
same order, and the validation batches are fixed.

The model: an embedding, `layers` pre-norm blocks (RMSNorm, causal self-attention through
F.scaled_dot_product_attention in bf16 autocast, RMSNorm, a router and the routed experts), a
final RMSNorm and the tied embedding as the output layer. The router is a linear map to E logits
in fp32, softmax, top-k, the k weights renormalized to sum to 1; a Switch-style load-balancing
term (0.01 E sum_e f_e P_e) is added to the objective, and the logged loss is the cross-entropy
alone (nats per byte). The experts are SwiGLU, y = sum over slots of
w * (silu(x Wg^T) * (x Wu^T)) Wd^T, run outside autocast on bf16 x:
  mok    mok.moe.MoE (MoE.from_experts): the fused GPU layer, or the plain-C reference on the CPU
         device. g and u accumulate in fp32, a = bf16(w * silu(g) * u), each slot's output is
         rounded to bf16, y = bf16(fp32 sum of the slots); weight gradients in fp32.
  torch  bench/forward.py's pipeline under autograd: tokens sorted by expert (argsort), gathered,
         torch._grouped_mm with the concatenated [Wg; Wu], SwiGLU and the router weight in fp32,
         torch._grouped_mm with Wd, index_add_ into fp32, y in bf16. torch._grouped_mm rounds g
         and u to bf16 before the SwiGLU and its weight gradients are bf16: these roundings are
         the difference between the two.
Every parameter is an fp32 master weight (both expert layers round theirs to bf16 for each call),
trained by the same AdamW (betas 0.9, 0.95, weight decay 0.1; linear warm-up over the first tenth
of the steps, then cosine decay to a tenth of --lr) with the gradient norm clipped at 1.

What "the curves overlap within noise" means here. The two runs start from the same weights and
see the same batches, but not the same bits: the first forward's loss differs only by the
roundings above (1e-4 to 1e-3 relative), and from the first update on the weights differ by bf16
rounding too, a difference training amplifies until the runs are as far apart as two runs of one
implementation whose reductions are ordered differently (the PyTorch MoE on a GPU, whose
index_add_ and attention backward use atomics, is such a pair of runs). Two scales are printed beside max |loss_mok - loss_torch| over the steps:
  sigma    the batch noise: the standard deviation of the PyTorch run's per-step loss about its
           centered 25-step moving average, over the second half of the steps (the scale on which
           another data order would move a curve);
  control  with --control, the PyTorch MoE is trained a second time, same weights, same batches:
           max |loss_torch - loss_torch'|, the spread of one implementation against itself (0 where
           it is bitwise repeatable, and then only sigma is a reference).
The curves overlap within noise when the largest difference is of the size of the control's (or
below sigma) and the validation losses agree about as closely as the control's do (about 1%). A
200-step CPU run with --control (H = I = 128, E = 8, top-2, 4 x 64 tokens, lr 3e-3; the CPU
build's torch is not bitwise repeatable either) gave max |mok - torch| 0.12, control 0.22, sigma
0.30; validation losses 2.590 (mok), 2.619 (torch), 2.594 (control).

Tokens/s: batch * seq tokens over the wall time of a step (forward, backward, clipping, AdamW; the
device synchronized at the step's end), summed over the steps after the first min(10, steps / 4)
(allocator and library warm-up). A CPU run measures the C reference, not MoK's speed.

Shapes: MoK's layers want hidden and intermediate multiples of 128 (include/mok.h; also on the CPU
device), top-k <= min(experts, 64), and batch * seq <= 2^24 tokens. The defaults (4 layers, H =
1024, I = 512, E = 32, top-8, 16 x 512 tokens a step, 500 steps) are sized for one H200, where
both runs together should take a minute or two (not yet measured).

Output: --out PREFIX writes PREFIX.json (configuration, per-step loss and seconds of both runs,
validation losses, tokens/s) and PREFIX.png (needs matplotlib; without it only the JSON). Default
docs/img/train_lm. The last lines printed: final train and validation loss of both runs, the
largest loss difference, tokens/s of both and their ratio.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

# torch before the binding's library (src/gpu/nccl_loader.h: the first libnccl.so.2 loaded wins)
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from mok.moe import MoE  # noqa: E402

VOCAB = 256       # bytes
HEAD_DIM = 64
AUX_COEF = 0.01   # weight of the load-balancing term


# ---- data ---------------------------------------------------------------------------------------

def stdlib_corpus():
    """(train, val) uint8 tensors: the standard library's *.py files, every 20th one to val."""
    root = os.path.dirname(os.__file__)
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    paths.sort()
    parts = ([], [])
    for i, p in enumerate(paths):
        with open(os.path.join(root, p), "rb") as f:
            parts[i % 20 == 19].append(f.read())
    train, val = (torch.frombuffer(bytearray(b"".join(x)), dtype=torch.uint8) for x in parts)
    return train, val, {"root": root, "files": len(paths), "train_bytes": train.numel(),
                        "val_bytes": val.numel()}


def batches(data, batch, seq, count, seed, device):
    """count (inputs, targets) pairs, each [batch, seq] int64, windows at seeded random offsets."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.arange(seq + 1)
    for _ in range(count):
        starts = torch.randint(0, data.numel() - seq - 1, (batch, 1), generator=gen)
        w = data[starts + span].to(device=device, dtype=torch.int64)  # [batch, seq + 1]
        yield w[:, :-1], w[:, 1:]


# ---- the two expert layers ---------------------------------------------------------------------

class TorchExperts(torch.nn.Module):
    """The PyTorch MoE (bench/forward.py's pipeline); parameters named and shaped as MoE's:
    wg, wu [E, I, H], wd [E, H, I] (Linear layout), any float dtype (rounded to bf16 per call)."""

    def __init__(self, wg, wu, wd):
        super().__init__()
        self.wg, self.wu, self.wd = (torch.nn.Parameter(t.clone()) for t in (wg, wu, wd))

    def forward(self, x, topk_idx, topk_w):
        """x [T, H] bf16, topk_idx [T, K] int, topk_w [T, K] fp32 -> y [T, H] bf16."""
        T, K = topk_idx.shape
        E, I = self.wg.shape[0], self.wg.shape[1]
        flat = topk_idx.flatten()                                            # [T K]
        order = torch.argsort(flat, stable=True)
        tok = order // K
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)  # [E]
        wgu = torch.cat([self.wg, self.wu], dim=1).to(torch.bfloat16).transpose(1, 2)  # [E, H, 2I]
        gu = torch._grouped_mm(x[tok], wgu, offs=offs)                       # [T K, 2I] bf16
        a = (F.silu(gu[:, :I].float()) * gu[:, I:].float() * topk_w.flatten()[order, None])
        yk = torch._grouped_mm(a.bfloat16(), self.wd.to(torch.bfloat16).transpose(1, 2),
                               offs=offs)                                    # [T K, H] bf16
        y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
        y.index_add_(0, tok, yk.float())
        return y.bfloat16()


def make_experts(impl, wg, wu, wd, top_k, max_tokens, device):
    if impl == "mok":
        return MoE.from_experts(wd, gate=wg, up=wu, top_k=top_k, max_tokens=max_tokens,
                                device=device)
    return TorchExperts(wg, wu, wd)


# ---- the model ----------------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, H, E, K):
        super().__init__()
        self.heads, self.K = H // HEAD_DIM, K
        self.norm1, self.norm2 = torch.nn.RMSNorm(H), torch.nn.RMSNorm(H)
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = None  # TorchExperts or mok.moe.MoE, set by LM

    def forward(self, x):
        """x [B, S, H] fp32 (the residual stream) -> (x, the load-balancing term)."""
        B, S, H = x.shape
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            qkv = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, HEAD_DIM)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)                           # [B, heads, S, 64] each
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, S, 64]
            x = x + self.proj(att.transpose(1, 2).reshape(B, S, H)).float()
        h = self.norm2(x).reshape(B * S, H)                                  # [T, H] fp32
        probs = self.router(h).softmax(dim=-1)                               # [T, E] fp32
        topk_w, topk_idx = probs.topk(self.K, dim=-1)                        # [T, K]
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        y = self.experts(h.to(torch.bfloat16), topk_idx.to(torch.int32), topk_w)  # [T, H] bf16
        E = probs.shape[1]
        frac = torch.bincount(topk_idx.flatten(), minlength=E).float() / topk_idx.numel()
        aux = E * (frac * probs.mean(dim=0)).sum()
        return x + y.view(B, S, H).float(), aux


class LM(torch.nn.Module):
    def __init__(self, args, impl, device):
        super().__init__()
        H, I, E, L = args.hidden, args.intermediate, args.experts, args.layers
        gen = torch.Generator().manual_seed(args.seed)  # on the CPU: the same draws on any device

        def rand(*shape, std):
            return (torch.randn(*shape, generator=gen) * std).to(device)

        self.embed = torch.nn.Parameter(rand(VOCAB, H, std=0.02))
        self.pos = torch.nn.Parameter(rand(args.seq, H, std=0.02))
        blocks = []
        for _ in range(L):
            wg, wu = rand(E, I, H, std=H ** -0.5), rand(E, I, H, std=H ** -0.5)
            wd = rand(E, H, I, std=I ** -0.5 / math.sqrt(2 * L))
            experts = make_experts(impl, wg, wu, wd, args.top_k, args.batch * args.seq, device)
            block = Block(H, E, args.top_k).to(device)
            block.experts = experts  # after .to: a MoE stays on the device its layer was made for
            with torch.no_grad():
                for lin, std in ((block.qkv, H ** -0.5), (block.proj, H ** -0.5 / math.sqrt(2 * L)),
                                 (block.router, 0.02)):
                    lin.weight.copy_(rand(*lin.weight.shape, std=std))
            blocks.append(block)
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm = torch.nn.RMSNorm(H).to(device)

    def forward(self, idx, targets):
        """idx, targets [B, S] int64 -> (cross-entropy in nats per byte, load-balancing term)."""
        x = self.embed[idx] + self.pos[: idx.shape[1]]                     # [B, S, H] fp32
        aux = 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = F.linear(self.norm(x), self.embed)                     # [B, S, 256]
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return loss, aux / len(self.blocks)


# ---- training -----------------------------------------------------------------------------------

def lr_at(step, args):
    warm = args.steps // 10
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, impl, train_data, val_data, args, device):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, seconds = [], []
    tokens = args.batch * args.seq
    for step, (x, y) in enumerate(batches(train_data, args.batch, args.seq, args.steps, args.seed,
                                          device)):
        sync(device)
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss, aux = model(x, y)
        (loss + AUX_COEF * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        sync(device)
        seconds.append(time.perf_counter() - t0)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"{impl:7s} step {step:5d}  loss {losses[-1]:.4f}  {seconds[-1] * 1e3:8.1f} ms  "
                  f"{tokens / seconds[-1]:10.0f} tok/s", flush=True)
    with torch.no_grad():
        val = [model(x, y)[0].item() for x, y in batches(val_data, args.batch, args.seq,
                                                         args.val_batches, args.seed + 1, device)]
    for block in model.blocks:
        if isinstance(block.experts, MoE):
            block.experts.layer.check()  # raises what a GPU kernel found (bad routing, timeout)
    skip = min(10, args.steps // 4)
    timed = seconds[skip:]
    return {"loss": losses, "step_s": seconds, "val_loss": sum(val) / len(val),
            "tokens_per_s": tokens * len(timed) / sum(timed), "timed_from_step": skip}


def noise(losses, window=25):
    """sigma: std of the loss about its centered moving average, over the second half."""
    half = losses[len(losses) // 2:]
    if len(half) < window:
        return float("nan")
    r = window // 2
    res = [half[i] - sum(half[i - r:i + r + 1]) / (2 * r + 1) for i in range(r, len(half) - r)]
    m = sum(res) / len(res)
    return math.sqrt(sum((v - m) ** 2 for v in res) / len(res))


def summary(result):
    runs = result["runs"]
    m, t = runs["mok"], runs["torch"]
    n = max(1, len(m["loss"]) // 20)
    tail = lambda r: sum(r["loss"][-n:]) / n  # noqa: E731
    diff = max(abs(a - b) for a, b in zip(m["loss"], t["loss"]))
    control = (max(abs(a - b) for a, b in zip(runs["control"]["loss"], t["loss"]))
               if "control" in runs else None)
    lines = [
        f"final train loss (mean of the last {n} steps): mok {tail(m):.4f}  torch {tail(t):.4f}",
        f"final val loss: mok {m['val_loss']:.4f}  torch {t['val_loss']:.4f}  "
        f"(relative difference {abs(m['val_loss'] - t['val_loss']) / t['val_loss']:.2e})",
        f"step 0 loss: mok {m['loss'][0]:.6f}  torch {t['loss'][0]:.6f}",
        f"max |loss difference| over {len(m['loss'])} steps: {diff:.4f}  "
        f"(batch noise sigma {result['sigma']:.4f}" + (
            f", control: max |torch - torch'| {control:.4f})" if control is not None else ")"),
        f"tokens/s: mok {m['tokens_per_s']:.0f}  torch {t['tokens_per_s']:.0f}  "
        f"ratio mok/torch {m['tokens_per_s'] / t['tokens_per_s']:.2f}x",
    ]
    return "\n".join(lines)


# ---- the plot -----------------------------------------------------------------------------------

def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path} (pip install matplotlib; then --replot)")
        return False
    runs, c = result["runs"], result["config"]
    fig, (ax, ad) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    for name, label, color in (("torch", "PyTorch MoE (_grouped_mm)", "tab:orange"),
                               ("mok", "MoK (mok.moe.MoE)", "tab:blue")):
        r = runs[name]
        ax.plot(r["loss"], label=f"{label}: {r['tokens_per_s'] / 1e3:,.0f}k tok/s, "
                                 f"val {r['val_loss']:.3f}", color=color, lw=1)
    ax.set_ylabel("train loss (nats / byte)")
    ax.set_title(f"{c['layers']} layers, H={c['hidden']}, I={c['intermediate']}, E={c['experts']}, "
                 f"top-{c['top_k']}, {c['batch']}x{c['seq']} tokens/step, {result['device']}",
                 fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    if "control" in runs:
        ad.plot([a - b for a, b in zip(runs["control"]["loss"], runs["torch"]["loss"])],
                color="tab:gray", lw=0.8, label="torch (second run) - torch")
    ad.plot([a - b for a, b in zip(runs["mok"]["loss"], runs["torch"]["loss"])], color="k", lw=0.8,
            label="mok - torch")
    ad.legend(fontsize=8)
    ad.axhline(0, color="gray", lw=0.5)
    ad.set_ylabel("loss difference")
    ad.set_xlabel("step")
    ad.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="H, a multiple of 128 (and of 64)")
    p.add_argument("--intermediate", type=int, default=512, help="I per expert, a multiple of 128")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--control", action="store_true",
                   help="train the PyTorch MoE a second time: the noise floor of the comparison")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "train_lm"),
                   help="writes OUT.json and OUT.png (a .json or .png suffix is dropped)")
    p.add_argument("--replot", metavar="JSON", help="draw the PNG of a JSON this script wrote, "
                                                    "next to it, and print its summary")
    return p.parse_args(argv)


def git_commit():
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return "unknown"


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        plot(result, os.path.splitext(args.replot)[0] + ".png")
        print(summary(result))
        return 0
    if args.hidden % HEAD_DIM:
        sys.exit(f"--hidden {args.hidden}: a multiple of {HEAD_DIM} (the head size)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU visible to torch (use --device cpu for the reference)")
    out = os.path.splitext(args.out)[0] if args.out.endswith((".json", ".png")) else args.out
    train_data, val_data, corpus = stdlib_corpus()
    print(f"data: {corpus['files']} files of {corpus['root']}: {corpus['train_bytes']:,} train "
          f"bytes, {corpus['val_bytes']:,} val bytes")
    runs, first_state = {}, None
    for run in ("mok", "torch") + (("control",) if args.control else ()):
        impl = "torch" if run == "control" else run
        torch.manual_seed(args.seed)
        model = LM(args, impl, device)
        if impl == "torch":  # the same initial weights, checked
            state = model.state_dict()
            assert list(state) == list(first_state), (list(state), list(first_state))
            for k, v in first_state.items():
                assert torch.equal(v, state[k]), f"initial {k} differs between the two models"
        else:
            first_state = {k: v.clone() for k, v in model.state_dict().items()}
            params = sum(p.numel() for p in model.parameters())
            print(f"model: {params / 1e6:.1f}M parameters, "
                  f"{args.batch * args.seq} tokens a step, {args.steps} steps, on {device}")
        t0 = time.perf_counter()
        runs[run] = train(model, run, train_data, val_data, args, device)
        runs[run]["wall_s"] = time.perf_counter() - t0
        print(f"{run}: {runs[run]['wall_s']:.1f} s", flush=True)
        del model
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (MoK reference)"
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "replot")},
              "device": name, "torch": torch.__version__, "commit": git_commit(), "data": corpus,
              "runs": runs, "sigma": noise(runs["torch"]["loss"])}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    drawn = plot(result, out + ".png")
    print(f"wrote {out}.json" + (f" and {out}.png" if drawn else ""))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
