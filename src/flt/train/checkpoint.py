"""Checkpoints that are complete or absent, never half written.

Layout of a run directory::

    RUN/checkpoints/step-00000100/model.safetensors   weights (safetensors: no code on load)
                                 /trainer.pt          optimizer and RNG states (torch.save,
                                                      loaded with weights_only=True)
                                 /config.json         run configuration, extras, step and the
                                                      SHA-256 of the two files above
    RUN/checkpoints/latest                            name of the newest complete checkpoint

A checkpoint is written into a temporary directory, every file is fsynced, and the
directory is renamed into place with ``os.replace``; ``latest`` is then replaced the same
way (temporary file, fsync, ``os.replace``). A process killed at any moment leaves the
previous checkpoint and ``latest`` intact. Loading verifies the hashes, so truncated or
altered files raise :class:`CheckpointError` naming the file instead of loading garbage.
:func:`find_checkpoint` verifies the checkpoint ``latest`` names; if it is corrupt, or
``latest`` is missing (a run killed between renaming its first checkpoint into place and
writing ``latest``, or a deleted file) or damaged, it takes the newest ``step-*``
directory whose files verify and says which one it took and why. Old checkpoints are
deleted by renaming them to a temporary name first (:func:`flt._io.discard_dir`), so a
kill mid-deletion leaves no half-deleted ``step-*`` directory; :func:`remove_leftovers`
clears what a killed trainer left behind.

Every file name read from a checkpoint (``latest``, the files listed in ``config.json``)
must name an entry of its own directory (:func:`flt._io.confined_path`): absolute paths,
``..`` and links that lead elsewhere are refused before anything is opened. No hash covers
``config.json`` itself, so what it says is checked against what else records it: its
``step`` must be the one in its ``step-NNNNNNNN`` name and in ``trainer.pt``, and a
``RUN/checkpoints`` that is a link is refused rather than written through.

Files and directories get the permissions of a plain ``open()`` / ``os.makedirs`` under
the process's umask (:mod:`flt._io`), not the 0600 / 0700 of temporary files.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from flt._io import (
    atomic_dir,
    atomic_write_text,
    confined_path,
    discard_dir,
    dumps_json,
    file_mode,
    fsync_file,
    read_json,
    read_json_file,
    remove_temporaries,
    sha256_file,
)
from flt.layers.upgrade import parameters_before_cores, upgrading
from flt.tasks import config_from_dict, get_task

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer.pt"
CONFIG_FILE = "config.json"
FORMAT = "flt-checkpoint-1"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint exists but is corrupt, incomplete or does not fit the model; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(run_dir: str, step: int, model: torch.nn.Module, *, config: dict[str, Any], trainer_state: dict[str, Any], keep: int = 2) -> str:
    """Save weights, trainer state and ``config`` for ``step``; keep the newest ``keep``. Returns the path."""
    root = _own_checkpoints_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    name = step_dir_name(step)

    def fill(tmp: str) -> None:
        model_path = os.path.join(tmp, MODEL_FILE)
        # One metadata entry: safetensors writes its metadata map in a random order, and a
        # resumed run must write the bytes an uninterrupted one does (the step is in config.json).
        save_model(model, model_path, metadata={"format": FORMAT})
        # safetensors writes through a private temporary file of its own: mode 0600.
        os.chmod(model_path, file_mode())
        state_path = os.path.join(tmp, STATE_FILE)
        torch.save(trainer_state, state_path)
        files = {}
        for fname, path in ((MODEL_FILE, model_path), (STATE_FILE, state_path)):
            fsync_file(path)
            files[fname] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
        meta = {"format": FORMAT, "step": step, "files": files, **config}
        config_path = os.path.join(tmp, CONFIG_FILE)
        with open(config_path, "x", encoding="utf-8") as f:  # a new file of the fresh temporary directory
            f.write(dumps_json(meta, os.path.join(root, name, CONFIG_FILE), indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())

    # A directory of this name may be left by a run killed after writing it but before
    # updating `latest`: atomic_dir replaces it.
    final = atomic_dir(root, name, fill)
    atomic_write_text(os.path.join(root, LATEST), name + "\n")
    _prune(root, keep, current=name)
    return final


def _own_checkpoints_dir(run_dir: str) -> str:
    """``run_dir/checkpoints``, refused (``ValueError`` naming it) if it is a link or not a
    directory: checkpoints are written, and old ones deleted, only inside the run."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if os.path.islink(root) or (os.path.lexists(root) and not os.path.isdir(root)):
        what = f"a symbolic link (to {os.readlink(root)})" if os.path.islink(root) else "not a directory"
        raise ValueError(f"{root} is {what}, not the checkpoint directory flt writes; flt does not write through links: remove it")
    return root


def _prune(root: str, keep: int, current: str) -> None:
    # Only this run's own step directories count and are deleted: a link named step-* (to a
    # folder inside the run or out of it) takes no place among the kept ones, and neither
    # the link nor what it points to is deleted.
    steps = _step_dirs(root)
    for old in steps[:-keep] if keep > 0 else steps:
        if old != current:
            discard_dir(os.path.join(root, old))
    for n in os.listdir(root):
        if n.startswith(".step-") and n.endswith(".tmp") and _own_dir(os.path.join(root, n)):
            # A temporary directory of a killed run: never complete, never referenced.
            shutil.rmtree(os.path.join(root, n))


def has_checkpoint(run_dir: str) -> bool:
    """True if ``run_dir`` holds a ``checkpoints/latest`` pointer or a ``step-*`` checkpoint directory."""
    root = os.path.join(run_dir, CHECKPOINTS)
    return os.path.exists(os.path.join(root, LATEST)) or bool(_step_dirs(root))


def _own_dir(path: str) -> bool:
    """True if ``path`` is a directory itself, not a link to one."""
    return os.path.isdir(path) and not os.path.islink(path)


def _step_dirs(root: str) -> list[str]:
    """Names of the ``step-*`` directories in ``root``, oldest first: directories of the
    run itself, not links to directories (which may lie outside the run)."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _STEP_DIR.match(n) and _own_dir(os.path.join(root, n)))


def _note(message: str) -> None:
    """The default ``report`` of :func:`find_checkpoint`: one line on stderr."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def find_checkpoint(path: str, *, report: Callable[[str], None] = _note) -> str:
    """Resolve a run directory (its latest intact checkpoint) or a checkpoint directory.

    A run directory's checkpoint is the one ``checkpoints/latest`` names, if its
    ``config.json`` reads and its files match their hashes (:func:`read_checkpoint_config`).
    Otherwise (that checkpoint corrupt, ``latest`` missing or damaged) it is the newest
    ``step-*`` directory that verifies, and a message passed to ``report`` (default: a note
    on stderr) names the one skipped and the one taken, e.g. ``RUN/checkpoints/step-00000200
    is corrupt (...); using RUN/checkpoints/step-00000100, the newest complete checkpoint``.
    Raises ``FileNotFoundError`` when there is no checkpoint, and :class:`CheckpointError`
    (or the ``FileNotFoundError`` of a missing file, when ``latest`` names the only
    checkpoint) when none verifies. A checkpoint directory given itself is not replaced by
    another one: its errors are raised.
    """
    return locate_checkpoint(path, report=report)[0]


def locate_checkpoint(path: str, *, report: Callable[[str], None] = _note) -> tuple[str, dict[str, Any]]:
    """``(checkpoint, its verified config)`` for ``path``, as :func:`find_checkpoint`
    resolves it, verifying the files once."""
    if os.path.isfile(os.path.join(path, CONFIG_FILE)) and not os.path.isdir(os.path.join(path, CHECKPOINTS)):
        return path, read_checkpoint_config(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    root = os.path.join(path, CHECKPOINTS)
    latest = os.path.join(root, LATEST)
    named, problem = _read_latest(root)
    names = _step_dirs(root)
    if named is None and not names:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {latest} or a {CONFIG_FILE})")
    candidates = ([named] if named else []) + [n for n in reversed(names) if n != named]
    failures: list[tuple[str, Exception]] = []
    for name in candidates:
        ckpt = os.path.join(root, name)
        try:
            # A step directory that is a link out of the run is refused before it is read.
            confined_path(root, name, f"run {path}", CheckpointError)
            meta = read_checkpoint_config(ckpt)
        except (CheckpointError, FileNotFoundError) as e:
            failures.append((ckpt, e))
            continue
        _report_fallback(report, problem, failures, ckpt)
        return ckpt, meta
    if named and problem is None and len(candidates) == 1:
        raise failures[0][1]
    why = problem or f"{latest} names {named}"
    details = "; ".join(f"{os.path.basename(c)}: {e}" for c, e in failures)
    raise CheckpointError(f"no usable checkpoint in {path}: {why} and none of {', '.join(names)} is complete ({details})")


def _read_latest(root: str) -> tuple[str | None, str | None]:
    """``(name, problem)``: the checkpoint ``root/latest`` names, or None and what is wrong
    with ``latest`` (missing, corrupt, naming a directory that does not exist)."""
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return None, f"{latest} is missing"
    with open(latest, encoding="utf-8", errors="replace") as f:
        name = f.read(256).strip()
    if not _STEP_DIR.match(name):
        return None, f"{latest} is corrupt: it names {name!r}, not a checkpoint directory"
    if not os.path.isdir(os.path.join(root, name)):
        return None, f"{latest} points to {os.path.join(root, name)}, which does not exist"
    return name, None


def _report_fallback(report: Callable[[str], None], problem: str | None, failures: list[tuple[str, Exception]], taken: str) -> None:
    """Say which checkpoint was taken instead of the one ``latest`` names, and why."""
    if problem is None and not failures:
        return
    skipped = failures if problem else failures[1:]
    for ckpt, e in skipped:
        report(f"{problem + '; ' if problem else ''}skipping {ckpt}: {e}")
    if problem:
        report(f"{problem}; using {taken}, the newest complete checkpoint")
    else:
        report(f"{failures[0][0]} is corrupt ({failures[0][1]}); using {taken}, the newest complete checkpoint")


def remove_leftovers(run_dir: str) -> list[str]:
    """Delete what a killed trainer can leave in ``run_dir``: the temporaries of atomic
    writes (``.summary.json.*.tmp``, ``checkpoints/.latest.*.tmp``, ``checkpoints/.step-*.tmp``
    directories) and ``step-*`` directories older than the one ``latest`` names that an
    older version was deleting when it was killed (a file that ``config.json`` lists is
    missing, or ``config.json`` itself).
    Returns the paths removed. Only while holding the run directory's lock
    (:mod:`flt.train.lock`): another trainer's temporaries are live files."""
    root = _own_checkpoints_dir(run_dir)
    removed = [os.path.join(run_dir, n) for n in remove_temporaries(run_dir)]
    removed += [os.path.join(root, n) for n in remove_temporaries(root)]
    # Pruning deletes only checkpoints older than the one `latest` names, after writing it.
    named = _read_latest(root)[0]
    for name in _step_dirs(root):
        ckpt = os.path.join(root, name)
        if named is not None and name < named and _half_deleted(ckpt):
            discard_dir(ckpt)
            removed.append(ckpt)
    return removed


def _half_deleted(ckpt: str) -> bool:
    """True if ``ckpt`` lacks its ``config.json`` or a file it lists (what an interrupted
    ``rmtree`` leaves); a checkpoint with all its files, even corrupt ones, is kept."""
    path = os.path.join(ckpt, CONFIG_FILE)
    if os.path.islink(ckpt):
        return False  # not this run's to delete
    if not os.path.lexists(path):
        return True
    try:
        files = read_json_file(path)["files"]
        paths = [confined_path(ckpt, name, path) for name in files]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return not all(os.path.lexists(p) for p in paths)


def read_checkpoint_config(ckpt: str) -> dict[str, Any]:
    """The checkpoint's ``config.json``, after verifying that every file matches its hash.

    The files it lists must include the weights and the trainer state, and every name
    must be a file of ``ckpt`` itself (:func:`flt._io.confined_path`): all names are
    checked before any file is opened."""
    path = os.path.join(ckpt, CONFIG_FILE)
    confined_path(ckpt, CONFIG_FILE, f"checkpoint {ckpt}", CheckpointError)
    meta = read_json(path, f"checkpoint file missing: {path}", lambda e: CheckpointError(f"checkpoint file {path} is corrupt: {e}"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} is not an flt checkpoint config (format {FORMAT!r})")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path} has no valid step (a non-negative integer), got {step!r}")
    named = _STEP_DIR.match(os.path.basename(os.path.normpath(ckpt)))
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"{path} says step {step}, but its directory is {os.path.basename(os.path.normpath(ckpt))}; "
                              "the checkpoint was altered")
    files = {fname: (confined_path(ckpt, fname, path, CheckpointError), info) for fname, info in meta["files"].items()}
    missing = [name for name in (MODEL_FILE, STATE_FILE) if name not in files]
    if missing:
        raise CheckpointError(f"{path} does not list {' or '.join(missing)} among its files, so it cannot be verified")
    for fpath, info in files.values():
        if not os.path.isfile(fpath):
            raise FileNotFoundError(f"checkpoint file missing: {fpath}")
        if not isinstance(info, dict) or os.path.getsize(fpath) != info.get("bytes") or sha256_file(fpath) != info.get("sha256"):
            raise CheckpointError(f"checkpoint file {fpath} is corrupt or truncated (its size or SHA-256 does not match {path})")
    return meta


def load_weights(ckpt: str, model: torch.nn.Module) -> bool:
    """Load ``model.safetensors`` into ``model`` (strict: every tensor must match). A file
    written before attention layers had a core is upgraded as it loads
    (:func:`flt.layers.upgrade.upgrading`); returns True for such a file, whose optimizer
    state then needs :func:`optimizer_state_before_cores`."""
    path = confined_path(ckpt, MODEL_FILE, f"checkpoint {ckpt}", CheckpointError)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        with upgrading(model) as moved:
            load_model(model, path, strict=True, device=str(next(model.parameters()).device))
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {e}") from None
    except RuntimeError as e:
        raise CheckpointError(f"the weights in {path} do not fit this model: {e}") from None
    return bool(moved)


def optimizer_state_before_cores(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                                 model: torch.nn.Module) -> dict[str, Any]:
    """The optimizer state ``saved`` by a run whose model listed its parameters as before
    attention layers had cores (:func:`flt.layers.upgrade.parameters_before_cores`),
    renumbered for ``optimizer`` over ``model`` as it lists them now, so that each parameter
    gets its own moments back. Only a core with parameters of its own (FLT's
    ``far_constant``, ``far_field="constant"`` or ``"positive"``) lists them differently;
    for any other model the state comes back renumbered to the same numbers. Raises
    ``ValueError`` when the groups or their sizes differ from ``optimizer``'s."""
    before = {id(p): i for i, p in enumerate(parameters_before_cores(model))}
    current = optimizer.state_dict()["param_groups"]
    if len(saved["param_groups"]) != len(current):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this model's {len(current)}")
    state: dict[Any, Any] = {}
    groups = []
    for group, now, then in zip(optimizer.param_groups, current, saved["param_groups"], strict=True):
        if len(then["params"]) != len(group["params"]):
            raise ValueError(f"the checkpoint's optimizer holds {len(then['params'])} parameters in a group where this "
                             f"model has {len(group['params'])}")
        index = {id(p): i for p, i in zip(group["params"], now["params"], strict=True)}
        listed_then = sorted(group["params"], key=lambda p: before[id(p)])
        for p, old in zip(listed_then, then["params"], strict=True):
            if old in saved["state"]:
                state[index[id(p)]] = saved["state"][old]
        groups.append({**then, "params": now["params"]})
    return {"state": state, "param_groups": groups}


def load_trainer_state(ckpt: str, step: int | None = None) -> dict[str, Any]:
    """``trainer.pt`` loaded with ``weights_only=True`` (tensors and plain containers only),
    checked to be a dict whose ``step`` is ``step`` (the checkpoint's, from its
    ``config.json``) when given; anything else raises :class:`CheckpointError` naming it."""
    path = confined_path(ckpt, STATE_FILE, f"checkpoint {ckpt}", CheckpointError)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, RecursionError) as e:
        from flt.data._files import torch_load_error

        raise CheckpointError(f"checkpoint file {path} is corrupt: {torch_load_error(e)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not a trainer state (a dict)")
    if step is not None and state.get("step") != step:
        raise CheckpointError(f"checkpoint file {path} holds the state of step {state.get('step')!r}, but "
                              f"{os.path.join(ckpt, CONFIG_FILE)} says step {step}; the checkpoint was altered")
    return state


def saved_run(ckpt: str, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(preset, model)``: the records of a checkpoint's ``config.json`` (``meta``) that
    rebuild its run, refused with a :class:`CheckpointError` naming the file unless they have
    the shape ``flt train`` writes (a preset with a task name, a run and data options, and a
    model config)."""
    preset, model = meta.get("preset"), meta.get("model")
    if not (isinstance(preset, dict) and isinstance(preset.get("task"), str) and isinstance(preset.get("run"), dict)
            and isinstance(preset.get("data", {}), dict) and isinstance(model, dict)):
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FILE)} records no run flt can rebuild (a preset with task, run "
                              "and data, and a model)")
    return preset, model


def load_checkpoint_model(path: str, *, device: torch.device | str = "cpu", report: Callable[[str], None] = _note) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, meta)`` from a run or checkpoint directory: the model rebuilt from its saved
    config with the saved weights, in eval mode; ``meta`` is the checkpoint's ``config.json``.
    ``report`` receives :func:`find_checkpoint`'s messages."""
    ckpt, meta = locate_checkpoint(path, report=report)
    preset, model_record = saved_run(ckpt, meta)
    try:
        task, cfg = get_task(preset["task"]), config_from_dict(model_record)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FILE)} has no valid model config: {e}") from None
    model = task.build_model(cfg, device=device)
    load_weights(ckpt, model)
    return model.eval(), meta
