// dsv4rt-instantiate: skinny_gemm<float,1,1> skinny_gemm<float,1,2> skinny_gemm<float,1,4> skinny_gemm<float,1,8>
// dsv4rt-instantiate: skinny_gemm<float,2,1> skinny_gemm<float,2,2> skinny_gemm<float,2,4> skinny_gemm<float,2,8>
// dsv4rt-instantiate: skinny_gemm<__nv_bfloat16,1,1> skinny_gemm<__nv_bfloat16,1,2>
// dsv4rt-instantiate: skinny_gemm<__nv_bfloat16,1,4> skinny_gemm<__nv_bfloat16,1,8>
// dsv4rt-instantiate: skinny_gemm<__nv_bfloat16,2,1> skinny_gemm<__nv_bfloat16,2,2>
// dsv4rt-instantiate: skinny_gemm<__nv_bfloat16,2,4> skinny_gemm<__nv_bfloat16,2,8>
#include "common.cuh"

constexpr int kUnit = 64;  // columns of k a warp takes at a time: one 128-byte line of each of its 16 weight rows
constexpr int kStage = 2;  // units a warp loads at once: it holds two stages, one in flight while it uses the other

// A warp's weight registers for one stage: [unit][weight row g, g + 8][j], its elements 32j + 8t .. + 7 of
// the unit (units unit0 + u·splits); zeros past k or past n.
__device__ __forceinline__ void load_stage(uint4 (&a)[kStage][2][2], const __nv_bfloat16* const (&wrow)[2],
                                           const bool (&wok)[2], int unit0, int splits, int k, int t) {
#pragma unroll
    for (int u = 0; u < kStage; ++u)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int at = (unit0 + u * splits) * kUnit + 32 * j + 8 * t;
                a[u][r][j] = wok[r] && at < k ? load_stream<true>(wrow[r] + at) : make_uint4(0, 0, 0, 0);
            }
}

// acc[i] += the stage's weights · the same columns of activation tile i, on the tensor cores.
template <int XT>
__device__ __forceinline__ void use_stage(float (&acc)[XT][4], const uint4 (&a)[kStage][2][2],
                                          const __nv_bfloat16* const (&xrow)[XT], const bool (&xok)[XT], int unit0,
                                          int splits, int k, int t) {
#pragma unroll
    for (int u = 0; u < kStage; ++u) {
        const int base = (unit0 + u * splits) * kUnit;
        if (base >= k) break;
#pragma unroll
        for (int i = 0; i < XT; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int at = base + 32 * j + 8 * t;
                const uint4 b = xok[i] && at < k ? __ldg(reinterpret_cast<const uint4*>(xrow[i] + at))
                                                 : make_uint4(0, 0, 0, 0);
                mma<Mma::bf16>(acc[i], a[u][0][j].x, a[u][1][j].x, a[u][0][j].y, a[u][1][j].y, b.x, b.y);
                mma<Mma::bf16>(acc[i], a[u][0][j].z, a[u][1][j].z, a[u][0][j].w, a[u][1][j].w, b.z, b.w);
            }
    }
}

// Element e of row group rg's [8·XT rows][16 columns] tile, from row m0, if it lies inside y.
template <typename OutT>
__device__ __forceinline__ void store_output(OutT* y, float v, int rg, int e, int m0, int m, int n, int y_ld,
                                             long long y_step, int groups) {
    const int row_groups = (n + 15) / 16, row = m0 + e / 16, col = rg % row_groups * 16 + e % 16;
    if (rg < groups * row_groups && row < m && col < n)
        y[rg / row_groups * y_step + static_cast<long long>(row) * y_ld + col] = from_float<OutT>(v);
}

// y[g] [m, n] = alpha · x[g] [m, k] · w[g]ᵀ for decode batches, w [n, k] row-major bf16, x bf16, fp32 sums
// (twin: gemm.linear's cuBLAS product). Group g starts at x + g·x_step, w + g·w_step, y + g·y_step; x rows
// are x_ld apart, y rows y_ld. k, x_ld and the steps are multiples of 8, x and w 16-byte aligned.
//
// A row group is 16 output columns (weight rows) of one group; row groups are numbered group-major. A block
// holds `per_block` row groups, `parts` warps each (blockDim.x = 32·per_block·parts), and 8·XT rows
// (blockIdx.z); a cluster of S blocks along y splits k with it, so parts·S warps take the 64-column units of
// a row group's k in turn, two stages of kStage units in registers: one stage's loads fly while the other's
// are used, and the weight stream never waits on arithmetic. Each warp streams its 16 weight rows with
// 16-byte loads that bypass L1; the activation rows come through L1, which every warp and block reads alike.
// Tensor cores (mma m16n8k16, weights as the 16-row operand, activations as XT 8-row ones) sum in fp32. A dot
// product over k does not depend on the order of k, so each thread feeds the mma the 8 consecutive elements
// it loaded from each of its rows, wherever the fragment layout would put them: thread (g = lane / 4,
// t = lane % 4) holds elements 32j + 8t .. + 7 of a unit (j = 0, 1) of weight rows g and g + 8 and of
// activation row g of each tile; words 2h and 2h + 1 of them fill the k slots 2t.. and 8 + 2t.. of mma (j, h).
// Partial sums meet in shared memory, warps in a fixed order, then cluster ranks in a fixed order through
// distributed shared memory: the bits do not depend on timing.
template <typename OutT, int XT, int S>
__global__ void __cluster_dims__(1, S, 1) __launch_bounds__(512)
skinny_gemm(OutT* y, const __nv_bfloat16* x, const __nv_bfloat16* w, int m, int n, int k, int x_ld, int y_ld,
            long long x_step, long long w_step, long long y_step, float alpha, int groups, int parts) {
    constexpr int TILE = 8 * XT * 16;   // outputs of a row group and row tile
    extern __shared__ float partial[];  // [warps][TILE]; a row group's first warp's slice then holds its sums
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int per_block = (blockDim.x >> 5) / parts, row_groups = (n + 15) / 16, m0 = blockIdx.z * 8 * XT;
    const int rg = blockIdx.x * per_block + warp / parts;
    const bool live = rg < groups * row_groups;
    const int group = rg / row_groups, n0 = rg % row_groups * 16;
    const int split = blockIdx.y * parts + warp % parts, splits = S * parts;
    const int units = live ? (k + kUnit - 1) / kUnit : 0;
    const __nv_bfloat16* wrow[2];
    bool wok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        wok[r] = live && n0 + g + 8 * r < n;
        wrow[r] = w + (wok[r] ? group * w_step + static_cast<long long>(n0 + g + 8 * r) * k : 0);
    }
    const __nv_bfloat16* xrow[XT];
    bool xok[XT];
#pragma unroll
    for (int i = 0; i < XT; ++i) {
        xok[i] = live && m0 + 8 * i + g < m;
        xrow[i] = x + (xok[i] ? group * x_step + static_cast<long long>(m0 + 8 * i + g) * x_ld : 0);
    }
    float acc[XT][4] = {};
    uint4 a[kStage][2][2], b[kStage][2][2];
    const int step = kStage * splits;  // units from one of a warp's stages to its next
    int unit = split;
    load_stage(a, wrow, wok, unit, splits, k, t);
    while (unit < units) {
        load_stage(b, wrow, wok, unit + step, splits, k, t);
        use_stage<XT>(acc, a, xrow, xok, unit, splits, k, t);
        unit += step;
        if (unit >= units) break;
        load_stage(a, wrow, wok, unit + step, splits, k, t);
        use_stage<XT>(acc, b, xrow, xok, unit, splits, k, t);
        unit += step;
    }
    // acc[i][c]: weight row g + 8·(c / 2), activation row 2t + c % 2 of tile i
    float* mine = partial + warp * TILE;
#pragma unroll
    for (int i = 0; i < XT; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) mine[(8 * i + 2 * t + (c & 1)) * 16 + g + 8 * (c >> 1)] = acc[i][c];
    __syncthreads();
    for (int e = threadIdx.x; e < per_block * TILE; e += blockDim.x) {
        float* first = partial + e / TILE * parts * TILE + e % TILE;  // element e % TILE of the group's first warp
        float sum = 0.f;
        for (int v = 0; v < parts; ++v) sum += first[v * TILE];
        if constexpr (S == 1)
            store_output(y, sum * alpha, blockIdx.x * per_block + e / TILE, e % TILE, m0, m, n, y_ld, y_step, groups);
        else
            *first = sum;  // only this thread reads or writes element e % TILE of the group's warps
    }
    if constexpr (S > 1) {
        const int rank = static_cast<int>(cluster_rank());
        cluster_sync();
        for (int e = rank + S * threadIdx.x; e < per_block * TILE; e += S * blockDim.x) {
            const float* first = partial + e / TILE * parts * TILE + e % TILE;
            float sum = 0.f;
#pragma unroll
            for (int q = 0; q < S; ++q) sum += __uint_as_float(cluster_load(cluster_addr(first, q)));
            store_output(y, sum * alpha, blockIdx.x * per_block + e / TILE, e % TILE, m0, m, n, y_ld, y_step, groups);
        }
        cluster_sync();  // a block's shared memory outlives the reads of the others
    }
}
