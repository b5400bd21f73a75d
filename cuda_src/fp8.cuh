// e4m3 helpers of the faithful-mode fp8 kernels (fp8.cu, gemm_fp8.cu, moe_fp4.cu, the fp8 KV cache of kv_fp8.cuh),
// docs/numerics.md#act-quant. e4m3 values travel as raw bytes, scales as e8m0 bytes (2^(byte - 127)), one per 128 values
// of a row for activations, per 128 x 128 tile for weights.
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

// Two e4m3 codes (low byte first) exactly, NaN included.
__device__ __forceinline__ float2 e4m3x2_value(unsigned short codes) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3)));
}

__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    const unsigned l = __bfloat16_as_ushort(__float2bfloat16_rn(lo)), h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
    return l | h << 16;
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

__device__ __forceinline__ float act_inverse(unsigned byte) { return __uint_as_float((254u - byte) << 23); }
