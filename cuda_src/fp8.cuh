// e4m3 helpers of the faithful-mode fp8 GEMMs (fp8.cu, moe_fp4.cu), MODEL.md section 9. e4m3 values travel as
// raw bytes, scales as e8m0 bytes (2^(byte - 127)), one per 128 values of a row for activations, per 128 x 128
// tile for weights.
#pragma once

constexpr int kFp8Block = 128;

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
