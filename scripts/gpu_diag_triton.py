"""Triton kernels on the GPU against the PyTorch path: bfloat16 (causal and not, one and three segments) and the band kernel in float64. Prints one line per case; `bash scripts/gpu_check.sh` runs it first."""
import torch
from flt.ops.features import gaussian_orthogonal_random_matrix
from flt.ops.triton import favor_attention, favor_attention_torch
from flt.ops.triton.band import band_attention, band_attention_torch

torch.manual_seed(0)
for m, D in ((64, 32), (256, 64)):
    xq, xk = (0.3 * torch.randn(1, 2, 1000, D, device="cuda") for _ in range(2))
    v = torch.randn(1, 2, 1000, D, device="cuda")
    w = gaussian_orthogonal_random_matrix(m, D, device="cuda")
    for causal in (True, False):
        r = favor_attention_torch(xq.double(), xk.double(), v.double(), w.double(), causal=causal).float()
        for dtype in (torch.float32, torch.bfloat16):
            for seg in (1, 3):
                out = favor_attention(xq.to(dtype), xk.to(dtype), v.to(dtype), w, causal=causal, segments=seg)
                torch.cuda.synchronize()
                print(f"favor m={m} D={D} {dtype} segments={seg} causal={causal}: rel err {float((out.float() - r).norm() / r.norm()):.2e}", flush=True)
F = torch.float64
for width, chunk, seg, causal in [(16, 16, 1, True), (16, 16, None, True), (8, 16, 1, True), (16, 16, 1, False), (16, 16, None, False)]:
    B, H, N, D, E, m = 2, 2, 333, 32, 16, 64
    xq, xk = (0.5 * torch.randn(B, H, N, D, dtype=F, device="cuda") for _ in range(2))
    v = torch.randn(B, H, N, 32, dtype=F, device="cuda")
    a, c = (0.3 * torch.randn(1, H, N, E, dtype=F, device="cuda") for _ in range(2))
    w = gaussian_orthogonal_random_matrix(m, D + E, dtype=F, device="cuda")
    bias = torch.randn(1, H, N, 2 * width + 1, dtype=F, device="cuda")
    try:
        out = band_attention(xq, xk, v, w, bias, width=width, extra_q=a, extra_k=c, causal=causal, chunk_size=chunk, segments=seg)
        ref = band_attention_torch(xq, xk, v, w, bias, width=width, extra_q=a, extra_k=c, causal=causal)
        print(f"band f64 width={width} segments={seg} causal={causal}: max abs {float((out - ref).abs().max()):.2e}", flush=True)
    except Exception as e:
        print(f"band f64 width={width} segments={seg} causal={causal}: {type(e).__name__}: {str(e)[:150]}", flush=True)
