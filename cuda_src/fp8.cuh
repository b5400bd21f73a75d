// e4m3 helpers of the faithful-mode fp8 kernels (fp8.cu, gemm_fp8.cu, moe_fp4.cu, the fp8 KV cache of kv_fp8.cuh),
// docs/numerics.md#act-quant. e4m3 values travel as raw bytes, scales as e8m0 bytes (2^(byte - 127)), one per 128 values
// of a row for activations, per 128 x 128 tile for weights.
#pragma once
#include <cuda_fp8.h>

constexpr int kFp8Block = 128;

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
