// e4m3 helpers of the faithful-mode fp8 GEMMs (fp8.cu, moe_fp4.cu), MODEL.md section 9. e4m3 values travel as
// raw bytes, scales as e8m0 bytes (2^(byte - 127)), one per 128 values of a row for activations, per 128 x 128
// tile for weights.
#pragma once

constexpr int kFp8Block = 128;

// 16 bytes of a weight row, read once: no L1 allocation, so the activations stay there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// d += a·b on the tensor cores: a 16 x 32 e4m3 (row-major), b 32 x 8 e4m3 (column-major), d 16 x 8 fp32.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
