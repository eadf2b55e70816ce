"""Type checks of configuration dataclasses against their annotations."""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import typing
from typing import Any

__all__ = ["check_field_types"]


def _matches(value: Any, tp) -> bool:
    """``value`` fits annotation ``tp``: bools are not ints, ints are floats, Optional allows None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is collections.abc.Callable:
        return callable(value)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is collections.abc.Callable:
        return "a callable"
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}"
    return getattr(origin or tp, "__name__", str(tp))


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)       # slow (evaluates the string annotations): once per class


def check_field_types(cfg) -> None:
    """Raise ``TypeError`` naming the first field of dataclass ``cfg`` whose value does not fit its annotation."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _matches(value, hints[f.name]):
            raise TypeError(f"{type(cfg).__name__}.{f.name}: expected {_describe(hints[f.name])}, got {value!r} "
                            f"({type(value).__name__}); pass a value of that type")
