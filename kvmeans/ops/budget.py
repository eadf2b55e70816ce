"""State budgets: how many state rows KVM may hold after reading ``ctx_len`` tokens.

A budget is read at each chunk boundary (paper Sec. 3.2, "We choose n_append"):
``ctx_len`` is the number of tokens seen by the chunk of queries that just attended.
The op then caps it by the rows that could exist and never lets the state shrink:
``M* = max(m, min(B(ctx_len), available))`` with ``available = m + C`` at most.
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union

__all__ = ["StateBudget", "BudgetLike", "as_budget", "parse_budget_spec", "is_data_dependent"]

KINDS = ("fixed", "power_law", "saturating", "novelty")


@dataclass(frozen=True)
class StateBudget:
    """A state-size schedule ``ctx_len -> rows``.

    Build one with :meth:`fixed`, :meth:`power_law`, :meth:`saturating` or :meth:`novelty` (data-dependent
    growth), or pass any callable ``ctx_len -> rows`` to ``kvm_attention(budget=...)``.
    """

    kind: str
    n: int = 0                 # fixed: rows; saturating: N of floor(N*t/(N+t)); novelty: the cap on rows
    factor: float = 1.0        # power_law: factor * t**exponent
    exponent: float = 0.5
    min_len: int = 0
    round_down: int = 1
    max_len: Optional[int] = None
    threshold: Optional[float] = None   # novelty: append a token whose 1 - max cosine to the rows exceeds this

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"StateBudget kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("n", "min_len", "round_down") + (("max_len",) if self.max_len is not None else ()):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"StateBudget: {name} must be an int, got {x!r}")
            object.__setattr__(self, name, int(x))
        for name in ("factor", "exponent"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
                raise ValueError(f"StateBudget: {name} must be a finite number, got {x!r}")
            object.__setattr__(self, name, float(x))
        if self.kind == "fixed" and self.n < 1:
            raise ValueError(f"StateBudget.fixed(n): n must be >= 1, got {self.n}")
        if self.kind == "saturating" and self.n < 1:
            raise ValueError(f"StateBudget.saturating(n): n must be >= 1, got {self.n}")
        if (self.kind == "novelty") != (self.threshold is not None):
            raise ValueError(f"StateBudget: threshold belongs to kind 'novelty' only, got kind={self.kind!r}, "
                             f"threshold={self.threshold!r}")
        if self.kind == "novelty":
            t = self.threshold
            if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t <= 2:
                raise ValueError(f"StateBudget.novelty: threshold must be a number in [0, 2] (1 - cosine), got {t!r}")
            object.__setattr__(self, "threshold", float(t))
            if self.n < 1:
                raise ValueError(f"StateBudget.novelty: cap must be >= 1 rows, got {self.n}")
        if self.kind == "power_law" and not (self.factor > 0 and self.exponent >= 0):
            raise ValueError(
                f"StateBudget.power_law: factor must be > 0 and exponent >= 0, got factor={self.factor}, "
                f"exponent={self.exponent}")
        if self.min_len < 0:
            raise ValueError(f"StateBudget: min_len must be >= 0, got {self.min_len}")
        if self.round_down < 1:
            raise ValueError(f"StateBudget: round_down must be >= 1, got {self.round_down}")
        if self.max_len is not None and self.max_len < max(self.min_len, 1):
            raise ValueError(
                f"StateBudget: max_len={self.max_len} is below min_len={self.min_len}; raise max_len or drop it")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def fixed(cls, n: int) -> "StateBudget":
        """Exactly ``n`` rows once there are enough tokens (paper: KVM fixed-256 is ``fixed(256)``)."""
        return cls("fixed", n=n)

    @classmethod
    def power_law(cls, factor: float, exponent: float = 0.5, min_len: int = 0, round_down: int = 1,
                  max_len: Optional[int] = None) -> "StateBudget":
        """``floor(factor * t**exponent)``; 16*sqrt(N) is ``power_law(16, 0.5, min_len=256)``."""
        return cls("power_law", factor=factor, exponent=exponent, min_len=min_len, round_down=round_down,
                   max_len=max_len)

    @classmethod
    def saturating(cls, n: int, min_len: int = 0, round_down: int = 1,
                   max_len: Optional[int] = None) -> "StateBudget":
        """``floor(n*t/(n+t))``: grows like ``t`` early and saturates at ``n``."""
        return cls("saturating", n=n, min_len=min_len, round_down=round_down, max_len=max_len)

    @classmethod
    def novelty(cls, threshold: float, cap: int) -> "StateBudget":
        """Data-dependent growth: a token leaving the window becomes a new row when its novelty
        ``1 - max_i cos(k_bar, LN_s(s_i))`` exceeds ``threshold`` (in [0, 2]), while the rows of its
        (sequence, kv head) stay below ``cap``; every other token merges (docs/algorithm.md)."""
        return cls("novelty", n=cap, threshold=threshold)

    @property
    def data_dependent(self) -> bool:
        """The rows depend on the data (per sequence and kv head), not on the position alone."""
        return self.kind == "novelty"

    # ---- evaluation -----------------------------------------------------------------------
    def __call__(self, ctx_len: int) -> int:
        """Rows after ``ctx_len`` tokens (novelty: the cap, the most rows the state may hold)."""
        t = max(int(ctx_len), 0)
        if self.kind in ("fixed", "novelty"):
            return self.n
        if self.kind == "power_law":
            try:
                target = math.floor(self.factor * float(t) ** self.exponent)
            except OverflowError:           # more rows than could ever exist: the op caps it by the tokens
                target = sys.maxsize
        else:
            target = (self.n * t) // (self.n + t)
        target = target // self.round_down * self.round_down
        target = max(target, self.min_len)
        if self.max_len is not None:
            target = min(target, self.max_len)
        return target

    def __repr__(self) -> str:
        if self.kind == "fixed":
            return f"StateBudget.fixed({self.n})"
        if self.kind == "novelty":
            return f"StateBudget.novelty({self.threshold:g}, {self.n})"
        extra = "".join(f", {k}={getattr(self, k)}" for k in ("min_len", "round_down", "max_len")
                        if getattr(self, k) != {"min_len": 0, "round_down": 1, "max_len": None}[k])
        if self.kind == "power_law":
            return f"StateBudget.power_law({self.factor:g}, {self.exponent:g}{extra})"
        return f"StateBudget.saturating({self.n}{extra})"


BudgetLike = Union[StateBudget, Callable[[int], int], int]


def as_budget(budget: BudgetLike) -> Callable[[int], int]:
    """Accept a StateBudget, a plain int ``n`` (exactly ``StateBudget.fixed(n)``: same rows, same checks)
    or any callable ``ctx_len -> rows``."""
    if isinstance(budget, bool):
        raise TypeError("budget must be a StateBudget, an int or a callable ctx_len -> rows, got a bool")
    if isinstance(budget, int):
        return StateBudget.fixed(budget)
    if callable(budget):
        return budget
    raise TypeError(f"budget must be a StateBudget, an int or a callable ctx_len -> rows, got {type(budget).__name__}")


def is_data_dependent(budget) -> bool:
    """The budget grows the state by novelty (per sequence and kv head) rather than by position."""
    return isinstance(budget, StateBudget) and budget.data_dependent


def parse_budget_spec(text: str) -> Union[StateBudget, int]:
    """``N``, ``fixed:N``, ``saturating:N[:MIN_LEN]``, ``power_law:FACTOR[:EXPONENT[:MIN_LEN]]`` or
    ``novelty:THRESHOLD:CAP`` -> a budget (a plain ``N`` stays an int); ``ValueError`` naming the forms otherwise."""
    kind, _, rest = text.partition(":")
    args = [a for a in rest.split(":") if a]
    try:
        if kind.isdigit() and not rest:
            return int(kind)
        if kind == "fixed" and len(args) == 1:
            return StateBudget.fixed(int(args[0]))
        if kind == "saturating" and 1 <= len(args) <= 2:
            return StateBudget.saturating(int(args[0]), *map(int, args[1:]))
        if kind == "power_law" and 1 <= len(args) <= 3:
            return StateBudget.power_law(float(args[0]), *(float(a) for a in args[1:2]), *map(int, args[2:]))
        if kind == "novelty" and len(args) == 2:
            return StateBudget.novelty(float(args[0]), int(args[1]))
    except ValueError as err:
        if kind == "novelty" and "threshold" in str(err):
            raise ValueError(f"budget {text!r}: {err}") from None
    raise ValueError(f"budget {text!r} is not one of N, fixed:N, saturating:N[:MIN_LEN], "
                     "power_law:FACTOR[:EXPONENT[:MIN_LEN]], novelty:THRESHOLD:CAP")
