"""QM9 property models behind one interface: the library's molecule regressor
(:class:`flt.models.MoleculeRegressor`, any attention mechanism on 3-D positions) and the
field's message-passing baselines from torch_geometric, SchNet (Schütt et al., 2017) and
DimeNet++ (Gasteiger et al., 2020).

Every model maps a padded batch ``z [B, N]``, ``pos [B, N, 3]``, ``key_padding_mask
[B, N]`` (True = padding) to ``[B]`` in target units, ``target_mean + target_std * out``,
so the task, the loop and the budget are the same whichever ``encoder`` a config names.

Each has a variant with the long-range block (:class:`flt.layers.LongRangeBlock`,
:mod:`flt.baselines.longrange`): ``schnet+lr``, ``dimenet++lr`` and ``transformer+lr``, the
base model with the block once before the readout (``longrange_placement="readout"``) or
after each of its blocks (``"each"``), configured by ``longrange`` (the block's options).

Both baselines run on graphs computed with plain torch (:mod:`flt.baselines.atom_graphs`), so
neither needs a compiled extension: a radius graph (:func:`~flt.baselines.atom_graphs.radius_graph`,
O(B N^2) for QM9's at most 29 atoms), SchNet's ``interaction_graph``, and for DimeNet++ also
the angle triplets (:func:`~flt.baselines.atom_graphs.triplets`), which :mod:`flt.baselines.dimenet`
hands to PyG's own blocks in place of PyG's versions (those need ``pyg-lib`` and
``torch_sparse``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.baselines.atom_graphs import radius_graph
from flt.baselines.longrange import (
    AfterBlock,
    AfterOutput,
    AfterResidual,
    LongRangeContext,
    check_longrange,
    list_slots,
    wrap_modules,
)
from flt.models.config import READOUTS, LayeredConfig
from flt.models.molecule import MoleculeRegressor

#: ``QM9Config.encoder`` choices: each base model, then each with the long-range block.
ENCODERS = ("transformer", "schnet", "dimenet++", "transformer+lr", "schnet+lr", "dimenet++lr")
#: The base model of each encoder with the long-range block.
BASES = {"transformer+lr": "transformer", "schnet+lr": "schnet", "dimenet++lr": "dimenet++"}
#: Each message-passing model's radius-graph cutoff (Angstrom) in its paper, used when
#: ``QM9Config.cutoff`` is None: SchNet (Schütt et al., 2017) and DimeNet++ (Gasteiger et al., 2020).
CUTOFFS = {"schnet": 10.0, "dimenet++": 5.0}


@dataclass(frozen=True)
class QM9Config(LayeredConfig):
    """A QM9 property model. ``encoder``: ``"transformer"`` (:class:`MoleculeRegressor`:
    ``depth`` layers of ``attention`` of width ``dim``, positions the atom coordinates),
    ``"schnet"`` (``depth`` interaction blocks of width ``dim``, ``num_gaussians`` radial
    basis functions up to ``cutoff`` Angstrom) or ``"dimenet++"`` (``depth`` blocks of
    width ``dim``, PyG's other sizes at their defaults, ``cutoff``). ``cutoff`` None (the
    default) takes each model's published one (:data:`CUTOFFS`: SchNet 10 Angstrom,
    DimeNet++ 5). ``readout`` pools atoms
    by ``"sum"`` or ``"mean"``; None (the default) takes the target's natural one, filled
    in by the task (sum for extensive properties such as energies, mean for orbital
    energies and the dipole). ``num_elements`` bounds the atomic numbers (QM9: H to F).
    ``longrange`` (the options of :class:`flt.layers.LongRangeBlock`, e.g. ``{"frequencies":
    "grid"}``) and ``longrange_placement`` (``"readout"``: once before the readout; ``"each"``:
    after every interaction block, output block or layer) apply to the ``+lr`` encoders only."""

    encoder: str = "transformer"
    num_elements: int = 10
    readout: str | None = None
    isotropic: bool = True
    cutoff: float | None = None
    num_gaussians: int = 50
    target_mean: float = 0.0
    target_std: float = 1.0
    longrange: dict[str, Any] = field(default_factory=dict)
    longrange_placement: str = "readout"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("encoder", self.encoder, ENCODERS)
        check_longrange(self.encoder, self.longrange, self.longrange_placement)
        check_positive_int("num_elements", self.num_elements)
        check_positive_int("num_gaussians", self.num_gaussians)
        if self.readout is not None:
            check_choice("readout", self.readout, READOUTS)
        if self.cutoff is not None and not self.cutoff > 0:
            raise ValueError(f"cutoff must be a positive number of Angstrom, got {self.cutoff!r}")
        if not self.target_std > 0:
            raise ValueError(f"target_std must be positive, got {self.target_std!r}")
        if BASES.get(self.encoder, self.encoder) != "transformer" and self.layer_attention is not None:
            raise ValueError(f"layer_attention applies to encoder='transformer', got encoder={self.encoder!r}")

    @classmethod
    def saved_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """Configs saved before ``cutoff`` defaulted to each model's own (None) hold the old
        default 10.0: for SchNet that is what None gives, for the transformer it is unused,
        so both read as None and ``--resume`` of such a run compares equal to the preset."""
        if fields.get("cutoff") == 10.0 and fields.get("encoder", "transformer") in ("transformer", "schnet"):
            fields = {**fields, "cutoff": None}
        return fields


class _RadiusGraph(nn.Module):
    """SchNet's ``interaction_graph``: ``(pos, batch) -> (edge_index, edge_weight)``."""

    def __init__(self, cutoff: float):
        super().__init__()
        self.cutoff = cutoff

    def forward(self, pos: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return radius_graph(pos, batch, self.cutoff)


def _flatten(z: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real atoms of a padded batch: ``z [A]``, ``pos [A, 3]``, ``batch [A]``."""
    real = ~key_padding_mask
    batch = torch.arange(z.shape[0], device=z.device).unsqueeze(1).expand_as(z)[real]
    return z[real], pos[real], batch


class QM9Regressor(nn.Module):
    """The model a :class:`QM9Config` names; ``forward(z [B, N], pos [B, N, 3],
    key_padding_mask [B, N]) -> [B]`` in target units. ``exact=True`` runs the transformer's
    O(N^2) attention and the long-range blocks' exact sums; the plain message-passing
    encoders, which estimate nothing, refuse it.

    The ``+lr`` encoders wrap the base model's own modules (:mod:`flt.baselines.longrange`):
    SchNet's interaction blocks, the node-feature projection (``lin_up``, width
    ``2 dim``) of DimeNet++'s output blocks (whose outputs are summed into the prediction,
    so ``"readout"`` puts the block in the last one's node path), the transformer's trunk
    blocks; :func:`flt.baselines.longrange.blocks_of` lists the blocks.

    The keyword arguments are the fields of :class:`QM9Config`; the transformer's other
    trunk fields (``mlp_ratio``, ``dropout``, its mechanisms) come as ``**trunk``, which
    the message-passing encoders do not read."""

    def __init__(self, *, encoder: str, num_elements: int, dim: int, depth: int, heads: int, readout: str | None,
                 isotropic: bool, cutoff: float | None, num_gaussians: int, target_mean: float, target_std: float,
                 longrange: dict[str, Any] | None = None, longrange_placement: str = "readout",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **trunk: Any):
        super().__init__()
        check_choice("encoder", encoder, ENCODERS)
        check_longrange(encoder, dict(longrange or {}), longrange_placement)
        longrange = {"heads": heads, **(longrange or {})}
        readout = readout or "mean"
        self.encoder, self.readout = encoder, readout
        self.base = BASES.get(encoder, encoder)
        self.target_mean, self.target_std = float(target_mean), float(target_std)
        self.context = LongRangeContext()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        if self.base == "transformer":
            self.net = MoleculeRegressor(num_elements=num_elements, dim=dim, depth=depth, heads=heads, readout=readout,
                                         isotropic=isotropic, target_mean=target_mean, target_std=target_std, **fk, **trunk)
            if encoder != self.base:
                wrap_modules(list_slots(self.net.trunk.blocks), dim, longrange, longrange_placement, AfterBlock, **fk)
            return
        cutoff = CUTOFFS[self.base] if cutoff is None else cutoff
        if self.base == "schnet":
            from torch_geometric.nn.models import SchNet

            self.net = SchNet(hidden_channels=dim, num_filters=dim, num_interactions=depth, num_gaussians=num_gaussians,
                              cutoff=cutoff, interaction_graph=_RadiusGraph(cutoff), readout="add" if readout == "sum" else "mean")
        else:
            from flt.baselines.dimenet import PlainDimeNetPlusPlus

            self.net = PlainDimeNetPlusPlus(hidden_channels=dim, out_channels=1, num_blocks=depth, int_emb_size=64,
                                            basis_emb_size=8, out_emb_channels=2 * dim, num_spherical=7, num_radial=6,
                                            cutoff=cutoff)
        self.net.to(device=device, dtype=dtype)
        if encoder == "schnet+lr":
            wrap_modules(list_slots(cast(nn.ModuleList, self.net.interactions)), dim, longrange, longrange_placement, AfterResidual,
                         self.context, **fk)
        elif encoder == "dimenet++lr":
            slots: list[tuple[nn.Module, str]] = [(block, "lin_up") for block in cast(nn.ModuleList, self.net.output_blocks)]
            wrap_modules(slots, 2 * dim, longrange, longrange_placement, AfterOutput, self.context, **fk)

    def forward(self, z: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *,
                exact: bool = False) -> torch.Tensor:
        """Predicted property ``[B]`` in target units."""
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
        if self.base == "transformer":
            return self.net(z, pos, key_padding_mask, exact=exact)
        if exact and self.encoder == self.base:
            raise ValueError(f"exact=True is the transformer's exact attention or the long-range block's exact sum; "
                             f"encoder={self.encoder!r} has neither")
        if z.ndim != 2 or pos.shape != (*z.shape, 3) or key_padding_mask.shape != z.shape:
            raise ValueError(f"expected z [B, N], pos [B, N, 3] and key_padding_mask [B, N], got {tuple(z.shape)}, "
                             f"{tuple(pos.shape)} and {tuple(key_padding_mask.shape)}")
        zf, pf, batch = _flatten(z, pos, key_padding_mask)
        with self.context.bound(pos, key_padding_mask, exact=exact):
            out = self.net(zf, pf, batch).view(-1)
        if self.base == "dimenet++" and self.readout == "mean":  # PyG's DimeNet++ sums over atoms
            out = out / (~key_padding_mask).sum(dim=1).to(out.dtype)
        return self.target_mean + self.target_std * out
