"""The name transformers gives the cache in forward kwargs, ``generate``'s ``model_kwargs`` and model outputs:
``past_key_values`` up to 5.23, ``cache`` from 5.24 (which still reads ``past_key_values`` as a deprecated
alias, with a warning). kvmeans' call sites use the installed version's name through this module.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

__all__ = ["CACHE_KWARG", "cache_kwargs", "cache_from", "either_cache"]

# a feature test rather than a version compare, so dev builds around the rename are read right too
CACHE_KWARG = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
               else "past_key_values")


def cache_kwargs(cache: Any) -> dict:
    """``{CACHE_KWARG: cache}``: the keyword a transformers forward, ``generate`` or output class takes it by."""
    return {CACHE_KWARG: cache}


def cache_from(named: Mapping[str, Any], *also: str) -> Optional[Any]:
    """The cache in ``named`` (a call's kwargs, ``model_kwargs`` or a ``ModelOutput``), the installed
    version's name first, then the other one, then ``also`` (e.g. GPT-NeoX attention's ``layer_past``); None if none.
    A ``ModelOutput`` is read by the installed name only (5.24's map the old one to it, with a warning)."""
    other = () if isinstance(named, ModelOutput) else tuple({"cache", "past_key_values"} - {CACHE_KWARG})
    for name in (CACHE_KWARG, *other, *also):
        if named.get(name) is not None:
            return named[name]
    return None


def either_cache(cache: Any, past_key_values: Any) -> Optional[Any]:
    """The one of ``cache=`` / ``past_key_values=`` a forward was given (None if neither); both is an error."""
    if cache is not None and past_key_values is not None:
        raise ValueError("got both cache= and past_key_values= (transformers 5.24 renamed past_key_values to cache); "
                         "pass the cache once")
    return past_key_values if cache is None else cache
