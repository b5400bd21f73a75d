// Paged-cache addressing shared by the compressor and the indexer kernels.
#pragma once
#include "common.cuh"

// Entry e of one request's paged cache: `pages` is that request's page list (byte offsets from base).
__device__ __forceinline__ char* paged_entry(char* base, const long long* pages, int per_page, int entry_bytes, int e) {
    return base + pages[e / per_page] + static_cast<long long>(e % per_page) * entry_bytes;
}
