"""Reading ``search.json`` back: the per-layer mechanisms (and the absolute encoding, when
the search mixed it) that ``flt train --arch`` builds."""

from __future__ import annotations

import copy
import os
from typing import Any

from flt._io import read_json

#: Which selection of ``search.json`` to train.
SELECTIONS = ("perturbation", "magnitude")


def read_search(path: str) -> dict[str, Any]:
    """The contents of a ``search.json`` (a file, or the search directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "search.json")
    data = read_json(path, f"--arch: no search result at {path}", lambda e: ValueError(f"--arch: {e}"))
    if not isinstance(data, dict) or data.get("format") != "flt-search-1":
        raise ValueError(f"--arch: {path} is not a search.json written by flt search")
    missing = [key for key in ("task", "candidates") if key not in data]
    if missing:
        raise ValueError(f"--arch: {path} lacks {', '.join(map(repr, missing))}; a search.json written by flt search has them")
    if not data.get("complete"):
        raise ValueError(f"--arch: the search in {path} has not decided every layer yet; finish it with flt search --resume")
    problem = _shape_problem(data)
    if problem is not None:
        raise ValueError(f"--arch: {path} is not a search.json written by flt search: {problem}")
    return data


def _shape_problem(data: dict[str, Any]) -> str | None:
    """What in ``data`` has not the shape :func:`arch_fields` reads, or None."""
    def candidates(key: str, kind: str) -> str | None:
        entries = data.get(key)
        if key == "posenc_candidates" and entries is None:
            return None
        if not isinstance(entries, list) or not all(
                isinstance(c, dict) and isinstance(c.get("label"), str) and isinstance(c.get(kind), str)
                and isinstance(c.get(f"{kind}_options"), dict) for c in entries):
            return f"{key} is not a list of {{label, {kind}, {kind}_options}} entries"
        return None

    for key, kind in (("candidates", "attention"), ("posenc_candidates", "posenc")):
        problem = candidates(key, kind)
        if problem is not None:
            return problem
    if not isinstance(data["task"], str):
        return "task is not a task name"
    for selection in SELECTIONS:
        chosen = data.get(selection)
        if chosen is not None and not (isinstance(chosen, list) and all(isinstance(label, str) for label in chosen)):
            return f"{selection} is not a list of candidate labels"
    posenc = data.get("posenc")
    if posenc is not None and not (isinstance(posenc, dict) and all(isinstance(posenc.get(s), (str, type(None))) for s in SELECTIONS)):
        return "posenc is not an object of chosen labels"
    return None


def arch_layers(data: dict[str, Any], selection: str = "perturbation") -> list[dict[str, Any]]:
    """``[{"attention": NAME, "attention_options": {...}}]`` per layer, for
    ``LayeredConfig.layer_attention``: the candidates ``selection`` chose."""
    if selection not in SELECTIONS:
        raise ValueError(f"--arch-select must be one of {list(SELECTIONS)}, got {selection!r}")
    chosen = data.get(selection)
    if chosen is None:
        raise ValueError(f"--arch: the search has no {selection} choice (alpha was frozen uniform: magnitude says nothing)")
    by_label = {c["label"]: c for c in data["candidates"]}
    missing = sorted(set(chosen) - set(by_label))
    if missing:
        raise ValueError(f"--arch: the search chose {missing}, which are not among its candidates")
    return [{"attention": by_label[label]["attention"], "attention_options": dict(by_label[label]["attention_options"])}
            for label in chosen]


def arch_posenc(data: dict[str, Any], selection: str = "perturbation") -> dict[str, Any] | None:
    """``{"posenc": NAME, "posenc_options": {...}}``: the absolute encoding ``selection``
    chose, or None when the search did not mix the encoding (the model keeps its own)."""
    if selection not in SELECTIONS:
        raise ValueError(f"--arch-select must be one of {list(SELECTIONS)}, got {selection!r}")
    if not data.get("posenc_candidates"):
        return None
    chosen = (data.get("posenc") or {}).get(selection)
    if chosen is None:
        raise ValueError(f"--arch: the search has no {selection} choice of the absolute encoding "
                         "(alpha was frozen uniform: magnitude says nothing)")
    by_label = {c["label"]: c for c in data["posenc_candidates"]}
    if chosen not in by_label:
        raise ValueError(f"--arch: the search chose the encoding {chosen!r}, which is not among its candidates")
    return {"posenc": by_label[chosen]["posenc"], "posenc_options": dict(by_label[chosen]["posenc_options"])}


def arch_fields(data: dict[str, Any], selection: str = "perturbation") -> dict[str, Any]:
    """The model config fields of the architecture ``selection`` chose: ``layer_attention``
    (with ``attention`` and ``attention_options`` of its first layer) and, when the search
    mixed it, ``posenc`` and ``posenc_options``; for :func:`flt.models.replace_fields`."""
    from flt.options import (
        ATTENTION_ARGUMENTS,
        POSENC_ARGUMENTS,
        check_attention_options,
        check_posenc_options,
    )

    layers = arch_layers(data, selection)
    for layer in layers:  # as the model would (flt.models.build_attention), which takes them as checked
        layer["attention_options"] = check_attention_options(layer["attention"], layer["attention_options"],
                                                             reserved=ATTENTION_ARGUMENTS)
    fields = {"attention": layers[0]["attention"], "attention_options": copy.copy(layers[0]["attention_options"]),
              "layer_attention": layers}
    posenc = arch_posenc(data, selection)
    if posenc is not None:
        posenc["posenc_options"] = check_posenc_options(posenc["posenc"], posenc["posenc_options"],
                                                        reserved=POSENC_ARGUMENTS)
        fields.update(posenc)
    return fields
