// dsv4rt-instantiate: act_quant<float> act_quant<__nv_bfloat16>
// dsv4rt-instantiate: fp8_skinny_gemm<float,1> fp8_skinny_gemm<float,2>
// dsv4rt-instantiate: fp8_skinny_gemm<__nv_bfloat16,1> fp8_skinny_gemm<__nv_bfloat16,2>
#include <cuda_fp8.h>
#include "common.cuh"
#include "fp8.cuh"

// Faithful-mode fp8 (MODEL.md section 9): the activation quantiser in front of every GEMM whose weight is
// stored in fp8, and the decode GEMM of such a weight; formats in fp8.cuh.
constexpr float kE4m3Max = 448.f;

__device__ __forceinline__ float e8m0_to_float(unsigned b) {
    // 0 is 2^-127, below the normal range; 255 is NaN (as loader.formats.e8m0_to_float32)
    return b == 255 ? __uint_as_float(0x7fc00000u) : b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);
}

// Four elements of T in one access (p aligned to four elements).
template <typename T> struct alignas(4 * sizeof(T)) Quad { T e[4]; };

// reference.quant.act_quant as bytes: per row and block of 128 columns (the last may be shorter),
// s = 2^ceil(log2(max(amax, 1e-4) / 448)), its e8m0 byte in scale [rows, ceil(k/128)], and q [rows, k] =
// e4m3(x / s) rounded to nearest even. The quotient amax / 448 is rounded to float32 before its exponent is
// taken, as numpy does. A block holding NaN or ±inf gets s = 1, as in the reference (frexp of a non-finite
// ratio gives exponent 0): its infinities and finite values above 448 saturate to ±448, NaN stays NaN.
// One warp per block of a row, four columns a lane.
template <typename T>
__global__ void __launch_bounds__(256) act_quant(unsigned char* q, unsigned char* scale, const T* x, int rows, int k) {
    const int lane = threadIdx.x & 31, nkb = (k + kFp8Block - 1) / kFp8Block;
    const long long task = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (task >= static_cast<long long>(rows) * nkb) return;  // whole warps
    const int row = static_cast<int>(task / nkb), kb = static_cast<int>(task % nkb), col = kb * kFp8Block + 4 * lane;
    const size_t at = static_cast<size_t>(row) * k + col;
    const bool vec = k % 4 == 0 && (reinterpret_cast<unsigned long long>(x) % sizeof(Quad<T>)) == 0 &&
                     (reinterpret_cast<unsigned long long>(q) & 3) == 0;
    float v[4];
    if (vec && col < k) {
        const Quad<T> quad = *reinterpret_cast<const Quad<T>*>(x + at);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_float(quad.e[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = col + i < k ? to_float(x[at + i]) : 0.f;
    }
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(v[i])), finite &= isfinite(v[i]);
    amax = warp_max(amax);  // fmaxf drops NaN: non-finite blocks are told apart by the vote instead
    unsigned byte = 127;
    if (__all_sync(0xffffffffu, finite)) {
        const unsigned r = __float_as_uint(__fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Max));  // a positive normal float
        byte = (r >> 23) + ((r & 0x7fffffu) != 0);  // the exponent of 2^ceil(log2 r), biased by 127 like e8m0
    }
    const float inv = __uint_as_float((254u - byte) << 23);  // 1 / s, exact: byte stays within [105, 247]
    unsigned packed = 0;
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        float2 p = make_float2(v[i] * inv, v[i + 1] * inv);
        // ±inf to ±448 explicitly, as the reference's min(·, 448); NaN passes to the conversion's NaN
        if (!isnan(p.x)) p.x = fminf(fmaxf(p.x, -kE4m3Max), kE4m3Max);
        if (!isnan(p.y)) p.y = fminf(fmaxf(p.y, -kE4m3Max), kE4m3Max);
        packed |= static_cast<unsigned>(__nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
    }
    if (vec && col < k) {
        *reinterpret_cast<unsigned*>(q + at) = packed;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (col + i < k) q[at + i] = static_cast<unsigned char>(packed >> (8 * i));
    }
    if (lane == 0) scale[static_cast<size_t>(row) * nkb + kb] = static_cast<unsigned char>(byte);
}

// y [m, n] = Σ over 128-column blocks kb of (xq[:, kb] · wq[:, kb]ᵀ) · x_scale[:, kb] · w_scale[n / 128, kb]:
// the fp8 linear layer of the faithful mode (twin: reference.ops.Linear with act_quant in front of the
// dequantised weight) for decode batches. xq [m, k] and x_scale [m, ceil(k/128)] come from act_quant, wq [n, k]
// and w_scale [ceil(n/128), ceil(k/128)] are the checkpoint's tensors as they are. k must be a multiple of 16
// and the byte arrays 16-byte aligned.
//
// A block owns 16 output columns (weight rows) and 8·XT rows (blockIdx.z: rows 8·XT·z..); its warps split
// the 128-column blocks of k and sum through shared memory at the end. Each warp streams its 16 weight rows
// with 16-byte loads that bypass L1; the activation rows come through L1, which every warp and block reads
// alike. Tensor cores (mma m16n8k32 e4m3, fp32 accumulation: weights as the 16-row operand, activations as
// XT 8-row ones) give each 128-block's dot products, which are then scaled in fp32. A dot product over k
// does not depend on the order of k, so each thread feeds the mma the 16 consecutive bytes it loaded from
// each of its rows, wherever the fragment layout would put them: thread (g = lane / 4, t = lane % 4) holds
// bytes 64j + 16t .. + 15 of a block (j = 0, 1) of weight rows g and g + 8 and of activation row g of each
// tile; words 2h and 2h + 1 of them fill the k slots 4t.. and 16 + 4t.. of mma (j, h).
template <typename OutT, int XT>
__global__ void __launch_bounds__(512) fp8_skinny_gemm(OutT* y, const unsigned char* xq, const unsigned char* x_scale,
                                                       const unsigned char* wq, const unsigned char* w_scale, int m,
                                                       int n, int k) {
    constexpr int ROWS = 8 * XT, U = 2;  // U blocks' weight loads in flight (32 registers)
    extern __shared__ float partial[];   // [warps][ROWS][16]
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int n0 = blockIdx.x * 16, m0 = blockIdx.z * ROWS, nkb = (k + kFp8Block - 1) / kFp8Block;
    const unsigned char* wrow[2];
    bool wok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        wok[r] = n0 + g + 8 * r < n;
        wrow[r] = wq + static_cast<size_t>(wok[r] ? n0 + g + 8 * r : 0) * k;
    }
    const unsigned char* xrow[XT];
    bool xok[XT], sok[XT][2];  // sok: rows 2t and 2t + 1 of the tile, whose scales this thread applies
#pragma unroll
    for (int i = 0; i < XT; ++i) {
        xok[i] = m0 + 8 * i + g < m;
        xrow[i] = xq + static_cast<size_t>(xok[i] ? m0 + 8 * i + g : 0) * k;
        sok[i][0] = m0 + 8 * i + 2 * t < m;
        sok[i][1] = m0 + 8 * i + 2 * t + 1 < m;
    }
    const unsigned char* ws = w_scale + static_cast<size_t>(n0 / kFp8Block) * nkb;  // 16 divides 128
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[XT][4] = {};
    for (int kb0 = warp; kb0 < nkb; kb0 += U * warps) {
        uint4 w[U][2][2];  // [block][weight row g, g + 8][j]
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int kb = kb0 + u * warps, at = kb * kFp8Block + 64 * j + 16 * t;
                    w[u][r][j] = kb < nkb && wok[r] && at < k ? load_stream(wrow[r] + at) : zero;
                }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * warps;
            if (kb >= nkb) break;
            const float sw = e8m0_to_float(ws[kb]);
#pragma unroll
            for (int i = 0; i < XT; ++i) {
                uint4 a[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int at = kb * kFp8Block + 64 * j + 16 * t;
                    a[j] = xok[i] && at < k ? __ldg(reinterpret_cast<const uint4*>(xrow[i] + at)) : zero;
                }
                float s[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int at = (m0 + 8 * i + 2 * t + c) * nkb + kb;  // m·nkb is far below 2^31
                    s[c] = sok[i][c] ? e8m0_to_float(x_scale[at]) * sw : 0.f;
                }
                float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        mma<Mma::e4m3>(d, word(w[u][0][j], 2 * h), word(w[u][1][j], 2 * h),
                                       word(w[u][0][j], 2 * h + 1), word(w[u][1][j], 2 * h + 1), word(a[j], 2 * h),
                                       word(a[j], 2 * h + 1));
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(d[c], s[c & 1], acc[i][c]);
            }
        }
    }
    // d[c]: weight row g + 8·(c / 2), activation row 2t + c % 2 of the tile
    float* mine = partial + warp * ROWS * 16;
#pragma unroll
    for (int i = 0; i < XT; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) mine[(8 * i + 2 * t + (c & 1)) * 16 + g + 8 * (c >> 1)] = acc[i][c];
    __syncthreads();
    for (int e = threadIdx.x; e < ROWS * 16; e += blockDim.x) {
        const int row = m0 + e / 16, col = n0 + e % 16;
        if (row >= m || col >= n) continue;
        float sum = 0.f;
        for (int v = 0; v < warps; ++v) sum += partial[v * ROWS * 16 + e];
        y[static_cast<size_t>(row) * n + col] = from_float<OutT>(sum);
    }
}
