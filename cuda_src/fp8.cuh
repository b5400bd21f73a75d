// e4m3 and e2m1 helpers of the faithful-mode kernels (fp8.cu, gemm_fp8.cu, gemm_w8a16.cu, moe_fp4.cu, moe_wgmma.cu,
// the fp8 KV cache of kv_fp8.cuh, the fp4 indexer keys), docs/numerics.md#act-quant. e4m3 values travel as raw
// bytes, scales as e8m0 bytes (2^(byte - 127)), one per 128 values of a row for activations, per 128 x 128 tile for
// weights.
#pragma once
#include <cuda_fp8.h>

constexpr int kFp8Block = 128;
constexpr float kE4m3Max = 448.f;

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ float e8m0_to_float(unsigned b) {
    // 0 is 2^-127, below the normal range; 255 is NaN (as loader.formats.e8m0_to_float32)
    return b == 255 ? __uint_as_float(0x7fc00000u) : b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);
}
__device__ __forceinline__ float e8m0_value(unsigned byte) { return __uint_as_float(byte << 23); }  // byte in [1, 254]

// As e8m0_to_float, a bf16 pair: 0 is 2^-127 (a bf16 subnormal), 255 NaN.
__device__ __forceinline__ __nv_bfloat162 e8m0_bf16x2(unsigned byte) {
    const unsigned short b = byte == 0 ? 0x0040 : byte == 255 ? 0x7fc0 : byte << 7;
    return __halves2bfloat162(__ushort_as_bfloat16(b), __ushort_as_bfloat16(b));
}

// Eight e2m1 codes (code i in bits 4i .. 4i + 3) as four bf16 pairs, lowest value first, unscaled. The magnitudes'
// bf16 high and low bytes come from byte-permute tables indexed by the 3-bit magnitude; value 2j's sign is bit
// 8j + 3 of codes, value 2j + 1's bit 8j + 7: bits 7 of byte j of codes << 4 and of codes.
__device__ __forceinline__ uint4 e2m1x8_bf16(unsigned codes) {
    constexpr unsigned kHi0 = 0x3f3f3f00u, kHi1 = 0x40404040u;  // 0, .5, 1, 1.5 | 2, 3, 4, 6: 0x3f00, 0x3f80, ...
    constexpr unsigned kLo0 = 0xc0800000u, kLo1 = 0xc0804000u;
    const unsigned m = codes & 0x77777777u, shifted = codes << 4;
    const unsigned hi03 = __byte_perm(kHi0, kHi1, m), lo03 = __byte_perm(kLo0, kLo1, m);
    const unsigned hi47 = __byte_perm(kHi0, kHi1, m >> 16), lo47 = __byte_perm(kLo0, kLo1, m >> 16);
    return make_uint4(__byte_perm(lo03, hi03, 0x5140) | (__byte_perm(shifted, codes, 0x4000) & 0x80008000u),
                      __byte_perm(lo03, hi03, 0x7362) | (__byte_perm(shifted, codes, 0x5111) & 0x80008000u),
                      __byte_perm(lo47, hi47, 0x5140) | (__byte_perm(shifted, codes, 0x6222) & 0x80008000u),
                      __byte_perm(lo47, hi47, 0x7362) | (__byte_perm(shifted, codes, 0x7333) & 0x80008000u));
}

// e2m1x8_bf16's values times a block scale (e8m0_bf16x2), each product exact.
__device__ __forceinline__ uint4 e2m1x8_scaled(unsigned codes, __nv_bfloat162 scale) {
    uint4 v = e2m1x8_bf16(codes);
    unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(w + k), scale);
        w[k] = *reinterpret_cast<const unsigned*>(&p);
    }
    return v;
}

// 2^e exactly; 0 below the float32 subnormals, inf above the range.
__device__ __forceinline__ float pow2(int e) {
    return e > 127     ? __int_as_float(0x7f800000)
           : e >= -126 ? __int_as_float((e + 127) << 23)
           : e >= -149 ? __int_as_float(1 << (e + 149))
                       : 0.f;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned selector) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// The e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7) times 2^e, e <= 6, a prmt table.
// For e >= -5 every byte is a normal e4m3 whose exponent field moves with e: magnitude m >= 2 is m·4 + 8·(e + 6),
// 0.5 is 8·(e + 6); below, the float products are rounded.
__device__ __forceinline__ uint2 e2m1_table(int e) {
    if (e >= -5) {
        const unsigned b = 8 * (e + 6);
        return make_uint2(0x0C080000u + b * 0x01010100u, 0x1C181410u + b * 0x01010101u);
    }
    const float f = pow2(e);
    const auto two = [f](float a, float b) {
        return static_cast<unsigned>(__nv_cvt_float2_to_fp8x2(make_float2(a * f, b * f), __NV_SATFINITE, __NV_E4M3));
    };
    return make_uint2(two(0.f, .5f) | two(1.f, 1.5f) << 16, two(2.f, 3.f) | two(4.f, 6.f) << 16);
}

// The four e2m1 codes in the low 16 bits of v (code i in bits 4i..4i+3) as four e4m3 bytes through the table; a sign
// bit, moved to bit 2 of its selector, picks byte 0x80.
__device__ __forceinline__ unsigned e2m1x4_to_e4m3(unsigned v, uint2 table) {
    return prmt(table.x, table.y, v & 0x7777u) | prmt(0u, 0x80u, v >> 1 & 0x4444u);
}

// Two e4m3 codes (low byte first) exactly, NaN included.
__device__ __forceinline__ float2 e4m3x2_value(unsigned short codes) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3)));
}

// Bytes 2h and 2h + 1 of four e4m3 values as a bf16 pair, by moving bits (conversion instructions run at a quarter
// of the rate and kept the W8A16 GEMM at half the bandwidth): sign and the seven magnitude bits land where bf16
// keeps them, which reads the value times 2^-120 (subnormals included), and one exact bf16 multiply restores it.
// The NaN byte reads as ±480; no released weight holds NaN.
__device__ __forceinline__ unsigned widen_e4m3x2(unsigned v, int h) {
    const unsigned x = __byte_perm(v, 0, h ? 0x3424 : 0x1404);  // bytes 2h, 2h + 1 to the top of each half
    const unsigned b = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&b),
                                     __floats2bfloat162_rn(0x1p120f, 0x1p120f));
    return *reinterpret_cast<const unsigned*>(&r);
}

// One bit (bit 7 of the byte) for each NaN code (magnitude 0x7f) among four e4m3 bytes: no carry crosses a byte.
__device__ __forceinline__ unsigned e4m3_nan_bytes(unsigned codes) {
    return ((codes & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// Eight e4m3 codes (lo: the first four) times their block scale (e8m0_bf16x2) as eight bf16, each dequantize_weight's
// value: widen_e4m3x2 is exact and the bf16 multiply rounds the exact product once, as the float product's rounding to
// bf16 does. NaN codes, which widen_e4m3x2 reads as ±480, are made NaN.
__device__ __forceinline__ uint4 e4m3x8_scaled(unsigned lo, unsigned hi, __nv_bfloat162 scale) {
    unsigned v[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const unsigned pair = widen_e4m3x2(p < 2 ? lo : hi, p & 1);
        const __nv_bfloat162 r = __hmul2_rn(*reinterpret_cast<const __nv_bfloat162*>(&pair), scale);
        v[p] = *reinterpret_cast<const unsigned*>(&r);
    }
    if (e4m3_nan_bytes(lo) | e4m3_nan_bytes(hi)) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // the flags of bytes 2p, 2p + 1 to bits 15 and 31, as widen_e4m3x2 moves them
            const unsigned nan = __byte_perm(e4m3_nan_bytes(p < 2 ? lo : hi), 0, p & 1 ? 0x3424 : 0x1404);
            v[p] |= (nan >> 15 & 0x10001u) * 0x7fc0u;
        }
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    const unsigned l = __bfloat16_as_ushort(__float2bfloat16_rn(lo)), h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
    return l | h << 16;
}

// Two floats as three bf16 pairs (lo in the low halves) that sum to them exactly, so that products of bf16 operands
// with them are exact in fp32: each part rounds what the parts before it left, a remainder float32 holds exactly,
// and the third has at most 8 significant bits left. An infinity goes whole into the first part.
__device__ __forceinline__ void split_bf16x3(float lo, float hi, unsigned (&parts)[3]) {
#pragma unroll
    for (int p = 0; p < 3; ++p) {
        parts[p] = bf16x2(lo, hi);
        lo = isfinite(lo) ? lo - __uint_as_float(parts[p] << 16) : 0.f;
        hi = isfinite(hi) ? hi - __uint_as_float(parts[p] & 0xffff0000u) : 0.f;
    }
}

// act_quant's scale of a block (docs/numerics.md#act-quant) as its e8m0 byte: s = 2^ceil(log2(max(amax, 1e-4) / 448)),
// the quotient rounded to float32 before its exponent is taken, as numpy does; 127 (s = 1) for a block holding NaN
// or ±inf, as in the reference (frexp of a non-finite ratio gives exponent 0). The byte stays within [105, 247].
__device__ __forceinline__ unsigned act_scale_byte(float amax, bool finite) {
    if (!finite) return 127;
    const unsigned r = __float_as_uint(__fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Max));  // a positive normal float
    return (r >> 23) + ((r & 0x7fffffu) != 0);  // the exponent of 2^ceil(log2 r), biased by 127 like e8m0
}

// The e4m3 codes (low byte first) of a and b times 1/s, inv = 1/s of act_scale_byte: rounded to nearest even,
// ±inf to ±448 explicitly (the reference's min(·, 448)), NaN to NaN.
__device__ __forceinline__ unsigned short act_codes(float a, float b, float inv) {
    float2 p = make_float2(a * inv, b * inv);
    if (!isnan(p.x)) p.x = fminf(fmaxf(p.x, -kE4m3Max), kE4m3Max);
    if (!isnan(p.y)) p.y = fminf(fmaxf(p.y, -kE4m3Max), kE4m3Max);
    return __nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE, __NV_E4M3);
}

// act_quant of a row's 8 values at columns 8c .. 8c + 7 where the 16 lanes of a half warp hold the 16 chunks of a
// 128-column block (c = 16b + lane % 16): codes to q[8c ..], the block's scale byte to s[c / 16] by its first lane.
// Every lane of the half warp calls it; the same bytes as the act_quant kernel on these values.
__device__ __forceinline__ void act_quant_chunk(const float (&v)[8], unsigned char* q, unsigned char* s, int c) {
    const unsigned half = 0xffffu << (threadIdx.x & 16);
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e])), finite &= isfinite(v[e]);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {  // fmaxf drops NaN: non-finite blocks are told apart by the flag
        amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
        finite &= __shfl_xor_sync(half, static_cast<int>(finite), o) != 0;
    }
    const unsigned byte = act_scale_byte(amax, finite);
    const float inv = e8m0_value(254u - byte);
    unsigned short codes[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) codes[e] = act_codes(v[2 * e], v[2 * e + 1], inv);
    *reinterpret_cast<uint2*>(q + 8 * c) = make_uint2(codes[0] | static_cast<unsigned>(codes[1]) << 16,
                                                      codes[2] | static_cast<unsigned>(codes[3]) << 16);
    if ((c & 15) == 0) s[c >> 4] = static_cast<unsigned char>(byte);
}
