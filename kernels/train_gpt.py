"""A small GPT trained twice, same seed: attention by ``nc.torch_op`` and by torch SDPA.

    NUMBA_ENABLE_CUDASIM=0 python kernels/train_gpt.py --device cuda --out docs

The text is the Python language reference that ships with CPython's standard library
(``pydoc_data.topics``: the help texts of ``help("topics")``, 465 k characters), read as
characters (about 100 distinct), the last tenth held out.  The model: token and position
embeddings, pre-norm blocks (causal multi-head attention, a GELU MLP), a final norm and a linear
head; Adam with a short warm-up.  Both runs start from the same weights and read the same
batches, so their losses differ only by the two attentions' numerics.

The napkin_cat attention is ``attention(heads=h, causal=True).stream(x, s_x).tile(q, g_q)
.tile(h, 1)`` as one ``nc.torch_op`` (batch and heads merged into ``h``); its forward and
backward are the generated kernels on CUDA tensors (FlashAttention-2's backward from the saved
logsumexp), in the ``--dtype`` given (bf16 by default on a GPU: 16-bit Q, K, V, O and gradients,
fp32 logsumexp), as SDPA gets the same dtype.  The rest of the model is fp32.

Written: ``DIR/train_gpt.json`` (configuration, both loss curves, tokens/s after the warm-up
steps, peak CUDA memory, the op's paths and notes) and ``DIR/train_gpt.png`` (the curves and
their difference).  Printed last: a short table.  "Agree within noise": the largest difference
of the two runs' 20-step mean losses is below the batch noise (the standard deviation of one
run's loss about its 21-step running median; both runs see the same batches, so this is a
generous bound for what numerics alone should do).

``--small`` is the CPU-sized run of ``tests/test_training.py`` (context 16, the NumPy executor).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import napkin_cat as nc  # noqa: E402

GPU = dict(n_layer=4, n_head=4, n_embd=256, context=1024, batch=8, steps=300, lr=1e-3, warmup=20, dtype="bf16")
SMALL = dict(n_layer=2, n_head=2, n_embd=16, context=16, batch=4, steps=30, lr=1e-2, warmup=3, dtype="f32")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def corpus() -> str:
    """The Python language reference from the standard library (no download)."""
    from pydoc_data.topics import topics
    return "".join(topics[k] for k in sorted(topics))


# block sizes on a GPU: the forward (s_x, g_q) and the two backward parts ((dK, dV): g_s, s_t;
# dQ: g_t, s_s), all of which fit shared memory in bf16 and f32 and use mma fragments in bf16
GPU_TILES = {"s_x": 64, "g_q": 64, "g_s": 64, "s_t": 16, "g_t": 64, "s_s": 16}


def attention_op(simulate: bool | None = None, verify: bool = True, tiles: dict | None = None):
    t, s, e, h = nc.axes("t s e h")
    flash = nc.library.attention(q=t, x=s, d=e, heads=h, causal=True).stream(s, "s_x").tile(t, "g_q").tile(h, 1)
    if tiles:   # FlashAttention-2's forward: the output accumulates in registers
        flash = flash.place("O", "registers")
    return nc.torch_op(flash, simulate=simulate, verify=verify, tiles=tiles)


class Attention(nn.Module):
    def __init__(self, cfg, op):
        super().__init__()
        self.heads, self.op, self.dtype = cfg["n_head"], op, DTYPES[cfg["dtype"]]
        self.qkv = nn.Linear(cfg["n_embd"], 3 * cfg["n_embd"])
        self.proj = nn.Linear(cfg["n_embd"], cfg["n_embd"])

    def forward(self, x):
        B, T, C = x.shape
        H = self.heads
        q, k, v = (a.view(B, T, H, C // H).transpose(1, 2).to(self.dtype) for a in self.qkv(x).split(C, dim=2))
        if self.op is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # batch and heads as one axis h of the diagram
            y = self.op(*(a.reshape(B * H, T, C // H).contiguous() for a in (q, k, v))).view(B, H, T, C // H)
        return self.proj(y.to(x.dtype).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg, op):
        super().__init__()
        C = cfg["n_embd"]
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = Attention(cfg, op)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg, vocab: int, op):
        super().__init__()
        C = cfg["n_embd"]
        self.tok, self.pos = nn.Embedding(vocab, C), nn.Embedding(cfg["context"], C)
        self.blocks = nn.ModuleList(Block(cfg, op) for _ in range(cfg["n_layer"]))
        self.ln, self.head = nn.LayerNorm(C), nn.Linear(C, vocab)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class Adam:
    """Adam (no weight decay), written out: torch.optim's first construction imports
    torch._dynamo, seconds that the CPU test would spend on nothing."""

    def __init__(self, params, lr, betas=(0.9, 0.95), eps=1e-8):
        self.params, self.lr, self.betas, self.eps, self.t = list(params), lr, betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** self.t))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def train(cfg: dict, impl: str, device: str, seed: int = 0, simulate: bool | None = None,
          verify: bool = True, log=print) -> dict:
    """One run: ``impl`` "napkin_cat" or "sdpa"; the losses per step, tokens/s, peak memory."""
    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    train_data = data[: int(0.9 * len(data))]
    torch.manual_seed(seed)
    op = attention_op(simulate, verify, GPU_TILES if device.startswith("cuda") else None) if impl == "napkin_cat" else None
    model = GPT(cfg, len(chars), op).to(device)
    opt = Adam(model.parameters(), lr=cfg["lr"])
    batches = torch.Generator().manual_seed(seed + 1)
    T, B = cfg["context"], cfg["batch"]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, warm = [], min(5, cfg["steps"] - 1)
    start = None
    for step in range(cfg["steps"]):
        if step == warm:   # the first steps lower and compile the kernels
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        ix = torch.randint(len(train_data) - T - 1, (B,), generator=batches)
        xb = torch.stack([train_data[i:i + T] for i in ix]).to(device)
        yb = torch.stack([train_data[i + 1:i + T + 1] for i in ix]).to(device)
        opt.lr = cfg["lr"] * min(1.0, (step + 1) / cfg["warmup"])
        loss = model(xb, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == cfg["steps"] - 1:
            log(f"  {impl} step {step:4d} loss {losses[-1]:.4f}")
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = dict(impl=impl, losses=losses, tokens_per_s=(cfg["steps"] - warm) * B * T / seconds,
               peak_memory_mb=torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None)
    if op is not None:
        out.update(paths=[op.last_path, op.last_backward_path], saves=list(op.last_saves), notes=list(op.notes))
    return out


def running_median(xs, k=21):
    h = k // 2
    return [statistics.median(xs[max(0, i - h): i + h + 1]) for i in range(len(xs))]


def agreement(a, b, window: int = 20) -> dict:
    """The two curves' largest per-step and windowed differences, and the batch noise."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    means = [abs(statistics.fmean(a[i:i + window]) - statistics.fmean(b[i:i + window]))
             for i in range(0, max(1, len(a) - window + 1), window)]
    med = running_median(b)
    noise = statistics.pstdev([x - m for x, m in zip(b, med)]) if len(b) > 2 else 0.0
    return dict(max_step_diff=max(diffs), max_window_diff=max(means), batch_noise=noise,
                agree=max(means) < noise)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    a, b = result["napkin_cat"]["losses"], result["sdpa"]["losses"]
    fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw=dict(height_ratios=(3, 1)))
    cfg = result["config"]
    top.plot(b, label=f"torch SDPA ({cfg['dtype']})", lw=1.2)
    top.plot(a, label=f"nc.torch_op ({cfg['dtype']})", lw=1.2, ls="--")
    top.set_ylabel("training loss (nats/char)")
    top.set_title(f"GPT, {cfg['n_layer']} layers, context {cfg['context']}, {result['device']}")
    top.legend()
    bot.plot([x - y for x, y in zip(a, b)], lw=0.8, color="k")
    bot.axhline(0, color="grey", lw=0.5)
    bot.set_ylabel("difference")
    bot.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: dict, device: str, seed: int = 0, simulate: bool | None = None, verify: bool = True,
        log=print) -> dict:
    """Both runs and their comparison."""
    result = dict(config=cfg, device=torch.cuda.get_device_name() if device.startswith("cuda") else device,
                  seed=seed, text="pydoc_data.topics (CPython standard library)")
    for impl in ("napkin_cat", "sdpa"):
        result[impl] = train(cfg, impl, device, seed, simulate, verify, log)
    result["agreement"] = agreement(result["napkin_cat"]["losses"], result["sdpa"]["losses"])
    return result


def table(result: dict) -> str:
    rows = ["| attention | first loss | last-20 mean loss | tokens/s | peak MB |", "|---|---|---|---|---|"]
    for impl in ("napkin_cat", "sdpa"):
        r = result[impl]
        mem = "-" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        rows.append(f"| {impl} | {r['losses'][0]:.4f} | {statistics.fmean(r['losses'][-20:]):.4f} | "
                    f"{r['tokens_per_s']:,.0f} | {mem} |")
    ag = result["agreement"]
    rows.append(f"max step diff {ag['max_step_diff']:.2e}, max 20-step mean diff {ag['max_window_diff']:.2e}, "
                f"batch noise {ag['batch_noise']:.2e}: {'agree' if ag['agree'] else 'DO NOT agree'} within noise")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="docs", help="folder for train_gpt.json and train_gpt.png")
    ap.add_argument("--small", action="store_true", help="the CPU-sized configuration")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", action="store_true", help="skip the kernels' self-check at lowering")
    args = ap.parse_args(argv)
    cfg = dict(SMALL if args.small else GPU)
    cfg.update({k: v for k, v in (("steps", args.steps), ("dtype", args.dtype)) if v is not None})
    result = run(cfg, args.device, args.seed, simulate=False if args.device == "cpu" else None,
                 verify=not args.no_verify)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_gpt.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, out / "train_gpt.png")
    except ImportError:
        print("matplotlib is not installed: no plot (the JSON has the curves)")
    for impl in ("napkin_cat",):
        print(f"nc.torch_op paths {result[impl]['paths']}, saves {result[impl]['saves']}")
        for n in result[impl]["notes"]:
            print(f"  note: {n}")
    print(table(result))
    return 0 if math.isfinite(result["napkin_cat"]["losses"][-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
