// dsv4rt-instantiate: act_quant<float> act_quant<__nv_bfloat16>
// dsv4rt-instantiate: dequantize_weight<float> dequantize_weight<__nv_bfloat16>
// dsv4rt-instantiate: fp8_skinny_gemm<float,E4m3Bytes,1> fp8_skinny_gemm<float,E4m3Bytes,2>
// dsv4rt-instantiate: fp8_skinny_gemm<__nv_bfloat16,E4m3Bytes,1> fp8_skinny_gemm<__nv_bfloat16,E4m3Bytes,2>
// dsv4rt-instantiate: fp8_skinny_gemm<float,float,1> fp8_skinny_gemm<float,float,2>
// dsv4rt-instantiate: fp8_skinny_gemm<__nv_bfloat16,__nv_bfloat16,1> fp8_skinny_gemm<__nv_bfloat16,__nv_bfloat16,2>
#include "common.cuh"
#include "fp8.cuh"

// Faithful-mode fp8 (docs/numerics.md#act-quant): the activation quantiser in front of every GEMM whose weight is
// stored in fp8, and the decode GEMM of such a weight; formats in fp8.cuh.
using E4m3Bytes = unsigned char;  // act_quant-ed activations: a name for the instantiation lists

// Four elements of T in one access (p aligned to four elements).
template <typename T> struct alignas(4 * sizeof(T)) Quad { T e[4]; };

// reference.quant.act_quant per row and block of 128 columns (the last may be shorter): s (act_scale_byte) and the
// codes e4m3(x / s) (act_codes), infinities and finite values above 448 of a non-finite block saturating to ±448,
// NaN staying NaN: q [rows, k] the codes and scale [rows, ceil(k/128)] the e8m0 bytes of s. One warp per block of a
// row, four columns a lane.
template <typename T>
__global__ void __launch_bounds__(256) act_quant(unsigned char* q, unsigned char* scale, const T* x, int rows, int k) {
    const int lane = threadIdx.x & 31, nkb = (k + kFp8Block - 1) / kFp8Block;
    const long long task = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (task >= static_cast<long long>(rows) * nkb) return;  // whole warps
    const int row = static_cast<int>(task / nkb), kb = static_cast<int>(task % nkb), col = kb * kFp8Block + 4 * lane;
    const size_t at = static_cast<size_t>(row) * k + col;
    const auto aligned = [](const void* p, unsigned n) { return reinterpret_cast<unsigned long long>(p) % n == 0; };
    const bool vec = k % 4 == 0 && col < k && aligned(x, sizeof(Quad<T>)) && aligned(q, 4);
    float v[4];
    if (vec) {
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
    const unsigned byte = act_scale_byte(amax, __all_sync(0xffffffffu, finite));
    const float inv = e8m0_value(254u - byte);
    const unsigned short codes[2] = {act_codes(v[0], v[1], inv), act_codes(v[2], v[3], inv)};
    const unsigned packed = codes[0] | static_cast<unsigned>(codes[1]) << 16;
    if (vec) {
        *reinterpret_cast<unsigned*>(q + at) = packed;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (col + i < k) q[at + i] = static_cast<unsigned char>(packed >> (8 * i));
    }
    if (lane == 0) scale[static_cast<size_t>(row) * nkb + kb] = static_cast<unsigned char>(byte);
}

// What a thread loads of activation row g for 16 consecutive weight bytes of k: 16 e4m3 bytes (one 16-byte
// load, every lane of a quad reading its own), 16 bf16 or 16 float32 values (the W8A16 forms).
template <typename InT> constexpr int kXLoads = sizeof(InT);

// d += (16 weight bytes of rows g, g + 8) · (the same 16 k of activation row g), in k-slots of this thread
// alone (see fp8_skinny_gemm). e4m3 activations: two m16n8k32. bf16: four m16n8k16 on the weights widened to
// bf16 (exact). float32: each value split into three bf16 parts whose sum is the value, products exact in fp32.
template <typename InT>
__device__ __forceinline__ void dot16(float (&d)[4], const uint4& w0, const uint4& w1, const uint4 (&a)[kXLoads<InT>]) {
    if constexpr (sizeof(InT) == 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            mma<Mma::e4m3>(d, word(w0, 2 * h), word(w1, 2 * h), word(w0, 2 * h + 1), word(w1, 2 * h + 1),
                           word(a[0], 2 * h), word(a[0], 2 * h + 1));
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned r0 = word(w0, q), r1 = word(w1, q);
            const unsigned a0 = widen_e4m3x2(r0, 0), a1 = widen_e4m3x2(r1, 0);
            const unsigned a2 = widen_e4m3x2(r0, 1), a3 = widen_e4m3x2(r1, 1);
            if constexpr (sizeof(InT) == 2) {
                mma<Mma::bf16>(d, a0, a1, a2, a3, word(a[q >> 1], 2 * (q & 1)), word(a[q >> 1], 2 * (q & 1) + 1));
            } else {
                unsigned lo[3], hi[3];
                split_bf16x3(__uint_as_float(word(a[q], 0)), __uint_as_float(word(a[q], 1)), lo);
                split_bf16x3(__uint_as_float(word(a[q], 2)), __uint_as_float(word(a[q], 3)), hi);
#pragma unroll
                for (int part = 0; part < 3; ++part) mma<Mma::bf16>(d, a0, a1, a2, a3, lo[part], hi[part]);
            }
        }
    }
}

// y [m, n] = Σ over 128-column blocks kb of (x[:, kb] · wq[:, kb]ᵀ) · x_scale[:, kb] · w_scale[n / 128, kb]:
// the fp8 linear layer of the faithful mode (twin: reference.ops.Linear on the dequantised weight) for decode
// batches. wq [n, k] and w_scale [ceil(n/128), ceil(k/128)] are the checkpoint's tensors as they are. InT
// unsigned char: x is act_quant's e4m3 [m, k] with x_scale [m, ceil(k/128)]; bf16 or float32 (W8A16, for the
// weights whose input the reference does not quantise): x is the activation itself and x_scale unused.
// Grouped (the output projection): the n columns fall into groups of group_n, and group j of a row reads
// columns j·k.. of an x row of (n / group_n)·k values (and its scales likewise); group_n = n is one plain GEMM.
// k must be a multiple of 16, group_n of 16, the arrays 16-byte aligned.
//
// A block owns 16 output columns (weight rows) and 8·XT rows (blockIdx.z: rows 8·XT·z..); its warps split
// the 128-column blocks of k and sum through shared memory at the end. Each warp streams its 16 weight rows
// with 16-byte loads that bypass L1; the activation rows come through L1, which every warp and block reads
// alike. Tensor cores (weights as the 16-row operand, activations as XT 8-row ones, fp32 accumulation) give
// each 128-block's dot products, which are then scaled in fp32. A dot product over k does not depend on the
// order of k, so each thread feeds the mma the 16 consecutive weight bytes it loaded from each of its rows,
// wherever the fragment layout would put them: thread (g = lane / 4, t = lane % 4) holds bytes 64j + 16t ..
// + 15 of a block (j = 0, 1) of weight rows g and g + 8 and the same k of activation row g of each tile.
template <typename OutT, typename InT, int XT>
__global__ void __launch_bounds__(512) fp8_skinny_gemm(OutT* y, const InT* x, const unsigned char* x_scale,
                                                       const unsigned char* wq, const unsigned char* w_scale, int m,
                                                       int n, int k, int group_n) {
    constexpr int ROWS = 8 * XT, U = 2;  // U blocks' weight loads in flight (32 registers)
    constexpr bool kQuantized = sizeof(InT) == 1;
    extern __shared__ float partial[];   // [warps][ROWS][16]
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int n0 = blockIdx.x * 16, m0 = blockIdx.z * ROWS, nkb = (k + kFp8Block - 1) / kFp8Block;
    const int groups = n / group_n, group = n0 / group_n;
    const unsigned char* wrow[2];
    bool wok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        wok[r] = n0 + g + 8 * r < n;
        wrow[r] = wq + static_cast<size_t>(wok[r] ? n0 + g + 8 * r : 0) * k;
    }
    const InT* xrow[XT];
    const unsigned char* srow[XT][2];
    bool xok[XT], sok[XT][2];  // sok: rows 2t and 2t + 1 of the tile, whose scales this thread applies
#pragma unroll
    for (int i = 0; i < XT; ++i) {
        xok[i] = m0 + 8 * i + g < m;
        xrow[i] = x + (static_cast<size_t>(xok[i] ? m0 + 8 * i + g : 0) * groups + group) * k;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sok[i][c] = m0 + 8 * i + 2 * t + c < m;
            srow[i][c] = x_scale + (static_cast<size_t>(sok[i][c] ? m0 + 8 * i + 2 * t + c : 0) * groups + group) * nkb;
        }
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
                float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int at = kb * kFp8Block + 64 * j + 16 * t;
                    uint4 a[kXLoads<InT>];
#pragma unroll
                    for (int l = 0; l < kXLoads<InT>; ++l)
                        a[l] = xok[i] && at < k ? __ldg(reinterpret_cast<const uint4*>(xrow[i] + at) + l) : zero;
                    dot16<InT>(d, w[u][0][j], w[u][1][j], a);
                }
                float s[2];
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    s[c] = !sok[i][c] ? 0.f : kQuantized ? e8m0_to_float(srow[i][c][kb]) * sw : sw;
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

// out [n, k] = wq [n, k] times its e8m0 scale per 128 x 128 tile, exact in float32 and bf16: the prefill
// form of a W8A16 weight, expanded into a scratch buffer right before its GEMM. 16 values a thread, all under
// one scale (k is a multiple of 16), read and written in 16-byte accesses.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_weight(T* out, const unsigned char* wq, const unsigned char* w_scale,
                                                         int n, int k) {
    const long long i = 16 * (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x);
    if (i >= static_cast<long long>(n) * k) return;
    const int row = static_cast<int>(i / k), col = static_cast<int>(i % k), nkb = (k + kFp8Block - 1) / kFp8Block;
    const float s = e8m0_to_float(w_scale[static_cast<size_t>(row / kFp8Block) * nkb + col / kFp8Block]);
    const uint4 v = *reinterpret_cast<const uint4*>(wq + i);
    alignas(16) T values[16];
#pragma unroll
    for (int h = 0; h < 8; ++h) {
        const float2 f = e4m3x2_value(static_cast<unsigned short>(word(v, h >> 1) >> (16 * (h & 1))));
        values[2 * h] = from_float<T>(f.x * s);
        values[2 * h + 1] = from_float<T>(f.y * s);
    }
#pragma unroll
    for (int j = 0; j < static_cast<int>(sizeof(T)); ++j)
        reinterpret_cast<uint4*>(out + i)[j] = reinterpret_cast<const uint4*>(values)[j];
}
