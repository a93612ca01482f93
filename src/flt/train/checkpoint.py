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
If ``latest`` is missing (a run killed between renaming its first checkpoint into place
and writing ``latest``, or a deleted file), :func:`find_checkpoint` takes the newest
``step-*`` directory whose files verify and says which one it took.

Files and directories get the permissions of a plain ``open()`` / ``os.makedirs`` under
the process's umask (:mod:`flt._io`), not the 0600 / 0700 of temporary files.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from flt._io import atomic_write_text, file_mode, fsync_dir, fsync_file, make_temp_dir, sha256_file
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
    root = os.path.join(run_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name = step_dir_name(step)
    tmp = make_temp_dir(root, prefix=f".{name}.", suffix=".tmp")
    try:
        model_path = os.path.join(tmp, MODEL_FILE)
        save_model(model, model_path, metadata={"format": FORMAT, "step": str(step)})
        # safetensors writes through a private temporary file of its own: mode 0600.
        os.chmod(model_path, file_mode())
        state_path = os.path.join(tmp, STATE_FILE)
        torch.save(trainer_state, state_path)
        files = {}
        for fname, path in ((MODEL_FILE, model_path), (STATE_FILE, state_path)):
            fsync_file(path)
            files[fname] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
        meta = {"format": FORMAT, "step": step, "files": files, **config}
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = os.path.join(root, name)
        if os.path.exists(final):
            # Left by a run that was killed after writing it but before updating `latest`.
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), name + "\n")
    _prune(root, keep, current=name)
    return final


def _prune(root: str, keep: int, current: str) -> None:
    steps = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
    for old in steps[:-keep] if keep > 0 else steps:
        if old != current:
            shutil.rmtree(os.path.join(root, old))
    for n in os.listdir(root):
        if n.startswith(".step-") and n.endswith(".tmp"):
            # A temporary directory of a killed run: never complete, never referenced.
            shutil.rmtree(os.path.join(root, n))


def has_checkpoint(run_dir: str) -> bool:
    """True if ``run_dir`` holds a ``checkpoints/latest`` pointer or a ``step-*`` checkpoint directory."""
    root = os.path.join(run_dir, CHECKPOINTS)
    return os.path.exists(os.path.join(root, LATEST)) or bool(_step_dirs(root))


def _step_dirs(root: str) -> list[str]:
    """Names of the ``step-*`` directories in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _STEP_DIR.match(n) and os.path.isdir(os.path.join(root, n)))


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=2)


def find_checkpoint(path: str, *, report: Callable[[str], None] = _warn) -> str:
    """Resolve a run directory (its latest checkpoint) or a checkpoint directory.

    A run directory's checkpoint is the one ``checkpoints/latest`` names. Without
    ``latest``, it is the newest ``step-*`` directory whose ``config.json`` reads and whose
    files match their hashes (:func:`read_checkpoint_config`); every directory skipped on
    the way, and the one taken, is described in a message passed to ``report`` (default:
    :func:`warnings.warn`). Raises ``FileNotFoundError`` when there is no checkpoint and
    :class:`CheckpointError` when ``latest`` is corrupt or no ``step-*`` directory verifies.
    """
    if os.path.isfile(os.path.join(path, CONFIG_FILE)) and not os.path.isdir(os.path.join(path, CHECKPOINTS)):
        return path
    root = os.path.join(path, CHECKPOINTS)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return _newest_valid(path, root, report)
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{latest} is corrupt: it names {name!r}, not a checkpoint directory")
    found = os.path.join(root, name)
    if not os.path.isdir(found):
        raise CheckpointError(f"{latest} points to {found}, which does not exist")
    return found


def _newest_valid(path: str, root: str, report: Callable[[str], None]) -> str:
    """The newest ``step-*`` checkpoint in ``root`` that verifies, when ``latest`` is missing."""
    latest = os.path.join(root, LATEST)
    names = _step_dirs(root)
    if not names:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {latest} or a {CONFIG_FILE})")
    for name in reversed(names):
        ckpt = os.path.join(root, name)
        try:
            read_checkpoint_config(ckpt)
        except (CheckpointError, FileNotFoundError) as e:
            report(f"{latest} is missing; skipping {ckpt}: {e}")
            continue
        report(f"{latest} is missing; using {ckpt}, the newest complete checkpoint")
        return ckpt
    raise CheckpointError(f"no usable checkpoint in {path}: {latest} is missing and none of {', '.join(names)} is complete")


def read_checkpoint_config(ckpt: str) -> dict[str, Any]:
    """The checkpoint's ``config.json``, after verifying that every file matches its hash."""
    path = os.path.join(ckpt, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} is not an flt checkpoint config (format {FORMAT!r})")
    for fname, info in meta["files"].items():
        fpath = os.path.join(ckpt, fname)
        if not os.path.isfile(fpath):
            raise FileNotFoundError(f"checkpoint file missing: {fpath}")
        if not isinstance(info, dict) or os.path.getsize(fpath) != info.get("bytes") or sha256_file(fpath) != info.get("sha256"):
            raise CheckpointError(f"checkpoint file {fpath} is corrupt or truncated (its size or SHA-256 does not match {path})")
    return meta


def load_weights(ckpt: str, model: torch.nn.Module) -> None:
    """Load ``model.safetensors`` into ``model`` (strict: every tensor must match)."""
    path = os.path.join(ckpt, MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        load_model(model, path, strict=True, device=str(next(model.parameters()).device))
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {e}") from None
    except RuntimeError as e:
        raise CheckpointError(f"the weights in {path} do not fit this model: {e}") from None


def load_trainer_state(ckpt: str) -> dict[str, Any]:
    """``trainer.pt`` loaded with ``weights_only=True`` (tensors and plain containers only)."""
    path = os.path.join(ckpt, STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {type(e).__name__}: {e}") from None


def load_checkpoint_model(path: str, *, device="cpu", report: Callable[[str], None] = _warn) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, meta)`` from a run or checkpoint directory: the model rebuilt from its saved
    config with the saved weights, in eval mode; ``meta`` is the checkpoint's ``config.json``.
    ``report`` receives :func:`find_checkpoint`'s messages."""
    ckpt = find_checkpoint(path, report=report)
    meta = read_checkpoint_config(ckpt)
    try:
        task, cfg = get_task(meta["preset"]["task"]), config_from_dict(meta["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FILE)} has no valid model config: {e}") from None
    model = task.build_model(cfg, device=device)
    load_weights(ckpt, model)
    return model.eval(), meta
