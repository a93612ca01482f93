"""What a search does besides the preset's training run: :class:`SearchConfig`, read by
the search (:mod:`flt.search.run`) and by its client in the training loop
(:mod:`flt.search.supernet`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from flt.search.mixed import Candidate, EncodingCandidate


@dataclass(frozen=True)
class SearchConfig:
    """What the search does besides the preset's training run.

    Args:
        candidates: the mechanisms every slot chooses from (:func:`flt.search.mixed.parse_candidates`).
        tune_steps: fine-tuning steps after each decision.
        alpha_lr, alpha_weight_decay: Adam on ``alpha`` (betas 0.5, 0.999).
        fixed_alpha: keep ``alpha`` uniform (no architecture updates).
        holdout: fraction of the training split held out for ``alpha`` and selection.
        posenc_candidates: the absolute encodings the model's encoding slot chooses from
            (:func:`flt.search.mixed.parse_posenc_candidates`); empty (the default): the
            preset's encoding, not searched.
    """

    candidates: tuple[Candidate, ...]
    tune_steps: int = 20
    alpha_lr: float = 3e-3
    alpha_weight_decay: float = 1e-3
    fixed_alpha: bool = False
    holdout: float = 0.2
    posenc_candidates: tuple[EncodingCandidate, ...] = ()

    def __post_init__(self) -> None:
        if len(self.candidates) < 2:
            raise ValueError(f"a search needs at least two candidates, got {len(self.candidates)}")
        if len(self.posenc_candidates) == 1:
            raise ValueError("posenc_candidates needs at least two encodings to choose from (or none: the encoding is not searched)")
        if isinstance(self.tune_steps, bool) or not isinstance(self.tune_steps, int) or self.tune_steps < 0:
            raise ValueError(f"tune_steps must be a non-negative integer, got {self.tune_steps!r}")
        if not self.alpha_lr > 0:
            raise ValueError(f"alpha_lr must be positive, got {self.alpha_lr!r}")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be a fraction in (0, 1), got {self.holdout!r}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = [c.to_dict() for c in self.candidates]
        if self.posenc_candidates:
            out["posenc_candidates"] = [c.to_dict() for c in self.posenc_candidates]
        else:
            del out["posenc_candidates"]  # the record of a search that does not mix the encoding is as before
        return out
