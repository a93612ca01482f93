"""Candidates and the mixed op: one layer's attention as a weighted sum of named mechanisms.

A *slot* is the attention of one Transformer block. In the supernet it is a
:class:`MixedAttention` over the same candidates in every slot, each an entry of
:data:`flt.ATTENTION` written as on the command line (``flt``, ``flt:spectrum=local``,
``softmax:relative_bias=t5``). Its output is ``y = sum_o w_o * o(x)`` with
``w = softmax(alpha) * keep``: ``alpha`` is the slot's architecture parameter and ``keep``
marks the candidates still in (0 removes one, as perturbation selection does while it
measures). A *decided* slot computes its chosen candidate alone (``w`` one-hot) and never
changes again.

The candidates are ordinary submodules, so everything that finds layers by module
traversal (random-feature redraws and fixed evaluation draws of :mod:`flt.layers.draws`,
weight decay groups, checkpoints) sees them as it sees the layers of a plain model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from flt._checks import check_choice
from flt.layers import ATTENTION
from flt.models.block import build_attention, build_posenc
from flt.options import parse_attention_list
from flt.posenc import POSENC

if TYPE_CHECKING:
    from flt.tasks.base import Task

__all__ = [
    "Candidate", "EncodingCandidate", "MixedAttention", "MixedEncoding", "MixedOp", "attention_blocks", "build_supernet",
    "check_candidates", "check_posenc_candidates", "encoding_slot", "mixed_slots", "parse_candidates",
    "parse_posenc_candidates",
]


#: A :class:`Candidate` or a subclass of it, built by its own class.
_Entry = TypeVar("_Entry", bound="Candidate")


@dataclass(frozen=True)
class Candidate:
    """One candidate mechanism: ``label`` as the user wrote it, the registry ``name`` and the
    constructor ``options`` (the task's defaults for ``name`` with the entry's own on top)."""

    #: The keys of :meth:`to_dict` (``search.json``) for the registry name and its options.
    keys: ClassVar[tuple[str, str]] = ("attention", "attention_options")

    label: str
    name: str
    options: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        name_key, options_key = self.keys
        return {"label": self.label, name_key: self.name, options_key: dict(self.options)}

    @classmethod
    def from_dict(cls: type[_Entry], data: dict[str, Any]) -> _Entry:
        name_key, options_key = cls.keys
        return cls(data["label"], data[name_key], dict(data[options_key]))


def _parse_entries(text: str, flag: str, what: str, cls: type[_Entry], registry: Mapping[str, object],
                   options_of: Callable[[str, dict[str, Any]], dict[str, Any]]) -> list[_Entry]:
    """``"a,b:k=v,..."`` of option ``flag`` -> ``cls`` entries of ``registry`` with the
    options ``options_of(name, entry's own)`` (the task's defaults under them). At least
    two, distinct."""
    entries = parse_attention_list(text, flag)
    if len(entries) < 2:
        raise ValueError(f"{flag} needs at least two {what} to choose from, got {text!r}")
    out = []
    for label, name, options in entries:
        check_choice(f"{flag} entry {label!r}: {cls.keys[0]}", name, registry)
        out.append(cls(label, name, options_of(name, options)))
    return out


def parse_candidates(text: str, task: type[Task]) -> list[Candidate]:
    """``"a,b:k=v,..."`` (``--candidates``) -> candidates with ``task``'s default options for
    each name (``task.attention_defaults``) under the entry's own. At least two, distinct."""
    return _parse_entries(text, "--candidates", "mechanisms", Candidate, ATTENTION,
                          lambda name, options: task.attention_options(name, task.attention_defaults.get(name, {}), options))


def check_candidates(candidates: list[Candidate], *, dim: int, heads: int, pos_dim: int, causal: bool) -> None:
    """Build every candidate once at the model's width and geometry, so that an entry that
    does not construct (unknown option, wrong type, a mechanism that cannot serve these
    positions) is a ``ValueError`` naming it before any data loads or training starts."""
    for c in candidates:
        try:
            build_attention(c.name, dim, heads, pos_dim=pos_dim, causal=causal, options=c.options)  # checks the options
        except (ValueError, TypeError, NotImplementedError) as err:
            raise ValueError(f"--candidates entry {c.label!r} does not construct for this model "
                             f"(dim {dim}, heads {heads}, pos_dim {pos_dim}, causal {causal}): {err}") from None


@dataclass(frozen=True)
class EncodingCandidate(Candidate):
    """One candidate absolute encoding of :data:`flt.posenc.POSENC`: ``label`` as written,
    the registry ``name`` and its ``options`` (the task's defaults for ``name`` under the
    entry's own)."""

    keys: ClassVar[tuple[str, str]] = ("posenc", "posenc_options")


def parse_posenc_candidates(text: str, task: type[Task]) -> list[EncodingCandidate]:
    """``"none,sinusoidal,fourier:k=v"`` (``--posenc-candidates``) -> candidate encodings
    with ``task``'s default options for each name (``task.posenc_defaults``) under the
    entry's own. At least two, distinct."""
    return _parse_entries(text, "--posenc-candidates", "encodings", EncodingCandidate, POSENC,
                          lambda name, options: {**task.posenc_defaults.get(name, {}), **options})


def check_posenc_candidates(candidates: list[EncodingCandidate], *, dim: int, pos_dim: int) -> None:
    """Build every candidate encoding once at the model's width and position dimension and
    encode a few positions: one that does not construct or cannot encode these positions is
    a ``ValueError`` naming it before any data loads."""
    for c in candidates:
        try:
            enc = build_posenc(c.name, dim, pos_dim, c.options)  # checks the options
            with torch.no_grad():
                out = enc(torch.zeros(1, 2, pos_dim))
            if tuple(out.shape) != (1, 2, dim):
                raise ValueError(f"it returns shape {tuple(out.shape)}, not (1, 2, {dim})")
        except (ValueError, TypeError, NotImplementedError, IndexError, RuntimeError) as err:
            raise ValueError(f"--posenc-candidates entry {c.label!r} does not construct for this model "
                             f"(dim {dim}, pos_dim {pos_dim}): {err}") from None


class MixedOp(nn.Module):
    """The mixture shared by :class:`MixedAttention` and :class:`MixedEncoding`: candidate
    modules ``ops``, their ``labels`` and the mixing weights.

    Buffers (saved with the weights): ``keep [K]`` (1 = the candidate is in, 0 = removed)
    and ``decided`` (-1 while undecided, else the chosen index). Parameter ``alpha [K]``
    (zeros: uniform weights); ``frozen=True`` keeps it there (no gradient).
    """

    keep: torch.Tensor  # registered buffer [K]: 1 for a candidate still in, 0 once removed
    decided: torch.Tensor  # registered buffer []: -1 while undecided, else the chosen index

    def __init__(self, ops: list[nn.Module], labels: list[str], *, frozen: bool = False) -> None:
        super().__init__()
        if len(ops) != len(labels) or len(ops) < 2:
            raise ValueError(f"a mixed op needs at least two candidates and one label each, got {len(ops)} and {len(labels)}")
        self.ops = nn.ModuleList(ops)
        self.labels = list(labels)
        ref: torch.Tensor | None = next((p for op in ops for p in op.parameters()), None)
        if ref is None:
            ref = next((b for op in ops for b in op.buffers() if b.is_floating_point()), None)
        # alpha in the candidates' precision when that is float64, else float32.
        dtype = torch.float64 if ref is not None and ref.dtype == torch.float64 else torch.float32
        device = ref.device if ref is not None else None
        self.alpha = nn.Parameter(torch.zeros(len(ops), dtype=dtype, device=device), requires_grad=not frozen)
        self.register_buffer("keep", torch.ones(len(ops), device=device))
        self.register_buffer("decided", torch.tensor(-1, dtype=torch.long, device=device))

    @property
    def is_decided(self) -> bool:
        return int(self.decided) >= 0

    @property
    def choice(self) -> str | None:
        """The chosen candidate's label, or None while undecided."""
        return self.labels[int(self.decided)] if self.is_decided else None

    def probabilities(self) -> torch.Tensor:
        """``softmax(alpha)`` (detached, float64): what magnitude selection reads."""
        return torch.softmax(self.alpha.detach().double(), dim=0)

    def weights(self) -> torch.Tensor:
        """The mixing weights ``w [K]``: one-hot once decided, else ``softmax(alpha) * keep``."""
        if self.is_decided:
            return nn.functional.one_hot(self.decided, len(self.ops)).to(self.alpha.dtype)
        return torch.softmax(self.alpha, dim=0) * self.keep.to(self.alpha.dtype)

    def decide(self, index: int) -> None:
        """Make the slot one-hot on candidate ``index``, for good."""
        if self.is_decided:
            raise ValueError(f"this slot is decided already (on {self.choice!r})")
        if not 0 <= index < len(self.ops):
            raise ValueError(f"candidate index must lie in [0, {len(self.ops)}), got {index}")
        with torch.no_grad():
            self.decided.fill_(index)
            self.keep.zero_()[index] = 1.0
        self.alpha.requires_grad_(False)

    def active(self) -> list[int]:
        """Indices of the candidates that contribute: the chosen one once decided, else those kept."""
        return [int(self.decided)] if self.is_decided else [k for k, kept in enumerate(self.keep.tolist()) if kept]

    def weighted_sum(self, call: Callable[[int, nn.Module], torch.Tensor]) -> torch.Tensor | None:
        """``sum_k w_k call(k, op_k)`` over the active candidates; None when none is in."""
        w = self.weights()
        out = None
        for k in self.active():
            y = call(k, self.ops[k])
            y = y * w[k].to(y.dtype)
            out = y if out is None else out + y
        return out

    def extra_repr(self) -> str:
        return f"labels={self.labels}, decided={self.choice}"


class MixedAttention(MixedOp):
    """``y = sum_o w_o * op_o(x, pos, key_padding_mask)`` over candidate attention layers
    ``ops`` (:class:`MixedOp`: ``alpha``, ``keep``, ``decided``)."""

    supports_decoding = False

    def _mix(self, method: str, x: torch.Tensor, pos: torch.Tensor | None, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        def call(k: int, op: nn.Module) -> torch.Tensor:
            fn = getattr(op, method, None)
            if fn is None:
                raise ValueError(f"candidate {self.labels[k]!r} has no {method}() method")
            return fn(x, pos, key_padding_mask).to(x.dtype)

        out = self.weighted_sum(call)
        return out if out is not None else torch.zeros_like(x)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, N, dim] -> [B, N, dim]``, the weighted sum of the candidates still in."""
        return self._mix("forward", x, pos, key_padding_mask)

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same sum of the candidates' O(N^2) ``exact`` attention."""
        return self._mix("exact", x, pos, key_padding_mask)

    def reference(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same sum of the candidates' ``reference`` attention (the graph encoder's mode)."""
        return self._mix("reference", x, pos, key_padding_mask)


class MixedEncoding(MixedOp):
    """``e = sum_o w_o * enc_o(pos)`` over candidate absolute encodings ``ops`` of
    :data:`flt.posenc.POSENC` (:class:`MixedOp`: ``alpha``, ``keep``, ``decided``): the
    model's absolute positional encoding as one more slot of the search."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        """``pos [B, N, P] -> [B, N, dim]``, the weighted sum of the encodings still in."""
        out = self.weighted_sum(lambda k, op: op(pos))
        if out is None:  # every candidate removed: the encoding adds nothing
            out = self.ops[0](pos) * 0
        return out


def attention_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(block, attribute)`` of the attention layer of every Transformer block of
    ``model``, in order: ``trunk.blocks[i].attn`` in the models of :mod:`flt.models`,
    ``encoder.blocks[i].attention`` in the graph task's node transformer."""
    trunk = getattr(model, "trunk", None)
    if trunk is not None and hasattr(trunk, "blocks"):
        return [(b, "attn") for b in trunk.blocks]
    encoder = getattr(model, "encoder", None)
    if encoder is not None and hasattr(encoder, "blocks") and all(hasattr(b, "attention") for b in encoder.blocks):
        return [(b, "attention") for b in encoder.blocks]
    raise TypeError(f"{type(model).__name__} has no Transformer blocks whose attention flt search could mix "
                    "(trunk.blocks of flt.models, or the graph task's encoder='transformer')")


def encoding_owner(model: nn.Module) -> nn.Module:
    """The module holding ``model``'s absolute positional encoding as ``posenc``."""
    for owner in (model, getattr(model, "encoder", None)):
        if owner is not None and isinstance(getattr(owner, "posenc", None), nn.Module):
            return owner
    raise TypeError(f"{type(model).__name__} has no absolute positional encoding (posenc) to mix")


def mixed_slots(model: nn.Module) -> list[MixedAttention]:
    """The mixed attention ops of a supernet, in block order."""
    return [m for m in model.modules() if isinstance(m, MixedAttention)]


def encoding_slot(model: nn.Module) -> MixedEncoding | None:
    """The mixed absolute encoding of a supernet, or None when the search does not mix it."""
    found = [m for m in model.modules() if isinstance(m, MixedEncoding)]
    return found[0] if found else None


def build_supernet(model: nn.Module, candidates: list[Candidate], *, frozen: bool = False,
                   posenc_candidates: list[EncodingCandidate] | None = None) -> nn.Module:
    """Replace the attention of every block of ``model`` (:func:`attention_blocks`) by a
    :class:`MixedAttention` over ``candidates`` built at that layer's width, heads, position
    dimension and causality; with ``posenc_candidates`` (two or more) also its absolute
    encoding by a :class:`MixedEncoding` over them, at the model's width and position
    dimension. Returns ``model``."""
    blocks = attention_blocks(model)
    first = getattr(blocks[0][0], blocks[0][1])
    # The encoding is added to the token embeddings: the width and positions of the attention.
    width, pos_dim = first.dim, first.pos_dim
    ref = next(model.parameters())
    fk: dict[str, Any] = {"device": ref.device, "dtype": ref.dtype}
    for block, attr in blocks:
        old = getattr(block, attr)
        ops = [build_attention(c.name, old.dim, old.heads, pos_dim=old.pos_dim, causal=old.causal, options=c.options, **fk)
               for c in candidates]
        setattr(block, attr, MixedAttention(ops, [c.label for c in candidates], frozen=frozen))
        if hasattr(block, "attention_name"):
            # By name: the type checker reads a module's unknown attributes as submodules or tensors.
            setattr(block, "attention_name", "mixed")  # noqa: B010
    if posenc_candidates:
        owner = encoding_owner(model)
        ops = [build_posenc(c.name, width, pos_dim, c.options, **fk) for c in posenc_candidates]
        owner.posenc = MixedEncoding(ops, [c.label for c in posenc_candidates], frozen=frozen)
    return model
