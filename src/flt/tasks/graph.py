"""``graph``: link prediction by attention over all nodes at anchor coordinates (binary
cross-entropy; ROC AUC on the validation edges against as many non-edges).

Data options: ``graph`` (``"grid"``, the 20 x 20 grid, the default, or ``"communities"``,
20 cliques of 20 nodes with rewired edges; both generated, :mod:`flt.graphs.data`),
``path`` (a text edge list ``u v`` per line instead, :func:`flt.graphs.load_edge_list`),
``seed`` (generates Communities, draws the 80/10/10 edge split with its negatives and the
anchors; the run's ``--seed`` is separate) and ``num_anchors`` (``K``, default 64, capped at
the number of nodes). Distances, anchors and positions use the training edges only.

Every node ``v`` is a token at position ``r_v = d(v, .) / sqrt(K)`` in ``R^K`` (``P = K``),
its hop distances to the anchors (:func:`flt.graphs.anchor_coordinates`), embedded from its
distance features ``1 / (1 + d)``; the model (:class:`flt.graphs.LinkTransformer`) attends
over all ``N`` nodes at once and scores a pair ``(u, v)`` from the two embeddings. A
training batch is ``batch_size`` labelled pairs (training edges and their fixed non-edges);
every step embeds all nodes. ROC AUC is not a sum over batches, so validation is one batch
holding every validation pair. See docs/graphs.md for the design and the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from flt._checks import check_positive_int
from flt.graphs import LinkTransformer, anchor_inputs, generated_split, load_edge_list, roc_auc, select_anchors, split_links
from flt.models import replace_fields
from flt.models.config import TrunkConfig
from flt.tasks.base import Task, epoch_indices, eval_slices, mechanism_options, shard
from flt.tasks.preset import Preset, RunConfig

#: FLT: the Gaussian spectrum of docs/graphs.md (per head and per axis length scale,
#: ``l = 2`` coordinate units, about two grid hops, ``f(0) = 1`` at the start) with the
#: logit coupling. Its exact counterpart is ``softmax`` with the same spectrum as relative
#: bias, the default for ``softmax`` here. Performer gets FLT's number of random features.
ATTENTION_DEFAULTS = {
    "flt": {"spectrum": "gaussian", "coupling": "logit", "num_features": 64, "num_frequencies": 32, "length_scale": 2.0,
            "amplitude": 1.0},
    "performer": {"num_features": 64},
    "softmax": {"relative_bias": "spectrum", "spectrum": "gaussian", "length_scale": 2.0, "amplitude": 1.0},
}
POSENC_DEFAULTS: dict = {}


@dataclass(frozen=True)
class GraphConfig(TrunkConfig):
    """Link predictor over all nodes at anchor coordinates (:class:`flt.graphs.LinkTransformer`).

    ``num_anchors`` is ``K``, the size of the node features and positions (filled in from
    the data); ``out_dim`` the node embedding the pair head scores.
    """

    task: ClassVar[str] = "graph"

    num_anchors: int = 64
    out_dim: int = 32
    dim: int = 32
    depth: int = 2
    heads: int = 2

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("num_anchors", self.num_anchors)
        check_positive_int("out_dim", self.out_dim)


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


class GraphTask(Task):
    """Link prediction over all nodes at anchor coordinates (BCE, ROC AUC)."""

    name = "graph"
    description = "link predictor attending over all nodes at anchor-distance coordinates; bundled data: generated Grid / Communities"
    config, model = GraphConfig, LinkTransformer
    metric, higher_is_better, compare_metrics, unit = "auc", True, ("loss",), "pair"
    options = ("path", "graph", "seed", "num_anchors")
    dataset = staticmethod(generated_split)
    presets = {"smoke": smoke, "small": small}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    axes = {"loss": "binary cross-entropy (nats/pair)", "auc": "ROC AUC, validation edges vs non-edges",
            "offset": "hops / √K"}

    def __init__(self, *, path=None, graph: str | None = None, seed: int = 0, num_anchors: int = 64):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        check_positive_int("num_anchors", num_anchors)
        if path is None:
            split = generated_split("grid" if graph is None else graph, seed=seed)
        elif graph is not None:
            raise ValueError(f"graph={graph!r} names a generated graph; --data PATH reads an edge list instead")
        else:
            split = split_links(load_edge_list(path), seed=seed)
        n = split.num_nodes
        anchors = select_anchors(n, min(num_anchors, n), seed=seed, edges=split.train_pos)
        self.num_nodes = n
        self.features, self.pos = anchor_inputs(n, split.train_pos, anchors)
        self.train, self.valid, self.test = split.train, split.valid, split.test

    def configure(self, cfg):
        return replace_fields(cfg, num_anchors=self.pos.shape[1])

    def train_batch(self, step, batch_size, seed, rank, world):
        pairs, labels = self.train
        idx = epoch_indices(len(pairs), batch_size, seed, step)[shard(batch_size, rank, world)]
        return self.features, self.pos, pairs[idx], labels[idx]

    def batch_items(self, batch) -> int:
        return batch[2].shape[0]

    def loss(self, model, batch):
        features, pos, pairs, labels = batch
        return F.binary_cross_entropy_with_logits(model(features, pos, pairs).float(), labels.float())

    def eval_batches(self, batch_size, max_batches, rank, world):
        # One batch, on one process: the AUC needs every validation score at once.
        for _ in eval_slices(1, 1, max_batches, rank, world):
            yield (self.features, self.pos, *self.valid)

    def eval_sums(self, model, batch):
        features, pos, pairs, labels = batch
        return _auc_sums(model(features, pos, pairs), labels)

    def metrics(self, sums):
        return {"loss": sums["nll"] / sums["count"], "auc": sums["auc_pairs"] / sums["pos_neg_pairs"]}

    def rpe_extent(self, cfg):
        # Offsets on an axis of anchor space range over the coordinates' spread.
        spread = float(self.pos.max() - self.pos.min())
        return (spread if spread > 0 else 1.0), False

    def longest_sequence(self, cfg):
        return self.num_nodes

    @torch.no_grad()
    def report(self, model, device):
        was_training = model.training
        model.eval()
        try:
            pairs, labels = self.test
            logits = model(self.features.to(device), self.pos.to(device), pairs.to(device))
            sums = _auc_sums(logits, labels.to(device))
        finally:
            model.train(was_training)
        auc = sums["auc_pairs"] / sums["pos_neg_pairs"]
        return f"test ROC AUC {auc:.4f} (final weights; {int(labels.sum())} test edges, as many non-edges)"


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
