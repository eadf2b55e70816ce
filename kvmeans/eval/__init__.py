"""Evaluation helpers: synthetic recall tasks (MQAR, passkey) and their accuracy metrics."""
from kvmeans.eval.memory import PAPER_BUDGETS, full_attention_kv_bytes, measure_model, schedule_curves
from kvmeans.eval.synthetic import (
    KEY,
    NUM_DIGITS,
    NUM_SPECIAL,
    PAD,
    SEP,
    VAL,
    accuracy_by_depth,
    accuracy_grid,
    mqar_batch,
    passkey_batch,
    passkey_needle_len,
    plot_heatmap,
    recall_accuracy,
)

# the lm-eval `kvm` model (kvmeans.eval.harness) is not imported here: it needs lm-eval + accelerate

__all__ = ["PAD", "SEP", "KEY", "VAL", "NUM_SPECIAL", "NUM_DIGITS", "mqar_batch", "passkey_batch",
           "passkey_needle_len", "recall_accuracy", "accuracy_by_depth", "accuracy_grid", "plot_heatmap",
           "PAPER_BUDGETS", "full_attention_kv_bytes", "measure_model", "schedule_curves", "document_spans",
           "per_position_nll"]


def __getattr__(name):          # position-loss helpers load lazily (they need numpy; the rest is torch-only)
    if name in ("document_spans", "per_position_nll"):
        from kvmeans.eval import position_loss
        return getattr(position_loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
