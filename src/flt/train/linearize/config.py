"""What a linearisation computes from (:class:`LinearizeConfig`), and the checks of its
attention that run before any model loads (:func:`check_attention`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flt._checks import check_choice
from flt.layers import ATTENTION
from flt.options import checked_once
from flt.tasks.preset import RunConfig

#: What trains during fine-tuning (:class:`LinearizeConfig.finetune`).
FINETUNE = ("all", "attention", "cores")
#: What attention transfer matches (:class:`LinearizeConfig.transfer`): each layer's
#: output, its attention weights, or both.
TRANSFER = ("outputs", "weights", "both")


@dataclass(frozen=True)
class LinearizeConfig:
    """Everything :func:`~flt.train.linearize.linearize` computes from; saved in ``run.json``
    and every checkpoint (``resume`` needs the same one).

    ``attention`` and ``attention_options`` go to :func:`flt.integrations.transformers.convert`.
    The default is FLT's logit coupling with an exact band of 32 tokens, FAVOR+ beyond it and
    no query-key normalisation, so that the converted core starts as close as an estimate
    can to the softmax it replaces (with ``f = 0`` its exact path *is* that softmax).
    ``transfer`` is what attention transfer matches (:data:`TRANSFER`; :mod:`flt.train.linearize`).
    ``byte_tokens``: the text's bytes are the token ids (``MODEL_DIR`` must then have no
    tokenizer); without it ``MODEL_DIR`` must have one.
    Learning rates follow a linear warm-up and a cosine decay within each stage.
    """

    attention: str = "flt"
    attention_options: dict[str, Any] = field(default_factory=lambda: {"near_field": 32, "qk_norm": False, "num_features": 64, "seed": 0})
    data: str | None = None
    valid_fraction: float = 0.1
    seq_len: int = 128
    batch_size: int = 8
    transfer_steps: int = 100
    finetune_steps: int = 100
    transfer_lr: float = 1e-2
    finetune_lr: float = 3e-4
    warmup_steps: int = 10
    finetune: str = "all"
    transfer: str = "outputs"
    grad_clip: float | None = 1.0
    eval_every: int = 50
    eval_batches: int | None = 16
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    seed: int = 0
    byte_tokens: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.byte_tokens, bool):
            raise ValueError(f"byte_tokens must be true or false, got {self.byte_tokens!r}")
        for name in ("seq_len", "batch_size", "eval_every", "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("transfer_steps", "finetune_steps", "warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.transfer_steps + self.finetune_steps < 1:
            raise ValueError("transfer_steps + finetune_steps must be at least 1")
        if self.finetune not in FINETUNE:
            raise ValueError(f"finetune must be one of {FINETUNE}, got {self.finetune!r}")
        if self.transfer not in TRANSFER:
            raise ValueError(f"transfer must be one of {TRANSFER}, got {self.transfer!r}")
        if not 0.0 < self.valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must lie strictly between 0 and 1, got {self.valid_fraction!r}")
        for name in ("transfer_lr", "finetune_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.eval_batches is not None and (isinstance(self.eval_batches, bool) or self.eval_batches < 1):
            raise ValueError(f"eval_batches must be None or a positive integer, got {self.eval_batches!r}")

    @property
    def steps(self) -> int:
        return self.transfer_steps + self.finetune_steps

    def stage(self, step: int) -> str:
        """``"transfer"`` or ``"finetune"``: the stage of (1-based) ``step``."""
        return "transfer" if step <= self.transfer_steps else "finetune"

    def lr_at(self, step: int) -> float:
        """Learning rate of (1-based) ``step``: warm-up and cosine decay within its stage
        (the schedule of :meth:`flt.tasks.preset.RunConfig.lr_at`, restarted at each stage)."""
        if self.stage(step) == "transfer":
            steps, lr, local = self.transfer_steps, self.transfer_lr, step
        else:
            steps, lr, local = self.finetune_steps, self.finetune_lr, step - self.transfer_steps
        return RunConfig(steps=steps, lr=lr, warmup_steps=min(self.warmup_steps, max(steps - 1, 0))).lr_at(local)


def check_attention(config: LinearizeConfig) -> LinearizeConfig:
    """Refuse an unknown mechanism or option before any model loads (the checks of ``flt train``),
    and weights to match from a mechanism without them. Returns ``config`` with its
    ``attention_options`` as the check returned them (:class:`flt.options.CheckedOptions`):
    options that already passed it are not checked again, here or where the cores are built
    (:func:`flt.integrations.transformers.convert`)."""
    check_choice("attention", config.attention, ATTENTION)
    if "causal" in config.attention_options:
        raise ValueError("causal is not an attention option here: a decoder's attention is causal")
    if "path" in config.attention_options:
        raise ValueError("path is not an attention option here: linearize trains the estimator (path='forward')")
    config = dataclasses.replace(config, attention_options=checked_once(config.attention, config.attention_options))
    if config.transfer != "outputs" and config.attention_options.get("coupling") == "multiplicative":
        raise ValueError(f"--transfer {config.transfer} matches attention weights, which coupling='multiplicative' does not "
                         "have (its signed mask makes them signed); use --transfer outputs or coupling='logit'")
    return config
