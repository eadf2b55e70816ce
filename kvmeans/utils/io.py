"""Atomic file writes: readers never see a half-written checkpoint, token file or result."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, TypeVar, Union

R = TypeVar("R")


def atomic_write(path: Union[str, os.PathLike], write: Callable[[str], R]) -> R:
    """Call ``write(tmp_path)`` for a temp file in ``path``'s folder, then ``os.replace`` it over ``path``.

    On any error (or KeyboardInterrupt) the temp file is removed and ``path`` is untouched.
    Returns what ``write`` returned.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        result = write(tmp)
        fd = os.open(tmp, os.O_RDONLY)          # durable before it becomes visible
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)        # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return result


def atomic_write_text(path: Union[str, os.PathLike], text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write)


def atomic_write_file(path: Union[str, os.PathLike], write: Callable) -> None:
    """Like :func:`atomic_write` but ``write`` receives an open binary file object."""
    def to_file(tmp):
        with open(tmp, "wb") as f:
            write(f)
    atomic_write(path, to_file)
