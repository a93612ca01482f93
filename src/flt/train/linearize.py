"""Linearising a trained ``transformers`` decoder: attention transfer, then fine-tuning.

:func:`linearize` loads a local checkpoint (``AutoModelForCausalLM.from_pretrained``, no
download), converts a copy with :func:`flt.integrations.transformers.convert` and trains it
in two stages, as Hedgehog and LoLCATs linearise pretrained models:

1. **attention transfer** (``transfer_steps``): every converted attention module sees the
   *teacher's* input to that layer (the original softmax model's hidden states, captured by
   forward hooks) and is trained (``transfer``) to reproduce the teacher layer's output
   (``"outputs"``, the default: after its output projection, by the relative squared error
   :func:`relative_error` summed over layers), its attention weights (``"weights"``, as
   Hedgehog and LoLCATs do: the KL divergence of each row of the core's weights from the
   softmax's, :func:`attention_kl`, averaged over layers) or both (their sum). Only the flt
   cores' parameters train (spectrum, feature maps, near-field terms, temperatures); every
   weight of the original model is frozen. Each layer learns from the teacher's inputs, not
   from the student's own earlier layers, so the layers train independently in one pass.
2. **fine-tuning** (``finetune_steps``): the whole converted model (``finetune="all"``,
   default), its attention modules (``"attention"``: cores and q/k/v/o projections) or the
   cores only (``"cores"``), by next-token cross-entropy on the same text.

The run directory is the one ``flt train`` writes (the same checkpoint, lock, metrics and
plot code of :mod:`flt.train`): ``run.json``, ``metrics.jsonl`` (``transfer`` records: the
loss, each layer's output error ``layers`` and, when weights are matched, its weights' KL
``kl``; ``train``; ``valid``; ``matching`` before and after transfer), ``checkpoints/``
(atomic, hashed; ``resume=True`` continues bit for bit), ``summary.json`` (validation
perplexity of the softmax model, of the converted model before transfer, after transfer
and after fine-tuning), ``learning_curves.png`` and ``model/``, the linearised model saved
with ``save_pretrained`` (load it with :func:`flt.integrations.transformers.from_pretrained`).
:func:`flt.train.train` itself runs flt's own models from a task's config; a
``transformers`` model is not one, so the two stages here are a short loop over the same parts.

Text: a UTF-8 file (its last ``valid_fraction`` is validation) or, by default, the
embedded Python-documentation corpus (:func:`flt.data.text.load_python_docs`). Tokens: the
checkpoint's tokenizer when ``MODEL_DIR`` has one (``AutoTokenizer``), else, when asked
for (``byte_tokens=True``, ``--bytes``), bytes (ids 0..255, for models with ``vocab_size >=
256`` trained on bytes, such as ``examples/train_tiny_llama.py``'s). A folder without a
tokenizer is refused unless bytes are asked for: a model trained on another tokenizer
would otherwise train, silently, on ids that mean nothing to it.

Attention dropout is set to 0 on load (a linear core has no attention matrix to drop);
the random features are drawn once (``seed``) and not redrawn. Matching weights runs the
teacher with ``transformers``' eager attention, which returns them (its perplexity then
differs from the default implementation's by float32 rounding only).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from flt._io import atomic_savefig, atomic_write_json, read_json_file
from flt.tasks.base import step_generator

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from transformers import PreTrainedModel

    from flt.functional import AttentionCore

#: A forward pre-hook with keyword arguments: ``(module, args, kwargs) -> (args, kwargs) or None``.
_PreHook = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], 'tuple[tuple[Any, ...], dict[str, Any]] | None']

#: What trains during fine-tuning (:class:`LinearizeConfig.finetune`).
FINETUNE = ("all", "attention", "cores")
#: What attention transfer matches (:class:`LinearizeConfig.transfer`): each layer's
#: output, its attention weights, or both.
TRANSFER = ("outputs", "weights", "both")
#: Config attributes of attention dropout in ``transformers`` configs (Llama family, GPT-2).
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")
#: Files that mark a directory as a ``transformers`` tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
#: The headline metric (validation perplexity) in records and plots.
METRIC = "ppl"


@dataclass(frozen=True)
class LinearizeConfig:
    """Everything :func:`linearize` computes from; saved in ``run.json`` and every checkpoint
    (``resume`` needs the same one).

    ``attention`` and ``attention_options`` go to :func:`flt.integrations.transformers.convert`.
    The default is FLT's logit coupling with an exact band of 32 tokens, FAVOR+ beyond it and
    no query-key normalisation, so that the converted core starts as close as an estimate
    can to the softmax it replaces (with ``f = 0`` its exact path *is* that softmax).
    ``transfer`` is what attention transfer matches (:data:`TRANSFER`; module docstring).
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
        """Learning rate of (1-based) ``step``: warm-up and cosine decay within its stage."""
        from flt.tasks.preset import RunConfig

        if self.stage(step) == "transfer":
            steps, lr, local = self.transfer_steps, self.transfer_lr, step
        else:
            steps, lr, local = self.finetune_steps, self.finetune_lr, step - self.transfer_steps
        return RunConfig(steps=steps, lr=lr, warmup_steps=min(self.warmup_steps, max(steps - 1, 0))).lr_at(local)


def load_text(path: str | None, valid_fraction: float = 0.1) -> tuple[bytes, bytes, str]:
    """``(train, valid, name)``: a UTF-8 file split at ``1 - valid_fraction`` of its bytes
    (at a line break when there is one nearby), or the embedded Python-documentation corpus."""
    if path is None:
        from flt.data.text import load_python_docs

        splits = load_python_docs()
        return splits.train, splits.valid, "python-docs"
    from flt.data._files import read_regular
    from flt.data.text import TEXT_BYTES_PER_BYTE

    file = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"--data {path}: no such file (expected a UTF-8 text file)")
    # A FIFO or device is refused before it is read (reading a FIFO waits for a writer), and
    # the size is checked against FLT_MEMORY_LIMIT before the bytes are.
    data = read_regular(path, "--data file", bytes_per_byte=TEXT_BYTES_PER_BYTE, hint="use a smaller --data file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path}: not UTF-8 text ({err})") from None
    cut = int(len(data) * (1 - valid_fraction))
    newline = data.rfind(b"\n", max(0, cut - 1000), cut)
    cut = newline + 1 if newline > 0 else cut
    train, valid = data[:cut], data[cut:]
    if not train or not valid:
        raise ValueError(f"--data {path}: {len(data)} bytes leave an empty training or validation part")
    return train, valid, file.name


def check_tokens(model_dir: str | os.PathLike, byte_tokens: bool) -> None:
    """Refuse a ``MODEL_DIR`` without a tokenizer unless bytes are asked for
    (``byte_tokens``), and bytes asked for where it has one."""
    tokenizer = [name for name in TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
    if byte_tokens and tokenizer:
        raise ValueError(f"--bytes: MODEL_DIR {model_dir} has a tokenizer ({tokenizer[0]}), which bytes would ignore; "
                         "drop --bytes to use it")
    if not byte_tokens and not tokenizer:
        raise ValueError(f"MODEL_DIR {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); pass --bytes "
                         "(byte_tokens=True) to train on the text's bytes as token ids 0..255, right only for a model "
                         "trained on bytes, or save the model's tokenizer into it (tokenizer.save_pretrained)")


class Tokens:
    """Turns text into token ids with ``MODEL_DIR``'s tokenizer, or bytes
    (``byte_tokens``, for a folder without one: :func:`check_tokens`)."""

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int, byte_tokens: bool = False):
        check_tokens(model_dir, byte_tokens)
        directory = Path(model_dir)
        self.tokenizer = None
        if not byte_tokens:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.kind = type(self.tokenizer).__name__
        elif vocab_size >= 256:
            self.kind = "bytes"
        else:
            raise ValueError(f"{model_dir} has no tokenizer and its vocabulary ({vocab_size} tokens) cannot hold bytes; "
                             "save the model's tokenizer into it (tokenizer.save_pretrained)")

    def encode(self, text: bytes) -> torch.Tensor:
        """Ids ``[N]`` int64."""
        if self.tokenizer is None:
            return byte_ids(text)
        ids = self.tokenizer(text.decode("utf-8"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)


def byte_ids(text: bytes) -> torch.Tensor:
    """Bytes as token ids ``[N]`` int64 (0..255)."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)


def window_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The training windows of (1-based) ``step``: ``[B, seq_len + 1]`` token ids at random
    starts drawn from ``(seed, step)`` alone (a resumed run sees the same batches)."""
    span = tokens.numel() - seq_len - 1
    if span < 1:
        raise ValueError(f"the training text has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    starts = torch.randint(0, span, (batch_size,), generator=step_generator(seed, step, stream=11))
    return torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()])


def eval_windows(tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int | None) -> Iterator[torch.Tensor]:
    """Consecutive validation windows ``[b, seq_len + 1]`` overlapping by one token, so each
    token after the first is predicted once; at most ``max_batches`` batches."""
    starts = list(range(0, tokens.numel() - seq_len - 1, seq_len))
    if not starts:
        raise ValueError(f"the validation text has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    for i, first in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield torch.stack([tokens[s: s + seq_len + 1] for s in starts[first: first + batch_size]])


def next_token_loss(model: PreTrainedModel, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of every next token of ``windows [B, T + 1]`` (in float32 or better)."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int | None = None,
               device: torch.device | str | None = None) -> dict[str, float]:
    """``{"loss", "ppl", "tokens"}`` of ``model`` on ``tokens`` (:func:`eval_windows`), in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for windows in eval_windows(tokens, seq_len, batch_size, max_batches):
            windows = windows.to(device) if device is not None else windows
            total += float(next_token_loss(model, windows, reduction="sum").double())
            count += windows[:, 1:].numel()
    finally:
        model.train(was_training)
    loss = total / count
    return {"loss": loss, METRIC: math.exp(loss), "tokens": count}


def check_attention(config: LinearizeConfig) -> None:
    """Refuse an unknown mechanism or option before any model loads (the checks of ``flt train``),
    and weights to match from a mechanism without them."""
    from flt._checks import check_choice
    from flt.layers import ATTENTION
    from flt.options import ATTENTION_ARGUMENTS, check_attention_options

    check_choice("attention", config.attention, ATTENTION)
    if "causal" in config.attention_options:
        raise ValueError("causal is not an attention option here: a decoder's attention is causal")
    if "path" in config.attention_options:
        raise ValueError("path is not an attention option here: linearize trains the estimator (path='forward')")
    check_attention_options(config.attention, config.attention_options, reserved=ATTENTION_ARGUMENTS)
    if config.transfer != "outputs" and config.attention_options.get("coupling") == "multiplicative":
        raise ValueError(f"--transfer {config.transfer} matches attention weights, which coupling='multiplicative' does not "
                         "have (its signed mask makes them signed); use --transfer outputs or coupling='logit'")


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a path, after checking that it looks like a ``transformers`` checkpoint
    of a softmax model: a directory with a ``config.json`` and no flt settings in it."""
    from flt.integrations.transformers import CONFIG_KEY

    directory = Path(model_dir)
    if not directory.exists():
        raise FileNotFoundError(f"MODEL_DIR {model_dir}: no such directory (expected a transformers checkpoint "
                                "written by save_pretrained)")
    if not directory.is_dir():
        raise ValueError(f"MODEL_DIR {model_dir} is a file, not a directory (expected a transformers checkpoint)")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"MODEL_DIR {model_dir} is not a transformers checkpoint: it has no config.json "
                         "(write one with model.save_pretrained)")
    config = read_json_file(str(config_file), f"MODEL_DIR {model_dir}: config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"MODEL_DIR {model_dir} is not a transformers checkpoint: its config.json has no model_type")
    if config.get(CONFIG_KEY):
        raise ValueError(f"MODEL_DIR {model_dir} holds a model converted by flt already ({CONFIG_KEY} in its config.json); "
                         "linearize starts from a softmax model")
    return directory


def load_softmax_model(model_dir: str | os.PathLike, device: torch.device | str | None = None) -> PreTrainedModel:
    """The checkpoint's causal LM in float32, eval mode, attention dropout set to 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = check_model_dir(model_dir)
    try:
        config = AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"MODEL_DIR {model_dir}: transformers cannot read its config.json ({err})") from None
    for name in ATTENTION_DROPOUT:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32)
    except OSError as err:
        raise ValueError(f"MODEL_DIR {model_dir}: no loadable weights ({err})") from None
    except ValueError as err:
        raise ValueError(f"MODEL_DIR {model_dir}: not a causal language model transformers can load ({err})") from None
    # transformers' annotations of its wrapped .to() read as an unbound method's.
    return model.to(device).eval()  # type: ignore[arg-type]


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
    from flt._dtype import compute_dtype

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


@dataclass
class _Run:
    """What a linearisation holds while it trains."""

    config: LinearizeConfig
    out_dir: str
    device: torch.device
    teacher: PreTrainedModel
    student: PreTrainedModel
    matching: LayerMatching
    train_ids: torch.Tensor
    valid_ids: torch.Tensor
    record: dict[str, Any]
    logger: Any = None
    optimizer: torch.optim.Optimizer | None = None
    stage: str | None = None
    step_times: list[float] = field(default_factory=list)
    last_checkpoint: str | None = None


class LinearizeInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`linearize`: ``step`` reached, ``checkpoint`` a resume starts from."""

    def __init__(self, out_dir: str, step: int, steps: int, checkpoint: str | None):
        super().__init__(f"linearising in {out_dir} interrupted after step {step} of {steps}")
        self.out_dir, self.step, self.steps, self.checkpoint = out_dir, step, steps, checkpoint


def linearize(model_dir: str | os.PathLike, out_dir: str, config: LinearizeConfig = LinearizeConfig(), *,
              resume: bool = False, device: str = "cpu", progress: bool = True, plots: bool = True,
              on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Linearise the softmax decoder in ``model_dir`` into ``out_dir`` (module docstring)
    and return the summary (also ``summary.json``).

    Args:
        resume: continue the run in ``out_dir`` from its latest checkpoint (same
            ``model_dir`` and ``config``); it ends as the uninterrupted run would, bit for bit
            (timings aside). Without it ``out_dir`` must not hold a run yet.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        on_step: called with the step number after each step (and its checkpoint).

    Raises:
        LinearizeInterrupted: on Ctrl-C; the checkpoints written so far are intact.
        ValueError, FileNotFoundError: bad ``model_dir``, data or options, before training.
        flt.train.lock.RunDirectoryInUse: another process works in ``out_dir``.
    """
    from flt.train.lock import lock_run_dir

    check_attention(config)
    check_model_dir(model_dir)
    check_tokens(model_dir, config.byte_tokens)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    lock = lock_run_dir(out_dir, command="flt linearize")
    reached = [0]
    try:
        return _linearize(Path(model_dir), out_dir, config, dev, resume, progress, plots, on_step, reached, lock.note)
    except KeyboardInterrupt as err:
        raise LinearizeInterrupted(out_dir, reached[0], config.steps, _resumable(out_dir)) from err
    finally:
        lock.release()


def _resumable(out_dir: str) -> str | None:
    from flt.train.checkpoint import CheckpointError, find_checkpoint

    try:
        return find_checkpoint(out_dir, report=lambda message: None)
    except (FileNotFoundError, CheckpointError):
        return None


def _linearize(model_dir: Path, out_dir: str, config: LinearizeConfig, device: torch.device, resume: bool, progress: bool,
               plots: bool, on_step: Callable[[int], None] | None, reached: list[int], lock_note: str | None) -> dict[str, Any]:
    from flt.integrations.transformers import convert
    from flt.train.checkpoint import has_checkpoint, remove_leftovers
    from flt.train.metrics import MetricsLogger
    from flt.train.rng import seed_everything

    wall_start = time.perf_counter()
    notes = [lock_note] if lock_note else []
    notes += [f"removed {p}, left half written by a run that was killed" for p in remove_leftovers(out_dir)]
    record = {"linearize": dataclasses.asdict(config), "model_dir": str(model_dir.resolve())}
    origin: str | None = None
    meta: dict[str, Any] = {}
    if resume:
        origin, meta = _resume_point(out_dir, record, notes)
    elif has_checkpoint(out_dir):
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    seed_everything(config.seed)
    teacher = load_softmax_model(model_dir, device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = convert(copy.deepcopy(teacher), config.attention, **config.attention_options)
    weights = config.transfer != "outputs"
    if weights:
        teacher.set_attn_implementation("eager")  # the implementation that returns the softmax weights
    tokens = Tokens(model_dir, teacher.config.vocab_size, config.byte_tokens)
    train_text, valid_text, corpus = load_text(config.data, config.valid_fraction)
    train_ids, valid_ids = tokens.encode(train_text), tokens.encode(valid_text)
    top = int(max(train_ids.max(), valid_ids.max()))
    if top >= teacher.config.vocab_size:
        raise ValueError(f"the text has token id {top}, beyond the vocabulary of {model_dir} ({teacher.config.vocab_size}); "
                         "a byte-level text needs vocab_size >= 256 or the model's tokenizer files in MODEL_DIR")
    record.update(tokens=tokens.kind, corpus=corpus)
    r = _Run(config, out_dir, device, teacher, student, LayerMatching(teacher, student, weights=weights), train_ids, valid_ids, record)
    if config.transfer_steps and not trainable_parameters(student, "cores"):
        raise ValueError(f"{config.attention} with options {config.attention_options} has no learned parameters for "
                         "attention transfer; set transfer_steps to 0 or choose a mechanism with a learned part")
    start = 0 if origin is None else _restore(r, origin, meta)
    for note in notes:
        print(f"note: {note}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    _write_run_json(r, teacher, student)
    with contextlib.closing(MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), resume_step=start if origin else None)) as r.logger:
        if origin is None:
            _baselines(r)
        _loop(r, start, progress, on_step, reached)
    return _finish(r, plots, wall_start)


def _resume_point(out_dir: str, record: dict[str, Any], notes: list[str]) -> tuple[str, dict[str, Any]]:
    from flt.train.checkpoint import locate_checkpoint

    ckpt, meta = locate_checkpoint(out_dir, report=notes.append)
    saved = {k: meta.get(k) for k in ("linearize", "model_dir")}
    if isinstance(saved["linearize"], dict):
        # Runs from before `transfer` existed matched outputs; those from before
        # `byte_tokens` read bytes wherever MODEL_DIR had no tokenizer (their record says which).
        saved["linearize"] = {"transfer": "outputs", "byte_tokens": meta.get("tokens") == "bytes", **saved["linearize"]}
    if saved["linearize"] != json.loads(json.dumps(record["linearize"])):
        diffs = sorted(k for k in record["linearize"] if (saved["linearize"] or {}).get(k) != json.loads(json.dumps(record["linearize"][k])))
        raise ValueError(f"--resume needs the options of the run in {out_dir}; these differ: {', '.join(diffs)}")
    if saved["model_dir"] != record["model_dir"]:
        raise ValueError(f"--resume: the run in {out_dir} linearises {saved['model_dir']}, not {record['model_dir']}")
    return ckpt, meta


def _write_run_json(r: _Run, teacher: PreTrainedModel, student: PreTrainedModel) -> None:
    info = {**r.record, "parameters": sum(p.numel() for p in student.parameters()),
            "softmax_parameters": sum(p.numel() for p in teacher.parameters()), "model_type": teacher.config.model_type,
            "device": str(r.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    atomic_write_json(os.path.join(r.out_dir, "run.json"), info, indent=2, sort_keys=True)


def _evaluate(r: _Run, model: PreTrainedModel) -> dict[str, float]:
    c = r.config
    return perplexity(model, r.valid_ids, seq_len=c.seq_len, batch_size=c.batch_size, max_batches=c.eval_batches, device=r.device)


def _matching(r: _Run) -> dict[str, list[float]]:
    """The ``matching`` record's values on the validation windows: each layer's output
    error (``error``) and, when weights are matched, its weights' KL (``kl``)."""
    c = r.config
    losses = r.matching.evaluate(r.valid_ids, c.seq_len, c.batch_size, c.eval_batches, device=r.device)
    return {"error": losses["outputs"], **({"kl": losses["weights"]} if "weights" in losses else {})}


def _baselines(r: _Run) -> None:
    """Step 0: the softmax model's and the converted model's validation perplexity and the
    converted layers' matching error, before any training."""
    softmax, converted = _evaluate(r, r.teacher), _evaluate(r, r.student)
    r.logger.log(0, "softmax", **softmax)
    r.logger.log(0, "valid", stage="converted", **converted)
    r.logger.log(0, "matching", **_matching(r))
    print(f"softmax model: valid ppl {softmax[METRIC]:.4g}; converted, before training: valid ppl {converted[METRIC]:.4g}", flush=True)


def _set_stage(r: _Run, stage: str) -> None:
    """Trainable parameters, optimizer and train/eval mode of ``stage``; a fresh AdamW."""
    c = r.config
    params = trainable_parameters(r.student, "cores" if stage == "transfer" else c.finetune)
    r.optimizer = torch.optim.AdamW(params, lr=c.transfer_lr if stage == "transfer" else c.finetune_lr, betas=(0.9, 0.95),
                                    weight_decay=0.0)
    # Transfer matches the teacher's deterministic outputs: no dropout in the student either.
    r.student.train(stage == "finetune")
    r.stage = stage


def _optimizer(r: _Run) -> torch.optim.Optimizer:
    """The optimizer of the stage in progress (:func:`_set_stage` creates it)."""
    if r.optimizer is None:
        raise RuntimeError("no stage has been set: the optimizer comes with the stage (_set_stage)")
    return r.optimizer


def _restore(r: _Run, ckpt: str, meta: dict[str, Any]) -> int:
    from flt.train.checkpoint import load_trainer_state, load_weights
    from flt.train.rng import set_rng_state

    load_weights(ckpt, r.student)
    state = load_trainer_state(ckpt)
    step = int(meta["step"])
    if step < r.config.steps:
        _set_stage(r, r.config.stage(step + 1))
        if state["stage"] == r.stage:
            _optimizer(r).load_state_dict(state["optimizer"])
    set_rng_state(state["rng"], r.student)
    r.step_times = state["step_times"].tolist()
    r.last_checkpoint = ckpt
    return step


def _loop(r: _Run, start: int, progress: bool, on_step: Callable[[int], None] | None, reached: list[int]) -> None:
    c = r.config
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=c.steps, initial=start, desc=f"linearize {c.attention}", dynamic_ncols=True, unit="step")
    try:
        for step in range(start + 1, c.steps + 1):
            if r.stage != c.stage(step):
                _set_stage(r, c.stage(step))
            t0 = time.perf_counter()
            loss, layers = _train_step(r, step)
            r.step_times.append(time.perf_counter() - t0)
            values = {"loss": loss, "lr": c.lr_at(step), "stage": r.stage}
            r.logger.log(step, "transfer" if layers is not None else "train", **values, **(layers or {}))
            stage_end = step in (c.transfer_steps, c.steps)
            if step % c.eval_every == 0 or stage_end:
                valid = _evaluate(r, r.student)
                r.logger.log(step, "valid", stage=r.stage, **valid)
                if r.stage == "transfer" and step == c.transfer_steps:
                    r.logger.log(step, "matching", **_matching(r))
                message = f"step {step} ({r.stage}): valid ppl {valid[METRIC]:.4g}"
                bar.write(message) if bar is not None else print(message, flush=True)
            if step % c.checkpoint_every == 0 or stage_end:
                _checkpoint(r, step)
            reached[0] = step
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{r.stage} loss {loss:.4g}")
            if on_step is not None:
                on_step(step)
    finally:
        if bar is not None:
            bar.close()


def _train_step(r: _Run, step: int) -> tuple[float, dict[str, list[float]] | None]:
    """One optimizer step: ``(loss, per-layer matching losses or None)``: in transfer each
    layer's output error (``layers``) and, when weights are matched, its weights' KL (``kl``)."""
    c, optimizer = r.config, _optimizer(r)
    for group in optimizer.param_groups:
        group["lr"] = c.lr_at(step)
    batch = window_batch(r.train_ids, step, c.batch_size, c.seq_len, c.seed).to(r.device)
    layers = None
    if r.stage == "transfer":
        losses = r.matching.losses(batch[:, :-1])
        loss = transfer_loss(losses, c.transfer)
        layers = {"layers": losses["outputs"].detach().tolist()}
        if "weights" in losses:
            layers["kl"] = losses["weights"].detach().tolist()
    else:
        loss = next_token_loss(r.student, batch)
    value = float(loss.detach())
    if not math.isfinite(value):
        from flt.train.loop import TrainingDiverged

        where = f"the last checkpoint, {r.last_checkpoint}, is intact" if r.last_checkpoint else "no checkpoint was written yet"
        raise TrainingDiverged(f"the {r.stage} loss is {value} at step {step} of {c.steps} in {r.out_dir}; {where}; "
                               f"lower the {r.stage} learning rate")
    loss.backward()
    if c.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], c.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value, layers


def _checkpoint(r: _Run, step: int) -> None:
    from flt.train.checkpoint import save_checkpoint
    from flt.train.rng import rng_state

    state = {"step": step, "stage": r.stage, "optimizer": _optimizer(r).state_dict(), "rng": rng_state(r.student),
             "step_times": torch.tensor(r.step_times, dtype=torch.float64)}
    r.last_checkpoint = save_checkpoint(r.out_dir, step, r.student, config=r.record, trainer_state=state,
                                        keep=r.config.keep_checkpoints)


def _finish(r: _Run, plots: bool, wall_start: float) -> dict[str, Any]:
    """``summary.json`` from the records (a resumed run has the earlier ones too), the
    linearised model in ``model/`` and the plot."""
    from flt.train.loop import peak_memory_mib
    from flt.train.metrics import read_metrics

    c = r.config
    records = read_metrics(os.path.join(r.out_dir, "metrics.jsonl"))
    valid = {rec["step"]: rec for rec in records if rec["split"] == "valid"}
    matching = {rec["step"]: rec["error"] for rec in records if rec["split"] == "matching"}
    kl = {rec["step"]: rec.get("kl") for rec in records if rec["split"] == "matching"}
    softmax = next(rec for rec in records if rec["split"] == "softmax")
    ppl = {"softmax": softmax[METRIC], "converted": valid[0][METRIC],
           "transferred": valid[c.transfer_steps][METRIC] if c.transfer_steps else None,
           "finetuned": valid[c.steps][METRIC] if c.finetune_steps else None}
    bad = {k: v for k, v in ppl.items() if v is not None and not math.isfinite(v)}
    if bad:
        from flt.train.loop import TrainingDiverged

        raise TrainingDiverged(f"the validation perplexity {', '.join(f'{k} is {v}' for k, v in bad.items())} in {r.out_dir} "
                               "(not a finite number; summary.json is not written); lower the learning rates, or check "
                               "the model's and the text's scale")
    final = ppl["finetuned"] if ppl["finetuned"] is not None else ppl["transferred"]
    times = {stage: [t for i, t in enumerate(r.step_times, 1) if c.stage(i) == stage] for stage in ("transfer", "finetune")}
    memory, memory_kind = peak_memory_mib(r.device)
    summary = {
        **r.record, "attention": c.attention, "attention_options": c.attention_options, "metric": METRIC,
        "steps": c.steps, "transfer_steps": c.transfer_steps, "finetune_steps": c.finetune_steps, "finetune": c.finetune,
        "transfer": c.transfer,
        "ppl": ppl, "ppl_ratio": final / ppl["softmax"], "eval_tokens": softmax["tokens"],
        "matching_error": {"before": matching.get(0), "after": matching.get(c.transfer_steps) if c.transfer_steps else None},
        "weights_kl": {"before": kl.get(0), "after": kl.get(c.transfer_steps) if c.transfer_steps else None},
        "time_per_step_s": {k: statistics.median(v) if v else None for k, v in times.items()},
        "train_time_s": sum(r.step_times), "wall_time_s": time.perf_counter() - wall_start,
        "peak_memory_mib": memory, "memory_kind": memory_kind, "device": str(r.device),
    }
    atomic_write_json(os.path.join(r.out_dir, "summary.json"), summary, indent=2, sort_keys=True)
    _save_model(r)
    if plots:
        plot_linearization(records, os.path.join(r.out_dir, "learning_curves.png"), transfer_steps=c.transfer_steps,
                           title=f"linearize {r.record['model_dir']}: {c.attention}")
    print(f"done: valid ppl softmax {ppl['softmax']:.4g}, converted {ppl['converted']:.4g}, "
          f"after transfer {_show(ppl['transferred'])}, after fine-tuning {_show(ppl['finetuned'])} "
          f"({summary['ppl_ratio']:.3f}x softmax); model in {os.path.join(r.out_dir, 'model')}", flush=True)
    return summary


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _save_model(r: _Run) -> None:
    """``save_pretrained`` into a temporary directory renamed into place, so ``model/`` is
    complete or absent."""
    from flt._io import atomic_dir

    atomic_dir(r.out_dir, "model", r.student.save_pretrained)


def plot_linearization(records: list[dict[str, Any]], out_path: str, *, transfer_steps: int, title: str = "") -> Figure:
    """Three panels against the step: each layer's matching error during transfer (log
    scale; solid: the output error, dashed: the weights' KL when weights are matched), the fine-tuning loss with the validation loss, and the validation perplexity
    with the softmax model's as a dashed line; a dotted line marks the end of transfer.
    Returns the saved ``matplotlib.figure.Figure``."""
    from flt._io import new_figure
    from flt.train.plots import STEP_LABEL

    transfer = [rec for rec in records if rec["split"] == "transfer"]
    train = [rec for rec in records if rec["split"] == "train"]
    valid = [rec for rec in records if rec["split"] == "valid"]
    softmax = next(rec for rec in records if rec["split"] == "softmax")
    fig = new_figure(13, 3.8)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for layer in range(len(transfer[0]["layers"]) if transfer else 0):
        steps = [rec["step"] for rec in transfer]
        ax1.plot(steps, [rec["layers"][layer] for rec in transfer], lw=1, color=f"C{layer}", label=f"layer {layer}")
        if "kl" in transfer[0]:
            ax1.plot(steps, [rec["kl"][layer] for rec in transfer], lw=1, ls="--", color=f"C{layer}", label=f"layer {layer}, weights' KL")
    if transfer:
        ax1.set_yscale("log")
        ax1.legend(fontsize=8)
    ylabel = "relative squared error" + (" / KL (nats)" if transfer and "kl" in transfer[0] else "")
    ax1.set(xlabel=STEP_LABEL, ylabel=ylabel, title="attention transfer: matching error")
    ax2.plot([rec["step"] for rec in train], [rec["loss"] for rec in train], lw=1, label="fine-tuning (train)")
    ax2.plot([rec["step"] for rec in valid], [rec["loss"] for rec in valid], "o-", ms=3, label="valid")
    ax2.axhline(softmax["loss"], color="k", ls="--", lw=1, label="softmax model (valid)")
    ax2.set(xlabel=STEP_LABEL, ylabel="cross-entropy (nats/token)", title="loss")
    ax2.legend(fontsize=8)
    ax3.plot([rec["step"] for rec in valid], [rec[METRIC] for rec in valid], "o-", ms=3, color="C1", label="converted model")
    ax3.axhline(softmax[METRIC], color="k", ls="--", lw=1, label="softmax model")
    ax3.set(xlabel=STEP_LABEL, ylabel="perplexity (per token)", title="validation perplexity")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if transfer_steps:
            ax.axvline(transfer_steps, color="grey", ls=":", lw=1)
    if title:
        fig.suptitle(title)
    atomic_savefig(fig, out_path)
    return fig
