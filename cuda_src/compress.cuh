// Paged-cache addressing and the rope table shared by the compressor and the indexer kernels.
#pragma once
#include "common.cuh"

// Entry e of one request's paged cache: `pages` is that request's page list (byte offsets from base).
__device__ __forceinline__ char* paged_entry(char* base, const long long* pages, int per_page, int entry_bytes, int e) {
    return base + pages[e / per_page] + static_cast<long long>(e % per_page) * entry_bytes;
}

// cos and sin of pos · inv_freq[k] for the rope_dim / 2 channel pairs, once per block (not per head).
__device__ __forceinline__ void rope_table(float2* cs, const float* inv_freq, int rope_dim, int pos) {
    for (int k = threadIdx.x; k < rope_dim / 2; k += blockDim.x) {
        float s, c;
        sincosf(static_cast<float>(pos) * inv_freq[k], &s, &c);
        cs[k] = make_float2(c, s);
    }
}
