"""Novelty agreed across layers (KVMSpec.exact_scope "model" / "first", kvmeans.pretrained.board): the board's
running mean (or the first layer's scores), that a converted model ranks each layer's block by the mean over the
layers so far (in layer order, once per layer, nothing left after a forward) or by the first layer's, that the
scope changes what layers keep, and that one forward still equals any split, the rows of a padded batch alone,
and a crop."""
import pytest
import torch

from kvmeans.pretrained.board import NoveltyBoard

tf = pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_kwargs  # noqa: E402
from kvmeans.pretrained.convert import KVMSpec, convert_hf, load_converted, parse_kvm_spec  # noqa: E402
from tests.pretrained.test_batch import left_pad, positions, rows  # noqa: E402
from tests.pretrained.test_convert import ids, tiny  # noqa: E402
from tests.pretrained.test_reserve import assert_crop_replays  # noqa: E402

RESERVE = dict(budget=16, chunk_len=8, n_bswa_chunks=2, sink_len=2, exact_rows=6, exact_lead=1)


def _score(*vals):
    """[1, 2, len(vals)]: one score per token, the same in both kv heads (as block_scores gives)."""
    return torch.tensor(vals, dtype=torch.float64).expand(1, 2, len(vals))


def test_board_takes_the_running_mean_and_forgets_a_block_after_the_last_layer():
    board = NoveltyBoard(3)
    torch.testing.assert_close(board.combine(0, 16, _score(1., 4.)), _score(1., 4.))
    torch.testing.assert_close(board.combine(1, 16, _score(3., 0.)), _score(2., 2.))
    board.combine(0, 16, _score(5., 5.), rows=(1,))              # another part of a padded batch: its own entry
    assert len(board) == 2
    torch.testing.assert_close(board.combine(2, 16, _score(-1., 2.)), _score(1., 2.))
    assert len(board) == 1                                          # the last layer removed it
    torch.testing.assert_close(board.combine(0, 16, _score(7., 7.), rows=(1,)), _score(7., 7.))   # layer 0 rewrites
    with pytest.raises(ValueError, match="n_layers must be >= 1"):
        NoveltyBoard(0)
    with pytest.raises(ValueError, match=r"scope must be one of \('model', 'first'\), got 'layer'"):
        NoveltyBoard(2, "layer")


def test_a_first_layer_board_gives_every_layer_the_first_layers_scores():
    board = NoveltyBoard(3, "first")
    torch.testing.assert_close(board.combine(0, 16, _score(1., 4.)), _score(1., 4.))
    torch.testing.assert_close(board.combine(1, 16, _score(3., 0.)), _score(1., 4.))
    torch.testing.assert_close(board.combine(2, 16, _score(-9., 9.)), _score(1., 4.))
    assert len(board) == 0                                          # the last layer removed it


class _Spy:
    """Records every combine call of a model's board: (layer_pos, start, rows, score in, score out)."""

    def __init__(self, model):
        self.board = model.model.layers[0].self_attn.kvm_board
        self.calls, inner = [], self.board.combine

        def combine(layer_pos, start, score, rows=None):
            out = inner(layer_pos, start, score, rows)
            self.calls.append((layer_pos, start, rows, score.clone(), out.clone()))
            return out
        self.board.combine = combine


@torch.no_grad()
def test_each_layer_ranks_by_the_mean_over_the_layers_so_far_in_layer_order():
    model = convert_hf(tiny("llama"), **RESERVE)
    spy = _Spy(model)
    model(ids(100))
    assert spy.calls and len(spy.board) == 0                        # used, and nothing left after the forward
    by_block = {}
    for layer_pos, start, row_ids, score, out in spy.calls:
        by_block.setdefault((row_ids, start), []).append((layer_pos, score, out))
    assert sorted(s for _, s in by_block) == list(range(8, 100 - 16 + 1, 8))[:len(by_block)]
    for calls in by_block.values():
        assert [c[0] for c in calls] == [0, 1]                      # once per layer, in order
        (_, s0, o0), (_, s1, o1) = calls
        torch.testing.assert_close(o0, s0, rtol=0, atol=0)
        torch.testing.assert_close(o1, (s0 + s1) / 2, rtol=0, atol=1e-12)
    spy.calls.clear()
    layer = convert_hf(tiny("llama"), exact_scope="layer", **RESERVE)
    assert all(m.self_attn.kvm_board is None for m in layer.model.layers)     # no board to read


@torch.no_grad()
def test_with_scope_first_every_layer_ranks_by_the_first_layers_novelty():
    model = convert_hf(tiny("llama"), exact_scope="first", **RESERVE)
    spy = _Spy(model)
    model(ids(100))
    assert spy.calls and len(spy.board) == 0
    by_block = {}
    for layer_pos, start, row_ids, score, out in spy.calls:
        by_block.setdefault((row_ids, start), []).append((layer_pos, score, out))
    for calls in by_block.values():
        (p0, s0, o0), (p1, s1, o1) = calls
        assert (p0, p1) == (0, 1) and not torch.equal(s0, s1)      # the layers' own novelty differs ...
        assert torch.equal(o0, s0) and torch.equal(o1, s0)          # ... and both rank by the first layer's


@torch.no_grad()
def test_the_scope_changes_what_deeper_layers_keep_and_one_layer_is_its_own_mean():
    x = ids(120)
    model, layer, first = (convert_hf(tiny("llama"), exact_scope=s, **RESERVE)(x).logits
                           for s in ("model", "layer", "first"))
    assert (model - layer).abs().max() > 1e-5 and (model - first).abs().max() > 1e-5
    one_model, one_layer, one_first = (convert_hf(tiny("llama"), layers=[1], exact_scope=s, **RESERVE)(x).logits
                                       for s in ("model", "layer", "first"))
    torch.testing.assert_close(one_model, one_layer, rtol=0, atol=0)
    torch.testing.assert_close(one_first, one_layer, rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("scope", ["model", "first"])
def test_splits_padded_rows_and_crop_agree_with_one_forward(scope):
    model = convert_hf(tiny("llama"), exact_scope=scope, **RESERVE)
    x = ids(100)
    full = model(x).logits
    cache = tf.DynamicCache(config=model.config)
    steps = [x[:, :29], *x[:, 29:].split(1, 1)]
    decoded = torch.cat([model(s, **cache_kwargs(cache), use_cache=True).logits for s in steps], 1)
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)

    spy = _Spy(model)
    seqs = rows()
    xp, mask = left_pad(seqs, pad=7)
    padded = model(xp, attention_mask=mask, position_ids=positions(mask)).logits
    assert any(rows_ is not None for _, _, rows_, _, _ in spy.calls)     # the parts were ranked apart
    for i, s in enumerate(seqs):
        torch.testing.assert_close(padded[i, xp.shape[1] - len(s):], model(s[None]).logits[0], rtol=0, atol=1e-5)

    assert_crop_replays(model)                                        # replays layer by layer through the board
    assert len(spy.board) == 0


def test_spec_parses_saves_and_refuses_the_scope(tmp_path):
    assert parse_kvm_spec("exact_rows=4,exact_scope=layer") == {"exact_rows": 4, "exact_scope": "layer"}
    assert KVMSpec().exact_scope == "model"
    assert parse_kvm_spec("exact_scope=first") == {"exact_scope": "first"}
    with pytest.raises(ValueError, match=r"exact_scope must be one of \('model', 'layer', 'first'\).*got 'heads'"):
        parse_kvm_spec("exact_scope=heads")
    model = convert_hf(tiny("llama"), exact_scope="layer", **RESERVE)
    model.save_pretrained(tmp_path)
    loaded = load_converted(tmp_path)
    assert loaded.config.kvm_conversion["exact_scope"] == "layer"
    assert loaded.model.layers[1].self_attn.kvm_spec.exact_scope == "layer"
    saved = {**model.config.kvm_conversion, "exact_scope": "model"}
    assert KVMSpec.from_dict({k: v for k, v in saved.items() if k != "layers"}).exact_scope == "model"
    del saved["exact_scope"]                        # a folder saved before the setting existed ranked per layer
    assert KVMSpec.from_dict({k: v for k, v in saved.items() if k != "layers"}).exact_scope == "layer"
