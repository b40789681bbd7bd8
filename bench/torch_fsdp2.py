"""PyTorch FSDP2 reference for bench/gpu_fsdp.sh: the same GPT-2 shapes as kiln's benchmark pipelines
(124M: d768 L12 H12; 1.3B: d2048 L24 H16; vocabulary 50304, T = 1024), synthetic tokens,
fully_shard per block and at the root with bf16 parameters and fp32 gradient reduction, each block
torch.compile'd, fused AdamW, gradient clipping at 1.0. Prints and writes (--out) the median tokens/s
per GPU and ms/step of the last three quarters of the steps, and the peak memory per GPU
(torch.cuda.max_memory_allocated, which excludes the CUDA context as kiln's figure does).

    torchrun --standalone --nproc_per_node N bench/torch_fsdp2.py --model 1.3b --batch 8 --steps 20
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

SHAPES = {"124m": (768, 12, 12), "1.3b": (2048, 24, 16)}
VOCAB, T = 50304, 1024


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=SHAPES, default="124m")
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(1337)
    d, layers, heads = SHAPES[args.model]
    with torch.device("meta"):
        model = GPT(d, layers, heads)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        blk.compile()
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    for name, p in model.named_parameters():  # deferred init, on each rank's shard
        with torch.no_grad():
            if p.dim() == 2:
                p.normal_(0.0, 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)
            elif "ln" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    times = []
    for step in range(args.steps):
        idx = torch.randint(0, 50257, (args.batch, T + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} {1000 * times[-1]:.1f} ms", flush=True)
    steady = times[len(times) // 4:]
    ms = 1000 * statistics.median(steady)
    result = {"model": args.model, "gpus": world, "batch_per_gpu": args.batch, "ms_per_step": ms,
              "tokens_per_s_per_gpu": args.batch * T / (ms / 1000),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
