// dsv4rt-instantiate: moe_gemm_wgmma<true> moe_gemm_wgmma<false>
#include "common.cuh"
#include "moe.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// moe_mma.cu's grouped expert GEMM on Hopper's warpgroup MMA (sm_90a; other targets compile a stub and the
// launcher never picks it): the same operands and results, row tiles of kWgRows. A block takes kWgRows sorted rows
// (two warpgroups of 64, wgmma m64n256k16) and kWgCols weight rows (GATED: 128 columns of w1 and of w3 interleaved
// 8 by 8, so that a thread holds g and u of the same element) over k in steps of kWgK. The rows are gathered
// through perm, which TMA cannot do, so every thread copies with cp.async into the 128-byte swizzle wgmma reads;
// a step's copies are issued two steps ahead, and a step's wgmma runs while the next step is being issued.

constexpr int kWgRows = 128, kWgCols = 256, kWgK = 64, kWgStages = 4, kWgThreads = 256;
static_assert(kWgK == 64 && kWgCols == 256, "wgmma_k64_step, store_row_bf16");
constexpr int kWgABytes = kWgRows * kWgK * 2, kWgBBytes = kWgCols * kWgK * 2;

// Arguments as moe_gemm_mma (moe_sort with tile_rows kWgRows); grid (ceil(n / (GATED ? 128 : 256)), row tiles),
// kWgThreads threads, dynamic shared memory for kWgStages stages of a and b and 1024 more to align the swizzled tiles.
// n and k must be multiples of 64, a and the weights 16-byte aligned.
template <bool GATED>
__global__ void __launch_bounds__(kWgThreads, 1)
    moe_gemm_wgmma(__nv_bfloat16* out, const __nv_bfloat16* a, const int* perm, int active, const float* weight,
                   const unsigned long long* w_first, const unsigned long long* w_second, const int* offsets,
                   const int* tile_offsets, int experts, int n, int k, float limit) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = __nv_bfloat16;
    constexpr int A_COPIES = kWgRows * 8 / kWgThreads, B_COPIES = kWgCols * 8 / kWgThreads;  // 16-byte copies a step
    constexpr int COLS = GATED ? kWgCols / 2 : kWgCols, STAGE = kWgABytes + kWgBBytes;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = smem_base_1024(smem_raw).addr;

    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kWgRows, row_end = offsets[e + 1];
    const int col0 = blockIdx.x * COLS;

    // Thread t copies chunk t % 8 of tile rows t / 8 + 32i (a and b alike); rows 32 apart share their swizzle. Rows
    // past the expert or past n read nothing and land as zeros.
    const int part = threadIdx.x & 7, copy_row = threadIdx.x >> 3;
    const T* a_src[A_COPIES];
    bool a_ok[A_COPIES];
    tile_sources(a_src, a_ok, a, perm, active, row0 + copy_row, row_end, k, part * 8);
    const T* b_src[B_COPIES];
    bool b_ok[B_COPIES];
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i)
        b_src[i] = reinterpret_cast<const T*>(
            tile_weight_row<GATED>(w_first, w_second, e, copy_row + 32 * i, col0, n, 2 * k, b_ok[i]) + 16 * part);
    const unsigned copy_at = swizzled(copy_row, part);
    const int steps = k / kWgK;
    auto load = [&](int step) {  // always commits a group, empty past the last step, so that the waits count alike
        if (step < steps) {
            const unsigned stage = base + (step % kWgStages) * STAGE;
            const int k0 = step * kWgK;
#pragma unroll
            for (int i = 0; i < A_COPIES; ++i)
                cp_async16_or_zero(stage + copy_at + 32 * i * 128, a_src[i] + k0, a_ok[i]);
#pragma unroll
            for (int i = 0; i < B_COPIES; ++i)
                cp_async16_or_zero(stage + kWgABytes + copy_at + 32 * i * 128, b_src[i] + k0, b_ok[i]);
        }
        cp_async_commit();
    };

    const int wg = threadIdx.x >> 7;
    float acc[128];
#pragma unroll
    for (int s = 0; s < kWgStages - 2; ++s) load(s);
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<kWgStages - 3>();
        fence_proxy_async();
        // Every thread's copies of this step have landed, and every warpgroup is done with step - 2 (its
        // wgmma_wait<1> below), whose slot the next load takes.
        __syncthreads();
        load(step + kWgStages - 2);
        const unsigned stage = base + (step % kWgStages) * STAGE;
        wgmma_k64_step(acc, stage + wg * 64 * 128, stage + kWgABytes, step == 0);
    }
    wgmma_wait<0>();

    const int lane = threadIdx.x & 31, l4 = lane & 3;
    const int row_base = row0 + wg * 64 + ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + 8 * h;
        if (row >= row_end) continue;
        T* out_row = out + static_cast<size_t>(row) * n;
        if constexpr (GATED) {
            const float scale = weight[perm[row]];
#pragma unroll
            for (int p = 0; p < kWgCols / 16; ++p) {
                const float2 v = gated_pair(acc, p, h, limit, scale);
                const int col = col0 + p * 8 + 2 * l4;
                if (col < n) *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __float22bfloat162_rn(v);
            }
        } else {
            store_row_bf16(out_row, acc, h, col0, n);
        }
    }
#else
    __trap();
#endif
}
