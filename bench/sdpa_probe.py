"""PyTorch's causal SDPA (cuDNN and flash backends) at kiln's benchmark attention shapes, for comparison
with bench_attention. Run on the GPU machine: python3 bench/sdpa_probe.py (needs PyTorch)."""
import torch, time, glob, os, ctypes
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
print("cudnn libs:", glob.glob("/usr/local/cuda*/lib64/libcudnn.so*")[:3], glob.glob("/usr/lib/x86_64-linux-gnu/libcudnn.so*")[:3])
try:
    l = ctypes.CDLL("libcudnn.so.9"); l.cudnnGetVersion.restype=ctypes.c_size_t; print("default-path libcudnn.so.9 version", l.cudnnGetVersion())
except OSError as e: print("no libcudnn.so.9 on default path", e)
def bench(B,H,T,D,backend):
    q,k,v=[torch.randn(B,H,T,D,device='cuda',dtype=torch.bfloat16,requires_grad=True) for _ in range(3)]
    with sdpa_kernel(backend):
        o=F.scaled_dot_product_attention(q,k,v,is_causal=True); g=torch.randn_like(o)
        for _ in range(5): o=F.scaled_dot_product_attention(q,k,v,is_causal=True); o.backward(g)
        torch.cuda.synchronize()
        e=[torch.cuda.Event(enable_timing=True) for _ in range(3)]; n=20
        e[0].record()
        for _ in range(n): o=F.scaled_dot_product_attention(q,k,v,is_causal=True)
        e[1].record()
        for _ in range(n): o=F.scaled_dot_product_attention(q,k,v,is_causal=True); o.backward(g)
        e[2].record(); torch.cuda.synchronize()
    f=e[0].elapsed_time(e[1])/n; fb=e[1].elapsed_time(e[2])/n; b=fb-f
    fl=4*B*H*T*T*D/2
    print(f"{backend} B{B} H{H} T{T} D{D}: fwd {f:.3f} ms ({fl/f/1e9:.0f} TF/s) bwd {b:.3f} ms ({2.5*fl/b/1e9:.0f} TF/s)")
for be in [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]:
    for s in [(16,12,1024,64),(8,16,1024,128)]:
        try: bench(*s,be)
        except Exception as ex: print(be, s, "failed", ex)
