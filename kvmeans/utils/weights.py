"""Weights files that cannot be read: one :class:`CorruptWeightsError` naming the file and the fix.

A truncated, empty or garbage ``model*.safetensors`` / ``pytorch_model*.bin`` makes each loader fail in its own
words (``SafetensorError: header too small``, ``EOFError``, a pickle error advising ``weights_only=False``).
:func:`named_weight_errors` wraps a load: when it fails and a weights file of the folder does not open, the
error becomes a :class:`CorruptWeightsError`; any other failure passes unchanged (nothing is read on success).
"""
from __future__ import annotations

import contextlib
import json
import os
import zipfile
from pathlib import Path
from typing import Iterator, Optional, Tuple, Union

__all__ = ["CorruptWeightsError", "named_weight_errors", "unreadable_weights", "read_error"]

WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin")     # what transformers and kvmeans load


class CorruptWeightsError(ValueError):
    """A model folder's weights file that does not open (truncated, empty, not a weights file)."""


def unreadable_weights(folder: Union[str, os.PathLike]) -> Optional[Tuple[Path, str]]:
    """``(file, why)`` for the first weights file of ``folder`` that does not open, else None."""
    for pattern in WEIGHT_FILES:
        for file in sorted(Path(folder).glob(pattern)):
            try:
                _open(file)
            except Exception as err:
                return file, read_error(err)
    return None


def read_error(err: BaseException) -> str:
    """One line saying why a file did not read: ``err``'s first line, or for torch's weights-only unpickler
    (whose first line advises ``weights_only=False``: unsafe, and no cure for a damaged file) its actual error."""
    text = str(err).strip()
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()
        return f"not a torch.save file: {detail[0] if detail else type(err).__name__}"
    return (text.splitlines() or [type(err).__name__])[0]


def _open(file: Path) -> None:
    """Read ``file``'s header (safetensors) or its tensor records (torch.save; mmap for the zip format)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(file), "pt"):
            return
    import torch
    torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))


@contextlib.contextmanager
def named_weight_errors(folder) -> Iterator[None]:
    """Turn an error of the load inside the block into a :class:`CorruptWeightsError` when a weights file of
    ``folder`` (a local model folder; a hub name is left alone) does not open."""
    try:
        yield
    except CorruptWeightsError:
        raise
    except Exception as err:
        bad = unreadable_weights(folder) if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder) else None
        if bad is None:
            raise
        file, why = bad
        raise CorruptWeightsError(f"{file} is corrupt or truncated ({file.stat().st_size:,} bytes: {why}); "
                                  f"{_fix(Path(folder))}") from err


def _fix(folder: Path) -> str:
    try:
        name = json.loads((folder / "kvmeans_fetch.json").read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return "delete it and save the model again (save_pretrained, or the command that wrote the folder)"
    return f"fetch the model again: kvmeans models fetch {name} --force"
