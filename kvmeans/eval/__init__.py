"""Evaluation helpers: synthetic recall tasks (MQAR, passkey) and their accuracy metrics."""
from .synthetic import (KEY, NUM_DIGITS, NUM_SPECIAL, PAD, SEP, VAL, accuracy_by_depth, accuracy_grid, mqar_batch,
                        passkey_batch, passkey_needle_len, plot_heatmap, recall_accuracy)

__all__ = ["PAD", "SEP", "KEY", "VAL", "NUM_SPECIAL", "NUM_DIGITS", "mqar_batch", "passkey_batch",
           "passkey_needle_len", "recall_accuracy", "accuracy_by_depth", "accuracy_grid", "plot_heatmap"]
