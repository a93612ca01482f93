"""Attention transfer: each converted layer learns to reproduce its softmax layer.

:class:`LayerMatching` hooks the teacher (the softmax model) and the student (its
converted copy) so that each student layer sees the teacher's input to that layer and its
output (and, when asked, its attention weights) can be compared with the teacher's:
:func:`relative_error` for outputs, :func:`attention_kl` for weights, combined by
:func:`transfer_loss`. :func:`trainable_parameters` chooses what trains in each stage.

:mod:`flt.integrations.transformers` imports ``transformers`` (the hf extra): it is
imported inside the two functions that walk a model's attention modules, so that
importing :mod:`flt.train.linearize` does not need it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from flt._dtype import compute_dtype
from flt.train.linearize.data import eval_windows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from flt.functional import AttentionCore

#: A forward pre-hook with keyword arguments: ``(module, args, kwargs) -> (args, kwargs) or None``.
_PreHook = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], 'tuple[tuple[Any, ...], dict[str, Any]] | None']


def relative_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean((out - target)^2) / mean(target^2)`` in float32: the MSE in units of the
    teacher's output power, so layers of different scales weigh alike and 1 means an output
    no better than zeros."""
    target = target.float()
    return F.mse_loss(out.float(), target) / target.pow(2).mean().clamp_min(torch.finfo(torch.float32).tiny)


def attention_kl(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the rows of ``sum_j A_ij (log A_ij - log W_ij)``, the KL divergence of the
    student's attention weights ``weights`` from the teacher's ``target`` (both ``[B, H,
    N, N]``, rows summing to 1), in float32 or better: the row cross-entropy minus the
    teacher's entropy, 0 when they are equal. Keys without teacher weight (causally masked)
    add nothing; a student weight of 0 where the teacher has one counts as the smallest
    positive float of the compute dtype."""
    if weights.shape != target.shape:
        raise ValueError(f"the student's attention weights {tuple(weights.shape)} and the teacher's {tuple(target.shape)} differ in shape")
    dtype = compute_dtype(weights, target)
    a, w = target.to(dtype), weights.to(dtype)
    tiny = torch.finfo(dtype).tiny
    return (a * (a.clamp_min(tiny).log() - w.clamp_min(tiny).log())).sum(-1).mean()


class LayerMatching:
    """Attention transfer by hooks: the teacher's (softmax) attention modules record their
    input hidden states and outputs; the student's converted modules take the teacher's
    inputs in place of their own and record their outputs. :meth:`losses` gives the
    relative squared error of each layer's output against the teacher's
    (:func:`relative_error`) and, with ``weights=True``, the KL divergence of each layer's
    attention weights from the teacher's (:func:`attention_kl`): the teacher's are those
    its eager attention returns (the teacher must run ``attn_implementation="eager"``),
    the student's are its core's (:meth:`flt.functional.AttentionCore.weights`) on the
    queries, keys and positions the core was called with (recorded by a hook on the core).
    The hooks act only inside :meth:`losses`: elsewhere both models run as they are."""

    def __init__(self, teacher: PreTrainedModel, student: PreTrainedModel, *, weights: bool = False) -> None:
        from flt.integrations.transformers import attention_modules

        if weights and getattr(teacher.config, "_attn_implementation", None) != "eager":
            raise ValueError("matching attention weights needs the teacher's eager attention, which returns them: "
                             "call teacher.set_attn_implementation('eager') first")
        self.teacher, self.student, self.weights = teacher, student, weights
        pairs = list(zip(attention_modules(teacher), attention_modules(student), strict=False))
        self.inputs: list[torch.Tensor | None] = [None] * len(pairs)
        self.targets: list[torch.Tensor | None] = [None] * len(pairs)
        self.outputs: list[torch.Tensor | None] = [None] * len(pairs)
        self.target_weights: list[torch.Tensor | None] = [None] * len(pairs)
        self.core_inputs: list[tuple | None] = [None] * len(pairs)
        self.cores = [cast("AttentionCore", s.flt_core) for _, s in pairs] if weights else []
        self.handles, self.active = [], False
        for i, (t, s) in enumerate(pairs):
            self.handles += [t.register_forward_pre_hook(self._record_input(i), with_kwargs=True),
                             t.register_forward_hook(self._record_target(i)),
                             s.register_forward_pre_hook(self._replace_input(i), with_kwargs=True),
                             s.register_forward_hook(self._record(self.outputs, i))]
        for i, core in enumerate(self.cores):
            self.handles.append(core.register_forward_hook(self._record_core_inputs(i)))

    def _record_input(self, i: int) -> _PreHook:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.active:
                self.inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def _replace_input(self, i: int) -> _PreHook:
        def hook(module: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if not self.active:
                return None
            if args:
                return (self.inputs[i], *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self.inputs[i]}
        return hook

    def _record(self, store: list[torch.Tensor | None], i: int) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.active:
                store[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def _record_target(self, i: int) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.active:
                self.targets[i] = output[0] if isinstance(output, tuple) else output
                if self.weights:
                    self.target_weights[i] = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        return hook

    def _record_core_inputs(self, i: int) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def hook(core: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.active:
                q, k, _, pos, pad = args  # flt_attention_forward calls core(query, key, value, pos, pad)
                self.core_inputs[i] = (q, k, pos, pad)
        return hook

    def losses(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """On ``input_ids [B, T]``: ``{"outputs": [L]}``, each layer's relative squared
        output error, and with ``weights=True`` also ``"weights": [L]``, each layer's KL
        divergence of its attention weights from the teacher's."""
        self.active = True
        try:
            with torch.no_grad():
                self.teacher(input_ids=input_ids)
            self.student(input_ids=input_ids)
        finally:
            self.active = False
        errors, divergences = [], []
        for i, (out, target) in enumerate(zip(self.outputs, self.targets, strict=True)):
            if out is None or target is None:
                raise RuntimeError(f"attention layer {i} of the teacher or the student did not run on input_ids")
            errors.append(relative_error(out, target))
            if self.weights:
                divergences.append(attention_kl(self._student_weights(i), self._teacher_weights(i)))
        result = {"outputs": torch.stack(errors)}
        if self.weights:
            result["weights"] = torch.stack(divergences)
        return result

    def _teacher_weights(self, i: int) -> torch.Tensor:
        target = self.target_weights[i]
        if target is None:
            raise RuntimeError(f"the teacher's attention layer {i} returned no attention weights (it must run eager attention)")
        return target.detach()

    def _student_weights(self, i: int) -> torch.Tensor:
        recorded = self.core_inputs[i]
        if recorded is None:
            raise RuntimeError(f"the student's core {i} was not called on input_ids (a core of path='forward' is; "
                               "'reference' and 'exact' bypass the hook that records its queries and keys)")
        q, k, pos, pad = recorded
        return self.cores[i].weights(q, k, pos, pad)

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-layer relative squared error ``[L]`` of the student's attention outputs on ``input_ids [B, T]``."""
        return self.losses(input_ids)["outputs"]

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int | None,
                 device: torch.device | str | None = None) -> dict[str, list[float]]:
        """Mean per-layer :meth:`losses` over the validation windows (:func:`eval_windows`):
        ``{"outputs": [L], "weights": [L]}`` (the latter with ``weights=True``)."""
        was_training = self.student.training
        self.student.eval()
        total: dict[str, torch.Tensor] = {}
        batches = 0
        try:
            for windows in eval_windows(tokens, seq_len, batch_size, max_batches):
                for key, value in self.losses(windows[:, :-1].to(device)).items():
                    total[key] = value.double() + total[key] if key in total else value.double()
                batches += 1
        finally:
            self.student.train(was_training)
        if not batches:
            raise ValueError(f"max_batches must be positive to evaluate, got {max_batches}")
        return {key: (value / batches).tolist() for key, value in total.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def transfer_loss(losses: dict[str, torch.Tensor], transfer: str) -> torch.Tensor:
    """The loss attention transfer minimises (:data:`TRANSFER`): the output errors summed
    over layers (``"outputs"``), the weights' KL averaged over layers (``"weights"``), or
    the two added (``"both"``)."""
    if transfer == "outputs":
        return losses["outputs"].sum()
    if transfer == "weights":
        return losses["weights"].mean()
    return losses["outputs"].sum() + losses["weights"].mean()


def trainable_parameters(model: PreTrainedModel, what: str) -> list[torch.nn.Parameter]:
    """Set ``requires_grad`` for one stage and return those parameters: ``"cores"`` (the flt
    cores alone: attention transfer), ``"attention"`` (cores and the attention modules'
    projections) or ``"all"``."""
    from flt.integrations.transformers import attention_modules

    if what == "all":
        chosen = {id(p) for p in model.parameters()}
    elif what == "attention":
        chosen = {id(p) for m in attention_modules(model) for p in m.parameters()}
    else:
        chosen = {id(p) for m in attention_modules(model) for p in m.get_submodule("flt_core").parameters()}
    # Parameters a core froze when it was built (a spectrum with far_field=False, a fixed
    # basis's centres and lengths) stay frozen in every stage: recorded at the first call,
    # before any stage has changed requires_grad.
    frozen = model.__dict__.get("_flt_frozen_parameters")
    if frozen is None:
        frozen = {id(p) for m in attention_modules(model) for p in m.get_submodule("flt_core").parameters()
                  if not p.requires_grad}
        model.__dict__["_flt_frozen_parameters"] = frozen
    chosen -= frozen
    params = []
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
        if id(p) in chosen:
            params.append(p)
    return params
