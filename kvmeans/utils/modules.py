"""Copies of a model that share its weights."""
from __future__ import annotations

import copy
import itertools

from torch import nn


def copy_sharing_weights(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``'s modules, configs and hooks that holds the *same* parameter and buffer tensors (no
    second copy of the weights): for eval arms that convert their own copy (``convert_hf`` replaces modules'
    attention and configs, never the weights). Training the copy trains the original's weights too."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)
