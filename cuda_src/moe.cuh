// Row-tile addressing of the grouped expert GEMMs (moe.cu, moe_fp4.cu, the wgmma kernels) over moe_sort's
// tile_offsets, and their gated epilogue.
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

// The sources of a tile's rows first, first + 32, ... (N of them) at column col of a [., k]: sorted row r is a's row
// perm[r] / active when perm is given (a routed pair's token), else r; rows from row_end on are not the expert's and
// read nothing (ok false, src a valid address to copy zeros from).
template <typename T, int N>
__device__ __forceinline__ void tile_sources(const T* (&src)[N], bool (&ok)[N], const T* a, const int* perm, int active,
                                             int first, int row_end, int k, int col) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int r = first + 32 * i;
        ok[i] = r < row_end;
        src[i] = a + (ok[i] ? static_cast<size_t>(perm ? perm[r] / active : r) * k : 0) + col;
    }
}

// Weight row j of a tile of output columns from col0, in expert e's matrix of row_bytes-long rows (pointer tables
// first, second): GATED interleaves w1 and w3 8 rows at a time, the layout gated_pair reads. Rows past n: ok false,
// and the address of row 0. An int row_bytes, and chunk offsets added in bytes by the callers, let ptxas keep the
// pointers across the main loop: with a size_t length it recomputed each row's product every step, and
// moe_gemm_wgmma took a quarter longer (tests/test_k_moe_mma.py counts the step).
template <bool GATED>
__device__ __forceinline__ const unsigned char* tile_weight_row(const unsigned long long* first,
                                                                const unsigned long long* second, int e, int j,
                                                                int col0, int n, int row_bytes, bool& ok) {
    const int c = col0 + (GATED ? (j >> 4) * 8 + (j & 7) : j);
    ok = c < n;
    const unsigned long long* table = GATED && (j >> 3 & 1) ? second : first;
    return reinterpret_cast<const unsigned char*>(table[e]) + (ok ? static_cast<size_t>(c) * row_bytes : 0);
}

// A gated tile's clamped SwiGLU times the routing weight `scale` for output columns 8p + 2·(lane % 4) and the next of
// row h (0: lane / 4 of the warp's 16, 1: 8 below), from wgmma accumulators whose n8 block 2p holds w1 and block 2p + 1
// w3 of output columns 8p..
template <int N>
__device__ __forceinline__ float2 gated_pair(const float (&acc)[N], int p, int h, float limit, float scale) {
    float v[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float gv = fminf(acc[8 * p + 2 * h + c], limit);
        const float uv = fminf(fmaxf(acc[8 * p + 4 + 2 * h + c], -limit), limit);
        v[c] = gv * sigmoid(gv) * uv * scale;
    }
    return make_float2(v[0], v[1]);
}
