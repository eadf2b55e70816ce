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

__all__ = ["StateBudget", "BudgetLike", "as_budget", "parse_budget_spec"]


@dataclass(frozen=True)
class StateBudget:
    """A state-size schedule ``ctx_len -> rows``.

    Build one with :meth:`fixed`, :meth:`power_law` or :meth:`saturating`, or pass any
    callable ``ctx_len -> rows`` to ``kvm_attention(budget=...)``.
    """

    kind: str
    n: int = 0                 # fixed: rows; saturating: N of floor(N*t/(N+t))
    factor: float = 1.0        # power_law: factor * t**exponent
    exponent: float = 0.5
    min_len: int = 0
    round_down: int = 1
    max_len: Optional[int] = None

    def __post_init__(self):
        if self.kind not in ("fixed", "power_law", "saturating"):
            raise ValueError(f"StateBudget kind must be fixed, power_law or saturating, got {self.kind!r}")
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

    # ---- evaluation -----------------------------------------------------------------------
    def __call__(self, ctx_len: int) -> int:
        t = max(int(ctx_len), 0)
        if self.kind == "fixed":
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


def parse_budget_spec(text: str) -> Union[StateBudget, int]:
    """``N``, ``fixed:N``, ``saturating:N[:MIN_LEN]`` or ``power_law:FACTOR[:EXPONENT[:MIN_LEN]]`` -> a budget
    (a plain ``N`` stays an int); ``ValueError`` naming the forms otherwise."""
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
    except ValueError:
        pass
    raise ValueError(f"budget {text!r} is not one of N, fixed:N, saturating:N[:MIN_LEN], "
                     "power_law:FACTOR[:EXPONENT[:MIN_LEN]]")
