"""``kvmeans data prepare``: text -> ``train.bin`` / ``val.bin`` token files (format in ``kvmeans.train.data``).

Inputs: ``builtin`` (the built-in Shakespeare corpus, one document per play; ``builtin:act`` /
``builtin:scene`` for one per act / scene), text files (one
document each), folders (recursively ``*.txt``, ``*.md``, ``*.jsonl``, sorted), JSONL files (one
document per line, from the ``text_field`` key), a ``datasets.save_to_disk`` folder, or the name of
a dataset the ``datasets`` library can load locally (``NAME`` or ``NAME:SPLIT``, default split train).

Every document is tokenized (no special tokens added) and followed by the EOS token. The split is
by document: ``round(val_fraction * n_docs)`` documents (at least 1 when ``val_fraction > 0`` and
there are >= 2 documents) drawn with ``numpy.random.default_rng(seed)`` go to val, in input order.
The tokenized corpus is held in memory (2 or 4 bytes a token) until both files are written.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from kvmeans.train.data import builtin_documents, token_dtype, write_token_file
from kvmeans.train.tokenizers import eos_token_id, load_tokenizer, save_tokenizer

_SUFFIXES = (".txt", ".md", ".jsonl")


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise ValueError(f"{path}:{i}: no string field {text_field!r} (use --text-field)")
            yield row[text_field]


def _dataset_docs(name: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"input {name!r}: no such file or folder (and the `datasets` package is "
                                "not installed, so it cannot be read as a dataset name)") from None
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            repo, _, split = name.partition(":")
            ds = datasets.load_dataset(repo, split=split or "train")
    except Exception as e:  # datasets raises many types; the user needs the name and the reason
        raise FileNotFoundError(f"input {name!r}: not a file or folder, and `datasets` cannot load it "
                                f"locally: {type(e).__name__}: {e}") from None
    if text_field not in ds.column_names:
        raise ValueError(f"dataset {name!r} has no column {text_field!r} (columns: {ds.column_names})")
    for row in ds:
        yield row[text_field]


def iter_documents(inputs: Sequence[Union[str, Path]], text_field: str = "text") -> Iterator[Tuple[str, str]]:
    """Yield ``(source, text)`` for every non-blank document of ``inputs`` (see the module docstring)."""
    for item in inputs:
        p = Path(item)
        if str(item).split(":")[0] == "builtin" and not p.exists():
            docs: Any = builtin_documents(str(item).partition(":")[2] or "play")
            files: List[Path] = []
        elif p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
            docs, files = _dataset_docs(str(p), text_field), []
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES)
            if not files:
                raise FileNotFoundError(f"{p}: folder holds no {'/'.join(_SUFFIXES)} files")
            docs = []
        elif p.is_file():
            docs, files = [], [p]
        else:
            docs, files = _dataset_docs(str(item), text_field), []
        for doc in docs:
            if doc.strip():
                yield str(item), doc
        for f in files:
            if f.suffix == ".jsonl":
                for doc in _jsonl_docs(f, text_field):
                    if doc.strip():
                        yield str(f), doc
            else:
                doc = f.read_text(encoding="utf-8")
                if doc.strip():
                    yield str(f), doc


def concat_pack(docs: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], Dict[str, int]]:
    """``concat``: the documents (each already ending in EOS) back to back; nothing is discarded."""
    n = int(sum(len(d) for d in docs))
    return list(docs), {"input_tokens": n, "tokens": n, "discarded": 0}


def cram_pack(docs: Sequence[np.ndarray], seq_len: int) -> Tuple[List[np.ndarray], Dict[str, int]]:
    """``cram`` (the authors' packing): windows of exactly ``W = seq_len + 1`` tokens.

    Each document (tokens + EOS) is cut to its first W tokens. A document of W tokens is emitted
    alone. Shorter ones are appended to a buffer; when the buffer reaches >= W tokens its first W
    are emitted and the rest is dropped, and the buffer starts empty. Discarded (counted in the stats):
    ``truncated`` - everything after the first W tokens of a long document (its EOS included);
    ``overflow`` - the buffer's tail beyond W when a window is emitted (the end of the document
    that crossed the boundary: it is NOT carried into the next window); ``leftover`` - the
    buffer (< W tokens) still open after the last document. Returns ``(windows, stats)``.
    """
    w = seq_len + 1
    out: List[np.ndarray] = []
    buf: List[np.ndarray] = []
    buf_len = 0
    st = {"input_tokens": 0, "tokens": 0, "truncated": 0, "overflow": 0, "leftover": 0}
    for d in docs:
        st["input_tokens"] += len(d)
        if len(d) >= w:
            out.append(d[:w])
            st["truncated"] += len(d) - w
            continue
        buf.append(d)
        buf_len += len(d)
        if buf_len >= w:
            out.append(np.concatenate(buf)[:w])
            st["overflow"] += buf_len - w
            buf, buf_len = [], 0
    st["leftover"] = buf_len
    st["tokens"] = len(out) * w
    st["discarded"] = st["truncated"] + st["overflow"] + st["leftover"]
    return out, st


def prepare_tokens(inputs: Sequence[Union[str, Path]], out_dir: Union[str, Path], tokenizer: Any = "gpt2",
                   tokenizer_id: Optional[str] = None, packing: str = "concat", seq_len: int = 8192,
                   val_fraction: float = 0.01, seed: int = 0, text_field: str = "text",
                   eos_id: Optional[int] = None, vocab_size: int = 4096,
                   log: Callable[[str], None] = print) -> Dict[str, Dict[str, Any]]:
    """Tokenize ``inputs`` into ``out_dir/train.bin`` and ``out_dir/val.bin`` (+ the tokenizer files).

    tokenizer: ``"gpt2"``, ``"builtin"`` (``vocab_size`` ids), a ``tokenizer.json`` path, or a
    ``tokenizers.Tokenizer`` / transformers fast tokenizer object (then ``tokenizer_id`` is required).
    packing: ``"concat"`` (``concat_pack``) or ``"cram"`` (``cram_pack``; its docstring says exactly
    which tokens are dropped). Returns ``{"train": stats, "val": stats}`` (token counts, documents, path).
    """
    if packing not in ("concat", "cram"):
        raise ValueError(f"packing must be 'concat' or 'cram', got {packing!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if packing == "cram" and seq_len < 1:           # windows of seq_len + 1 tokens: one token has no target
        raise ValueError(f"seq_len must be >= 1 for cram packing, got {seq_len}")
    if isinstance(tokenizer, (str, Path)):
        tokenizer, spec_id, spec_eos = load_tokenizer(str(tokenizer), vocab_size)
        tokenizer_id = tokenizer_id or spec_id
        eos_id = spec_eos if eos_id is None else eos_id
    elif tokenizer_id is None:
        raise ValueError("tokenizer_id is required when passing a tokenizer object")
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
    eos_id = eos_token_id(tok) if eos_id is None else int(eos_id)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(token_dtype(vocab))

    docs: List[np.ndarray] = []
    sources: Dict[str, int] = {}
    batch: List[str] = []

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            docs.append(np.array(enc.ids + [eos_id], dtype=dtype))
        batch.clear()

    for src, text in iter_documents(inputs, text_field):
        sources[src] = sources.get(src, 0) + 1
        batch.append(text)
        if len(batch) >= 256:
            flush()
    flush()
    if not docs:
        raise ValueError(f"no documents found in {list(map(str, inputs))}")
    n_val = 0 if val_fraction == 0 or len(docs) < 2 else min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
    is_val = np.zeros(len(docs), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(docs))[:n_val]] = True

    out = Path(out_dir)
    results: Dict[str, Dict[str, Any]] = {}
    windows = f", windows of {seq_len + 1}" if packing == "cram" else ""
    log(f"{len(docs)} documents from {len(sources)} source(s); tokenizer {tokenizer_id} "
        f"(vocab {vocab}, eos {eos_id}); packing {packing}{windows}")
    for split, mask in (("train", ~is_val), ("val", is_val)):
        part = [d for d, m in zip(docs, mask) if m]
        chunks, st = cram_pack(part, seq_len) if packing == "cram" else concat_pack(part)
        st.update(documents=len(part), path=str(out / f"{split}.bin"))
        extra = {"split": split, "documents": len(part), "seed": seed, "val_fraction": val_fraction,
                 "discarded_tokens": st["discarded"], "inputs": [str(i) for i in inputs]}
        write_token_file(out / f"{split}.bin", chunks, vocab, tokenizer_id, eos_id, packing,
                         seq_len=seq_len if packing == "cram" else None, extra=extra)
        msg = f"{split}: {len(part)} documents, {st['tokens']:,} tokens -> {st['path']}"
        if packing == "cram":
            msg += (f" ({st['tokens'] // (seq_len + 1)} windows; discarded {st['discarded']:,} of "
                    f"{st['input_tokens']:,} tokens: {st['truncated']:,} beyond the first {seq_len + 1} of long "
                    f"documents, {st['overflow']:,} buffer overflow, {st['leftover']:,} final partial buffer)")
        log(msg)
        if st["tokens"] == 0:
            log(f"warning: {split}.bin holds no tokens")
        results[split] = st
    eos_token = tok.id_to_token(eos_id)
    save_tokenizer(tok, out, eos_token=eos_token, extra={"kvmeans_tokenizer_id": tokenizer_id})
    return results
