"""Kernel feature maps for linear attention (docs/math.md section 2).

Pure functions: the random projection is an argument, drawn by
:func:`gaussian_orthogonal_random_matrix` and kept as a buffer by the layer that owns it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flt._checks import check_positive_int, check_tensor
from flt._dtype import compute_dtype


def gaussian_orthogonal_random_matrix(
    num_features: int,
    dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Draw the ``[m, D]`` FAVOR+ projection.

    With ``orthogonal=True`` the rows come in blocks of ``D`` mutually orthogonal rows
    (QR of Gaussian blocks) rescaled to norms drawn from chi(D), so every row is still
    marginally N(0, I) and the estimator stays unbiased, with lower variance.
    """
    check_positive_int("num_features", num_features)
    check_positive_int("dim", dim)
    dtype = dtype or torch.get_default_dtype()
    # Drawn in float64 on the CPU so a seed gives the same matrix on every device.
    gauss = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    if not orthogonal:
        return gauss(num_features, dim).to(device=device, dtype=dtype)
    count = math.ceil(num_features / dim)
    # One [count, D, D] draw and one batched QR. torch's CPU generator fills a tensor whose
    # size is a multiple of 16 exactly as it fills the same numbers block after block, and the
    # batched QR factors each block as a QR of it alone does: when D^2 is such a size the
    # matrix is bit for bit the block-by-block one. Other D draw and factor block by block,
    # so that a seed keeps its matrix for every D.
    if dim * dim % 16 == 0:
        qmat, rmat = torch.linalg.qr(gauss(count, dim, dim))
    else:
        factors = [torch.linalg.qr(gauss(dim, dim)) for _ in range(count)]
        qmat, rmat = torch.stack([q for q, _ in factors]), torch.stack([r for _, r in factors])
    qmat = qmat * torch.sign(torch.diagonal(rmat, dim1=-2, dim2=-1)).unsqueeze(-2)  # unique Haar-distributed Q
    rows = qmat.transpose(-1, -2).reshape(count * dim, dim)[:num_features]
    norms = gauss(num_features, dim).norm(dim=1, keepdim=True)
    return (rows * norms).to(device=device, dtype=dtype)


def favor_plus_features(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FAVOR+ positive random features with a per-token stabiliser.

    ``phi(x) = m^(-1/2) exp(W x - |x|^2 / 2)`` so that ``E[phi(x).phi(y)] = exp(x.y)``.
    The caller scales the inputs (``x = q / D^(1/4)`` gives the softmax kernel).

    Each token's exponent is shifted by its own maximum ``s`` over the ``m`` features:
    the function returns ``(feat, s)`` with ``phi(x) = feat * exp(s)``. For queries ``s``
    cancels in the attention ratio and can be dropped; for keys pass it to the attention
    op as ``key_log_scale``, which rescales with a global max (bidirectional) or a running
    max over past keys only (causal), so no output ever depends on a future key.

    Peer convention (checked in ``tests/library/test_peers.py``): performer-pytorch's
    ``softmax_kernel`` scales by ``D^(-1/4)`` itself, shifts queries by the max of ``W x``
    and keys by one global max, and adds ``eps = 1e-4`` to every feature. The shifts cancel;
    the ``eps`` biases the kernel and, with the global key max, lets future keys change
    past outputs in causal mode. flt adds no ``eps``.

    Args:
        x: ``[..., N, D]``.
        projection: ``[m, D]``.

    Returns:
        ``feat [..., N, m]`` in float32 or better, ``s [..., N]`` (detached).
    """
    check_tensor("x", x)
    check_tensor("projection", projection, ndim=2, layout="[m, D]")
    if projection.shape[1] != x.shape[-1]:
        raise ValueError(f"projection has D = {projection.shape[1]} but x has last dimension {x.shape[-1]}")
    cdt = compute_dtype(x)
    x = x.to(cdt)
    half_sq = 0.5 * (x * x).sum(dim=-1, keepdim=True)
    return _exponentiate(x @ projection.to(cdt).T, half_sq, cdt)


def _exponentiate(proj: torch.Tensor, half_sq: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``m^(-1/2) exp(proj - half_sq - shift)`` in place, and the shift.

    One ``[..., N, m]`` tensor, written by the matmul and exponentiated in place: the
    per-token terms (``|x|^2 / 2``, the shift, ``log m^(1/2)``) are folded into one
    ``[..., N, 1]`` offset, so the large tensor sees three passes and no temporaries. The
    offset's value is ``max_k (W x)_k + log m^(1/2)``; its gradient is that of ``|x|^2 / 2``
    (the shift is a constant), so ``d feat / dx = feat (W - x)`` as for the unfused formula.
    Under autocast the product arrives in bfloat16 / float16 and is widened to ``cdt``
    (float32) first: the exponential never runs in a half type.
    """
    if proj.dtype != cdt:
        proj = proj.to(cdt)
    top = proj.detach().amax(dim=-1, keepdim=True)
    shift = (top - half_sq.detach()).squeeze(-1)
    offset = half_sq + (shift.unsqueeze(-1) + 0.5 * math.log(proj.shape[-1]))
    feat = proj.sub_(offset).exp_()
    return feat, shift


def favor_plus_features_split(x: torch.Tensor, extra: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`favor_plus_features` of ``[x, extra]`` (concatenated on the last dimension)
    without forming the concatenation.

    The projection splits into the block ``W_x`` acting on ``x`` and ``W_e`` acting on
    ``extra``: ``W [x, e] = W_x x + W_e e`` and ``|[x, e]|^2 = |x|^2 + |e|^2``. ``W_e e`` is
    computed once for the ``B or 1`` rows of ``extra`` (the positional features ``a(r)``
    are shared by the batch), and ``W_x x`` is accumulated into it (in place when it
    already has the batch's size), so the only ``[..., N, m]`` tensor is the result.

    Args:
        x: ``[B, H, N, D]``.
        extra: ``[B or 1, H, N, E]``.
        projection: ``[m, D + E]``.

    Returns:
        ``(feat [B, H, N, m], s [B, H, N])``, equal to
        ``favor_plus_features(torch.cat([x, extra.expand(B, H, N, E)], -1), projection)``.
    """
    check_tensor("x", x, ndim=4, layout="[B, H, N, D]")
    check_tensor("extra", extra, ndim=4, layout="[B or 1, H, N, E]")
    check_tensor("projection", projection, ndim=2, layout="[m, D + E]")
    B, H, N, D = x.shape
    if extra.shape[0] not in (1, B) or extra.shape[1:3] != (H, N):
        raise ValueError(f"extra must be [B or 1, H, N, E] = [{B} or 1, {H}, {N}, E], got {tuple(extra.shape)}")
    if projection.shape[1] != D + extra.shape[-1]:
        raise ValueError(f"projection has {projection.shape[1]} columns but x and extra have {D} + {extra.shape[-1]}")
    cdt = compute_dtype(x, extra)
    x, extra, w = x.to(cdt), extra.to(cdt), projection.to(cdt)
    m = w.shape[0]
    half_sq = 0.5 * ((x * x).sum(dim=-1, keepdim=True) + (extra * extra).sum(dim=-1, keepdim=True))
    # Everything on [B or 1, H * N, ...] tensors that autograd sees as bases, not views:
    # an in-place op on a view would make the backward copy the whole gradient through
    # as_strided. The matmul of a 3-D tensor with a 2-D one returns a fresh tensor.
    E, x3 = extra.shape[-1], x.reshape(B, H * N, D)
    pe = extra.reshape(extra.shape[0], H * N, E) @ w[:, D:].T  # [B or 1, H N, m]
    wx = w[:, :D].T.expand(B, D, m)
    if pe.shape[0] == B and not torch.is_autocast_enabled(x.device.type):
        proj = pe.baddbmm_(x3, wx)
    else:  # pe broadcast over the batch (or an autocast dtype): one new tensor
        proj = torch.baddbmm(pe, x3, wx)
    feat, shift = _exponentiate(proj, half_sq.reshape(B, H * N, 1), cdt)
    return feat.view(B, H, N, m), shift.view(B, H, N)


def relu_features(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """ReLU random features ``m^(-1/2) relu(W x)``: ``[..., N, D] -> [..., N, m]``.

    A deterministic-given-W nonnegative map; not an estimator of the softmax kernel.
    """
    check_tensor("x", x)
    check_tensor("projection", projection, ndim=2, layout="[m, D]")
    cdt = compute_dtype(x)
    return F.relu(x.to(cdt) @ projection.to(cdt).T) * (projection.shape[0] ** -0.5)


def relu_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What :func:`relu_features` estimate: ``E_w[relu(w.x) relu(w.y)]`` for ``w ~ N(0, I)``,
    the arc-cosine kernel of order 1, ``|x| |y| (sin t + (pi - t) cos t) / (2 pi)`` with
    ``t`` the angle between ``x`` and ``y``: ``x [..., N, D], y [..., Nk, D] -> [..., N, Nk]``."""
    check_tensor("x", x)
    check_tensor("y", y)
    cdt = compute_dtype(x, y)
    x, y = x.to(cdt), y.to(cdt)
    nx, ny = x.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)
    norms = nx * ny.transpose(-1, -2)
    # The angle's derivative is infinite at cos = +-1: keep it just inside for gradients.
    tiny = 1e-7 if cdt == torch.float64 else 1e-4
    cos = (x @ y.transpose(-1, -2) / norms.clamp_min(torch.finfo(cdt).tiny)).clamp(-1 + tiny, 1 - tiny)
    t = torch.acos(cos)
    return norms * (torch.sqrt(1 - cos * cos) + (math.pi - t) * cos) / (2 * math.pi)


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """Deterministic second-order Taylor features of the exponential kernel:
    ``phi(x).phi(y) = 1 + x.y + (x.y)^2 / 2`` (:func:`taylor_kernel`), which is at least 1/2
    for every pair, so row sums stay positive. ``[..., N, D] -> [..., N, 1 + D + D(D+1)/2]``:
    a constant, ``x``, and the upper triangle of ``x x^T`` with the diagonal scaled by
    ``2^(-1/2)`` (``(x.y)^2 = sum_i x_i^2 y_i^2 + 2 sum_(i<j) x_i x_j y_i y_j``)."""
    check_tensor("x", x)
    x = x.to(compute_dtype(x))
    D = x.shape[-1]
    rows, cols = torch.triu_indices(D, D, device=x.device)
    weight = torch.ones(rows.shape, dtype=x.dtype, device=x.device)
    weight[rows == cols] = math.sqrt(0.5)  # in x's dtype (a float32 where() would round it for float64)
    quad = x[..., rows] * x[..., cols] * weight
    return torch.cat([torch.ones_like(x[..., :1]), x, quad], dim=-1)


def taylor_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 + x.y + (x.y)^2 / 2``, the kernel of :func:`taylor_features`:
    ``x [..., N, D], y [..., Nk, D] -> [..., N, Nk]``."""
    check_tensor("x", x)
    check_tensor("y", y)
    cdt = compute_dtype(x, y)
    u = x.to(cdt) @ y.to(cdt).transpose(-1, -2)
    return 1 + u + 0.5 * u * u


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Learned spiky features ``[softmax(W x), softmax(-W x)]`` (Hedgehog, Zhang et al. 2024):
    ``x [..., N, D], weight [m/2, D] -> [..., N, m]``, each half a softmax over its ``m/2``
    features, so every feature is positive and each half sums to 1.

    Deterministic given ``W``, a learned parameter (not a random draw). Its kernel
    ``phi(x).phi(y)`` grows sharp as ``W`` grows: with large ``|W x|`` each half tends to a
    one-hot of its arg max, and the kernel to the indicator that two inputs share it. That is
    the point of the map: an attention as peaked as softmax's with no estimate of ``exp(x.y)``.
    """
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=2, layout="[m/2, D]")
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"weight must be [m/2, {x.shape[-1]}] for inputs of dimension {x.shape[-1]}, got {tuple(weight.shape)}")
    cdt = compute_dtype(x)
    proj = x.to(cdt) @ weight.to(cdt).T
    return torch.cat([torch.softmax(proj, dim=-1), torch.softmax(-proj, dim=-1)], dim=-1)


def elu_features(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1`` (Katharopoulos et al.): ``[..., N, D] -> [..., N, D]``, strictly positive."""
    check_tensor("x", x)
    return F.elu(x.to(compute_dtype(x))) + 1.0
