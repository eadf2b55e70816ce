"""Loss by position: mean next-token loss per position block over long documents (the paper's
TextbookChapters figure), several models in one plot.

    kvmeans eval position-loss --model runs/kvm/final --model runs/gpta/final --data data/books \\
        --ctx 32768 --block 1024 --max-docs 100 --out results/position-loss

Data: a ``KVMTOK1`` token file (or the folder ``kvmeans data prepare`` writes; ``--split val`` by
default). Documents are delimited by the header's ``eos_id`` (``prepare`` writes every document
followed by EOS); ``cram`` files also end a document at every ``seq_len + 1`` window boundary
(a document is cut there). Every document with at least ``ctx + 1`` tokens (EOS excluded) gives
one example, its first ``ctx + 1`` tokens: inputs ``t[0:ctx]``, labels ``t[1:ctx+1]`` (the
reference's recipe, docs/reference-conventions.md §6.2), so position ``i`` is the loss of predicting token
``i + 1`` from the ``i + 1`` tokens before it. Documents are taken in file order (``--max-docs``:
the first N long enough). ``--eos-id`` overrides the header; a file with no EOS id (or
``--windows``) is read as consecutive non-overlapping windows of ``ctx + 1`` tokens, which are
then not documents: say so when reporting.

Bounded memory: each batch of documents runs through the model in segments of ``--segment``
tokens, continuing the model's cache (KVM state, windows: the same logits as one call over the
whole document, up to float rounding), and the LM head + cross entropy run on ``--logits-chunk``
positions at a time, so no ``[ctx, vocab]`` logits tensor exists (peak: ``batch x segment x d``
activations + ``batch x logits_chunk x vocab`` logits + the cache; full-attention layers still
keep their whole KV cache).

Models: ours (or the authors' layout), or any transformers causal LM; ``--kvm SPEC`` converts every
plain transformers ``--model`` with :func:`kvmeans.convert_hf` after loading (documents of one batch
have the same length, so no padding mask is needed).

Outputs under ``--out`` (each written atomically): ``position_loss.json`` (config with ``kvm``; per
model the per-position NLL sums and counts, per-block sums / counts / mean loss, overall mean and
perplexity, ``kvm_conversion``: the settings applied, or null), ``position_loss.csv`` (one row per
model and block), ``position_loss.png`` (mean loss per block, one curve per model). Loss is in nats.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.bench.report import write_csv
from kvmeans.train.data import TokenFile
from kvmeans.utils.io import atomic_write, atomic_write_text

__all__ = ["document_spans", "open_token_data", "per_position_nll", "block_stats", "evaluate_models",
           "write_outputs", "plot_position_loss"]

_SCAN = 1 << 24        # tokens scanned at a time when looking for EOS


# ---- data -------------------------------------------------------------------------------------------
def open_token_data(path: Union[str, Path], split: str = "val") -> TokenFile:
    """A token file, or ``<folder>/<split>.bin`` of a ``kvmeans data prepare`` folder."""
    p = Path(path)
    if p.is_dir():
        f = p / f"{split}.bin"
        if not f.is_file():
            have = sorted(x.name for x in p.glob("*.bin"))
            raise FileNotFoundError(f"--data {p}: no {split}.bin in the folder (has: {have or 'no .bin files'}); "
                                    "pass --split train/val or the token file itself")
        p = f
    if not p.is_file():
        raise FileNotFoundError(f"--data {p}: no such token file (make one with `kvmeans data prepare`)")
    try:
        return TokenFile(p)
    except ValueError as err:                   # the message starts with the path
        raise ValueError(f"--data {err}") from None


def document_spans(tf: TokenFile, min_len: int, eos_id: Optional[int] = None, windows: bool = False,
                   max_docs: Optional[int] = None) -> Tuple[List[Tuple[int, int]], Dict[str, Any]]:
    """``(start, length)`` of the documents with at least ``min_len`` tokens, in file order.

    Boundaries: ``eos_id`` (default: the header's) tokens, plus every ``seq_len + 1`` window edge of a
    ``cram`` file; with ``windows=True`` (or no EOS id anywhere) the stream is cut into consecutive
    windows of ``min_len`` tokens instead. Returns the spans (at most ``max_docs``) and a summary
    (``mode``, ``documents`` scanned, ``long_enough``, ``longest``).
    """
    n = len(tf)
    eos = tf.eos_id if eos_id is None else int(eos_id)
    if windows or eos is None:
        k = n // min_len
        spans = [(i * min_len, min_len) for i in range(k if max_docs is None else min(k, max_docs))]
        return spans, {"mode": "windows", "documents": k, "long_enough": k, "longest": min_len if k else 0}
    cuts: List[np.ndarray] = []
    for a in range(0, n, _SCAN):
        cuts.append(np.flatnonzero(np.asarray(tf.tokens[a:a + _SCAN]) == eos) + a)
    ends = np.concatenate(cuts) if cuts else np.zeros(0, dtype=np.int64)
    # a document is [previous boundary + 1, eos); the tail after the last EOS counts too
    starts = np.concatenate([[0], ends + 1])
    stops = np.concatenate([ends, [n]])
    if tf.packing == "cram" and tf.seq_len:
        w = int(tf.seq_len) + 1
        edges = np.arange(w, n, w)
        # every cut (end of one document, start of the next) is ordered, so sorting the two lists
        # independently keeps them paired: EOS at e cuts (e, e + 1), a window edge at w cuts (w, w)
        starts = np.sort(np.concatenate([starts, edges]))
        stops = np.sort(np.concatenate([stops, edges]))
    lengths = stops - starts
    keep = np.flatnonzero(lengths >= min_len)
    docs = int((lengths > 0).sum())
    info = {"mode": "eos", "eos_id": eos, "documents": docs, "long_enough": int(len(keep)),
            "longest": int(lengths.max()) if len(lengths) else 0}
    if max_docs is not None:
        keep = keep[:max_docs]
    return [(int(starts[i]), int(lengths[i])) for i in keep], info


# ---- model ----------------------------------------------------------------------------------------
def backbone_parts(model) -> Tuple[Any, torch.nn.Module, Optional[float]]:
    """(backbone ``ids, cache -> hidden, cache``, lm_head, softcap) of a KVMForCausalLM, a KVMLanguageModel or
    a transformers causal LM (plain or converted: its decoder with its own cache, its output embeddings)."""
    from kvmeans.models.transformer import KVMModel
    if isinstance(getattr(model, "transformer", None), KVMModel):
        return model.transformer, model.lm_head, getattr(model.config, "logit_softcap", None)
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        raise TypeError(f"expected a KVMForCausalLM, a KVMLanguageModel or a transformers causal LM, "
                        f"got {type(model).__name__}")
    from kvmeans.models.hf_compat import cache_from, cache_kwargs
    decoder = model.get_decoder()

    def backbone(ids, cache):
        out = decoder(input_ids=ids, use_cache=True, **cache_kwargs(cache))
        return out.last_hidden_state, cache_from(out)
    return backbone, model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)


@torch.no_grad()
def per_position_nll(model, inputs: Tensor, labels: Tensor, segment: int = 2048,
                     logits_chunk: int = 256) -> Tensor:
    """Next-token NLL ``[B, T]`` (float64) of ``labels`` given ``inputs`` (both ``[B, T]`` long).

    The backbone runs over ``segment`` columns at a time continuing its cache; the LM head and the
    cross entropy over ``logits_chunk`` positions at a time (float32 logits, as the model returns).
    """
    if inputs.shape != labels.shape or inputs.dim() != 2:
        raise ValueError(f"inputs and labels must both be [B, T], got {list(inputs.shape)} and {list(labels.shape)}")
    if segment < 1 or logits_chunk < 1:
        raise ValueError(f"--segment and --logits-chunk must be >= 1, got {segment} and {logits_chunk}")
    backbone, head, cap = backbone_parts(model)
    B, T = inputs.shape
    out = torch.empty(B, T, dtype=torch.float64)
    cache = None
    for s in range(0, T, segment):
        e = min(T, s + segment)
        hidden, cache = backbone(inputs[:, s:e], cache)
        for a in range(0, e - s, logits_chunk):
            b = min(e - s, a + logits_chunk)
            logits = head(hidden[:, a:b])
            if cap:
                logits = cap * torch.tanh(logits / cap)
            logits = logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, s + a:s + b].reshape(-1),
                                  reduction="none")
            out[:, s + a:s + b] = nll.view(B, b - a).double().cpu()
        del hidden
    return out


def block_stats(sums: Sequence[float], counts: Sequence[int], block: int) -> Dict[str, List]:
    """Per block of ``block`` positions: ``start``, ``end`` (exclusive), ``sum``, ``count``, ``mean``
    (count-weighted; the last block may be shorter)."""
    s, c = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.int64)
    out: Dict[str, List] = {"start": [], "end": [], "sum": [], "count": [], "mean": []}
    for a in range(0, len(s), block):
        b = min(len(s), a + block)
        tot, cnt = float(s[a:b].sum()), int(c[a:b].sum())
        out["start"].append(a)
        out["end"].append(b)
        out["sum"].append(tot)
        out["count"].append(cnt)
        out["mean"].append(tot / cnt if cnt else None)
    return out


def _batches(tf: TokenFile, spans: List[Tuple[int, int]], ctx: int, batch_size: int) -> Iterator[Tensor]:
    for i in range(0, len(spans), batch_size):
        rows = [np.asarray(tf.tokens[a:a + ctx + 1], dtype=np.int64) for a, _ in spans[i:i + batch_size]]
        yield torch.from_numpy(np.stack(rows))


def evaluate_models(models: Sequence[Tuple[str, str, Any]], tf: TokenFile, spans: List[Tuple[int, int]], ctx: int,
                    block: int, batch_size: int = 1, segment: int = 2048, logits_chunk: int = 256,
                    device: Union[str, torch.device] = "cpu", log=print) -> List[Dict[str, Any]]:
    """Per model ``(label, source, model)``: per-position sums/counts over ``spans`` and block stats."""
    results = []
    for label, source, model in models:
        vocab = model.lm_head.weight.shape[0]
        if tf.vocab_size > vocab:
            raise ValueError(f"--data {tf.path}: token ids go up to {tf.vocab_size - 1} but model {source} has "
                             f"{vocab} embeddings; use data tokenized with the model's tokenizer")
        sums = np.zeros(ctx, dtype=np.float64)
        counts = np.zeros(ctx, dtype=np.int64)
        t0 = time.perf_counter()
        for rows in _batches(tf, spans, ctx, batch_size):
            rows = rows.to(device)
            nll = per_position_nll(model, rows[:, :-1], rows[:, 1:], segment, logits_chunk)
            sums += nll.sum(0).numpy()
            counts += nll.shape[0]
        dt = time.perf_counter() - t0
        blocks = block_stats(sums, counts, block)
        total, n = float(sums.sum()), int(counts.sum())
        mean = total / n if n else float("nan")
        log(f"[{label}] {len(spans)} documents x {ctx} tokens in {dt:.1f} s: mean loss {mean:.4f} "
            f"(ppl {math.exp(mean):.2f})")
        results.append({"label": label, "model": source, "num_docs": len(spans), "mean_loss": mean,
                        "perplexity": math.exp(mean) if n else None, "tokens": n, "seconds": dt,
                        "per_position": {"sums": sums.tolist(), "counts": counts.tolist()}, "blocks": blocks})
    return results


# ---- outputs --------------------------------------------------------------------------------------
def plot_position_loss(path: Union[str, Path], results: Sequence[Dict[str, Any]], title: str = "") -> Optional[Path]:
    """Mean loss per block vs position (block midpoint), one curve per model, written atomically."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed, skipping the PNG (pip install matplotlib)", file=sys.stderr)
        return None
    fig = Figure(figsize=(7.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in results:
        b = r["blocks"]
        pts = [((s + e) / 2, m) for s, e, m in zip(b["start"], b["end"], b["mean"]) if m is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=r["label"])
    ax.set_xlabel("position in document (tokens; block midpoints)")
    ax.set_ylabel("mean loss (nats)")
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    if results:
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return Path(path)


_CSV = ["label", "model", "block_start", "block_end", "tokens", "sum_nll", "mean_loss"]
_BLOCK_KEYS = ("start", "end", "count", "sum", "mean")


def write_outputs(out_dir: Union[str, Path], results: Sequence[Dict[str, Any]],
                  config: Dict[str, Any]) -> Dict[str, Path]:
    """``position_loss.json``, ``.csv`` and ``.png`` in ``out_dir`` (each atomically)."""
    out = Path(out_dir)
    paths = {"json": out / "position_loss.json", "csv": out / "position_loss.csv", "png": out / "position_loss.png"}
    atomic_write_text(paths["json"], json.dumps({"config": config, "models": list(results)}, indent=1) + "\n")

    write_csv(paths["csv"], _CSV, [dict(zip(_CSV, (r["label"], r["model"], *block)))
                                   for r in results for block in zip(*(r["blocks"][k] for k in _BLOCK_KEYS))])
    title = f"loss by position: {config.get('num_docs')} documents x {config.get('ctx')} tokens, blocks of " \
            f"{config.get('block')} ({Path(str(config.get('data'))).name})"
    if plot_position_loss(paths["png"], results, title) is None:
        del paths["png"]
    return paths


def format_table(results: Sequence[Dict[str, Any]], max_rows: int = 40) -> str:
    """Blocks as rows, models as columns (mean loss); long tables keep every k-th block."""
    if not results:
        return ""
    b0 = results[0]["blocks"]
    idx = list(range(len(b0["start"])))
    if len(idx) > max_rows:
        step = -(-len(idx) // max_rows)
        idx = sorted(set(idx[::step]) | {idx[-1]})
    head = ["positions"] + [r["label"] for r in results]
    rows = [[f"{b0['start'][i]}-{b0['end'][i] - 1}"] +
            ["" if r["blocks"]["mean"][i] is None else f"{r['blocks']['mean'][i]:.4f}" for r in results] for i in idx]
    rows.append(["all"] + [f"{r['mean_loss']:.4f}" for r in results])
    widths = [max(len(str(x[j])) for x in [head] + rows) for j in range(len(head))]
    line = lambda r: " | ".join(str(c).ljust(w) if j == 0 else str(c).rjust(w)  # noqa: E731
                                for j, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows])
