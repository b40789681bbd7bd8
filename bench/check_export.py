"""Loads a `kiln export` file into a plain PyTorch GPT-2 (Hugging Face's names and Conv1D layouts,
read with json + struct, no safetensors package) and prints its loss on the first batch of an
llm.c token shard, in file order, beside kiln's loss on the same batch; exits 1 if they differ by
more than --tol (relative). With transformers installed, GPT2LMHeadModel.from_pretrained reads the
export too and must agree.

    python3 bench/check_export.py EXPORT_DIR SHARD.bin --batch 8 --seq 64 --kiln-loss 3.1234
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = bytearray(data[base + b:base + e])
        out[name] = torch.frombuffer(raw, dtype=DTYPES[t["dtype"]]).reshape(t["shape"]).float()
    return out


def gpt2_loss(w, cfg, idx, targets):
    """GPT-2's forward pass written out over the Hugging Face state dict."""
    h, d = cfg["n_head"], cfg["n_embd"]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    g = lambda k: w["transformer." + k]
    b, t = idx.shape
    x = g("wte.weight")[idx] + g("wpe.weight")[:t]
    for l in range(cfg["n_layer"]):
        p = f"h.{l}."
        a = F.layer_norm(x, (d,), g(p + "ln_1.weight"), g(p + "ln_1.bias"), eps)
        q, k, v = (a @ g(p + "attn.c_attn.weight") + g(p + "attn.c_attn.bias")).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + y @ g(p + "attn.c_proj.weight") + g(p + "attn.c_proj.bias")
        m = F.layer_norm(x, (d,), g(p + "ln_2.weight"), g(p + "ln_2.bias"), eps)
        m = F.gelu(m @ g(p + "mlp.c_fc.weight") + g(p + "mlp.c_fc.bias"), approximate="tanh")
        x = x + m @ g(p + "mlp.c_proj.weight") + g(p + "mlp.c_proj.bias")
    x = F.layer_norm(x, (d,), g("ln_f.weight"), g("ln_f.bias"), eps)
    logits = x @ g("wte.weight").T
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)).item()


def first_batch(shard, batch, seq):
    """kiln's windows in file order (data.shuffle = false): sample i is tokens [i*T, i*T + T]."""
    raw = open(shard, "rb").read()
    header = struct.unpack("<256i", raw[:1024])
    tokens = torch.frombuffer(bytearray(raw[1024:1024 + 2 * header[2]]), dtype=torch.int16).to(torch.int64) & 0xFFFF
    idx = torch.stack([tokens[i * seq:i * seq + seq] for i in range(batch)])
    tgt = torch.stack([tokens[i * seq + 1:i * seq + seq + 1] for i in range(batch)])
    return idx, tgt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("shard")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--kiln-loss", type=float, required=True)
    ap.add_argument("--tol", type=float, default=1e-2)
    args = ap.parse_args()
    cfg = json.load(open(args.export_dir + "/config.json"))
    w = read_safetensors(args.export_dir + "/model.safetensors")
    idx, tgt = first_batch(args.shard, args.batch, args.seq)
    with torch.no_grad():
        loss = gpt2_loss(w, cfg, idx, tgt)
    rel = abs(loss - args.kiln_loss) / abs(args.kiln_loss)
    print(f"plain PyTorch GPT-2 on the export: loss {loss:.5f}; kiln {args.kiln_loss:.5f}; relative difference {rel:.2e}")
    ok = math.isfinite(loss) and rel <= args.tol
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        print("transformers is not installed: GPT2LMHeadModel not checked")
    else:
        model = GPT2LMHeadModel.from_pretrained(args.export_dir).eval()
        with torch.no_grad():
            hf = model(idx, labels=None).logits
            hf_loss = F.cross_entropy(hf.view(-1, hf.shape[-1]), tgt.reshape(-1)).item()
        print(f"transformers GPT2LMHeadModel on the export: loss {hf_loss:.5f}")
        ok = ok and abs(hf_loss - loss) / abs(loss) <= 1e-4
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
