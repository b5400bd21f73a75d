// dsv4rt-instantiate: fp8_prefill_gemm<float,1,1> fp8_prefill_gemm<float,2,1> fp8_prefill_gemm<float,2,2>
// dsv4rt-instantiate: fp8_prefill_gemm<__nv_bfloat16,1,1> fp8_prefill_gemm<__nv_bfloat16,2,1>
// dsv4rt-instantiate: fp8_prefill_gemm<__nv_bfloat16,2,2>
#include "common.cuh"
#include "fp8.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// The faithful-mode fp8 linear layer of prefill batches (docs/numerics.md#act-quant) on Hopper's tensor cores:
// y [m, n] = Σ over 128-column blocks kb of (xq[:, kb] · wq[:, kb]ᵀ) · x_scale[:, kb] · w_scale[n / 128, kb], the
// large-m counterpart of fp8.cu's fp8_skinny_gemm with the same operands (xq, x_scale from act_quant; wq [n, k],
// w_scale [n / 128, k / 128] the checkpoint's). n and k are multiples of 128, m is any. Grouped as fp8_skinny_gemm
// (the fast numerics' output projection): the n columns fall into groups of group_n (a multiple of 128), group j
// reading columns j·k.. of xq rows of (n / group_n)·k bytes and its scales likewise; group_n = n is one GEMM.
//
// A block owns 64·WG rows and 128·H columns of y. A producer warp streams 128-column slices of both operands
// into a ring of shared-memory stages by TMA (128-byte swizzle); WG consumer warpgroups, 64 rows each, run
// wgmma m64n128k32 e4m3 on them, each 128-column block of each of the H column halves into fresh fp32 registers,
// which they then scale (x_scale of the row times w_scale of the block) into the accumulator, as DeepGEMM does: the
// tensor cores' own fp8 accumulation is never trusted beyond 128 products. mbarriers pace the ring: `full` counts
// the TMA bytes of a stage, `empty` the consumer warps done with it. Two halves (256 columns) read x once for twice
// the products: a 128 x 128 block's 32 KB a k step at the fp8 rate outrun what L2 delivers to every SM at once.
// wgmma exists on sm_90a alone; other targets compile a stub and the launcher refuses them.

constexpr int kTileN = 128;    // columns of y a block owns: one row of weight scales
constexpr int kWgRows = 64;    // rows of a consumer warpgroup (wgmma's m)
constexpr int kWgmmaK = 32;    // e4m3 bytes of k one wgmma takes

// Stages of a block: 4 of 48 KB with two warpgroups and two halves, 6 of 32 KB with two warpgroups and one (one
// block a multiprocessor), 4 of 24 KB with one (two).
template <int WG, int H> constexpr int kStages = WG == 2 && H == 1 ? 6 : 4;
template <int WG, int H> constexpr int kStageBytes = (kWgRows * WG + kTileN * H) * kFp8Block;
// Threads: the consumer warpgroups and a producer warp; with two halves a whole producer warpgroup, which hands its
// registers to the consumers (64 accumulators a half and the step's 64 products).
template <int WG, int H> constexpr int kThreads = H == 2 ? 128 * WG + 128 : 128 * WG + 32;
constexpr int kConsumerRegs = 232, kProducerRegs = 40;

// cuTensorMapEncodeTiled's opaque 128 bytes, passed by value.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static_assert(fits_launch_registers(256, kConsumerRegs, 128, kProducerRegs), "setmaxnreg's budget");
// rows row.. and columns col.. of the map's tensor into shared memory at dst; bar counts the bytes
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, int col, int row, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(bar) : "memory");
}

__device__ __forceinline__ void store_pair(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
#endif

// x_map: xq [m, (n / group_n)·k] in boxes of min(64·WG, m) rows x 128 bytes; w_map: wq [n, k] in boxes of 128·H x
// 128 (group_n a multiple of 128·H). Rows of a stage past the box hold stale bytes: they only reach rows of y that
// are not stored; weight rows past n land as zeros (TMA's fill), their columns are not stored either.
template <typename OutT, int WG, int H>
__global__ void __launch_bounds__(kThreads<WG, H>, 3 - WG)
    fp8_prefill_gemm(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map, OutT* y,
                     const unsigned char* x_scale, const unsigned char* w_scale, int m, int n, int k, int x_box_rows,
                     int group_n) {
    static_assert(H == 1 || WG == 2, "256-column blocks hand the producer's registers to two warpgroups");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = kStages<WG, H>, A_BYTES = kWgRows * WG * kFp8Block, STAGE = kStageBytes<WG, H>;
    extern __shared__ unsigned char shared[];
    const unsigned base = smem_base_1024(shared).addr;
    const unsigned full = base + S * STAGE, empty = full + 8 * S;  // mbarriers of stage s at + 8·s
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nkb = k / kFp8Block;
    const int m0 = blockIdx.y * kWgRows * WG, n0 = blockIdx.x * kTileN * H, groups = n / group_n, group = n0 / group_n;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 4 * WG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        fence_proxy_async();
    }
    __syncthreads();

    if (warp >= 4 * WG) {  // the producer warp, after the consumers so that their warpgroups are aligned
        if constexpr (H == 2) setmaxnreg_dec<kProducerRegs>();
        if (warp == 4 * WG && lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&x_map)) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&w_map)) : "memory");
            const unsigned bytes = x_box_rows * kFp8Block + kTileN * H * kFp8Block;
            for (int kb = 0; kb < nkb; ++kb) {
                const int s = kb % S;
                const unsigned stage = base + s * STAGE;
                mbar_wait(empty + 8 * s, ((kb / S) & 1) ^ 1);  // a fresh barrier passes parity 1 at once
                mbar_expect_tx(full + 8 * s, bytes);
                tma_load(stage, x_map, group * k + kb * kFp8Block, m0, full + 8 * s);
                tma_load(stage + A_BYTES, w_map, kb * kFp8Block, n0, full + 8 * s);
            }
        }
        return;
    }

    if constexpr (H == 2) setmaxnreg_inc<kConsumerRegs>();
    const int wg = warp >> 2, row = m0 + wg * kWgRows + 16 * (warp & 3) + (lane >> 2);  // rows row, row + 8
    const bool ok0 = row < m, ok1 = row + 8 < m;  // rows past m read row 0's scales and are not stored
    const unsigned char* xs0 = x_scale + (static_cast<size_t>(ok0 ? row : 0) * groups + group) * nkb;
    const unsigned char* xs1 = x_scale + (static_cast<size_t>(ok1 ? row + 8 : 0) * groups + group) * nkb;
    // the w_scale rows of the halves; a half past n reads the last row, and its columns are not stored
    const unsigned char* ws[H];
#pragma unroll
    for (int h = 0; h < H; ++h) ws[h] = w_scale + static_cast<size_t>(min(n0 / kFp8Block + h, n / kFp8Block - 1)) * nkb;
    float acc[H][64], part[64];
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
    for (int kb = 0; kb < nkb; ++kb) {
        const int s = kb % S;
        const unsigned a = base + s * STAGE + wg * kWgRows * kFp8Block, b = base + s * STAGE + A_BYTES;
        // scale bytes loaded before the wait and used after the products: they land while the tensor cores work
        unsigned wb[H];
#pragma unroll
        for (int h = 0; h < H; ++h) wb[h] = __ldg(ws[h] + kb);
        const unsigned xb0 = __ldg(xs0 + kb), xb1 = __ldg(xs1 + kb);
        mbar_wait(full + 8 * s, (kb / S) & 1);
#pragma unroll
        for (int h = 0; h < H; ++h) {
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kFp8Block / kWgmmaK; ++ks)
                wgmma_m64n128k32(part, smem_desc(a + ks * kWgmmaK), smem_desc(b + h * kTileN * kFp8Block + ks * kWgmmaK),
                                 ks);
            wgmma_commit();
            wgmma_wait<0>();
            if (h == H - 1 && lane == 0) mbar_arrive(empty + 8 * s);
            const float sw = e8m0_to_float(wb[h]), s0 = e8m0_to_float(xb0) * sw, s1 = e8m0_to_float(xb1) * sw;
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[h][i] = fmaf(part[i], i & 2 ? s1 : s0, acc[h][i]);
        }
    }
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
        for (int j = 0; j < kTileN / 8; ++j) {
            const int col = n0 + h * kTileN + 8 * j + 2 * (lane & 3);
            if (col >= n) continue;
            if (ok0) store_pair(y + static_cast<size_t>(row) * n + col, acc[h][4 * j], acc[h][4 * j + 1]);
            if (ok1) store_pair(y + static_cast<size_t>(row + 8) * n + col, acc[h][4 * j + 2], acc[h][4 * j + 3]);
        }
#else
    __trap();
#endif
}
