"""Training: data (token files, batches), tokenizers, data preparation, and the training loop.

``kvmeans train --preset tiny-cpu`` (see :mod:`kvmeans.cli.train`); in Python::

    from kvmeans.train import resolve_config, train
    summary = train(resolve_config("tiny-cpu", overrides=[("train", "max_steps", 50)]))
"""
from kvmeans.train.config import RUN_PRESETS, ConfigError, RunConfig, resolve_config

__all__ = ["RUN_PRESETS", "ConfigError", "RunConfig", "resolve_config", "train"]


def __getattr__(name):
    # the loop loads on first use, so `import kvmeans.train.prepare` stays light
    if name == "train":
        from kvmeans.train.loop import train
        return train
    raise AttributeError(f"module 'kvmeans.train' has no attribute {name!r}")
