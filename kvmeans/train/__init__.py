"""Training: data (token files, batches), tokenizers, data preparation, and the training loop.

``python -m kvmeans.train --preset tiny-cpu`` (see :mod:`kvmeans.train.cli`); in Python::

    from kvmeans.train import resolve_config, train
    summary = train(resolve_config("tiny-cpu", overrides=[("train", "max_steps", 50)]))
"""
from .config import RUN_PRESETS, ConfigError, RunConfig, resolve_config

__all__ = ["RUN_PRESETS", "ConfigError", "RunConfig", "resolve_config", "train", "main"]


def __getattr__(name):
    # the loop and its CLI load on first use, so `import kvmeans.train.prepare` stays light
    if name == "train":
        from .loop import train
        return train
    if name == "main":
        from .cli import main
        return main
    raise AttributeError(f"module 'kvmeans.train' has no attribute {name!r}")
