"""Options checked against a constructor's signature: names, and types from the annotations.

The one validator of keyword options, for every registry that builds modules from a dict
of options (attention layers, encodings, data options, frozen configs). It lives below the
layers so that a layer's builder (:meth:`flt.layers.base.AttentionBase.from_options`) and
the command line (:mod:`flt.options`) run the same check without an import circle.

Where a class names a ``flat_builder`` (``FLTAttention.flat_builder``, the function of
:mod:`flt.layers.flat` that turns the flat option names into the layer's parts), its
options are those of the builder; otherwise those of ``__init__``, following ``**kwargs``
up the MRO. Values are only type-checked here; ranges stay with the constructors and
combinations with :mod:`flt.layers.rules`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flt._checks import check_choice, shown

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class UnknownOptionError(TypeError, ValueError):
    """An option that the mechanism does not take. A ``TypeError`` like Python's own
    "unexpected keyword argument", and a ``ValueError`` like the project's other bad options."""


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


def _spectra() -> dict[str, type]:
    from flt.relative.spectra import SPECTRA

    return SPECTRA


#: ``**name`` parameters that go to another registry's constructor: the parameter that
#: selects the entry, the registry, the description of the target and the arguments the
#: layer passes itself (not options).
FORWARDS: dict[str, tuple[str, Callable[[], dict[str, type]], str, tuple[str, ...]]] = {
    "spectrum_options": ("spectrum", _spectra, "spectrum", ("heads", "pos_dim", "num_frequencies", "device", "dtype")),
}


def _signature_source(klass: type) -> tuple[Callable[..., Any], int] | None:
    """The function whose keyword parameters are ``klass``'s options and how many leading
    parameters are not (``self``): the ``flat_builder`` it names (a function of
    :mod:`flt.layers.flat`), else its own ``__init__`` (None when it defines neither)."""
    builder = klass.__dict__.get("flat_builder")
    if isinstance(builder, staticmethod):
        return builder.__func__, 0
    init = klass.__dict__.get("__init__")
    return None if init is None else (init, 1)


def _evaluate(annotation: Any, func: Callable[..., Any]) -> Any:
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        try:
            return eval(annotation, getattr(func, "__globals__", {}))  # noqa: S307 (what typing.get_type_hints does)
        except Exception:  # noqa: BLE001 (an annotation we cannot evaluate is not checked)
            return None
    return annotation


@functools.cache
def constructor_options(cls: type) -> Options:
    """The keyword parameters of ``cls(...)``: those of its ``__init__``, and, while an
    ``__init__`` passes ``**kwargs`` on to ``super().__init__``, those of the next one."""
    params: dict[str, Option] = {}
    for klass in cls.__mro__:
        source = _signature_source(klass)
        if source is None:
            continue
        init, skip = source
        if klass.__module__.split(".")[0] in ("builtins", "torch"):
            return Options(params, None, True)
        var_keyword = None
        for i, p in enumerate(inspect.signature(init).parameters.values()):
            if i < skip or p.kind is p.VAR_POSITIONAL:
                continue
            if p.kind is p.VAR_KEYWORD:
                var_keyword = p.name
            elif p.name not in params:
                params[p.name] = Option(p.name, _evaluate(p.annotation, init), p.default, klass)
        if var_keyword is None:
            return Options(params, None, False)
        core_class = getattr(cls, "core_class", None)
        if var_keyword == "parts" and core_class is not None:
            # An attention layer's ``**parts``: its core's keyword arguments, less those the
            # layer sets itself (:class:`flt.layers.base.AttentionBase`).
            core, own = constructor_options(core_class), getattr(cls, "core_arguments", ())
            params.update({k: v for k, v in core.params.items() if k not in params and k not in own})
            return Options(params, core.forwarded, core.open)
        if var_keyword in FORWARDS:
            return Options(params, var_keyword, False)
    return Options(params, None, True)


# -- types -------------------------------------------------------------------------------


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy.bool_


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _accepts(value: object, hint: Any) -> bool:
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
        if not isinstance(value, (list, tuple)) or ((origin or hint) is list and not isinstance(value, list)):
            return False
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(_accepts(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_accepts(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # anything more exotic is left to the constructor


def _describe(hint: Any) -> str:
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
        plurals: dict[Any, str] = {int: "ints", float: "numbers", str: "strings", bool: "bools"}
        inner = plurals.get(args[0] if args else None, "values")
        return f"a list of {inner}"
    if isinstance(hint, type):
        name = hint.__qualname__ if hint.__module__ == "builtins" else f"{hint.__module__.split('.')[0]}.{hint.__qualname__}"
        return f"a {name}"
    return str(hint)


def _check_type(owner: str, option: Option, value: object, via: str = "") -> None:
    if not _accepts(value, option.hint):
        where = f" (of {via})" if via else ""
        raise TypeError(
            f"{owner}: option {option.name!r}{where} must be {_describe(option.hint)}, "
            f"got {shown(value)} ({type(value).__name__})"
        )


def check_fields(obj: DataclassInstance) -> None:
    """Check every field of the dataclass instance ``obj`` against its annotation (a bool is
    never a number, an int field takes no float): ``TypeError`` naming the field, the
    expected type and the value. Ranges stay with the dataclass's own checks."""
    import dataclasses

    cls: type = type(obj)
    hints = _field_hints(cls)
    for f in dataclasses.fields(obj):
        hint = hints.get(f.name)
        if hint is not None and not _accepts(getattr(obj, f.name), hint):
            value = getattr(obj, f.name)
            raise TypeError(f"{type(obj).__name__}: {f.name} must be {_describe(hint)}, got {shown(value)} ({type(value).__name__})")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 (a hint we cannot evaluate is not checked)
        return {}


def check_keyword_types(cls: type, options: dict[str, Any], owner: str) -> None:
    """Type-check the ``options`` that ``cls``'s constructor names (from its annotations);
    names it does not know are left to the caller. ``TypeError`` names ``owner`` and the option."""
    params = constructor_options(cls).params
    for key, value in options.items():
        if key in params:
            _check_type(owner, params[key], value)


def _listing(cls: type, names: Collection[str], extra: tuple[str, dict[str, Option]] | None) -> str:
    text = f"{cls.__name__} takes {', '.join(sorted(names)) or 'no options'}"
    if extra is not None and extra[1]:
        text += f"; its {extra[0]} takes {', '.join(sorted(extra[1]))}"
    return text


def check_options(owner: str, cls: type, options: dict[str, Any], *, arguments: tuple[str, ...],
                  reserved: tuple[str, ...]) -> None:
    """Check ``options`` against the options of ``cls`` (:func:`constructor_options`, the
    forwarded registry entry's too), reporting against ``owner`` (``attention 'flt'``):
    :class:`UnknownOptionError` for a name it does not take (the closest name suggested, the
    valid ones listed, ``arguments`` left out of the listing), ``TypeError`` for a value of
    the wrong type, ``ValueError`` for a name in ``reserved`` (set by the caller itself)."""
    sig = constructor_options(cls)
    forwarded: dict[str, Option] = {}
    target: str | None = None  # the forwarded entry's description, where one is chosen
    registry: dict[str, Any] = {}
    choice: Any = None
    what = ""
    if sig.forwarded is not None:
        selector, registry_of, what, supplied = FORWARDS[sig.forwarded]
        choice = options.get(selector, sig.params[selector].default if selector in sig.params else None)
        if selector in sig.params:
            _check_type(owner, sig.params[selector], choice)
        registry = registry_of()
        if choice in registry:
            target = f"{what} {choice!r}"
            forwarded = {
                k: v for k, v in constructor_options(registry[choice]).params.items() if k not in supplied and k not in sig.params
            }
        else:
            check_choice(selector, choice, registry)
    own = [k for k in sig.params if k not in arguments]
    for key, value in options.items():
        if key in reserved:
            raise ValueError(f"{owner}: {key!r} is not an option: the model sets {', '.join(reserved[:-1])} and {reserved[-1]}")
        if key in sig.params:
            _check_type(owner, sig.params[key], value)
        elif key in forwarded:
            _check_type(owner, forwarded[key], value, via=target or "")  # set where forwarded is
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

