"""Synthetic recall tasks: determinism, exact layouts, oracle accuracy and a tiny end-to-end run."""
import pytest
import torch
from torch import nn

from kvmeans.eval.synthetic import (
    KEY,
    NUM_DIGITS,
    NUM_SPECIAL,
    SEP,
    VAL,
    accuracy_by_depth,
    accuracy_grid,
    mqar_batch,
    multikey_batch,
    passkey_batch,
    passkey_needle_len,
    plot_heatmap,
    recall_accuracy,
)


# ---------------------------------------------------------------- determinism
def test_mqar_deterministic():
    a = mqar_batch(4, 40, 5, 32, seed=7)
    b = mqar_batch(4, 40, 5, 32, seed=7)
    c = mqar_batch(4, 40, 5, 32, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_passkey_deterministic():
    a = passkey_batch(4, 50, seed=3)
    b = passkey_batch(4, 50, seed=3)
    c = passkey_batch(4, 50, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_golden_samples():
    x, y = mqar_batch(2, 24, 4, 20, seed=0)
    assert x[0, :10].tolist() == [6, 12, 7, 16, 8, 14, 10, 13, 15, 12]
    assert x[0, 15:].tolist() == [1, 10, 13, 6, 12, 7, 16, 8, 14]
    x, y, d = passkey_batch(2, 24, seed=0, depth=0.5, vocab_size=32)
    assert x[0].tolist() == [31, 16, 20, 17, 24, 2, 22, 23, 3, 7, 13, 11, 16, 14, 14, 28, 17,
                             2, 22, 23, 3, 7, 13, 11]
    assert y[0, 20:23].tolist() == [7, 13, 11]


# ---------------------------------------------------------------- MQAR layout
@pytest.mark.parametrize("T,P,V,Q", [(24, 4, 20, None), (64, 8, 40, 3), (33, 3, 16, 6), (17, 4, 12, 4)])
def test_mqar_layout(T, P, V, Q):
    B = 5
    x, y = mqar_batch(B, T, P, V, seed=1, num_queries=Q)
    Q = P if Q is None else Q
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
    n = (V - NUM_SPECIAL) // 2
    q0 = T - 2 * Q
    for b in range(B):
        keys, vals = x[b, 0:2 * P:2].tolist(), x[b, 1:2 * P:2].tolist()
        assert len(set(keys)) == P and all(NUM_SPECIAL <= k < NUM_SPECIAL + n for k in keys)
        assert all(NUM_SPECIAL + n <= v < NUM_SPECIAL + 2 * n for v in vals)
        fill = x[b, 2 * P:q0 - 1]
        assert ((fill >= NUM_SPECIAL + n) & (fill < NUM_SPECIAL + 2 * n)).all()   # filler never a key
        assert x[b, q0 - 1] == SEP and (x[b] == SEP).sum() == 1
        kv = dict(zip(keys, vals))
        qs = x[b, q0::2].tolist()
        if Q <= P:
            assert len(set(qs)) == Q
        for i, k in enumerate(qs):
            assert k in kv and x[b, q0 + 2 * i + 1] == kv[k] and y[b, q0 + 2 * i] == kv[k]
        mask = y[b] != -100
        assert mask.sum() == Q and mask[q0::2].all()


def test_mqar_budget_errors():
    with pytest.raises(ValueError, match="seq_len=16 < 2"):
        mqar_batch(1, 16, 4, 20, seed=0)                # 2*4 + 1 + 2*4 = 17 > 16
    with pytest.raises(ValueError, match="has 8 keys < num_pairs=9"):
        mqar_batch(1, 64, 9, 20, seed=0)                # only 8 keys


# ---------------------------------------------------------------- passkey layout
@pytest.mark.parametrize("T,K,D", [(24, 2, 3), (50, 1, 2), (101, 3, 4), (14, 2, 3)])
def test_passkey_layout_and_depth(T, K, D):
    depths = [0.0, 0.25, 0.5, 1 / 3, 0.9, 1.0]
    B = len(depths)
    x, y, d = passkey_batch(B, T, seed=2, depth=depths, vocab_size=40, key_len=K, answer_len=D)
    N = passkey_needle_len(K, D)
    assert N == 2 + K + D and x.shape == y.shape == (B, T) and d.shape == (B,)
    F = T - 2 * N
    lo = NUM_SPECIAL + NUM_DIGITS
    for b in range(B):
        s = round(depths[b] * F)
        kpos = (x[b] == KEY).nonzero().flatten().tolist()
        assert kpos == [s, T - N]                      # needle start exact to the token; query at the end
        assert (x[b] == VAL).nonzero().flatten().tolist() == [s + 1 + K, T - N + 1 + K]
        needle, query = x[b, s:s + N], x[b, T - N:]
        assert torch.equal(needle, query)
        digits = needle[2 + K:]
        assert ((digits >= NUM_SPECIAL) & (digits < lo)).all()
        rest = torch.cat([x[b, :s], x[b, s + N:T - N]])
        assert rest.numel() == F and ((rest >= lo) & (rest < 40)).all()
        assert ((needle[1:1 + K] >= lo) & (needle[1:1 + K] < 40)).all()
        mask = y[b] != -100
        assert mask.nonzero().flatten().tolist() == list(range(T - D - 1, T - 1))
        assert torch.equal(y[b, mask], digits)
        assert torch.equal(y[b, mask], x[b, T - D:])     # pre-shifted: target[t] == x[t + 1]
    assert torch.allclose(d, torch.tensor(depths))


def test_passkey_random_depth_and_budget():
    x, y, d = passkey_batch(16, 60, seed=5)
    assert ((d >= 0) & (d <= 1)).all() and d.unique().numel() > 1
    assert x.shape == (16, 60)
    with pytest.raises(ValueError, match="seq_len=13 < 2 \\* needle length 7"):
        passkey_batch(1, 13, seed=0)                   # needle 7 tokens, twice = 14 > 13
    with pytest.raises(ValueError, match="depth=1.5"):
        passkey_batch(1, 30, seed=0, depth=1.5)


# ---------------------------------------------------------------- multi-key passkey
def test_multikey_deterministic():
    a = multikey_batch(4, 64, seed=3, pair_every=16)
    b = multikey_batch(4, 64, seed=3, pair_every=16)
    c = multikey_batch(4, 64, seed=4, pair_every=16)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("T,every,Q,K,D,V", [(128, 32, 1, 1, 3, 64), (128, 32, 4, 1, 3, 64), (1024, 16, 4, 1, 3, 128),
                                            (64, 16, 2, 2, 3, 20), (40, 20, 1, 1, 2, 16), (12, 12, 1, 1, 3, 15)])
def test_multikey_layout_answers_are_the_queried_values(T, every, Q, K, D, V):
    B = 16
    x, y = multikey_batch(B, T, seed=1, pair_every=every, num_queries=Q, vocab_size=V, key_len=K, answer_len=D)
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
    N, P, lo = passkey_needle_len(K, D), T // every, NUM_SPECIAL + NUM_DIGITS
    q0 = T - Q * N
    queried = set()
    for b in range(B):
        kpos = (x[b] == KEY).nonzero().flatten().tolist()
        assert len(kpos) == P + Q and kpos[P:] == list(range(q0, T, N))   # P needles, then Q queries end the row
        assert all(q - p >= N for p, q in zip(kpos, kpos[1:]))             # needles do not overlap
        needles = [x[b, p:p + N] for p in kpos[:P]]
        assert all(n[1 + K] == VAL and ((n[1:1 + K] >= lo) & (n[1:1 + K] < V)).all() for n in needles)
        assert all(((n[2 + K:] >= NUM_SPECIAL) & (n[2 + K:] < lo)).all() for n in needles)
        keys = [tuple(n[1:1 + K].tolist()) for n in needles]
        assert len(set(keys)) == P, "keys distinct within a row"
        rest = torch.ones(T, dtype=torch.bool)
        for p in kpos:
            rest[p:p + N] = False
        assert rest.sum() == T - (P + Q) * N and ((x[b, rest] >= lo) & (x[b, rest] < V)).all()  # filler: words
        answers = []
        for i in range(Q):
            query = x[b, q0 + i * N:q0 + (i + 1) * N]
            j = keys.index(tuple(query[1:1 + K].tolist()))
            assert torch.equal(query, needles[j])                          # the value of the queried key
            answers += needles[j][2 + K:].tolist()
            queried.add(j)
        assert len({tuple(a) for a in x[b, q0:].view(Q, N)[:, 1:1 + K].tolist()}) == Q, "different needles asked"
        mask = y[b] != -100
        assert mask.nonzero().flatten().tolist() == [q0 + i * N + 1 + K + d for i in range(Q) for d in range(D)]
        assert y[b, mask].tolist() == answers
    assert P == 1 or len(queried) > 1, "the queried needle varies"


def test_multikey_oracle_and_budget_errors():
    x, y = multikey_batch(8, 256, seed=2, pair_every=16, num_queries=3, vocab_size=64, key_len=2)
    assert recall_accuracy(MultikeyOracle(64, passkey_needle_len(2, 3), 3), x, y) == 1.0
    assert recall_accuracy(RandomModel(64), x, y) < 0.1
    with pytest.raises(ValueError, match="raise pair_every"):
        multikey_batch(1, 23, seed=0, pair_every=7)                 # 3 needles + query of 6 tokens > 23
    with pytest.raises(ValueError, match="distinct keys"):
        multikey_batch(1, 1024, seed=0, pair_every=16)              # 64 needles, 50 one-token keys
    with pytest.raises(ValueError, match="no needle"):
        multikey_batch(1, 24, seed=0, pair_every=32)
    with pytest.raises(ValueError, match="num_queries=3"):
        multikey_batch(1, 64, seed=0, pair_every=32, num_queries=3)   # 2 needles


# ---------------------------------------------------------------- accuracy
class MQAROracle(nn.Module):
    """Predicts the token that followed the first earlier occurrence of the current token."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        B, T = x.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            for t in range(T):
                prev = (x[b, :t] == x[b, t]).nonzero()
                if len(prev):
                    logits[b, t, x[b, prev[0, 0] + 1]] = 10.0
        return logits, None


class PasskeyOracle(nn.Module):
    """Copies from the needle (first KEY) with the query's offset (query = last needle-length tokens)."""

    def __init__(self, vocab, n):
        super().__init__()
        self.vocab, self.n = vocab, n

    def forward(self, x):
        B, T = x.shape
        logits = torch.randn(B, T, self.vocab)
        for b in range(B):
            s = int((x[b] == KEY).nonzero()[0, 0])
            for t in range(T - self.n, T - 1):
                logits[b, t, x[b, s + t - (T - self.n) + 1]] = 100.0
        return logits, None


class MultikeyOracle(nn.Module):
    """Copies the value of the needle whose key each query (``q`` times ``n`` tokens at the end) repeats."""

    def __init__(self, vocab, n, q):
        super().__init__()
        self.vocab, self.n, self.q = vocab, n, q

    def forward(self, x):
        B, T = x.shape
        logits = torch.randn(B, T, self.vocab)
        for b in range(B):
            for q in range(T - self.q * self.n, T, self.n):
                head = x[b, q:q + self.n - 3]
                s = next(p for p in range(T) if torch.equal(x[b, p:p + len(head)], head))
                for t in range(q, q + self.n - 1):
                    logits[b, t, x[b, s + t - q + 1]] = 100.0
        return logits, None


class RandomModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x):
        return torch.randn(*x.shape, self.vocab, generator=self.g)


def test_oracle_and_chance():
    V = 32
    x, y = mqar_batch(16, 48, 6, V, seed=11)
    assert recall_accuracy(MQAROracle(V), x, y, batch_size=5) == 1.0
    assert recall_accuracy(RandomModel(V), x, y) < 0.15           # chance = 1/32
    x, y, _ = passkey_batch(16, 48, seed=11, vocab_size=V)
    assert recall_accuracy(PasskeyOracle(V, passkey_needle_len()), x, y, batch_size=3) == 1.0
    x, y, _ = passkey_batch(200, 48, seed=12, vocab_size=V)
    acc = recall_accuracy(RandomModel(V), x, y)
    assert 0.0 < acc < 0.1                                         # 600 tokens, chance 1/32


def test_oracle_by_depth_and_grid():
    V = 32
    oracle = PasskeyOracle(V, passkey_needle_len())
    by = accuracy_by_depth(oracle, 40, [0.0, 0.5, 1.0], samples=4, seed=0, vocab_size=V)
    assert by == {0.0: 1.0, 0.5: 1.0, 1.0: 1.0}
    grid = accuracy_grid(RandomModel(V), [32, 48], [0.0, 1.0], samples=8, seed=0, vocab_size=V)
    assert set(grid) == {32, 48} and all(set(r) == {0.0, 1.0} for r in grid.values())
    assert all(a < 0.5 for r in grid.values() for a in r.values())


# ---------------------------------------------------------------- end to end
def test_tiny_model_end_to_end(tmp_path):
    from kvmeans.models import KVMLanguageModel, KVMModelConfig
    torch.manual_seed(0)
    cfg = KVMModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mixer="kvm", chunk_len=16,
                         budget={"kind": "fixed", "n": 16})
    model = KVMLanguageModel(cfg).train()
    x, y = mqar_batch(4, 48, 4, 64, seed=0)
    acc = recall_accuracy(model, x, y)
    assert 0.0 <= acc <= 1.0 and model.training                   # train mode restored
    loss = model.loss(x, y)
    assert torch.isfinite(loss)
    grid = accuracy_grid(model, [32, 64], [0.0, 1.0], samples=4, seed=0)   # vocab from model.config
    assert list(grid) == [32, 64]
    assert all(0.0 <= a <= 1.0 for r in grid.values() for a in r.values())
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "heat.png"
    assert plot_heatmap(grid, out) == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["heat.png"]  # no temp file left behind
