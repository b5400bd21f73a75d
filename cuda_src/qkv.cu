// dsv4rt-instantiate: qkv_norm_rope_insert<float> qkv_norm_rope_insert<__nv_bfloat16>
// dsv4rt-instantiate: qkv_norm_rope_insert<float,true> qkv_norm_rope_insert<__nv_bfloat16,true>
#include "kv_fp8.cuh"

constexpr int kQkvWarps = 8;

// Fusion 3 (docs/kernels.md#fusions, docs/model.md#attention), one launch with static warp dispatch: warp w < rows*heads owns query
// head (w / heads, w % heads), warp rows*heads + t owns token t's kv row. Warps never talk to each other.
//   q [rows, heads, hd] in place: q = rope(q * rsqrt(mean(q^2) + eps), pos)
//   kv [rows, hd] -> rope(rmsnorm(kv, kv_weight), pos), stored at window-cache entry pos of the token's request.
// Rows with req < 0 are padding: their warps touch nothing. A kv row whose page is not held is not stored there;
// step_rows (may be null) gets every kv row t at t * entry_bytes, where attention reads a step's own keys.
// Fp8Kv: the window holds faithful-mode entries (kv_fp8.cuh), entry_bytes apart.
template <typename T, bool Fp8Kv = false>
__global__ void __launch_bounds__(kQkvWarps * 32)
qkv_norm_rope_insert(T* q, const T* kv, const float* kv_weight, const int* positions, const int* req,
                     const float* inv_freq, char* window_base, const long long* window_pages, const int* page_start,
                     int per_page, int entry_bytes, int rows, int heads, int hd, int rd, float eps,
                     char* step_rows) {
    constexpr int V = kVec<T>, C = kLaneChunks<T>;
    const int lane = threadIdx.x & 31;
    const long long w = static_cast<long long>(blockIdx.x) * kQkvWarps + (threadIdx.x >> 5);
    const long long q_rows = static_cast<long long>(rows) * heads;
    if (w >= q_rows + rows) return;
    const bool is_q = w < q_rows;
    const int t = is_q ? static_cast<int>(w / heads) : static_cast<int>(w - q_rows);
    const int r = req[t];
    if (r < 0) return;
    const int pos = positions[t];

    const T* src;
    T* dst;
    T* copy = nullptr;  // the kv row's second home
    if (is_q) {
        dst = q + w * hd;
        src = dst;
    } else {
        const long long page = window_pages[page_start[r] + pos / per_page];
        src = kv + static_cast<long long>(t) * hd;
        dst = page < 0 ? nullptr
                       : reinterpret_cast<T*>(window_base + page + static_cast<long long>(pos % per_page) * entry_bytes);
        if (step_rows) copy = reinterpret_cast<T*>(step_rows + static_cast<long long>(t) * entry_bytes);
        if (!dst) {
            dst = copy;
            copy = nullptr;
        }
        if (!dst) return;
    }

    float v[C][V];
    load_lane_row(src, hd, lane, v);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < C; ++i)
#pragma unroll
        for (int j = 0; j < V; ++j) ss += v[i][j] * v[i][j];
    const float scale = rsqrtf(warp_sum(ss) / hd + eps);

#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int d0 = (lane + 32 * i) * V;
        if (d0 >= hd) continue;
        float g[V];  // the query norm has no weight: times 1 is exact
        if (is_q) {
#pragma unroll
            for (int j = 0; j < V; ++j) g[j] = 1.f;
        } else {
            load_vec(kv_weight + d0, g);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) v[i][j] = v[i][j] * scale * g[j];
        rope_chunk(v[i], d0, hd, rd, pos, inv_freq, false);
        if (!Fp8Kv || is_q) {
            store_vec(dst + d0, v[i]);
            if (copy) store_vec(copy + d0, v[i]);
        }
    }
    if constexpr (Fp8Kv)
        if (!is_q) {
            store_kv_entry<T>(reinterpret_cast<char*>(dst), v, hd, rd, lane);
            if (copy) store_kv_entry<T>(reinterpret_cast<char*>(copy), v, hd, rd, lane);
        }
}
