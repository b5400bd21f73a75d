// dsv4rt-instantiate: w8a16_gemm
#include "common.cuh"
#include "fp8.cuh"
#include "moe.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// The faithful-mode output projection wo_a of prefill batches (docs/numerics.md#act-quant: its input is not
// quantised) on Hopper's warpgroup MMA, the many-row counterpart of fp8_skinny_gemm's W8A16 form: the checkpoint's
// e4m3 weight is widened to bf16 in shared memory, step by step, instead of being expanded whole into a scratch
// buffer for cuBLAS. Each weight value is dequantize_weight's (the e4m3 value times its e8m0 tile scale, rounded
// once to bf16), the activations are bf16, so every product is exact and the sums are fp32.
//
// moe_wgmma.cu's FP4 design: a block takes kW8Rows rows of x (two warpgroups of 64, wgmma m64n256k16) and kW8Cols
// weight rows of its group over k in steps of kW8K. Every thread copies x rows with cp.async into the 128-byte swizzle
// wgmma reads and the e4m3 bytes into a raw stage, two steps ahead; before its wgmma each step's raw stage is widened
// into one of two bf16 tiles, while the previous step's wgmma runs.
constexpr int kW8Rows = 128, kW8Cols = 256, kW8K = 64, kW8Stages = 4, kW8Threads = 256;
static_assert(kW8K == 64 && kW8Cols == 256, "wgmma_k64_step, store_row_bf16");
constexpr int kW8ABytes = kW8Rows * kW8K * 2, kW8RawBytes = kW8Cols * kW8K, kW8BBytes = kW8Cols * kW8K * 2;

// y [m, groups·n] = for each group g (blockIdx.z): x[:, g·k..] · dequant(w[g·n..])ᵀ into columns g·n..; x bf16
// [m, groups·k], w e4m3 [groups·n, k] with e8m0 scales w_scale [groups·n / 128, k / 128]. Grid (ceil(n / kW8Cols),
// ceil(m / kW8Rows), groups), kW8Threads threads, dynamic shared memory for kW8Stages stages of x and raw weight
// bytes, two widened tiles and 1024 more to align the swizzled tiles. n and k are multiples of 128, x and w 16-byte
// aligned, y 4-byte.
__global__ void __launch_bounds__(kW8Threads, 1)
    w8a16_gemm(__nv_bfloat16* y, const __nv_bfloat16* x, const unsigned char* w, const unsigned char* w_scale, int m,
               int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = __nv_bfloat16;
    constexpr int A_COPIES = kW8Rows * 8 / kW8Threads, B_COPIES = kW8Cols * (kW8K / 16) / kW8Threads;
    constexpr int STAGE = kW8ABytes + kW8RawBytes;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    unsigned char* stages = smem_raw + (base - smem_u32(smem_raw));  // generic address of base
    const unsigned widened = base + kW8Stages * STAGE;                 // STAGE is a multiple of 1024

    const int groups = gridDim.z, group = blockIdx.z, nkb = k / kFp8Block;
    const int row0 = blockIdx.y * kW8Rows, col0 = blockIdx.x * kW8Cols;
    // x: thread t copies chunk t % 8 of tile rows t / 8 + 32i, rows past m as zeros (rows 32 apart share a swizzle).
    const int part = threadIdx.x & 7, copy_row = threadIdx.x >> 3;
    const T* a_src[A_COPIES];
    bool a_ok[A_COPIES];
    tile_sources(a_src, a_ok, x, nullptr, 1, row0 + copy_row, m, groups * k, group * k + part * 8);
    // w: thread t copies chunk t % 4 of the step's 64 bytes of weight rows t / 4 + 64i, rows past n as zeros. A raw row
    // keeps its chunk j at j ^ (row / 2 % 4), so that the widening threads, one a row, read without bank conflicts.
    const int b_part = threadIdx.x & 3, b_row = threadIdx.x >> 2;
    const unsigned char* b_src[B_COPIES];
    bool b_ok[B_COPIES];
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        const int c = col0 + b_row + 64 * i;
        b_ok[i] = c < n;
        b_src[i] = w + static_cast<size_t>(group * n + (b_ok[i] ? c : 0)) * k + b_part * 16;
    }
    const unsigned a_at = swizzled(copy_row, part), b_at = b_row * kW8K + ((b_part ^ (b_row >> 1 & 3)) << 4);
    // the scales of the weight row this thread widens (past n: the last row's, for columns that are never stored)
    const int widen_row = group * n + min(col0 + static_cast<int>(threadIdx.x), n - 1);
    const unsigned char* scales = w_scale + static_cast<size_t>(widen_row / kFp8Block) * nkb;
    const int steps = k / kW8K;
    auto load = [&](int step) {  // always commits a group, empty past the last step, so that the waits count alike
        if (step < steps) {
            const unsigned stage = base + (step % kW8Stages) * STAGE;
            const int k0 = step * kW8K;
#pragma unroll
            for (int i = 0; i < A_COPIES; ++i)
                cp_async16_or_zero(stage + a_at + 32 * i * 128, a_src[i] + k0, a_ok[i]);
#pragma unroll
            for (int i = 0; i < B_COPIES; ++i)
                cp_async16_or_zero(stage + kW8ABytes + b_at + 64 * i * kW8K, b_src[i] + k0, b_ok[i]);
        }
        cp_async_commit();
    };
    // Thread t widens weight row t of a step's raw stage into a bf16 tile: 16 codes into chunks 2j, 2j + 1.
    auto widen = [&](int step, unsigned scale_byte) {
        const unsigned char* raw = stages + (step % kW8Stages) * STAGE + kW8ABytes + threadIdx.x * kW8K;
        unsigned char* tile = stages + kW8Stages * STAGE + (step & 1) * kW8BBytes;
        const __nv_bfloat162 scale = e8m0_bf16x2(scale_byte);
#pragma unroll
        for (int j = 0; j < kW8K / 16; ++j) {
            const uint4 codes = *reinterpret_cast<const uint4*>(raw + ((j ^ (threadIdx.x >> 1 & 3)) << 4));
            *reinterpret_cast<uint4*>(tile + swizzled(threadIdx.x, 2 * j)) = e4m3x8_scaled(codes.x, codes.y, scale);
            *reinterpret_cast<uint4*>(tile + swizzled(threadIdx.x, 2 * j + 1)) = e4m3x8_scaled(codes.z, codes.w, scale);
        }
    };

    const int wg = threadIdx.x >> 7;
    float acc[128];
#pragma unroll
    for (int s = 0; s < kW8Stages - 2; ++s) load(s);
    // a step's scale byte is read a step ahead, so that it has landed when its widening starts
    unsigned scale_byte = __ldg(scales);
    for (int step = 0; step < steps; ++step) {
        const unsigned next_scale_byte = __ldg(scales + min(step + 1, steps - 1) * kW8K / kFp8Block);
        cp_async_wait<kW8Stages - 3>();
        fence_proxy_async();
        // Every thread's copies of this step have landed, and every warpgroup is done with step - 2 (its
        // wgmma_wait<1> below), whose stage the next load and whose widened tile this step's widening take.
        __syncthreads();
        load(step + kW8Stages - 2);
        widen(step, scale_byte);
        fence_proxy_async();
        __syncthreads();
        wgmma_k64_step(acc, base + (step % kW8Stages) * STAGE + wg * 64 * 128, widened + (step & 1) * kW8BBytes,
                       step == 0);
        scale_byte = next_scale_byte;
    }
    wgmma_wait<0>();

    const int lane = threadIdx.x & 31;
    const int row_base = row0 + wg * 64 + ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + 8 * h;
        if (row >= m) continue;
        store_row_bf16(y + (static_cast<size_t>(row) * groups + group) * n, acc, h, col0, n);
    }
#else
    __trap();
#endif
}
