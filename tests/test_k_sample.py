"""GPU sampling against the reference's definition (reference/sampling.py): greedy = argmax, the token
always in the top-k/top-p set, the empirical distribution over seeds, determinism in (seed, step)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
VOCAB = 129280


def draw(rt, logits, temperature, top_k, top_p, seed, step):
    """Tokens for rows of logits with per-row parameters (scalars are broadcast)."""
    from dsv4rt.model.sample import sample
    rows, vocab = logits.shape
    params = [np.broadcast_to(np.asarray(v, t), rows).copy() for v, t in
              ((temperature, np.float32), (top_k, np.int32), (top_p, np.float32), (seed, np.uint64), (step, np.uint64))]
    bufs = [rt.arena.alloc(a.nbytes) for a in [logits, np.empty(rows, np.int32)] + params]
    for b, a in zip(bufs, [logits, np.full(rows, -1, np.int32)] + params):
        b.copy_from_host(np.ascontiguousarray(a))
    sample(rt.device, bufs[1].ptr, bufs[0].ptr, rows, vocab, *(b.ptr for b in bufs[2:]))(rt.stream)
    rt.stream.synchronize()
    out = bufs[1].copy_to_host(np.empty(rows, np.int32))
    for b in bufs:
        b.free()
    return out


def allowed(logits, temperature, top_k, top_p):
    """The reference's candidate set and its probabilities (float64), as reference.sampling.sample builds them."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    if top_k:
        order = order[:top_k]
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    cum = np.cumsum(probs)
    keep = int(np.searchsorted(cum, top_p) + 1)
    return order[:keep], probs[:keep] / probs[:keep].sum(), cum


def test_greedy_and_top_k_1_are_argmax(rt):
    rng = np.random.default_rng(0)
    rows = 48
    logits = (rng.standard_normal((rows, VOCAB)) * 4).astype(np.float32)
    logits[::5, 777] = logits[::5, 1234] = logits[::5].max(axis=1) + 1  # tied maxima: the first one wins
    logits[1:3, :] = -np.inf  # everything masked but one token, greedy and sampled
    logits[1:3, 99] = 0
    temperature = np.where(np.arange(rows) % 2, 0.0, 0.8).astype(np.float32)
    top_k = np.where(np.arange(rows) % 2, 0, 1).astype(np.int32)
    top_k[2] = 0
    got = draw(rt, logits, temperature, top_k, 0.9, np.arange(rows), 3)
    assert np.array_equal(got, np.argmax(logits, axis=1))


def test_token_is_always_in_the_allowed_set(rt):
    rng = np.random.default_rng(1)
    rows = 96
    logits = (rng.standard_normal((rows, VOCAB)) * rng.uniform(1, 6, (rows, 1))).astype(np.float32)
    temperature = rng.choice([0.3, 0.7, 1.0, 1.6], rows).astype(np.float32)
    top_k = rng.choice([0, 2, 20, 1000, VOCAB], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], rows).astype(np.float32)
    seed = rng.integers(0, 2**63, rows, dtype=np.uint64)
    got = draw(rt, logits, temperature, top_k, top_p, seed, 17)
    for r in range(rows):
        # The cut may move by one token where the cumulative mass meets top_p within fp32/fixed-point error.
        wide, _, _ = allowed(logits[r], temperature[r], top_k[r], min(1.0, top_p[r] + 1e-5))
        assert got[r] in wide, r
    again = draw(rt, logits, temperature, top_k, top_p, seed, 17)
    assert np.array_equal(got, again)
    perm = rng.permutation(rows)  # a request's token does not depend on its row in the batch
    moved = draw(rt, logits[perm], temperature[perm], top_k[perm], top_p[perm], seed[perm], 17)
    assert np.array_equal(moved, got[perm])


def check_distribution(tokens, support, probs, vocab):
    counts = np.bincount(tokens, minlength=vocab)
    n = len(tokens)
    assert counts.sum() == counts[support].sum(), "a token outside the allowed set"
    expected = n * probs
    assert np.all(np.abs(counts[support] - expected) <= 5 * np.sqrt(expected * (1 - probs)) + 2), \
        (counts[support], expected)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.6),
                                                       (2.0, 6, 0.97)])
def test_small_vocab_distribution(rt, temperature, top_k, top_p):
    logits = np.array([1.0, 2.5, -0.5, 2.0, 0.3, 1.7, -2.0, 0.9], np.float32)
    support, probs, cum = allowed(logits, temperature, top_k, top_p)
    assert top_p == 1 or np.all(np.abs(cum - top_p) > 1e-3)  # no cut the rounding could move
    rows = 40000
    rng = np.random.default_rng(2)
    seeds = rng.integers(0, 2**63, rows, dtype=np.uint64)
    steps = np.arange(rows, dtype=np.uint64)
    tokens = draw(rt, np.tile(logits, (rows, 1)), temperature, top_k, top_p, seeds, steps)
    check_distribution(tokens, support, probs, len(logits))
    one_seed = draw(rt, np.tile(logits, (rows, 1)), temperature, top_k, top_p, 12345, steps)  # steps alone vary
    check_distribution(one_seed, support, probs, len(logits))


@pytest.mark.parametrize("top_k, top_p", [(4, 1.0), (0, 0.85), (50, 0.7)])
def test_flash_vocab_distribution(rt, top_k, top_p):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(VOCAB) - 9).astype(np.float32)
    logits[[5, 70000, 129279, 4242]] = [6.0, 5.5, 5.0, 4.0]
    logits[100000] = 6.0  # tied with token 5: the stable order puts 5 first
    support, probs, cum = allowed(logits, 1.0, top_k, top_p)
    assert len(support) <= 50 and (top_p == 1 or np.all(np.abs(cum - top_p) > 1e-3))
    rows = 2048
    tokens = draw(rt, np.tile(logits, (rows, 1)), 1.0, top_k, top_p, rng.integers(0, 2**63, rows, dtype=np.uint64), 0)
    check_distribution(tokens, support, probs, VOCAB)
