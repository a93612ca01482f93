"""Link prediction: node encoders, a pair scorer, training and ROC AUC, in plain torch.

A :class:`LinkModel` is a node encoder (built from the *training* edges of a
:class:`~flt.graphs.split.LinkSplit` and nothing else) followed by a symmetric pair head:
the logit of ``(u, v)`` is ``MLP([z_u * z_v, |z_u - z_v|])``. Encoders (:data:`MODEL_KINDS`):

* ``gir``: :class:`~flt.graphs.gir.GIRPathEncoder` over ``K`` random anchors.
* ``anchor-distance``: an MLP on the distance features ``1 / (1 + d(v, a_k))``.
* ``gcn``, ``sage``, ``gat``, ``gin``: featureless message passing (:class:`~flt.graphs.gnn.GNN`,
  ``torch_geometric`` convolutions) on the constant node feature; ``+indication`` appends
  the ``K`` anchor-indicator channels to that feature, ``+gir`` fuses the GNN embedding
  with a GIR embedding (concatenation, then a linear map), e.g. ``sage+indication+gir``.
* ``flt``: :class:`~flt.graphs.transformer.GraphTransformer`, FLT attention over all nodes
  with the anchor coordinates as positions in ``R^K`` (linear in ``N``).
* ``softmax-spectrum``: the same transformer with its exact ``O(N^2)`` counterpart,
  softmax attention with the spectrum's exact ``f`` as relative bias.
* ``lap-pe``: :class:`~flt.graphs.transformer.LaplacianPE`, an MLP on Laplacian
  eigenvectors of the training edges (random sign flips in training).

:func:`train_link_model` minimises binary cross-entropy on the training positives and
their fixed negatives with Adam, full batch (FLT's random features redrawn every step,
anchors optionally resampled every step), and reports the test ROC AUC at the step of
best validation AUC; :func:`run_link_prediction` does split, model and training from a
graph, a model kind and a seed. :func:`build_pair_model` and :func:`train_pair_model` are
the same for any structure and any labelled pairs (the pairwise node classification of
:mod:`flt.graphs.pairs` uses them).

:class:`LinkTransformer` is the model of ``flt train graph`` (:mod:`flt.tasks.graph`): the
same pair head on a transformer over all nodes with any :data:`flt.ATTENTION` mechanism
or on a structural encoder (GIR, distances, GNNs), taking the node inputs and the
structure as arguments so that the task's trainer can run it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.layers.draws import fixed_draw, has_random_features, redraw

from .anchors import select_anchors
from .data import Graph, communities, grid_graph
from .gnn import GNN_KINDS, StructuralEncoder, parse_kind
from .split import LinkSplit, split_links
from .transformer import (
    GRAPH_ATTENTIONS,
    GraphTransformer,
    LaplacianPE,
    NodeTransformer,
    anchor_inputs,
)

#: Model kinds of :func:`build_pair_model`: the structural encoders (GIR, the distance MLP
#: and every GNN of :data:`~flt.graphs.gnn.GNN_KINDS`, featureless, with anchor indication,
#: fused with GIR, or both), the graph transformers and the Laplacian baseline.
MODEL_KINDS = (
    "gir",
    "anchor-distance",
    *(g + mod for g in GNN_KINDS for mod in ("", "+indication", "+gir", "+indication+gir")),
    "flt",
    "softmax-spectrum",
    "lap-pe",
)
GRAPHS = {"grid": lambda seed: grid_graph(20), "communities": lambda seed: communities(20, 20, p=0.01, seed=seed)}


def generated_split(graph: str = "grid", *, seed: int = 0) -> LinkSplit:
    """The link split (:func:`~flt.graphs.split.split_links`, seeded by ``seed``) of the
    generated graph ``graph`` of :data:`GRAPHS` (Communities is generated from ``seed`` too)."""
    check_choice("graph", graph, GRAPHS)
    return split_links(GRAPHS[graph](seed), seed=seed)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank formula, ties counted one half.

    With ``R`` the sum of the (tie-averaged, 1-based) ranks of the ``P`` positive scores
    among all ``P + Q`` scores, ``AUC = (R - P (P + 1) / 2) / (P Q)``: the probability
    that a random positive outscores a random negative.
    """
    scores = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
    labels = torch.as_tensor(labels).detach().reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"scores and labels must have the same length, got {scores.numel()} and {labels.numel()}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores contains non-finite values (NaN or inf)")
    pos = labels.to(torch.bool)
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0 or 1")
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"ROC AUC needs both classes, got {n_pos} positive and {n_neg} negative labels")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    end = torch.cumsum(counts, 0).to(torch.float64)
    avg_rank = end - (counts.to(torch.float64) - 1) / 2  # mean of ranks end - c + 1 .. end
    rank_sum = float(avg_rank[inverse][pos].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def gcn_adjacency(num_nodes: int, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``A_hat = D^-1/2 (A + I) D^-1/2`` as ``(src, dst, weight)`` over both directions of
    ``edges`` plus one self-loop per node."""
    loops = torch.arange(num_nodes)
    src = torch.cat([edges[:, 0], edges[:, 1], loops])
    dst = torch.cat([edges[:, 1], edges[:, 0], loops])
    deg = torch.bincount(dst, minlength=num_nodes).to(torch.float64)
    weight = (deg[src] * deg[dst]).rsqrt()
    return src, dst, weight


def gcn_propagate(x: torch.Tensor, adjacency: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``A_hat @ x`` for ``x [N, C]``: ``out[v] = sum_{u -> v} w_uv x[u]``."""
    src, dst, weight = adjacency
    return x.new_zeros(x.shape).index_add_(0, dst, x[src] * weight.to(x.dtype).unsqueeze(-1))


class GCN(nn.Module):
    """``layers`` GCN layers ``H' = A_hat H W + b``, ReLU between them: ``forward(x [N, F]) -> [N, out_dim]``.

    A node's output depends only on inputs within ``layers`` hops of it.
    """

    def __init__(self, num_nodes: int, edges: torch.Tensor, in_dim: int, *, hidden: int = 32, out_dim: int = 32, layers: int = 3):
        super().__init__()
        check_positive_int("layers", layers)
        self.num_nodes = num_nodes
        self.adjacency = gcn_adjacency(num_nodes, edges)
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.linears):
            x = gcn_propagate(lin(x), self.adjacency)
            if i < len(self.linears) - 1:
                x = F.relu(x)
        return x


class _Encoder(nn.Module):
    """Node embeddings ``[N, dim]`` from structure fixed at construction; ``forward()`` takes no input.

    The anchors of the structural kinds (:class:`~flt.graphs.gnn.StructuralEncoder`) can be
    redrawn in training (:meth:`resample_anchors`); evaluation uses the anchors drawn at
    construction (:meth:`fixed_anchors`).
    """

    def __init__(self, kind: str, num_nodes: int, train_edges: torch.Tensor, anchors: torch.Tensor, dim: int, options: dict, seed: int = 0):
        super().__init__()
        self.kind, self.num_nodes = kind, num_nodes
        self.edges, self.anchors, self.initial_anchors = train_edges, anchors, anchors
        if kind in GRAPH_ATTENTIONS:
            self.x, self.pos = anchor_inputs(num_nodes, train_edges, anchors)
            self.net: GraphTransformer | LaplacianPE | StructuralEncoder = GraphTransformer(
                len(anchors), len(anchors), attention=kind, out_dim=dim, **options)
        elif kind == "lap-pe":
            self.net = LaplacianPE(num_nodes, train_edges, out_dim=dim, seed=seed, **options)
        else:
            base, flags = parse_kind(kind)
            if base == "gir":  # the GIR encoder's own option names
                for key in ("hidden", "combine", "aggregation", "norm"):
                    if key in options:
                        options["gir_" + key] = options.pop(key)
            gir_options = {"gir_hidden", "gir_steps", "gir_combine", "gir_aggregation", "gir_norm"}
            allowed = {"gir": gir_options, "anchor-distance": {"hidden"}}.get(
                base, {"hidden", "layers", "heads"} | (gir_options if flags["fusion"] else set()))
            if set(options) - allowed:
                raise ValueError(f"unknown option(s) for model kind {kind!r}: {sorted(set(options) - allowed)}")
            self.net = StructuralEncoder(base, len(anchors), dim=dim, **flags, **options)

    @property
    def structural(self) -> bool:
        return isinstance(self.net, StructuralEncoder)

    def resample_anchors(self, seed: int) -> None:
        """Draw ``K`` new anchors from ``seed`` (uniformly) for the next calls."""
        if self.structural:
            self.anchors = select_anchors(self.num_nodes, len(self.initial_anchors), seed=seed)

    def fixed_anchors(self) -> None:
        """Go back to the anchors drawn at construction."""
        self.anchors = self.initial_anchors

    def forward(self) -> torch.Tensor:
        if self.kind in GRAPH_ATTENTIONS:
            return self.net(self.x, self.pos)
        if self.kind == "lap-pe":
            return self.net()
        return self.net(self.num_nodes, self.edges, self.anchors)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> _Encoder:
        # The fixed inputs are plain attributes; cast them along with the parameters
        # (model.double() must give a float64 model end to end).
        out = super()._apply(fn, *args, **kwargs)
        for name in ("x", "pos"):
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                setattr(self, name, fn(t))
        return out


class PairHead(nn.Sequential):
    """The symmetric pair scorer: ``forward(z [N, D], pairs [M, 2]) -> logits [M]``, the
    logit of ``(u, v)`` being ``MLP([z_u * z_v, |z_u - z_v|])`` (hidden width ``D``)."""

    def __init__(self, dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(nn.Linear(2 * dim, dim, **fk), nn.ReLU(), nn.Linear(dim, 1, **fk))

    # A pair scorer's signature, not Sequential's: subclassing Sequential keeps the
    # parameter names ("0.weight", ...) of saved models.
    def forward(self, z: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        zu, zv = z[pairs[:, 0]], z[pairs[:, 1]]
        return super().forward(torch.cat([zu * zv, (zu - zv).abs()], dim=-1)).squeeze(-1)


class LinkModel(nn.Module):
    """A node encoder and a symmetric pair head; ``forward(pairs [M, 2]) -> logits [M]``."""

    def __init__(self, encoder: nn.Module, dim: int):
        super().__init__()
        self.encoder = encoder
        self.head = PairHead(dim)

    def embeddings(self) -> torch.Tensor:
        return self.encoder()

    def score(self, z: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        return self.head(z, pairs)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.score(self.embeddings(), pairs)


def gir_positions(z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Positions ``[N, P]`` from node embeddings ``z [N, D]``: ``LN(z) @ basis`` with ``LN`` the
    LayerNorm without affine parameters and ``basis [D, P]`` (orthonormal columns)."""
    if z.ndim != 2 or basis.ndim != 2 or basis.shape[0] != z.shape[1]:
        raise ValueError(f"z must be [N, D] and basis [D, P] with the same D, got {tuple(z.shape)} and {tuple(basis.shape)}")
    return F.layer_norm(z, (z.shape[1],)) @ basis.to(z.dtype)


#: ``encoder`` choices of :class:`LinkTransformer` (``flt train graph --model-opt encoder=...``).
TASK_ENCODERS = ("transformer", "gir", "indicator", "anchor-distance", *GNN_KINDS)


class LinkTransformer(nn.Module):
    """The pair model of ``flt train graph``: node embeddings of any encoder and the :class:`PairHead`.

    ``forward(features [N, K], pos [N, K], edges [E, 2], anchors [K], pairs [M, 2], *,
    exact=False) -> logits [M]``. ``features`` and ``pos`` are the distance features and
    anchor coordinates of :func:`~flt.graphs.transformer.anchor_inputs`, ``edges`` the
    structure (the training edges) and ``anchors`` the anchor ids they were computed from.
    The node embeddings ``[N, out_dim]`` come from ``encoder`` (:data:`TASK_ENCODERS`):

    * ``"transformer"`` (the default): a :class:`~flt.graphs.transformer.NodeTransformer`
      on ``features`` at positions ``pos``, ``depth`` layers of the mechanism
      ``attention`` of :data:`flt.ATTENTION` with ``attention_options``, over all ``N``
      nodes; ``exact=True`` uses every layer's exact attention;
    * ``"gir"``, ``"anchor-distance"``, ``"gcn"``, ``"sage"``, ``"gat"``, ``"gin"``: a
      :class:`~flt.graphs.gnn.StructuralEncoder` of ``(edges, anchors)`` (``exact`` has no
      effect), the GNNs with ``gnn_layers`` layers, anchor indication if ``indication`` and
      fused with GIR if ``fusion``; ``"indicator"`` is ``"gcn"`` with anchor indication.
      GIR has per-anchor states of size ``gir_hidden`` and reach ``gir_steps`` (0: every
      level).

    ``in_dim`` is the width of ``features`` and ``pos`` (0: ``num_anchors``). With
    ``gir_positions = P > 0`` the transformer attends at learned positions instead of
    ``pos``: a :class:`~flt.graphs.gir.GIRPathEncoder` of ``(edges, anchors)`` (state size
    ``gir_hidden``, reach ``gir_steps``, embedding ``dim``), trained with the rest of the
    model, gives ``z_v``, and ``r_v = LN(z_v) Pi`` with ``LN`` a LayerNorm without affine
    parameters and ``Pi [dim, P]`` a fixed matrix with orthonormal columns drawn at
    construction (a persistent buffer), so every axis has about unit variance and the
    spectrum's length scales keep their meaning. The gradient of the attention reaches
    GIR through the positions (:func:`gir_positions`). ``layer_attention`` (one
    ``{"attention": NAME, "attention_options": {...}}`` per layer) replaces ``attention``
    and ``attention_options`` layer by layer (``flt train graph --arch``).

    The keyword arguments are the fields of :class:`flt.tasks.graph.GraphConfig`; the
    transformer's other trunk fields (``mlp_ratio``, ``dropout``, ``attention``,
    ``posenc`` and their options) come as ``**trunk``, which the GNN encoders do not read.
    """

    position_basis: torch.Tensor  # buffer [in_dim, gir_positions], when gir_positions > 0

    def __init__(self, *, num_anchors: int, dim: int, depth: int, heads: int, out_dim: int, encoder: str = "transformer",
                 gnn_layers: int = 3, indication: bool = False, fusion: bool = False, gir_hidden: int = 16, gir_steps: int = 0,
                 in_dim: int = 0, gir_positions: int = 0, layer_attention: list | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **trunk: Any):
        super().__init__()
        check_choice("encoder", encoder, TASK_ENCODERS)
        self.encoder_kind = encoder
        self.position_encoder: StructuralEncoder | None = None
        if gir_positions and encoder != "transformer":
            raise ValueError(f"gir_positions applies to encoder='transformer', got encoder={encoder!r}")
        if layer_attention is not None and encoder != "transformer":
            raise ValueError(f"layer_attention applies to encoder='transformer', got encoder={encoder!r}")
        if encoder == "transformer":
            if indication or fusion:
                raise ValueError("indication and fusion apply to the GNN encoders, not to encoder='transformer'")
            in_dim = in_dim or num_anchors
            if gir_positions:
                if gir_positions > dim:
                    raise ValueError(f"gir_positions (P = {gir_positions}) must not exceed dim ({dim}): Pi has orthonormal columns")
                self.position_encoder = StructuralEncoder("gir", num_anchors, dim=dim, gir_hidden=gir_hidden,
                                                       gir_steps=gir_steps or None).to(device=device, dtype=dtype)
                basis, _ = torch.linalg.qr(torch.randn(dim, gir_positions, dtype=torch.float64))
                self.register_buffer("position_basis", basis.to(device=device, dtype=dtype or torch.get_default_dtype()))
            self.encoder: NodeTransformer | StructuralEncoder = NodeTransformer(
                in_dim, gir_positions or in_dim, dim=dim, heads=heads, layers=depth, out_dim=out_dim,
                layer_attention=layer_attention, device=device, dtype=dtype, **trunk,
            )
        else:
            base = "gcn" if encoder == "indicator" else encoder
            if gir_steps < 0:
                raise ValueError(f"gir_steps must be 0 (every level) or a positive integer, got {gir_steps}")
            self.encoder = StructuralEncoder(
                base, num_anchors, dim=out_dim, hidden=dim, layers=gnn_layers, heads=heads,
                indication=indication or encoder == "indicator", fusion=fusion, gir_hidden=gir_hidden,
                gir_steps=gir_steps or None,
            ).to(device=device, dtype=dtype)
        self.head = PairHead(out_dim, device=device, dtype=dtype)

    def embeddings(self, features: torch.Tensor, pos: torch.Tensor, edges: torch.Tensor, anchors: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """Node embeddings ``[N, out_dim]``."""
        if self.encoder_kind == "transformer":
            if self.position_encoder is not None:
                pos = self.learned_positions(features.shape[0], edges, anchors)
            return self.encoder(features, pos, exact=exact)
        return self.encoder(features.shape[0], edges, anchors)

    def learned_positions(self, num_nodes: int, edges: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The GIR positions ``[N, P]`` of ``gir_positions = P``: ``LN(GIR(edges, anchors)) Pi``."""
        if self.position_encoder is None:
            raise ValueError("this model attends at the positions it is given (gir_positions = 0)")
        return gir_positions(self.position_encoder(num_nodes, edges, anchors), self.position_basis)

    def forward(self, features: torch.Tensor, pos: torch.Tensor, edges: torch.Tensor, anchors: torch.Tensor, pairs: torch.Tensor,
                *, exact: bool = False) -> torch.Tensor:
        return self.head(self.embeddings(features, pos, edges, anchors, exact=exact), pairs)


def build_pair_model(kind: str, num_nodes: int, edges: torch.Tensor, *, seed: int = 0, num_anchors: int = 64, dim: int = 32, stratified: bool = False, **options: Any) -> LinkModel:
    """A :class:`LinkModel` of the given kind over ``num_nodes`` nodes whose structure is ``edges`` and nothing else.

    Anchors (``num_anchors`` of them, capped at ``N``) and the initial weights are drawn
    from ``seed``; the global torch generator is left as it was. ``options`` go to the
    encoder (``hidden``, ``gir_steps`` (the propagation depth ``T``), ``combine``, ``aggregation`` for ``gir``; ``hidden``,
    ``layers``, ``heads`` (GAT) and, with ``+gir``, ``gir_hidden``, ``gir_steps``, ``gir_combine`` for the GNNs; ``hidden`` for ``anchor-distance``; the arguments of
    :class:`~flt.graphs.transformer.GraphTransformer` for ``flt`` and ``softmax-spectrum``;
    ``k``, ``hidden``, ``sign_flip`` for ``lap-pe``, which ignores the anchors).
    """
    check_choice("kind", kind, MODEL_KINDS)
    check_positive_int("num_anchors", num_anchors)
    n = num_nodes
    anchors = select_anchors(n, min(num_anchors, n), seed=seed, edges=edges, stratified=stratified)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = _Encoder(kind, n, edges, anchors, dim, dict(options), seed=seed)
        return LinkModel(encoder, dim)


def build_link_model(kind: str, split: LinkSplit, *, seed: int = 0, num_anchors: int = 64, dim: int = 32, stratified: bool = False, **options: Any) -> LinkModel:
    """A :class:`LinkModel` of the given kind whose structure comes from ``split.train_pos`` only
    (:func:`build_pair_model` with ``edges = split.train_pos``)."""
    check_choice("kind", kind, MODEL_KINDS)
    if not isinstance(split, LinkSplit):
        raise TypeError(f"split must be a flt.graphs.LinkSplit, got {type(split).__name__}")
    return build_pair_model(kind, split.num_nodes, split.train_pos, seed=seed, num_anchors=num_anchors, dim=dim, stratified=stratified, **options)


@dataclass
class LinkResult:
    """Outcome of :func:`train_link_model`: the test ROC AUC at the best validation step."""

    test_auc: float
    valid_auc: float
    best_step: int
    history: list = field(default_factory=list)  # (step, valid_auc, test_auc)


def train_pair_model(model: LinkModel, train: tuple, valid: tuple, test: tuple, *, steps: int = 200, lr: float = 0.01, eval_every: int = 10, seed: int = 0,
                     resample_anchors: bool = False, redraw_features: bool = True) -> LinkResult:
    """Full-batch BCE training with Adam on ``train = (pairs [M, 2], labels [M])``;
    evaluate the ROC AUC on ``valid`` and ``test`` every ``eval_every`` steps and at the end.

    Returns the test AUC at the evaluation with the highest validation AUC (the first one on
    ties). Random draws in training, all from generators seeded by ``seed`` (the global
    torch generator is left as it was):

    * ``redraw_features``: a model with random features (FLT, Performer) gets a new draw
      before every step (:func:`flt.layers.draws.redraw`, as ``flt train`` does) and is
      evaluated on the fixed draw of ``seed`` (:func:`flt.layers.draws.fixed_draw`);
    * ``resample_anchors``: every step (one step is one epoch, full batch) draws ``K`` new
      anchors for the structural encoders; evaluation uses the anchors of construction.
    """
    check_positive_int("steps", steps)
    check_positive_int("eval_every", eval_every)
    (train_pairs, train_y), (valid_pairs, valid_y), (test_pairs, test_y) = train, valid, test
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best = LinkResult(test_auc=float("nan"), valid_auc=-1.0, best_step=0)
    draws = redraw_features and has_random_features(model)
    draw_gen = torch.Generator().manual_seed(seed)
    found = getattr(model, "encoder", None)
    encoder = found if isinstance(found, _Encoder) else None
    if resample_anchors and (encoder is None or not encoder.structural):
        raise ValueError("resample_anchors=True needs a structural model kind (gir, anchor-distance or a GNN)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(1, steps + 1):
            model.train()
            if draws:
                redraw(model, draw_gen)
            if resample_anchors and encoder is not None:  # not None: checked above
                encoder.resample_anchors(seed * 1_000_003 + step)
            loss = F.binary_cross_entropy_with_logits(model(train_pairs), train_y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % eval_every == 0 or step == steps:
                model.eval()
                if encoder is not None:
                    encoder.fixed_anchors()
                with torch.no_grad(), fixed_draw(model, seed):
                    z = model.embeddings()
                    valid_auc = roc_auc(model.score(z, valid_pairs), valid_y)
                    test_auc = roc_auc(model.score(z, test_pairs), test_y)
                best.history.append((step, valid_auc, test_auc))
                if valid_auc > best.valid_auc:
                    best.test_auc, best.valid_auc, best.best_step = test_auc, valid_auc, step
    return best


def train_link_model(model: LinkModel, split: LinkSplit, *, steps: int = 200, lr: float = 0.01, eval_every: int = 10, seed: int = 0, **training: Any) -> LinkResult:
    """:func:`train_pair_model` on the training positives and their fixed negatives,
    validated and tested on the held-out pairs of ``split``."""
    return train_pair_model(model, split.train, split.valid, split.test, steps=steps, lr=lr, eval_every=eval_every, seed=seed, **training)


def run_link_prediction(graph: Graph | str, model_kind: str, seed: int = 0, steps: int = 200, *, lr: float = 0.01, eval_every: int = 10,
                        resample_anchors: bool = False, redraw_features: bool = True, **model_options: Any) -> LinkResult:
    """Split ``graph`` (a :class:`Graph`, ``"grid"`` or ``"communities"``) with ``seed``, build
    a ``model_kind`` model (:data:`MODEL_KINDS`) with ``seed`` and train it for ``steps``
    steps; ``result.test_auc`` is the ROC AUC at the best validation step.

    A graph given by name is generated with :data:`GRAPHS` (Communities from ``seed``).
    """
    split = generated_split(graph, seed=seed) if isinstance(graph, str) else split_links(graph, seed=seed)
    model = build_link_model(model_kind, split, seed=seed, **model_options)
    return train_link_model(model, split, steps=steps, lr=lr, eval_every=eval_every, seed=seed,
                            resample_anchors=resample_anchors, redraw_features=redraw_features)
