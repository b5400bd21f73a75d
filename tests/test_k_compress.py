"""cuda_src/compress.cu and cuda_src/indexer.cu against the numpy reference: the compressor's pooling +
RMSNorm + RoPE + cache insert with its paged state (fusion 1), and the indexer's scores and top-k.
Caches live in pages of one buffer handed out in random order, as the KV manager does."""
import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, rel_rows, skip_without_wgmma
from dsv4rt.config import ModelConfig
from dsv4rt.kv.plan import CacheKind
from dsv4rt.model import compress as kernels
from dsv4rt.reference.attention import Indexer
from dsv4rt.reference.compressor import Compressor, CompressorState
from dsv4rt.reference.ops import Rope

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16]
EPS = 1e-6
POISON = 0xFF  # every byte: NaN in float32 and bf16
FLASH = ModelConfig.load(FIXTURES / "configs" / "deepseek-v4-flash.json")
FLASH_INV_FREQ = FLASH.rope_inv_freq(2).astype(np.float32)  # a c4a layer's YaRN table (64 rope dims)
# The stored entry is the only bf16 rounding of fusion 1 (its inputs are float32 GEMM outputs).
ENTRY_TOL = {np.float32: 1e-5, BF16: 8e-3}
# The float build scores in exact float32; the bf16 build multiplies on the tensor cores, with q rounded
# to bf16 after the kernel's rope (a caller-roped q is stored so too), 1.5e-3 on random data.
SCORE_TOL = {np.float32: 1e-5, BF16: 5e-3}


def inv_freq_table(rope_dim: int) -> np.ndarray:
    if rope_dim == 64:
        return FLASH_INV_FREQ
    return (160000.0 ** (-np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)


class Uploads:
    """Per-step device copies of host arrays, ordered on the stream and freed together."""

    def __init__(self, rt):
        self.rt, self.bufs = rt, []

    def __call__(self, host: np.ndarray) -> int:
        host = np.ascontiguousarray(host)
        b = self.rt.arena.alloc(max(host.nbytes, 16))
        if host.nbytes:
            b.copy_from_host(host, self.rt.stream)
        self.bufs.append(b)
        return b.ptr

    def fetch(self, ptr: int, out: np.ndarray) -> np.ndarray:
        self.rt.stream.synchronize()
        return next(b for b in self.bufs if b.ptr == ptr).copy_to_host(out)

    def free(self):
        self.rt.stream.synchronize()
        for b in self.bufs:
            b.free()
        self.bufs = []


class PagePool:
    """The physical pages of one cache kind, in one poisoned buffer, handed out in random order. The
    last page is a trap that page tables may name for pages not held: it must stay poisoned."""

    def __init__(self, rt, n_pages: int, page_bytes: int, rng):
        self.rt, self.page_bytes = rt, page_bytes
        self.buf = rt.arena.alloc((n_pages + 1) * page_bytes)
        self.buf.copy_from_host(np.full(self.buf.nbytes, POISON, np.uint8), rt.stream)
        self.free = [int(i) for i in rng.permutation(n_pages)]
        self.trap = n_pages * page_bytes

    def take(self) -> int:
        offset = self.free.pop() * self.page_bytes
        self.buf.copy_from_host(np.full(self.page_bytes, POISON, np.uint8), self.rt.stream, offset)
        return offset

    def give(self, offset: int):
        self.free.append(offset // self.page_bytes)

    def image(self) -> np.ndarray:
        self.rt.stream.synchronize()
        img = self.buf.copy_to_host(np.empty(self.buf.nbytes, np.uint8))
        assert np.all(img[self.trap:] == POISON), "a page that is not held was touched"
        return img

    def close(self):
        self.buf.free()


def page_table(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat int64 page offsets and int32 page_start of several requests."""
    start = np.cumsum([0] + [len(t) for t in tables[:-1]]).astype(np.int32)
    return np.array([o for t in tables for o in t] or [-1], np.int64), start


def read_entries(img: np.ndarray, table: list[int], per_page: int, entry_bytes: int, n: int, dtype) -> np.ndarray:
    width = entry_bytes // np.dtype(dtype).itemsize
    out = np.empty((n, width), np.float32)
    for e in range(n):
        at = table[e // per_page] + e % per_page * entry_bytes
        out[e] = img[at:at + entry_bytes].view(dtype).astype(np.float32)
    return out


# ---------------------------------------------------------------- fusion 1: the compressor

class CompressorRun:
    """Requests fed chunk by chunk to compress_pool and to numpy Compressors with the same a, z.

    The numpy compressor's projections are identities over x = [a | z], so it pools exactly the
    rows the kernel gets. The state cache is paged like the KV manager's sliding kinds: each step
    holds the page columns CacheKind.columns names and gives the others back; pages not held point
    at the trap page."""

    def __init__(self, rt, dtype, *, width, ratio, overlap, rope_dim, state_per_page, out_per_page, max_len,
                 requests=1, seed=0):
        self.rt, self.dtype = rt, dtype
        self.rng = rng = np.random.default_rng(seed)
        c = 2 if overlap else 1
        self.width, self.ratio, self.overlap, self.rope_dim, self.cd = width, ratio, overlap, rope_dim, c * width
        self.ape = rng.standard_normal((ratio, self.cd), dtype=np.float32)
        self.norm = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32)
        self.inv_freq = inv_freq_table(rope_dim)
        eye, zero = np.eye(self.cd, dtype=np.float32), np.zeros((self.cd, self.cd), np.float32)
        self.ref = Compressor(np.hstack([eye, zero]), np.hstack([zero, eye]), self.ape, self.norm, ratio, EPS,
                              Rope(self.inv_freq))
        self.states = [self.ref.new_state() for _ in range(requests)]
        self.fed = [np.zeros((0, 2 * self.cd), np.float32) for _ in range(requests)]
        self.lengths = [0] * requests

        self.out_bytes = width * np.dtype(dtype).itemsize
        self.out_per_page = out_per_page
        logical = -(-(max_len // ratio) // out_per_page)
        self.out_pool = PagePool(rt, requests * logical, out_per_page * self.out_bytes, rng)
        self.out_tables = [[self.out_pool.take() for _ in range(logical)] + [-1] for _ in range(requests)]
        pages, start = page_table(self.out_tables)
        self.consts = Uploads(rt)
        self.out_cache = kernels.PagedCache(self.out_pool.buf.ptr, self.consts(pages), self.consts(start),
                                            out_per_page, self.out_bytes)

        self.state_bytes = 2 * self.cd * 4
        self.kind = CacheKind("state", (0,), self.state_bytes, state_per_page, state_per_page * self.state_bytes, 0,
                              state_per_page * self.state_bytes, stride=ratio, width=c * ratio)
        self.state_pool = PagePool(rt, requests * (self.kind.pages(max_len, max_len) + 1),
                                   state_per_page * self.state_bytes, rng)
        self.held = [{} for _ in range(requests)]  # page column -> offset
        self.columns = -(-max_len // state_per_page)
        self.d_ape, self.d_norm, self.d_inv = (self.consts(v) for v in (self.ape, self.norm, self.inv_freq))

    def close(self):
        self.consts.free()
        self.out_pool.close()
        self.state_pool.close()

    def _hold(self, r: int, length: int, new_len: int):
        need = {c for lo, hi in self.kind.columns(length, new_len) for c in range(lo, hi)}
        for col in [c for c in self.held[r] if c not in need]:
            self.state_pool.give(self.held[r].pop(col))
        for col in sorted(need - set(self.held[r])):
            self.held[r][col] = self.state_pool.take()

    def step(self, chunks, pad_between=False, pad_end=0):
        """One launch over `chunks` [(request, tokens)], with padding rows (poisoned, req −1)."""
        a_rows, z_rows, pos, req = [], [], [], []

        def pad(n):
            a_rows.append(np.full((n, self.cd), np.nan, np.float32))
            z_rows.append(np.full((n, self.cd), np.nan, np.float32))
            pos.extend([self.ratio - 1] * n)  # would complete an entry, were padding not skipped
            req.extend([-1] * n)

        for i, (r, n) in enumerate(chunks):
            if i and pad_between:
                pad(1)
            p0 = self.lengths[r]
            a = self.rng.standard_normal((n, self.cd), dtype=np.float32)
            z = 2 * self.rng.standard_normal((n, self.cd), dtype=np.float32)
            at = np.arange(p0, p0 + n)
            self.ref.update(self.states[r], np.hstack([a, z]), at)
            self.fed[r] = np.vstack([self.fed[r], np.hstack([a, z])])
            self._hold(r, p0, p0 + n)
            self.lengths[r] = p0 + n
            a_rows.append(a)
            z_rows.append(z)
            pos.extend(at)
            req.extend([r] * n)
        pad(pad_end)

        up = Uploads(self.rt)
        tables = [[self.held[r].get(c, self.state_pool.trap) for c in range(self.columns)]
                  for r in range(len(self.states))]
        pages, start = page_table(tables)
        state = kernels.PagedCache(self.state_pool.buf.ptr, up(pages), up(start), self.kind.positions_per_page,
                                   self.state_bytes)
        launch = kernels.compress_pool(
            self.rt.device, self.dtype, self.out_cache, state, up(np.vstack(a_rows)), up(np.vstack(z_rows)),
            self.d_ape, self.d_norm, self.d_inv, up(np.array(pos, np.int32)), up(np.array(req, np.int32)),
            rows=len(pos), width=self.width, ratio=self.ratio, overlap=self.overlap, rope_dim=self.rope_dim, eps=EPS)
        launch(self.rt.stream)
        up.free()
        self.check()

    def check(self):
        out, state = self.out_pool.image(), self.state_pool.image()
        spp = self.kind.positions_per_page
        for r, st in enumerate(self.states):
            n = (len(self.out_tables[r]) - 1) * self.out_per_page
            got = read_entries(out, self.out_tables[r], self.out_per_page, self.out_bytes, n, self.dtype)
            assert rel_rows(got[:st.count], st.entries).max(initial=0) < ENTRY_TOL[self.dtype], r
            assert np.isnan(got[st.count:]).all(), "an entry not complete yet was written"
            keep = kernels.state_keep_from(self.lengths[r], self.ratio, self.overlap)
            assert keep == self.kind.keep_from(self.lengths[r])
            for p in range(keep, self.lengths[r]):
                at = self.held[r][p // spp] + p % spp * self.state_bytes
                assert np.array_equal(state[at:at + self.state_bytes].view(np.float32), self.fed[r][p]), (r, p)


@pytest.fixture
def run(rt):
    made = []

    def make(dtype, **kw):
        made.append(CompressorRun(rt, dtype, **kw))
        return made[-1]
    yield make
    for m in made:
        m.close()


# Chunks starting at every residue mod 4, 1-token chunks inside a window (no entry), the first entry
# alone (position 3), chunks cutting windows, 1000 tokens at once (250 entries).
C4A_CHUNKS = [1, 1, 1, 1, 2, 3, 5, 7, 1, 1000, 3, 1, 2, 6]
# The first entry alone (position 127), then single tokens from every residue mod 128, then long chunks.
C128A_CHUNKS = [127, 1] + [1] * 130 + [1000, 37, 300]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [512, 128])  # main and indexer caches of a Flash c4a layer
def test_c4a_chunks(run, dtype, width):
    r = run(dtype, width=width, ratio=4, overlap=True, rope_dim=64, state_per_page=8, out_per_page=64,
            max_len=sum(C4A_CHUNKS), seed=width)
    for n in C4A_CHUNKS:
        r.step([(0, n)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_c128a_chunks(run, dtype):
    r = run(dtype, width=512, ratio=128, overlap=False, rope_dim=64, state_per_page=16, out_per_page=2,
            max_len=sum(C128A_CHUNKS), seed=1)
    for n in C128A_CHUNKS:
        r.step([(0, n)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width, ratio, overlap, rope_dim, state_per_page, out_per_page, chunks", [
    (32, 16, False, 16, 5, 16, [15, 1, 1, 7, 9, 40, 3, 100, 1, 1, 1]),  # tiny-a's c128a (ratio 16)
    (64, 4, True, 16, 3, 5, C4A_CHUNKS),
    (96, 4, True, 96, 7, 3, [3, 1, 4, 9, 1, 1, 30]),  # rope over the whole entry
])
def test_odd_sizes(run, dtype, width, ratio, overlap, rope_dim, state_per_page, out_per_page, chunks):
    r = run(dtype, width=width, ratio=ratio, overlap=overlap, rope_dim=rope_dim, state_per_page=state_per_page,
            out_per_page=out_per_page, max_len=sum(chunks), seed=width)
    for n in chunks:
        r.step([(0, n)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width, ratio, overlap, state_per_page, out_per_page", [
    (128, 4, True, 8, 64), (512, 128, False, 16, 2)])
def test_batch_of_requests(run, dtype, width, ratio, overlap, state_per_page, out_per_page):
    """Prefill chunks and decode tokens of several requests in one launch, with padding rows."""
    r = run(dtype, width=width, ratio=ratio, overlap=overlap, rope_dim=64, state_per_page=state_per_page,
            out_per_page=out_per_page, max_len=700, requests=3, seed=7)
    r.step([(0, 5), (1, 130), (2, 1)], pad_between=True, pad_end=2)
    r.step([(2, 300), (0, 3)], pad_end=1)
    for _ in range(12):
        r.step([(0, 1), (1, 1), (2, 1)], pad_between=True, pad_end=3)
    r.step([(1, 127), (0, 128), (2, 2)], pad_between=True)


# ---------------------------------------------------------------- the indexer

def indexer_reference(keys, q, x, pos, topk, inv_freq) -> np.ndarray:
    """Indexer.select on one request with identity projections: q (unroped) and x give w directly."""
    heads = q.shape[1]
    st = CompressorState(keys.shape[1])
    st.entries = keys
    ix = Indexer(wq_b=lambda qr: qr, weights_proj=np.eye(heads, dtype=np.float32), compressor=None, topk=topk)
    return ix.select(st, x, q.reshape(len(q), -1), pos, Rope(inv_freq), 4)


def index_weights(x: np.ndarray, dim: int) -> np.ndarray:
    """w as Indexer.select computes it from x with identity weights_proj."""
    heads = x.shape[1]
    return (x @ np.eye(heads, dtype=np.float32).T) * np.float32(dim ** -0.5 * heads ** -0.5)


def make_request(rng, dtype, n_keys, positions, heads, dim, keys=None, x=None):
    keys = rng.standard_normal((n_keys, dim), dtype=np.float32) if keys is None else keys
    q = rng.standard_normal((len(positions), heads, dim), dtype=np.float32)
    x = rng.standard_normal((len(positions), heads), dtype=np.float32) if x is None else x
    rounded = lambda v: v.astype(dtype).astype(np.float32)  # noqa: E731
    return dict(keys=rounded(keys), q=rounded(q), x=x, pos=np.asarray(positions, np.int32))


def run_indexer(rt, dtype, requests, *, topk, rope_dim, rope_in_kernel, pad_rows=0, seed=0, launched=None):
    """One launch over the rows of every request, then poisoned padding rows. Returns per request
    (selected rows, kernel scores, reference mask, float64 scores of the reference's q, visible); the names of the
    kernels launched are appended to `launched`."""
    rng = np.random.default_rng(seed)
    heads, dim = requests[0]["q"].shape[1:]
    inv_freq = inv_freq_table(rope_dim)
    per_page, entry_bytes = 64, dim * np.dtype(dtype).itemsize
    logical = [-(-len(r["keys"]) // per_page) for r in requests]
    pool = PagePool(rt, sum(logical), per_page * entry_bytes, rng)
    tables = [[pool.take() for _ in range(n)] + [-1] for n in logical]
    for r, table in zip(requests, tables):
        for j0 in range(0, len(r["keys"]), per_page):
            pool.buf.copy_from_host(r["keys"][j0:j0 + per_page].astype(dtype), rt.stream, table[j0 // per_page])

    q_ref = [Rope(inv_freq)(r["q"], r["pos"]) for r in requests]  # float32, as the reference ropes
    q_in = [r["q"] if rope_in_kernel else q.astype(dtype).astype(np.float32) for r, q in zip(requests, q_ref)]
    q_in.append(np.full((pad_rows, heads, dim), np.nan, np.float32))
    w = [index_weights(r["x"], dim) for r in requests] + [np.full((pad_rows, heads), np.nan, np.float32)]
    pos = [r["pos"] for r in requests] + [np.full(pad_rows, 4000, np.int32)]
    req = [np.full(len(r["pos"]), i, np.int32) for i, r in enumerate(requests)] + [np.full(pad_rows, -1, np.int32)]
    rows = sum(len(p) for p in pos)
    visible = [(r["pos"] + 1) // 4 for r in requests]
    n_max = max(1, max(int(v.max(initial=0)) for v in visible))

    up = Uploads(rt)
    pages, start = page_table(tables)
    keys = kernels.PagedCache(pool.buf.ptr, up(pages), up(start), per_page, entry_bytes)
    d_sel = up(np.full((rows, topk), -7, np.int32))
    d_scores = up(np.full((rows, n_max), np.nan, np.float32))
    launch = kernels.indexer_select(
        rt.device, dtype, d_sel, d_scores, up(np.vstack(q_in).astype(dtype)), up(np.vstack(w)), keys,
        up(np.concatenate(pos)), up(np.concatenate(req)), rows=rows, heads=heads, head_dim=dim, topk=topk,
        n_max=n_max, inv_freq=up(inv_freq) if rope_in_kernel else None, rope_dim=rope_dim)
    launch(rt.stream)
    if launched is not None:
        launched += [k.kernel.name for k in launch.launches]
    sel = up.fetch(d_sel, np.empty((rows, topk), np.int32))
    scores = up.fetch(d_scores, np.empty((rows, n_max), np.float32))
    up.free()
    pool.image()
    pool.close()

    assert np.all(sel[rows - pad_rows:] == -1), "padding rows select nothing"
    results, row = [], 0
    identity = np.zeros(rope_dim // 2, np.float32)
    for r, q, v in zip(requests, q_in, visible):
        n = len(r["pos"])
        mask = indexer_reference(r["keys"], q, r["x"], r["pos"], topk, inv_freq if rope_in_kernel else identity)
        q_eff = Rope(inv_freq)(q, r["pos"]) if rope_in_kernel else q
        relu = np.maximum(q_eff.astype(np.float64) @ r["keys"].T.astype(np.float64), 0)
        ref_scores = np.einsum("th,thn->tn", index_weights(r["x"], dim).astype(np.float64), relu)
        results.append((sel[row:row + n], scores[row:row + n], mask, ref_scores, v))
        row += n
    return results


def check_selection(results, topk, tol, exact=False):
    """Scores within tol of float64 numpy; the selection exactly the top-k of the kernel's own scores
    (ties toward the lower index); against the reference's selection exact, or differing only on
    entries within tol of the k-th score."""
    flips = 0
    for sel, scores, mask, ref_scores, visible in results:
        for t in range(len(sel)):
            v, k = visible[t], min(topk, visible[t])
            got, want = scores[t, :v], ref_scores[t, :v]  # ‖a−b‖ ≤ tol·‖b‖: all-zero rows must be exact
            assert np.isfinite(got).all() and np.linalg.norm(got - want) <= tol * np.linalg.norm(want), t
            own = np.sort(np.argsort(-got, kind="stable")[:k])
            ref = np.flatnonzero(mask[t])
            got = sel[t]
            assert np.all(got[k:] == -1) and len(ref) == k
            got = got[:k]
            assert np.array_equal(got, own), (t, np.setxor1d(got, own)[:8])
            if exact:
                assert np.array_equal(got, ref), (t, got[:8], ref[:8])
                continue
            differ = np.setxor1d(got, ref)
            if len(differ):
                s = ref_scores[t, :v]
                kth = np.sort(s)[-k]
                assert np.all(np.abs(s[differ] - kth) <= tol * np.abs(s).max()), (t, differ)
                flips += len(differ)
    return flips


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_flash_decode(rt, dtype):
    """Many requests × one query: visible ≫ k, = k ± 1, < k, one entry, none; padding rows."""
    rng = np.random.default_rng(11)
    reqs = []
    for n in [16384, 5000, 513, 512, 511, 100, 1, 0]:
        pos = 4 * n - 1 + int(rng.integers(0, 4)) if n else 2
        reqs.append(make_request(rng, dtype, n, [pos], 64, 128))
    results = run_indexer(rt, dtype, reqs, topk=512, rope_dim=64, rope_in_kernel=True, pad_rows=3)
    check_selection(results, 512, SCORE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_flash_prefill_chunk(rt, dtype):
    """One chunk of one request whose visible count crosses k; the caller ropes q."""
    rng = np.random.default_rng(12)
    p0, n = 1950, 200
    req = make_request(rng, dtype, (p0 + n) // 4, np.arange(p0, p0 + n), 64, 128)
    check_selection(run_indexer(rt, dtype, [req], topk=512, rope_dim=64, rope_in_kernel=False), 512, SCORE_TOL[dtype])


@pytest.mark.parametrize("dtype, ties", [(np.float32, False), (BF16, False), (np.float32, True)])
def test_indexer_prefill_rows_take_one_block_each(rt, dtype, ties):
    """A step of 400 rows (beyond CLUSTER_ROWS × SMs: one top-k block per row), visible counts crossing k;
    with keys from three vectors, the ties at the k-th score (float32: bf16 scores of identical keys err
    alike, beyond the score tolerance, and the top-k reads float32 scores in both builds)."""
    rng = np.random.default_rng(14)
    p0, n = 1900, 400
    keys = rng.standard_normal((3, 128), dtype=np.float32)[rng.integers(0, 3, (p0 + n) // 4)] if ties else None
    req = make_request(rng, dtype, (p0 + n) // 4, np.arange(p0, p0 + n), 64, 128, keys=keys)
    check_selection(run_indexer(rt, dtype, [req], topk=512, rope_dim=64, rope_in_kernel=True), 512, SCORE_TOL[dtype],
                    exact=ties)


@pytest.mark.parametrize("rope_in_kernel", [True, False])
def test_indexer_prefill_step_on_wgmma(rt, rope_in_kernel):
    """A step of two prefill chunks and a decode row, 403 + 301 + 1 rows and 2 of padding (at least WGMMA_MIN_ROWS:
    the wgmma kernel on sm_90a, its 4-row groups straddling the requests), visible counts crossing k and the
    128-key tiles."""
    skip_without_wgmma(rt)
    rng = np.random.default_rng(15)
    reqs = [make_request(rng, BF16, 2303 // 4, np.arange(1900, 2303), 64, 128),
            make_request(rng, BF16, 301 // 4, np.arange(0, 301), 64, 128),
            make_request(rng, BF16, 3000, [4 * 3000 - 1], 64, 128)]
    launched = []
    results = run_indexer(rt, BF16, reqs, topk=512, rope_dim=64, rope_in_kernel=rope_in_kernel, pad_rows=2,
                          launched=launched)
    assert "indexer_scores_wgmma<false>" in launched
    check_selection(results, 512, SCORE_TOL[BF16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim, rope_dim, topk", [(32, 16, 16, 8), (40, 64, 16, 20)])
def test_indexer_odd_sizes(rt, dtype, heads, dim, rope_dim, topk):
    """tiny-a's indexer (32 heads of 16, rope over all of it) and an odd head count; two prefill chunks."""
    rng = np.random.default_rng(heads)
    reqs = [make_request(rng, dtype, 25, np.arange(0, 100), heads, dim),
            make_request(rng, dtype, 21, np.arange(37, 87), heads, dim)]
    results = run_indexer(rt, dtype, reqs, topk=topk, rope_dim=rope_dim, rope_in_kernel=True, pad_rows=1)
    check_selection(results, topk, SCORE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_ties_go_to_lower_indices(rt, dtype):
    """Keys drawn from three vectors (three distinct scores per query) and all-zero weights (all scores 0)."""
    rng = np.random.default_rng(13)
    base = rng.standard_normal((3, 128), dtype=np.float32)
    reqs = []
    for n in [2000, 700, 300]:
        keys = base[rng.integers(0, 3, n)]
        reqs.append(make_request(rng, dtype, n, [4 * n - 1, 4 * n - 5], 64, 128, keys=keys))
    reqs.append(make_request(rng, dtype, 1500, [5999, 3000], 64, 128, x=np.zeros((2, 64), np.float32)))
    results = run_indexer(rt, dtype, reqs, topk=512, rope_dim=64, rope_in_kernel=True)
    check_selection(results, 512, SCORE_TOL[dtype], exact=True)


LONG = 262144  # visible entries of a 1M-token context


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_long_context_one_row(rt, dtype):
    rng = np.random.default_rng(21)
    req = make_request(rng, dtype, LONG, [4 * LONG - 1], 64, 128)
    results = run_indexer(rt, dtype, [req], topk=512, rope_dim=64, rope_in_kernel=True)
    check_selection(results, 512, SCORE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_long_context_rows(rt, dtype):
    """Rows of two requests whose visible counts differ (n_max odd: rows start off float4 alignment);
    the second request's keys come from 300 vectors, so the k-th score's ties cross the blocks' shares."""
    rng = np.random.default_rng(22)
    n, m = LONG - 1, 70001
    a = make_request(rng, dtype, n, [4 * n - 1, 4 * n - 2000, 4 * n - 4001], 64, 128)
    keys = rng.standard_normal((300, 128), dtype=np.float32)[rng.integers(0, 300, m)]
    b = make_request(rng, dtype, m, [4 * m - 1, 4 * m - 9001], 64, 128, keys=keys)
    results = run_indexer(rt, dtype, [a, b], topk=512, rope_dim=64, rope_in_kernel=True, pad_rows=1)
    check_selection(results, 512, SCORE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_long_context_ties(rt, dtype):
    """Three distinct scores per row over 262,143 entries (identical keys score bit for bit the same), and
    a row of zeros: no digit narrows the candidates, every pass reads the row."""
    rng = np.random.default_rng(23)
    base = rng.standard_normal((3, 128), dtype=np.float32)
    n = LONG - 1
    reqs = [make_request(rng, dtype, n, [4 * n - 1, 4 * n - 400], 64, 128, keys=base[rng.integers(0, 3, n)]),
            make_request(rng, dtype, 100000, [4 * 100000 - 1], 64, 128, x=np.zeros((1, 64), np.float32))]
    results = run_indexer(rt, dtype, reqs, topk=512, rope_dim=64, rope_in_kernel=True)
    scores, visible = results[0][1], results[0][4]
    assert all(len(np.unique(scores[t, :visible[t]])) == 3 for t in range(2))
    check_selection(results, 512, SCORE_TOL[dtype])
