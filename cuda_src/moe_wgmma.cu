// dsv4rt-instantiate: moe_gemm_wgmma<true,false> moe_gemm_wgmma<false,false>
// dsv4rt-instantiate: moe_gemm_wgmma<true,true> moe_gemm_wgmma<false,true>
#include "common.cuh"
#include "fp8.cuh"
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
//
// FP4 (the experts as released, faithful numerics): the weights are packed e2m1 [n, k/2] with an e8m0 scale per
// 1 x 32, widened to bf16 in shared memory (exact: e2m1 times a power of two), and a is act_quant's rounded bf16 (the
// e4m3 values it represents, exact too), so each product is the reference's and the sums are fp32. The
// packed bytes and scales stream into raw stages; before its wgmma each step is widened into one of two bf16
// tiles. GATED FP4 rounds its output as act_quant would (per row and 128 columns: one block's tile) for w2.
constexpr int kWgRows = 128, kWgCols = 256, kWgK = 64, kWgStages = 4, kWgThreads = 256;
static_assert(kWgK == 64 && kWgCols == 256, "wgmma_k64_step, store_row_bf16");
constexpr int kWgABytes = kWgRows * kWgK * 2, kWgBBytes = kWgCols * kWgK * 2;
constexpr int kWgPacked = kWgCols * kWgK / 2, kWgRawBytes = kWgPacked + kWgCols * 4;  // packed rows, then scales

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// v: this lane's values of its row's 128 output columns (the other three lanes of its quad hold the rest), rounded
// onto the grid act_quant gives that block: e4m3(v / s) · s.
template <int P>
__device__ __forceinline__ void round_as_act_quant(float (&v)[P][2]) {
    const unsigned quad = 0xfu << (threadIdx.x & 28);
    float amax = 0.f;
    int finite = 1;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int c = 0; c < 2; ++c) amax = fmaxf(amax, fabsf(v[p][c])), finite &= isfinite(v[p][c]);
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(quad, amax, o));  // drops NaN: the vote tells non-finite blocks apart
        finite &= __shfl_xor_sync(quad, finite, o);
    }
    const unsigned byte = act_scale_byte(amax, finite);
    const float inv = e8m0_value(254u - byte), s = e8m0_value(byte);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const float2 e = e4m3x2_value(act_codes(v[p][0], v[p][1], inv));
        v[p][0] = e.x * s, v[p][1] = e.y * s;
    }
}
#endif

// Arguments as moe_gemm_mma (moe_sort with tile_rows kWgRows), FP4 with the scale tables s_first, s_second; grid
// (ceil(n / (GATED ? 128 : 256)), row tiles), kWgThreads threads, dynamic shared memory for kWgStages stages of a
// and b (FP4: raw b, then two widened b tiles) and 1024 more to align the swizzled tiles. n and k must be multiples
// of 64 (FP4: of 128), a and the weights 16-byte aligned (FP4 scales: 4-byte).
template <bool GATED, bool FP4>
__global__ void __launch_bounds__(kWgThreads, 1)
    moe_gemm_wgmma(__nv_bfloat16* out, const __nv_bfloat16* a, const int* perm, int active, const float* weight,
                   const unsigned long long* w_first, const unsigned long long* w_second,
                   const unsigned long long* s_first, const unsigned long long* s_second, const int* offsets,
                   const int* tile_offsets, int experts, int n, int k, float limit) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = __nv_bfloat16;
    // 16-byte copies of a step: a rows (8 a row), b rows (bf16: 8 a row; FP4: 2 packed a row, and 4 bytes of scales)
    constexpr int A_COPIES = kWgRows * 8 / kWgThreads, B_COPIES = kWgCols * (FP4 ? 2 : 8) / kWgThreads;
    constexpr int COLS = GATED ? kWgCols / 2 : kWgCols;
    constexpr int STAGE = kWgABytes + (FP4 ? kWgRawBytes : kWgBBytes);
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    unsigned char* stages = smem_raw + (base - smem_u32(smem_raw));  // generic address of base
    const unsigned widened = base + kWgStages * STAGE;  // FP4: the two bf16 b tiles (STAGE is a multiple of 1024)

    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kWgRows, row_end = offsets[e + 1];
    const int col0 = blockIdx.x * COLS;

    // Thread t copies chunk t % 8 of tile rows t / 8 + 32i; rows 32 apart share their swizzle. Rows past the expert
    // or past n read nothing and land as zeros.
    const int part = threadIdx.x & 7, copy_row = threadIdx.x >> 3;
    const T* a_src[A_COPIES];
    bool a_ok[A_COPIES];
    tile_sources(a_src, a_ok, a, perm, active, row0 + copy_row, row_end, k, part * 8);
    // b row j of the tile: GATED interleaves w1 and w3 8 rows at a time.
    const auto weight_row = [&](int j, const unsigned long long* firsts, const unsigned long long* seconds,
                                size_t row_bytes, bool& ok) {
        const bool second = GATED && (j >> 3 & 1);
        const int c = col0 + (GATED ? (j >> 4) * 8 + (j & 7) : j);
        ok = c < n;
        return reinterpret_cast<const unsigned char*>((second ? seconds : firsts)[e]) + (ok ? c * row_bytes : 0);
    };
    // bf16: thread t copies chunk t % 8 of b rows t / 8 + 32i (swizzled as a); FP4: chunk t % 2 of the packed rows
    // t / 2 + 128i, and the 4 scale bytes of row t that cover the step's 128-column block.
    const int b_part = FP4 ? threadIdx.x & 1 : part, b_row = FP4 ? threadIdx.x >> 1 : copy_row;
    const unsigned char* b_src[B_COPIES];
    bool b_ok[B_COPIES];
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i)
        b_src[i] = weight_row(b_row + (FP4 ? 128 : 32) * i, w_first, w_second, FP4 ? k / 2 : k * 2, b_ok[i]) +
                   b_part * 16;
    bool s_ok = false;
    const unsigned char* s_src = FP4 ? weight_row(threadIdx.x, s_first, s_second, k / 32, s_ok) : nullptr;
    const unsigned copy_at = swizzled(copy_row, part);
    const int steps = k / kWgK;
    auto load = [&](int step) {  // always commits a group, empty past the last step, so that the waits count alike
        if (step < steps) {
            const unsigned stage = base + (step % kWgStages) * STAGE;
            const int k0 = step * kWgK;
#pragma unroll
            for (int i = 0; i < A_COPIES; ++i)
                cp_async16_or_zero(stage + copy_at + 32 * i * 128, a_src[i] + k0, a_ok[i]);
            if constexpr (FP4) {
                const unsigned raw = stage + kWgABytes;
#pragma unroll
                for (int i = 0; i < B_COPIES; ++i)
                    cp_async16_or_zero(raw + (b_row + 128 * i) * (kWgK / 2) + b_part * 16, b_src[i] + k0 / 2,
                                       b_ok[i]);
                cp_async4_or_zero(raw + kWgPacked + threadIdx.x * 4, s_src + k0 / 128 * 4, s_ok);
            } else {
#pragma unroll
                for (int i = 0; i < B_COPIES; ++i)
                    cp_async16_or_zero(stage + kWgABytes + copy_at + 32 * i * 128, b_src[i] + 2 * k0, b_ok[i]);
            }
        }
        cp_async_commit();
    };
    // FP4: thread t widens b row t of a step's raw stage into a bf16 tile (8 chunks of 8 values).
    auto widen = [&](int step) {
        const unsigned char* raw = stages + (step % kWgStages) * STAGE + kWgABytes;
        const uint4* packed = reinterpret_cast<const uint4*>(raw + threadIdx.x * (kWgK / 2));
        const unsigned scales = *reinterpret_cast<const unsigned*>(raw + kWgPacked + threadIdx.x * 4);
        const int block = (step * kWgK) % 128 / 32;  // the step's first 32-column block within the scale word
        unsigned char* tile = stages + kWgStages * STAGE + (step & 1) * kWgBBytes;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 p = packed[h];
            const __nv_bfloat162 scale = e8m0_bf16x2(scales >> (8 * (block + h)) & 0xff);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                *reinterpret_cast<uint4*>(tile + swizzled(threadIdx.x, 4 * h + q)) = e2m1x8_scaled(word(p, q), scale);
        }
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
        unsigned b_tile = stage + kWgABytes;
        if constexpr (FP4) {
            // the widened tile of step - 2, which this one overwrites, is done with (the barrier above)
            widen(step);
            fence_proxy_async();
            __syncthreads();
            b_tile = widened + (step & 1) * kWgBBytes;
        }
        wgmma_k64_step(acc, stage + wg * 64 * 128, b_tile, step == 0);
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
            // n8 block 2p holds w1, block 2p + 1 w3 of output columns 8p..
            const float scale = weight[perm[row]];
            float v[kWgCols / 16][2];
#pragma unroll
            for (int p = 0; p < kWgCols / 16; ++p)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float gv = fminf(acc[8 * p + 2 * h + c], limit);
                    const float uv = fminf(fmaxf(acc[8 * p + 4 + 2 * h + c], -limit), limit);
                    v[p][c] = gv * sigmoid(gv) * uv * scale;
                }
            if constexpr (FP4) round_as_act_quant(v);
#pragma unroll
            for (int p = 0; p < kWgCols / 16; ++p) {
                const int col = col0 + p * 8 + 2 * l4;
                if (col < n)
                    *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(v[p][0], v[p][1]);
            }
        } else {
            store_row_bf16(out_row, acc, h, col0, n);
        }
    }
#else
    __trap();
#endif
}
