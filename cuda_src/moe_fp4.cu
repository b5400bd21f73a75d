// dsv4rt-instantiate: moe_fp4_skinny<float,2> moe_fp4_skinny<float,1> moe_fp4_skinny<__nv_bfloat16,1>
#include <cuda_fp8.h>
#include "common.cuh"
#include "fp8.cuh"
#include "moe.cuh"

// The routed experts of the faithful decode MoE (docs/model.md#moe, docs/numerics.md) on their weights as released: packed
// e2m1 [n, k/2] (low nibble = even column) with an e8m0 scale per 1 x 32, against activations from act_quant (e4m3
// with an e8m0 scale per 128 columns of a row). Hopper's tensor cores take e4m3, not e2m1, so each weight row's
// 128-column group is re-expressed in e4m3 under one exponent: with s_max the largest of the group's four block
// scales, code x of a block with scale s becomes v = x·2^(s − s_max + 6), at most 6·64 = 384, and the weight is
// v·2^(s_max − 133). That is exact for every block within 14 binades of s_max (v down to 2^-9, e4m3's smallest
// subnormal); blocks further below round onto that grid, an error of at most 2^(s_max − 143), 2^-16/6 of the
// group's range.
// mma m16n8k32 then gives the group's dot products in fp32, scaled by 2^(s_max − 133) · 2^(x_scale − 127) (exact
// but for products below 2^-149).
constexpr int kFp4Block = 32;     // columns per weight scale
constexpr int kFp4Rows = 8;       // activation rows of a tile: the mma's n (moe_sort with tile_rows 8)
constexpr int kFp4MaxWarps = 8;
constexpr int kFp4InFlight = 4;   // weight 16-byte vectors a thread loads before it computes (per row pair)

// Grouped GEMM over the expert-sorted rows for decode tiles: out[r, c] = a_row(r) · W_e[c]ᵀ for the rows r of the
// 8-row tile blockIdx.y (moe_sort with tile_rows 8; tiles past the total return at once) and 16 columns from
// 16·blockIdx.x. a_row(r) is xq[perm[r] / active] when perm is given (tokens gathered on the fly), else xq[r];
// x_scale likewise. M = 2 takes a second weight into out_second (w1 and w3 of the same rows), M = 1 one. w_* and
// s_* are pointer tables [experts] of the packed weights [n, k/2] and their scales [n, k/32]. k must be a multiple
// of 32, xq and the weights 16-byte aligned (scales are read bytewise).
//
// The block's warps split the 128-column groups and sum through shared memory at the end. Thread (g = lane / 4,
// t = lane % 4) loads, of each group, block t (16 bytes) of weight rows g and g + 8 and columns 32t..32t + 31 of
// activation row g; the quad's shuffles give s_max. Word q of those 16 bytes, columns 32t + 8q.., fills the k
// slots 4t.. and 16 + 4t.. of the group's mma q, and activation bytes 8q.. the same slots: the k order of a dot
// product is free, as long as a slot means one column in every thread.
template <typename OutT, int M>
__global__ void __launch_bounds__(32 * kFp4MaxWarps)
    moe_fp4_skinny(OutT* out, OutT* out_second, const unsigned char* xq, const unsigned char* x_scale, const int* perm,
                   int active, const unsigned long long* w_first, const unsigned long long* s_first,
                   const unsigned long long* w_second, const unsigned long long* s_second, const int* offsets,
                   const int* tile_offsets, int experts, int n, int k) {
    constexpr int U = kFp4InFlight / M;  // groups a warp loads at once
    __shared__ float partial[kFp4MaxWarps][M][kFp4Rows * 16];
    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kFp4Rows, rows = min(kFp4Rows, offsets[e + 1] - row0);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int n0 = blockIdx.x * 16, blocks = k / kFp4Block, groups = (k + kFp8Block - 1) / kFp8Block;

    // Rows past n or past the tile repeat a valid one and are never stored.
    const unsigned char* wrow[M][2];
    const unsigned char* srow[M][2];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const size_t row = min(n0 + g + 8 * r, n - 1);
            wrow[m][r] = reinterpret_cast<const unsigned char*>((m ? w_second : w_first)[e]) + row * (k / 2);
            srow[m][r] = reinterpret_cast<const unsigned char*>((m ? s_second : s_first)[e]) + row * blocks;
        }
    const auto act_row = [&](int r) { return perm ? perm[row0 + min(r, rows - 1)] / active : row0 + min(r, rows - 1); };
    const unsigned char* xrow = xq + static_cast<size_t>(act_row(g)) * k;
    const unsigned char* xs[2] = {x_scale + static_cast<size_t>(act_row(2 * t)) * groups,
                                  x_scale + static_cast<size_t>(act_row(2 * t + 1)) * groups};

    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[M][4] = {};
    for (int kb0 = warp; kb0 < groups; kb0 += U * warps) {
        uint4 w[U][M][2];
        int s[U][M][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int block = 4 * (kb0 + u * warps) + t;
            const bool ok = block < blocks;  // kb0 + u·warps past the groups too
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    w[u][m][r] = ok ? load_stream(wrow[m][r] + kFp4Block / 2 * block) : zero;
                    s[u][m][r] = ok ? __ldg(srow[m][r] + block) : 0;  // 0 leaves the group's s_max as it is
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * warps;
            if (kb >= groups) break;
            const int col = kFp8Block * kb + 32 * t;
            uint4 a[2] = {zero, zero};
            if (col < k) {
                a[0] = __ldg(reinterpret_cast<const uint4*>(xrow + col));
                a[1] = __ldg(reinterpret_cast<const uint4*>(xrow + col + 16));
            }
            const float xf[2] = {pow2(__ldg(xs[0] + kb) - 127), pow2(__ldg(xs[1] + kb) - 127)};
#pragma unroll
            for (int m = 0; m < M; ++m) {
                uint2 table[2];
                float wf[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    int smax = max(s[u][m][r], __shfl_xor_sync(0xffffffffu, s[u][m][r], 1));
                    smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, 2));
                    table[r] = e2m1_table(s[u][m][r] - smax + 6);
                    wf[r] = pow2(smax - 133);
                }
                float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const unsigned w0 = word(w[u][m][0], q), w1 = word(w[u][m][1], q);
                    mma<Mma::e4m3>(d, e2m1x4_to_e4m3(w0, table[0]), e2m1x4_to_e4m3(w1, table[1]),
                                   e2m1x4_to_e4m3(w0 >> 16, table[0]), e2m1x4_to_e4m3(w1 >> 16, table[1]),
                                   word(a[q >> 1], 2 * (q & 1)), word(a[q >> 1], 2 * (q & 1) + 1));
                }
                // d[c]: weight row g + 8·(c / 2), activation row 2t + c % 2 of the tile
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[m][c] = fmaf(d[c], wf[c >> 1] * xf[c & 1], acc[m][c]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) partial[warp][m][(2 * t + (c & 1)) * 16 + g + 8 * (c >> 1)] = acc[m][c];
    __syncthreads();
    for (int i = threadIdx.x; i < kFp4Rows * 16; i += blockDim.x) {
        const int r = i / 16, col = n0 + i % 16;
        if (r >= rows || col >= n) continue;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum = 0.f;
            for (int v = 0; v < warps; ++v) sum += partial[v][m][i];
            (m ? out_second : out)[static_cast<size_t>(row0 + r) * n + col] = from_float<OutT>(sum);
        }
    }
}
