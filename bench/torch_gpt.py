"""PyTorch reference for pipelines/gpt2-124m.toml and pipelines/gpt-1.3b.toml on one GPU, to run in the
same call as kiln's rows: bench/torch_fsdp2.py's GPT-2 model (124M: d768 L12 H12; 1.3B: d2048 L24 H16;
vocabulary 50304, T = 1024, tied LM head, SDPA, tanh GELU), trained as bench/torch_llama.py trains
its Llama: fp32 weights under bf16 autocast, the whole model torch.compile'd, fused AdamW, gradient
clipping at 1.0, synthetic tokens. Prints and writes (--out) the median tokens/s and ms/step of the
last three quarters of the steps, and the peak memory (torch.cuda.max_memory_allocated).

    python3 bench/torch_gpt.py --model 1.3b --batch 8 --steps 20 --out torch-gpt-1.3b.json
"""
import argparse

import torch

from torch_fsdp2 import GPT, SHAPES, T
from torch_llama import train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=SHAPES, default="1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(*SHAPES[args.model]).cuda()
    train(model, f"gpt-{args.model}", args.batch, T, args.steps, args.out)


if __name__ == "__main__":
    main()
