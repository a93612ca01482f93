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

Validation. Options are checked against the constructor signature of the class that takes
them (names, and types from the annotations): :func:`check_attention_options` for
:data:`flt.ATTENTION` entries, whose ``**spectrum_options`` are checked against
``flt.relative.spectra.SPECTRA[spectrum]``, and :func:`check_posenc_options` for
:data:`flt.POSENC` entries. Every attention layer runs the same check when it is built
(:class:`flt.layers.base.AttentionBase`), so ``FLTAttention(64, 4, num_frequencies="abc")``
and ``flt train --attn-opt num_frequencies=abc`` fail with the same message, naming the
option and the expected type. An unknown name lists the valid ones and suggests the
closest. Values are only type-checked here; ranges and combinations stay with the
constructors.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import numbers
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "UnknownOptionError",
    "check_attention_options",
    "check_fields",
    "check_keyword_types",
    "check_posenc_options",
    "constructor_options",
    "merge_options",
    "parse_assignments",
    "parse_attention",
    "parse_attention_list",
    "parse_value",
    "run_label",
]


class UnknownOptionError(TypeError, ValueError):
    """An option that the mechanism does not take. A ``TypeError`` like Python's own
    "unexpected keyword argument", and a ``ValueError`` like the project's other bad options."""


# -- syntax ------------------------------------------------------------------------------


def parse_value(text: str):
    """A JSON value, or the text itself when it is not valid JSON (``local`` -> ``"local"``).

    Python's spellings ``True``/``False``/``None`` (any case) are read as the booleans and
    null: a flag typed the Python way must not become the always-true string ``"False"``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        word = text.strip().lower()
        if word in _WORDS:
            return _WORDS[word]
        return text


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def _assignment(item: str, where: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{where} expects KEY=VALUE, got {item!r}")
    return key, parse_value(value)


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


# -- signatures --------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One keyword parameter of a constructor."""

    name: str
    hint: Any  # the evaluated annotation; None when absent or not evaluable
    default: Any
    owner: type


@dataclass(frozen=True)
class Options:
    """The keyword parameters a class's constructor takes, ``**kwargs`` followed up the MRO."""

    params: dict[str, Option]
    forwarded: str | None  # name of a ``**`` parameter listed in FORWARDS, else None
    open: bool  # a ``**`` parameter that goes nowhere we can inspect: any name is accepted


def _spectra():
    from flt.relative.spectra import SPECTRA

    return SPECTRA


#: ``**name`` parameters that go to another registry's constructor: the parameter that
#: selects the entry, the registry, the description of the target and the arguments the
#: layer passes itself (not options).
FORWARDS: dict[str, tuple[str, Any, str, tuple[str, ...]]] = {
    "spectrum_options": ("spectrum", _spectra, "spectrum", ("heads", "pos_dim", "num_frequencies", "device", "dtype")),
}


def _evaluate(annotation, func) -> Any:
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        try:
            return eval(annotation, getattr(func, "__globals__", {}))  # noqa: S307 (what typing.get_type_hints does)
        except Exception:  # noqa: BLE001 (an annotation we cannot evaluate is not checked)
            return None
    return annotation


@functools.lru_cache(maxsize=None)
def constructor_options(cls: type) -> Options:
    """The keyword parameters of ``cls(...)``: those of its ``__init__``, and, while an
    ``__init__`` passes ``**kwargs`` on to ``super().__init__``, those of the next one."""
    params: dict[str, Option] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass.__module__.split(".")[0] in ("builtins", "torch"):
            return Options(params, None, True)
        var_keyword = None
        for i, p in enumerate(inspect.signature(init).parameters.values()):
            if i == 0 or p.kind is p.VAR_POSITIONAL:
                continue
            if p.kind is p.VAR_KEYWORD:
                var_keyword = p.name
            elif p.name not in params:
                params[p.name] = Option(p.name, _evaluate(p.annotation, init), p.default, klass)
        if var_keyword is None:
            return Options(params, None, False)
        if var_keyword in FORWARDS:
            return Options(params, var_keyword, False)
    return Options(params, None, True)


# -- types -------------------------------------------------------------------------------


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy.bool_


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _accepts(value, hint) -> bool:
    if hint is None or hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return _is_bool(value)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_real(value)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or hint in (list, tuple, Sequence):
        import torch

        if isinstance(value, torch.Tensor):  # what the spectra's per-axis values accept too
            return origin is not None and not value.is_complex() and value.dtype != torch.bool
        if not isinstance(value, (list, tuple)) or (origin or hint) is list and not isinstance(value, list):
            return False
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(_accepts(v, a) for v, a in zip(value, args))
        return not args or all(_accepts(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # anything more exotic is left to the constructor


def _describe(hint) -> str:
    if hint is type(None):
        return "None (null)"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    named = {bool: "a bool (true or false)", int: "an int", float: "a number", str: "a string", dict: "a dict"}
    if hint in named:
        return named[hint]
    if origin in (list, tuple, Sequence) or hint in (list, tuple, Sequence):
        inner = {int: "ints", float: "numbers", str: "strings", bool: "bools"}.get(args[0] if args else None, "values")
        return f"a list of {inner}"
    if isinstance(hint, type):
        name = hint.__qualname__ if hint.__module__ == "builtins" else f"{hint.__module__.split('.')[0]}.{hint.__qualname__}"
        return f"a {name}"
    return str(hint)


def _check_type(owner: str, option: Option, value, via: str = "") -> None:
    if not _accepts(value, option.hint):
        where = f" (of {via})" if via else ""
        raise TypeError(
            f"{owner}: option {option.name!r}{where} must be {_describe(option.hint)}, "
            f"got {value!r} ({type(value).__name__})"
        )


def check_fields(obj) -> None:
    """Check every field of the dataclass instance ``obj`` against its annotation (a bool is
    never a number, an int field takes no float): ``TypeError`` naming the field, the
    expected type and the value. Ranges stay with the dataclass's own checks."""
    import dataclasses

    hints = _field_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints.get(f.name)
        if hint is not None and not _accepts(getattr(obj, f.name), hint):
            value = getattr(obj, f.name)
            raise TypeError(f"{type(obj).__name__}: {f.name} must be {_describe(hint)}, got {value!r} ({type(value).__name__})")


@functools.lru_cache(maxsize=None)
def _field_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 (a hint we cannot evaluate is not checked)
        return {}


def check_keyword_types(cls: type, options: dict, owner: str) -> None:
    """Type-check the ``options`` that ``cls``'s constructor names (from its annotations);
    names it does not know are left to the caller. ``TypeError`` names ``owner`` and the option."""
    params = constructor_options(cls).params
    for key, value in options.items():
        if key in params:
            _check_type(owner, params[key], value)


# -- validation --------------------------------------------------------------------------

#: Arguments of every :data:`flt.ATTENTION` constructor that the caller (the model) sets:
#: not options.
ATTENTION_ARGUMENTS = ("dim", "heads", "pos_dim", "causal", "device", "dtype")
#: The same for :data:`flt.POSENC` constructors.
POSENC_ARGUMENTS = ("dim", "pos_dim", "device", "dtype")


def _registry_name(cls: type, registry: dict) -> str | None:
    return next((name for name, entry in registry.items() if entry is cls), None)


def _resolve(mechanism, registry: dict, what: str) -> tuple[type, str]:
    from flt._checks import check_choice

    if isinstance(mechanism, str):
        check_choice(what, mechanism, registry)
        return registry[mechanism], f"{what} {mechanism!r}"
    name = _registry_name(mechanism, registry)
    return mechanism, f"{what} {name!r}" if name else mechanism.__name__


def _listing(cls: type, names, extra: tuple[str, dict] | None) -> str:
    text = f"{cls.__name__} takes {', '.join(sorted(names)) or 'no options'}"
    if extra is not None and extra[1]:
        text += f"; its {extra[0]} takes {', '.join(sorted(extra[1]))}"
    return text


def _check(owner: str, cls: type, options: dict, *, arguments: tuple[str, ...], reserved: tuple[str, ...]) -> None:
    sig = constructor_options(cls)
    forwarded: dict[str, Option] = {}
    target = registry = choice = None
    if sig.forwarded is not None:
        selector, registry, what, supplied = FORWARDS[sig.forwarded]
        choice = options.get(selector, sig.params[selector].default if selector in sig.params else None)
        if selector in sig.params:
            _check_type(owner, sig.params[selector], choice)
        registry = registry()
        if choice in registry:
            target = f"{what} {choice!r}"
            forwarded = {
                k: v for k, v in constructor_options(registry[choice]).params.items() if k not in supplied and k not in sig.params
            }
        else:
            from flt._checks import check_choice

            check_choice(selector, choice, registry)
    own = [k for k in sig.params if k not in arguments]
    for key, value in options.items():
        if key in reserved:
            raise ValueError(f"{owner}: {key!r} is not an option: the model sets {', '.join(reserved[:-1])} and {reserved[-1]}")
        if key in sig.params:
            _check_type(owner, sig.params[key], value)
        elif key in forwarded:
            _check_type(owner, forwarded[key], value, via=target)
        elif not sig.open:
            close = difflib.get_close_matches(key, own + list(forwarded), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if target is not None:
                others = [repr(n) for n, entry in registry.items() if n != choice and key in constructor_options(entry).params]
                if others:
                    names = ", ".join(others[:-1]) + " or " + others[-1] if len(others) > 1 else others[0]
                    hint += f"; {key!r} is an option of the {what} {names}, not of {choice!r}"
            listing = _listing(cls, own, (target, forwarded) if target else None)
            raise UnknownOptionError(f"{owner}: unknown option {key!r}{hint} ({listing})")
    hook = getattr(registry[choice], "check_options", None) if target is not None else None
    if hook is not None:
        try:
            hook({k: v for k, v in options.items() if k in forwarded})
        except ValueError as err:
            raise ValueError(f"{owner}: {err}") from None


def check_attention_options(mechanism, options: dict, *, reserved: tuple[str, ...] = ()) -> None:
    """Check ``options`` for ``ATTENTION[mechanism]`` (a name or the class itself).

    Every keyword argument of the constructor is known (``dim``, ``heads``, ``pos_dim``,
    ``causal``, ``device``, ``dtype`` too, unless listed in ``reserved``: the CLI reserves
    them, since the model sets them); ``**spectrum_options`` are checked against the
    spectrum that ``options["spectrum"]`` (or the default) selects. Raises
    :class:`UnknownOptionError` for an unknown name, ``TypeError`` for a value of the wrong
    type, ``ValueError`` for a reserved name or an unknown mechanism or spectrum.
    """
    from flt.layers.registry import ATTENTION

    cls, owner = _resolve(mechanism, ATTENTION, "attention")
    # feature_dim: how a kernel layer subclass sizes its feature map's input; not listed.
    _check(owner, cls, options, arguments=(*ATTENTION_ARGUMENTS, "feature_dim"), reserved=reserved)


def check_posenc_options(encoding, options: dict, *, reserved: tuple[str, ...] = ()) -> None:
    """Check ``options`` for ``POSENC[encoding]`` (a name or the class); as
    :func:`check_attention_options`."""
    from flt.posenc import POSENC

    cls, owner = _resolve(encoding, POSENC, "posenc")
    _check(owner, cls, options, arguments=POSENC_ARGUMENTS, reserved=reserved)

