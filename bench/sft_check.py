#!/usr/bin/env python3
"""The fine-tuning benchmark's Hugging Face side (bench/gpu_sft.sh; run on the GPU machine, which has
transformers).

  make DIR VOCAB          a randomly initialised Llama 3.2 1B-shaped LlamaForCausalLM (d 2048, 16 layers,
                          32 query / 8 key-value heads, SwiGLU 8192, tied embeddings, rope_theta 500000 with
                          llama3 scaling) with a vocabulary of VOCAB, saved by save_pretrained in bf16
  loss DIR SHARD T        transformers' mean loss of DIR's model (bf16, on the GPU) over SHARD's windows of
                          T + 1 tokens (as kiln eval cuts them), only over the targets SHARD.mask trains on:
                          once with causal attention over each whole window, once with each document of a
                          window run as a sequence of its own (what attention within documents computes);
                          prints one JSON line
"""
import json
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make(path, vocab):
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=vocab, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


def read_shard(path):
    head = np.fromfile(path, dtype=np.int32, count=256)
    dtype = np.uint16 if head[0] == 20240520 else np.uint32
    tokens = np.fromfile(path, dtype=dtype, offset=1024, count=int(head[2])).astype(np.int64)
    flags = np.fromfile(path[:-4] + ".mask", dtype=np.uint8, offset=1024)
    assert len(flags) == len(tokens), (len(flags), len(tokens))
    return tokens, flags


def loss(path, shard, T):
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()
    tokens, flags = read_shard(shard)
    sums = {"across": 0.0, "within": 0.0}
    counted = 0
    with torch.no_grad():
        for first in range(0, len(tokens) - T, T):
            win, fl = tokens[first:first + T + 1], flags[first:first + T + 1]
            trained = torch.tensor((fl[1:] & 1) > 0, device="cuda")
            targets = torch.tensor(win[1:], device="cuda")
            counted += int(trained.sum())
            ids = torch.tensor(win[:T], device="cuda")[None]
            logits = model(ids).logits[0].float()
            sums["across"] += float(torch.nn.functional.cross_entropy(logits[trained], targets[trained], reduction="sum"))
            # Each document on its own: split where the mask marks a document's first token (bit 1).
            starts = [0] + [t for t in range(1, T) if fl[t] & 2]
            parts = []
            for a, b in zip(starts, starts[1:] + [T]):
                parts.append(model(ids[:, a:b]).logits[0].float())
            logits = torch.cat(parts)
            sums["within"] += float(torch.nn.functional.cross_entropy(logits[trained], targets[trained], reduction="sum"))
    print(json.dumps({k: v / counted for k, v in sums.items()} | {"targets": counted}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]))
    else:
        loss(sys.argv[2], sys.argv[3], int(sys.argv[4]))
