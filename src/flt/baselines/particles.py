"""Per-particle models (``P = 3``): every particle of a cloud gets a prediction.

:func:`particle_model` builds the model a :class:`ParticleConfig` names (``encoder``, a key
of :data:`PARTICLE_MODELS`): ``"transformer"`` (:class:`ParticleRegressor`),
``"schnet"`` (:class:`ParticleSchNet`, torch_geometric's SchNet interaction blocks on a
radius graph) and each with the long-range block (``"transformer+lr"``, ``"schnet+lr"``;
:class:`flt.layers.LongRangeBlock`). Every model maps ``charge [B, N]``, ``pos [B, N, 3]``
to ``[B, N]`` in target units.

:class:`ParticleRegressor`: particles are tokens, coordinates are positions. The trunk is the molecule model's (:class:`flt.models.block.Trunk` over centred
coordinates); a token's input is the embedding of its charge, ``-1`` or ``+1``, plus the
absolute encoding of its position (``posenc="none"`` by default: relative mechanisms see
only offsets). Permuting the particles permutes the predictions, translating a cloud
changes nothing (centring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.baselines.longrange import (
    AfterBlock,
    AfterResidual,
    LongRangeContext,
    check_longrange,
    list_slots,
    wrap_modules,
)
from flt.layers.longrange import LongRangeBlock
from flt.models.block import trunk_modules
from flt.models.config import LayeredConfig
from flt.models.molecule import tie_isotropic

#: ``ParticleConfig.encoder`` choices (the keys of :data:`PARTICLE_MODELS`).
PARTICLE_ENCODERS = ("transformer", "schnet", "transformer+lr", "schnet+lr")


@dataclass(frozen=True)
class ParticleConfig(LayeredConfig):
    """A per-particle model: ``encoder`` (:data:`PARTICLE_ENCODERS`) names it. The
    transformer: charge embeddings, 3-D coordinates as positions, one linear head per token;
    ``isotropic`` ties the per-axis lengths of radial spectra (as
    :class:`flt.models.MoleculeConfig`). SchNet: ``depth`` interaction blocks of width
    ``dim`` on the graph of pairs closer than ``cutoff`` mean spacings (``spacing`` position
    units each, filled in by the task from its density), ``num_gaussians`` radial basis
    functions. ``longrange`` (options of :class:`flt.layers.LongRangeBlock`) and
    ``longrange_placement`` (``"readout"``, ``"each"``, or ``"input"`` for the SchNet) configure the ``+lr`` encoders'
    block. Predictions are ``target_mean + target_std * out``."""

    depth: int = 2
    isotropic: bool = False
    target_mean: float = 0.0
    target_std: float = 1.0
    encoder: str = "transformer"
    cutoff: float = 2.0
    num_gaussians: int = 50
    spacing: float = 1.0
    longrange: dict[str, Any] = field(default_factory=dict)
    longrange_placement: str = "readout"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("encoder", self.encoder, PARTICLE_ENCODERS)
        check_longrange(self.encoder, self.longrange, self.longrange_placement, input_encoders=("schnet+lr",))
        check_positive_int("num_gaussians", self.num_gaussians)
        for name in ("cutoff", "spacing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.isotropic, bool):
            raise TypeError(f"isotropic must be a bool, got {self.isotropic!r}")
        for name in ("target_mean", "target_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.target_std > 0:
            raise ValueError(f"target_std must be positive, got {self.target_std!r}")


def check_particles(charge: torch.Tensor, pos: torch.Tensor) -> None:
    """``charge [B, N]`` of +-1 and ``pos [B, N, 3]``."""
    if charge.ndim != 2 or pos.shape != (*charge.shape, 3):
        raise ValueError(f"expected charge [B, N] and pos [B, N, 3], got {tuple(charge.shape)} and {tuple(pos.shape)}")
    if not bool(((charge == 1) | (charge == -1)).all()):
        raise ValueError("charges must be +1 or -1")


class ParticleRegressor(nn.Module):
    """Shapes: ``forward(charge [B, N] (+-1), pos [B, N, 3]) -> [B, N]`` in target units;
    ``exact=True`` runs every attention layer's O(N^2) ``exact``. ``dim`` and ``**trunk``
    are the trunk's fields (:func:`flt.models.block.trunk_modules`)."""

    def __init__(self, *, dim: int, isotropic: bool = False, target_mean: float = 0.0, target_std: float = 1.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **trunk: Any) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.target_mean, self.target_std = float(target_mean), float(target_std)
        self.embed = nn.Embedding(2, dim, **fk)
        self.posenc, self.drop, self.trunk = trunk_modules(dim=dim, pos_dim=3, causal=False, **fk, **trunk)
        self.head = nn.Linear(dim, 1, **fk)
        if isotropic:
            tie_isotropic(self.trunk)

    def forward(self, charge: torch.Tensor, pos: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        check_particles(charge, pos)
        pos = pos - pos.mean(dim=1, keepdim=True)
        x = self.embed((charge > 0).long()) + self.posenc(pos).to(self.embed.weight.dtype)
        x = self.trunk(self.drop(x), pos, exact=exact)
        return self.target_mean + self.target_std * self.head(x).squeeze(-1)


def cloud_radius_graph(pos: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index [2, E], distance [E])`` of every ordered pair ``(i, j)``, ``i != j``, of
    particles of one cloud closer than ``cutoff``, for clouds ``pos [B, N, 3]`` (flat
    indices ``b N + i``), sorted by ``i`` then ``j``.

    A cell list: particles are binned in cubes of side ``cutoff`` and each is compared with
    the particles of its own and the 26 neighbouring cubes only, so time and memory grow
    like ``N`` at a fixed density (about ``27 density cutoff^3`` candidates per particle)
    instead of ``N^2``. Distances are recomputed from the positions so gradients reach them.
    """
    B, N, _ = pos.shape
    flat = pos.reshape(B * N, 3)
    with torch.no_grad():
        points = flat.detach()
        low = pos.detach().amin(1, keepdim=True)
        cell = torch.floor((pos.detach() - low) / cutoff).long().reshape(B * N, 3) + 1  # a margin of one cell
        grid = cell.amax(0) + 2
        if B * math.prod(grid.tolist()) >= 2**62:  # Python ints: the tensor's product would overflow first
            raise ValueError(f"pos spans {[int(g) - 2 for g in grid.tolist()]} cells of side {cutoff:g} per axis; the "
                             f"cell keys of {B} clouds would overflow int64: positions this far apart are not one cloud")
        cloud = torch.arange(B, device=pos.device).repeat_interleave(N)
        key = ((cloud * grid[0] + cell[:, 0]) * grid[1] + cell[:, 1]) * grid[2] + cell[:, 2]
        order = torch.argsort(key, stable=True)
        sorted_key = key[order]
        step = torch.tensor([-1, 0, 1], device=pos.device)
        shift = torch.cartesian_prod(step, step, step)
        neighbour = key[:, None] + (shift[:, 0] * grid[1] + shift[:, 1]) * grid[2] + shift[:, 2]  # [BN, 27]
        first = torch.searchsorted(sorted_key, neighbour)
        count = (torch.searchsorted(sorted_key, neighbour, right=True) - first).reshape(-1)
        i = torch.arange(B * N, device=pos.device).repeat_interleave(27).repeat_interleave(count)
        begin = first.reshape(-1).repeat_interleave(count)
        within = torch.arange(len(i), device=pos.device) - (torch.cumsum(count, 0) - count).repeat_interleave(count)
        j = order[begin + within]
        keep = (i != j) & ((points[i] - points[j]).norm(dim=-1) < cutoff)
        i, j = i[keep], j[keep]
        canonical = torch.argsort(i * (B * N) + j)
        edge_index = torch.stack([i[canonical], j[canonical]])
    return edge_index, (flat[edge_index[0]] - flat[edge_index[1]]).norm(dim=-1)


class ParticleSchNet(nn.Module):
    """A per-particle SchNet (Schütt et al., 2017) from torch_geometric's parts: the
    embedding of each particle's charge, ``depth`` of PyG's ``InteractionBlock`` (width
    ``dim``, ``num_gaussians`` Gaussians, cosine cutoff) on the radius graph of each cloud
    (:func:`cloud_radius_graph`), and SchNet's two-layer head per
    particle. ``cutoff`` is in mean spacings, ``spacing`` position units each.

    ``longrange`` (options of :class:`flt.layers.LongRangeBlock`, or None for the plain
    model) adds the block after the last interaction block (``longrange_placement=
    "readout"``), after each (``"each"``), or once on the embedded charges before the first
    (``"input"``: the block's values are then a function of each particle's charge alone).
    ``exact=True`` runs the blocks' exact sums (a
    model without blocks refuses it).

    Shapes: ``forward(charge [B, N] (+-1), pos [B, N, 3]) -> [B, N]`` in target units.
    """

    def __init__(self, *, dim: int, depth: int, cutoff: float = 2.0, num_gaussians: int = 50, spacing: float = 1.0,
                 target_mean: float = 0.0, target_std: float = 1.0, longrange: dict[str, Any] | None = None,
                 longrange_placement: str = "readout", heads: int = 4, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        try:
            from torch_geometric.nn.models.schnet import (
                GaussianSmearing,
                InteractionBlock,
                ShiftedSoftplus,
            )
        except ImportError as error:
            raise ImportError(f"encoder='schnet' uses torch_geometric's SchNet blocks, which could not be imported "
                              f"({error}); install the qm9 extra: pip install -e '.[qm9]'") from error
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.target_mean, self.target_std = float(target_mean), float(target_std)
        self.radius = float(cutoff) * float(spacing)
        self.embed = nn.Embedding(2, dim)
        self.expand = GaussianSmearing(0.0, self.radius, num_gaussians)
        self.interactions = nn.ModuleList(InteractionBlock(dim, num_gaussians, dim, self.radius) for _ in range(depth))
        self.head = nn.Sequential(nn.Linear(dim, dim // 2), ShiftedSoftplus(), nn.Linear(dim // 2, 1))
        self.to(**fk)
        self.context = LongRangeContext()
        self.has_longrange = longrange is not None
        self.input_block: LongRangeBlock | None = None
        if longrange is not None:
            options = {"heads": heads, **longrange}
            if longrange_placement == "input":
                self.input_block = LongRangeBlock(dim, **options, **fk)
            else:
                wrap_modules(list_slots(self.interactions), dim, options, longrange_placement, AfterResidual, self.context, **fk)

    def forward(self, charge: torch.Tensor, pos: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        check_particles(charge, pos)
        if exact and not self.has_longrange:
            raise ValueError("exact=True is the long-range block's exact sum; this SchNet has no block")
        B, N = charge.shape
        edge_index, distance = cloud_radius_graph(pos, self.radius)
        basis = self.expand(distance)
        h = self.embed((charge > 0).long())
        if self.input_block is not None:
            h = self.input_block(h, pos, exact=exact)
        h = h.reshape(B * N, -1)
        with self.context.bound(pos, torch.zeros(B, N, dtype=torch.bool, device=pos.device), exact=exact):
            for interaction in self.interactions:
                h = h + interaction(h, edge_index, distance, basis)
        return self.target_mean + self.target_std * self.head(h).view(B, N)


def _transformer(cfg: ParticleConfig, fk: dict[str, Any]) -> nn.Module:
    model = ParticleRegressor(dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout,
                              attention=cfg.attention, attention_options=dict(cfg.attention_options), posenc=cfg.posenc,
                              posenc_options=dict(cfg.posenc_options), isotropic=cfg.isotropic,
                              target_mean=cfg.target_mean, target_std=cfg.target_std,
                              layer_attention=cfg.layer_attention, **fk)
    if cfg.encoder == "transformer+lr":
        wrap_modules(list_slots(model.trunk.blocks), cfg.dim, {"heads": cfg.heads, **cfg.longrange},
                     cfg.longrange_placement, AfterBlock, **fk)
    return model


def _schnet(cfg: ParticleConfig, fk: dict[str, Any]) -> nn.Module:
    return ParticleSchNet(dim=cfg.dim, depth=cfg.depth, cutoff=cfg.cutoff, num_gaussians=cfg.num_gaussians,
                          spacing=cfg.spacing, target_mean=cfg.target_mean, target_std=cfg.target_std,
                          longrange=dict(cfg.longrange) if cfg.encoder == "schnet+lr" else None,
                          longrange_placement=cfg.longrange_placement, heads=cfg.heads, **fk)


#: Builder per ``ParticleConfig.encoder``: ``(config, {"device": ..., "dtype": ...}) -> model``.
PARTICLE_MODELS = {"transformer": _transformer, "schnet": _schnet, "transformer+lr": _transformer, "schnet+lr": _schnet}


def particle_model(config: ParticleConfig, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module:
    """The per-particle model ``config.encoder`` names (:data:`PARTICLE_MODELS`), the one
    place a task with per-particle targets builds its model from a :class:`ParticleConfig`."""
    if not isinstance(config, ParticleConfig):
        raise TypeError(f"particle_model builds from a ParticleConfig, got {type(config).__name__}")
    return PARTICLE_MODELS[config.encoder](config, {"device": device, "dtype": dtype})
