"""Distil a pretrained transformers LM into its KVM-converted self (RADLADS-style, two stages).

The student is the teacher converted with ``convert_hf(..., learned=True)``: the same weights plus KVM's
learned read-out per converted layer (merge gate, LN_s, state/window temperatures), initialised to the
training-free read. Only those parameters train (and, with ``lr_qkvo > 0``, the converted layers' own
attention weights: q/k/v/o projections, their biases and q/k norms); everything else stays the teacher's.

* Stage 1 (``stage1_steps``), attention-output alignment: one teacher forward records each converted layer's
  input (the teacher's residual stream) and attention output; each student layer runs on the teacher's
  input and is pulled to the teacher's output, loss ``|y_s - y_t|^2 / |y_t|^2`` per layer, averaged over
  layers. Layers are independent, so each is backpropagated on its own (one layer's graph in memory).
* Stage 2 (``stage2_steps``), logit distillation: ``KL(teacher || student)`` of the next-token
  distributions of the whole model, mean over tokens.

Sequences must be several times the KVM window (a sequence inside the window never reaches the state).
On the training loop's pieces: checkpoints of the trained parameters and the optimiser with CRC
(``checkpoint``), exact resume (the data order is a function of the step), ``metrics.csv`` and progress
(``metrics``), the lr schedule (``optim``), torchrun ranks (``runtime``: each rank takes rows ``r::world``
of the batch; gradients are all-reduced). Outputs under ``out``::

    OUT/distill.json  settings + held-out documents   OUT/metrics.csv  step, loss (stage 1: alignment,
    OUT/ckpt/         step_*.pt + latest                               stage 2: KL), lr, tokens/s, elapsed
    OUT/final/        the converted model with its learned parameters + tokenizer (kvmeans.load_converted)
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvmeans.models.reference_checkpoint import NATIVE_MODEL_TYPES
from kvmeans.pretrained.convert import (
    CONFIG_KEY,
    KVMSpec,
    _attention_layers,
    calibrates,
    convert_hf,
    parse_kvm_spec,
)
from kvmeans.pretrained.distill_data import training_sequences
from kvmeans.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_temp_files,
    restore_checkpoint,
    save_checkpoint,
)
from kvmeans.train.config import ConfigError, OptimSection, RunConfig, TrainSection
from kvmeans.train.loop import StopSignal
from kvmeans.train.metrics import MetricsLog, TrainProgress
from kvmeans.train.optim import apply_schedule
from kvmeans.train.runtime import setup_runtime
from kvmeans.utils.io import atomic_dir, atomic_write_file
from kvmeans.utils.weights import CorruptWeightsError, named_weight_errors

__all__ = ["DistillConfig", "Distiller", "distill", "trainable_parameters", "alignment_loss", "kl_loss"]

# settings a resumed run may change (and stage2_steps until stage 2 has begun); any other difference is refused
_RESUMABLE = ("out", "ckpt_every", "log_every", "threads")


@dataclass
class DistillConfig:
    """One distillation run. ``kvm``: a ``--kvm`` spec (``learned=true`` is implied); ``data``: corpus names
    (``["shakespeare"]``, ``["factbook", "pybind11", "shakespeare"]``) and/or text files; ``holdout``: ``(windows,
    length, seed)`` of the ``kvmeans eval ppl`` windows kept out of training, per source (its defaults: 6, 2048, 0)."""
    teacher: str
    kvm: str
    out: str
    data: List[str] = field(default_factory=lambda: ["shakespeare"])
    seq_len: int = 2048
    batch_size: int = 1                  # sequences per optimiser step, all ranks together
    stage1_steps: int = 100
    stage2_steps: int = 50
    lr: float = 1e-2                     # peak lr of the KVM read-out parameters
    lr_qkvo: float = 0.0                 # peak lr of the converted layers' attention weights; 0 = frozen
    warmup_steps: int = 10               # per stage, then cosine decay to lr / 10
    holdout: List[int] = field(default_factory=lambda: [6, 2048, 0])
    seed: int = 0
    ckpt_every: int = 50                 # 0 = only at the end
    log_every: int = 1
    threads: Optional[int] = None
    device: str = "cpu"

    @property
    def total_steps(self) -> int:
        return self.stage1_steps + self.stage2_steps

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self, spec: Optional[KVMSpec], world: int = 1) -> None:
        """Errors naming the setting and the fix (``spec``: the student's, ``None`` while not yet calibrated)."""
        span = spec.n_bswa_chunks * spec.chunk_len if spec is not None else 0
        if spec is not None and self.seq_len <= span:
            raise ConfigError(f"--seq-len {self.seq_len} never leaves the KVM window (n_bswa_chunks * chunk_len = "
                              f"{span} tokens), so nothing reaches the state to learn from; "
                              f"use --seq-len >= {4 * span}")
        if self.stage1_steps < 0 or self.stage2_steps < 0 or self.total_steps < 1:
            raise ConfigError(f"need --stage1-steps >= 0, --stage2-steps >= 0 and at least one step, got "
                              f"{self.stage1_steps} and {self.stage2_steps}")
        if self.batch_size < 1 or self.batch_size % world:
            raise ConfigError(f"--batch-size {self.batch_size} must be >= 1 and a multiple of the {world} processes")
        if self.lr <= 0 or self.lr_qkvo < 0:
            raise ConfigError(f"need --lr > 0 and --lr-qkvo >= 0, got {self.lr} and {self.lr_qkvo}")


def student_spec(kvm: str) -> dict:
    """``convert_hf`` keyword arguments of ``kvm`` with ``learned=True`` (a ConfigError for a bad spec)."""
    try:
        settings = parse_kvm_spec(kvm)
    except ValueError as err:
        raise ConfigError(f"--kvm {kvm}: {err}") from None
    if settings.get("learned") is False:
        raise ConfigError("--kvm: learned=false leaves nothing to distil; drop it (distill sets learned=true)")
    return {**settings, "learned": True}


def trainable_parameters(student: nn.Module, qkvo: bool) -> Dict[str, List[nn.Parameter]]:
    """``{"kvm": [...], "qkvo": [...]}``: the learned read-out of every converted layer, and (``qkvo``) the
    rest of those layers' parameters. Marks exactly these ``requires_grad`` (the rest of the model frozen)."""
    groups: Dict[str, List[nn.Parameter]] = {"kvm": [], "qkvo": []}
    chosen = set(student.config.kvm_conversion["layers"])
    student.requires_grad_(False)
    for i, attn in sorted(_attention_layers(student).items()):
        if i not in chosen:
            continue
        for name, p in attn.named_parameters():
            group = "kvm" if name.startswith("kvm_") else "qkvo"
            if group == "kvm" or qkvo:
                p.requires_grad_(True)
                groups[group].append(p)
    return groups


def _capture_attention(teacher: nn.Module, layers: Sequence[int]):
    """Forward hooks recording ``{layer: (args, kwargs, output)}`` of the teacher's attention layers."""
    seen: Dict[int, tuple] = {}
    attn = _attention_layers(teacher)
    def hook(i):
        def record(module, args, kwargs, output):
            seen[i] = (args, kwargs, output[0] if isinstance(output, tuple) else output)
        return record
    handles = [attn[i].register_forward_hook(hook(i), with_kwargs=True) for i in layers]
    return seen, handles


def alignment_loss(teacher: nn.Module, student: nn.Module, ids: torch.Tensor, backward_scale: float = 0.0) -> float:
    """Stage 1 loss on ``ids [B, T]``: mean over sequences and converted layers of ``|y_s - y_t|^2 / |y_t|^2``
    (per sequence, so a batch split over ranks averages to the same), each student layer run on the teacher's
    input to that layer. With ``backward_scale > 0`` each layer's loss times it is backpropagated at once (one
    layer's graph alive at a time). Returns the loss."""
    layers = student.config.kvm_conversion["layers"]
    seen, handles = _capture_attention(teacher, layers)
    try:
        with torch.no_grad():
            teacher.base_model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    attn = _attention_layers(student)
    total = 0.0
    for i in layers:
        args, kwargs, target = seen.pop(i)
        out = attn[i](*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        err = (out.float() - target.float()).pow(2).flatten(1).sum(1)
        loss = (err / target.float().pow(2).flatten(1).sum(1).clamp_min(1e-12)).mean() / len(layers)
        if backward_scale > 0:
            (loss * backward_scale).backward()
        total += loss.item()
    return total


def kl_loss(teacher: nn.Module, student: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Stage 2 loss on ``ids [B, T]``: ``KL(teacher || student)`` of the next-token distributions, mean over tokens."""
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float(), -1)
    logp = F.log_softmax(student(input_ids=ids, use_cache=False).logits.float(), -1)
    return F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")


class _Trained(nn.Module):
    """The trained parameters under their student names (dots as ``-``): what checkpoints hold."""

    def __init__(self, student: nn.Module):
        super().__init__()
        for name, p in student.named_parameters():
            if p.requires_grad:
                self.register_parameter(name.replace(".", "-"), p)


class Distiller:
    """Teacher, student, data, optimiser and the step counter of one run (``run()`` trains to the end)."""

    def __init__(self, cfg: DistillConfig, resume: bool = False, log_fn: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log_fn
        self.rt = setup_runtime(RunConfig(train=TrainSection(out=cfg.out, device=cfg.device, seed=cfg.seed,
                                                             dtype="fp32")))
        self.out = Path(cfg.out)
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file; choose a folder")
        settings = student_spec(cfg.kvm)
        auto = calibrates(settings)         # the split is known after the calibration pass: checked then
        cfg.check(None if auto else KVMSpec(**{k: v for k, v in settings.items() if k != "layers"}), self.rt.world)
        ckpt = self._resume_file(resume)
        from transformers import AutoModelForCausalLM

        from kvmeans.models.load import load_hf_tokenizer
        if not (Path(cfg.teacher) / "config.json").is_file():
            raise ConfigError(f"--teacher {cfg.teacher}: no config.json there; give a transformers model folder "
                              "(e.g. from `kvmeans models fetch smollm2-135m`)")
        teacher_type = json.loads((Path(cfg.teacher) / "config.json").read_text()).get("model_type")
        if teacher_type in NATIVE_MODEL_TYPES:
            raise ConfigError(f"--teacher {cfg.teacher} is a KVM-native model; distill converts a plain transformers "
                              "model (e.g. from `kvmeans models fetch smollm2-135m`)")
        self.tokenizer = load_hf_tokenizer(cfg.teacher, "--teacher")
        try:
            self.sequences, self.heldout = training_sequences(self.tokenizer, list(cfg.data), cfg.seq_len,
                                                              tuple(cfg.holdout))
        except (ValueError, OSError) as err:
            raise ConfigError(f"--data: {err}") from None
        try:
            with named_weight_errors(cfg.teacher):
                self.teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher, dtype=torch.float32)
        except CorruptWeightsError as err:
            raise ConfigError(f"--teacher {cfg.teacher}: {err}") from None
        self.teacher = self.teacher.to(self.rt.device).eval()
        if getattr(self.teacher.config, CONFIG_KEY, None):
            raise ConfigError(f"--teacher {cfg.teacher} is a converted model (config.json {CONFIG_KEY}); "
                              "give the original model folder")
        self.teacher.requires_grad_(False)
        try:
            self.student = convert_hf(copy.deepcopy(self.teacher), tokenizer=self.tokenizer, **settings)
        except ValueError as err:
            raise ConfigError(f"--kvm: {err}") from None
        if auto:
            conv = {k: v for k, v in self.student.config.kvm_conversion.items() if k != "layers"}
            cfg.check(KVMSpec.from_dict(conv), self.rt.world)
        self.student.eval()               # no dropout; gradients still flow
        groups = trainable_parameters(self.student, cfg.lr_qkvo > 0)
        self.trained = _Trained(self.student)
        self.optimizer = torch.optim.AdamW(
            [{"name": name, "params": ps, "lr": lr, "peak_lr": lr, "weight_decay": 0.0, "peak_weight_decay": 0.0}
             for name, ps, lr in (("kvm", groups["kvm"], cfg.lr), ("qkvo", groups["qkvo"], cfg.lr_qkvo)) if ps],
            betas=(0.9, 0.99))
        self.step, self.elapsed = 0, 0.0
        if ckpt is not None:
            self._restore(ckpt)

    # ------------------------------------------------------------------ checkpoints
    def _resume_file(self, resume: bool) -> Optional[Path]:
        found = latest_checkpoint(self.out / "ckpt")
        if not resume:
            if found is not None:
                raise ConfigError(f"{self.out} already holds checkpoints ({found.name}); pass --resume to continue "
                                  "that run, or choose another --out")
            return None
        if found is None:
            raise ConfigError(f"--resume: no checkpoint under {self.out / 'ckpt'}")
        return found

    def _restore(self, path: Path) -> None:
        if self.rt.is_main:
            remove_temp_files(self.out / "ckpt")
        state = load_checkpoint(path)
        saved, now = state["config"], self.cfg.to_dict()
        free = _RESUMABLE + (("stage2_steps",) if state["step"] <= saved["stage1_steps"] else ())
        changed = sorted(k for k in set(saved) | set(now) if k not in free and saved.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"{path} was written by a run with other settings ({', '.join(changed)}: "
                              f"{[saved.get(k) for k in changed]}); resume with the same settings")
        restore_checkpoint(state, self.trained, self.optimizer)
        self.step, self.elapsed = state["step"], state["elapsed"]

    def save(self) -> None:
        extra = {"config": self.cfg.to_dict(), "elapsed": self.elapsed, "world_size": self.rt.world}
        save_checkpoint(self.out / "ckpt", self.step, self.trained, self.optimizer, extra)

    # ------------------------------------------------------------------ steps
    def batch(self, step: int) -> torch.Tensor:
        """This rank's rows of the global batch of ``step``: a fixed function of the step (exact resume); each
        epoch visits every sequence once, in an order drawn from ``seed + epoch``."""
        n, b = len(self.sequences), self.cfg.batch_size
        idx = []
        for j in range(step * b, step * b + b):
            epoch, pos = divmod(j, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
            idx.append(int(perm[pos]))
        return self.sequences[idx[self.rt.rank::self.rt.world]].to(self.rt.device)

    def stage(self, step: int) -> int:
        return 1 if step < self.cfg.stage1_steps else 2

    def train_step(self) -> Tuple[float, float]:
        """One optimiser step at ``self.step``; returns the loss (mean over the global batch) and the lr."""
        cfg, s = self.cfg, self.stage(self.step)
        begin, length = (0, cfg.stage1_steps) if s == 1 else (cfg.stage1_steps, cfg.stage2_steps)
        sched = OptimSection(lr=cfg.lr, warmup_steps=cfg.warmup_steps, decay="cosine", min_lr=cfg.lr / 10,
                             adamc=False)
        lr = apply_schedule(self.optimizer, self.step - begin, length, sched)
        ids = self.batch(self.step)
        if s == 1:
            loss = alignment_loss(self.teacher, self.student, ids, backward_scale=1.0)
        else:
            kl = kl_loss(self.teacher, self.student, ids)
            kl.backward()
            loss = kl.item()
        self._sync_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        (loss,) = self.rt.sum([loss / self.rt.world])
        return loss, lr

    def _sync_grads(self) -> None:
        """Average the trained parameters' gradients over torchrun ranks (each rank ran its own rows)."""
        if not dist.is_initialized():
            return
        for p in self.trained.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= self.rt.world

    # ------------------------------------------------------------------ run
    def run(self) -> Dict[str, Any]:
        cfg, total = self.cfg, self.cfg.total_steps
        if self.rt.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            info = {"settings": cfg.to_dict(), "heldout_documents": self.heldout,
                    "training_sequences": len(self.sequences),
                    "trained_parameters": sum(p.numel() for p in self.trained.parameters())}
            text = json.dumps(info, indent=2) + "\n"
            atomic_write_file(self.out / "distill.json", lambda f: f.write(text.encode()))
        progress = TrainProgress(total, self.step, cfg.log_every, self.rt.is_main, self.log)
        progress.write(f"distill {cfg.teacher} -> {self.out / 'final'}: {len(self.sequences)} training sequences of "
                       f"{cfg.seq_len} tokens (held-out documents {self.heldout}), "
                       f"{sum(p.numel() for p in self.trained.parameters()):,} trained parameters, stage 1 "
                       f"{cfg.stage1_steps} + stage 2 {cfg.stage2_steps} steps of {cfg.batch_size} sequence(s) on "
                       f"{self.rt.world} process(es)"
                       + (f"; resuming at step {self.step}" if self.step else ""))
        summary: Dict[str, Any] = {"out": str(self.out), "stopped_early": False, "losses": []}
        metrics = MetricsLog(self.out, RunConfig(), self.step if self.step else None, self.rt.is_main)
        with StopSignal(self.rt.is_main) as stop, metrics as log:
            while self.step < total:
                t0 = time.perf_counter()
                loss, lr = self.train_step()
                dt = time.perf_counter() - t0
                self.elapsed += dt
                summary["losses"].append(loss)
                tps = cfg.batch_size * cfg.seq_len / dt
                log.row(self.step, loss, lr, tps, None, self.elapsed)
                progress.update(self.step, loss, lr, tps, None)
                if self.step == cfg.stage1_steps and cfg.stage2_steps and cfg.stage1_steps:
                    progress.write(f"stage 1 done (alignment loss {loss:.4f}); stage 2: logit KL")
                end = self.step == total
                stopping = stop.requested is not None and not end
                (stops,) = self.rt.sum([float(stopping)])
                if end or stops > 0 or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                    self.save()
                if stops > 0 and not end:
                    progress.write(f"stopped after step {self.step}; continue with --resume (out {self.out})")
                    summary["stopped_early"] = True
                    break
        progress.close()
        if not summary["stopped_early"]:
            summary["final"] = str(self.export())
            self.log(f"final model: {summary['final']} ({self.step} steps, {self.elapsed:.0f} s of training, "
                     f"{self.step * cfg.batch_size * cfg.seq_len:,} tokens)")
        summary.update(steps=self.step, elapsed_s=self.elapsed)
        return summary

    def export(self) -> Optional[Path]:
        """OUT/final: the student (converted, learned parameters) + the teacher's tokenizer; rank 0 writes."""
        if not self.rt.is_main:
            return None
        final = self.out / "final"
        with atomic_dir(final) as tmp:
            self.student.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        return final


def distill(cfg: DistillConfig, resume: bool = False, log_fn: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run (or resume) ``cfg``; returns ``out``, ``steps``, ``losses`` (this segment's, per step), ``elapsed_s``,
    ``stopped_early`` and ``final`` (the saved model folder)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = Distiller(cfg, resume, log_fn)
    try:
        return d.run()
    finally:
        if d.rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
