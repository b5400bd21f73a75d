// dsv4rt-instantiate: moe_fp8_wgmma<true> moe_fp8_wgmma<false>
#include "common.cuh"
#include "fp8.cuh"
#include "moe.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// The released experts (packed e2m1, an e8m0 scale per 1 x 32) of many-row batches on Hopper's fp8 tensor cores
// (sm_90a; other targets compile a stub and the launcher never picks it), docs/kernels.md#tensor-cores-for-many-rows.
// a is act_quant's output (e4m3 codes and a scale per row and 128 columns), so each step of 128 columns is one
// act_quant block. A block takes kF8Rows sorted rows and kF8Cols weight rows (GATED: 64 of w1 and of w3 interleaved
// 8 by 8, so that a thread holds g and u of the same element).
//
// Warp-specialised as DeepGEMM's kernels: two producer warpgroups gather a's rows and the packed weight rows by
// cp.async into a ring of stages, two steps ahead, and widen each step's weights in place to e4m3 under one exponent
// per row (as the decode kernel moe_fp4.cu re-expresses them: exact for every 32-column block within 14 binades of the
// step's largest). Two consumer warpgroups of 64 rows run four wgmma m64n128k32 a step into fresh registers, which
// they then scale (the row's act_quant scale times the weight row's exponent) into fp32 accumulators, as gemm_fp8.cu
// does: the tensor cores' own sums never run past 128 products. Each consumer scales while the other's products run.
// mbarriers pace the ring: `full` counts the producer threads done with a stage, `empty` the consumer warps.
constexpr int kF8Rows = 128, kF8Cols = 128, kF8K = 128, kF8Stages = 4, kF8Ahead = 2;
// two consumer and two producer warpgroups; the producers hand registers to the consumers (64 fp32 sums and a step's
// 64 products a thread)
constexpr int kF8Producers = 256, kF8Threads = 256 + kF8Producers, kF8ConsumerRegs = 160, kF8ProducerRegs = 96;
static_assert(fits_launch_registers(256, kF8ConsumerRegs, kF8Producers, kF8ProducerRegs), "setmaxnreg's budget");
// a stage: a rows and widened weight rows (128-byte swizzled), packed weight rows, their 4 scale bytes (once for
// each of the two producer threads of a row) and each row's exponent as a float
constexpr int kF8ABytes = kF8Rows * kF8K, kF8BBytes = kF8Cols * kF8K, kF8Packed = kF8Cols * kF8K / 2;
constexpr int kF8Raw = kF8ABytes + kF8BBytes, kF8RowScales = kF8Raw + kF8Packed + kF8Producers * 4;
constexpr int kF8Stage = (kF8RowScales + kF8Cols * 4 + 1023) / 1024 * 1024;
constexpr int kF8Shared = kF8Stages * kF8Stage + 1024 + 16 * kF8Stages;  // stages, alignment slack, mbarriers
static_assert(kF8Shared <= 227 * 1024, "a multiprocessor's shared memory");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc += part · (row scale) · (weight row's exponent): rows h = 0, 1 of the thread (scales s0, s1), columns
// 8j + 2·(lane % 4) + c of the stage's exponents col_scale.
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], float s0, float s1,
                                        const float* col_scale) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float2 w = *reinterpret_cast<const float2*>(col_scale + 8 * j + 2 * (threadIdx.x & 3));
        acc[4 * j] = fmaf(part[4 * j], s0 * w.x, acc[4 * j]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], s0 * w.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s1 * w.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s1 * w.y, acc[4 * j + 3]);
    }
}
#endif

// out [rows, n] for each expert e's sorted rows (offsets, tile_offsets from moe_sort with kF8Rows-row tiles): GATED,
// float32: the clamped SwiGLU of a · w1ᵀ and a · w3ᵀ times the row's routing weight (weight[perm[row]]), which
// w2's act_quant takes unrounded, as the reference does; else bf16: a · w1ᵀ.
// a [., k] e4m3 codes with a_scale [., k / 128] e8m0, read at row perm[r] / active when perm is given, else at r.
// Weights: pointer tables of packed e2m1 [n, k / 2] and e8m0 [n, k / 32]. Grid (ceil(n / (GATED ? 64 : 128)), row
// tiles), kF8Threads threads, kF8Shared bytes of dynamic shared memory. n and k must be multiples of 128, a and the
// weights 16-byte aligned, the scales 4-byte.
template <bool GATED>
__global__ void __launch_bounds__(kF8Threads, 1)
    moe_fp8_wgmma(void* out, const unsigned char* a, const unsigned char* a_scale, const int* perm,
                  int active, const float* weight, const unsigned long long* w_first,
                  const unsigned long long* w_second, const unsigned long long* s_first,
                  const unsigned long long* s_second, const int* offsets, const int* tile_offsets, int experts, int n,
                  int k, float limit) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = GATED ? kF8Cols / 2 : kF8Cols;
    extern __shared__ unsigned char smem_raw[];
    const SmemBase aligned = smem_base_1024(smem_raw);
    const unsigned base = aligned.addr;
    unsigned char* stages = aligned.ptr;  // generic address of base
    const unsigned full = base + kF8Stages * kF8Stage, empty = full + 8 * kF8Stages;  // stage s's at + 8·s

    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kF8Rows, row_end = offsets[e + 1];
    const int col0 = blockIdx.x * COLS, nkb = k / kF8K, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kF8Stages; ++s) {
            mbar_init(full + 8 * s, kF8Producers);
            mbar_init(empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= 8) {  // the producer warpgroups, after the consumers so that their warpgroups are aligned
        setmaxnreg_dec<kF8ProducerRegs>();
        const int t = threadIdx.x - 256, j = t >> 1, h = t & 1;  // half h (32-column blocks 2h, 2h + 1) of weight row j
        // a: thread t copies chunk t % 8 of tile rows t / 8 + 32i; rows past the expert land as zeros
        const unsigned char* a_src[4];
        bool a_ok[4];
        tile_sources(a_src, a_ok, a, perm, active, row0 + (t >> 3), row_end, k, (t & 7) * 16);
        const unsigned a_at = swizzled(t >> 3, t & 7);
        bool w_ok;
        const unsigned char* w_src = tile_weight_row<GATED>(w_first, w_second, e, j, col0, n, k / 2, w_ok) + 32 * h;
        const unsigned char* s_src = tile_weight_row<GATED>(s_first, s_second, e, j, col0, n, k / 32, w_ok);
        // each thread widens the half row it copies; raw chunk q of row j sits at q ^ (j / 2 % 4), so that the 8
        // threads of a shared-memory phase read distinct bank groups. Both threads of a row copy its scale word.
        const auto raw_at = [&](int q) { return kF8Raw + j * (kF8K / 2) + (((2 * h + q) ^ (j >> 1 & 3)) << 4); };
        const unsigned scale_at = kF8Raw + kF8Packed + t * 4;
        const auto issue = [&](int step) {  // always commits a group, empty past the last step
            if (step < nkb) {
                const int slot = step % kF8Stages;
                mbar_wait(empty + 8 * slot, ((step / kF8Stages) & 1) ^ 1);  // a fresh barrier passes parity 1 at once
                const unsigned stage = base + slot * kF8Stage;
                const int k0 = step * kF8K;
#pragma unroll
                for (int i = 0; i < 4; ++i) cp_async16_or_zero(stage + a_at + 32 * i * 128, a_src[i] + k0, a_ok[i]);
#pragma unroll
                for (int q = 0; q < 2; ++q) cp_async16_or_zero(stage + raw_at(q), w_src + k0 / 2 + 16 * q, w_ok);
                cp_async4_or_zero(stage + scale_at, s_src + k0 / 32, w_ok);
            }
            cp_async_commit();
        };
        for (int s = 0; s < kF8Ahead; ++s) issue(s);
        for (int step = 0; step < nkb; ++step) {
            issue(step + kF8Ahead);
            cp_async_wait<kF8Ahead>();  // this thread's copies of step have landed
            const int slot = step % kF8Stages;
            unsigned char* stage = stages + slot * kF8Stage;
            const unsigned scales = *reinterpret_cast<const unsigned*>(stage + scale_at);
            const int top = max(max(scales & 0xff, scales >> 8 & 0xff), max(scales >> 16 & 0xff, scales >> 24));
            if (h == 0) reinterpret_cast<float*>(stage + kF8RowScales)[j] = pow2(top - 133);
#pragma unroll
            for (int q = 0; q < 2; ++q) {  // 32-column block 2h + q: chunks 4h + 2q, +1 of the widened row
                const int block = 2 * h + q;
                const uint4 codes = *reinterpret_cast<const uint4*>(stage + raw_at(q));
                const uint2 table = e2m1_table(static_cast<int>(scales >> (8 * block) & 0xff) - top + 6);
                unsigned v[8];
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    v[2 * w] = e2m1x4_to_e4m3(word(codes, w), table);
                    v[2 * w + 1] = e2m1x4_to_e4m3(word(codes, w) >> 16, table);
                }
                *reinterpret_cast<uint4*>(stage + kF8ABytes + swizzled(j, 2 * block)) =
                    make_uint4(v[0], v[1], v[2], v[3]);
                *reinterpret_cast<uint4*>(stage + kF8ABytes + swizzled(j, 2 * block + 1)) =
                    make_uint4(v[4], v[5], v[6], v[7]);
            }
            fence_proxy_async();  // this thread's copies and stores become visible to the consumers' wgmma
            mbar_arrive(full + 8 * slot);
        }
        return;
    }
    setmaxnreg_inc<kF8ConsumerRegs>();

    const int wg = warp >> 2, row_base = row0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
    // this thread's two rows' act_quant scales (rows past the expert: row0's, never stored)
    const unsigned char* xs[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row_base + 8 * h < row_end ? row_base + 8 * h : row0;
        xs[h] = a_scale + static_cast<size_t>(perm ? perm[r] / active : r) * nkb;
    }
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int step = 0; step < nkb; ++step) {
        const int slot = step % kF8Stages;
        const unsigned stage = base + slot * kF8Stage;
        // scale bytes loaded before the wait and used after the products: they land while the tensor cores work
        const unsigned x0 = __ldg(xs[0] + step), x1 = __ldg(xs[1] + step);
        mbar_wait(full + 8 * slot, (step / kF8Stages) & 1);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wgmma_m64n128k32(part, smem_desc(stage + wg * 64 * 128 + 32 * ks), smem_desc(stage + kF8ABytes + 32 * ks),
                             ks);
        wgmma_commit();
        wgmma_wait<0>();
        promote(acc, part, e8m0_to_float(x0), e8m0_to_float(x1),
                reinterpret_cast<const float*>(stages + slot * kF8Stage + kF8RowScales));
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * slot);
    }

    const int l4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + 8 * h;
        if (row >= row_end) continue;
        if constexpr (GATED) {
            float* out_row = static_cast<float*>(out) + static_cast<size_t>(row) * n;
            const float scale = weight[perm[row]];
#pragma unroll
            for (int p = 0; p < kF8Cols / 16; ++p) {
                const int col = col0 + p * 8 + 2 * l4;
                if (col < n) *reinterpret_cast<float2*>(out_row + col) = gated_pair(acc, p, h, limit, scale);
            }
        } else {
            __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(out) + static_cast<size_t>(row) * n;
#pragma unroll
            for (int j = 0; j < kF8Cols / 8; ++j) {
                const int col = col0 + 8 * j + 2 * l4;
                if (col < n)
                    *reinterpret_cast<__nv_bfloat162*>(out_row + col) =
                        __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
        }
    }
#else
    __trap();
#endif
}
