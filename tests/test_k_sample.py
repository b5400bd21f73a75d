"""GPU sampling against the reference's definition (reference/sampling.py): greedy = argmax, the token
always in the top-k/top-p set, the empirical distribution over seeds, determinism in (seed, step); and the
exact token at the full vocabulary against the kernel's own definition, in numpy (KernelDraw)."""
import math

import ml_dtypes
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


# ---------------------------------------------------------------- the exact token at the full vocabulary

M32 = 0xFFFFFFFF


def philox_draw(seed: int, step: int) -> int:
    """The kernel's 64 random bits for (seed, step): Philox4x32-10, counter (step, 'SAMP'), key seed."""
    c, k0, k1 = [step & M32, step >> 32, 0x53414D50, 0], seed & M32, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c[0] << 32 | c[1]


def monotone_bits(x: np.ndarray) -> np.ndarray:
    u = (np.asarray(x, np.float32) + np.float32(0)).view(np.uint32)  # −0 → +0
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


class KernelDraw:
    """sample.cu's token by its definition: keys (logit desc, index asc), masses floor(exp((l − lmax)/T)·2^42)
    in float32, the pool (l ≥ fma(T, −30, lmax), mass > 0), top-k then top-p cuts, u = r·Z / 2^64 and the token
    where the running mass in index order passes u. np.exp is not CUDA's expf (a few ulps apart), so token()
    also says whether the draw, or a cut, lies within that error of a boundary."""

    def __init__(self, logits: np.ndarray, temperature: float, top_k: int, top_p: float):
        logits = np.asarray(logits, np.float32)
        vocab = len(logits)
        bits = monotone_bits(logits)
        keys = bits.astype(np.uint64) << np.uint64(32) | (M32 - np.arange(vocab, dtype=np.uint64))
        self.argmax = M32 - int(keys.max() & np.uint64(M32))
        self.greedy = not temperature > 0 or top_k == 1
        self.near_cut = False
        if self.greedy:
            return
        lmax = logits[self.argmax]
        lowest = monotone_bits(np.float32(np.float64(np.float32(temperature)) * -30 + np.float64(lmax)))
        with np.errstate(all="ignore"):  # correctly rounded exp: within 2.5 ulps of expf
            x = (logits - lmax) / np.float32(temperature)
            scaled = np.exp(x.astype(np.float64)).astype(np.float32) * np.float32(2.0 ** 42)
        mass = np.where(np.isnan(scaled), 0, np.floor(scaled)).astype(np.uint64)
        pool = (bits >= lowest) & (mass > 0)
        order = np.argsort(keys)[::-1]
        order = order[pool[order]]
        if 0 < top_k < vocab and len(order) > top_k:
            edge = np.sum((bits >= lowest) & (np.abs(scaled - 1) < 1e-4))  # members that may round to mass 0
            self.near_cut = len(order) - edge <= top_k
            order = order[:top_k]
        cum = np.cumsum(mass[order])
        if top_p < 1 and len(cum) and cum[-1] > 0:
            total = int(cum[-1])
            target = max(1, math.ceil(float(np.float32(top_p)) * float(total)))
            cut = int(np.searchsorted(cum, target))
            near = [abs(int(cum[j]) - target) for j in (cut - 1, cut) if j >= 0]
            self.near_cut |= min(near) < 1e-6 * total + len(cum)
            order = order[:cut + 1]
        self.index = np.sort(order)
        self.cum = np.cumsum(mass[self.index])

    def token(self, seed: int, step: int) -> tuple[int, bool]:
        """(token, near a boundary)."""
        total = int(self.cum[-1]) if not self.greedy and len(self.cum) else 0
        if total == 0:
            return self.argmax, False
        u = philox_draw(seed, step) * total >> 64
        j = int(np.searchsorted(self.cum, u, side="right"))
        gap = min([int(self.cum[j]) - u] + ([u - int(self.cum[j - 1])] if j else []))
        return int(self.index[j]), self.near_cut or gap < 1e-6 * total + len(self.cum)


def realistic_logits(rng, kind: str, vocab: int = VOCAB) -> np.ndarray:
    if kind == "chat":  # a few plausible tokens well above a long tail
        x = rng.standard_normal(vocab) * 2.5
        top = rng.choice(vocab, 20, replace=False)
        x[top] += rng.uniform(8, 16, len(top))
    elif kind == "confident":
        x = rng.standard_normal(vocab) * 2
        x[rng.integers(vocab)] += 25
    elif kind == "ties":  # a 0.5 grid, and a tied group on top
        x = np.round(rng.standard_normal(vocab) * 4) / 2
        x[rng.choice(vocab, 6, replace=False)] = x.max() + 2
    elif kind == "bf16":
        x = (rng.standard_normal(vocab) * 3).astype(ml_dtypes.bfloat16)
    else:  # flat
        x = rng.standard_normal(vocab) * 0.05
    return np.asarray(x, np.float32)


FULL_CASES = [("chat", 0.7, 0, 0.9), ("chat", 0.7, 50, 1.0), ("chat", 1.0, 0, 0.95), ("chat", 1.5, 1000, 0.99),
              ("chat", 0.3, 5, 0.5), ("chat", 1.0, 1, 0.9), ("chat", 0.0, 0, 0.9), ("confident", 0.7, 0, 0.9),
              ("confident", 1.2, 1000, 1.0), ("ties", 1.0, 50, 0.9), ("ties", 0.5, 1000, 0.99), ("bf16", 0.8, 0, 0.95),
              ("bf16", 1.0, 5, 1.0), ("flat", 1.0, 0, 0.9), ("flat", 0.7, 1000, 0.5)]


@pytest.mark.parametrize("rows", [1, 8, 24, 64, 192])  # a row over 8, 8, 4, 2 and 1 blocks (sample.CLUSTERS)
def test_full_vocab_exact_token(rt, rows):
    rng = np.random.default_rng(4)
    cases = [(realistic_logits(rng, kind), t, k, p) for kind, t, k, p in FULL_CASES]
    models = [KernelDraw(*c) for c in cases]
    draws = max(rows, 6 * len(cases))
    job = np.arange(-(-draws // rows) * rows) % len(cases)
    seeds = rng.integers(0, 2**63, len(job), dtype=np.uint64)
    steps = rng.integers(0, 2**40, len(job), dtype=np.uint64)
    got = np.concatenate([draw(rt, np.stack([cases[j][0] for j in job[at:at + rows]]),
                               *(np.array([cases[j][i] for j in job[at:at + rows]]) for i in (1, 2, 3)),
                               seeds[at:at + rows], steps[at:at + rows]) for at in range(0, len(job), rows)])
    checked = np.zeros(len(cases), int)
    for n, j in enumerate(job):
        want, near = models[j].token(int(seeds[n]), int(steps[n]))
        if not near:
            assert got[n] == want, (FULL_CASES[j], n)
            checked[j] += 1
    assert np.all(checked >= np.bincount(job, minlength=len(cases)) // 2), checked  # boundaries are rare


def test_nan_and_inf_rows(rt):
    rng = np.random.default_rng(6)
    base = realistic_logits(rng, "chat")
    rows = [np.full(VOCAB, -np.inf, np.float32), base.copy(), base.copy(), base.copy(), base.copy()]
    rows[1][:] = -np.inf
    rows[1][4321] = -7.0                       # one finite token
    rows[2][[1000, 2000]] = np.nan             # NaN is the largest key: the first NaN, as np.argmax
    rows[3][[10, 20]] = -np.float32(np.nan)    # a negative NaN is the smallest key: never in the pool
    rows[4][[30, 40]] = np.inf                 # +inf: no finite mass, the first +inf
    logits = np.stack(rows * 2)
    temperature = np.repeat([0.7, 0.0], len(rows)).astype(np.float32)
    seeds = rng.integers(0, 2**63, len(logits), dtype=np.uint64)
    got = draw(rt, logits, temperature, 0, 0.9, seeds, 9)
    want = [KernelDraw(logits[r], temperature[r], 0, 0.9).token(int(seeds[r]), 9)[0] for r in range(len(logits))]
    assert list(got) == want
    assert want[:3] == [0, 4321, 1000] and want[4] == 30 and want[3] not in (10, 20)
