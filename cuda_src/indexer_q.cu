// dsv4rt-instantiate: indexer_q_fp4<float> indexer_q_fp4<__nv_bfloat16>
// dsv4rt-instantiate: indexer_q_fp4_128<float> indexer_q_fp4_128<__nv_bfloat16>
#include "compress.cuh"
#include "indexer_fp4.cuh"

// The faithful-mode indexer queries (docs/numerics.md#indexer-rounding), before indexer.cu's scores.
constexpr int kQThreads = 256;  // a warp per head

// q [rows, n_heads, dim] (T) in place, as reference.quant.indexer_round after the reference's RoPE: roped at pos[t]
// on the last rope_dim channels when inv_freq is given, rotated, rounded onto e2m1 with a scale per 32 and stored
// as values (exact in bf16). Rows with req < 0 are left alone. One block per row; dynamic shared memory: the rope
// table, then hadamard_size(dim) floats per warp.
template <typename T>
__global__ void __launch_bounds__(kQThreads) indexer_q_fp4(T* q, const int* pos, const int* req,
                                                           const float* inv_freq, int rope_dim, int n_heads, int dim) {
    extern __shared__ __align__(16) float rows[];
    const int t = blockIdx.x, lane = threadIdx.x & 31, n = hadamard_size(dim);
    if (req[t] < 0) return;
    float2* cs = reinterpret_cast<float2*>(rows);
    float* x = rows + rope_dim + (threadIdx.x >> 5) * n;
    if (inv_freq) rope_table(cs, inv_freq, rope_dim, pos[t]);
    __syncthreads();
    for (int h = threadIdx.x >> 5; h < n_heads; h += kQThreads / 32) {
        T* head = q + (static_cast<size_t>(t) * n_heads + h) * dim;
        for (int d = lane; d < n; d += 32) x[d] = d < dim ? to_float(head[d]) : 0.f;
        __syncwarp();
        if (inv_freq) {
            for (int k = lane; k < rope_dim / 2; k += 32) {
                float* p = x + dim - rope_dim + 2 * k;
                const float ev = p[0], od = p[1];
                p[0] = ev * cs[k].x - od * cs[k].y;
                p[1] = od * cs[k].x + ev * cs[k].y;
            }
        }
        hadamard_warp(x, n, lane);
        for (int d0 = 0; d0 < dim; d0 += kFp4Block) {
            const Fp4Value v = fp4_round(x, dim, n, d0 + lane);
            if (d0 + lane < dim) head[d0 + lane] = from_float<T>(e2m1_value(v.code) * e8m0_value(v.scale));
        }
        __syncwarp();  // x is read before the next head overwrites it
    }
}

// indexer_q_fp4 at dim 128 (Flash and Pro): lane l holds dims 4l .. 4l + 3 of a head in registers. The Hadamard
// stages of 1 and 2 stay in the lane and the others pair lane l with l ^ (h / 4) by shuffles: the same butterflies in
// the same order as hadamard_warp, so the same bits. A scale block of 32 is 8 lanes. The warp's heads (w, w + 8, ...)
// are loaded before any is rotated, so that their loads overlap. Same arguments less dim; n_heads <= 64.
template <typename T>
__global__ void __launch_bounds__(kQThreads) indexer_q_fp4_128(T* q, const int* pos, const int* req,
                                                               const float* inv_freq, int rope_dim, int n_heads) {
    constexpr int kDim = 128, kWarps = kQThreads / 32, kPer = 64 / kWarps;
    using Raw = Raw4<T>;
    __shared__ float2 cs[kDim / 2];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (req[t] < 0) return;
    if (inv_freq) rope_table(cs, inv_freq, rope_dim, pos[t]);
    __syncthreads();
    T* row = q + static_cast<size_t>(t) * n_heads * kDim + 4 * lane;
    Raw raw[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
        if (warp + kWarps * i < n_heads) raw[i] = *reinterpret_cast<const Raw*>(row + (warp + kWarps * i) * kDim);
    const float norm = hadamard_norm(kDim);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int h = warp + kWarps * i;
        if (h >= n_heads) break;
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = to_float(reinterpret_cast<const T*>(&raw[i])[e]);
        if (inv_freq) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int d = 4 * lane + 2 * j;
                if (d < kDim - rope_dim) continue;
                const float2 r = cs[(d - (kDim - rope_dim)) / 2];
                const float ev = x[2 * j], od = x[2 * j + 1];
                x[2 * j] = ev * r.x - od * r.y;
                x[2 * j + 1] = od * r.x + ev * r.y;
            }
        }
#pragma unroll
        for (int s = 1; s < 4; s <<= 1)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!(e & s)) {
                    const float u = x[e], v = x[e + s];
                    x[e] = u + v;
                    x[e + s] = u - v;
                }
#pragma unroll
        for (int m = 1; m < 32; m <<= 1)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, x[e], m);
                x[e] = lane & m ? other - x[e] : x[e] + other;
            }
        float amax = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(x[e] = fmaf(x[e], norm, 0.f)));
#pragma unroll
        for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
        const unsigned scale = fp4_scale_byte(amax);
        Raw out;
#pragma unroll
        for (int e = 0; e < 4; ++e)
            reinterpret_cast<T*>(&out)[e] =
                from_float<T>(e2m1_value(e2m1_code(x[e] * e8m0_value(254u - scale))) * e8m0_value(scale));
        *reinterpret_cast<Raw*>(row + h * kDim) = out;
    }
}
