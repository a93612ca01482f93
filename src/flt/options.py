"""Options of mechanisms and encodings: one syntax for every command, one validation for
the API and the CLI.

Syntax (every command that takes ``--attention``)::

    NAME[:KEY=VALUE[:KEY=VALUE...]]           flt train --attention flt:num_frequencies=16
    ENTRY[,ENTRY...]                          flt compare --attention flt,softmax:relative_bias=alibi

``VALUE`` is JSON (numbers, ``true``/``false``, ``null``, lists) or, when it is not valid
JSON, the text itself (``spectrum=local``). Commas and colons inside brackets or quotes do
not split (``local:window_sizes=[2,8]``). ``--attn-opt KEY=VALUE`` (repeatable) sets
options too: it applies to every entry. The same key given by both with different values
is an error (there is no silent precedence); with the same value it is accepted.

Validation. Options are checked where they enter, by one validator
(:func:`flt._signatures.check_options`: names, and types from the annotations of the
signature that lists a class's options): :func:`check_attention_options` for
:data:`flt.ATTENTION` entries by name, whose ``**spectrum_options`` are checked against
``flt.relative.spectra.SPECTRA[spectrum]``, and :func:`check_posenc_options` for :data:`flt.POSENC`
entries. A layer's builder runs the same check (``FLTAttention.from_options``,
:meth:`flt.layers.base.AttentionBase.from_options`), so ``FLTAttention.from_options(64, 4,
num_frequencies="abc")`` and ``flt train --attn-opt num_frequencies=abc`` fail with the same
message, naming the option and the expected type; a layer built from its parts checks its
own arguments. An unknown name lists the valid ones and suggests the closest. Values are
only type-checked here; ranges stay with the constructors and combinations with
:mod:`flt.layers.rules`.

Once per option set. Options enter at the outermost of nested entry points: the command
line checks them before any data loads, then builds the model, whose builders
(:func:`flt.models.build_attention`, :func:`flt.models.build_posenc`) are entry points of
their own for Python callers, and builds each of its layers from them. The checks return
the options as :class:`CheckedOptions`, which the command line puts in the model's config:
the builders take such a set as checked, and check any other dict (a model checks each
distinct set it is given once, not once per layer). A set that fails fails with the same
message every time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flt._io import MAX_JSON_DEPTH, nests_deeper_than
from flt._signatures import (
    FORWARDS,
    Option,
    Options,
    UnknownOptionError,
    check_fields,
    check_keyword_types,
    check_options,
    constructor_options,
)
from flt.layers.base import ATTENTION_ARGUMENTS, check_layer_options

__all__ = [
    "ATTENTION_ARGUMENTS",
    "FORWARDS",
    "CheckedOptions",
    "Option",
    "Options",
    "UnknownOptionError",
    "check_attention_options",
    "check_fields",
    "check_keyword_types",
    "check_posenc_options",
    "checked_once",
    "constructor_options",
    "merge_options",
    "parse_assignments",
    "parse_attention",
    "parse_attention_list",
    "parse_value",
    "run_label",
]


# -- syntax ------------------------------------------------------------------------------


def parse_value(text: str, where: str = "an option value") -> Any:
    """A JSON value, or the text itself when it is not valid JSON (``local`` -> ``"local"``).

    Python's spellings ``True``/``False``/``None`` (any case) are read as the booleans and
    null: a flag typed the Python way must not become the always-true string ``"False"``.
    JSON nested more than :data:`flt._io.MAX_JSON_DEPTH` deep is refused with a
    ``ValueError`` naming ``where`` (the option)."""
    try:
        value = json.loads(text)
        too_deep = nests_deeper_than(value, MAX_JSON_DEPTH)
    except RecursionError:
        too_deep = True
    except json.JSONDecodeError:
        word = text.strip().lower()
        if word in _WORDS:
            return _WORDS[word]
        return text
    if too_deep:
        raise ValueError(f"{where}: the value nests more than {MAX_JSON_DEPTH} levels deep; no option takes such a value")
    return value


#: Seeds fit a signed 64-bit integer: torch's generators take seeds below 2**64, and flt
#: derives seeds from a run's by small offsets (a process's rank, a draw's index).
MAX_SEED = 2**63 - 1
#: More CPU threads than any machine has is a typo (torch takes a C int).
MAX_THREADS = 1 << 16


def check_seed(value: object, name: str, *, allow_none: bool = False) -> None:
    """Refuse a seed ``name`` that is not an integer in [0, :data:`MAX_SEED`] (or None
    with ``allow_none``), with a ``ValueError`` naming it."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r} (seeds lie in [0, 2**63 - 1])")


def check_threads(value: object, name: str = "--threads") -> None:
    """Refuse a thread count ``name`` that is not an integer in [1, :data:`MAX_THREADS`]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ValueError(f"{name} must be a positive integer, got {value!r} (at most {MAX_THREADS})")


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def _assignment(item: str, where: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{where} expects KEY=VALUE, got {item!r}")
    return key, parse_value(value, f"{where} {key}")


def parse_assignments(items: list[str] | None, flag: str) -> dict:
    """``["a=1", "b=x"] -> {"a": 1, "b": "x"}`` (a repeated key: the last one wins)."""
    return dict(_assignment(item, flag) for item in items or [])


def _split(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets, braces and double quotes."""
    parts, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def parse_attention(text: str, flag: str = "--attention") -> tuple[str, dict]:
    """One entry ``NAME[:KEY=VALUE...]`` -> ``(name, options)``.

    >>> parse_attention("flt:num_frequencies=16:spectrum=local")
    ('flt', {'num_frequencies': 16, 'spectrum': 'local'})
    """
    raw = text.strip()
    name, *items = _split(raw, ":")
    name = name.strip()
    if not name:
        raise ValueError(f"{flag} entry {raw!r} has no mechanism name (expected NAME[:KEY=VALUE...])")
    options: dict = {}
    for item in items:
        key, value = _assignment(item, f"{flag} entry {raw!r}: options must be KEY=VALUE;")
        if key in options:
            raise ValueError(f"{flag} entry {raw!r} sets {key!r} twice")
        options[key] = value
    return name, options


def parse_attention_list(text: str, flag: str = "--attention") -> list[tuple[str, str, dict]]:
    """Comma-separated entries -> ``[(label, name, options)]``; ``label`` is the entry as
    written (stripped). Labels must be distinct."""
    entries = []
    for raw in _split(text, ","):
        raw = raw.strip()
        if not raw:
            raise ValueError(f"{flag} has an empty entry: {text!r}")
        entries.append((raw, *parse_attention(raw, flag)))
    labels = [label for label, _, _ in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{flag} lists an entry twice: {text!r}")
    return entries


def merge_options(entry: dict, flags: dict, *, entry_source: str, flag_source: str = "--attn-opt") -> dict:
    """``entry`` and ``flags`` in one dict; a key both set to different values is an error.

    ``entry_source`` and ``flag_source`` name where each came from in the message.
    """
    for key in entry.keys() & flags.keys():
        if entry[key] != flags[key] or type(entry[key]) is not type(flags[key]):
            raise ValueError(
                f"option {key!r} is set twice: {json.dumps(entry[key])} by {entry_source} and "
                f"{json.dumps(flags[key])} by {flag_source}; give it once"
            )
    return {**entry, **flags}


def run_label(text: str) -> str:
    """A file-name-safe form of an entry (``flt:num_frequencies=16`` -> ``flt_num_frequencies=16``)."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text.strip())


# -- validation --------------------------------------------------------------------------

#: The same for :data:`flt.POSENC` constructors.
POSENC_ARGUMENTS = ("dim", "pos_dim", "device", "dtype")


def _registry_name(cls: type, registry: dict) -> str | None:
    return next((name for name, entry in registry.items() if entry is cls), None)


def _resolve(mechanism: str | type, registry: dict, what: str) -> tuple[type, str]:
    from flt._checks import check_choice

    if isinstance(mechanism, str):
        check_choice(what, mechanism, registry)
        return registry[mechanism], f"{what} {mechanism!r}"
    name = _registry_name(mechanism, registry)
    return mechanism, f"{what} {name!r}" if name else mechanism.__name__


class CheckedOptions(dict):
    """Options as they passed :func:`check_attention_options` or :func:`check_posenc_options`:
    a dict of the same items that remembers which class and reserved names it was checked
    against, so that the model builders it is handed to (:func:`flt.models.build_attention`,
    :func:`flt.models.build_posenc`) build from it without checking it again. An item set
    or replaced after the check makes it unchecked again; a plain dict is always checked."""

    #: The class and reserved names it was checked against, and its items then.
    checked: tuple[type, tuple[str, ...], tuple[tuple[str, Any], ...]]

    def checked_for(self, cls: type, reserved: tuple[str, ...]) -> bool:
        """Whether these very items passed the check of ``cls`` with ``reserved`` reserved."""
        checked = self.__dict__.get("checked")
        if checked is None or checked[0] is not cls or checked[1] != reserved or len(checked[2]) != len(self):
            return False
        return all(key in self and self[key] is value for key, value in checked[2])


def _checked(options: dict[str, Any], cls: type, reserved: tuple[str, ...]) -> CheckedOptions:
    result = CheckedOptions(options)
    result.checked = (cls, reserved, tuple(options.items()))
    return result


def check_attention_options(mechanism: str | type, options: dict[str, Any], *,
                            reserved: tuple[str, ...] = ()) -> CheckedOptions:
    """Check ``options`` for ``ATTENTION[mechanism]`` (a name or the class itself).

    Every keyword argument of the constructor is known (``dim``, ``heads``, ``pos_dim``,
    ``causal``, ``device``, ``dtype`` too, unless listed in ``reserved``: the CLI reserves
    them, since the model sets them); ``**spectrum_options`` are checked against the
    spectrum that ``options["spectrum"]`` (or the default) selects. Raises
    :class:`UnknownOptionError` for an unknown name, ``TypeError`` for a value of the wrong
    type, ``ValueError`` for a reserved name or an unknown mechanism or spectrum. Returns
    the options as :class:`CheckedOptions` (module docstring).
    """
    from flt.layers.registry import ATTENTION

    cls, _ = _resolve(mechanism, ATTENTION, "attention")
    # A seed of the mechanism's draws is a seed as the run's is (check_seed), whatever the class's annotation allows.
    check_seed(options.get("seed"), "attention option seed", allow_none=True)
    check_layer_options(cls, options, reserved=reserved)
    return _checked(options, cls, reserved)


def checked_once(mechanism: str, options: dict[str, Any]) -> CheckedOptions:
    """``options`` of ``ATTENTION[mechanism]`` checked with :data:`ATTENTION_ARGUMENTS`
    reserved (what a builder that sets those arguments itself needs): as they are when they
    already passed that check, else checked now (:func:`check_attention_options`)."""
    from flt.layers.registry import ATTENTION

    cls = ATTENTION.get(mechanism)
    if cls is not None and isinstance(options, CheckedOptions) and options.checked_for(cls, ATTENTION_ARGUMENTS):
        return options
    return check_attention_options(mechanism, options, reserved=ATTENTION_ARGUMENTS)


def check_posenc_options(encoding: str | type, options: dict[str, Any], *,
                         reserved: tuple[str, ...] = ()) -> CheckedOptions:
    """Check ``options`` for ``POSENC[encoding]`` (a name or the class); as
    :func:`check_attention_options`."""
    from flt.posenc import POSENC

    cls, owner = _resolve(encoding, POSENC, "posenc")
    check_seed(options.get("seed"), "posenc option seed", allow_none=True)
    check_options(owner, cls, options, arguments=POSENC_ARGUMENTS, reserved=reserved)
    return _checked(options, cls, reserved)

