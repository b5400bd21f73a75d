// dsv4rt-instantiate: hc_project_mma<2> hc_project_mma<4>
#include "common.cuh"
#include "fp8.cuh"

// hc_pre's projections (docs/model.md#hyper-connections) for prefill steps of the bf16 build, on the tensor cores:
// x [T, K] (K = hc·D bf16 columns) against fn [R, K] float32, R = (2 + hc)·hc. Each fn value enters as three bf16
// terms whose sum is the value exactly (split_bf16x3), so with x already bf16 every m16n8k16 product is exact: what
// differs from a float32 matmul is the tensor cores' float32 accumulation (each k16 group aligned to its largest
// term) and its order. Block (b, s) takes tokens 64b .. 64b + 63 over the
// columns of k tiles [s·per_slice, (s + 1)·per_slice) of 64, warp w its 16 tokens; the tiles come by cp.async in
// kPmStages stages. It writes partial [T][slices][R + 1] (fn's rows, then the sum of squares of x), which
// hc_pre_finish (hc.cu) adds up in slice order, as it does hc_pre_decode's.
constexpr int kPmTokens = 64, kPmK = 64, kPmStages = 4, kPmThreads = 128;
constexpr int kPmFnStride = kPmK + 8;  // floats a staged fn row: the quad's float2 reads of 8 rows miss each other
constexpr int kPmXBytes = kPmTokens * kPmK * 2;

template <int HC>
__host__ __device__ constexpr int pm_stage_bytes() { return kPmXBytes + (2 + HC) * HC * kPmFnStride * 4; }

// grid (ceil(tokens / kPmTokens), slices), kPmThreads threads, dynamic shared memory kPmStages · pm_stage_bytes.
// K a multiple of kPmK, x and fn 16-byte aligned.
template <int HC>
__global__ void __launch_bounds__(kPmThreads) hc_project_mma(float* partial, const __nv_bfloat16* x, const float* fn,
                                                             int tokens, int K, int per_slice) {
    constexpr int R = (2 + HC) * HC, NT = R / 8, STAGE = pm_stage_bytes<HC>();
    static_assert(R % 8 == 0, "whole n tiles of fn rows");
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * kPmTokens, s = blockIdx.y, slices = gridDim.y;
    const int kt0 = s * per_slice, nk = min(K / kPmK - kt0, per_slice);
    const unsigned base = smem_u32(smem);
    const auto issue = [&](int i) {  // k tile kt0 + i into stage i % kPmStages; always commits a group
        if (i < nk) {
            const unsigned st = base + (i % kPmStages) * STAGE;
            const int k = (kt0 + i) * kPmK;
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // x: 64 rows of 8 chunks; rows past the batch land as zeros
                const int row = (tid >> 3) + 16 * j, c = tid & 7;
                const bool ok = t0 + row < tokens;
                cp_async16_or_zero(st + swizzled(row, c), x + (ok ? static_cast<size_t>(t0 + row) * K + k + 8 * c : 0),
                                   ok);
            }
            for (int j = tid; j < R * 16; j += kPmThreads)  // fn: R rows of 16 chunks of four floats
                cp_async16_or_zero(st + kPmXBytes + (j >> 4) * kPmFnStride * 4 + (j & 15) * 16,
                                   fn + static_cast<size_t>(j >> 4) * K + k + 4 * (j & 15), true);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < kPmStages - 1; ++i) issue(i);

    // acc[n][c]: token 16·warp + g + 8·(c / 2), fn row 8n + 2q + c % 2; ss[h]: token 16·warp + g + 8h
    float acc[NT][4] = {}, ss[2] = {};
    for (int i = 0; i < nk; ++i) {
        cp_async_wait<kPmStages - 2>();
        __syncthreads();  // tile i landed for every thread; stage (i - 1) % kPmStages is free again
        issue(i + kPmStages - 1);
        const unsigned st = base + (i % kPmStages) * STAGE;
        const float* fs = reinterpret_cast<const float*>(smem + (i % kPmStages) * STAGE + kPmXBytes);
#pragma unroll
        for (int ks = 0; ks < kPmK / 16; ++ks) {
            unsigned a[4];
            ldmatrix_x4(a, st + swizzled(16 * warp + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // a[0], a[2]: token g; a[1], a[3]: token g + 8
                const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a[r]));
                ss[r & 1] += f.x * f.x + f.y * f.y;
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float* row = fs + (8 * n + g) * kPmFnStride + 16 * ks + 2 * q;
                unsigned b0[3], b1[3];
                split_bf16x3(row[0], row[1], b0);
                split_bf16x3(row[8], row[9], b1);
                // the three terms smallest first into fresh sums, then one float32 add: an mma aligns its terms to
                // the largest before it adds, so added straight onto acc the small terms would lose their bits
                float t[4] = {};
#pragma unroll
                for (int p = 2; p >= 0; --p) mma<Mma::bf16>(t, a[0], a[1], a[2], a[3], b0[p], b1[p]);
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[n][c] += t[c];
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], 1);
        ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int t = t0 + 16 * warp + g + 8 * h;
        if (t >= tokens) continue;
        float* out = partial + (static_cast<size_t>(t) * slices + s) * (R + 1);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            out[8 * n + 2 * q] = acc[n][2 * h];
            out[8 * n + 2 * q + 1] = acc[n][2 * h + 1];
        }
        if (q == 0) out[R] = ss[h];
    }
}
