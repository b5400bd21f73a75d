// The candidate keys of a sparse-attention query row in the paged caches, and the cp.async copies that bring
// them to shared memory (attention.cu, attention_mqa.cu) through common.cuh's cp.async helpers.
#pragma once
#include "attention.cuh"

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }  // NVRTC lacks INFINITY


// The candidate keys of one query row at position m of request r, in the order window, compressed:
// window entries lo .. m, then compressed entries 0 .. visible-1 (selected == nullptr) or the row's
// top_k indexer choices (entries < 0 or not yet visible are absent). Pages not held are absent too.
// A window entry that is a row of the same request in this step (its rows are contiguous, at consecutive
// positions) comes from step_base (qkv.cu's step_rows) instead: a step of any length holds its own keys.
struct Candidates {
    const char* win_base;
    const long long* win_pages;
    int win_per_page, win_bytes;
    const char* cmp_base;
    const long long* cmp_pages;
    int cmp_per_page, cmp_bytes;
    const int* selected;
    const char* step_base;
    const int* req;
    int t, r, lo, n_window, visible, count;

    __device__ __forceinline__ const char* entry(int k) const {
        const char* base = win_base;
        const long long* pages = win_pages;
        int per_page = win_per_page, bytes = win_bytes, e = lo + k;
        if (k < n_window && step_base) {
            const int row = t - (n_window - 1 - k);
            if (row >= 0 && req[row] == r) return step_base + static_cast<long long>(row) * win_bytes;
        }
        if (k >= n_window) {
            e = selected ? selected[k - n_window] : k - n_window;
            if (e < 0 || e >= visible) return nullptr;
            base = cmp_base, pages = cmp_pages, per_page = cmp_per_page, bytes = cmp_bytes;
        }
        const long long page = pages[e / per_page];
        return page < 0 ? nullptr : base + page + static_cast<long long>(e % per_page) * bytes;
    }
};

// The candidates of query row t (request r, position m; none when r < 0), from the kernels' arguments.
__device__ __forceinline__ Candidates row_candidates(
        int t, int r, int m, const char* win_base, const long long* win_pages, const int* win_start,
        int win_per_page, int win_bytes, const char* cmp_base, const long long* cmp_pages, const int* cmp_start,
        int cmp_per_page, int cmp_bytes, const int* selected, int top_k, int ratio, int window,
        const char* step_base, const int* req) {
    Candidates c{win_base, nullptr, win_per_page, win_bytes, cmp_base, nullptr, cmp_per_page, cmp_bytes,
                 nullptr, step_base, req, t, r, 0, 0, 0, 0};
    if (r < 0) return c;
    c.win_pages = win_pages + win_start[r];
    c.lo = max(0, m - window + 1);
    c.n_window = m - c.lo + 1;
    if (ratio > 0) {
        c.cmp_pages = cmp_pages + cmp_start[r];
        c.visible = (m + 1) / ratio;
        c.selected = selected ? selected + static_cast<long long>(t) * top_k : nullptr;
    }
    c.count = c.n_window + (ratio <= 0 ? 0 : selected ? top_k : c.visible);
    return c;
}

// Split blockIdx.z of gridDim.z takes candidates [x, y) of count: an equal share rounded up to whole tiles.
__device__ __forceinline__ int2 split_share(int count, int tile) {
    const int share = ((count + gridDim.z - 1) / gridDim.z + tile - 1) / tile * tile;
    const int begin = min(count, static_cast<int>(blockIdx.z) * share);
    return make_int2(begin, min(count, begin + share));
}
