// dsv4rt-instantiate: sparse_attention_mqa<__nv_bfloat16> sparse_attention_mqa<__nv_bfloat16,true>
#include "attention_keys.cuh"
#include "kv_fp8.cuh"

// Sparse attention of the bf16 build on the tensor cores. K = V is one vector per key shared by every head
// (MQA), so a block takes one query row with kMqaHeads of its heads: each key crosses into shared memory once
// per row, and S = Q·Kᵀ [heads × keys] and O += P·V [heads × hd] are mma.sync m16n8k16 products (bf16 in,
// float32 accumulation, P rounded to bf16).
// Warp w owns the 16 heads of strip w % 4 and the 16-dim slices 2i + w / 4 of the head dims: 128 float32
// accumulators of O at hd 512. It multiplies Q and K over its slices, adds the partial scores of its partner
// w ^ 4 (the other slices) through shared memory, and turns the scores into the A fragments of P·V in
// registers (FA2). Partners add the same two values, so both hold the same softmax state.
constexpr int kMqaWarps = 8, kMqaHeads = 64, kMqaKeys = 32;
constexpr int kMqaSlices = kMaxHeadDim / 32;  // 16-dim slices per warp at most

// Arguments and outputs as sparse_attention<T, Fp8Kv> (attention.cu), T = __nv_bfloat16, hd a multiple of 16.
// grid (rows, ceil(heads / kMqaHeads), splits), block kMqaWarps * 32, dynamic shared memory
// (kMqaHeads + (Fp8Kv ? 1 : 2) * kMqaKeys) * (hd + 8) * 2 + kMqaWarps * kMqaKeys * 64
// + (Fp8Kv ? 2 * kMqaKeys * kv_fp8_bytes(hd, rd) : 0): q rows, bf16 key tiles (two in flight; Fp8Kv: one,
// dequantised from two encoded ones in flight), the partial scores the partners swap.
template <typename T, bool Fp8Kv = false>
__global__ void __launch_bounds__(kMqaWarps * 32, 1)
sparse_attention_mqa(T* out, float* part_o, float2* part_ml, const T* q, const int* positions, const int* req,
                     const float* sink, const float* inv_freq,
                     const char* win_base, const long long* win_pages, const int* win_start, int win_per_page,
                     int win_bytes, const char* cmp_base, const long long* cmp_pages, const int* cmp_start,
                     int cmp_per_page, int cmp_bytes,
                     const int* selected, int top_k, int ratio, int window, int heads, int hd, int rd, float scale,
                     const char* step_rows) {
    static_assert(sizeof(T) == 2, "bf16 operands");
    constexpr int TILE = kMqaKeys, NT = TILE / 8, KS = TILE / 16, SL = kMqaSlices;
    static_assert(TILE * 8 == kMqaWarps * 32, "eight copying threads per key");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int stride = hd + 8;  // elements per shared row: ldmatrix's eight rows fall on distinct banks
    T* qs = reinterpret_cast<T*>(smem_raw);  // [kMqaHeads][stride]
    T* keys = qs + kMqaHeads * stride;       // [Fp8Kv ? 1 : 2][TILE][stride]
    float4* swap = reinterpret_cast<float4*>(keys + (Fp8Kv ? 1 : 2) * TILE * stride);  // [warp][NT][lane]
    unsigned char* encoded = reinterpret_cast<unsigned char*>(swap + kMqaWarps * NT * 32);  // [2][TILE][kv_bytes]
    __shared__ bool present[2][TILE];

    const int t = blockIdx.x, h0 = blockIdx.y * kMqaHeads, m = positions[t];
    const Candidates cand = row_candidates(t, req[t], m, win_base, win_pages, win_start, win_per_page, win_bytes,
                                           cmp_base, cmp_pages, cmp_start, cmp_per_page, cmp_bytes, selected, top_k,
                                           ratio, window, step_rows, req);
    const int2 span = split_share(cand.count, TILE);
    const int k_begin = span.x, k_end = span.y, n_tiles = (k_end - k_begin + TILE - 1) / TILE;
    const int block_heads = min(kMqaHeads, heads - h0), chunks = hd / 8;
    const bool split = part_o != nullptr;
    if (n_tiles == 0) {  // no key: zeros, or empty partials (attention_combine reads no sum of theirs)
        const long long row0 = static_cast<long long>(t) * heads + h0;
        if (split)
            for (int i = threadIdx.x; i < block_heads; i += blockDim.x)
                part_ml[(row0 + i) * gridDim.z + blockIdx.z] = make_float2(neg_inf(), 0.f);
        else
            for (int i = threadIdx.x; i < block_heads * chunks; i += blockDim.x)
                reinterpret_cast<uint4*>(out + row0 * hd)[i] = make_uint4(0, 0, 0, 0);
        return;
    }

    const T* q_row = q + (static_cast<long long>(t) * heads + h0) * hd;
    for (int i = threadIdx.x; i < kMqaHeads * chunks; i += blockDim.x) {
        const int h = i / chunks, c = i - h * chunks;
        cp_async16_or_zero(qs + h * stride + c * 8, q_row + (h < block_heads ? h * hd + c * 8 : 0), h < block_heads);
    }
    const int kv_bytes = Fp8Kv ? kv_fp8_bytes(hd, rd) : 0;
    const int copy_key = threadIdx.x >> 3, copy_part = threadIdx.x & 7;
    auto load_tile = [&](int it) {  // absent keys and those past the share: zeros, whose P·V terms vanish
        const int buf = it & 1, k = k_begin + it * TILE + copy_key;
        const char* src = k < k_end ? cand.entry(k) : nullptr;
        if (copy_part == 0) present[buf][copy_key] = src != nullptr;
        if constexpr (Fp8Kv) {
            unsigned char* dst = encoded + (buf * TILE + copy_key) * kv_bytes;
            if (src)
                for (int c = copy_part; c * 8 < kv_bytes; c += 8) cp_async8(dst + c * 8, src + c * 8);
        } else {
            T* dst = keys + (buf * TILE + copy_key) * stride;
            for (int c = copy_part; c < chunks; c += 8)
                cp_async16_or_zero(dst + c * 8, src ? src + c * 16 : win_base, src != nullptr);
        }
        cp_async_commit();
    };
    auto dequantise = [&](int buf) {  // Fp8Kv: encoded tile buf to bf16, exactly the values decode_kv gives
        for (int i = threadIdx.x; i < TILE * chunks; i += blockDim.x) {
            const int j = i / chunks, d0 = (i - j * chunks) * 8;
            const unsigned char* e = encoded + (buf * TILE + j) * kv_bytes;
            const uint4 v = present[buf][j] ? kv_fp8_bf16x8(e, d0, hd, rd) : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(keys + j * stride + d0) = v;
        }
    };

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, strip = warp & 3, pair = warp >> 2;
    const int g = lane >> 2, l4 = lane & 3;
    const bool busy = strip * 16 < block_heads;  // warp-uniform: a strip of padding heads only copies
    // Thread rows: heads strip·16 + g (fragment elements 0, 1) and + 8 (2, 3); with one split the sink
    // enters as a key of value zero (max sink, sum 1, counted by one thread of the quad).
    float o[SL][2][4], mx[2], l[2];
#pragma unroll
    for (int i = 0; i < SL; ++i)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][n][e] = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int h = strip * 16 + g + 8 * i;
        mx[i] = split ? neg_inf() : h < block_heads ? sink[h0 + h] : 0.f;
        l[i] = split || l4 != 0 ? 0.f : 1.f;
    }
    // ldmatrix lane addresses: q rows of the strip; keys as the B operand of Q·Kᵀ (8 keys × 16 dims per
    // fragment) and, transposed, of P·V (16 keys × 8 dims).
    const unsigned q_addr = smem_u32(qs + (strip * 16 + (lane & 15)) * stride + 8 * (lane >> 4));
    const int k_off = ((lane & 7) + 8 * (lane >> 4)) * stride + 8 * ((lane >> 3) & 1);
    const int v_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * stride + 8 * (lane >> 4);

    load_tile(0);  // with the q rows
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<0>();
        __syncthreads();  // tile it landed for every thread; tile it - 1 is consumed, its buffer free
        if (it + 1 < n_tiles) load_tile(it + 1);
        const int buf = it & 1;
        if constexpr (Fp8Kv) {
            dequantise(buf);
            __syncthreads();
        }
        if (!busy) {  // meets the busy warps' barrier at the score swap (whole-block: racecheck models those)
            __syncthreads();
            continue;
        }
        const T* tile = keys + (Fp8Kv ? 0 : buf * TILE * stride);
        const unsigned k_addr = smem_u32(tile + k_off), v_addr = smem_u32(tile + v_off);

        // s[n]: heads g, g + 8 × keys 8n + 2·l4, +1 of the tile.
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
        for (int i = 0; i < SL; ++i) {
            const int slice = 2 * i + pair;
            if (slice * 16 >= hd) break;
            unsigned a[4];
            ldmatrix_x4(a, q_addr + slice * 32);
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                unsigned b[4];
                ldmatrix_x4(b, k_addr + (j * 16 * stride + slice * 16) * 2);
                mma<Mma::bf16>(s[2 * j], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma<Mma::bf16>(s[2 * j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
        float4* mine = swap + warp * NT * 32 + lane;
        const float4* theirs = swap + (warp ^ 4) * NT * 32 + lane;
#pragma unroll
        for (int n = 0; n < NT; ++n) mine[n * 32] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float4 x = theirs[n * 32];
            s[n][0] += x.x, s[n][1] += x.y, s[n][2] += x.z, s[n][3] += x.w;
        }

        // One rescale per tile: the new maximum covers every present key of it.
        float top[2] = {neg_inf(), neg_inf()}, base[2];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = present[buf][8 * n + 2 * l4 + (e & 1)] ? s[n][e] * scale : neg_inf();
                top[e >> 1] = fmaxf(top[e >> 1], s[n][e]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 1));
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 2));
            const float next = fmaxf(mx[i], top[i]);
            base[i] = next == neg_inf() ? 0.f : next;  // no key yet: exp(-inf - 0) = 0, not exp(-inf + inf)
            const float a = __expf(mx[i] - base[i]);
            mx[i] = next;
            l[i] *= a;
#pragma unroll
            for (int j = 0; j < SL; ++j)
#pragma unroll
                for (int n = 0; n < 2; ++n) o[j][n][2 * i] *= a, o[j][n][2 * i + 1] *= a;
        }
        // p[j]: the A fragment of keys 16j .. 16j + 15 (score tiles 2j, 2j + 1).
        unsigned p[KS][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float e0 = __expf(s[n][0] - base[0]), e1 = __expf(s[n][1] - base[0]);
            const float e2 = __expf(s[n][2] - base[1]), e3 = __expf(s[n][3] - base[1]);
            l[0] += e0 + e1;
            l[1] += e2 + e3;
            p[n / 2][2 * (n & 1)] = bf16x2(e0, e1);
            p[n / 2][2 * (n & 1) + 1] = bf16x2(e2, e3);
        }
#pragma unroll
        for (int i = 0; i < SL; ++i) {
            const int slice = 2 * i + pair;
            if (slice * 16 >= hd) break;
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                unsigned b[4];
                ldmatrix_x4_trans(b, v_addr + (j * 16 * stride + slice * 16) * 2);
                mma<Mma::bf16>(o[i][0], p[j][0], p[j][1], p[j][2], p[j][3], b[0], b[1]);
                mma<Mma::bf16>(o[i][1], p[j][0], p[j][1], p[j][2], p[j][3], b[2], b[3]);
            }
        }
    }
    if (!busy) return;

    // o[i][n]: heads g, g + 8 × dims 16·slice + 8n + 2·l4, +1.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        const int h = strip * 16 + g + 8 * i;
        if (h >= block_heads) continue;
        const long long row = static_cast<long long>(t) * heads + h0 + h;
        if (split) {
            const long long part = row * gridDim.z + blockIdx.z;
            if (pair == 0 && l4 == 0) part_ml[part] = make_float2(mx[i], l[i]);
            if (l[i] == 0.f) continue;  // no key: attention_combine reads no partial sum
#pragma unroll
            for (int j = 0; j < SL; ++j) {
                const int slice = 2 * j + pair;
                if (slice * 16 >= hd) break;
#pragma unroll
                for (int n = 0; n < 2; ++n)
                    *reinterpret_cast<float2*>(part_o + part * hd + slice * 16 + 8 * n + 2 * l4) =
                        make_float2(o[j][n][2 * i], o[j][n][2 * i + 1]);
            }
        } else {
            const float inv = 1.f / l[i];
#pragma unroll
            for (int j = 0; j < SL; ++j) {
                const int slice = 2 * j + pair;
                if (slice * 16 >= hd) break;
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const int d = slice * 16 + 8 * n + 2 * l4;
                    float v[2] = {o[j][n][2 * i] * inv, o[j][n][2 * i + 1] * inv};
                    rope_chunk(v, d, hd, rd, m, inv_freq, true);
                    *reinterpret_cast<unsigned*>(out + row * hd + d) = bf16x2(v[0], v[1]);
                }
            }
        }
    }
}
