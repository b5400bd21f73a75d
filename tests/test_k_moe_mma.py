"""The bf16 build's grouped expert GEMMs on the tensor cores (cuda_src/moe_mma.cu, cuda_src/moe_wgmma.cu): alone
against a float64 grouped GEMM on hand-made sorts (experts of 0, 1, 7, 63, 64, 130 and 200 rows, column tiles past n,
1 to 8 k steps), gated and not, gathered and not; then in the whole MoE layer against reference.moe.MoE at Flash-like
widths; and which kernel a layer takes."""
import re

import numpy as np
import pytest

from conftest import rel_rows, skip_without_wgmma
from moe_cases import BF16, fetch, held, ran
from test_k_gemm_fp8 import kernel_sass, nvdisasm
from test_k_moe import Layer, build, check_sort

COUNTS = np.array([0, 1, 64, 130, 0, 63, 200, 7])  # rows per expert, 155 tokens x 3 slots
ACTIVE = 3
SPARE = 64  # output rows past the sorted ones: a partial tile's rows past its expert must leave them alone


def bf16_values(a: np.ndarray) -> np.ndarray:
    return a.astype(BF16).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(128, 64), (192, 256), (64, 192), (320, 512)])
@pytest.mark.parametrize("gated, gathered", [(True, True), (False, False), (False, True)],
                         ids=["gated", "plain", "plain-gathered"])
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
def test_grouped_gemm(rt, dev, n, k, gated, gathered, wgmma):
    from dsv4rt.model.moe import MMA_ROWS, WGMMA_ROWS, grouped_mma
    if wgmma:
        skip_without_wgmma(rt)
    rng = np.random.default_rng(n + k + 2 * gated + gathered)
    experts, pairs = len(COUNTS), int(COUNTS.sum())
    offsets = np.concatenate([[0], np.cumsum(COUNTS)]).astype(np.int32)
    tiles = -(-COUNTS // (WGMMA_ROWS if wgmma else MMA_ROWS))
    tile_offsets = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)
    perm = rng.permutation(pairs).astype(np.int32)
    a = bf16_values(rng.standard_normal((pairs // ACTIVE if gathered else pairs, k)))
    rows = a[perm // ACTIVE] if gathered else a
    w = [bf16_values(rng.standard_normal((experts, n, k)) * k ** -0.5) for _ in range(2 if gated else 1)]
    weight = rng.uniform(0.1, 2.0, pairs).astype(np.float32)
    limit = 1.5  # the products are ~N(0, 1): both clamps bite

    ref = np.empty((pairs, n))
    for e in range(experts):
        s = slice(offsets[e], offsets[e + 1])
        acc = rows[s] @ w[0][e].T
        if gated:
            g, u = np.minimum(acc, limit), np.clip(rows[s] @ w[1][e].T, -limit, limit)
            acc = g / (1 + np.exp(-g)) * u * weight[perm[s]][:, None]
        ref[s] = acc

    mats = [dev(m.astype(BF16)) for m in w]
    tables = [dev(np.array([m.ptr + i * n * k * 2 for i in range(experts)], np.uint64)) for m in mats]
    out = dev(np.full((pairs + SPARE, n), np.nan, BF16))
    dperm, dweight = dev(perm), dev(weight)
    grouped_mma(rt.device, BF16, out.ptr, dev(a.astype(BF16)).ptr, dperm.ptr if gathered else None, ACTIVE,
                dweight.ptr if gated else None, tables[0].ptr, tables[1].ptr if gated else None, dev(offsets).ptr,
                dev(tile_offsets).ptr, experts, int(tiles.sum()) + 3, n, k, limit, wgmma=wgmma)(rt.stream)
    y = fetch(rt, out, (pairs + SPARE, n), BF16).astype(np.float64)
    assert np.isnan(y[pairs:]).all()
    y = y[:pairs]
    assert np.isfinite(y).all()
    # bf16 rounding of the output (2^-9 relative) dominates; fp32 sums of ≤ 256 products stay far below the floor.
    bad = np.abs(y - ref) > 2.0 ** -8 * np.abs(ref) + 1e-5 * np.abs(ref).max()
    assert not bad.any(), (np.argwhere(bad)[:8], y[bad][:8], ref[bad][:8])


@pytest.mark.parametrize("dtype, n, k", [(np.float32, 128, 128), (BF16, 96, 128), (BF16, 128, 200)])
def test_refuses_other_operands(dtype, n, k):
    from dsv4rt.model.moe import grouped_mma, mma_fits
    assert not mma_fits(dtype, n, k)
    with pytest.raises(ValueError, match="bf16 operands with n and k multiples of 64"):
        grouped_mma(None, dtype, 0, 0, None, 1, None, 0, None, 0, 0, 8, 1, n, k, 1.0)


@pytest.fixture(scope="module")
def wide():
    """Flash-like widths (multiples of 64, k of 8 and 16 steps) with experts of several row tiles."""
    yield from held(Layer(dim=512, inter=256, experts=16, active=4, limit=6.0))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [200, 700])
@pytest.mark.parametrize("hashed", [False, True], ids=["routed", "hash"])
@pytest.mark.parametrize("with_shared", [True, False], ids=["shared", "no-shared"])
@pytest.mark.parametrize("path", ["mma", "wgmma"])
def test_layer(rt, blas, wide, tokens, hashed, with_shared, path):
    if path == "wgmma":
        skip_without_wgmma(rt)
    with ran(rt, blas, wide, build, BF16, tokens, hashed, seed=5000 + tokens, with_shared=with_shared,
             path=path) as (moe, x, ids, y):
        names = ["moe_gemm_wgmma<true>", "moe_gemm_wgmma<false>"] if path == "wgmma" else \
            ["moe_gemm_mma<true>", "moe_gemm_mma<false>"]
        assert [launch.kernel.name for launch in moe.grouped] == names
        ref = wide.reference(hashed, with_shared)
        err = rel_rows(y, ref(x, ids)).max()
        assert err < 1e-2, err
        counts = check_sort(moe, ref.route(x, ids)[0], tokens * wide.active)
    assert (counts % moe.tile_rows).any()
    if tokens == 700:
        assert counts.max() > 2 * 64


@pytest.mark.parametrize("tokens, experts, dtype, arch, path", [
    (64, 32, BF16, "sm_90a", "wgmma"),      # flash-slice's batch of 64: 12 rows an expert
    (64, 32, BF16, "sm_80", "mma"),
    (16, 32, BF16, "sm_90a", "skinny"),     # 3 rows an expert
    (64, 256, BF16, "sm_90a", "skinny"),    # Flash's batch of 64: 1.5 rows an expert
    (64, 32, np.float32, "sm_90a", "skinny"),
    (100, 32, np.float32, "sm_90a", "tiled"),
])
def test_grouped_path(tokens, experts, dtype, arch, path):
    from dsv4rt.model.moe import MoeDims, grouped_path
    assert grouped_path(arch, dtype, MoeDims(tokens, 4096, 2048, experts, 6, 2048)) == path


@pytest.mark.parametrize("tokens, dim, inter, dtype, arch, path", [
    (8192, 4096, 2048, BF16, "sm_90a", "wgmma"),
    (8192, 4096, 2048, BF16, "sm_80", "skinny"),       # no wgmma
    (8192, 4096, 2048, np.float32, "sm_90a", "skinny"),
    (8192, 160, 96, BF16, "sm_90a", "skinny"),         # widths off the 128 grid
    (16, 4096, 2048, BF16, "sm_90a", "skinny"),        # 3 rows an expert
])
def test_fp4_path(tokens, dim, inter, dtype, arch, path):
    from dsv4rt.model.moe import MoeDims
    from dsv4rt.model.moe_fp4 import fp4_path
    assert fp4_path(arch, dtype, MoeDims(tokens, dim, inter, 32, 6, inter)) == path


@pytest.mark.skipif(nvdisasm() is None, reason="no nvdisasm on PATH or in the nvidia wheels")
def test_wgmma_step_keeps_its_copy_pointers(tmp_path, monkeypatch):
    """moe_gemm_wgmma's k step as dsv4rt builds it for sm_90a, from its barrier to its last wgmma: twelve weight-row
    copies (a's come before the barrier) from pointers held across the loop. When ptxas recomputed each row's 64-bit
    product there instead (IMAD.WIDE.U32), a step took 176 instructions and the bf16 8K prefill's experts 37.6 ms
    against 30.1 (ncu, H200); it takes 102."""
    module, sass = kernel_sass(tmp_path, monkeypatch, "moe_wgmma")
    bodies = dict(re.findall(r"//-+ \.text\.(\S+) -+\n(.*?)(?=//-+ \.text\.|\Z)", sass, re.S))
    assert sorted(bodies) == sorted(module.lowered.values())
    for symbol, body in bodies.items():
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", body)
        start = next(i for i, op in enumerate(ops) if op.startswith("BAR.SYNC"))
        end = next(i for i in range(start, len(ops)) if "HGMMA" in ops[i] and "gsb0" in ops[i])
        step = [op for op in ops[start:end + 1] if not op.startswith("NOP")]
        assert sum(op.startswith("LDGSTS") for op in step) == 12, symbol
        assert not any("IMAD.WIDE.U32" in op for op in step), symbol
        assert len(step) <= 120, (symbol, len(step))
