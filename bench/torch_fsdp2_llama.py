"""PyTorch FSDP2 reference for pipelines/llama-8b.toml (issue 25), written the way torchtitan trains
Llama 3 8B: the Llama of bench/torch_llama.py in Llama 3 8B's shape (d4096, 32 layers, 32 query and
8 key/value heads, SwiGLU 14336, RoPE theta 500000, RMSNorm, no biases, untied embeddings,
vocabulary 50304, T = 2048), built on the meta device and materialised shard by shard (deferred
init), every block activation-checkpointed (--ac full; --ac none keeps the activations), then
torch.compile'd, then fully_shard'ed, and the root fully_shard'ed, with bf16 parameters and fp32
gradient reduction; fused AdamW, gradient clipping at 1.0, synthetic tokens. Prints and writes
(--out) the median tokens/s per GPU and ms/step of the last three quarters of the steps, and the
peak memory per GPU: torch.cuda.max_memory_allocated (the tensors alone), max_memory_reserved
(what the caching allocator held), and peak_device_gib, measured as kiln measures its own: the drop
in cudaMemGetInfo's free memory from just after the CUDA context was made, highest at a step end
(so NCCL's buffers, cuBLAS's workspaces and the allocator's reserve count, as they do for kiln).

    torchrun --standalone --nproc_per_node 2 bench/torch_fsdp2_llama.py --batch 4 --steps 20
    torchrun --standalone --nproc_per_node 1 bench/torch_fsdp2_llama.py --layers 4   # a smoke test
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torch_llama import REAL_VOCAB, VOCAB, Block, RMSNorm, Rope

D, HEADS, KV, FFN, THETA, EPS = 4096, 32, 8, 14336, 500000.0, 1e-5


class Llama(nn.Module):
    def __init__(self, layers, seq, ac):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.rope = Rope(D // HEADS, seq, THETA)
        blocks = [Block(D, HEADS, KV, FFN, EPS, self.rope) for _ in range(layers)]
        self.blocks = nn.ModuleList(checkpoint_wrapper(b) if ac else b for b in blocks)
        self.norm_f = RMSNorm(D, EPS)
        self.head = nn.Linear(D, VOCAB, bias=False)  # untied, as Llama 3 8B

    def forward(self, idx, targets):
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def init_shards(model, layers, seq):
    """kiln's init on each rank's shard: normal(0.02), residual projections scaled by 1/sqrt(2L)
    (Megatron), RMSNorm weights 1; RoPE's tables recomputed (to_empty left them undefined)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)
        fresh = Rope(D // HEADS, seq, THETA).cuda()
        model.rope.cos.copy_(fresh.cos)
        model.rope.sin.copy_(fresh.sin)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ac", choices=("full", "none"), default="full")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    free_at_start = torch.cuda.mem_get_info()[0]  # the context exists now; nothing else is allocated
    peak_device = 0
    torch.manual_seed(1337 + rank)
    with torch.device("meta"):
        model = Llama(args.layers, args.seq, args.ac == "full")
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:  # torchtitan's order: activation checkpointing, compile, fully_shard
        blk.compile()
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    init_shards(model, args.layers, args.seq)
    start_gib = torch.cuda.memory_allocated() / 2**30
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    times = []
    for step in range(args.steps):
        idx = torch.randint(0, REAL_VOCAB, (args.batch, args.seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak_device = max(peak_device, free_at_start - torch.cuda.mem_get_info()[0])
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} {1000 * times[-1]:.1f} ms", flush=True)
    steady = times[len(times) // 4:]
    ms = 1000 * statistics.median(steady)
    result = {"model": f"llama-8b shape, {args.layers} layers", "parameters": params, "gpus": world,
              "batch_per_gpu": args.batch, "seq": args.seq, "ac": args.ac, "ms_per_step": ms,
              "tokens_per_s_per_gpu": args.batch * args.seq / (ms / 1000),
              "weights_at_start_gib": start_gib, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "peak_device_gib": peak_device / 2**30}
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
