"""``kvmeans bench longctx``: memory and speed of a transformers causal LM at long context, per arm and length.

    kvmeans bench longctx --model ~/.cache/kvmeans/models/qwen2.5-coder-1.5b --out runs/longctx \\
        --lengths 2048 8192 32768 131072 \\
        --arms full streaming:4+256 kvm:budget=fixed:132,chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32

Arms (:func:`parse_arm`): ``full`` (the model as is: one forward over the prompt, its own KV cache),
``streaming:S+W`` (StreamingLLM: the prompt in segments of ``segment`` tokens under a mask that shows each query
the ``S`` first tokens and the last ``W`` (itself included); after every forward the cache keeps only those keys
and values, positions staying the tokens' own) and ``kvm:SPEC`` (:func:`kvmeans.convert_hf` with ``SPEC``, the
grammar of ``--kvm``; its prefill runs in segments of ``prefill_segment``, ``segment`` unless the spec sets it).

Every (arm, length) runs in a fresh Python process (:func:`run_worker`), so the peak memory it reports is its own
and an arm that runs out of memory takes only its own process down. The worker (:func:`measure`) loads the model
(a folder's weights, or random weights from its config.json: memory and speed do not depend on the weights),
runs a short warm-up (which touches every weight, so memory-mapped weights count as loaded), then times
``model(ids, use_cache=True, logits_to_keep=1)`` on ``batch`` seeded random prompts of ``length`` tokens (time to
first token: until the first token's id is known) and ``decode_tokens`` greedy steps of one token with the cache,
and reads the cache's bytes (:func:`kvmeans.pretrained.cache.cache_nbytes`: a converted layer's state, a plain
layer's keys and values). Peak resident memory of the prefill and of the decode (:class:`PeakRSS`): the kernel's
high-water mark ``VmHWM``, reset at the start of each phase by writing 5 to ``/proc/self/clear_refs``, and a
thread reading ``VmRSS`` every 5 ms (the larger of the two; the thread alone where the reset is refused); reported
above the resident memory after loading and the warm-up. On CUDA also the peak of
``torch.cuda.max_memory_allocated`` above the memory allocated after loading.

A worker killed by SIGKILL (the kernel's OOM killer; exit -9 or 137) or that reports ``MemoryError`` or a
failed allocation is ``oom``; one that gives no result within ``timeout`` seconds is killed and ``timeout``; any
other failure ``error``. Longer lengths of an arm that failed are ``skipped``. Lengths run in increasing order,
the arms interleaved at each length, so a noisy machine slows them alike.

Outputs under ``out`` (atomic, rewritten after every run): ``longctx.csv``, ``longctx.json`` (settings, env,
rows, the workers' raw results), ``longctx.png`` (peak memory, decode time per token and cache bytes vs length).
"""
from __future__ import annotations

import gc
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvmeans.utils.args import UsageError

__all__ = ["ArmSpec", "LongctxConfig", "parse_arm", "parse_arms", "resolve_model", "check_config", "measure",
           "worker_main", "run_worker", "run", "rows_table", "write_outputs", "PeakRSS",
           "DEFAULT_ARMS", "DEFAULT_LENGTHS", "DEFAULT_KVM"]

DEFAULT_KVM = "budget=fixed:132,chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32"
DEFAULT_ARMS = ("full", "streaming:4+256", f"kvm:{DEFAULT_KVM}")       # 260 kept keys for both compressed arms
DEFAULT_LENGTHS = (2048, 8192, 32768, 131072)
DTYPES = ("float32", "bfloat16", "float16", "auto")
FAILED = ("oom", "timeout", "error")
RESULT_TAG = "KVMEANS_LONGCTX_RESULT "
# Test hook: "LABEL@LENGTH=ACTION[;...]" makes that worker fail at its start (kill: SIGKILL itself, as the OOM
# killer does; memory: raise MemoryError; error: raise RuntimeError; hang: sleep). LABEL * matches every arm.
INJECT_ENV = "KVMEANS_LONGCTX_INJECT"
WARMUP_TOKENS = 64
_MB = 2 ** 20
_ROOT = Path(__file__).resolve().parents[2]


# ---- arms and settings ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArmSpec:
    """One arm: ``label`` as the user wrote it; ``kind`` full, streaming (``sinks`` + ``window``) or kvm
    (``spec``: the ``--kvm`` text, parsed again in the worker)."""
    label: str
    kind: str
    sinks: Optional[int] = None
    window: Optional[int] = None
    spec: Optional[str] = None


_ARM_FORMS = "full, streaming:S+W (S sink tokens + the last W tokens) or kvm:SPEC (the grammar of --kvm)"


def parse_arm(text: str) -> ArmSpec:
    """``full``, ``streaming:S+W`` or ``kvm:SPEC`` -> :class:`ArmSpec`; a :class:`UsageError` naming ``--arms``."""
    kind, colon, rest = text.partition(":")
    if text == "full":
        return ArmSpec(text, "full")
    if kind == "streaming" and colon:
        s, plus, w = rest.partition("+")
        if not (plus and s.isdigit() and w.isdigit()) or int(w) < 1:
            raise UsageError(f"--arms {text}: streaming takes S+W, S >= 0 sink tokens and W >= 1 recent tokens "
                             "(e.g. streaming:4+256)")
        return ArmSpec(text, "streaming", int(s), int(w))
    if kind == "kvm" and (colon or text == "kvm"):
        from kvmeans.pretrained.convert import parse_kvm_spec
        try:
            parse_kvm_spec(rest)
        except ValueError as err:
            raise UsageError(f"--arms {text}: {err}".replace("--kvm item", "item")) from None
        return ArmSpec(text, "kvm", spec=rest)
    hint = ("; give the arms as separate arguments (a kvm spec has commas of its own): "
            "--arms full streaming:4+256 kvm:SPEC") if "," in text and kind != "kvm" else ""
    raise UsageError(f"--arms {text!r}: unknown arm; use {_ARM_FORMS}{hint}")


def parse_arms(texts: Sequence[str]) -> List[ArmSpec]:
    arms = [parse_arm(t) for t in texts]
    if not arms:
        raise UsageError(f"--arms: give at least one arm ({_ARM_FORMS})")
    seen = set()
    for a in arms:
        if a.label in seen:
            raise UsageError(f"--arms {a.label}: given twice")
        seen.add(a.label)
    return arms


def resolve_model(text: str) -> Tuple[str, bool]:
    """``--model``: a model folder -> ``(folder, False)``; ``config:DIR_OR_NAME`` -> ``(folder, True)``: random
    weights from the config.json of DIR, else of ``kvmeans models fetch``'s folder of NAME. A :class:`UsageError`
    naming ``--model`` for a missing config.json or a model that is KVM already."""
    random = text.startswith("config:")
    name = text[len("config:"):] if random else text
    if random:
        if not name:
            raise UsageError("--model config:: give a folder with a config.json or a fetched model's name after "
                             "config: (e.g. config:qwen2.5-coder-1.5b)")
        from kvmeans.pretrained.fetch import model_dir
        places = [Path(name).expanduser()]
        if "/" not in name and os.sep not in name:          # a name: also the folder kvmeans models fetch fills
            places.append(model_dir(name))
        folder = next((p for p in places if (p / "config.json").is_file()), None)
        if folder is None:
            raise UsageError(f"--model {text}: no config.json in {' nor in '.join(map(str, places))}; give a "
                             f"folder with a config.json, or a model fetched with kvmeans models fetch NAME")
    else:
        from kvmeans.utils.args import check_model_dir
        folder = Path(name).expanduser()
        check_model_dir(str(folder))
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {text}: cannot read {folder / 'config.json'} ({err})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UsageError(f"--model {text}: {folder / 'config.json'} has no model_type; give a transformers model")
    from kvmeans.pretrained.convert import CONFIG_KEY
    if raw.get(CONFIG_KEY) or raw["model_type"] in ("kvm", "kvm_reference"):
        raise UsageError(f"--model {text}: a KVM model already; give the plain transformers model (the kvm arms "
                         "convert it)")
    return str(folder), random


@dataclass
class LongctxConfig:
    """What :func:`run` measures (the flags of ``kvmeans bench longctx``)."""
    model: str                        # a folder, or config:DIR_OR_NAME
    out: str
    arms: List[ArmSpec] = field(default_factory=lambda: parse_arms(DEFAULT_ARMS))
    lengths: List[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    decode_tokens: int = 16
    batch: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    threads: Optional[int] = None
    segment: int = 256
    seed: int = 0
    timeout: float = 1800.0
    generate: bool = False            # through model.generate (batch 1; full and kvm arms)


def check_config(c: LongctxConfig) -> Tuple[str, bool]:
    """Every user mistake in ``c`` as a :class:`UsageError` naming its flag, before any run; returns
    :func:`resolve_model`'s ``(folder, random)``."""
    from kvmeans.utils.args import check_device, check_out_dir
    if not c.lengths or min(c.lengths) < 1:
        raise UsageError(f"--lengths must be >= 1, got {min(c.lengths) if c.lengths else 'none'}")
    for flag, v, least in (("--decode-tokens", c.decode_tokens, 1), ("--batch", c.batch, 1),
                           ("--segment", c.segment, 1), ("--threads", c.threads, 1)):
        if v is not None and v < least:
            raise UsageError(f"{flag} must be >= {least}, got {v}")
    if c.generate and (c.batch != 1 or any(a.kind == "streaming" for a in c.arms)):
        raise UsageError("--generate: runs model.generate on one prompt; use --batch 1 and the full and kvm arms "
                         "(StreamingLLM evicts by a mask generate does not apply)")
    if not c.timeout > 0 or not math.isfinite(c.timeout):
        raise UsageError(f"--timeout must be a positive number of seconds, got {c.timeout}")
    if c.dtype not in DTYPES:
        raise UsageError(f"--dtype {c.dtype}: use one of {', '.join(DTYPES)}")
    check_device("--device", c.device)
    check_out_dir("--out", c.out)
    folder, random = resolve_model(c.model)
    if any(a.kind == "kvm" for a in c.arms):
        from kvmeans.pretrained.convert import FAMILIES
        model_type = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))["model_type"]
        if model_type not in FAMILIES:
            raise UsageError(f"--arms kvm: convert_hf supports model_type in {sorted(FAMILIES)}; {c.model} is "
                             f"{model_type!r}")
    return folder, random


# ---- memory probes --------------------------------------------------------------------------------------------
def _status_kb(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> Optional[int]:
    """Resident memory of this process now (``VmRSS``); None where ``/proc`` has no such file."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def anon_bytes() -> Optional[int]:
    """Anonymous resident memory of this process now (``RssAnon``: its own allocations, not the pages of files it
    maps, such as memory-mapped weights, which the kernel may drop and read again); None where unavailable."""
    kb = _status_kb("RssAnon")
    return None if kb is None else kb * 1024


def ru_maxrss_bytes() -> int:
    """The process's peak resident memory since it started (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS; False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """The peak resident memory of this process over a ``with`` block (``peak``, bytes; None without ``/proc``):
    the larger of the kernel's high-water mark (reset at entry, where the kernel allows it) and a thread reading
    ``VmRSS`` every ``interval`` seconds (it runs while torch kernels release the GIL). ``anon``: the peak of
    ``RssAnon`` the thread read (no file pages: memory-mapped weights that the kernel evicts under memory pressure
    and reads back move ``VmRSS`` but not this)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak: Optional[int] = None
        self.sampled: Optional[int] = None
        self.hwm: Optional[int] = None
        self.anon: Optional[int] = None

    def _read(self) -> None:
        now, anon = rss_bytes(), anon_bytes()
        if now is not None:
            self.sampled = max(self.sampled or 0, now)
        if anon is not None:
            self.anon = max(self.anon or 0, anon)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()

    def __enter__(self) -> "PeakRSS":
        self.hwm_reset = _reset_hwm()
        self.sampled, self.anon = rss_bytes(), anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self.sampled is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._read()
        kb = _status_kb("VmHWM") if self.hwm_reset else None
        self.hwm = None if kb is None else kb * 1024
        found = [v for v in (self.sampled, self.hwm) if v is not None]
        self.peak = max(found) if found else None


# ---- the worker -----------------------------------------------------------------------------------------------
def _inject(label: str, length: int) -> None:
    for item in filter(None, os.environ.get(INJECT_ENV, "").split(";")):
        where, _, action = item.rpartition("=")
        arm, _, at = where.rpartition("@")
        if arm in (label, "*") and at == str(length):
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "memory":
                raise MemoryError(f"{INJECT_ENV}: injected")
            if action == "hang":
                time.sleep(3600)
            raise RuntimeError(f"{INJECT_ENV}: injected failure")


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(s: Dict[str, Any], device):
    """The model of settings ``s`` on ``device`` in eval mode: the folder's weights, or (``random``) weights drawn
    with seed ``s["seed"]`` from its config, built on ``device`` directly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    dtype = None if s["dtype"] == "auto" else getattr(torch, s["dtype"])
    if not s["random"]:                 # a plain transformers folder (resolve_model checked it)
        from kvmeans.utils.weights import named_weight_errors
        with named_weight_errors(s["model"]):
            model = AutoModelForCausalLM.from_pretrained(s["model"], dtype="auto" if dtype is None else dtype)
        return model.to(device).eval()
    cfg = AutoConfig.from_pretrained(s["model"])
    torch.manual_seed(s["seed"])
    with device:
        model = AutoModelForCausalLM.from_config(cfg, **({} if dtype is None else {"dtype": dtype}))
    return model.to(device).eval()


def _kvm_settings(spec: str, segment: int) -> dict:
    from kvmeans.pretrained.convert import parse_kvm_spec
    settings = parse_kvm_spec(spec)
    settings.setdefault("prefill_segment", segment)
    return settings


class _Plain:
    """``full`` and ``kvm`` arms: the model's own forward (a converted model segments its prefill itself)."""

    def __init__(self, model):
        self.model, self.cache = model, None

    def __call__(self, ids):
        from kvmeans.models.hf_compat import cache_from, cache_kwargs
        kw = {} if self.cache is None else cache_kwargs(self.cache)
        out = self.model(ids, use_cache=True, logits_to_keep=1, **kw)
        self.cache = cache_from(out)
        return out.logits[:, -1]

    def prefill(self, ids, segment: int):
        return self(ids)


class _Streaming:
    """StreamingLLM: a query at position p sees the keys at positions < ``sinks`` and in (p - ``window``, p];
    after every forward the cache keeps only the keys and values the next query can see (every layer)."""

    def __init__(self, model, sinks: int, window: int):
        import torch
        from transformers import DynamicCache
        self.model, self.sinks, self.window = model, sinks, window
        self.cache = DynamicCache(config=model.config)
        self.key_pos = torch.zeros(0, dtype=torch.long)
        self.pos = 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def __call__(self, ids):
        import torch

        from kvmeans.models.hf_compat import cache_kwargs
        n = ids.shape[1]
        qpos = torch.arange(self.pos, self.pos + n)
        self.key_pos = torch.cat([self.key_pos, qpos])
        k, q = self.key_pos[None, :], qpos[:, None]
        see = (k <= q) & ((k < self.sinks) | (k > q - self.window))
        mask = torch.zeros(see.shape, dtype=self.dtype).masked_fill_(~see, torch.finfo(self.dtype).min)
        out = self.model(input_ids=ids, position_ids=qpos[None].expand(ids.shape[0], n).to(self.device),
                         attention_mask=mask[None, None].to(self.device), use_cache=True, logits_to_keep=1,
                         **cache_kwargs(self.cache))
        self.pos += n
        keep = ((self.key_pos < self.sinks) | (self.key_pos > self.pos - self.window)).nonzero().squeeze(1)
        if len(keep) < len(self.key_pos):
            for layer in self.cache.layers:
                idx = keep.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
            self.key_pos = self.key_pos[keep]
        return out.logits[:, -1]

    def prefill(self, ids, segment: int):
        for s in range(0, ids.shape[1], segment):
            logits = self(ids[:, s:s + segment])
        return logits


def _runner(model, arm: Dict[str, Any]):
    return _Streaming(model, arm["sinks"], arm["window"]) if arm["kind"] == "streaming" else _Plain(model)


def _touch_weights(model) -> None:
    """Read every parameter and buffer once, so that memory-mapped weights are resident before the baseline is
    taken. Without it the embedding table's pages come in only for the token ids a prompt uses (and the kernel's
    readahead around them), which shows as RSS growing with the prompt although it is the model's own file."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel() and t.is_floating_point():     # one element per KiB: every 4 KiB page is read
            t.detach().reshape(-1)[:: max(1, 1024 // t.element_size())].sum().item()


def _cache_bytes(cache) -> Tuple[int, Dict[str, int]]:
    from kvmeans.pretrained.cache import cache_nbytes, cache_nbytes_by_kind
    return cache_nbytes(cache), cache_nbytes_by_kind(cache)


def measure(s: Dict[str, Any]) -> Dict[str, Any]:
    """One (arm, length) in this process (settings ``s``: see :func:`_settings`); the result's fields are
    described in docs/benchmarks.md. Raises what the model raises."""
    import torch

    from kvmeans.utils.heap import heap_setting
    arm = s["arm"]
    if s.get("threads"):
        torch.set_num_threads(s["threads"])
    device = torch.device(s["device"])
    t0 = time.perf_counter()
    model = _load(s, device)
    if arm["kind"] == "kvm":
        from kvmeans.pretrained.convert import convert_hf
        convert_hf(model, **_kvm_settings(arm["spec"], s["segment"]))
    load_s = time.perf_counter() - t0
    gc.collect()
    rss_model = rss_bytes()
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    B, T = s["batch"], s["length"]
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(s["seed"])).to(device)
    cuda = device.type == "cuda"
    with torch.no_grad():
        _touch_weights(model)
        warm = _runner(model, arm)            # first-call costs out of the timings
        nxt = warm.prefill(ids[:, :min(T, WARMUP_TOKENS)], s["segment"]).argmax(-1, keepdim=True)
        warm(nxt)
        del warm, nxt
        gc.collect()
        _sync(device)
        rss_loaded, anon_loaded = rss_bytes(), anon_bytes()
        ru_maxrss = ru_maxrss_bytes()     # the peak through loading and warm-up (PeakRSS resets it below)
        gpu_loaded = torch.cuda.memory_allocated(device) if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if s.get("generate"):
            return _measure_generate(s, model, ids, rss_model, rss_loaded, anon_loaded, load_s)
        run = _runner(model, arm)
        with PeakRSS() as pre:
            t0 = time.perf_counter()
            nxt = run.prefill(ids, s["segment"]).argmax(-1, keepdim=True)
            _sync(device)
            ttft = time.perf_counter() - t0
        gpu_prefill = torch.cuda.max_memory_allocated(device) if cuda else None
        cache_bytes, by_kind = _cache_bytes(run.cache)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        steps = []
        with PeakRSS() as dec:
            for _ in range(s["decode_tokens"]):
                t0 = time.perf_counter()
                nxt = run(nxt).argmax(-1, keepdim=True)
                _sync(device)
                steps.append(time.perf_counter() - t0)
        gpu_decode = torch.cuda.max_memory_allocated(device) if cuda else None
        cache_end, _ = _cache_bytes(run.cache)
    step = statistics.median(steps[1:] if len(steps) > 1 else steps)
    peaks = [p for p in (pre.peak, dec.peak) if p is not None]
    anon_peaks = [p for p in (pre.anon, dec.anon) if p is not None]

    def above(x, base):
        return None if x is None or base is None else x - base
    return {
        "status": "ok", "arm": arm["label"], "kind": arm["kind"], "length": T, "batch": B,
        "threads": torch.get_num_threads(), "device": str(device), "dtype": str(next(model.parameters()).dtype),
        "random_weights": s["random"], "load_s": load_s,
        "rss_model_bytes": rss_model, "rss_loaded_bytes": rss_loaded,
        "peak_prefill_bytes": pre.peak, "peak_decode_bytes": dec.peak,
        "peak_prefill_hwm_bytes": pre.hwm, "peak_prefill_sampled_bytes": pre.sampled, "hwm_reset": pre.hwm_reset,
        "peak_above_model_bytes": above(max(peaks) if peaks else None, rss_loaded),
        "anon_loaded_bytes": anon_loaded,
        "peak_anon_above_model_bytes": above(max(anon_peaks) if anon_peaks else None, anon_loaded),
        "ru_maxrss_load_bytes": ru_maxrss,
        "gpu_loaded_bytes": gpu_loaded,
        "gpu_peak_above_model_bytes": above(max(gpu_prefill, gpu_decode), gpu_loaded) if cuda else None,
        "ttft_s": ttft, "prefill_tok_s": B * T / ttft,
        "decode_step_s": steps, "decode_ms_per_tok": 1000 * step, "decode_tok_s": B / step,
        "cache_bytes": cache_bytes, "cache_bytes_by_kind": by_kind, "cache_bytes_end": cache_end,
        "heap": heap_setting(),
    }


def _measure_generate(s, model, ids, rss_model, rss_loaded, anon_loaded, load_s) -> Dict[str, Any]:
    """``model.generate`` on the prompt, greedy, ``decode_tokens + 1`` new tokens, nothing set for long prompts:
    time to the first token and per token from a streamer's arrival times, peak RSS over the whole call."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from kvmeans.models.hf_compat import cache_from
    from kvmeans.utils.heap import heap_setting
    stamps: List[float] = []

    class Stamps(BaseStreamer):                 # put() gets the prompt first, then each new token
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with PeakRSS() as peak:
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s["decode_tokens"] + 1,
                             min_new_tokens=s["decode_tokens"] + 1, do_sample=False, pad_token_id=0,
                             streamer=Stamps(), return_dict_in_generate=True)
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    step = statistics.median(steps[1:] if len(steps) > 1 else steps)
    cache_bytes, by_kind = _cache_bytes(cache_from(out))
    return {"status": "ok", "arm": s["arm"]["label"], "kind": s["arm"]["kind"], "length": ids.shape[1], "batch": 1,
            "threads": torch.get_num_threads(), "device": str(ids.device), "via": "generate",
            "dtype": str(next(model.parameters()).dtype), "random_weights": s["random"], "load_s": load_s,
            "rss_model_bytes": rss_model, "rss_loaded_bytes": rss_loaded, "peak_prefill_bytes": peak.peak,
            "peak_decode_bytes": None, "peak_above_model_bytes": None if peak.peak is None or rss_loaded is None
            else peak.peak - rss_loaded, "gpu_peak_above_model_bytes": None, "anon_loaded_bytes": anon_loaded,
            "peak_anon_above_model_bytes": None if peak.anon is None or anon_loaded is None
            else peak.anon - anon_loaded,
            "ttft_s": stamps[1] - t0, "prefill_tok_s": ids.shape[1] / (stamps[1] - t0), "decode_step_s": steps,
            "decode_ms_per_tok": 1000 * step, "decode_tok_s": 1 / step, "cache_bytes": cache_bytes,
            "cache_bytes_by_kind": by_kind, "cache_bytes_end": cache_bytes, "heap": heap_setting()}


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def worker_main(settings_json: str) -> int:
    """The worker process: :func:`measure` the settings, print one line ``RESULT_TAG + json`` (also for a
    failure: ``status`` oom or error, ``error`` its message, ``traceback``)."""
    s = json.loads(settings_json)
    try:
        _inject(s["arm"]["label"], s["length"])
        result = measure(s)
    except Exception as err:                  # MemoryError included
        head = (str(err).strip().splitlines() or [""])[0]
        result = {"status": "oom" if _is_oom(err) else "error", "error": f"{type(err).__name__}: {head}"[:500],
                  "traceback": traceback.format_exc()[-4000:]}
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


_WORKER = "import sys; from kvmeans.bench.longctx import worker_main; sys.exit(worker_main(sys.argv[1]))"


def run_worker(settings: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """:func:`worker_main` in a fresh ``sys.executable`` process; its result, or a ``timeout`` / ``oom`` (killed
    by SIGKILL) / ``error`` result when it gives none. ``wall_s``: the process's whole time."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    if settings.get("threads"):
        env["OMP_NUM_THREADS"] = str(settings["threads"])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(settings)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout:g} s (killed)",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if lines:
        return {**json.loads(lines[-1][len(RESULT_TAG):]), "wall_s": wall}
    tail = proc.stderr.strip().splitlines()[-20:]
    if proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return {"status": "oom", "error": f"killed by SIGKILL (exit {proc.returncode}): the kernel's OOM killer, "
                "most likely", "stderr_tail": tail, "wall_s": wall}
    return {"status": "error", "error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"[:500],
            "stderr_tail": tail, "wall_s": wall}


# ---- the driver -----------------------------------------------------------------------------------------------
def _settings(c: LongctxConfig, folder: str, random: bool, arm: ArmSpec, length: int) -> Dict[str, Any]:
    return {"model": folder, "random": random, "arm": asdict(arm), "length": length, "batch": c.batch,
            "decode_tokens": c.decode_tokens, "dtype": c.dtype, "device": c.device, "threads": c.threads,
            "segment": c.segment, "seed": c.seed, "generate": c.generate}


def _mb(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x / _MB, 3)


def _row(arm: ArmSpec, length: int, r: Dict[str, Any]) -> Dict[str, Any]:
    by_kind = r.get("cache_bytes_by_kind") or {}
    return {"arm": arm.label, "kind": arm.kind, "length": length, "status": r["status"],
            "peak_rss_above_model_mb": _mb(r.get("peak_above_model_bytes")),
            "peak_anon_above_model_mb": _mb(r.get("peak_anon_above_model_bytes")),
            "peak_prefill_rss_mb": _mb(r.get("peak_prefill_bytes")),
            "peak_decode_rss_mb": _mb(r.get("peak_decode_bytes")),
            "rss_model_mb": _mb(r.get("rss_model_bytes")), "rss_loaded_mb": _mb(r.get("rss_loaded_bytes")),
            "peak_load_rss_mb": _mb(r.get("ru_maxrss_load_bytes")),
            "gpu_peak_above_model_mb": _mb(r.get("gpu_peak_above_model_bytes")),
            "ttft_s": r.get("ttft_s"), "prefill_tok_s": r.get("prefill_tok_s"),
            "decode_ms_per_tok": r.get("decode_ms_per_tok"), "decode_tok_s": r.get("decode_tok_s"),
            "cache_bytes": r.get("cache_bytes"), "cache_mb": _mb(r.get("cache_bytes")),
            **{f"cache_{k}_bytes": by_kind.get(k) for k in ("sinks", "rows", "reserve", "window", "recording", "kv")},
            "heap": r.get("heap"), "load_s": r.get("load_s"), "wall_s": r.get("wall_s"), "error": r.get("error")}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def rows_table(rows: Sequence[Dict[str, Any]], arms: Sequence[ArmSpec]) -> str:
    """The printed table: one line per arm and length (arms in the given order, lengths increasing)."""
    from kvmeans.bench.report import format_table
    order = {a.label: i for i, a in enumerate(arms)}
    gpu = any(r.get("gpu_peak_above_model_mb") is not None for r in rows)
    head = ["arm", "length", "peak RSS above model MB", "anon MB"] + (["peak GPU above model MB"] if gpu else []) + \
        ["TTFT s", "prefill tok/s", "decode ms/tok", "tok/s", "cache MB", "status"]
    body = []
    for r in sorted(rows, key=lambda r: (order.get(r["arm"], len(order)), r["length"])):
        body.append([r["arm"], r["length"], _fmt(r["peak_rss_above_model_mb"], ".1f"),
                     _fmt(r.get("peak_anon_above_model_mb"), ".1f")]
                    + ([_fmt(r["gpu_peak_above_model_mb"], ".1f")] if gpu else [])
                    + [_fmt(r["ttft_s"], ".3f"), _fmt(r["prefill_tok_s"], ".0f"), _fmt(r["decode_ms_per_tok"], ".2f"),
                       _fmt(r["decode_tok_s"], ".1f"), _fmt(r["cache_mb"], ".3f"), r["status"]])
    return format_table(head, body)


def _plot(path: Path, rows: Sequence[Dict[str, Any]], arms: Sequence[ArmSpec], title: str) -> Optional[Path]:
    from kvmeans.bench.report import plot_panels
    gpu = any(r.get("gpu_peak_above_model_mb") is not None for r in rows)
    panels = [("peak_rss_above_model_mb", "peak RSS above the loaded model", "MB")]
    if gpu:
        panels.append(("gpu_peak_above_model_mb", "peak GPU memory above the loaded model", "MB"))
    panels += [("decode_ms_per_tok", "decode time per token", "ms / token"),
               ("cache_mb", "cache after the prompt", "MB")]
    out = []
    for key, name, unit in panels:
        series = {}
        for a in arms:
            mine = sorted((r for r in rows if r["arm"] == a.label), key=lambda r: r["length"])
            bad = next((r for r in mine if r["status"] in FAILED), None)
            label = a.label if len(a.label) <= 48 else a.label[:45] + "..."
            if bad is not None:
                label += f" ({bad['status']} at {bad['length']})"
            ok = [r for r in mine if r["status"] == "ok"]
            series[label] = ([r["length"] for r in ok], [r[key] for r in ok])
        out.append({"title": name, "ylabel": unit, "xlabel": "prompt length (tokens)", "series": series})
    return plot_panels(path, out, title=title, ncols=len(out))


def write_outputs(out: Path, settings: Dict[str, Any], env: Dict[str, Any], rows: List[Dict[str, Any]],
                  runs: List[Dict[str, Any]], arms: Sequence[ArmSpec], plot: bool = True) -> None:
    """``longctx.csv``, ``longctx.json`` and (``plot``) ``longctx.png`` under ``out``, atomically."""
    from kvmeans.bench.report import write_csv, write_json
    fields = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(out / "longctx.csv", fields, rows)
    write_json(out / "longctx.json", {"settings": settings, "env": env, "rows": rows, "runs": runs})
    if plot and rows:
        title = (f"kvmeans bench longctx: {Path(settings['model_folder']).name}"
                 f"{' (random weights)' if settings['random_weights'] else ''}, {settings['dtype']}, "
                 f"{settings['device']}, batch {settings['batch']}, threads {settings['threads'] or 'default'}")
        _plot(out / "longctx.png", rows, arms, title)


def run(c: LongctxConfig, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Every arm at every length (increasing lengths, arms interleaved), each in its own process; the outputs
    rewritten after every run. Returns the rows."""
    folder, random = check_config(c)
    from kvmeans.bench.report import env_info, format_env
    lengths = sorted(set(c.lengths))
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    env = env_info(c.device)
    log(format_env(env))
    settings = {**{k: v for k, v in asdict(c).items() if k != "arms"}, "arms": [a.label for a in c.arms],
                "lengths": lengths, "model_folder": folder, "random_weights": random}
    rows: List[Dict[str, Any]] = []
    runs: List[Dict[str, Any]] = []
    failed: Dict[str, Dict[str, Any]] = {}
    total, n = len(lengths) * len(c.arms), 0
    try:
        import matplotlib  # noqa: F401
        plot = True
    except ImportError:
        log("note: matplotlib is not installed, skipping longctx.png (pip install matplotlib)")
        plot = False
    for length in lengths:
        for arm in c.arms:
            n += 1
            if arm.label in failed:
                prev = failed[arm.label]
                r = {"status": "skipped", "error": f"{prev['status']} at length {prev['length']}"}
            else:
                r = run_worker(_settings(c, folder, random, arm, length), c.timeout)
                if r["status"] in FAILED:
                    failed[arm.label] = {"status": r["status"], "length": length}
            runs.append({"arm": arm.label, "length": length, **r})
            rows.append(_row(arm, length, r))
            done = rows[-1]
            if done["status"] == "ok":
                anon = _fmt(done.get("peak_anon_above_model_mb"), ".1f")
                what = (f"ttft {done['ttft_s']:.3f} s, decode {done['decode_ms_per_tok']:.2f} ms/tok, peak "
                        f"+{_fmt(done['peak_rss_above_model_mb'], '.1f')} MB (anon +{anon}), "
                        f"cache {done['cache_mb']:.3f} MB")
            else:
                what = done["error"] or ""
            log(f"[{n}/{total}] {arm.label} @ {length}: {done['status']} ({what})")
            write_outputs(out, settings, env, rows, runs, c.arms, plot)
    return rows

