"""Progress bars, decided in one place: a tqdm bar when tqdm is installed and a bar is wanted, else None (the
caller then shows nothing, or plain lines of its own: training's :class:`kvmeans.train.metrics.TrainProgress`).

Users: the demo's per-model bars (:class:`kvmeans.demo.ModelBars`), training and distillation
(``TrainProgress``), ``kvmeans eval niah`` / ``ruler`` and ``kvmeans bench pretrained``.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["progress_bar", "write_line"]


def progress_bar(total: int, enabled: bool = True, terminal: bool = False, **kwargs) -> Optional[Any]:
    """A ``tqdm.auto`` bar counting to ``total`` on stderr (``dynamic_ncols``; ``kwargs`` go to tqdm: ``unit``,
    ``desc``, ``initial``, ``position``...), or None: when not ``enabled``, when tqdm is not installed, or, with
    ``terminal``, when stderr is not a terminal."""
    if not enabled or (terminal and not sys.stderr.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, dynamic_ncols=True, **kwargs)


def write_line(message: str) -> None:
    """Print ``message`` to stdout above any open bars (tqdm's ``write``), or plainly without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(message)
        return
    tqdm.write(message)
