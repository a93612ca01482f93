"""Feature-map modules: they own the random projection buffer and call :mod:`flt.ops.features`."""

from __future__ import annotations

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.ops.features import elu_features, favor_plus_features, gaussian_orthogonal_random_matrix, relu_features

FEATURE_MAPS = ("favor+", "relu", "elu")


class FeatureMap(nn.Module):
    """Nonnegative features ``phi(x)``: ``[..., N, D] -> ([..., N, m], log_scale [..., N] or None)``.

    ``"favor+"`` (default) estimates the softmax kernel ``exp(x.y)`` without bias (Performer);
    ``phi(x) = feat * exp(log_scale)``. ``"relu"`` (ReLU random features) and ``"elu"``
    (``elu + 1``, ``m = D``) are deterministic maps that do not estimate ``exp(x.y)``.

    Args:
        dim: input dimension ``D``.
        num_features: ``m`` (ignored by ``"elu"``).
        kind: one of :data:`FEATURE_MAPS`.
        orthogonal: orthogonal random blocks (lower variance).
        redraw_interval: in training mode, draw a new projection every this many forward
            calls (``None``: a fixed buffer, the default).
        seed: seeds the projection; ``None`` uses torch's global generator.
    """

    def __init__(
        self,
        dim: int,
        num_features: int = 256,
        *,
        kind: str = "favor+",
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("num_features", num_features)
        check_choice("feature_map", kind, FEATURE_MAPS)
        if redraw_interval is not None:
            check_positive_int("redraw_interval", redraw_interval)
        self.dim, self.kind, self.orthogonal = dim, kind, orthogonal
        self.num_features = dim if kind == "elu" else num_features
        self.redraw_interval = redraw_interval
        self._generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        if kind == "elu":
            self.register_buffer("projection", None)
        else:
            proj = gaussian_orthogonal_random_matrix(
                num_features, dim, orthogonal=orthogonal, generator=self._generator, device=device, dtype=torch.float32
            )
            # Kept in float32 or better whatever the module dtype: it feeds an exponential.
            self.register_buffer("projection", proj if dtype != torch.float64 else proj.double())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=True)

    def _apply(self, fn, recurse=True):
        # The projection stays in float32 or float64 when the module is cast to half types.
        super()._apply(fn, recurse)
        if self.projection is not None and self.projection.dtype in (torch.float16, torch.bfloat16):
            self.projection = self.projection.float()
        return self

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw a new random projection in place."""
        if self.projection is None:
            return
        new = gaussian_orthogonal_random_matrix(
            self.num_features, self.dim, orthogonal=self.orthogonal, generator=self._generator, dtype=torch.float64
        )
        self.projection.copy_(new)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "favor+":
            return favor_plus_features(x, self.projection)
        if self.kind == "relu":
            return relu_features(x, self.projection), None
        return elu_features(x), None

    def step_schedule(self) -> None:
        """Count a training forward call and redraw on schedule."""
        if self.training and self.redraw_interval is not None:
            if int(self.calls) > 0 and int(self.calls) % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_features={self.num_features}, kind={self.kind!r}, redraw_interval={self.redraw_interval}"
