// Row-tile addressing of the grouped expert GEMMs (moe.cu, moe_fp4.cu) over moe_sort's tile_offsets.
#pragma once

// The expert of a row tile: the last one whose tiles start at or before it.
__device__ __forceinline__ int tile_expert(const int* tile_offsets, int experts, int tile) {
    int e = 0;
    for (int hi = experts - 1; e < hi;) {
        const int mid = (e + hi + 1) >> 1;
        if (tile_offsets[mid] <= tile) e = mid; else hi = mid - 1;
    }
    return e;
}
