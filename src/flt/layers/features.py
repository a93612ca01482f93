"""Feature-map modules: they own the random projection buffer and call :mod:`flt.ops.features`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.ops import features as ops

#: The kernel feature maps by the name ``feature_map`` takes.
FEATURE_MAPS = ("favor+", "relu", "elu", "taylor", "hedgehog")
#: The maps with no random projection: their features are a function of the input (and of
#: learned parameters) alone.
DETERMINISTIC_MAPS = ("elu", "taylor", "hedgehog")


class FeatureMap(nn.Module):
    """Nonnegative features ``phi(x)``: ``[..., N, D] -> ([..., N, m], log_scale [..., N] or None)``.

    ``"favor+"`` (default) estimates the softmax kernel ``exp(x.y)`` without bias (Performer);
    ``phi(x) = feat * exp(log_scale)``. ``"relu"`` (ReLU random features, estimating the
    arc-cosine kernel), ``"elu"`` (``elu + 1``, ``m = D``) and ``"taylor"`` (the second-order
    Taylor expansion of ``exp(x.y)``, ``1 + x.y + (x.y)^2 / 2``, ``m = 1 + D + D(D+1)/2``) and
    ``"hedgehog"`` (``[softmax(W x), softmax(-W x)]`` with a learned ``W [m/2, D]``, initialised
    to the identity when ``m = 2D``; :func:`flt.ops.features.hedgehog_features`) do not
    estimate ``exp(x.y)``; the last three are deterministic (no random projection, no draw).

    Args:
        dim: input dimension ``D``.
        num_features: ``m`` (ignored by the deterministic ``"elu"`` and ``"taylor"``; even for
            ``"hedgehog"``).
        kind: one of :data:`FEATURE_MAPS`.
        orthogonal: orthogonal random blocks (lower variance).
        seed: seeds the projection; ``None`` uses torch's global generator.

    The projection is a persistent buffer. It changes only through
    :meth:`redraw_random_features`, the protocol of :mod:`flt.layers.draws` (which the
    trainer's ``redraw_interval`` and a layer's ``redraw_interval`` both go through).
    """

    #: Names of the buffers that hold the draws (:mod:`flt.layers.draws`).
    random_feature_buffers = ("projection",)

    def __init__(
        self,
        dim: int,
        num_features: int = 256,
        *,
        kind: str = "favor+",
        orthogonal: bool = True,
        seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("num_features", num_features)
        check_choice("feature_map", kind, FEATURE_MAPS)
        self.dim, self.kind, self.orthogonal = dim, kind, orthogonal
        self.num_features = {"elu": dim, "taylor": 1 + dim + dim * (dim + 1) // 2}.get(kind, num_features)
        self._generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        self.weight: nn.Parameter | None = None
        self.projection: torch.Tensor | None  # a buffer: None for the deterministic maps
        if kind == "hedgehog":
            if num_features % 2:
                raise ValueError(f"num_features must be even for feature_map='hedgehog' (two softmax halves), got {num_features}")
            self.weight = nn.Parameter(self._hedgehog_init(num_features // 2, dim, device=device, dtype=dtype))
        if kind in DETERMINISTIC_MAPS:
            self.register_buffer("projection", None)
        else:
            proj = ops.gaussian_orthogonal_random_matrix(
                num_features, dim, orthogonal=orthogonal, generator=self._generator, device=device, dtype=torch.float32
            )
            # Kept in float32 or better whatever the module dtype: it feeds an exponential.
            self.register_buffer("projection", proj if dtype != torch.float64 else proj.double())

    def _hedgehog_init(self, rows: int, dim: int, *, device: torch.device | str | None,
                       dtype: torch.dtype | None) -> torch.Tensor:
        """The identity where ``m/2 = D`` (the softmax halves then start as ``softmax(+-x)``),
        else orthogonal rows of unit norm, seeded like the random projections."""
        if rows == dim:
            return torch.eye(dim, device=device, dtype=dtype)
        w = ops.gaussian_orthogonal_random_matrix(rows, dim, generator=self._generator, dtype=torch.float64)
        return (w / w.norm(dim=-1, keepdim=True)).to(device=device, dtype=dtype or torch.get_default_dtype())

    @property
    def has_random_features(self) -> bool:
        """False for the deterministic maps (no projection)."""
        return self.projection is not None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Checkpoints written before the redraw protocol hold a forward-call counter here.
        state_dict.pop(prefix + "calls", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FeatureMap:
        # The projection stays in float32 or float64 when the module is cast to half types.
        super()._apply(fn, recurse)
        if self.projection is not None and self.projection.dtype in (torch.float16, torch.bfloat16):
            self.projection = self.projection.float()
        return self

    @torch.no_grad()
    def redraw_random_features(self, generator: torch.Generator | None = None) -> None:
        """Draw a new random projection in place (float64 on the CPU, then copied).

        ``generator``: a CPU generator; ``None`` uses the module's own (from ``seed``) or
        torch's global generator. Nothing to do for the deterministic maps.
        """
        if self.projection is None:
            return
        new = ops.gaussian_orthogonal_random_matrix(
            self.num_features, self.dim, orthogonal=self.orthogonal,
            generator=self._generator if generator is None else generator, dtype=torch.float64,
        )
        self.projection.copy_(new)

    def _drawn(self) -> torch.Tensor:
        """The projection of a random map (``"favor+"``, ``"relu"``), which always has one."""
        assert self.projection is not None  # a buffer for every kind but DETERMINISTIC_MAPS
        return self.projection

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "favor+":
            return ops.favor_plus_features(x, self._drawn())
        if self.kind == "relu":
            return ops.relu_features(x, self._drawn()), None
        if self.kind == "taylor":
            return ops.taylor_features(x), None
        if self.kind == "hedgehog":
            assert self.weight is not None  # built for kind="hedgehog"
            return ops.hedgehog_features(x, self.weight), None
        return ops.elu_features(x), None

    def exact_kernel(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor | None:
        """The kernel these features estimate, ``[..., N, Nk]``, or None for ``"favor+"``
        (its kernel ``exp(xq.xk)`` is the reference's logits): ``"relu"`` the arc-cosine
        kernel :func:`flt.ops.features.relu_kernel` (the features' mean over projections),
        ``"elu"``, ``"taylor"`` and ``"hedgehog"`` their own deterministic ``phi(xq).phi(xk)``."""
        if self.kind == "favor+":
            return None
        if self.kind == "relu":
            return ops.relu_kernel(xq, xk)
        if self.kind == "taylor":
            return ops.taylor_kernel(xq, xk)  # without its D^2 features
        return self(xq)[0] @ self(xk)[0].transpose(-1, -2)

    def forward_split(self, x: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FAVOR+ features of ``[x, extra]`` without the concatenation:
        ``x [B, H, N, D1], extra [B or 1, H, N, D2]`` with ``D1 + D2 = dim``
        (:func:`flt.ops.features.favor_plus_features_split`). ``"favor+"`` only."""
        if self.kind != "favor+":
            raise ValueError(f"forward_split needs feature_map='favor+', this map is {self.kind!r}")
        return ops.favor_plus_features_split(x, extra, self._drawn())

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_features={self.num_features}, kind={self.kind!r}"
