"""Peer implementations timed next to ours, when they are installed (optional imports).

Only packages that install from PyPI without CUDA wheels and leave torch alone qualify;
``performer-pytorch`` (lucidrains, FAVOR+) does with ``pip install --no-deps
performer-pytorch`` where its small dependencies (``local-attention``,
``axial-positional-embedding``, ``einops``) are present. A missing peer is reported as
skipped with the reason, never silently replaced.

Each peer has a builder with our constructor signature and a reference: the same
features through the quadratic formula, the analogue of ``layer.reference`` that the
benchmark checks before it times anything.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
from typing import Any

import torch
from einops import rearrange

#: Peer name -> (import name, distribution name).
PEERS = {"performer-pytorch": ("performer_pytorch", "performer-pytorch")}


def peer_status(name: str) -> tuple[bool, str]:
    """``(available, version or reason)`` without raising."""
    module, dist = PEERS[name]
    try:
        # Importing prints nothing, but building the causal module does (see build_peer).
        importlib.import_module(module)
    except ImportError as err:
        return False, f"not installed ({err}); try `pip install --no-deps {dist}`"
    return True, importlib.metadata.version(dist)


def build_peer(name: str, dim: int, heads: int, *, causal: bool = False, num_features: int = 256, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The peer's self-attention module, ``forward(x [B, N, dim]) -> [B, N, dim]``."""
    if name != "performer-pytorch":
        raise ValueError(f"unknown peer {name!r}; known: {sorted(PEERS)}")
    from performer_pytorch import SelfAttention

    # Its causal module prints a notice about a missing CUDA kernel (it has a CPU path).
    with contextlib.redirect_stdout(io.StringIO()):
        module = SelfAttention(dim, causal=causal, heads=heads, dim_head=dim // heads, nb_features=num_features)
    return module.to(dtype) if dtype is not None else module


def peer_reference(module: Any, x: torch.Tensor) -> torch.Tensor:
    """performer-pytorch's attention written as its quadratic formula, O(N^2).

    Its own feature map (``softmax_kernel``, stabilised by a per-query max and one max over
    all keys), then ``w = qf kf^T`` and ``out = w v / den``, with its definition of the
    causal denominator ``den_i = qf_i . (sum_(j <= i) kf_j + eps)``, ``eps = 1e-6``.
    """
    from performer_pytorch.performer_pytorch import softmax_kernel

    fast = module.fast_attention
    q, k, v = (rearrange(f(x), "b n (h d) -> b h n d", h=module.heads) for f in (module.to_q, module.to_k, module.to_v))
    qf = softmax_kernel(q, projection_matrix=fast.projection_matrix, is_query=True)
    kf = softmax_kernel(k, projection_matrix=fast.projection_matrix, is_query=False)
    w = qf @ kf.transpose(-1, -2)
    if fast.causal:
        w = w.tril()
        den = w.sum(-1, keepdim=True) + 1e-6 * qf.sum(-1, keepdim=True)
    else:
        den = w.sum(-1, keepdim=True)
    return module.to_out(rearrange((w @ v) / den, "b h n d -> b n (h d)"))
