"""Triton kernels on the GPU against the PyTorch path, one case per process (an illegal
memory access ends its process, not the cases after it): FAVOR+ in float32 and bfloat16,
causal and not, one and three segments; the band kernel in float64 with each tile the
launcher may pick. One line per case. `bash scripts/gpu_check.sh` runs it first.

    python scripts/gpu_diag_triton.py          # every case
    python scripts/gpu_diag_triton.py 7        # case 7 alone
"""

from __future__ import annotations

import subprocess
import sys

FAVOR = [(256, 64, dtype, seg, causal) for dtype in ("float32", "bfloat16") for seg in (1, 3) for causal in (True, False)]
BAND = [(width, seg, causal, tile) for width, seg, causal in ((16, 1, True), (16, None, True), (8, 1, True), (16, 1, False), (16, None, False))
        for tile in ((16, 32, 1),)]  # every tile gave the same float64 error on an H200 (its cause was not the tile)
CASES = [("favor", c) for c in FAVOR] + [("band", c) for c in BAND]


def favor_case(m, D, dtype, seg, causal):
    import torch

    from flt.ops.features import gaussian_orthogonal_random_matrix
    from flt.ops.triton import favor_attention, favor_attention_torch

    torch.manual_seed(0)
    xq, xk = (0.3 * torch.randn(1, 2, 1000, D, device="cuda") for _ in range(2))
    v = torch.randn(1, 2, 1000, D, device="cuda")
    w = gaussian_orthogonal_random_matrix(m, D, device="cuda")
    ref = favor_attention_torch(xq.double(), xk.double(), v.double(), w.double(), causal=causal).float()
    t = getattr(torch, dtype)
    out = favor_attention(xq.to(t), xk.to(t), v.to(t), w, causal=causal, segments=seg)
    torch.cuda.synchronize()
    return f"rel err {float((out.float() - ref).norm() / ref.norm()):.2e}"


def band_case(width, seg, causal, tile):
    import torch

    import flt.ops.triton.band as band
    from flt.ops.features import gaussian_orthogonal_random_matrix

    band.tile_candidates = lambda *args: [tile]  # this tile alone
    torch.manual_seed(0)
    F = torch.float64
    B, H, N, D, E, m = 2, 2, 333, 32, 16, 64
    xq, xk = (0.5 * torch.randn(B, H, N, D, dtype=F, device="cuda") for _ in range(2))
    v = torch.randn(B, H, N, 32, dtype=F, device="cuda")
    a, c = (0.3 * torch.randn(1, H, N, E, dtype=F, device="cuda") for _ in range(2))
    w = gaussian_orthogonal_random_matrix(m, D + E, dtype=F, device="cuda")
    bias = torch.randn(1, H, N, 2 * width + 1, dtype=F, device="cuda")
    kw = {"width": width, "extra_q": a, "extra_k": c, "causal": causal}
    out = band.band_attention(xq, xk, v, w, bias, segments=seg, **kw)
    ref = band.band_attention_torch(xq, xk, v, w, bias, **kw)
    return f"max abs {float((out - ref).abs().max()):.2e}"


def main(argv: list[str]) -> None:
    if argv:
        kind, case = CASES[int(argv[0])]
        try:
            result = (favor_case if kind == "favor" else band_case)(*case)
        except Exception as err:  # noqa: BLE001 (the error is the case's result)
            result = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        print(f"{kind} {case}: {result}", flush=True)
        return
    for i in range(len(CASES)):
        done = subprocess.run([sys.executable, __file__, str(i)], capture_output=True, text=True, timeout=60)
        line = done.stdout.strip().splitlines()[-1:] or [f"{CASES[i]}: no output, exit {done.returncode}: {done.stderr.strip()[-160:]}"]
        print(line[0], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
