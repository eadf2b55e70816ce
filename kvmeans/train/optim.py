"""Optimiser: the authors' parameter groups (reference 8.3), CompleteP width scaling, AdamW, AdamC, schedule.

Groups (each a dict with a ``name``):

| name      | parameters                                   | lr          | weight decay |
|-----------|----------------------------------------------|-------------|--------------|
| embedding | ``transformer.wte.weight``                   | lr          | wd           |
| matrix    | every other ``nn.Linear`` weight             | lr / r      | wd * r       |
| lora      | the value-gate LoRA ``v_gate1``, ``v_gate2``  | lr / r_lora | wd * r_lora  |
| lm_head   | ``lm_head.weight``                           | lr / r      | wd * r       |
| scalars   | LayerNorms, token-shift mixes, gates' v0,    | lr          | 0            |
|           | temperatures, OVQ beta, biases               |             |              |

``r = hidden_size / mup_base_dim`` (1.0 at 120M, 4/3 at 350M). The LoRA matrices scale with their own
width instead, ``r_lora = lora_dim / 32`` (32 is the LoRA width at 768; it stays 32 up to about 1.4k,
so r_lora = 1 for every paper model, as in the authors' code). A parameter decays iff it is the
weight of an ``nn.Linear`` or ``nn.Embedding``: ``v_gate0`` and ``mlp.x_k`` are stored ``[1, 1, d]``
but are per-channel vectors, so "ndim >= 2" alone would misfile them.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
from torch import nn

from kvmeans.train.config import OptimSection

__all__ = ["build_param_groups", "build_optimizer", "mup_ratio", "group_peaks", "refresh_peaks", "lr_factor",
           "apply_schedule"]

_LORA = ("v_gate1", "v_gate2")
_LORA_BASE = 32              # the value-gate LoRA width at hidden 768 (reference 4.3)


def _is_matrix(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding))


def build_param_groups(model: nn.Module, cfg: OptimSection) -> List[Dict]:
    """AdamW parameter groups with ``name``, ``lr``, ``weight_decay`` and the peaks the schedule scales.

    ``model``: a :class:`KVMLanguageModel` (the unwrapped module). Tied embeddings appear once, in
    ``embedding``. Empty groups are dropped.
    """
    decays = {id(m.weight) for m in model.modules() if _is_matrix(m)}
    lora = {id(m.weight) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in _LORA}
    embed, head = id(model.transformer.wte.weight), id(model.lm_head.weight)
    params: Dict[str, list] = {"embedding": [], "matrix": [], "lora": [], "lm_head": [], "scalars": []}
    names: Dict[str, list] = {k: [] for k in params}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group = ("embedding" if id(p) == embed else "lm_head" if id(p) == head else "lora" if id(p) in lora
                 else "matrix" if id(p) in decays else "scalars")
        params[group].append(p)
        names[group].append(name)
    groups = []
    for g in params:
        if params[g]:
            lr, wd = group_peaks(g, mup_ratio(model, g, cfg), cfg)
            groups.append({"name": g, "params": params[g], "param_names": names[g], "lr": lr, "weight_decay": wd,
                           "peak_lr": lr, "peak_weight_decay": wd})
    return groups


def mup_ratio(model: nn.Module, group: str, cfg: OptimSection) -> float:
    """Width ratio of ``group``: hidden / mup_base_dim for matrix and lm_head, LoRA width / 32 for lora."""
    if group == "lora":
        widths = {m.out_features for n, m in model.named_modules() if n.endswith("v_gate1")}
        return max(widths) / _LORA_BASE
    return model.config.hidden_size / cfg.mup_base_dim if group in ("matrix", "lm_head") else 1.0


def group_peaks(name: str, ratio: float, cfg: OptimSection) -> Tuple[float, float]:
    """Peak ``(lr, weight_decay)`` of group ``name`` at width ratio ``ratio`` (the table above)."""
    if name in ("matrix", "lm_head", "lora"):
        return cfg.lr / ratio, cfg.weight_decay * ratio
    return cfg.lr, (0.0 if name == "scalars" else cfg.weight_decay)


def refresh_peaks(optimizer: torch.optim.Optimizer, model: nn.Module, cfg: OptimSection) -> None:
    """Recompute each group's peaks from ``cfg`` (after loading a checkpoint, whose groups carry the
    peaks it was saved with: a resumed run may change optim.lr or optim.weight_decay)."""
    for g in optimizer.param_groups:
        g["peak_lr"], g["peak_weight_decay"] = group_peaks(g["name"], mup_ratio(model, g["name"], cfg), cfg)


def build_optimizer(model: nn.Module, cfg: OptimSection, device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW over :func:`build_param_groups` (fused kernels on CUDA; the loop sets lr/wd every step)."""
    groups = build_param_groups(model, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=device_type == "cuda")


def lr_factor(step: int, total_steps: int, cfg: OptimSection) -> float:
    """lr at 0-based ``step`` as a fraction of the peak: ``(step + 1) / warmup`` during warm-up, then
    decay to ``min_lr / lr`` at ``total_steps`` (linear as in the paper, or cosine; "constant" holds 1)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    # fraction of the decay phase still ahead: 1 right after warm-up, 1 / decay_steps at the last step
    left = (total_steps - step) / max(1, total_steps - cfg.warmup_steps)
    if cfg.decay == "constant":
        return 1.0
    shape = left if cfg.decay == "linear" else 0.5 * (1 - math.cos(math.pi * left))
    return floor + (1 - floor) * shape


def apply_schedule(optimizer: torch.optim.Optimizer, step: int, total_steps: int, cfg: OptimSection) -> float:
    """Set every group's lr (and, with AdamC, its weight decay: ``wd_peak * lr_now / lr_peak``) for ``step``.

    Returns the base lr (the ``embedding``/``scalars`` groups' lr) for logging.
    """
    f = lr_factor(step, total_steps, cfg)
    for g in optimizer.param_groups:
        g["lr"] = g["peak_lr"] * f
        g["weight_decay"] = g["peak_weight_decay"] * (f if cfg.adamc else 1.0)
    return cfg.lr * f
