// Faithful-mode indexer keys and queries (docs/numerics.md#indexer-rounding): after RoPE, the orthonormal Walsh-Hadamard
// rotation over the next power of two n >= dim (zeros appended, the first dim outputs kept, as
// reference.quant.rotate), then e2m1 with a ue8m0 scale per 32 values, s = 2^ceil(log2(max(amax, 6·2^-126) / 6)),
// round to nearest even. A stored key is reference.layouts.encode_indexer_key's bytes, fp4_entry_bytes(dim) of
// them (68 at dim 128): code pairs (low nibble = even index), then one scale byte per 32 values. Entries may lie
// at any byte offset (the tensor-core reader copies 4-byte words); codes times a power-of-two scale are exact in
// float32 and bf16.
#pragma once
#include "kv_fp8.cuh"

constexpr int kFp4Block = 32;  // values per scale

__device__ __forceinline__ int fp4_entry_bytes(int dim) { return dim / 2 + (dim + kFp4Block - 1) / kFp4Block; }

__device__ __forceinline__ int hadamard_size(int dim) { return dim <= 1 ? 1 : 1 << (32 - __clz(dim - 1)); }

// float32(1 / float32(sqrt(n))) for n a power of two, reference.quant.hadamard's entry magnitude bit for bit:
// 2^-L/2 for even L = log2 n, else 2^-(L-1)/2 times float32(1 / float32(sqrt 2)).
__device__ __forceinline__ float hadamard_norm(int n) {
    const int log2n = __ffs(n) - 1;
    return __uint_as_float((log2n & 1 ? 0x3f3504f3u : 0x3f800000u) - (static_cast<unsigned>(log2n >> 1) << 23));
}

// x[0, n) in shared memory times the unnormalised Sylvester-order Hadamard matrix, in place, by one warp.
__device__ __forceinline__ void hadamard_warp(float* x, int n, int lane) {
    for (int h = 1; h < n; h <<= 1) {
        __syncwarp();
        for (int i = lane; i < n / 2; i += 32) {
            const int a = (i & ~(h - 1)) * 2 + (i & (h - 1));  // the pairs (a, a + h) of this stage
            const float u = x[a], v = x[a + h];
            x[a] = u + v;
            x[a + h] = u - v;
        }
    }
    __syncwarp();
}

// The e8m0 byte of the scale, without the division: with amax = M·2^E, M in [1, 2), amax / 6 = (M / 1.5)·2^(E-2)
// lies in (2^(E-3), 2^(E-2)] for M <= 1.5 and in (2^(E-2), 2^(E-1)) above, and its float32 rounding crosses neither
// bound (the float32 above 1.5 is 1.5 + 2^-23, whose quotient is 2^(E-2)·(1 + 2^-23 / 1.5), past the midpoint).
// The floor 6·2^-126 (1.5·2^-124) gives byte 1; amax / s <= 6.
__device__ __forceinline__ unsigned fp4_scale_byte(float amax) {
    const unsigned b = __float_as_uint(fmaxf(amax, __uint_as_float(0x01c00000u)));
    return (b >> 23) - 2 + ((b & 0x7fffffu) > 0x400000u);
}

// The e2m1 code of x (|x| <= 6) rounded to nearest even, sign in bit 3 (set for -0 and for negatives that
// round to 0, as numpy's copysign): magnitudes 0, .5, 1, 1.5 are codes 0-3 (2|x| rounded), 2, 3, 4 codes 4-6
// (|x| rounded, + 2), 4, 6 codes 6, 7 (|x| / 2 rounded, + 4). Even codes are the even grid points.
__device__ __forceinline__ unsigned e2m1_code(float x) {
    const float a = fabsf(x);
    const float k = a < 2.f ? rintf(2.f * a) : a < 4.f ? rintf(a) + 2.f : rintf(0.5f * a) + 4.f;
    return static_cast<unsigned>(k) | (__float_as_uint(x) >> 28 & 8u);
}

__device__ __forceinline__ float e2m1_value(unsigned code) {
    const unsigned m = code & 7u;
    return __uint_as_float((m < 2 ? m * 0x3f000000u : (m << 22) + 0x3f000000u) | (code & 8u) << 28);
}

// Element d of a warp's rotated row x (dim values rotated in place by hadamard_warp over n): its code and the
// scale byte of its 32-value block. The lanes of the warp take consecutive d of one block; lanes past dim read 0.
struct Fp4Value {
    unsigned code, scale;
};
__device__ __forceinline__ Fp4Value fp4_round(const float* x, int dim, int n, int d) {
    const float v = d < dim ? fmaf(x[d], hadamard_norm(n), 0.f) : 0.f;  // + 0: a zero is +0, as numpy's matmul
    const unsigned scale = fp4_scale_byte(warp_max(fabsf(v)));
    return {e2m1_code(v * e8m0_value(254u - scale)), scale};
}

// Rotates the warp's row x (dim values, zeros up to hadamard_size(dim), in shared memory) and stores it as an
// entry at dst. Every lane of the warp calls it.
__device__ __forceinline__ void store_fp4_key(unsigned char* dst, float* x, int dim, int lane) {
    const int n = hadamard_size(dim);
    hadamard_warp(x, n, lane);
    for (int d0 = 0; d0 < dim; d0 += kFp4Block) {
        const Fp4Value v = fp4_round(x, dim, n, d0 + lane);
        const unsigned odd = __shfl_down_sync(0xffffffffu, v.code, 1);
        if (lane % 2 == 0 && d0 + lane < dim) dst[(d0 + lane) / 2] = static_cast<unsigned char>(v.code | odd << 4);
        if (lane == 0) dst[dim / 2 + d0 / kFp4Block] = static_cast<unsigned char>(v.scale);
    }
}

// Values 8o .. 8o + 7 of the entry at e (any alignment), dequantised in float32 as decode_indexer_key does.
__device__ __forceinline__ void load_fp4_octet(const unsigned char* e, int dim, int o, float (&v)[8]) {
    const unsigned char* c = e + 4 * o;
    const unsigned codes = c[0] | c[1] << 8 | c[2] << 16 | static_cast<unsigned>(c[3]) << 24;
    const float s = e8m0_value(e[dim / 2 + 8 * o / kFp4Block]);
    const uint4 p = e2m1x8_bf16(codes);
    const unsigned pairs[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a bf16 is the top half of its float
        v[2 * i] = __uint_as_float(pairs[i] << 16) * s;
        v[2 * i + 1] = __uint_as_float(pairs[i] & 0xffff0000u) * s;
    }
}
