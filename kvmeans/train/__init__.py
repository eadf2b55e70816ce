"""Training: data (token files, batches), tokenizers, data preparation, and the training loop.

``python -m kvmeans.train --preset tiny-cpu`` (see :mod:`kvmeans.train.cli`); in Python::

    from kvmeans.train import resolve_config, train
    summary = train(resolve_config("tiny-cpu", overrides=[("train", "max_steps", 50)]))
"""
from .config import RUN_PRESETS, ConfigError, RunConfig, resolve_config


def train(config, resume=None, **kwargs):
    """:func:`kvmeans.train.loop.train` (imported on first use)."""
    from .loop import train as _train
    return _train(config, resume=resume, **kwargs)


__all__ = ["RUN_PRESETS", "ConfigError", "RunConfig", "resolve_config", "train"]
