"""State growth and memory: state rows, cache bytes, prefill time and decode speed vs context length,
against what a full-attention KV cache would take (the paper's Figure 1, measured on a model).

    kvmeans eval memory --model runs/kvm/final --lengths 1024 4096 16384 --decode-tokens 32
    kvmeans eval memory --preset kvm-120m --preset kvm-sqrt-120m --lengths 4096 32768 --device cuda
    kvmeans eval memory --schedule --lengths 256 4096 65536 1048576        # budgets only, no model

Model mode (``--model DIR`` / ``--preset NAME``, both repeatable; presets have random weights): for
each length N a batch of ``--batch-size`` random token sequences is prefilled in one call (wall time,
device synchronised), the cache is inspected, then ``--decode-tokens`` greedy tokens are decoded one
at a time (tokens/s = batch x tokens / time). The numbers recorded per layer after the prefill of N
tokens: ``nbytes`` = :meth:`ModelCache.layer_nbytes` (the mixer's buffers with their spare capacity,
plus its token-shift row and the MLP token-shift row: exactly what ``KVMCache.nbytes`` sums);
``used_nbytes`` (KVM layers: the rows and window tokens in use); ``state_rows`` and
``window_tokens`` (KVM layers); ``kv_rows`` (full / SWA / BSWA layers). The full-attention
reference is ``full_attn_kv_bytes = 2 x layers x B x Hkv x N x D x bytes(model dtype)``: keys and
values of every layer for all N tokens at the model's KV head count and head dim, in the model's
dtype, without token-shift rows or allocator slack (a lower bound for a real KV cache). Note that
KVM states of bf16/fp16 models are kept in float32.

Transformers models: a ``--model`` folder of any transformers causal LM is measured the same way
(prefill through its decoder, its own cache); ``--kvm SPEC`` converts every such folder with
:func:`kvmeans.convert_hf`, and the layer table reports each converted layer's state rows and
buffered window tokens (``mixer`` ``kvm``) next to plain layers' key/value rows (``attention``);
``cache_bytes`` is then :func:`~kvmeans.pretrained.cache.cache_nbytes`. ``memory.json`` records the
spec (``config.kvm``) and each model's ``kvm_conversion``.

Schedule mode (``--schedule``): no forward, only :func:`kvmeans.ops.schedule.rows_after` for the
paper's budgets (fixed 256 rows, 16 sqrt(N) with min 256, saturating 1024 N / (1024 + N)) or
``--budget`` specs, with ``--chunk-len``/``--n-bswa-chunks`` (default 256 / 2): state rows after a
fresh sequence of N tokens, for N up to millions in a moment; full attention holds N rows. ``--budget``
takes what every command's ``--budget`` takes (``N``, ``fixed:N``, ``saturating:N[:MIN_LEN]``,
``power_law:FACTOR[:EXPONENT[:MIN_LEN]]``, ``novelty:THRESHOLD:CAP``) and the aliases ``sqrt:F``
(``power_law:F:0.5:256``) and ``power:F:E[:MIN]``. A novelty budget's rows depend on the keys: the
table shows ``<= M (novelty)``, the most rows it can reach (``max_state_rows``; ``state_rows`` empty).

Outputs under ``--out`` (atomic): ``memory.json``, ``memory.csv`` (one row per model and length),
``memory.png`` (state rows vs N; cache bytes vs N next to full attention; log-log) and, in schedule
mode, ``schedule.json``, ``schedule.csv``, ``schedule.png``.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvmeans.bench.report import human_bytes, plot_panels, write_csv, write_json
from kvmeans.eval.position_loss import backbone_parts
from kvmeans.models.config import KVMModelConfig, budget_to_dict
from kvmeans.ops.budget import StateBudget, as_budget, is_data_dependent, parse_budget_spec
from kvmeans.ops.schedule import rows_after

__all__ = ["PAPER_BUDGETS", "parse_budget", "budget_label", "schedule_curves", "measure_model",
           "full_attention_kv_bytes", "cache_layers"]

PAPER_BUDGETS: Dict[str, StateBudget] = {
    "fixed-256": StateBudget.fixed(256),
    "16*sqrt(N)": StateBudget.power_law(16, 0.5, min_len=256),
    "saturating-1024": StateBudget.saturating(1024, min_len=1),
}


# ---- schedule mode ----------------------------------------------------------------------------------
BUDGET_FORMS = ("N, fixed:N, saturating:N[:MIN_LEN], power_law:FACTOR[:EXPONENT[:MIN_LEN]], novelty:THRESHOLD:CAP "
                "(THRESHOLD in [0, 2]) or the aliases sqrt:F (= power_law:F:0.5:256) and power:F:E[:MIN]")


def _num(x: float) -> str:
    """``x`` short (``%g``) unless that loses digits."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def budget_label(budget: StateBudget) -> str:
    """A short name of ``budget`` for tables and plots: ``fixed-256``, ``16*N^0.5 (min 256)``, ``saturating-1024``,
    ``novelty-0.3 (cap 1024)``; distinct budgets get distinct names."""
    least = f" (min {budget.min_len})" if budget.min_len else ""
    if budget.kind == "fixed":
        return f"fixed-{budget.n}"
    if budget.kind == "saturating":
        return f"saturating-{budget.n}{least}"
    if budget.kind == "power_law":
        return f"{_num(budget.factor)}*N^{_num(budget.exponent)}{least}"
    return f"novelty-{_num(budget.threshold)} (cap {budget.n})"


def parse_budget(spec: str) -> Tuple[str, StateBudget]:
    """A ``--budget`` spec -> ``(label, budget)``: the grammar of every command's ``--budget``
    (:func:`~kvmeans.ops.budget.parse_budget_spec`) plus this command's aliases ``sqrt:F`` (F sqrt(N), min 256:
    the paper's, labelled ``F*sqrt(N)``) and ``power:F:E[:MIN]`` (``power_law:F:E[:MIN]``)."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "sqrt" and rest and ":" not in rest:
            budget = StateBudget.power_law(float(rest), 0.5, min_len=256)
            return f"{_num(budget.factor)}*sqrt(N)", budget
        shared = f"power_law:{rest}" if kind == "power" and rest.count(":") in (1, 2) else spec
        budget = as_budget(parse_budget_spec(shared))
    except ValueError:
        raise ValueError(f"--budget {spec!r} is not one of {BUDGET_FORMS}") from None
    return budget_label(budget), budget


def schedule_curves(lengths: Sequence[int], budgets: Optional[Dict[str, Callable[[int], int]]] = None,
                    chunk_len: int = 256, n_bswa_chunks: int = 2) -> List[Dict[str, Any]]:
    """Rows ``[{"budget", "N", "state_rows", "max_state_rows", "window_tokens", "full_attention_rows"}]`` from the
    schedule alone (state rows after a fresh sequence of N tokens; the window holds the current partial chunk
    plus n-1 full ones). Under a novelty budget the rows depend on the keys: ``state_rows`` is None and
    ``max_state_rows`` the most they can reach (every token novel, up to the cap); otherwise the two are equal.
    ``ValueError`` for a novelty cap below ``chunk_len`` (``kvm_attention`` refuses it)."""
    from kvmeans.ops.schedule import bswa_begin
    budgets = PAPER_BUDGETS if budgets is None else budgets
    out = []
    for label, b in budgets.items():
        if is_data_dependent(b) and b.n < chunk_len:
            raise ValueError(f"{label}: cap {b.n} is below chunk_len {chunk_len} (the first chunk's rows); "
                             f"use a cap >= {chunk_len}")
        for n in lengths:
            rows = rows_after(b, int(n), chunk_len, n_bswa_chunks)
            out.append({"budget": label, "N": int(n), "state_rows": None if is_data_dependent(b) else rows,
                        "max_state_rows": rows, "window_tokens": int(n) - bswa_begin(int(n), chunk_len, n_bswa_chunks),
                        "full_attention_rows": int(n)})
    return out


def _rows_cell(row: Dict[str, Any]) -> Union[int, str]:
    """``state_rows``, or ``<= M (novelty)`` where the rows depend on the data."""
    return row["state_rows"] if row["state_rows"] is not None else f"<= {row['max_state_rows']} (novelty)"


# ---- model mode -------------------------------------------------------------------------------------
def _model_config(model) -> KVMModelConfig:
    cfg = model.config
    return cfg.to_model_config() if hasattr(cfg, "to_model_config") else cfg


def _is_kvm_native(model) -> bool:
    from kvmeans.models.transformer import KVMModel
    return isinstance(getattr(model, "transformer", None), KVMModel)


def _describe(model) -> SimpleNamespace:
    """What the report needs of ``model``'s geometry: ``num_layers``, ``kv_heads``, ``qk_head_dim``,
    ``vocab_size``, ``chunk_len``, ``n_bswa_chunks``, ``mixers`` (per layer), ``budget`` (text),
    ``budget_spec``. A transformers model's layers are ``attention`` or, converted, ``kvm``."""
    if _is_kvm_native(model):
        cfg = _model_config(model)
        return SimpleNamespace(num_layers=cfg.num_layers, kv_heads=cfg.kv_heads, qk_head_dim=cfg.qk_head_dim,
                               vocab_size=cfg.vocab_size, chunk_len=cfg.chunk_len, n_bswa_chunks=cfg.n_bswa_chunks,
                               mixers=cfg.mixer_per_layer(),
                               budget=repr(cfg.state_budget()) if "kvm" in cfg.mixer_per_layer() else "no KVM layers",
                               budget_spec=budget_to_dict(cfg.state_budget()))
    from kvmeans.pretrained.convert import CONFIG_KEY, KVMSpec
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    conv = dict(getattr(model.config, CONFIG_KEY, None) or {})
    layers = conv.pop("layers", [])
    spec = KVMSpec.from_dict(conv) if conv else None
    return SimpleNamespace(num_layers=cfg.num_hidden_layers,
                           kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                           qk_head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                           vocab_size=cfg.vocab_size, chunk_len=spec.chunk_len if spec else 32,
                           n_bswa_chunks=spec.n_bswa_chunks if spec else None,
                           mixers=["kvm" if i in layers else "attention" for i in range(cfg.num_hidden_layers)],
                           budget=repr(spec.state_budget) if spec else "no KVM layers",
                           budget_spec=budget_to_dict(spec.state_budget) if spec else None)


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def full_attention_kv_bytes(config: KVMModelConfig, n_tokens: int, batch: int, dtype: torch.dtype) -> int:
    """``2 x layers x B x Hkv x N x D x bytes``: keys + values of all layers for ``n_tokens`` tokens."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * batch * config.kv_heads * n_tokens * config.qk_head_dim * item


def cache_layers(cache) -> List[Dict[str, Any]]:
    """Per layer of a :class:`~kvmeans.models.cache.ModelCache`: ``layer``, ``mixer``, ``nbytes``
    (``layer_nbytes``), ``mixer_nbytes``, ``used_nbytes``, ``state_rows``, ``window_tokens``, ``kv_rows``;
    of a transformers cache (:func:`hf_cache_layers`) the same keys."""
    if not hasattr(cache, "mixers"):
        return hf_cache_layers(cache)
    rows = []
    for i, st in enumerate(cache.layers):
        r: Dict[str, Any] = {"layer": i, "mixer": cache.mixers[i], "nbytes": int(cache.layer_nbytes(i)),
                             "mixer_nbytes": int(st.nbytes) if st is not None else 0, "used_nbytes": None,
                             "state_rows": None, "window_tokens": None, "kv_rows": None}
        if st is not None and hasattr(st, "num_rows"):
            r.update(state_rows=int(st.num_rows), window_tokens=int(st.window_len), used_nbytes=int(st.nbytes_used))
        elif st is not None and hasattr(st, "length"):
            r.update(kv_rows=int(st.length))
        rows.append(r)
    return rows


def hf_cache_layers(cache) -> List[Dict[str, Any]]:
    """Per layer of a transformers cache: a converted layer (``kvm``) reports its state rows and the tokens
    buffered for the window; a plain one (``attention``) its key/value tokens. ``nbytes`` as
    :func:`~kvmeans.pretrained.cache.cache_nbytes` counts them."""
    from kvmeans.pretrained.cache import ConvertedCacheLayer
    rows = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, ConvertedCacheLayer):
            st = layer.state
            rows.append({"layer": i, "mixer": "kvm", "nbytes": int(st.nbytes), "mixer_nbytes": int(st.nbytes),
                         "used_nbytes": int(st.nbytes), "state_rows": st.num_rows,
                         "window_tokens": st.window_tokens, "kv_rows": None})
        else:
            n = sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor))
            rows.append({"layer": i, "mixer": "attention", "nbytes": n, "mixer_nbytes": n, "used_nbytes": None,
                         "state_rows": None, "window_tokens": None, "kv_rows": int(layer.get_seq_length())})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_model(model, lengths: Sequence[int], decode_tokens: int = 16, batch_size: int = 1,
                  seed: int = 0, warmup: bool = True, log=print) -> List[Dict[str, Any]]:
    """Prefill / decode measurements of ``model`` (``KVMForCausalLM``, ``KVMLanguageModel`` or a transformers
    causal LM, plain or converted) at each length; one dict per length (see the module docstring)."""
    backbone, head, _ = backbone_parts(model)
    cfg = _describe(model)
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    gen = torch.Generator().manual_seed(seed)
    if warmup:                     # first-call overheads (allocator, kernels) out of the timings
        w = torch.randint(0, cfg.vocab_size, (batch_size, 2 * cfg.chunk_len + 1), generator=gen).to(device)
        _, c = backbone(w, None)
        backbone(w[:, :1], c)
    out = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (batch_size, int(n)), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        hidden, cache = backbone(ids, None)
        nxt = head(hidden[:, -1:]).argmax(-1)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        del hidden
        layers = cache_layers(cache)
        total = sum(r["nbytes"] for r in layers) if not hasattr(cache, "mixers") else int(cache.nbytes)
        dec_s = None
        if decode_tokens > 0:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                h, cache = backbone(nxt, cache)
                nxt = head(h[:, -1:]).argmax(-1)
            _sync(device)
            dec_s = time.perf_counter() - t0
        kvm = [r["state_rows"] for r in layers if r["state_rows"] is not None]
        full = full_attention_kv_bytes(cfg, int(n), batch_size, dtype)
        rec = {"N": int(n), "batch": batch_size, "prefill_s": prefill_s,
               "prefill_tok_s": batch_size * int(n) / prefill_s if prefill_s > 0 else None,
               "decode_tokens": decode_tokens, "decode_s": dec_s,
               "decode_tok_s": batch_size * decode_tokens / dec_s if dec_s else None,
               "cache_bytes": total, "full_attn_kv_bytes": full, "cache_vs_full": total / full,
               "state_rows": max(kvm) if kvm else None, "layers": layers}
        out.append(rec)
        dec = "-" if rec["decode_tok_s"] is None else f"{rec['decode_tok_s']:.1f}"
        log(f"  N={n}: prefill {prefill_s:.3f} s, decode {dec} tok/s, cache {human_bytes(total)} vs full "
            f"attention {human_bytes(full)}, state rows {rec['state_rows']}")
        del cache
    return out


# ---- outputs ----------------------------------------------------------------------------------------
_CSV = ["label", "budget", "N", "batch", "prefill_s", "prefill_tok_s", "decode_tokens", "decode_s", "decode_tok_s",
        "state_rows", "cache_bytes", "full_attn_kv_bytes", "cache_vs_full", "layer_nbytes", "layer_state_rows"]


def write_model_outputs(out_dir: Union[str, Path], models: Sequence[Dict[str, Any]], config: Dict[str, Any]
                        ) -> Dict[str, Path]:
    """``memory.json`` / ``memory.csv`` / ``memory.png`` for the measured ``models``."""
    out = Path(out_dir)
    paths = {"json": write_json(out / "memory.json", {"config": config, "models": list(models)}),
             "csv": write_csv(out / "memory.csv", _CSV, [
                 {"label": m["label"], "budget": m["budget"], **{k: r[k] for k in _CSV if k in r},
                  "layer_nbytes": " ".join(str(x["nbytes"]) for x in r["layers"]),
                  "layer_state_rows": " ".join("" if x["state_rows"] is None else str(x["state_rows"])
                                               for x in r["layers"])}
                 for m in models for r in m["results"]])}
    rows_series, bytes_series = {}, {}
    for m in models:
        xs = [r["N"] for r in m["results"]]
        name = f"{m['label']} ({m['budget']})"
        if any(r["state_rows"] is not None for r in m["results"]):
            rows_series[name] = (xs, [r["state_rows"] for r in m["results"]])
        bytes_series[name] = (xs, [r["cache_bytes"] for r in m["results"]])
        bytes_series[f"{m['label']}: full-attention KV"] = (xs, [r["full_attn_kv_bytes"] for r in m["results"]])
    all_n = sorted({r["N"] for m in models for r in m["results"]})
    rows_series["full attention (N rows)"] = (all_n, all_n)
    png = plot_panels(out / "memory.png", [
        {"title": "KVM state rows after N tokens", "xlabel": "N (tokens)",
         "ylabel": "state rows (max over KVM layers)", "series": rows_series},
        {"title": "cache bytes after N tokens", "xlabel": "N (tokens)", "ylabel": "bytes (all layers)",
         "series": bytes_series}],
        title=f"kvmeans eval memory (batch {config.get('batch_size')}, {config.get('dtype')}, {config.get('device')})")
    if png is not None:
        paths["png"] = png
    return paths


def write_schedule_outputs(out_dir: Union[str, Path], rows: Sequence[Dict[str, Any]], config: Dict[str, Any]
                           ) -> Dict[str, Path]:
    out = Path(out_dir)
    paths = {"json": write_json(out / "schedule.json", {"config": config, "rows": list(rows)}),
             "csv": write_csv(out / "schedule.csv", ["budget", "N", "state_rows", "max_state_rows", "window_tokens",
                                                     "full_attention_rows"], rows)}
    series: Dict[str, Tuple[List[int], List[int]]] = {}
    for r in rows:
        xs, ys = series.setdefault(r["budget"] + (" (at most)" if r["state_rows"] is None else ""), ([], []))
        xs.append(r["N"])
        ys.append(r["max_state_rows"])
    ns = sorted({r["N"] for r in rows})
    series["full attention (N)"] = (ns, ns)
    panel = {"title": "state size vs context length (schedule)", "xlabel": "N (tokens)", "ylabel": "state rows",
             "series": series}
    png = plot_panels(out / "schedule.png", [panel], ncols=1,
                      title=f"chunk_len {config['chunk_len']}, n_bswa_chunks {config['n_bswa_chunks']}")
    if png is not None:
        paths["png"] = png
    return paths
