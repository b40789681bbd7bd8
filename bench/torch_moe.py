"""PyTorch reference for pipelines/moe-1b.toml on one GPU, written the way torchtitan's MoE is: the
same Llama-style mixture of experts (d1024, 16 layers, 16 query and 4 key/value heads, RoPE theta
500000, RMSNorm, no biases, tied embeddings, vocabulary 50304, T = 2048; every block's MLP 8 SwiGLU
experts of width 2816, each token to its best 2 by a softmax router with normalised gates, the
per-sequence load-balancing loss (0.01) and the router z-loss (0.001)), synthetic tokens, fp32
weights under bf16 autocast, every block torch.compile'd, the experts as torch._grouped_mm over the
tokens sorted by expert (each expert's rows padded to a multiple of 16, as torchtitan's
indices_padding_wrapper does), fused AdamW, gradient clipping at 1.0. Prints and writes (--out) the
median tokens/s and ms/step of the last three quarters of the steps, and the peak memory
(torch.cuda.max_memory_allocated, which excludes the CUDA context as kiln's figure does).

    python3 bench/torch_moe.py --batch 8 --steps 30 --out torch-moe.json
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_llama import REAL_VOCAB, VOCAB, RMSNorm, Rope  # the same RMSNorm and RoPE as the dense reference

ALIGN = 16  # torch._grouped_mm's row alignment per group


class MoE(nn.Module):
    """Router (softmax top-k, normalised gates), tokens sorted by expert, grouped SwiGLU experts,
    outputs weighted by the gates; the load-balancing loss (per sequence) and z-loss returned."""

    def __init__(self, d, ffn, experts, top_k, seq, aux_coeff, z_coeff):
        super().__init__()
        self.e, self.k, self.seq = experts, top_k, seq
        self.aux_coeff, self.z_coeff = aux_coeff, z_coeff
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, ffn, d))  # gate
        self.w3 = nn.Parameter(torch.empty(experts, ffn, d))  # up
        self.w2 = nn.Parameter(torch.empty(experts, d, ffn))  # down

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        n = x.shape[0]
        logits = self.router(x).float()
        probs = F.softmax(logits, dim=-1)
        gates, experts = torch.topk(probs, self.k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        # The load-balancing loss per sequence (f: the share of its choices, P: its mean probability)
        # and the z-loss, as kiln's router computes them.
        seqs = n // self.seq
        onehot = F.one_hot(experts.view(seqs, self.seq * self.k), self.e).float()
        f = onehot.mean(1)
        P = probs.view(seqs, self.seq, self.e).mean(1)
        aux = self.aux_coeff * self.e * (f * P).sum(-1).mean()
        z = self.z_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
        # Tokens sorted by expert, each expert's rows padded to a multiple of ALIGN (padding rows
        # point at a zero row appended to x).
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = onehot.sum((0, 1)).long()  # choices per expert (bincount's size would depend on the data)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        starts = torch.cumsum(padded, 0) - padded
        rank = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        slot = starts[flat[order]] + rank  # where each sorted choice lands among the padded rows
        total = flat.numel() + self.e * (ALIGN - 1)  # an upper bound, static for the compiler
        src = torch.full((total,), n, dtype=torch.long, device=x.device)
        src[slot] = order // self.k
        xz = torch.cat((x, x.new_zeros(1, d)))
        xs = xz[src].to(torch.bfloat16)
        offs = torch.cumsum(padded, 0).to(torch.int32)
        h = F.silu(torch._grouped_mm(xs, self.w1.to(torch.bfloat16).transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xs, self.w3.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        ys = torch._grouped_mm(h, self.w2.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        # Back to the choices, weighted by the gates, summed per token.
        y = ys[slot].float() * gates.view(-1)[order].unsqueeze(1)
        out = torch.zeros(n, d, device=x.device, dtype=torch.float32).index_add_(0, order // self.k, y)
        return out.to(x.dtype).view(b, t, d), aux + z


class Block(nn.Module):
    def __init__(self, d, h, kv, ffn, experts, top_k, seq, eps, rope):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.norm_1 = RMSNorm(d, eps)
        self.qkv = nn.Linear(d, (h + 2 * kv) * self.hd, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm_2 = RMSNorm(d, eps)
        self.moe = MoE(d, ffn, experts, top_k, seq, 0.01, 0.001)
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
        m, loss = self.moe(self.norm_2(x))
        return x + m, loss


class MoeLlama(nn.Module):
    def __init__(self, d, layers, h, kv, ffn, experts, top_k, seq, theta, eps):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        rope = Rope(d // h, seq, theta)
        self.blocks = nn.ModuleList(Block(d, h, kv, ffn, experts, top_k, seq, eps, rope) for _ in range(layers))
        self.norm_f = RMSNorm(d, eps)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # kiln's init: residual projections scaled by 1/sqrt(2L) (Megatron)
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "w2")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx)
        router_loss = 0.0
        for blk in self.blocks:
            x, l = blk(x)
            router_loss = router_loss + l
        logits = F.linear(self.norm_f(x), self.wte.weight)  # tied LM head
        ce = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return ce, ce + router_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = MoeLlama(1024, args.layers, 16, 4, 2816, 8, 2, args.seq, 500000.0, 1e-5).cuda()
    params = sum(p.numel() for p in model.parameters())
    expert = 3 * 1024 * 2816
    active = params - args.layers * (8 - 2) * expert
    for blk in model.blocks:  # torchtitan compiles per block
        blk.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    times = []
    for step in range(args.steps):
        idx = torch.randint(0, REAL_VOCAB, (args.batch, args.seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step % 5 == 0:
            print(f"step {step} loss {ce.item():.4f} {1000 * times[-1]:.1f} ms", flush=True)
    steady = times[len(times) // 4:]
    ms = 1000 * statistics.median(steady)
    result = {"model": "moe-1b", "parameters": params, "active_parameters": active, "batch": args.batch,
              "seq": args.seq, "ms_per_step": ms, "tokens_per_s": args.batch * args.seq / (ms / 1000),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
