// dsv4rt-instantiate: sparse_attention<float> sparse_attention<__nv_bfloat16>
// dsv4rt-instantiate: attention_combine<float> attention_combine<__nv_bfloat16>
// dsv4rt-instantiate: sparse_attention<__nv_bfloat16,true>
#include "attention_keys.cuh"
#include "kv_fp8.cuh"

// K = V is one vector per key shared by every head (MQA), so a block serves one query token and
// kBlockHeads of its heads: each key crosses from the cache into shared memory once per block, and each
// warp holds kHeadsPerWarp heads so that one read of a key from shared memory feeds two dot products.
constexpr int kAttnWarps = 4, kHeadsPerWarp = 2, kBlockHeads = kAttnWarps * kHeadsPerWarp;
// Keys per shared-memory tile: 16 KB at head_dim 512, two tiles in flight (cp.async double buffering).
template <typename T> constexpr int kTileKeys = 16384 / (kMaxHeadDim * static_cast<int>(sizeof(T)));
constexpr int kCombineWarps = 8;

// One softmax over window + compressed keys + sink per (query token, head), K = V, then inverse RoPE.
// grid (rows, ceil(heads / kBlockHeads), splits), block kAttnWarps * 32, dynamic shared memory
// 2 * kTileKeys<T> * hd * sizeof(T). Split z takes a contiguous share of the row's candidates; with one
// split the block writes out [rows, heads, hd]; with more it writes its unnormalised sum, running max and
// denominator to part_o [rows, heads, splits, hd] and part_ml [rows, heads, splits] for attention_combine.
// A row with req < 0 has no candidates: it writes zeros (or empty partials) and reads no cache.
// Fp8Kv (bf16 only): the caches hold 8-byte aligned faithful-mode entries (kv_fp8.cuh); a tile keeps them
// encoded, 2 * kTileKeys<T> * kv_fp8_bytes(hd, rd) bytes of shared memory, and the key loads dequantise.
template <typename T, bool Fp8Kv = false>
__global__ void __launch_bounds__(kAttnWarps * 32)
sparse_attention(T* out, float* part_o, float2* part_ml, const T* q, const int* positions, const int* req,
                 const float* sink, const float* inv_freq,
                 const char* win_base, const long long* win_pages, const int* win_start, int win_per_page,
                 int win_bytes, const char* cmp_base, const long long* cmp_pages, const int* cmp_start,
                 int cmp_per_page, int cmp_bytes,
                 const int* selected, int top_k, int ratio, int window, int heads, int hd, int rd, float scale,
                 const char* step_rows) {
    constexpr int V = kVec<T>, C = kLaneChunks<T>, TILE = kTileKeys<T>, HPW = kHeadsPerWarp;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* tiles = reinterpret_cast<T*>(smem_raw);  // [2][TILE][hd]
    const int kv_bytes = Fp8Kv ? kv_fp8_bytes(hd, rd) : 0;  // Fp8Kv: tiles [2][TILE][kv_bytes]
    __shared__ bool present[2][TILE];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = req[t], m = positions[t];

    const Candidates cand = row_candidates(t, r, m, win_base, win_pages, win_start, win_per_page, win_bytes, cmp_base,
                                           cmp_pages, cmp_start, cmp_per_page, cmp_bytes, selected, top_k, ratio,
                                           window, step_rows, req);
    const int2 span = split_share(cand.count, TILE);
    const int k_begin = span.x, k_end = span.y;
    const int n_tiles = (k_end - k_begin + TILE - 1) / TILE;
    const bool split = part_o != nullptr;

    // Running state per head: with one split the sink enters as a key of value zero (max sink, sum 1).
    float qv[HPW][C][V], o[HPW][C][V], mx[HPW], l[HPW];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const int h = blockIdx.y * kBlockHeads + warp * HPW + hh;
        const bool active = h < heads;
        load_lane_row(q + (static_cast<long long>(t) * heads + (active ? h : 0)) * hd, hd, lane, qv[hh]);
#pragma unroll
        for (int i = 0; i < C; ++i)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                qv[hh][i][j] = active ? qv[hh][i][j] : 0.f;
                o[hh][i][j] = 0.f;
            }
        mx[hh] = split ? neg_inf() : (active ? sink[h] : 0.f);
        l[hh] = split ? 0.f : 1.f;
    }

    auto load_tile = [&](int k0, int buf) {
        for (int j = warp; j < TILE; j += kAttnWarps) {
            const int k = k0 + j;
            const char* src = k < k_end ? cand.entry(k) : nullptr;
            if (lane == 0) present[buf][j] = src != nullptr;
            if (src) {
                if constexpr (Fp8Kv)
                    for (int c = lane; c * 8 < kv_bytes; c += 32)
                        cp_async8(smem_raw + (buf * TILE + j) * kv_bytes + c * 8, src + c * 8);
                else
                    for (int c = lane; c * V < hd; c += 32)
                        cp_async16(tiles + (buf * TILE + j) * hd + c * V, src + c * 16);
            }
        }
        cp_async_commit();
    };
    auto load_key = [&](const T* row, int buf, int j, float (&k)[C][V]) {
        if constexpr (Fp8Kv)
            load_kv_fp8(smem_raw + (buf * TILE + j) * kv_bytes, hd, rd, lane, k);
        else
            load_lane_row(row, hd, lane, k);
    };

    if (n_tiles > 0) load_tile(k_begin, 0);
    for (int it = 0; it < n_tiles; ++it) {
        if (it + 1 < n_tiles)
            load_tile(k_begin + (it + 1) * TILE, (it + 1) & 1);
        else
            cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* tile = tiles + (it & 1) * TILE * hd;
        const bool* here = present[it & 1];

        float s[HPW][TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) s[hh][j] = neg_inf();
            if (!here[j]) continue;
            float k[C][V];
            load_key(tile + j * hd, it & 1, j, k);
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < C; ++i)
#pragma unroll
                    for (int e = 0; e < V; ++e) dot += qv[hh][i][e] * k[i][e];
                s[hh][j] = warp_sum(dot) * scale;
            }
        }
        // One rescale per tile: the new maximum covers every present key of it.
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            float top = neg_inf();
#pragma unroll
            for (int j = 0; j < TILE; ++j) top = fmaxf(top, s[hh][j]);
            if (top == neg_inf()) continue;
            const float next = fmaxf(mx[hh], top), a = expf(mx[hh] - next);
            mx[hh] = next;
            l[hh] *= a;
#pragma unroll
            for (int i = 0; i < C; ++i)
#pragma unroll
                for (int e = 0; e < V; ++e) o[hh][i][e] *= a;
        }
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            if (!here[j]) continue;
            float k[C][V];
            load_key(tile + j * hd, it & 1, j, k);
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                const float p = expf(s[hh][j] - mx[hh]);
                l[hh] += p;
#pragma unroll
                for (int i = 0; i < C; ++i)
#pragma unroll
                    for (int e = 0; e < V; ++e) o[hh][i][e] += p * k[i][e];
            }
        }
        __syncthreads();  // the next iteration refills this buffer
    }

#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const int h = blockIdx.y * kBlockHeads + warp * HPW + hh;
        if (h >= heads) continue;
        const long long row = static_cast<long long>(t) * heads + h;
        if (split) {
            const long long part = row * gridDim.z + blockIdx.z;
            if (lane == 0) part_ml[part] = make_float2(mx[hh], l[hh]);
            if (l[hh] == 0.f) continue;  // no key: attention_combine reads no partial sum
#pragma unroll
            for (int i = 0; i < C; ++i) {
                const int d0 = (lane + 32 * i) * V;
                if (d0 < hd) store_vec(part_o + part * hd + d0, o[hh][i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < C; ++i) {
                const int d0 = (lane + 32 * i) * V;
                if (d0 >= hd) continue;
#pragma unroll
                for (int e = 0; e < V; ++e) o[hh][i][e] /= l[hh];
                rope_chunk(o[hh][i], d0, hd, rd, m, inv_freq, true);
                store_vec(out + row * hd + d0, o[hh][i]);
            }
        }
    }
}

// Four floats of a row as T at p (16 bytes of float, 8 of bf16).
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[4]) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}

// Merges the splits of sparse_attention with the sink, normalises, applies the inverse RoPE and writes
// out [rows, heads, hd]: a warp per (token, head, 128 dims), lane l owning 4 of them, so that a decode
// step's few rows still spread over many SMs; grid ceil(rows * heads * ceil(hd / 128) / kCombineWarps).
template <typename T>
__global__ void __launch_bounds__(kCombineWarps * 32)
attention_combine(T* out, const float* part_o, const float2* part_ml, const float* sink, const int* positions,
                  const float* inv_freq, int rows, int heads, int hd, int rd, int splits) {
    const int lane = threadIdx.x & 31, quarters = (hd + 127) / 128;
    const long long warp = static_cast<long long>(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
    if (warp >= static_cast<long long>(rows) * heads * quarters) return;
    const long long row = warp / quarters;
    const int h = static_cast<int>(row % heads), pos = positions[row / heads];
    const int d0 = static_cast<int>(warp % quarters) * 128 + 4 * lane;
    const float2* ml = part_ml + row * splits;
    float top = sink[h];
    for (int z = lane; z < splits; z += 32) top = fmaxf(top, ml[z].x);
    top = warp_max(top);
    float l = 0.f;
    for (int z = lane; z < splits; z += 32) l += ml[z].y == 0.f ? 0.f : ml[z].y * expf(ml[z].x - top);
    l = warp_sum(l) + expf(sink[h] - top);
    if (d0 >= hd) return;
    float o[4] = {};
#pragma unroll 4
    for (int z = 0; z < splits; ++z) {
        const float2 m = ml[z];
        if (m.y == 0.f) continue;  // an empty split left its partial sum unwritten
        const float a = expf(m.x - top);
        const float4 p = *reinterpret_cast<const float4*>(part_o + (row * splits + z) * hd + d0);
        o[0] += a * p.x, o[1] += a * p.y, o[2] += a * p.z, o[3] += a * p.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] /= l;
    rope_chunk(o, d0, hd, rd, pos, inv_freq, true);
    store4(out + row * hd + d0, o);
}
