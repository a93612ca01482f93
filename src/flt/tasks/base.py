"""The task interface that the single training loop drives, and the batching helpers tasks share.

A task class describes itself in class attributes (name, model config and class, metric,
presets, plot labels) and, once constructed with its data options, loads its data, fills
the data-dependent fields of the model config, draws the global batch of a step, computes
the training loss and sums the validation metrics. Batches are a pure function of
``(seed, step)``, never of a sampler's internal state, so a resumed run sees the same
batches as an uninterrupted one and any number of processes splits the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from flt._checks import check_positive_int
from flt.models import config_kwargs
from flt.models.config import TrunkConfig
from flt.models.memory import check_model_memory
from flt.tasks.preset import Preset

#: The types of a task's preset table and command-line shortcuts (:class:`Task` below).
Presets = dict[str, Callable[..., Preset]]
Shortcuts = dict[str, tuple[str, str, str]]

#: A task's batch (a tuple of tensors, or an object with ``.to(device)`` such as
#: :class:`flt.data.MoleculeBatch`) and its model config; :class:`Task` is generic in both,
#: so each task's methods are checked against its own batch and config.
BatchT = TypeVar("BatchT")
ConfigT = TypeVar("ConfigT", bound=TrunkConfig)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator determined by ``(seed, step, stream)`` alone."""
    state = np.random.SeedSequence([seed, step, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def shard(batch_size: int, rank: int, world: int) -> slice:
    """Process ``rank``'s slice of a global batch split over ``world`` processes."""
    if batch_size % world:
        raise ValueError(f"the global batch_size ({batch_size}) must be divisible by the number of processes ({world})")
    local = batch_size // world
    return slice(rank * local, (rank + 1) * local)


def _epoch_permutation(n: int, batch_size: int, seed: int, step: int) -> tuple[torch.Tensor, int, int, int]:
    """``(perm, batches per epoch, epoch, index of step's batch in its epoch)``: the seeded
    permutation of the epoch of (1-based) ``step``; the last partial batch is dropped."""
    if n < batch_size:
        raise ValueError(f"the training split has {n} samples, fewer than the batch size {batch_size}")
    per_epoch = n // batch_size
    epoch, i = divmod(step - 1, per_epoch)
    return torch.randperm(n, generator=step_generator(seed, epoch, stream=1)), per_epoch, epoch, i


def epoch_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Global batch of (1-based) ``step``: a seeded permutation per epoch, last partial batch dropped."""
    perm, _, _, i = _epoch_permutation(n, batch_size, seed, step)
    return perm[i * batch_size : (i + 1) * batch_size]


#: ``step_generator`` stream of the order of length-sorted batches (see :func:`bucketed_indices`).
BUCKET_STREAM = 3


def bucketed_indices(lengths: torch.Tensor, batch_size: int, seed: int, step: int, pool: int) -> torch.Tensor:
    """Global batch of (1-based) ``step`` drawn by length: the epoch's permutation of
    :func:`epoch_indices` is cut into pools of ``pool`` batches, each pool is sorted by
    ``lengths`` (stable) and cut into batches, and the epoch's batches are visited in a
    seeded random order. Every item is still seen once per epoch, while a batch holds items
    of similar length, so padding to its longest costs little. ``pool = 1`` gives the
    batches of :func:`epoch_indices` (in another order)."""
    check_positive_int("pool", pool)
    perm, per_epoch, epoch, i = _epoch_permutation(lengths.numel(), batch_size, seed, step)
    pools = perm[: per_epoch * batch_size].split(pool * batch_size)
    batches = torch.cat([p[torch.sort(lengths[p], stable=True).indices] for p in pools]).view(per_epoch, batch_size)
    order = torch.randperm(per_epoch, generator=step_generator(seed, epoch, stream=BUCKET_STREAM))
    return batches[order[i]]


def eval_slices(n: int, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[slice]:
    """This rank's share of the first ``max_batches`` consecutive batches of ``n`` items."""
    for i, first in enumerate(range(0, n, batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        if i % world == rank:
            yield slice(first, min(first + batch_size, n))


class Task(Generic[BatchT, ConfigT]):
    """Interface of a task: class attributes describe it, an instance holds its data.

    ``cls(**options)`` loads the data; ``options`` are the names in :attr:`options`
    (``Preset.data``, ``--data-opt KEY=VALUE``; ``--data PATH`` sets ``path``).
    ``Task[BatchT, ConfigT]``: its batches are ``BatchT`` and its model config a ``ConfigT``
    (:attr:`config`); code that drives any task uses the bare ``Task``.
    """

    #: Registry name: ``flt train NAME``.
    name: ClassVar[str] = ""
    #: One line for ``flt train --help`` and the docs table.
    description: ClassVar[str] = ""
    #: Model config dataclass and model class, whose keyword arguments are the config's
    #: fields or what :meth:`model_arguments` makes of them (:meth:`build_model`).
    config: ClassVar[type[TrunkConfig]]
    model: ClassVar[type]
    #: The key of :attr:`config` in saved configs (``"task"`` of :func:`flt.tasks.config_to_dict`,
    #: which checkpoints carry); None: this task's :attr:`name`. A task that trains another
    #: task's config names that task, so that each config class has one key.
    config_key: ClassVar[str | None] = None
    #: Headline validation metric and whether larger is better (tables, plots, docs).
    metric: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = False
    #: Further validation metrics that ``flt compare`` tabulates.
    compare_metrics: ClassVar[tuple[str, ...]] = ()
    #: What throughput counts.
    unit: ClassVar[str] = "samples"
    #: Data options the constructor takes; those of the bundled data set only (a real data
    #: set given by ``--data`` drops them); those that go with a ``path`` and are dropped
    #: when another path replaces it (an LM's ``valid_path``).
    options: ClassVar[tuple[str, ...]] = ()
    bundled_options: ClassVar[tuple[str, ...]] = ()
    path_options: ClassVar[tuple[str, ...]] = ()
    #: Loader of the bundled data set: keyword arguments only, returns ``.train`` and ``.valid``.
    dataset: ClassVar[Callable[..., Any]]
    #: ``presets[name](attention, posenc) -> Preset``; every task has ``smoke``.
    presets: ClassVar[Presets] = {}
    #: Options for mechanisms and absolute encodings by name (:func:`mechanism_options`).
    attention_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    posenc_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Axis labels with units: ``loss``, the validation metrics and ``offset`` (the unit of
    #: a relative position, the x axis of the RPE plot).
    axes: ClassVar[dict[str, str]] = {}
    #: Command-line shortcuts of ``flt train`` / ``flt compare`` for this task:
    #: ``{flag: (where, field, help)}``, ``--flag VALUE`` meaning ``--model-opt field=VALUE``
    #: (``where = "model"``) or ``--data-opt field=VALUE`` (``"data"``); ``help`` says what
    #: the value is, and ``flt train --help`` puts the names of the tasks it is of before it.
    shortcuts: ClassVar[Shortcuts] = {}
    #: The data option whose value seeds the held-out draw of :meth:`holdout_split` (None,
    #: or the option not given: seed 0).
    holdout_seed_option: ClassVar[str | None] = None

    @classmethod
    def attention_options(cls, attention: str, defaults: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
        """The options of a run of mechanism ``attention``: ``chosen`` (the command line's)
        over ``defaults`` (the preset's). A task whose defaults fit some choices only (a
        spectrum's options, which need ``relative_bias='spectrum'``) leaves them out here
        for the others, so that ``softmax:relative_bias=t5`` builds."""
        return {**defaults, **chosen}

    @classmethod
    def build_model(cls, config: TrunkConfig, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
        """The model of ``config`` (a :attr:`config` instance)."""
        if not isinstance(config, cls.config):
            raise TypeError(f"task {cls.name!r} builds from {cls.config.__name__}, got {type(config).__name__}")
        # Parameters alone (one token): a dim or depth of 10^9 is refused before it is allocated.
        check_model_memory(config, batch=1, length=1, training=False, device=device, purpose="building")
        return cls.model(**cls.model_arguments(config), device=device, dtype=dtype)

    @classmethod
    def model_arguments(cls, config: TrunkConfig) -> dict[str, Any]:
        """The keyword arguments of :attr:`model` for ``config``: its fields
        (:func:`flt.models.config_kwargs`). A task whose model is shared with other tasks
        (:class:`flt.models.TokenModel`) names its fields and choices here."""
        return config_kwargs(config)

    def configure(self, cfg: ConfigT) -> ConfigT:
        """The model config with its data-dependent fields filled in."""
        raise NotImplementedError

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> BatchT:
        """This process's slice (``rank`` of ``world``) of the global batch of ``step``."""
        raise NotImplementedError

    def batch_items(self, batch: BatchT) -> int:
        """Number of :attr:`unit` in a (local) batch, for throughput."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: BatchT) -> torch.Tensor:
        """Scalar training loss, the mean over the batch (so DDP's mean of gradients is exact)."""
        raise NotImplementedError

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[BatchT]:
        """This process's share of the validation batches (at most ``max_batches`` in all)."""
        raise NotImplementedError

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[BatchT]:
        """This process's share of the test batches, batched as :meth:`eval_batches`. The test
        split is held out from training and from validation (which picks presets and learning
        rates), so its metric is read once, at the end (``summary.json``'s ``test``). A task
        that does not override it has no test split (:func:`has_test_split`): it trains, and
        its summary has no test metrics."""
        raise NotImplementedError(f"task {self.name!r} has no test split")

    def eval_sums(self, model: nn.Module, batch: BatchT) -> dict[str, float]:
        """Sums over one batch (summed again over batches and processes)."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Validation metrics from the total sums; always includes ``loss`` and :attr:`metric`."""
        raise NotImplementedError

    def rpe_extent(self, cfg: ConfigT) -> tuple[float, bool]:
        """``(L, causal)``: plot ``f`` on ``[0, L]`` (causal) or ``[-L, L]`` per axis."""
        raise NotImplementedError

    def longest_sequence(self, cfg: ConfigT) -> int | None:
        """The most tokens one validation sample gives the attention layers (None if unknown);
        sizes the batches of the exact evaluation (:mod:`flt.train.drawgap`)."""
        return None

    def step_shape(self, cfg: ConfigT, batch_size: int) -> tuple[int, int | None]:
        """``(sequences, tokens)``: what ``batch_size`` samples give the attention layers at
        most, for the memory estimate made before the model is built (:mod:`flt._limits`)."""
        return batch_size, self.longest_sequence(cfg)

    def extra(self) -> dict[str, Any]:
        """JSON data a checkpoint needs besides the configs (e.g. the tokenizer)."""
        return {}

    def holdout_split(self, fraction: float, seed: int) -> tuple[Task[BatchT, ConfigT], Task[BatchT, ConfigT]]:
        """``(weights_task, alpha_task)``: this (configured) task with ``fraction`` of its
        training split held out, for ``flt search`` (:mod:`flt.tasks.holdout`); ``seed`` is
        the data's seed (:attr:`holdout_seed_option`). A task that does not override it
        cannot be searched."""
        raise ValueError(f"task {self.name!r} declares no held-out part of its training split; flt search supports "
                         "the tasks that do (flt.tasks.holdout_tasks)")

    def fit_batch_size(self, batch_size: int) -> int:
        """The training batch size this task's training split allows, at most ``batch_size``
        (a held-out part can be smaller than a batch)."""
        return batch_size

    @classmethod
    def probe_config(cls, cfg: ConfigT, data: dict[str, Any]) -> ConfigT:
        """The model config that tells ``flt search`` its attention geometry before any data
        loads: ``cfg`` with what the data options ``data`` set; raises if the model has no
        attention layers to choose."""
        return cfg

    @classmethod
    def constrain_supernet(cls, model: nn.Module, cfg: ConfigT) -> None:
        """Impose the model's own constraints on the mechanisms ``flt search`` put into it
        (its candidates); raises ``ValueError`` naming the constraint a candidate breaks."""

    def report(self, model: nn.Module, device: torch.device) -> str | None:
        """A line or two printed at the end of training (e.g. a generated sample)."""
        return None

    def plots(self, model: nn.Module, out_dir: str) -> list[str]:
        """The task's own PNG plots of the trained ``model``, written atomically into the run
        directory ``out_dir`` after training when plots are on (matplotlib is installed);
        returns their file names. None by default."""
        return []


def check_data_fields(cfg: TrunkConfig, configured: TrunkConfig) -> None:
    """Refuse a model config whose data-dependent fields (an LM's ``vocab_size``, the
    classes, the image size) were set to values other than the data's: :meth:`Task.configure`
    replaces them, so a ``--model-opt vocab_size=10`` would otherwise be dropped silently.
    Fields left at their defaults are filled in as usual."""
    import dataclasses

    clashes = []
    for f in dataclasses.fields(cfg):
        given, used = getattr(cfg, f.name), getattr(configured, f.name)
        scalar = isinstance(given, (bool, int, float, str)) and isinstance(used, (bool, int, float, str))
        if scalar and given != used and f.default is not dataclasses.MISSING and given != f.default:
            clashes.append(f"{f.name}={given!r} was given, but the data sets {f.name}={used!r}")
    if clashes:
        raise ValueError(f"{type(cfg).__name__}: {'; '.join(clashes)}; these fields come from the data: "
                         "leave them out (--model-opt)")


def has_test_split(task: Task[Any, Any]) -> bool:
    """Whether ``task`` defines :meth:`Task.test_batches` (every built-in task does)."""
    return type(task).test_batches is not Task.test_batches


def mechanism_options(task: type[Task[Any, Any]], attention: str, posenc: str, **overrides: Any) -> dict[str, Any]:
    """``attention``, ``attention_options``, ``posenc`` and ``posenc_options`` of a model
    config of ``task``: the task's defaults for these names (none for names without an
    entry, so mechanisms added to :data:`flt.ATTENTION` later work with every preset)."""
    return {
        "attention": attention,
        "attention_options": dict(task.attention_defaults.get(attention, {})),
        "posenc": posenc,
        "posenc_options": dict(task.posenc_defaults.get(posenc, {})),
        **overrides,
    }
