"""convert_hf(model) with no settings: the calibration pass (kvmeans.pretrained.calibrate) picks the split of the
kept keys with the lowest loss (near ties: the most exact rows), records it, and a saved model reloads with it."""
import json
import math

import pytest
import torch

tf = pytest.importorskip("transformers")
from kvmeans.ops.budget import StateBudget  # noqa: E402
from kvmeans.pretrained.calibrate import (  # noqa: E402
    CANDIDATES,
    Split,
    calibrate,
    calibration_windows,
    choose,
    split_settings,
)
from kvmeans.pretrained.convert import KVMSpec, convert_hf, load_converted, parse_kvm_spec  # noqa: E402


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return tf.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("keys", [64, 100, 260, 1024])
@pytest.mark.parametrize("split", CANDIDATES, ids=lambda s: s.name)
def test_split_spends_exactly_the_kept_keys(split, keys):
    s = split_settings(split, keys)
    window = s["n_bswa_chunks"] * s["chunk_len"]
    assert window + s["budget"].n == keys
    assert s["n_bswa_chunks"] >= 1 and s["budget"].n >= s["chunk_len"]
    assert 0 <= s["exact_rows"] <= s["budget"].n - s["chunk_len"]
    KVMSpec(**s)            # valid settings


def test_split_refuses_too_few_keys():
    with pytest.raises(ValueError, match="keys=40 cannot hold"):
        split_settings(Split(32, 0.5, 0.0), 40)


def test_choose_breaks_near_ties_by_exact_rows():
    """The lowest tail loss wins, except that a split within 1% of it with more exact rows is preferred; beyond
    1% the exact rows do not matter."""
    names = [c.name for c in CANDIDATES]          # C32-w0.50-e0.00 ... C16-w0.75-e0.75
    nll = dict.fromkeys(names, 3.5)
    assert choose([{"split": n, "nll": nll[n]} for n in names], 260) == "C16-w0.75-e0.75"   # all tied: most exact
    first6 = names[:6]                            # the candidates before C16-w0.75-e0.75 (51 exact rows)
    assert choose([{"split": n, "nll": nll[n]} for n in first6], 260) == "C32-w0.50-e0.25"
    far = {**nll, "C16-w0.88-e0.00": 3.4}                                        # 10% lower: a clear winner
    assert choose([{"split": n, "nll": far[n]} for n in names], 260) == "C16-w0.88-e0.00"
    near = {**far, "C16-w0.88-e0.45": 3.4 + math.log(1.009)}                     # within 1%, 16 exact rows
    assert choose([{"split": n, "nll": near[n]} for n in names], 260) == "C16-w0.88-e0.45"
    out = {**far, "C16-w0.88-e0.45": 3.4 + math.log(1.011)}                      # just beyond 1%
    assert choose([{"split": n, "nll": out[n]} for n in names], 260) == "C16-w0.88-e0.00"


def test_calibrate_keeps_the_rules_choice_and_leaves_the_model_alone():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    cands = (Split(8, 0.5, 0.0), Split(8, 0.75, 0.0), Split(8, 0.5, 0.5))
    chosen = calibrate(model, 48, convert=convert_hf, windows=ids, candidates=cands, progress=False)
    rec = chosen.pop("calibration")
    assert [c["split"] for c in rec["candidates"]] == [c.name for c in cands]
    best = next(c for c in rec["candidates"] if c["split"] == choose(
        [{"split": c["split"], "nll": math.log(c["tail_ppl"])} for c in rec["candidates"]], 48, cands))
    assert rec["chosen"] == best["split"] and "most exact rows" in rec["rule"]
    assert chosen == split_settings(next(c for c in cands if c.name == best["split"]), 48)
    # the recorded loss is the converted model's on the tokens past the kept keys
    from kvmeans.pretrained.arms import token_nll
    trial = convert_hf(tiny(), **chosen)
    nll = torch.cat([token_nll(trial, w[None])[0, 48:] for w in ids]).double().mean().item()
    assert math.exp(nll) == pytest.approx(best["tail_ppl"], rel=1e-3)
    assert not hasattr(model.config, "kvm_conversion")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bare_convert_calibrates_records_and_reloads(tmp_path):
    ids = torch.randint(0, 97, (2, 300), generator=torch.Generator().manual_seed(2))
    model = convert_hf(tiny(), calibration=ids)
    conv = model.config.kvm_conversion
    assert conv["calibration"]["chosen"] in {c.name for c in CANDIDATES}
    assert conv["calibration"]["keys"] == 260
    assert conv["budget"]["n"] + conv["n_bswa_chunks"] * conv["chunk_len"] == 260
    # per-head budgets come with the automatic setting (measured on the calibration ids here), after the split
    # was chosen with equal ones; "uniform" opts out and picks the same split
    heads = conv["exact_heads"]
    assert heads is None if not conv["exact_rows"] else (len(heads) == 2 and all(len(r) == 2 for r in heads))
    uniform = convert_hf(tiny(), calibration=ids, exact_heads="uniform").config.kvm_conversion
    assert uniform["exact_heads"] is None and uniform["calibration"]["chosen"] == conv["calibration"]["chosen"]
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["kvm_conversion"]
    assert stored["calibration"] == conv["calibration"]
    again = load_converted(tmp_path).eval()
    assert again.config.kvm_conversion == conv
    x = torch.randint(0, 97, (1, 400))
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, model(x).logits)


def test_a_named_split_in_a_spec_string_converts_at_its_sizes_without_calibrating():
    """``--kvm auto:NAME[,keys=N]`` (every command reading a spec string): the calibration split ``NAME`` spent at
    ``N`` kept keys (default 260), other settings kept, no calibration pass; ``auto,keys=N`` calibrates at N."""
    from kvmeans.pretrained.calibrate import split_named
    spec = parse_kvm_spec("auto:C16-w0.75-e0.75,exact_scope=first")
    assert spec == {**split_settings(split_named("C16-w0.75-e0.75"), 260), "exact_scope": "first",
                    "exact_heads": "copy"}          # the automatic setting's per-head budgets
    assert parse_kvm_spec("auto:C32-w0.50-e0.25,keys=96,exact_heads=uniform") == {
        **split_settings(split_named("C32-w0.50-e0.25"), 96), "exact_heads": "uniform"}
    m = convert_hf(tiny(), **parse_kvm_spec("auto:C32-w0.50-e0.25,keys=96,exact_heads=uniform"))     # no tokenizer
    conv = m.config.kvm_conversion
    assert "calibration" not in conv
    assert (conv["chunk_len"], conv["n_bswa_chunks"], conv["budget"]["n"], conv["exact_rows"]) == (32, 2, 32, 0)
    ids = torch.randint(0, 97, (2, 160), generator=torch.Generator().manual_seed(3))
    m = convert_hf(tiny(), calibration=ids, **parse_kvm_spec("auto,keys=64"))
    assert m.config.kvm_conversion["calibration"]["keys"] == 64
    for bad, msg in (("auto:C99-w0.10-e0.00", "no calibration split called 'C99-w0.10-e0.00'; give one of C32"),
                     ("auto:C16-w0.75-e0.75,exact_rows=3", "sets budget, .* itself; drop exact_rows"),
                     ("auto,auto:C16-w0.75-e0.75", "give one of auto or auto:NAME"),
                     ("keys=64", "keys=N goes with auto"),
                     ("auto:C16-w0.75-e0.75,keys=-1", "keys must be one non-negative integer"),
                     ("auto:C32-w0.50-e0.00,keys=40", "keys=40 cannot hold")):
        with pytest.raises(ValueError, match=msg):
            parse_kvm_spec(bad)


def test_settings_skip_calibration_and_calibrate_false_takes_defaults():
    m = convert_hf(tiny(), budget=StateBudget.fixed(64))
    assert "calibration" not in m.config.kvm_conversion
    m = convert_hf(tiny(), calibrate=False)
    assert "calibration" not in m.config.kvm_conversion
    assert m.config.kvm_conversion["n_bswa_chunks"] == KVMSpec().n_bswa_chunks


def test_calibration_needs_token_ids_or_a_tokenizer():
    with pytest.raises(ValueError, match="calibration needs token ids"):
        convert_hf(tiny())


def test_calibration_windows_mix_plays_and_code(llama_dir):
    tok = tf.AutoTokenizer.from_pretrained(llama_dir)
    w = calibration_windows(tok, 256)
    assert w.shape == (2, 256)
    plays, code = (tok.decode(x) for x in w)
    assert "def " in code or "import " in code or "self." in code
    assert "def " not in plays


def test_the_code_text_is_frozen_and_checked(monkeypatch, tmp_path):
    """The code half of the calibration text is the shipped snapshot, not the installed source (an edit of the
    package moved the automatic choice); a damaged snapshot is refused; a rebuild at its commit is identical."""
    import gzip
    import json
    import runpy
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace

    import kvmeans.pretrained.calibrate as cal
    script = Path(cal.__file__).resolve().parents[1] / "eval" / "data" / "build_calibration_code.py"
    build = SimpleNamespace(**runpy.run_path(str(script)))
    text = cal._package_source()
    assert len(text) == build.CHARS and text.startswith('"""') and "def " in text
    assert "_touch_weights" not in text                    # code written after the snapshot's commit
    doc = json.load(gzip.open(build.OUT, "rt", encoding="utf-8"))
    bad = tmp_path / "eval" / "data" / "calibration_code.json.gz"
    bad.parent.mkdir(parents=True)
    build.write({**doc, "text": doc["text"][:-1] + "!"}, bad)
    monkeypatch.setattr(cal, "__file__", str(tmp_path / "pretrained" / "calibrate.py"))
    with pytest.raises(ValueError, match="does not match its sha256"):
        cal._package_source()
    ref = doc["commit"]
    if subprocess.run(["git", "cat-file", "-e", ref], cwd=script.parent,
                      capture_output=True).returncode:
        pytest.skip(f"commit {ref} is not in this checkout (a shallow clone or an installed package)")
    rebuilt = tmp_path / "rebuilt.json.gz"
    build.write(build.build(ref), rebuilt)
    assert rebuilt.read_bytes() == build.OUT.read_bytes()
