"""flash-linear-attention's RWKV-7 kernels (CUDA, optional extra ``fla``), called with our argument layout."""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Optional, Tuple

from torch import Tensor

__all__ = ["fla_available", "rwkv7_fla"]


@lru_cache(maxsize=None)
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def rwkv7_fla(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
              initial_state: Optional[Tensor] = None, chunk: bool = True) -> Tuple[Tensor, Tensor]:
    """Same contract as :func:`rwkv7_naive`: fla's ``chunk_rwkv7`` (training, long prefill) or
    ``fused_recurrent_rwkv7`` (short continuations); ``w`` is the log decay in both, the state fp32."""
    from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
    fn = chunk_rwkv7 if chunk else fused_recurrent_rwkv7
    state = None if initial_state is None else initial_state.float().contiguous()
    o, final = fn(r=r, w=w, k=k, v=v, a=a, b=b, scale=1.0, initial_state=state, output_final_state=True)
    return o, final
