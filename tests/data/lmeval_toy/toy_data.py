"""Datasets of the local toy tasks: read the JSONL files beside this file (no download, no cache)."""
import json
from pathlib import Path

import datasets

_HERE = Path(__file__).resolve().parent


def _load(name):
    rows = [json.loads(line) for line in (_HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def toy_mc(**kwargs):
    return _load("toy_mc.jsonl")


def toy_gen(**kwargs):
    return _load("toy_gen.jsonl")
