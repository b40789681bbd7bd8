"""kiln against transformers on Hugging Face Llama directories (run on the GPU machine, which has
transformers): a randomly initialised LlamaForCausalLM (GQA, untied head, Llama 3.1's rope_scaling
with a short original context so every frequency band is used) saved with save_pretrained gives
the same loss in `kiln eval` as in transformers on the same tokens (f32 on the CPU backend to 1e-5,
bf16 on the GPU within bf16's tolerance); `kiln export` of it loads in transformers with the same
logits; tokenizer ids of kiln and of `tokenizers` are compared by the data tests, not here.
usage: python3 bench/hf_llama_check.py KILN_BINARY WORK_DIR
Prints one line per check and "hf_llama_check: N/N passed" last."""
import os
import re
import struct
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

kiln, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
results = []


def check(name, ok, detail):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def kiln_run(*args):
    p = subprocess.run([kiln, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def kiln_loss(model_dir, device, T):
    out = kiln_run("eval", model_dir, "--data", f"{work}/tokens.bin", "--seq-len", str(T), "--device", device)
    return float(re.search(r"loss ([0-9.]+)", out).group(1))


V, T, windows = 1000, 256, 8
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def make_config(rope_scaling):
    return LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=V, max_position_embeddings=4096, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       # Large weights make attention peaky: the loss then depends on RoPE's frequencies
                       # (with 0.02 a random model's attention is near uniform and hides them).
                       initializer_range=0.3, rope_scaling=rope_scaling)


cfg = make_config(SCALING)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).float().eval()
model.save_pretrained(f"{work}/hf32", safe_serialization=True)
LlamaForCausalLM.from_pretrained(f"{work}/hf32", torch_dtype=torch.bfloat16).save_pretrained(
    f"{work}/hf16", safe_serialization=True)

g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, V, (windows * T + 1,), generator=g)
with open(f"{work}/tokens.bin", "wb") as f:  # an llm.c shard: 256 int32 header, uint16 tokens
    f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
    f.write(tokens.to(torch.int16).numpy().astype("<u2").tobytes())


def hf_loss(m, device, dtype):
    m = m.to(device=device, dtype=dtype)
    total, n = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            x = tokens[w * T:(w + 1) * T + 1].to(device)
            logits = m(x[None, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], x[1:], reduction="sum").item()
            n += T
    return total / n


ref32 = hf_loss(model, "cpu", torch.float32)
# The same model with RoPE's plain frequencies: how far the scaling moves the loss (the check above
# must be finer than this to mean anything).
plain = LlamaForCausalLM(make_config(None)).float().eval()
plain.load_state_dict(model.state_dict())
plain32 = hf_loss(plain, "cpu", torch.float32)
print(f"rope scaling moves the f32 loss by {abs(plain32 - ref32) / ref32:.2e} relative")
got32 = kiln_loss(f"{work}/hf32", "cpu", T)
check("f32 loss, kiln eval (CPU) vs transformers (CPU f32)", abs(got32 - ref32) <= 1e-5 * ref32,
      f"kiln {got32:.7f} transformers {ref32:.7f} relative {abs(got32 - ref32) / ref32:.2e}")

ref16 = hf_loss(LlamaForCausalLM.from_pretrained(f"{work}/hf16", torch_dtype=torch.bfloat16), "cuda", torch.bfloat16)
got16 = kiln_loss(f"{work}/hf16", "cuda", T)
check("bf16 loss, kiln eval (GPU) vs transformers (GPU bf16)", abs(got16 - ref16) <= 1e-2 * ref16,
      f"kiln {got16:.5f} transformers {ref16:.5f} relative {abs(got16 - ref16) / ref16:.2e}")
got32_gpu = kiln_loss(f"{work}/hf32", "cuda", T)
check("f32 weights on the GPU (bf16 compute) vs transformers f32", abs(got32_gpu - ref32) <= 1e-2 * ref32,
      f"kiln {got32_gpu:.5f} transformers {ref32:.5f}")

# kiln export of the f32 directory (through kiln's name map both ways), sharded: same logits.
kiln_run("export", f"{work}/hf32", "-o", f"{work}/exported", "--max-shard-size", "2MB")
back = LlamaForCausalLM.from_pretrained(f"{work}/exported", torch_dtype=torch.float32).eval()
x = tokens[None, :T]
with torch.no_grad():
    a = model.to("cpu")(x).logits
    b = back(x).logits
diff = (a - b).abs().max().item()
n_files = len([f for f in os.listdir(f"{work}/exported") if f.endswith(".safetensors")])
check("kiln export loads in transformers with the same logits", diff == 0.0,
      f"max |logit difference| {diff:.3e}, {n_files} shard files")
rope = getattr(back.config, "rope_parameters", None) or back.config.rope_scaling
check("config round trip", rope["rope_type"] == "llama3" and rope.get("factor") == 8.0
      and back.config.num_key_value_heads == 2 and back.config.eos_token_id == 2,
      f"{rope}, kv heads {back.config.num_key_value_heads}")

print(f"hf_llama_check: {sum(results)}/{len(results)} passed")
