"""PyTorch reference for pipelines/llama-1b.toml on one GPU: the same Llama (d2048, 16 layers, 32
query and 8 key/value heads, SwiGLU 8192, RoPE theta 500000, RMSNorm, no biases, tied embeddings,
vocabulary 50304, T = 2048), synthetic tokens, fp32 weights under bf16 autocast, the whole model
torch.compile'd, SDPA with grouped-query attention (enable_gqa), RoPE (rotate_half, as Hugging
Face's Llama) and RMSNorm as plain modules, fused AdamW, gradient clipping at 1.0. Prints and
writes (--out) the median tokens/s and ms/step of the last three quarters of the steps, and the
peak memory (torch.cuda.max_memory_allocated, which excludes the CUDA context as kiln's figure does).

    python3 bench/torch_llama.py --batch 4 --steps 30 --out torch-llama.json
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, REAL_VOCAB = 50304, 50257


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rope(nn.Module):
    def __init__(self, dim, seq, theta):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):  # [B, heads, T, D]
        t = x.shape[2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        return x * cos + rotate_half(x) * sin


class Block(nn.Module):
    def __init__(self, d, h, kv, ffn, eps, rope):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.norm_1 = RMSNorm(d, eps)
        self.qkv = nn.Linear(d, (h + 2 * kv) * self.hd, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm_2 = RMSNorm(d, eps)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)
        self.rope = rope

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=2)
        q = q.view(b, t, self.h, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm_2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, d, layers, h, kv, ffn, seq, theta, eps):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        rope = Rope(d // h, seq, theta)
        self.blocks = nn.ModuleList(Block(d, h, kv, ffn, eps, rope) for _ in range(layers))
        self.norm_f = RMSNorm(d, eps)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # kiln's init: residual projections scaled by 1/sqrt(2L) (Megatron)
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.norm_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def train(model, name, batch, seq, steps, out=""):
    """Trains `model` (fp32 weights; forward(idx, targets) -> loss) compiled, under bf16 autocast, with
    fused AdamW and clipping at 1.0 on synthetic tokens; prints and writes (out) the median tokens/s
    and ms/step of the last three quarters of the steps and the peak memory."""
    params = sum(p.numel() for p in model.parameters())
    cmodel = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    times = []
    for step in range(steps):
        idx = torch.randint(0, REAL_VOCAB, (batch, seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cmodel(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} {1000 * times[-1]:.1f} ms", flush=True)
    steady = times[len(times) // 4:]
    ms = 1000 * statistics.median(steady)
    result = {"model": name, "parameters": params, "batch": batch, "seq": seq, "ms_per_step": ms,
              "tokens_per_s": batch * seq / (ms / 1000),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Llama(2048, args.layers, 32, 8, 8192, args.seq, 500000.0, 1e-5).cuda()
    train(model, "llama-1b", args.batch, args.seq, args.steps, args.out)


if __name__ == "__main__":
    main()
