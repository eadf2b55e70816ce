"""Where a training process runs and how it wraps the model: torchrun ranks, device, autocast, DDP / FSDP2.

Under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK set) the process group uses NCCL on CUDA and gloo on
CPU. ``build_model`` returns the bare :class:`KVMLanguageModel` (checkpoints and exports read it) and
the callable a training step uses, ``model(input_ids) -> logits``: a :class:`LogitsOnly` view, wrapped
in DDP, or over an FSDP2-sharded LM (``fully_shard`` per block, then the root).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kvmeans.models import KVMLanguageModel, KVMModelConfig
from kvmeans.train.config import ConfigError, RunConfig

__all__ = ["Runtime", "setup_runtime", "LogitsOnly", "build_model", "grad_sync"]


@dataclass
class Runtime:
    """Where this process runs: rank, world size, device and the autocast context."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    amp_dtype: Optional[torch.dtype] = None          # None = fp32 (no autocast)
    owns_process_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def sum(self, values: List[Any]) -> List[float]:
        """Sum scalars (floats or 0-d tensors) over ranks; one collective, and a host sync point."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()


def setup_runtime(cfg: RunConfig) -> Runtime:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK, pick the device and init the process group."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch.cuda.is_available() is False; use --train.device cpu")
    device = torch.device(want, local) if want == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = cfg.train.dtype
    amp = torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device.type == "cuda") else None
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
        owns = True
    return Runtime(rank, world, local, device, amp, owns)


def _checkpoint_blocks(model: KVMLanguageModel) -> None:
    """Recompute every block in backward (``Block.gradient_checkpointing``, as the HF class's
    ``gradient_checkpointing_enable``); parameter names stay unchanged."""
    for block in model.transformer.h:
        block.gradient_checkpointing = True


def _shard(model: KVMLanguageModel) -> None:
    """FSDP2: ``fully_shard`` each block, then the root. The first block of each value-residual stream
    stays in the root unit: the backbone reads its ``ln_attn`` / ``c_v`` outside that block's forward."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    cfg = model.config
    anchors = {}
    for i in range(cfg.num_layers):
        anchors.setdefault(cfg.is_alt_layer(i), i)
    for i, block in enumerate(model.transformer.h):
        if not (cfg.value_residual and i in anchors.values()):
            fully_shard(block)
    fully_shard(model)
    # blocks return their mixer state (views); training never edits outputs in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class LogitsOnly(nn.Module):
    """``lm(x) -> logits``: the training view of the LM. DDP must not see the returned cache, whose
    state tensors depend on parameters that get no gradient from the loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids)[0]


def build_model(cfg: RunConfig, model_cfg: KVMModelConfig, rt: Runtime):
    """``(raw, model)``: the KVMLanguageModel (the FSDP root under fsdp) and what a step calls:
    ``model(input_ids) -> logits``, a :class:`LogitsOnly` view, DDP-wrapped under ddp.

    Same seed on every rank, so every replica starts from the same weights.
    """
    torch.manual_seed(cfg.train.seed)
    raw = KVMLanguageModel(model_cfg).to(rt.device)
    ddp = rt.world > 1 and cfg.train.strategy == "ddp"
    unused = _unused_parameters(raw, cfg, rt) if ddp else []
    if unused and rt.is_main:
        print(f"note: {len(unused)} parameters get no gradient at seq_len={cfg.data.seq_len} (e.g. {unused[0]}); "
              "DDP runs with find_unused_parameters=True", flush=True)
    if cfg.train.grad_checkpointing:
        _checkpoint_blocks(raw)
    if cfg.train.compile:
        for block in raw.transformer.h:
            block.compile()
    if rt.world > 1 and not ddp:
        _shard(raw)
    if ddp:
        # broadcast_buffers off: the only buffers are RoPE tables, equal on every rank by construction
        return raw, DDP(LogitsOnly(raw), device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
                        find_unused_parameters=bool(unused), broadcast_buffers=False)
    return raw, LogitsOnly(raw)


def _unused_parameters(model: nn.Module, cfg: RunConfig, rt: Runtime) -> List[str]:
    """Names of parameters outside the autograd graph of one ``[1, seq_len]`` sequence (e.g. the KVM
    state's projections when seq_len fits in the window). Shapes alone decide this, so one probe holds
    for the whole run; DDP must be told, or its next step fails waiting for their gradients."""
    x = torch.zeros(1, cfg.data.seq_len, dtype=torch.long, device=rt.device)
    with rt.autocast():
        logits, _ = model(x)
    logits.float().sum().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    return unused


def grad_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro step (DDP no_sync / FSDP2 flag)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model.lm, "set_requires_gradient_sync"):       # FSDP2 root
        model.lm.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
