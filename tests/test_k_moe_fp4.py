"""cuda_src/moe_fp4.cu and model/moe_fp4.py against numpy (docs/model.md#moe, docs/formats.md#storage-formats). The fp4 expert GEMM reads
the checkpoint layout: one-hot activation rows give Wᵀ bit for bit against loader.formats.dequant_fp4 (nibble
order, scale indexing, groups cut short by k, gathered rows). The decode MoE against reference.moe.MoE with
act_quant in front of every expert GEMM over the dequantised weights: Flash sizes (32 experts, top 6), odd sizes,
block scales spread wider than e4m3 holds exactly; 1, 3 and 8 tokens; hash and routed layers; float32 and bf16
builds; a replayed graph; every layer of a released-format checkpoint uploaded with load_weights(raw=True)."""
import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows, skip_without_wgmma
from moe_cases import BF16, VOCAB, bf16_grid, check_graph_replay, every_layer_kind, fetch, held, layer_inputs, ran, \
    untied_inputs, upload
from test_k_fp8 import act_quant_bytes
from dsv4rt.loader.formats import dequant_fp4, dequant_fp8
from dsv4rt.reference import quant
from dsv4rt.reference.moe import Expert, MoE as MoERef
from dsv4rt.reference.ops import Linear

pytestmark = pytest.mark.gpu


def fp4_weight(rng, n: int, k: int, spread: int):
    """Packed e2m1 [n, k/2] of every code (−0 too) and e8m0 scales [n, k/32], `spread` binades either side of the
    level that keeps unit inputs at unit outputs (2.93 is the rms of the eight magnitudes)."""
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    level = 127 - round(float(np.log2(2.93 * np.sqrt(k))))
    return packed, (level + rng.integers(-spread, spread + 1, (n, k // 32))).astype(np.uint8)


def fp8_weight(rng, n: int, k: int):
    """e4m3 [n, k] of normal draws and e8m0 scales per 128 x 128 tile around the level of unit outputs."""
    codes = (rng.standard_normal((n, k), dtype=np.float32) * 32).astype(ml_dtypes.float8_e4m3fn)
    level = 127 - round(float(np.log2(32 * np.sqrt(k))))
    return codes, (level + rng.integers(-1, 2, (-(-n // 128), -(-k // 128)))).astype(np.uint8)


# --- the expert GEMM on one expert ----------------------------------------------------------------------------

def run_expert_gemm(rt, dev, out_dtype, xq, xs, weights, n, k, perm=None, active=1):
    """moe_fp4.expert_gemm on one expert whose rows are all of xq (or perm's gather); weights: one or two
    (packed, scales). Returns the outputs as float32."""
    from dsv4rt.model import moe_fp4
    from dsv4rt.model.moe import pointer_table
    m = len(xq) if perm is None else len(perm)
    tiles = -(-m // moe_fp4.TILE_ROWS)
    tables = [pointer_table(rt.arena, [dev(a).ptr]) for pair in weights for a in pair]
    outs = [dev(np.full((m, n), np.nan, out_dtype)) for _ in weights]
    second = {} if len(weights) == 1 else dict(out_second=outs[1].ptr, w_second=tables[2].ptr,
                                               w_second_scale=tables[3].ptr)
    moe_fp4.expert_gemm(rt.device, out_dtype, outs[0].ptr, dev(xq).ptr, dev(xs).ptr, tables[0].ptr, tables[1].ptr,
                        dev(np.array([0, m], np.int32)).ptr, dev(np.array([0, tiles], np.int32)).ptr, 1, tiles, n, k,
                        perm=None if perm is None else dev(perm.astype(np.int32)).ptr, active=active,
                        **second)(rt.stream)
    got = [fetch(rt, o, (m, n), out_dtype).astype(np.float32) for o in outs]
    for t in tables:
        t.free()
    return got


def one_hot(k: int):
    """act_quant of the identity: row j is column j alone (256 · 2^-8, exact)."""
    xq, xs, _ = act_quant_bytes(np.eye(k, dtype=np.float32))
    return xq, xs


@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
@pytest.mark.parametrize("n, k", [(40, 256), (24, 160), (16, 32), (100, 4096), (2048, 224)])
def test_expert_gemm_reads_the_checkpoint_layout(rt, dev, out_dtype, n, k):
    """One-hot activation rows pick single weight columns, so out = Wᵀ bit for bit with W = dequant_fp4: every
    nibble, block scale and 128-column group lands where loader.formats puts it. Scales over 15 binades, the most
    that e4m3 holds exactly; k = 160, 32 and 224 end in a short group; n = 40, 24 and 100 in a short column block."""
    rng = np.random.default_rng(n * 7 + k)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    scale = rng.integers(113, 128, (n, k // 32)).astype(np.uint8)
    (out,) = run_expert_gemm(rt, dev, out_dtype, *one_hot(k), [(packed, scale)], n, k)
    assert np.array_equal(out, dequant_fp4(packed, scale).T.astype(out_dtype).astype(np.float32))


def test_expert_gemm_gathers_rows_for_two_weights(rt, dev):
    """Two weights in one pass (w1 and w3) on rows gathered through perm, as the routed up-projection runs: row r of
    each output is column perm[r] / active of its weight; 29 rows, three full tiles and a short one."""
    n, k, active = 48, 192, 3
    rng = np.random.default_rng(7)
    weights = [(rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8),
                rng.integers(115, 130, (n, k // 32)).astype(np.uint8)) for _ in range(2)]
    perm = rng.permutation(k * active)[:29]
    got = run_expert_gemm(rt, dev, np.float32, *one_hot(k), weights, n, k, perm=perm, active=active)
    for out, (w, s) in zip(got, weights):
        assert np.array_equal(out, dequant_fp4(w, s).T[perm // active])


def test_scales_beyond_e4m3_round_within_the_bound(rt, dev):
    """Block scales over 50 binades: a block more than 14 below its group's largest scale s_max is off by at most
    2^(s_max − 143) per weight (half of e4m3's smallest subnormal step under the group's exponent), the rest exact."""
    n, k = 64, 512
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    scale = rng.integers(90, 140, (n, k // 32)).astype(np.uint8)
    (out,) = run_expert_gemm(rt, dev, np.float32, *one_hot(k), [(packed, scale)], n, k)
    s = np.repeat(scale.astype(np.int64), 32, axis=1)
    s_max = np.repeat(scale.reshape(n, -1, 4).max(axis=2).astype(np.int64), 128, axis=1)
    bound = np.where(s >= s_max - 14, 0.0, np.ldexp(1.0, s_max - 143))
    assert (bound > 0).mean() > 0.1
    assert np.all(np.abs(out.astype(np.float64) - dequant_fp4(packed, scale).T) <= bound.T)


def test_expert_gemm_refuses_k_off_32():
    from dsv4rt.model import moe_fp4
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_fp4.expert_gemm(None, np.float32, 0, 0, 0, 0, 0, 0, 0, 1, 1, 64, 48)


# --- the decode MoE -------------------------------------------------------------------------------------------

class Layer:
    """Random weights in the released formats: routed experts packed e2m1, windows at random row offsets of two
    pools (w1/w3 rows [inter, dim], w2 rows [dim, inter]: distinct matrices, cheap at Flash sizes); the shared
    expert e4m3; gate and inputs on the bf16 grid, so the float32 and bf16 builds route alike."""

    def __init__(self, dim, inter, experts, active, limit, spread=2, scaling=1.5):
        self.dim, self.inter, self.experts, self.active, self.limit, self.scaling = dim, inter, experts, active, \
            limit, scaling
        rng = np.random.default_rng(dim + experts + spread)
        self.gate = bf16_grid(rng.standard_normal((experts, dim), dtype=np.float32) * dim ** -0.5)
        self.bias = (rng.standard_normal(experts) * 0.3).astype(np.float32)
        self.pools = dict(up=fp4_weight(rng, 4 * inter, dim, spread), down=fp4_weight(rng, 4 * dim, inter, spread))
        self.dense = {p: dequant_fp4(*w) for p, w in self.pools.items()}
        self.rows = dict(w1=rng.integers(0, 3 * inter + 1, experts), w3=rng.integers(0, 3 * inter + 1, experts),
                         w2=rng.integers(0, 3 * dim + 1, experts))
        self.shared = dict(w1=fp8_weight(rng, inter, dim), w3=fp8_weight(rng, inter, dim),
                           w2=fp8_weight(rng, dim, inter))
        self.shared_dense = {m: dequant_fp8(*w) for m, w in self.shared.items()}
        self.tid2eid = np.argsort(rng.random((VOCAB, experts)), axis=1)[:, :active].astype(np.int32)
        self.held, self.gates, self.device = [], {}, None

    def matrix(self, name: str, e: int) -> np.ndarray:
        pool, n = ("down", self.dim) if name == "w2" else ("up", self.inter)
        return self.dense[pool][self.rows[name][e]:self.rows[name][e] + n]

    def reference(self, hashed: bool) -> MoERef:
        def expert(w1, w2, w3):
            return Expert(*(Linear(w, quant.act_quant) for w in (w1, w2, w3)), self.limit)
        routed = [expert(*(self.matrix(m, e) for m in ("w1", "w2", "w3"))) for e in range(self.experts)]
        shared = expert(*(self.shared_dense[m] for m in ("w1", "w2", "w3")))
        return MoERef(self.gate, None if hashed else self.bias, self.tid2eid if hashed else None, routed, shared,
                      self.active, self.scaling)

    def on_device(self, rt, dtype):
        """(Fp4Experts, Fp8Expert, gate address): the formats' bytes once, the gate per storage type."""
        from dsv4rt.model.moe import pointer_table
        from dsv4rt.model.moe_fp4 import Fp4Experts, Fp8Expert
        if self.device is None:
            pools = {p: [upload(rt, a) for a in w] for p, w in self.pools.items()}
            shared = {m: [upload(rt, a) for a in w] for m, w in self.shared.items()}
            self.held += [b for bufs in (*pools.values(), *shared.values()) for b in bufs]

            def table(m: str, part: int):
                pool, k = ("down", self.inter) if m == "w2" else ("up", self.dim)
                row_bytes = k // 2 if part == 0 else k // 32
                t = pointer_table(rt.arena, [pools[pool][part].ptr + int(r) * row_bytes for r in self.rows[m]])
                self.held.append(t)
                return t.ptr
            routed = Fp4Experts(*(table(m, part) for part in (0, 1) for m in ("w1", "w3", "w2")))
            fp8 = Fp8Expert(*(shared[m][part].ptr for part in (0, 1) for m in ("w1", "w3", "w2")))
            self.bias_buf, self.tid2eid_buf = upload(rt, self.bias), upload(rt, self.tid2eid)
            self.held += [self.bias_buf, self.tid2eid_buf]
            self.device = routed, fp8
        if dtype not in self.gates:
            self.gates[dtype] = upload(rt, self.gate.astype(dtype))
            self.held.append(self.gates[dtype])
        return (*self.device, self.gates[dtype].ptr)

    def free(self):
        for b in self.held:
            b.free()
        self.held, self.gates, self.device = [], {}, None

    inputs = layer_inputs

def build(rt, blas, layer: Layer, dtype, tokens: int, hashed: bool, x_buf, y_buf, path=None):
    from dsv4rt.model.moe import MoeDims
    from dsv4rt.model.moe_fp4 import Fp4MoE, workspace_bytes
    routed, shared, gate = layer.on_device(rt, dtype)
    dims = MoeDims(tokens, layer.dim, layer.inter, layer.experts, layer.active, layer.inter)
    ws, ids = rt.arena.alloc(workspace_bytes(dims, dtype)), rt.arena.alloc(4 * tokens)
    moe = Fp4MoE(rt.device, blas, dtype, dims, x=x_buf.ptr, y=y_buf.ptr, gate=gate, routed=routed, shared=shared,
                 scaling=layer.scaling, limit=layer.limit, workspace=ws.ptr,
                 bias=None if hashed else layer.bias_buf.ptr, tid2eid=layer.tid2eid_buf.ptr if hashed else None,
                 ids=ids.ptr if hashed else None, path=path)
    return moe, ws, ids


def routed_sets(moe) -> np.ndarray:
    from dsv4rt.cuda.driver import check, drv
    d = moe.dims
    idx = np.empty((d.tokens, d.active), np.int32)
    check(drv().cuMemcpyDtoH(idx.ctypes.data, moe.scratch["idx"], idx.nbytes))
    return np.sort(idx, axis=1)


def run_and_compare(rt, blas, layer: Layer, dtype, tokens: int, hashed: bool, seed: int, path=None, worst=1e-2):
    with ran(rt, blas, layer, build, dtype, tokens, hashed, seed, path=path) as (moe, x, ids, y):
        ref_moe = layer.reference(hashed)
        assert np.array_equal(routed_sets(moe), np.sort(ref_moe.route(x, ids)[0], axis=1))
        err = rel_rows(y, ref_moe(x, ids))
        assert err.max() < worst, err.max()
        assert worst <= 1e-2 or np.median(err) < 4e-3, np.median(err)   # a few flipped rows, not all
        return moe


@pytest.fixture(scope="module")
def flash():
    yield from held(Layer(dim=4096, inter=2048, experts=32, active=6, limit=10.0))


@pytest.fixture(scope="module")
def odd():
    """dim 160 and inter 96 end in short 128-column groups (the w1/w3 and w2 GEMMs' k)."""
    yield from held(Layer(dim=160, inter=96, experts=12, active=3, limit=4.0, spread=3))


@pytest.fixture(scope="module")
def wide():
    """Block scales over 21 binades: groups past what e4m3 holds exactly."""
    yield from held(Layer(dim=256, inter=128, experts=8, active=2, limit=6.0, spread=10))


@every_layer_kind([1, 3, 8])
def test_flash(rt, blas, flash, dtype, hashed, tokens):
    run_and_compare(rt, blas, flash, dtype, tokens, hashed, seed=1000 + tokens)


@every_layer_kind([1, 3, 8, 40])
def test_odd_sizes(rt, blas, odd, dtype, hashed, tokens):
    """40 tokens give experts several tiles each."""
    run_and_compare(rt, blas, odd, dtype, tokens, hashed, seed=2000 + tokens)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 8])
def test_wide_scale_spread(rt, blas, wide, dtype, tokens):
    run_and_compare(rt, blas, wide, dtype, tokens, False, seed=3000 + tokens)


def test_graph_replay_on_new_tokens(rt, blas, flash):
    check_graph_replay(rt, blas, flash, build)


# --- prefill batches on wgmma -----------------------------------------------------------------------------------

def run_fp8_experts(rt, dev, xq, xs, packed, scale, n, k, perm=None, active=1):
    """moe_fp4.fp8_experts (ungated) on one expert whose rows are all of xq (or perm's gather): float32 [rows, n]."""
    from dsv4rt.model import moe_fp4
    from dsv4rt.model.moe import pointer_table
    m = len(xq) if perm is None else len(perm)
    tiles = -(-m // 128)
    tables = [pointer_table(rt.arena, [dev(a).ptr]) for a in (packed, scale)]
    out = dev(np.full((m, n), np.nan, BF16))
    moe_fp4.fp8_experts(rt.device, out.ptr, dev(xq).ptr, dev(xs).ptr, (tables[0].ptr, tables[1].ptr), n=n, k=k,
                        offsets=dev(np.array([0, m], np.int32)).ptr, tile_offsets=dev(np.array([0, tiles], np.int32)).ptr,
                        experts=1, tiles=tiles, perm=None if perm is None else dev(perm.astype(np.int32)).ptr,
                        active=active)(rt.stream)
    got = fetch(rt, out, (m, n), BF16).astype(np.float32)
    for t in tables:
        t.free()
    return got


@pytest.mark.parametrize("n, k, rows", [(256, 256, 256), (128, 512, 200), (384, 128, 77)])
def test_fp8_experts_read_the_checkpoint_layout(rt, dev, n, k, rows):
    """The prefill kernel on one-hot rows: out = Wᵀ bit for bit (each value e2m1 · 2^s, exact in bf16) for scales over
    15 binades: nibble order, scales, the e4m3 re-expression, the swizzle and each row's exponent. 200 and 77 rows end
    in a short tile."""
    skip_without_wgmma(rt)
    rng = np.random.default_rng(n + k + rows)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    scale = rng.integers(113, 128, (n, k // 32)).astype(np.uint8)
    xq, xs = one_hot(k)
    got = run_fp8_experts(rt, dev, xq[:rows], xs[:rows], packed, scale, n, k)
    assert np.array_equal(got, dequant_fp4(packed, scale).T[:rows].astype(BF16).astype(np.float32))


def test_fp8_experts_gather_rows_and_round_wide_scales_within_the_bound(rt, dev):
    """Rows gathered through perm (300 of 3·512 pairs: three tiles), block scales over 50 binades: off by at most
    2^(s_max − 143) per weight where a block is more than 14 binades below its group's largest, as the decode kernel,
    then rounded once to bf16."""
    skip_without_wgmma(rt)
    n, k, active = 256, 512, 3
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    scale = rng.integers(90, 140, (n, k // 32)).astype(np.uint8)
    perm = rng.permutation(k * active)[:300]
    got = run_fp8_experts(rt, dev, *one_hot(k), packed, scale, n, k, perm=perm, active=active)
    s = np.repeat(scale.astype(np.int64), 32, axis=1)
    s_max = np.repeat(scale.reshape(n, -1, 4).max(axis=2).astype(np.int64), 128, axis=1)
    bound = np.where(s >= s_max - 14, 0.0, np.ldexp(1.0, s_max - 143)).T[perm // active]
    want = dequant_fp4(packed, scale).T[perm // active].astype(np.float64)
    assert (bound > 0).mean() > 0.1
    assert np.all(np.abs(got - want) <= bound + np.abs(want) * 2.0 ** -8)


@pytest.mark.gpu
@pytest.mark.parametrize("hashed", [False, True], ids=["routed", "hash"])
@pytest.mark.parametrize("layer_name, tokens", [("flash", 200), ("flash", 700), ("wide", 300)])
def test_wgmma(rt, blas, request, layer_name, tokens, hashed):
    """Experts of one partial to several 128-row tiles (700 x 6 of 32: 131 rows on average), and block scales over
    21 binades (wide). The more pairs, the likelier act_quant of the hidden
    row rounds one element the other way than numpy, whose sums differ in the last bits (H200: one token of 700 at
    1.6e-2): the worst row may sit at 3e-2."""
    skip_without_wgmma(rt)
    moe = run_and_compare(rt, blas, request.getfixturevalue(layer_name), BF16, tokens, hashed, seed=4000 + tokens,
                          path="wgmma", worst=3e-2)
    names = [launch.kernel.name for launch in moe.launches if hasattr(launch, "kernel")]
    assert "moe_fp8_wgmma<true>" in names and "moe_fp8_wgmma<false>" in names



# --- a released-format checkpoint, uploaded raw -----------------------------------------------------------------

@pytest.fixture(scope="module")
def released(tmp_path_factory):
    from dsv4rt.reference import load_model
    from dsv4rt.tiny import make_tiny
    path = make_tiny(tmp_path_factory.mktemp("released") / "tiny", "tiny", 11, fmt="official", shard_gb=0.001)
    return path, load_model(path, "faithful")


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_released_checkpoint_from_raw_weights(rt, blas, released, dtype, tokens):
    """Every layer's MoE of a `make-tiny --format official` checkpoint (hash and routed layers, k = 32: a group of
    one block), wired from load_weights(raw=True) as GpuModel would, against the faithful reference model's."""
    from dsv4rt.loader import Checkpoint
    from dsv4rt.model.moe import MoeDims, pointer_table
    from dsv4rt.model.moe_fp4 import Fp4Experts, Fp4MoE, Fp8Expert, workspace_bytes
    from dsv4rt.model.weights import load_weights
    path, model = released
    with Checkpoint.open(path) as ck:
        cfg = ck.config
        weights = load_weights(ck, dtype, rt.arena, rt.stream, raw=True)
    W, D = weights.arrays, cfg.hidden_size
    dims = MoeDims(tokens, D, cfg.moe_inter, cfg.n_experts, cfg.n_active, cfg.moe_inter)
    ws, dids, dx, dy = (rt.arena.alloc(n) for n in (workspace_bytes(dims, dtype), 4 * tokens,
                                                     tokens * D * np.dtype(dtype).itemsize,
                                                     tokens * D * np.dtype(dtype).itemsize))
    rng = np.random.default_rng(tokens)
    for i in range(cfg.num_layers):
        f, ref = f"layers.{i}.ffn.", model.layers[i].moe
        hashed = cfg.hash_layers[i]
        tables = [pointer_table(rt.arena, [W[f"{f}experts.{e}.{m}.{part}"].ptr for e in range(cfg.n_experts)])
                  for part in ("weight", "scale") for m in ("w1", "w3", "w2")]
        shared = Fp8Expert(*(W[f"{f}shared_experts.{m}.{part}"].ptr for part in ("weight", "scale")
                             for m in ("w1", "w3", "w2")))
        moe = Fp4MoE(rt.device, blas, dtype, dims, x=dx.ptr, y=dy.ptr, gate=W[f + "gate.weight"].ptr,
                     routed=Fp4Experts(*(t.ptr for t in tables)), shared=shared, scaling=cfg.routed_scaling,
                     limit=cfg.swiglu_limit, workspace=ws.ptr, bias=None if hashed else W[f + "gate.bias"].ptr,
                     tid2eid=W[f + "gate.tid2eid"].ptr if hashed else None, ids=dids.ptr if hashed else None)
        x = untied_inputs(rng, ref.gate, ref.bias, cfg.n_active, tokens)
        ids = rng.integers(0, cfg.vocab_size, tokens).astype(np.int32)
        dx.copy_from_host(x.astype(dtype), rt.stream)  # a pageable copy may return before its DMA lands
        dids.copy_from_host(ids)
        moe(rt.stream)
        y = fetch(rt, dy, (tokens, D), dtype).astype(np.float32)
        assert rel_rows(y, ref(x, ids)).max() < 1e-2, i
        for t in tables:
            t.free()
    for b in (ws, dids, dx, dy, weights.buffer):
        b.free()
