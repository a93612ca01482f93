"""Graph transformers over anchor coordinates, and a Laplacian-eigenvector baseline.

Anchor coordinates make a graph a point set in ``R^K``: node ``v`` sits at
``r_v = d(v, .) / sqrt(K)``, its hop distances to the ``K`` anchors (:func:`anchor_coordinates`).
A node that an anchor cannot reach gets the coordinate ``(d_max + 1) / sqrt(K)`` on that
axis, ``d_max`` the largest finite distance of the matrix: "farther than every reachable
node", a finite value the spectrum can work with. On a bipartite graph such as the grid,
neighbours differ by exactly one hop on every axis, so ``|r_u - r_v| = 1``; the
``1 / sqrt(K)`` keeps that unit independent of ``K``.

:class:`NodeTransformer` embeds every node from its features, for anchor coordinates the
distance features ``1 / (1 + d)`` (:func:`flt.graphs.anchors.distance_features`, as the
``anchor-distance`` MLP does; :func:`anchor_inputs` gives both), and runs a few pre-norm
layers of attention over *all* nodes with these coordinates as positions; the attention is
any :data:`flt.ATTENTION` mechanism with its options (``flt train graph``,
:class:`flt.graphs.link.LinkTransformer`). :class:`GraphTransformer` builds it with the
attention of one of the link benchmarks' two kinds:

* ``attention="flt"``: :class:`flt.FLTAttention` with ``pos_dim = K``, a Gaussian spectrum
  ``f(Delta) = a exp(-|Delta / l|^2 / 2)`` (per head and per axis ``l``, learned) and the
  logit coupling, i.e. softmax attention with a learned relative bias in anchor space,
  estimated with random features in time linear in ``N``.
* ``attention="softmax-spectrum"``: its exact ``O(N^2)`` counterpart,
  :class:`flt.layers.SoftmaxAttention` with ``relative_bias="spectrum"`` and the same
  spectrum options (the pairing ``flt`` / ``softmax:relative_bias=spectrum`` of the
  training presets). The Gaussian spectrum computes its exact bias on ``K > 3``
  coordinates by a matmul (:meth:`flt.relative.spectra.GaussianKernelSpectrum.pairwise`), without
  the ``[N, N, K]`` tensor of differences.

:class:`LaplacianPE` is the positional baseline: the first ``k`` nontrivial eigenvectors of
the normalised Laplacian of the training edges, fed to an MLP. An eigenvector is defined
only up to its sign, so in training mode every forward call flips each eigenvector's sign
at random (the same flip for all nodes, drawn from the encoder's own seeded generator);
in eval mode the signs are those ``torch.linalg.eigh`` returned. Repeated eigenvalues (the
grid has many) leave a whole basis of the eigenspace arbitrary; the sign flips do not
address that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.models.block import build_attention, build_posenc, feed_forward, layer_mechanisms

from .anchors import UNREACHABLE, _check_edges, anchor_distances, distance_features

#: ``attention=`` choices of :class:`GraphTransformer`.
GRAPH_ATTENTIONS = ("flt", "softmax-spectrum")
#: How a :class:`GraphTransformer` evaluates its attention: the layer's forward (``"fast"``:
#: linear time for FLT), the same random features through the ``O(N^2)`` formula
#: (``"reference"``), or the exact attention the features estimate (``"exact"``).
ATTENTION_MODES = ("fast", "reference", "exact")


def anchor_coordinates(dist: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Node positions ``[N, K]`` in ``R^K`` from anchor distances ``dist [N, K]``: ``d / sqrt(K)``,
    with :data:`UNREACHABLE` entries replaced by ``d_max + 1`` (``d_max`` the largest finite
    distance) before scaling."""
    if dist.ndim != 2 or dist.is_floating_point():
        raise ValueError(f"dist must be an integer [N, K] tensor of hop distances, got {dist.dtype} of shape {tuple(dist.shape)}")
    far = int(dist.max()) + 1
    d = torch.where(dist == UNREACHABLE, torch.full_like(dist, far), dist)
    return d.to(dtype) / math.sqrt(dist.shape[1])


def anchor_inputs(num_nodes: int, edges: torch.Tensor, anchors: torch.Tensor | Sequence[int], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [N, K], pos [N, K])`` of a :class:`NodeTransformer` over anchor space: the
    distance features ``1 / (1 + d)`` and the coordinates :func:`anchor_coordinates` of the
    hop distances ``d`` to ``anchors`` along ``edges`` (pass the training edges only)."""
    dist = anchor_distances(num_nodes, edges, anchors)
    return distance_features(dist, dtype), anchor_coordinates(dist, dtype)


class _Checkable(Protocol):
    """An attention layer with the O(N^2) forms its fast path is checked against."""

    def reference(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...

    def exact(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...


class _Block(nn.Module):
    """Pre-norm transformer layer: ``h + attn(LN(h), pos)``, then ``h + MLP(LN(h))``.

    :class:`flt.models.Block`'s computation with the same MLP (:func:`~flt.models.block.feed_forward`),
    kept apart for what graph runs saved: the attention under ``attention`` (the trunk's block
    names it ``attn``), the parameters in the order ``norm1``, ``norm2``, ``attention``, ``mlp``
    (which a saved optimizer state follows), and the ``"reference"`` mode of
    :data:`ATTENTION_MODES`."""

    def __init__(self, attention: nn.Module, dim: int, *, mlp_ratio: float = 2.0, dropout: float = 0.0, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.norm1, self.norm2 = nn.LayerNorm(dim, **fk), nn.LayerNorm(dim, **fk)
        self.attention = attention
        self.mlp = feed_forward(dim, mlp_ratio, **fk)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, mode: str) -> torch.Tensor:
        x = self.norm1(h)
        if mode == "fast":
            a = self.attention(x, pos)
        elif mode == "reference":
            a = cast(_Checkable, self.attention).reference(x, pos)
        else:
            a = cast(_Checkable, self.attention).exact(x, pos)
        h = h + self.drop(a)
        return h + self.drop(self.mlp(self.norm2(h)))


class NodeTransformer(nn.Module):
    """Attention over all nodes of a graph at given positions, with any :data:`flt.ATTENTION` mechanism.

    ``forward(features [N, F], pos [N, P], *, exact=False) -> [N, out_dim]``: the node
    features are embedded by a linear map (plus the absolute encoding ``posenc`` of
    ``pos``, :data:`flt.posenc.POSENC`; ``"none"`` adds nothing), pass ``layers`` pre-norm
    transformer layers whose attention ``ATTENTION[attention].from_options(dim, heads, pos_dim=P,
    **attention_options)`` spans all ``N`` nodes at positions ``pos``, and a final
    LayerNorm and linear map. :attr:`mode` (:data:`ATTENTION_MODES`) chooses how the
    attention is evaluated; ``exact=True`` evaluates this call in ``"exact"`` mode whatever
    :attr:`mode` is (what the trainer's draw gap asks for).

    Args:
        in_dim, pos_dim: ``F`` and ``P`` (``K`` for both with anchor features and coordinates).
        attention, attention_options: a mechanism name and its constructor options.
        dim, heads, layers, out_dim: width, heads per layer, depth, output size.
        mlp_ratio, dropout: hidden width of each MLP over ``dim``; dropout after attention and MLP.
        posenc, posenc_options: an absolute encoding of the positions, added to the embedding.
        layer_attention: None, or one ``{"attention": NAME, "attention_options": {...}}``
            per layer, replacing ``attention`` and ``attention_options`` layer by layer.
    """

    def __init__(
        self,
        in_dim: int,
        pos_dim: int,
        *,
        attention: str,
        attention_options: dict[str, Any] | None = None,
        dim: int = 32,
        heads: int = 2,
        layers: int = 2,
        out_dim: int = 32,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
        posenc: str = "none",
        posenc_options: dict[str, Any] | None = None,
        layer_attention: list[dict[str, Any]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_positive_int("layers", layers)
        mechanisms = layer_mechanisms(attention, attention_options, layer_attention, layers)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.mode = "fast"
        self.embed = nn.Linear(in_dim, dim, **fk)
        self.posenc = build_posenc(posenc, dim, pos_dim, dict(posenc_options or {}), **fk)
        self.blocks = nn.ModuleList(
            _Block(build_attention(name, dim, heads, pos_dim=pos_dim, causal=False, options=options, **fk),
                   dim, mlp_ratio=mlp_ratio, dropout=dropout, **fk)
            for name, options in mechanisms
        )
        self.norm = nn.LayerNorm(dim, **fk)
        self.out = nn.Linear(dim, out_dim, **fk)

    def forward(self, features: torch.Tensor, pos: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        mode = "exact" if exact else self.mode
        check_choice("mode", mode, ATTENTION_MODES)
        h = self.embed(features).unsqueeze(0)  # one "sequence" of N nodes
        pos = pos.unsqueeze(0).to(h.dtype)
        h = h + self.posenc(pos).to(h.dtype)
        for block in self.blocks:
            h = block(h, pos, mode)
        return self.out(self.norm(h)).squeeze(0)


def graph_attention(kind: str, *, spectrum: str = "gaussian", length_scale: float = 2.0, amplitude: float = 1.0,
                    num_features: int = 64, num_frequencies: int = 32, coupling: str = "logit") -> tuple[str, dict[str, Any]]:
    """``(name, options)`` in :data:`flt.ATTENTION` of a :data:`GRAPH_ATTENTIONS` kind: ``"flt"``
    is FLT with the given spectrum, ``"softmax-spectrum"`` softmax with the same spectrum's
    exact ``f`` as relative bias (``num_features`` is FLT's only)."""
    check_choice("attention", kind, GRAPH_ATTENTIONS)
    spec = {"spectrum": spectrum, "coupling": coupling, "num_frequencies": num_frequencies, "length_scale": length_scale, "amplitude": amplitude}
    if kind == "flt":
        return "flt", {"num_features": num_features, **spec}
    return "softmax", {"relative_bias": "spectrum", **spec}


class GraphTransformer(NodeTransformer):
    """The :class:`NodeTransformer` of the link benchmarks' ``flt`` and ``softmax-spectrum``
    kinds (module docstring): ``forward(features [N, K], pos [N, K]) -> [N, out_dim]``.

    Args:
        in_dim, pos_dim: ``K`` for both with anchor features and coordinates.
        attention: ``"flt"`` or ``"softmax-spectrum"`` (:func:`graph_attention`).
        dim, heads, layers, out_dim: width, heads per layer, depth, output size.
        spectrum, length_scale, amplitude: the spectrum of both kinds (Gaussian, ``l = 2``
            coordinate units, i.e. about two hops on the grid, ``f(0) = 1`` at start).
        num_features, num_frequencies, coupling: FLT's ``m``, ``R`` and coupling
            (``num_frequencies`` is kept but unused by the exact counterpart).
    """

    def __init__(
        self,
        in_dim: int,
        pos_dim: int,
        *,
        attention: str = "flt",
        dim: int = 32,
        heads: int = 2,
        layers: int = 2,
        out_dim: int = 32,
        spectrum: str = "gaussian",
        length_scale: float = 2.0,
        amplitude: float = 1.0,
        num_features: int = 64,
        num_frequencies: int = 32,
        coupling: str = "logit",
    ):
        name, options = graph_attention(attention, spectrum=spectrum, length_scale=length_scale, amplitude=amplitude,
                                        num_features=num_features, num_frequencies=num_frequencies, coupling=coupling)
        super().__init__(in_dim, pos_dim, attention=name, attention_options=options, dim=dim, heads=heads, layers=layers, out_dim=out_dim)
        self.attention_kind = attention


def laplacian_eigenvectors(num_nodes: int, edges: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` nontrivial eigenpairs of ``L = I - D^-1/2 A D^-1/2`` of ``edges``.

    Returns ``(values [k], vectors [N, k])`` in float64, eigenvalues ascending, skipping the
    smallest one (``0``, eigenvector ``D^1/2 1`` on a connected graph); isolated nodes get
    ``D^-1/2 = 0``. ``k`` is capped at ``N - 1``. Dense ``eigh``: for graphs of a few
    thousand nodes.
    """
    check_positive_int("k", k)
    edges = _check_edges(edges, num_nodes)
    adj = torch.zeros(num_nodes, num_nodes, dtype=torch.float64)
    adj[edges[:, 0], edges[:, 1]] = 1.0
    adj[edges[:, 1], edges[:, 0]] = 1.0
    deg = adj.sum(1)
    inv_sqrt = torch.where(deg > 0, deg.clamp(min=1).rsqrt(), torch.zeros_like(deg))
    lap = torch.eye(num_nodes, dtype=torch.float64) - inv_sqrt[:, None] * adj * inv_sqrt[None, :]
    values, vectors = torch.linalg.eigh(lap)
    k = min(k, num_nodes - 1)
    return values[1 : k + 1], vectors[:, 1 : k + 1]


def random_walk_encoding(num_nodes: int, edges: torch.Tensor, steps: int) -> torch.Tensor:
    """Random-walk structural encodings: ``[N, steps]`` float64, entry ``(v, t - 1)`` the
    probability that a simple random walk from ``v`` is back at ``v`` after ``t`` steps,
    the diagonal of ``(D^-1 A)^t`` for ``t = 1 .. steps`` (Dwivedi et al. 2022, "Graph
    Neural Networks with Learnable Structural and Positional Representations").

    ``A`` is the adjacency of ``edges`` (pass the training edges only); an isolated node
    has no walk and gets zeros. Dense ``N x N`` products: for graphs of a few thousand nodes.
    """
    check_positive_int("steps", steps)
    edges = _check_edges(edges, num_nodes)
    adj = torch.zeros(num_nodes, num_nodes, dtype=torch.float64)
    adj[edges[:, 0], edges[:, 1]] = 1.0
    adj[edges[:, 1], edges[:, 0]] = 1.0
    deg = adj.sum(1, keepdim=True)
    walk = torch.where(deg > 0, adj / deg.clamp(min=1), torch.zeros_like(adj))  # D^-1 A, row-stochastic
    out, power = [], walk
    for _ in range(steps):
        out.append(power.diagonal())
        power = power @ walk
    return torch.stack(out, dim=1)


def standardize_columns(x: torch.Tensor) -> torch.Tensor:
    """``x [N, C]`` with every column shifted to mean 0 and scaled to standard deviation 1
    over the nodes; a constant column (e.g. odd walk lengths on a bipartite graph) becomes 0."""
    centred = x - x.mean(0, keepdim=True)
    std = centred.pow(2).mean(0, keepdim=True).sqrt()
    return torch.where(std > 1e-12, centred / std.clamp(min=1e-12), torch.zeros_like(centred))


class LaplacianPE(nn.Module):
    """An MLP on Laplacian eigenvectors with random sign flips in training (module docstring).

    ``forward() -> [N, out_dim]``. The eigenvectors (unit norm) are scaled by ``sqrt(N)`` so
    that their entries are of order one. The flips come from a generator seeded with
    ``seed``, so training is reproducible and the global generator is not touched.
    """

    pe: torch.Tensor  # buffer [N, k]

    def __init__(self, num_nodes: int, edges: torch.Tensor, *, k: int = 32, hidden: int = 64, out_dim: int = 32, sign_flip: bool = True, seed: int = 0):
        super().__init__()
        _, vectors = laplacian_eigenvectors(num_nodes, edges, k)
        self.register_buffer("pe", (vectors * math.sqrt(num_nodes)).to(torch.get_default_dtype()), persistent=False)
        self.sign_flip = bool(sign_flip)
        self.generator = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(self.pe.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, out_dim))

    def features(self) -> torch.Tensor:
        """The eigenvector features ``[N, k]``, sign-flipped per column in training mode."""
        if not (self.training and self.sign_flip):
            return self.pe
        signs = torch.randint(0, 2, (self.pe.shape[1],), generator=self.generator).to(self.pe.dtype) * 2 - 1
        return self.pe * signs

    def forward(self) -> torch.Tensor:
        return self.net(self.features())


__all__ = [
    "ATTENTION_MODES",
    "GRAPH_ATTENTIONS",
    "GraphTransformer",
    "LaplacianPE",
    "NodeTransformer",
    "anchor_coordinates",
    "anchor_inputs",
    "graph_attention",
    "laplacian_eigenvectors",
    "random_walk_encoding",
    "standardize_columns",
]
