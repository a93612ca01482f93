"""``graph``: link prediction or pairwise node classification from node embeddings of any
graph encoder (binary cross-entropy; ROC AUC on the validation pairs).

Data options: ``graph`` (``"grid"``, the 20 x 20 grid, the default, or ``"communities"``,
20 cliques of 20 nodes with rewired edges; both generated, :mod:`flt.graphs.data`),
``path`` (a graph file instead: a text edge list ``u v`` per line or a PyTorch Geometric
``.pt`` file, :func:`flt.graphs.load_graph`), ``task`` (``"link"``, the default: held-out
edges against as many non-edges; ``"pair"``: are two nodes in the same community, on a
graph with node labels, with every edge as structure), ``num_pairs`` (labelled pairs of
``task=pair``, default 2000), ``seed`` (generates Communities, draws the split with its
negatives or the labelled pairs, and the anchors; the run's ``--seed`` is separate),
``num_anchors`` (``K``, default 64, capped at the number of nodes) and
``resample_anchors`` (``true``: new anchors every epoch of training pairs, drawn from
``seed`` and the epoch; validation keeps the anchors of ``seed``), ``positions`` (the node
inputs of the transformer, :data:`POSITIONS`, below), ``walk_steps`` (``S`` of
``positions=rwse``, default 16) and ``eigenvectors`` (``k`` of ``positions=laplacian``,
default 16). Distances, anchors, encodings and positions use the structure edges only
(for links, the training edges).

With ``positions=anchor`` (the default) every node ``v`` is a token at position
``r_v = d(v, .) / sqrt(K)`` in ``R^K`` (``P = K``), its hop distances to the anchors
(:func:`flt.graphs.anchor_coordinates`), with distance features ``1 / (1 + d)``. The
baselines give the transformer one structural encoding as both its node features and its
positions: ``rwse``, the random-walk return probabilities of ``S`` steps
(:func:`flt.graphs.random_walk_encoding`), each column standardised over the nodes
(``P = S``); ``laplacian``, the first ``k`` nontrivial eigenvectors of the normalised
Laplacian scaled by ``sqrt(N)`` (``P = k``), each eigenvector's sign flipped at random in
every training batch (drawn from the run seed and the step; validation and test use the
signs ``eigh`` returned), since an eigenvector is defined up to its sign. The model (:class:`flt.graphs.LinkTransformer`) embeds all ``N``
nodes, by default by attention over all of them at these positions (``--model-opt
encoder=...`` picks GIR, the distance MLP or a GNN instead), and scores a pair ``(u, v)``
from the two embeddings. A training batch is ``batch_size`` labelled pairs; every step
embeds all nodes. ROC AUC is not a sum over batches, so validation is one batch holding
every validation pair. See docs/graphs.md for the design and the benchmarks.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flt._checks import check_choice, check_positive_int
from flt.graphs import (
    LinkTransformer,
    anchor_inputs,
    communities,
    generated_split,
    grid_graph,
    laplacian_eigenvectors,
    load_graph,
    random_walk_encoding,
    roc_auc,
    select_anchors,
    split_links,
    split_node_pairs,
    standardize_columns,
)
from flt.graphs.link import TASK_ENCODERS
from flt.layers import ATTENTION
from flt.models import replace_fields
from flt.models.config import LayeredConfig
from flt.tasks.base import (
    Presets,
    Shortcuts,
    Task,
    epoch_indices,
    eval_slices,
    mechanism_options,
    shard,
)
from flt.tasks.holdout import labelled, permutation, split_indices
from flt.tasks.preset import Preset, RunConfig

#: ``(features [N, F], pos [N, P], edges [E, 2], anchors [K])``: the graph every batch encodes.
NodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: The graph's :data:`NodeInputs`, then ``pairs [B, 2]`` and their ``labels [B]``.
GraphBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

#: FLT: the Gaussian spectrum of docs/graphs.md (per head and per axis length scale,
#: ``l = 2`` coordinate units, about two grid hops, ``f(0) = 1`` at the start) with the
#: logit coupling. Its exact counterpart is ``softmax`` with the same spectrum as relative
#: bias, the default for ``softmax`` here. Performer gets FLT's number of random features.
ATTENTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "flt": {"spectrum": "gaussian", "coupling": "logit", "num_features": 64, "num_frequencies": 32, "length_scale": 2.0,
            "amplitude": 1.0},
    "performer": {"num_features": 64},
    "softmax": {"relative_bias": "spectrum", "spectrum": "gaussian", "length_scale": 2.0, "amplitude": 1.0},
}
POSENC_DEFAULTS: dict = {}


@dataclass(frozen=True)
class GraphConfig(LayeredConfig):
    """Pair model over all nodes (:class:`flt.graphs.LinkTransformer`).

    ``num_anchors`` is ``K``, the size of the node features and positions (filled in from
    the data); ``out_dim`` the node embedding the pair head scores. ``encoder``
    (:data:`flt.graphs.link.TASK_ENCODERS`) picks the node encoder: ``"transformer"``
    (``depth`` layers of ``attention``, width ``dim``), or GIR, the distance MLP and the
    GNNs (width ``dim``, ``gnn_layers`` layers, ``indication`` and ``fusion`` with GIR;
    GIR's state size ``gir_hidden`` and reach ``gir_steps``, 0 for every level).
    ``in_dim`` is the width of the node features and positions the data gives (filled in
    from the data; 0, in configs saved before it, means ``num_anchors``).
    ``gir_positions`` (``P``, 0: off) makes the transformer attend at positions computed
    by a GIR path encoder trained with it (:class:`flt.graphs.link.LinkTransformer`)
    instead of the positions the data gives. ``layer_attention`` (one
    ``{"attention": NAME, "attention_options": {...}}`` per layer, ``flt search`` selects
    it, ``flt train --arch`` trains it) gives each layer of the transformer its own mechanism.
    """

    num_anchors: int = 64
    in_dim: int = 0
    gir_positions: int = 0
    out_dim: int = 32
    dim: int = 32
    depth: int = 2
    heads: int = 2
    encoder: str = "transformer"
    gnn_layers: int = 3
    indication: bool = False
    fusion: bool = False
    gir_hidden: int = 16
    gir_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("num_anchors", self.num_anchors)
        check_positive_int("out_dim", self.out_dim)
        check_choice("encoder", self.encoder, TASK_ENCODERS)
        check_positive_int("gnn_layers", self.gnn_layers)
        check_positive_int("gir_hidden", self.gir_hidden)
        for name in ("in_dim", "gir_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.layer_attention is not None and self.encoder != "transformer":
            raise ValueError(f"layer_attention applies to encoder='transformer' (the mechanism of each of its layers), got encoder={self.encoder!r}")
        if self.gir_positions and self.encoder != "transformer":
            raise ValueError(f"gir_positions applies to encoder='transformer' (positions of its attention), got encoder={self.encoder!r}")
        if isinstance(self.gir_steps, bool) or not isinstance(self.gir_steps, int) or self.gir_steps < 0:
            raise ValueError(f"gir_steps must be 0 (every level) or a positive integer, got {self.gir_steps!r}")
        for name in ("indication", "fusion"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.encoder == "transformer" and (self.indication or self.fusion):
            raise ValueError("indication and fusion apply to the GNN encoders (gcn, sage, gat, gin), not to encoder='transformer'")


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train graph --preset smoke``: 2 layers, width 32, 40 steps of 256 pairs on the
    20 x 20 grid (K = 64 anchors). About 10 s (4 s of it training); validation AUC 0.913
    (draw gap: fresh draws 0.905, exact 0.909; softmax with the exact spectrum: 0.882)."""
    model = GraphConfig(**mechanism_options(GraphTask, attention, posenc))
    run = RunConfig(steps=40, batch_size=256, lr=3e-3, warmup_steps=5, eval_every=20, checkpoint_every=20, log_every=5)
    return Preset(GraphTask.name, model, run, {})


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train graph --preset small``: 2 layers, width 32, 400 steps of 512 pairs on the
    20 x 20 grid (K = 64 anchors; 1216 training pairs). About 20 s (softmax with the exact
    spectrum: 30 s); validation AUC 0.950 (draw gap: fresh draws 0.948, exact 0.949;
    softmax with the exact spectrum: 0.962). On Communities (``--data-opt
    graph=communities``) 0.992 (softmax: 0.990). The validation loss rises after step 50,
    the pair head growing overconfident on the few training pairs, while the AUC holds."""
    model = GraphConfig(**mechanism_options(GraphTask, attention, posenc))
    run = RunConfig(steps=400, batch_size=512, lr=3e-3, warmup_steps=20, eval_every=50, checkpoint_every=100, log_every=10)
    return Preset(GraphTask.name, model, run, {})


#: ``positions`` choices of the task: the transformer's node features and positions
#: (module docstring).
POSITIONS = ("anchor", "rwse", "laplacian")
#: Options of ``softmax``'s default relative bias (the spectrum) in :data:`ATTENTION_DEFAULTS`:
#: they are left out when the run chooses another ``relative_bias``.
SPECTRUM_DEFAULTS = ("spectrum", "length_scale", "amplitude")

#: Generated graphs of the task by name (Communities is generated from the data seed).
GRAPHS = {"grid": lambda seed: grid_graph(20), "communities": lambda seed: communities(20, 20, p=0.01, seed=seed)}


class GraphTask(Task[GraphBatch, GraphConfig]):
    """Link prediction or pairwise node classification from node embeddings (BCE, ROC AUC)."""

    name = "graph"
    description = "pair prediction (links, same community) from graph encoders: attention at anchor coordinates, GIR, GNNs; bundled data: generated Grid / Communities"
    config, model = GraphConfig, LinkTransformer
    metric, higher_is_better, compare_metrics, unit = "auc", True, ("loss",), "pair"
    options = ("path", "graph", "task", "num_pairs", "seed", "num_anchors", "resample_anchors", "positions", "walk_steps",
               "eigenvectors")
    bundled_options = ("graph",)
    dataset = staticmethod(generated_split)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    holdout_seed_option = "seed"
    axes: ClassVar[dict[str, str]] = {"loss": "binary cross-entropy (nats/pair)", "auc": "ROC AUC, validation pairs",
                                      "offset": "hops / √K"}
    shortcuts: ClassVar[Shortcuts] = {
        "model": ("model", "encoder", f"the node encoder, one of {', '.join(TASK_ENCODERS)} (--model-opt encoder=)"),
        "graph": ("data", "graph", "grid or communities (--data-opt graph=)"),
        "task": ("data", "task", "link or pair (--data-opt task=)"),
    }

    def __init__(self, *, path: str | os.PathLike[str] | None = None, graph: str | None = None, task: str = "link", num_pairs: int = 2000, seed: int = 0,
                 num_anchors: int = 64, resample_anchors: bool = False, positions: str = "anchor", walk_steps: int = 16,
                 eigenvectors: int = 16) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        check_positive_int("num_anchors", num_anchors)
        check_choice("task", task, ("link", "pair"))
        check_choice("positions", positions, POSITIONS)
        check_positive_int("walk_steps", walk_steps)
        check_positive_int("eigenvectors", eigenvectors)
        if not isinstance(resample_anchors, bool):
            raise ValueError(f"resample_anchors must be true or false, got {resample_anchors!r}")
        if path is None:
            check_choice("graph", "grid" if graph is None else graph, GRAPHS)
            g = GRAPHS["grid" if graph is None else graph](seed)
        elif graph is not None:
            raise ValueError(f"graph={graph!r} names a generated graph; --data PATH reads a graph file instead")
        else:
            g = load_graph(path)
        if task == "link":
            split = split_links(g, seed=seed)
            self.edges = split.train_pos
            self.train, self.valid, self.test = split.train, split.valid, split.test
        else:
            if g.labels is None:
                raise ValueError(f"task='pair' needs node labels (communities); {g.name} has none")
            self.edges = g.edges
            self.train, self.valid, self.test = split_node_pairs(g, num_pairs, seed=seed)
        n = g.num_nodes
        self.kind, self.walk_steps, self.eigenvectors = task, walk_steps, eigenvectors
        self.num_nodes, self.seed, self.resample, self.positions = n, seed, resample_anchors, positions
        self.num_anchors = min(num_anchors, n)
        self._set_structure(self.edges)

    def _set_structure(self, edges: torch.Tensor) -> None:
        """``edges``, the structure, with the anchors and node inputs computed from it."""
        n = self.num_nodes
        self.edges = edges
        self.anchors = select_anchors(n, self.num_anchors, seed=self.seed, edges=edges)
        if self.positions == "anchor":
            self.features, self.pos = anchor_inputs(n, edges, self.anchors)
        else:
            if self.positions == "rwse":
                enc = standardize_columns(random_walk_encoding(n, edges, self.walk_steps))
            else:
                enc = laplacian_eigenvectors(n, edges, self.eigenvectors)[1] * math.sqrt(n)
            self.features = self.pos = enc.to(torch.get_default_dtype())
        self._epoch_inputs: tuple[int, NodeInputs] | None = None

    def with_structure(self, edges: torch.Tensor) -> GraphTask:
        """A copy of the task whose structure is ``edges`` ``[E, 2]`` (anchors, distances and
        positions computed from them); the labelled pairs are the same objects. ``flt
        search`` takes its held-out edges out of the structure this way."""
        if not isinstance(edges, torch.Tensor) or edges.ndim != 2 or edges.shape[1] != 2 or edges.dtype != torch.int64:
            raise ValueError(f"edges must be an int64 tensor [E, 2], got {getattr(edges, 'shape', edges)!r}")
        if len(edges) and (int(edges.min()) < 0 or int(edges.max()) >= self.num_nodes):
            raise ValueError(f"edges must name nodes in [0, {self.num_nodes})")
        other = copy.copy(self)
        other._set_structure(edges)
        return other

    def holdout_split(self, fraction: float, seed: int) -> tuple[Task[GraphBatch, GraphConfig], Task[GraphBatch, GraphConfig]]:
        """Pairs: a random ``fraction`` of the labelled training pairs. Links: a random
        ``fraction`` of the training edges (with as many training negatives), taken out of
        the structure too (:mod:`flt.tasks.holdout`)."""
        pairs, labels = self.train
        if self.kind == "pair":
            rest, hold = split_indices(len(labels), fraction, seed, "labelled training pairs")
            weights, alpha = copy.copy(self), copy.copy(self)
            weights.train = (pairs[rest], labels[rest])
            alpha.train = alpha.valid = (pairs[hold], labels[hold])
            return weights, alpha
        # Links: the training pairs are the training edges (label 1) then as many negatives.
        pos, neg = pairs[labels == 1], pairs[labels == 0]
        rest_idx, hold_idx = split_indices(len(pos), fraction, seed, "training edges")
        rest_pos, hold_pos = pos[rest_idx], pos[hold_idx]
        perm_neg = permutation(len(neg), seed + 1)
        keep_neg = min(len(neg), len(hold_idx))
        rest_neg, hold_neg = neg[perm_neg[keep_neg:].sort().values], neg[perm_neg[:keep_neg].sort().values]
        # The held-out edges leave the structure: anchors and positions of the remaining edges.
        structure = self.with_structure(rest_pos)
        weights, alpha = copy.copy(structure), copy.copy(structure)
        weights.train = labelled(rest_pos, rest_neg)
        alpha.train = alpha.valid = labelled(hold_pos, hold_neg)
        return weights, alpha

    def fit_batch_size(self, batch_size: int) -> int:
        return min(batch_size, len(self.train[1]))

    @classmethod
    def probe_config(cls, cfg: GraphConfig, data: dict[str, Any]) -> GraphConfig:
        """The transformer encoder only (the others have no attention), with the width of
        the positions the data gives (the anchors by default)."""
        if cfg.encoder != "transformer":
            raise ValueError(f"flt search graph chooses the attention of the transformer encoder; encoder={cfg.encoder!r} "
                             "has no attention layers (leave out --model-opt encoder=)")
        width = {"rwse": data.get("walk_steps", 16), "laplacian": data.get("eigenvectors", 16)}.get(data.get("positions", "anchor"))
        if isinstance(width, int) and not isinstance(width, bool) and width > 0:
            return replace_fields(cfg, in_dim=width)
        return cfg

    def configure(self, cfg: GraphConfig) -> GraphConfig:
        """The config with ``num_anchors`` and ``in_dim`` of the data; a ``softmax`` run that
        chooses another relative bias than the spectrum drops the spectrum's defaults, and
        ``relative_bias=spd`` gets the hop length of the anchor coordinates, ``1 / sqrt(K)``,
        as its ``unit`` unless one is given."""
        if cfg.gir_positions and self.positions != "anchor":
            raise ValueError(f"gir_positions replaces the positions of the data; it needs positions='anchor', got {self.positions!r}")
        options = dict(cfg.attention_options)
        mechanism = ATTENTION.get(cfg.attention)
        if mechanism is not None and not mechanism.takes_spectrum_options(options):
            defaults = ATTENTION_DEFAULTS.get(cfg.attention, {})
            options = {k: v for k, v in options.items() if not (k in SPECTRUM_DEFAULTS and k in defaults and v == defaults[k])}
        if mechanism is not None and mechanism.option(options, "relative_bias") == "spd":
            if self.positions != "anchor" or cfg.gir_positions:
                raise ValueError("relative_bias='spd' reads hop distances from the positions: it needs positions='anchor' and no gir_positions")
            options["relative_options"] = {"unit": 1.0 / math.sqrt(self.num_anchors), **(options.get("relative_options") or {})}
        return replace_fields(cfg, num_anchors=len(self.anchors), in_dim=self.features.shape[1], attention_options=options)

    def inputs(self, epoch: int | None = None) -> NodeInputs:
        """``(features, pos, edges, anchors)`` of the anchors of ``seed`` (``epoch=None``) or,
        with ``resample_anchors``, of the training epoch ``epoch``."""
        if epoch is None or not self.resample:
            return self.features, self.pos, self.edges, self.anchors
        if self._epoch_inputs is None or self._epoch_inputs[0] != epoch:
            anchors = select_anchors(self.num_nodes, self.num_anchors, seed=self.seed * 1_000_003 + epoch + 1)
            nodes = anchor_inputs(self.num_nodes, self.edges, anchors) if self.positions == "anchor" else (self.features, self.pos)
            self._epoch_inputs = (epoch, (*nodes, self.edges, anchors))
        return self._epoch_inputs[1]

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> GraphBatch:
        pairs, labels = self.train
        idx = epoch_indices(len(pairs), batch_size, seed, step)[shard(batch_size, rank, world)]
        epoch = (step - 1) // max(1, len(pairs) // batch_size)  # the epoch of epoch_indices (1-based steps)
        features, pos, edges, anchors = self.inputs(epoch)
        if self.positions == "laplacian":
            # One sign per eigenvector, the same on every process: it depends on the run seed and step only.
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
            signs = (torch.randint(0, 2, (pos.shape[1],), generator=gen) * 2 - 1).to(pos.dtype)
            features, pos = features * signs, pos * signs
        return features, pos, edges, anchors, pairs[idx], labels[idx]

    def batch_items(self, batch: GraphBatch) -> int:
        return batch[4].shape[0]

    def loss(self, model: nn.Module, batch: GraphBatch) -> torch.Tensor:
        *inputs, labels = batch
        return F.binary_cross_entropy_with_logits(model(*inputs).float(), labels.float())

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[GraphBatch]:
        # One batch, on one process: the AUC needs every validation score at once.
        for _ in eval_slices(1, 1, max_batches, rank, world):
            yield (*self.inputs(), *self.valid)

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[GraphBatch]:
        # The held-out test pairs (links: edges hidden from the structure), one batch as above.
        for _ in eval_slices(1, 1, max_batches, rank, world):
            yield (*self.inputs(), *self.test)

    def eval_sums(self, model: nn.Module, batch: GraphBatch) -> dict[str, float]:
        *inputs, labels = batch
        return _auc_sums(model(*inputs), labels)

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["nll"] / sums["count"], "auc": sums["auc_pairs"] / sums["pos_neg_pairs"]}

    def rpe_extent(self, cfg: GraphConfig) -> tuple[float, bool]:
        if cfg.gir_positions:
            # Learned positions: a fixed orthonormal projection of a LayerNorm-ed embedding,
            # about unit variance per axis.
            return 4.0, False
        # Offsets on an axis of the positions range over the coordinates' spread.
        spread = float(self.pos.max() - self.pos.min())
        return (spread if spread > 0 else 1.0), False

    def longest_sequence(self, cfg: GraphConfig) -> int:
        return self.num_nodes

    def step_shape(self, cfg: GraphConfig, batch_size: int) -> tuple[int, int]:
        return 1, self.num_nodes  # every step encodes the whole graph once, whatever the number of pairs

    @torch.no_grad()
    def report(self, model: nn.Module, device: torch.device) -> str:
        was_training = model.training
        model.eval()
        try:
            pairs, labels = self.test
            inputs = [t.to(device) for t in self.inputs()]
            logits = model(*inputs, pairs.to(device))
            sums = _auc_sums(logits, labels.to(device))
        finally:
            model.train(was_training)
        auc = sums["auc_pairs"] / sums["pos_neg_pairs"]
        return f"test ROC AUC {auc:.4f} (final weights; {int(labels.sum())} positive and {len(labels) - int(labels.sum())} negative test pairs)"


def _auc_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Sums of one batch holding every pair: the ROC AUC times its number of (positive,
    negative) pairs (NaN for non-finite scores), that number, the summed BCE, the count."""
    logits, labels = logits.detach().double(), labels.double()
    n_pos = float(labels.sum())
    pos_neg = n_pos * (labels.numel() - n_pos)
    auc = roc_auc(logits, labels) if bool(torch.isfinite(logits).all()) else math.nan
    return {
        "auc_pairs": auc * pos_neg,
        "pos_neg_pairs": pos_neg,
        "nll": float(F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")),
        "count": float(labels.numel()),
    }
