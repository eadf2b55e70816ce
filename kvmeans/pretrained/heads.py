"""Per-head budgets of the reserve of exact rows (``KVMSpec.exact_heads``, docs/pretrained.md).

A few attention heads of a pretrained model copy: reading a passage again, they attend to the token that followed
the current one the first time (retrieval / induction heads); most heads read nearby tokens. A needle survives
compression only in the heads that look it up, so an equal reserve in every kv head spends most slots where
nobody reads them. With ``exact_heads`` the model's ``exact_rows x kv heads`` slots are shared out by each kv
head's **copy score** (:func:`copy_scores`: a passage of built-in text and the passage again; the attention, most
over the kv group's query heads, that the second copy's queries give the first copy's next token), at least
``HEAD_FLOOR x exact_rows`` and at most ``HEAD_MOST x exact_rows`` per head (:func:`head_caps`). A layer's reserve
then holds its largest cap; a head's slots past its own cap stay dead (never filled, never read).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

HEAD_FLOOR = 1 / 12     # the fewest slots a kv head keeps, as a share of exact_rows (4 of 48)
HEAD_MOST = 4.0         # the most, as a multiple of exact_rows
COPY_TOKENS = 384       # the passage length of the copy probe (read twice: 768 tokens, one eager forward)
AUTOMATIC = "copy"      # what the automatic setting (convert_hf(model), auto, auto:NAME) gives exact_heads
_MEASURED = {}          # (model path, first weight's address, tokens) -> copy scores, for copies sharing weights


def head_caps(weights: Tensor, exact_rows: int, floor: float = HEAD_FLOOR, most: float = HEAD_MOST) -> Tensor:
    """The slots of every kv head, ``[layers, Hkv]`` (long), from their weights ``[layers, Hkv]`` (copy scores):
    ``exact_rows`` per head on average, at least ``int(floor * exact_rows)`` and at most ``int(most * exact_rows)``,
    the rest in proportion to the weights, water-filled (heads at the most give their share to the others) and
    rounded down (the total is at most ``exact_rows`` times the heads)."""
    if weights.dim() != 2 or bool((weights < 0).any()) or not bool(torch.isfinite(weights).all()):
        raise ValueError(f"exact_heads weights must be finite, >= 0 and [layers, kv heads], got {tuple(weights.shape)}")
    w = weights.double().flatten()
    lo, hi = float(int(floor * exact_rows)), float(max(int(most * exact_rows), exact_rows))
    if w.sum() <= 0:                                    # nothing to go by: every head alike
        return torch.full(weights.shape, exact_rows, dtype=torch.long)
    caps = torch.full_like(w, lo)
    total = float(exact_rows * w.numel())
    free = torch.ones_like(w, dtype=torch.bool)
    for _ in range(w.numel() + 1):                      # each pass fills at least one head to the most, or ends
        left = total - float(caps.sum())
        share = w * free
        if left <= 1e-9 or float(share.sum()) <= 0:
            break
        caps = torch.clamp(caps + left * share / share.sum(), max=hi)
        free = caps < hi - 1e-9
    return caps.floor().long().view(weights.shape)


@torch.no_grad()
def copy_scores(model, tokenizer=None, tokens: int = COPY_TOKENS, text: Optional[str] = None,
                ids: Optional[List[int]] = None) -> List[List[float]]:
    """Each attention layer's copy score per kv head (``[n_layers][Hkv]``, layer index order): the model (not yet
    converted) reads ``tokens`` tokens of ``text`` (default: the built-in plays) twice, eager attention; a head's
    score is the mean over the second copy's queries of the attention, most over its kv group's query heads, on
    the first copy's token after the current one. ``tokenizer``: default the model's own (from its folder);
    ``ids``: the passage as token ids instead (its first ``tokens``; e.g. calibration windows given as ids)."""
    from kvmeans.pretrained.calibrate import _plays, _tokenizer_of
    # benches convert a weight-sharing copy per setting: the same weights, the same probe, measured once
    key = (getattr(model.config, "_name_or_path", ""), next(model.parameters()).data_ptr(), tokens)
    built_in = tokenizer is None and text is None and ids is None
    if built_in and key in _MEASURED:
        return [list(r) for r in _MEASURED[key]]
    if ids is None:
        tok = tokenizer if tokenizer is not None else _tokenizer_of(model)
        text = _plays() if text is None else text
        start = len(text) // 3                          # past the opening: lines, not a title page
        ids = tok(text[start:start + 12 * tokens], add_special_tokens=False)["input_ids"]
    ids = list(ids)[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"exact_heads: the probe passage has {len(ids)} tokens, fewer than {tokens}")
    device = next(model.parameters()).device
    x = torch.tensor([ids + ids], device=device)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    before = model.config._attn_implementation
    was_training = model.training
    model.eval()
    try:
        model.set_attn_implementation("eager")          # the only one that returns attention weights
        att = model(input_ids=x, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(before)
        model.train(was_training)
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    q = torch.arange(tokens, 2 * tokens - 1, device=device)
    out = []
    for a in att:                                       # [1, H, 2n, 2n]
        on_next = a[0, :, q, q - tokens + 1].float()    # [H, n - 1]
        out.append(on_next.reshape(hkv, -1, on_next.shape[-1]).amax(1).mean(-1).tolist())
    if built_in:
        _MEASURED[key] = [list(r) for r in out]
    return out
