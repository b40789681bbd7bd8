"""PyTorch reference for kiln's pipeline stages: the Llama of pipelines/llama-1b.toml (d2048, 16
layers, 32 query and 8 key/value heads, SwiGLU 8192, untied LM head, vocabulary 50304, T = 2048;
the blocks of bench/torch_llama.py) split into pp x vpp stages with torch.distributed.pipelining
(PipelineStage; Schedule1F1B for vpp = 1, ScheduleInterleaved1F1B above), each rank's stages
torch.compile'd, fp32 weights under bf16 autocast, fused AdamW per rank. Prints and writes (--out)
the median tokens/s (all GPUs) and ms/step of the last three quarters of the steps and the peak
memory per GPU.

    torchrun --nproc_per_node 2 bench/torch_pipeline.py --vpp 2 --batch 8 --microbatches 8 --out torch-pp.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

sys.path.insert(0, os.path.dirname(__file__))
from torch_llama import VOCAB, REAL_VOCAB, Block, RMSNorm, Rope  # noqa: E402


class Stage(nn.Module):
    """Blocks [first, last) of the model, with the embedding before block 0 and the head after the last."""

    def __init__(self, first, last, layers, seq, compile_blocks):
        super().__init__()
        d, h, kv, ffn, theta, eps = 2048, 32, 8, 8192, 500000.0, 1e-5
        rope = Rope(d // h, seq, theta)
        self.wte = nn.Embedding(VOCAB, d) if first == 0 else None
        self.blocks = nn.ModuleList(Block(d, h, kv, ffn, eps, rope) for _ in range(first, last))
        self.norm_f = RMSNorm(d, eps) if last == layers else None
        self.head = nn.Linear(d, VOCAB, bias=False) if last == layers else None
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
        self.run_blocks = torch.compile(self._blocks) if compile_blocks else self._blocks

    def _blocks(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if self.wte is not None:
                x = self.wte(x)
            x = self.run_blocks(x)
            if self.head is not None:
                x = self.head(self.norm_f(x))
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rank, pp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    S = pp * args.vpp
    per = args.layers // S
    stages, modules = [], []
    for c in range(args.vpp):
        v = c * pp + rank
        m = Stage(v * per, (v + 1) * per, args.layers, args.seq, not args.eager).to(dev)
        modules.append(m)
        stages.append(PipelineStage(m, v, S, dev))
    loss_fn = lambda logits, target: F.cross_entropy(logits.float().view(-1, VOCAB), target.reshape(-1))
    if args.vpp == 1:
        schedule = Schedule1F1B(stages[0], args.microbatches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    holds_first = any(s.stage_index == 0 for s in stages)
    holds_last = any(s.stage_index == S - 1 for s in stages)
    times = []
    for step in range(args.steps):
        idx = torch.randint(0, REAL_VOCAB, (args.batch, args.seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        losses = []
        kwargs = {}
        if holds_last:
            kwargs = {"target": idx[:, 1:].contiguous(), "losses": losses}
        if holds_first:
            schedule.step(idx[:, :-1].contiguous(), **kwargs)
        else:
            schedule.step(**kwargs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rank == pp - 1 and step % 5 == 0:
            print(f"step {step} loss {torch.stack(losses).mean().item():.4f} {1000 * times[-1]:.1f} ms", flush=True)
    steady = times[len(times) // 4:]
    ms = 1000 * statistics.median(steady)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {"model": "llama-1b untied", "pp": pp, "vpp": args.vpp, "batch": args.batch,
                  "microbatches": args.microbatches, "seq": args.seq, "compiled": not args.eager, "ms_per_step": ms,
                  "tokens_per_s": args.batch * args.seq / (ms / 1000), "peak_gib_per_gpu": peak.item()}
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
