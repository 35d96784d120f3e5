"""
bench/plot.py: the committed benchmark results (bench/results/*.jsonl) as PNGs for the README.

    python3 bench/plot.py [--results bench/results] [--out docs/img]

Each benchmark appends one JSON object per case and run to its file, so a case's last row is its
most recent run (rows marked "reverted" measured code that was taken out, and are skipped);
every plot takes that row for each case (and names the commits it drew from in
its title). MoK against the baseline the rows name, the ratio MoK / baseline over MoK's bar:
  forward.png    bench/forward.py: TFLOP/s of the layer per model, forward and forward + backward,
                 against the PyTorch pipeline (argsort, torch._grouped_mm, SwiGLU, index_add_).
  gemm.png       bench/gemm.py: TFLOP/s of each grouped GEMM per model (columns), balanced and
                 skewed routing (rows), against torch._grouped_mm (bf16) and
                 torch._scaled_grouped_mm rowwise (fp8).
  transport.png  bench/transport.py: GB/s per direction of dispatch, combine and combine + sum
                 per SM count, two H200s, against NCCL all_to_all_single moving the same bytes.
  ep.png         bench/ep.py: TFLOP/s of the layer per model at W = 1, 2, 4 ranks, forward and
                 forward + backward, the ratio to W = 1 over each W > 1 bar (virtual ranks on one
                 GPU share its SMs: the cost of the expert-parallel path, not scaling).
Needs matplotlib (drawn with the Agg backend: no display).
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
MODEL_NAMES = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen3-235B-A22B",
               "deepseek-v3": "DeepSeek-V3"}
# bench/gemm.py's GEMMs, in the order the README's table has them
GEMMS = (("gate_up", "gate/up"), ("gate_up_swiglu", "gate/up\n+SwiGLU"), ("down", "down"),
         ("bwd_ds", "bwd ds"), ("bwd_dx", "bwd dx"), ("wgrad_dwg", "wgrad\ndWg"),
         ("wgrad_dwd", "wgrad\ndWd"), ("gate_up/fp8", "fp8\ngate/up"), ("down/fp8", "fp8\ndown"))
MOK, BASE = "tab:blue", "tab:gray"


def latest(path):
    """{case: its last row} of a JSON-lines file (rows are appended in run order), skipping rows
    marked "reverted" (a measured variant whose code was taken out again)."""
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if not row.get("reverted"):
                    rows[row["case"]] = row
    return rows


def commits(rows):
    seen = sorted({r.get("commit", "?") for r in rows})
    return ("commit " if len(seen) == 1 else "commits ") + ", ".join(seen)


def bars(ax, labels, rows, mok, base, unit):
    """Pairs of bars (row[mok], row[base]) at each label, the ratio over MoK's; a row None: no
    such case. Where the panel's rows come from several commits, each label names its own."""
    width = 0.38
    mixed = len({r["commit"] for r in rows if r}) > 1
    for i, r in enumerate(rows):
        if r is None:
            continue
        m, b = r[mok], r[base]
        ax.bar(i - width / 2, m, width, color=MOK)
        ax.bar(i + width / 2, b, width, color=BASE)
        ax.text(i - width / 2, m, f"{m / b:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{label}\n{r['commit']}" if mixed and r else label
                        for label, r in zip(labels, rows)], fontsize=7 if mixed else 8)
    ax.set_ylabel(unit)
    ax.margins(y=0.08)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def finish(fig, title, base_label, path):
    """The title, one legend under the panels, and the PNG."""
    from matplotlib.patches import Patch
    fig.suptitle(title, fontsize=10)
    fig.legend(handles=[Patch(color=MOK, label="MoK"), Patch(color=BASE, label=base_label)],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def plot_forward(plt, rows, path):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    used = []
    for ax, suffix, title in ((axes[0], "", "forward"),
                              (axes[1], "/fwd+bwd", "forward + backward")):
        picked = [rows.get(f"{m}/T16384{suffix}") for m in MODELS]
        used += [r for r in picked if r]
        bars(ax, [MODEL_NAMES[m] for m in MODELS], picked, "tflops", "baseline_tflops", "TFLOP/s")
        wgrad = {r.get("wgrad") for r in picked if r and r.get("wgrad")}
        if len(wgrad) == 1:  # the rows' weight-gradient dtype (the pipeline's is bf16)
            title += f" ({wgrad.pop()} weight gradients)"
        ax.set_title(f"{title}, T = 16384, top-8", fontsize=10)
    finish(fig, f"MoE layer, one {used[0]['device']} (bench/forward.py, {commits(used)})",
           "PyTorch pipeline (argsort, torch._grouped_mm, SwiGLU, index_add_)", path)
    plt.close(fig)


def plot_gemm(plt, rows, path):
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), sharey=True)
    used = []
    for j, model in enumerate(MODELS):
        for i, routing in enumerate(("balanced", "skewed")):
            picked = []
            for key, label in GEMMS:
                gemm, _, fp8 = key.partition("/")
                r = rows.get(f"{model}/{gemm}/{routing}" + ("/fp8" if fp8 else ""))
                if r:
                    picked.append((label, r))
            used += [r for _, r in picked]
            ax = axes[i][j]
            bars(ax, [label for label, _ in picked], [r for _, r in picked], "tflops",
                 "baseline_tflops", "TFLOP/s" if j == 0 else "")
            ax.set_title(f"{MODEL_NAMES[model]}, {routing} routing "
                         f"({commits([r for _, r in picked])})", fontsize=10)
    finish(fig, f"grouped GEMMs, 131072 rows, one {used[0]['device']} (bench/gemm.py)",
           "torch._grouped_mm (fp8: torch._scaled_grouped_mm, rowwise)", path)
    plt.close(fig)


def plot_transport(plt, rows, path):
    by_tokens = {}
    for case, r in rows.items():
        _, kind, tokens, _ = case.split("/")
        by_tokens.setdefault(tokens, []).append((kind, r["sms"], r))
    order = {"dispatch": 0, "combine": 1, "combine+sum": 2}
    tokens = sorted(by_tokens, key=lambda t: int(t[1:]))
    counts = [len(by_tokens[t]) for t in tokens]
    fig, axes = plt.subplots(1, len(tokens), figsize=(0.75 * sum(counts) + 2, 4.5), sharey=True,
                             squeeze=False, gridspec_kw={"width_ratios": counts})
    used = []
    for ax, t in zip(axes[0], tokens):
        picked = sorted(by_tokens[t], key=lambda x: (order.get(x[0], 9), x[1]))
        used += [r for _, _, r in picked]
        bars(ax, [f"{k}\n{s} SMs" for k, s, _ in picked], [r for _, _, r in picked], "gbps",
             "baseline_gbps", "GB/s per direction" if t == tokens[0] else "")
        ax.set_title(f"T = {t[1:]} per rank", fontsize=10)
    finish(fig, f"NVLink transport, Qwen3-235B-A22B (H = 4096, E = 128, K = 8), "
                f"{used[0]['device']} (bench/transport.py, {commits(used)})",
           "NCCL all_to_all_single, the same bytes", path)
    plt.close(fig)


def plot_ep(plt, rows, path):
    colors = {1: MOK, 2: "tab:orange", 4: "tab:green"}
    ranks = sorted({r["ranks"] for r in rows.values()})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    used = []
    width = 0.8 / len(ranks)
    for ax, suffix, title in ((axes[0], "", "forward"), (axes[1], "/fwd+bwd", "forward + backward")):
        for i, model in enumerate(MODELS):
            w1 = rows.get(f"{model}/T16384/W1{suffix}")
            for j, w in enumerate(ranks):
                r = rows.get(f"{model}/T16384/W{w}{suffix}")
                if not r or "tflops" not in r:
                    continue
                used.append(r)
                x = i + (j - (len(ranks) - 1) / 2) * width
                ax.bar(x, r["tflops"], width, color=colors.get(w, BASE))
                if w > 1 and w1:
                    ax.text(x, r["tflops"], f"{r['tflops'] / w1['tflops']:.2f}x", ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks(range(len(MODELS)))
        ax.set_xticklabels([MODEL_NAMES[m] for m in MODELS], fontsize=8)
        ax.set_title(f"{title}, T = 16384 in all", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.margins(y=0.08)
    axes[0].set_ylabel("TFLOP/s")
    from matplotlib.patches import Patch
    fig.suptitle(f"expert parallelism, W virtual ranks on one {used[0]['device']} "
                 f"(bench/ep.py, {commits(used)})", fontsize=10)
    fig.legend(handles=[Patch(color=colors.get(w, BASE), label=f"W = {w}") for w in ranks],
               loc="lower center", ncol=len(ranks), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="the benchmark results as PNGs")
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    for name, draw in (("forward", plot_forward), ("gemm", plot_gemm),
                       ("transport", plot_transport), ("ep", plot_ep)):
        path = os.path.join(args.out, name + ".png")
        draw(plt, latest(os.path.join(args.results, name + ".jsonl")), path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
