"""Synthetic recall tasks (MQAR, passkey, multi-key passkey) generated on the fly for tiny CPU models.

Every generator is deterministic for a ``seed`` (its own ``torch.Generator``) and returns
``(input_ids [B, T] long, targets [B, T] long)`` with targets *pre-shifted* for
``KVMLanguageModel.loss``: ``targets[b, t]`` is the token expected at ``t + 1`` and ``-100``
(ignored) everywhere except at answer positions. Special token ids (shared by both tasks):

* ``PAD = 0`` (reserved, unused by the generators), ``SEP = 1`` (MQAR: start of the queries),
* ``KEY = 2``, ``VAL = 3`` (passkey needle / query markers).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["PAD", "SEP", "KEY", "VAL", "NUM_SPECIAL", "NUM_DIGITS", "mqar_batch", "passkey_batch",
           "passkey_needle_len", "multikey_batch", "recall_accuracy", "accuracy_by_depth", "accuracy_grid",
           "plot_heatmap"]

PAD, SEP, KEY, VAL = 0, 1, 2, 3
NUM_SPECIAL = 4
NUM_DIGITS = 10          # passkey value tokens: ids NUM_SPECIAL .. NUM_SPECIAL + 9
IGNORE = -100


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def mqar_batch(batch: int, seq_len: int, num_pairs: int, vocab_size: int, seed: int,
               num_queries: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Multi-query associative recall (Zoology-style).

    Vocabulary: ``n = (vocab_size - NUM_SPECIAL) // 2``; keys are ids ``[4, 4 + n)``, values
    ``[4 + n, 4 + 2n)``. Layout of each row (``P = num_pairs``, ``Q = num_queries``, default ``P``)::

        k1 v1 k2 v2 ... kP vP | f_1 ... f_F | SEP | q1 a1 q2 a2 ... qQ aQ
        T = 2P + F + 1 + 2Q == seq_len   (F >= 0 filler tokens, asserted)

    Keys within a row are distinct; values are drawn with replacement; filler tokens are random
    *values* (never keys, so a query key's only earlier occurrence is its pair). Queries are a
    random permutation of the keys (without replacement when ``Q <= P``) and ``a_i`` is the value
    paired with ``q_i``. Targets: ``targets[b, pos(q_i)] = a_i``, ``-100`` elsewhere.

    Returns ``input_ids [B, T]`` and ``targets [B, T]`` (both ``torch.long``).
    """
    q = num_pairs if num_queries is None else num_queries
    n = (vocab_size - NUM_SPECIAL) // 2
    if num_pairs < 1 or q < 1:
        raise ValueError(f"num_pairs={num_pairs}, num_queries={q}: need at least one pair and one query")
    if n < num_pairs:
        raise ValueError(f"vocab_size={vocab_size} has {n} keys < num_pairs={num_pairs}: raise vocab_size "
                         f"to at least {2 * num_pairs + NUM_SPECIAL} or lower num_pairs")
    filler = seq_len - 2 * num_pairs - 1 - 2 * q
    if filler < 0:
        raise ValueError(f"seq_len={seq_len} < 2*{num_pairs} + 1 + 2*{q} tokens of pairs, separator and queries: "
                         "raise seq_len or lower num_pairs / num_queries")
    g = _gen(seed)
    rows = torch.arange(batch).unsqueeze(1)
    keys = torch.rand(batch, n, generator=g).argsort(dim=1)[:, :num_pairs] + NUM_SPECIAL       # [B, P]
    values = torch.randint(NUM_SPECIAL + n, NUM_SPECIAL + 2 * n, (batch, num_pairs), generator=g)
    if q <= num_pairs:
        pick = torch.rand(batch, num_pairs, generator=g).argsort(dim=1)[:, :q]                  # [B, Q]
    else:
        pick = torch.randint(0, num_pairs, (batch, q), generator=g)
    fill = torch.randint(NUM_SPECIAL + n, NUM_SPECIAL + 2 * n, (batch, filler), generator=g)
    ctx = torch.stack([keys, values], dim=2).reshape(batch, 2 * num_pairs)
    qa = torch.stack([keys[rows, pick], values[rows, pick]], dim=2).reshape(batch, 2 * q)
    sep = torch.full((batch, 1), SEP, dtype=torch.long)
    input_ids = torch.cat([ctx, fill, sep, qa], dim=1)
    assert input_ids.shape == (batch, seq_len)
    targets = torch.full_like(input_ids, IGNORE)
    q0 = seq_len - 2 * q
    targets[:, q0::2] = qa[:, 1::2]
    return input_ids, targets


def passkey_needle_len(key_len: int = 2, answer_len: int = 3) -> int:
    """Tokens in one needle ``KEY k_1..k_K VAL d_1..d_D`` (the query at the end has the same length)."""
    return 2 + key_len + answer_len


def _check_needle(vocab_size: int, key_len: int, answer_len: int) -> None:
    """The needle arguments of :func:`passkey_batch` and :func:`multikey_batch`; a ValueError naming the bad one."""
    lo = NUM_SPECIAL + NUM_DIGITS
    if vocab_size <= lo:
        raise ValueError(f"vocab_size={vocab_size} must exceed {lo} (specials + digits)")
    if key_len < 1 or answer_len < 1:
        raise ValueError(f"key_len={key_len}, answer_len={answer_len}: both must be >= 1")


def passkey_batch(batch: int, seq_len: int, seed: int, depth: Union[None, float, Sequence[float], Tensor] = None,
                  vocab_size: int = 64, key_len: int = 2, answer_len: int = 3) -> Tuple[Tensor, Tensor, Tensor]:
    """Passkey retrieval: one needle hidden at a relative depth in random filler, queried at the end.

    Token ranges: digits ``[4, 14)`` (the value), words ``[14, vocab_size)`` (filler and key tokens).
    With ``N = passkey_needle_len(key_len, answer_len) = 2 + K + D`` and ``F = seq_len - 2N`` filler
    tokens, each row is::

        f_1 .. f_s | KEY k_1..k_K VAL d_1..d_D | f_{s+1} .. f_F | KEY k_1..k_K VAL d_1..d_D
        s = round(depth * F)   (needle start index; depth 0 = first token, 1 = right before the query)
        T = F + 2N == seq_len exactly (asserted)

    The query repeats the key and the ``VAL`` marker; its value tokens are the teacher-forced
    answer. Targets (pre-shifted) are ``d_1..d_D`` at positions ``T-D-1 .. T-2`` (the query's ``VAL``
    and ``d_1..d_{D-1}``), ``-100`` elsewhere.

    ``depth``: ``None`` -> uniform in ``[0, 1]`` per sample; a float -> all samples; a sequence or
    tensor of ``B`` floats -> per sample. Returns ``input_ids [B, T]``, ``targets [B, T]`` (long) and
    ``depths [B]`` (float, the requested depths).
    """
    n = passkey_needle_len(key_len, answer_len)
    lo = NUM_SPECIAL + NUM_DIGITS
    _check_needle(vocab_size, key_len, answer_len)
    filler = seq_len - 2 * n
    if filler < 0:
        raise ValueError(f"seq_len={seq_len} < 2 * needle length {n} (the needle and its query): raise seq_len")
    g = _gen(seed)
    if depth is None:
        depths = torch.rand(batch, generator=g, dtype=torch.float64)
    else:
        depths = torch.as_tensor(depth, dtype=torch.float64).expand(batch).clone()
    if not bool(((depths >= 0) & (depths <= 1)).all()):
        raise ValueError(f"depth={depth!r}: every depth must lie in [0, 1]")
    keys = torch.randint(lo, vocab_size, (batch, key_len), generator=g)
    digits = torch.randint(NUM_SPECIAL, lo, (batch, answer_len), generator=g)
    fill = torch.randint(lo, vocab_size, (batch, filler), generator=g)
    col = lambda v: torch.full((batch, 1), v, dtype=torch.long)   # noqa: E731
    needle = torch.cat([col(KEY), keys, col(VAL), digits], dim=1)                                # [B, N]
    starts = torch.round(depths * filler).long()                                                 # [B]
    input_ids = torch.empty(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        s = int(starts[b])
        input_ids[b] = torch.cat([fill[b, :s], needle[b], fill[b, s:], needle[b]])
    assert input_ids.shape == (batch, seq_len)
    targets = torch.full_like(input_ids, IGNORE)
    targets[:, seq_len - answer_len - 1:seq_len - 1] = digits
    return input_ids, targets, depths.float()


def multikey_batch(batch: int, seq_len: int, seed: int, pair_every: int = 32, num_queries: int = 1,
                   vocab_size: int = 64, key_len: int = 1, answer_len: int = 3) -> Tuple[Tensor, Tensor]:
    """Passkey with distractors: ``P = seq_len // pair_every`` needles with distinct keys, ``Q`` of them queried.

    Token ranges as in :func:`passkey_batch`: digits ``[4, 14)``, words ``[14, vocab_size)``. Each needle is
    ``KEY k_1..k_K VAL d_1..d_D`` (``N = 2 + K + D`` tokens; keys distinct within a row, values drawn with
    replacement); the needles sit at uniformly random non-overlapping places among ``F = seq_len - (P + Q) N``
    random filler words, and the row ends with ``Q = num_queries`` queries, each a copy of a different needle
    (chosen uniformly, ``Q <= P``). The needle count grows with the length at a fixed density, so a
    fixed-size memory fills up. Targets (pre-shifted) are each query's ``d_1..d_D`` (at the query's ``VAL``
    and its first ``D - 1`` digits), ``-100`` elsewhere.

    Returns ``input_ids [B, T]`` and ``targets [B, T]`` (both ``torch.long``).
    """
    n = passkey_needle_len(key_len, answer_len)
    lo = NUM_SPECIAL + NUM_DIGITS
    words = vocab_size - lo
    pairs = seq_len // pair_every
    _check_needle(vocab_size, key_len, answer_len)
    if pairs < 1:
        raise ValueError(f"seq_len={seq_len} < pair_every={pair_every}: no needle; lower pair_every")
    if not 1 <= num_queries <= pairs:
        raise ValueError(f"num_queries={num_queries} must be in [1, {pairs} needles]")
    if words ** key_len < pairs:
        raise ValueError(f"{words}**key_len={key_len} distinct keys < {pairs} needles at seq_len={seq_len}: "
                         f"raise vocab_size or key_len, or pair_every")
    filler = seq_len - (pairs + num_queries) * n
    if filler < 0:
        raise ValueError(f"seq_len={seq_len} < {pairs} needles + {num_queries} queries of {n} tokens; "
                         "raise pair_every")
    g = _gen(seed)
    code = torch.rand(batch, words ** key_len, generator=g).argsort(dim=1)[:, :pairs]          # [B, P] distinct
    keys = torch.stack([code // words ** i % words for i in range(key_len)], dim=2) + lo       # [B, P, K]
    digits = torch.randint(NUM_SPECIAL, lo, (batch, pairs, answer_len), generator=g)
    marker = lambda v: torch.full((batch, pairs, 1), v, dtype=torch.long)   # noqa: E731
    needles = torch.cat([marker(KEY), keys, marker(VAL), digits], dim=2)                        # [B, P, N]
    slots = torch.rand(batch, filler + pairs, generator=g).argsort(dim=1)[:, :pairs]
    is_needle = torch.zeros(batch, filler + pairs, dtype=torch.bool).scatter_(1, slots, True)
    lens = 1 + (n - 1) * is_needle.long()
    starts = lens.cumsum(dim=1) - lens                        # where each filler word or needle begins
    asked = torch.rand(batch, pairs, generator=g).argsort(dim=1)[:, :num_queries]             # [B, Q]
    fill = torch.randint(lo, vocab_size, (batch, filler), generator=g)
    input_ids = torch.empty(batch, seq_len, dtype=torch.long)
    input_ids.scatter_(1, starts[~is_needle].view(batch, filler), fill)
    first = starts[is_needle].view(batch, pairs, 1)
    input_ids.scatter_(1, (first + torch.arange(n)).view(batch, -1), needles.view(batch, -1))
    q0 = seq_len - num_queries * n
    input_ids[:, q0:] = needles[torch.arange(batch).unsqueeze(1), asked].view(batch, -1)
    targets = torch.full_like(input_ids, IGNORE)
    answer = torch.arange(n - answer_len, n) + q0 + n * torch.arange(num_queries).unsqueeze(1)  # [Q, D]
    targets[:, answer.flatten() - 1] = input_ids[:, answer.flatten()]
    return input_ids, targets


@torch.no_grad()
def recall_accuracy(model: nn.Module, input_ids: Tensor, targets: Tensor, batch_size: int = 32) -> float:
    """Teacher-forced exact-match accuracy over answer tokens.

    ``model(input_ids [b, T])`` must return logits ``[b, T, V]`` or a tuple whose first item is
    them (``KVMLanguageModel``). Accuracy = mean over positions with ``targets != -100`` of
    ``argmax(logits) == targets``; evaluated in batches of ``batch_size`` under ``no_grad``
    (and ``eval()`` mode, restored afterwards).
    """
    was_training = model.training
    model.eval()
    correct, total = 0, 0
    try:
        for i in range(0, input_ids.shape[0], batch_size):
            x, y = input_ids[i:i + batch_size], targets[i:i + batch_size]
            out = model(x)
            logits = out[0] if isinstance(out, (tuple, list)) else out
            mask = y != IGNORE
            correct += int((logits.argmax(dim=-1)[mask] == y[mask]).sum())
            total += int(mask.sum())
    finally:
        model.train(was_training)
    assert total > 0, "no answer positions in targets"
    return correct / total


def _vocab(model: nn.Module, vocab_size: Optional[int]) -> int:
    if vocab_size is not None:
        return vocab_size
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", 64))


def accuracy_by_depth(model: nn.Module, seq_len: int, depths: Sequence[float], samples: int, seed: int,
                      vocab_size: Optional[int] = None, **passkey_kwargs) -> Dict[float, float]:
    """Passkey accuracy ``{depth: accuracy}`` over ``samples`` rows of length ``seq_len`` per depth.

    ``vocab_size`` defaults to ``model.config.vocab_size`` (else 64); depth ``i`` uses seed ``seed + i``.
    """
    v = _vocab(model, vocab_size)
    out = {}
    for i, d in enumerate(depths):
        x, y, _ = passkey_batch(samples, seq_len, seed + i, depth=float(d), vocab_size=v, **passkey_kwargs)
        out[float(d)] = recall_accuracy(model, x, y)
    return out


def accuracy_grid(model: nn.Module, lengths: Sequence[int], depths: Sequence[float], samples: int, seed: int,
                  vocab_size: Optional[int] = None, **passkey_kwargs) -> Dict[int, Dict[float, float]]:
    """Passkey accuracy ``{seq_len: {depth: accuracy}}`` (length ``j`` uses seed ``seed + 1000 * j``)."""
    return {int(t): accuracy_by_depth(model, int(t), depths, samples, seed + 1000 * j, vocab_size, **passkey_kwargs)
            for j, t in enumerate(lengths)}


def plot_heatmap(grid: Dict[int, Dict[float, float]], path, title: str = "passkey accuracy") -> Optional[str]:
    """Write ``grid`` (from :func:`accuracy_grid`) as a PNG heatmap: depth rows x length columns.

    Uses a pyplot-free matplotlib ``Figure`` (Agg canvas, imported lazily) and writes atomically. Returns ``str(path)``,
    or ``None`` (with a printed message) when matplotlib is missing.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: the global backend is left alone
    except ImportError:
        print("plot_heatmap: matplotlib is not installed; skipping", path)
        return None
    from kvmeans.utils.io import atomic_write

    lengths = sorted(grid)
    depths = sorted({d for row in grid.values() for d in row})
    data = [[grid[t].get(d, float("nan")) for t in lengths] for d in depths]
    fig = Figure(figsize=(1.2 + 0.8 * len(lengths), 1.0 + 0.5 * len(depths)))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [str(t) for t in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    for i, row in enumerate(data):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", color="w" if a < 0.6 else "k", fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return str(path)
