// Helpers of the attention family (qkv.cu, attention.cu).
//
// A warp owns one head_dim row: lane l holds the 16-byte chunks l, l + 32, ... of it, converted to float,
// so rows up to kMaxHeadDim elements stay in registers and RoPE pairs never straddle two lanes.
#pragma once
#include "common.cuh"

constexpr int kMaxHeadDim = 512;
template <typename T> constexpr int kLaneChunks = kMaxHeadDim / (32 * kVec<T>);

// Interleaved RoPE on the pairs of one chunk (row elements d0 .. d0+N-1) that lie in the row's last rd dims.
// The angle is float(pos) * inv_freq[i] in fp32 like the reference; inverse negates it.
template <int N>
__device__ __forceinline__ void rope_chunk(float (&v)[N], int d0, int hd, int rd, int pos, const float* inv_freq,
                                           bool inverse) {
    static_assert(N % 2 == 0, "whole pairs");
#pragma unroll
    for (int i = 0; i < N; i += 2) {
        const int d = d0 + i - (hd - rd);
        if (d < 0) continue;
        float s, c;
        sincosf(static_cast<float>(pos) * inv_freq[d / 2], &s, &c);
        if (inverse) s = -s;
        const float ev = v[i], od = v[i + 1];
        v[i] = ev * c - od * s;
        v[i + 1] = od * c + ev * s;
    }
}

// The lane's chunks of a row of hd elements at p (16-byte aligned); chunks past the row read as zero.
template <typename T, int C, int V>
__device__ __forceinline__ void load_lane_row(const T* p, int hd, int lane, float (&v)[C][V]) {
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int c = lane + 32 * i;
        if (c * V < hd) {
            load_vec(p + c * V, v[i]);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) v[i][j] = 0.f;
        }
    }
}
