"""The interface every relative positional term implements.

A relative term is a learned function of two positions, one value per head, that an
attention layer adds to its logits (or, multiplicatively coupled, multiplies its weights
by). Every term gives the exact value for all pairs; terms that factorise also give
linear-time features:

* :meth:`RelativeTerm.bias` ``(pos_q [B|1, N, P], pos_k [B|1, Nk, P]) -> [B|1, H, N, Nk]``,
  the exact term (what ``SoftmaxAttention`` adds, what every layer's ``exact()`` uses);
* :meth:`RelativeTerm.of_offsets` ``(delta [..., P]) -> [..., H]``: the value at offsets
  ``delta = r_q - r_k`` (translation-invariant terms; what banded and Toeplitz layers
  evaluate on their offsets);
* :meth:`RelativeTerm.score_mod` ``(pos_q, pos_k) -> score_mod``: the exact term as a
  FlexAttention ``score_mod`` (``score + term[b, h, i, j]``), which never forms the
  ``[N, Nk]`` tensor (what ``SoftmaxAttention(backend="flex")`` uses);
* :meth:`RelativeTerm.features` ``(pos [B|1, N, P]) -> (a, c)``, each ``[B|1, H, N, F]``
  with ``a_i . c_j`` an estimate of the term: only where :attr:`linear` is True (the
  spectra). FLT needs such a term.

:data:`flt.relative.RELATIVE` maps names to classes built as
``cls(heads=H, pos_dim=P, causal=..., device=..., dtype=..., **options)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_dim, check_finite, check_tensor

#: Integer 1-D positions whose offsets span at most this many values get the term from a
#: table of its values at every offset (:meth:`RelativeTerm.score_mod`).
OFFSET_TABLE_LIMIT = 1 << 20


def pair_positions(pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate query and key positions; return them as ``[B|1, N, P]`` and ``[B|1, Nk, P]``."""
    check_tensor("pos_q", pos_q, ndim=(2, 3), layout="[B, N, P] or [N, P]")
    pos_q = pos_q if pos_q.ndim == 3 else pos_q.unsqueeze(0)
    if pos_k is None:
        pos_k = pos_q
    else:
        check_tensor("pos_k", pos_k, ndim=(2, 3), layout="[B, Nk, P] or [Nk, P]")
        pos_k = pos_k if pos_k.ndim == 3 else pos_k.unsqueeze(0)
        check_dim("pos_k", pos_k, 2, pos_q.shape[2], "position dimension P (must match pos_q)")
    if pos_q.shape[0] != pos_k.shape[0] and 1 not in (pos_q.shape[0], pos_k.shape[0]):
        raise ValueError(f"pos_q and pos_k have batch sizes {pos_q.shape[0]} and {pos_k.shape[0]}; they must match or be 1")
    check_finite("pos_q", pos_q)
    check_finite("pos_k", pos_k)
    return pos_q, pos_k


def tensor_sum(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(terms)`` of one or more tensors (e.g. over the ``P`` axes of a
    :meth:`RelativeTerm.head_value` offset), typed as a tensor: ``sum`` starts from the int 0."""
    total = sum(terms)
    if not isinstance(total, torch.Tensor):
        raise ValueError("tensor_sum needs at least one tensor")
    return total


class RelativeTerm(nn.Module):
    """Base class of the relative positional terms (module docstring).

    A subclass implements :meth:`of_offsets` (or overrides :meth:`pairwise` when the term
    is not a function of ``r_q - r_k`` alone, or has a cheaper pairwise form), and
    :meth:`features` when it factorises (then sets ``linear = True``).
    """

    #: Position dimensions the term accepts; ``None``: any.
    pos_dims: tuple[int, ...] | None = None
    #: Whether :meth:`features` gives a linear-time factorisation.
    linear: bool = False
    #: Random draws that :mod:`flt.layers.draws` redraws (none by default).
    has_random_features: bool = False

    def bias(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> torch.Tensor:
        """The exact term of every query-key pair: ``[B|1, H, N, Nk]`` in float32 or better
        (``pos_k`` defaults to ``pos_q``)."""
        return self.pairwise(*self._checked_pair(pos_q, pos_k))

    def _checked_pair(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        pos_q, pos_k = pair_positions(pos_q, pos_k)
        P = pos_q.shape[-1]
        own = getattr(self, "pos_dim", None)
        allowed = self.pos_dims
        if (allowed is not None and P not in allowed) or (isinstance(own, int) and P != own):
            want = own if isinstance(own, int) else " or ".join(map(str, allowed or ()))
            raise ValueError(f"{type(self).__name__} takes positions of dimension P = {want}, got P = {P}")
        return pos_q, pos_k

    def score_mod(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
        """The exact term as a FlexAttention ``score_mod``: ``mod(score, b, h, i, j) = score +
        bias(pos_q, pos_k)[b, h, i, j]``, without the ``[B|1, H, N, Nk]`` tensor.

        Integer 1-D positions (token indices, any term that is a function of the offset):
        the term's values at every offset between the extremes, ``[L, H]``, are computed
        once by :meth:`of_offsets` and gathered per score (``L <= OFFSET_TABLE_LIMIT``).
        Other positions: :meth:`head_value` of ``pos_q[b, i] - pos_k[b, j]`` per score (the
        positions are checked here, once); terms without it, or that are not a function of
        the offset, raise ``NotImplementedError``.

        Args:
            pos_q: ``[B|1, N, P]`` or ``[N, P]``; pos_k: ``[B|1, Nk, P]`` or ``[Nk, P]``
                (default ``pos_q``).
        """
        pos_q, pos_k = self._checked_pair(pos_q, pos_k)
        table = self._offset_table(pos_q, pos_k)
        if table is not None:
            values, low = table  # values[d - low] = term at r_q - r_k = d
            iq, ik = pos_q[..., 0].long(), pos_k[..., 0].long()
            one_q, one_k = iq.shape[0] == 1, ik.shape[0] == 1

            def by_offset(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                          kv_idx: torch.Tensor) -> torch.Tensor:
                d = iq[0 if one_q else b, q_idx] - ik[0 if one_k else b, kv_idx]
                return score + values[d - low, h].to(score.dtype)

            return by_offset
        if type(self).head_value is RelativeTerm.head_value:
            raise NotImplementedError(
                f"{type(self).__name__} has no per-score form (head_value) for FlexAttention: its score_mod needs integer "
                "1-D positions (token indices); use backend='sdpa' for these positions"
            )
        one_q, one_k = pos_q.shape[0] == 1, pos_k.shape[0] == 1

        def by_point(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            bq, bk = 0 if one_q else b, 0 if one_k else b
            delta = [pos_q[bq, q_idx, p] - pos_k[bk, kv_idx, p] for p in range(pos_q.shape[-1])]
            return score + self.head_value(delta, h).to(score.dtype)

        return by_point

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """The term of head ``h`` (a 0-d index) at one offset, given as its ``P`` coordinates
        (0-d tensors): a 0-d tensor, what :meth:`score_mod` adds per score for positions that
        are not token indices.

        Scalar code only: every parameter is read one element at a time (``t[h, c, p]``) and
        combined with scalar arithmetic and Python loops over components and axes. Compiled
        FlexAttention lowers a ``score_mod`` to code per score, and in torch 2.13 an operation
        on a whole captured tensor, or on a slice of it with two dimensions, gives wrong
        values there (``tests/library/test_score_mod.py`` checks the compiled result). Unchecked:
        :meth:`score_mod` checked the positions."""
        raise NotImplementedError(f"{type(self).__name__} has no head_value")

    def _offset_table(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """``(values [L, H], low)`` with ``values[d - low]`` the term at offset ``d``, for
        integer 1-D positions spanning at most :data:`OFFSET_TABLE_LIMIT` offsets; else None."""
        if pos_q.shape[-1] != 1 or pos_q.requires_grad or pos_k.requires_grad:
            return None
        if not (torch.equal(pos_q, pos_q.round()) and torch.equal(pos_k, pos_k.round())):
            return None
        low = int(pos_q.min()) - int(pos_k.max())
        high = int(pos_q.max()) - int(pos_k.min())
        if high - low + 1 > OFFSET_TABLE_LIMIT:
            return None
        offsets = torch.arange(low, high + 1, device=pos_q.device).to(pos_q.dtype).unsqueeze(-1)
        return self.of_offsets(offsets), low

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        """:meth:`bias` on checked positions. Default: :meth:`of_offsets` of ``r_q - r_k``."""
        delta = pos_q.unsqueeze(2) - pos_k.unsqueeze(1)  # [B|1, N, Nk, P]
        return rearrange(self.of_offsets(delta), "b i j h -> b h i j")

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        """The term at offsets ``delta = r_q - r_k``: ``[..., P] -> [..., H]``."""
        raise NotImplementedError(f"{type(self).__name__} is not a function of the offset r_q - r_k alone")

    def features(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, c)``, each ``[B|1, H, N, F]``, with ``a_i . c_j`` estimating the term."""
        raise NotImplementedError(
            f"{type(self).__name__} has no linear-time features (linear = False); FLT needs a term that has, e.g. a spectrum"
        )
