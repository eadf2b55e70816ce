"""Atomic file and folder writes: readers never see a half-written checkpoint, model, token file or result.

The temp files and folders (``mkstemp`` / ``mkdtemp``: 0600 / 0700) get the ordinary permissions of
the umask (typically 0644 / 0755) before they are renamed into place. A writer holds an ``flock`` on its
temp (released when its process ends, even by SIGKILL): each successful write of a target deletes the
unlocked temps of that target, which killed writers left behind.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TypeVar, Union

try:
    import fcntl
except ImportError:  # pragma: no cover  (Windows: no locks, so no temp is ever taken for stale)
    fcntl = None

R = TypeVar("R")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def chmod_tree(folder: Union[str, os.PathLike]) -> None:
    """Give ``folder`` and everything below it the umask's permissions (private temp files made public)."""
    umask = _umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; False when another process holds one (or the
    file system has no locks)."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def lock_temp(tmp: Union[str, os.PathLike]) -> int:
    """Hold an flock on temp file or folder ``tmp`` (being written by this process) until the returned file
    descriptor is closed: :func:`remove_stale_temps` leaves it alone meanwhile."""
    fd = os.open(tmp, os.O_RDONLY)
    _lock(fd)
    return fd


def remove_stale_temps(path: Union[str, os.PathLike]) -> None:
    """Delete the temps of ``path`` (``.NAME.<random>.tmp`` beside it, from :func:`atomic_write` or
    :func:`atomic_dir`) that no live writer holds locked: a process killed mid-write left them."""
    path = Path(path)
    ours = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]+\.tmp")
    for p in path.parent.iterdir():
        if not ours.fullmatch(p.name):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:                                 # gone meanwhile, or a symlink: not ours
            continue
        try:
            if not _lock(fd):                           # its writer is still at work
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        finally:
            os.close(fd)


def atomic_write(path: Union[str, os.PathLike], write: Callable[[str], R]) -> R:
    """Call ``write(tmp_path)`` for a temp file in ``path``'s folder, then ``os.replace`` it over ``path``.

    On any error (or KeyboardInterrupt) the temp file is removed and ``path`` is untouched; on success the
    stale temps of ``path`` are removed (:func:`remove_stale_temps`). Returns what ``write`` returned.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    _lock(lock)
    try:
        result = write(tmp)
        fd = os.open(tmp, os.O_RDONLY)          # durable before it becomes visible
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        remove_stale_temps(path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(lock)
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


@contextlib.contextmanager
def atomic_dir(path: Union[str, os.PathLike]) -> Iterator[Path]:
    """Yield a temp folder next to ``path`` to fill; on success it replaces ``path`` (a folder, if any).

    The folder and everything in it get the umask's permissions (writers such as ``save_pretrained``
    also go through private temp files). On any error the temp folder is removed and ``path`` is untouched;
    on success the stale temps of ``path`` are removed (:func:`remove_stale_temps`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    lock = lock_temp(tmp)
    old = path.parent / f".{path.name}.old"
    try:
        yield tmp
        chmod_tree(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        remove_stale_temps(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
