// Faithful-mode main KV cache entries (docs/caches.md#entry-layouts): window rows and compressed entries of width hd.
//
// After RoPE the nope dims [0, hd - rd) go onto e4m3 with a ue8m0 scale per 64 dims (a shorter last block
// takes its scale from its own dims), s = 2^ceil(log2(max(amax, 1e-4) / 448)), round to nearest even; the rope
// dims are not rounded. Kernels with the template flag Fp8Kv store, by storage type T:
//  * __nv_bfloat16: the bytes of reference.layouts.encode_kv, kv_fp8_bytes(hd, rd) per entry (584 at hd 512,
//    rd 64): nope e4m3 codes, rope dims as bf16, one e8m0 scale byte per 64 nope dims, zeros to a multiple of 8.
//    Entries are 8-byte aligned only; (hd - rd) % 8 == 0 keeps a lane's chunk on one side of the boundary.
//  * float (the build checked against the float32 reference): float32 rows whose nope dims hold the
//    dequantised e4m3 values, what reference.quant.kv_round returns; its rope dims stay float32 as there.
// Rows are warp-distributed as in attention.cuh, so one 64-dim scale block is the same chunk of 64 / kVec<T>
// adjacent lanes and its maximum is a shuffle among them.
#pragma once
#include "attention.cuh"
#include "fp8.cuh"

constexpr int kKvBlock = 64;  // nope dims per scale

__device__ __forceinline__ int kv_fp8_bytes(int hd, int rd) {
    const int nope = hd - rd;
    return (nope + 2 * rd + (nope + kKvBlock - 1) / kKvBlock + 7) / 8 * 8;
}

// The e8m0 byte of reference.quant.pow2_scale(max(amax, 1e-4), 448) = 2^ceil(log2(fl(amax / 448))), without
// the division (whose IEEE slow path is a call that made ptxas spill): with amax = M·2^E, M in [1, 2), the
// quotient (M / 1.75)·2^(E-8) lies in (2^(E-9), 2^(E-8)] for M <= 1.75 and in (2^(E-8), 2^(E-7)) above, and
// its float32 rounding crosses neither bound (checked against numpy on every float32 of the two octaves above
// 1e-4 and 2^24 random ones). So amax / s <= 448, and the byte stays within [105, 247].
__device__ __forceinline__ unsigned kv_scale_byte(float amax) {
    const unsigned b = __float_as_uint(fmaxf(amax, 1e-4f));
    return (b >> 23) - 8 + ((b & 0x7fffffu) > 0x600000u);
}

// Round to nearest even (|x| <= 448 by the choice of scale).
__device__ __forceinline__ unsigned short e4m3x2(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
// Eight values times inv as e4m3 codes, lowest address first.
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float inv) {
    const unsigned c0 = e4m3x2(v[0] * inv, v[1] * inv), c1 = e4m3x2(v[2] * inv, v[3] * inv);
    const unsigned c2 = e4m3x2(v[4] * inv, v[5] * inv), c3 = e4m3x2(v[6] * inv, v[7] * inv);
    return make_uint2(c0 | c1 << 16, c2 | c3 << 16);
}

// Stores the warp's row v (hd values after RoPE; chunks past hd hold zeros) as a faithful entry at dst
// (the float build rounds v in place). Every lane of the warp calls it.
template <typename T, int C, int V>
__device__ __forceinline__ void store_kv_entry(char* dst, float (&v)[C][V], int hd, int rd, int lane) {
    constexpr int G = kKvBlock / V;  // lanes whose chunks share a scale block
    static_assert(V % 2 == 0 && 32 % G == 0, "pairs of values, whole blocks per warp");
    const int nope = hd - rd;
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int d0 = (lane + 32 * i) * V;
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j) amax = d0 + j < nope ? fmaxf(amax, fabsf(v[i][j])) : amax;
#pragma unroll
        for (int o = 1; o < G; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (d0 >= hd) continue;
        const unsigned byte = kv_scale_byte(amax);
        const float inv = e8m0_value(254u - byte);  // 1 / s, exact
        if constexpr (sizeof(T) == 4) {
            const float s = e8m0_value(byte);
#pragma unroll
            for (int j = 0; j < V; j += 2) {  // nope is even: a pair never straddles it
                if (d0 + j >= nope) continue;
                const float2 q = e4m3x2_value(e4m3x2(v[i][j] * inv, v[i][j + 1] * inv));
                v[i][j] = q.x * s;
                v[i][j + 1] = q.y * s;
            }
            store_vec(reinterpret_cast<float*>(dst) + d0, v[i]);
        } else if (d0 < nope) {
            static_assert(V == 8, "a bf16 chunk is 8 codes, one 8-byte store");
            *reinterpret_cast<uint2*>(dst + d0) = e4m3x8(v[i], inv);
            if (lane % G == 0) dst[nope + 2 * rd + d0 / kKvBlock] = static_cast<char>(byte);
        } else {
            uint2* out = reinterpret_cast<uint2*>(dst + nope + 2 * (d0 - nope));
            out[0] = make_uint2(bf16x2(v[i][0], v[i][1]), bf16x2(v[i][2], v[i][3]));
            out[1] = make_uint2(bf16x2(v[i][4], v[i][5]), bf16x2(v[i][6], v[i][7]));
        }
    }
    if constexpr (sizeof(T) == 2) {
        const int used = nope + 2 * rd + (nope + kKvBlock - 1) / kKvBlock;
        if (lane < kv_fp8_bytes(hd, rd) - used) dst[used + lane] = 0;
    }
}

// The lane's chunks of an encoded bf16-build entry at e (8-byte aligned), dequantised as decode_kv does;
// chunks past hd read as zero.
template <int C, int V>
__device__ __forceinline__ void load_kv_fp8(const unsigned char* e, int hd, int rd, int lane, float (&v)[C][V]) {
    static_assert(V == 8, "the bf16 chunk");
    const int nope = hd - rd;
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int d0 = (lane + 32 * i) * V;
        if (d0 >= hd) {
#pragma unroll
            for (int j = 0; j < V; ++j) v[i][j] = 0.f;
        } else if (d0 < nope) {
            const uint2 codes = *reinterpret_cast<const uint2*>(e + d0);
            const float s = e8m0_value(e[nope + 2 * rd + d0 / kKvBlock]);
#pragma unroll
            for (int j = 0; j < V; j += 2) {
                const unsigned word = j < 4 ? codes.x : codes.y;
                const float2 q = e4m3x2_value(static_cast<unsigned short>(word >> (8 * (j % 4))));
                v[i][j] = q.x * s;
                v[i][j + 1] = q.y * s;
            }
        } else {
            const uint2* in = reinterpret_cast<const uint2*>(e + nope + 2 * (d0 - nope));
            const uint2 lo = in[0], hi = in[1];
            const unsigned words[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
            for (int j = 0; j < V; j += 2) {  // a bf16 is the top half of its float
                v[i][j] = __uint_as_float(words[j / 2] << 16);
                v[i][j + 1] = __uint_as_float(words[j / 2] & 0xffff0000u);
            }
        }
    }
}

// Dims d0 .. d0 + 7 of an encoded bf16-build entry at e as eight bf16 (decode_kv's values, exactly: an e4m3 code
// times a power of two, or a rope dim stored as bf16); d0 a multiple of 8 below hd.
__device__ __forceinline__ uint4 kv_fp8_bf16x8(const unsigned char* e, int d0, int hd, int rd) {
    const int nope = hd - rd;
    if (d0 >= nope) {
        const uint2* rope = reinterpret_cast<const uint2*>(e + nope + 2 * (d0 - nope));
        const uint2 lo = rope[0], hi = rope[1];
        return make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
    const uint2 codes = *reinterpret_cast<const uint2*>(e + d0);
    return e4m3x8_scaled(codes.x, codes.y, e8m0_bf16x2(e[nope + 2 * rd + d0 / kKvBlock]));
}
