// dsv4rt-instantiate: sparse_attention_wgmma<false> sparse_attention_wgmma<true>
#include "attention_keys.cuh"
#include "kv_fp8.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// attention_mqa.cu's sparse attention on Hopper's warpgroup MMA, for steps with a block per row (no split): the 64
// heads of a query row are wgmma's m, each key tile of 64 K = V rows crosses into shared memory once per row.
// Warpgroup w scores keys 32w .. 32w + 31 of a tile against the whole q (S = Q·Kᵀ, m64n32, k = hd), the two
// swap their row maxima so both keep the same softmax state, write P (bf16) into one shared tile, and each then
// adds P·V into its half of the head dims (m64n256, k = 64 keys; V is the key tile read MN-major). Each
// warpgroup's denominator counts its own keys; the halves meet in the epilogue.
// Shared tiles are 128-byte rows in the 128-byte swizzle: q and every key tile as kWgaSlabs slabs of 64 dims.
constexpr int kWgaHd = 512, kWgaHeads = 64, kWgaKeys = 64, kWgaThreads = 256;
constexpr int kWgaSlabs = kWgaHd / 64, kWgaTileBytes = kWgaKeys * kWgaHd * 2, kWgaQBytes = kWgaHeads * kWgaHd * 2;
constexpr int kWgaPBytes = kWgaHeads * kWgaKeys * 2;

// Arguments as sparse_attention_mqa (attention_mqa.cu) without the split outputs, hd = kWgaHd, heads <= kWgaHeads
// a block. grid (rows, ceil(heads / kWgaHeads)), kWgaThreads threads, dynamic shared memory 1024 (alignment) + q
// + key tiles (two; Fp8Kv: one, and two encoded tiles of kv_fp8_bytes per key) + P + 512 of row statistics.
template <bool Fp8Kv>
__global__ void __launch_bounds__(kWgaThreads, 1)
sparse_attention_wgmma(__nv_bfloat16* out, const __nv_bfloat16* q, const int* positions, const int* req,
                       const float* sink, const float* inv_freq,
                       const char* win_base, const long long* win_pages, const int* win_start, int win_per_page,
                       int win_bytes, const char* cmp_base, const long long* cmp_pages, const int* cmp_start,
                       int cmp_per_page, int cmp_bytes, const int* selected, int top_k, int ratio, int window,
                       int heads, int rd, float scale, const char* step_rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int hd = kWgaHd, TILE = kWgaKeys, STAGES = Fp8Kv ? 1 : 2;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    unsigned char* smem = smem_raw + (base - smem_u32(smem_raw));
    const unsigned qs = base, tiles = qs + kWgaQBytes, ps = tiles + STAGES * kWgaTileBytes;
    unsigned char* tiles_g = smem + kWgaQBytes;
    unsigned char* ps_g = tiles_g + STAGES * kWgaTileBytes;
    float* row_stat = reinterpret_cast<float*>(ps_g + kWgaPBytes);  // [warpgroup][head]: maxima, then sums
    unsigned char* encoded = reinterpret_cast<unsigned char*>(row_stat + 2 * kWgaHeads);  // Fp8Kv: [2][TILE][kv]
    __shared__ bool present[2][TILE];

    const int t = blockIdx.x, h0 = blockIdx.y * kWgaHeads, m = positions[t];
    const Candidates cand = row_candidates(t, req[t], m, win_base, win_pages, win_start, win_per_page, win_bytes,
                                           cmp_base, cmp_pages, cmp_start, cmp_per_page, cmp_bytes, selected, top_k,
                                           ratio, window, step_rows, req);
    const int n_tiles = (cand.count + TILE - 1) / TILE, block_heads = min(kWgaHeads, heads - h0);
    const long long row0 = static_cast<long long>(t) * heads + h0;
    if (n_tiles == 0) {  // no key: zeros
        for (int i = threadIdx.x; i < block_heads * hd / 8; i += blockDim.x)
            reinterpret_cast<uint4*>(out + row0 * hd)[i] = make_uint4(0, 0, 0, 0);
        return;
    }

    // Thread i copies 16-byte chunks (i % 4) + 4c of row i / 4 (a head of q, a key of a tile): slab chunk / 8.
    const int copy_row = threadIdx.x >> 2, copy_part = threadIdx.x & 3;
    const __nv_bfloat16* q_row = q + row0 * hd;
    for (int c = copy_part; c < hd / 8; c += 4)
        cp_async16_or_zero(qs + (c >> 3) * (kWgaHeads * 128) + swizzled(copy_row, c & 7),
                           q_row + (copy_row < block_heads ? copy_row * hd + c * 8 : 0), copy_row < block_heads);
    const int kv_bytes = Fp8Kv ? kv_fp8_bytes(hd, rd) : 0;
    auto load_tile = [&](int it) {  // absent keys and those past the count: zeros, whose P·V terms vanish
        const int buf = it & 1, k = it * TILE + copy_row;
        const char* src = k < cand.count ? cand.entry(k) : nullptr;
        if (copy_part == 0) present[buf][copy_row] = src != nullptr;
        if constexpr (Fp8Kv) {
            unsigned char* dst = encoded + (buf * TILE + copy_row) * kv_bytes;
            if (src)
                for (int c = copy_part; c * 8 < kv_bytes; c += 4) cp_async8(dst + c * 8, src + c * 8);
        } else {
            const unsigned dst = tiles + buf * kWgaTileBytes;
            for (int c = copy_part; c < hd / 8; c += 4)
                cp_async16_or_zero(dst + (c >> 3) * (TILE * 128) + swizzled(copy_row, c & 7),
                                   src ? src + c * 16 : win_base, src != nullptr);
        }
        cp_async_commit();
    };
    auto widen = [&](int buf) {  // Fp8Kv: encoded tile buf to the bf16 tile, exactly the values decode_kv gives
        for (int i = threadIdx.x; i < TILE * hd / 8; i += blockDim.x) {
            const int j = i / (hd / 8), c = i % (hd / 8);
            const uint4 v = present[buf][j] ? kv_fp8_bf16x8(encoded + (buf * TILE + j) * kv_bytes, c * 8, hd, rd)
                                            : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(tiles_g + (c >> 3) * (TILE * 128) + swizzled(j, c & 7)) = v;
        }
    };

    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, l4 = lane & 3;
    const int row_a = ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2);  // heads row_a (d[4j], d[4j + 1]) and row_a + 8
    float o[128], mx[2], l[2];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the sink enters as a key of value zero: max sink, sum 1, counted once
        const int h = row_a + 8 * i;
        mx[i] = h < block_heads ? sink[h0 + h] : 0.f;
        l[i] = wg == 0 && l4 == 0 ? 1.f : 0.f;
    }

    load_tile(0);  // with q
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // tile it landed; tile it - 1 and its P are consumed
        if (it + 1 < n_tiles) load_tile(it + 1);
        const int buf = it & 1;
        if constexpr (Fp8Kv) {
            widen(buf);
            fence_proxy_async();
            __syncthreads();
        }
        const unsigned tile = tiles + (Fp8Kv ? 0 : buf * kWgaTileBytes);

        float s[16];
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < hd / 16; ++k) {
            const unsigned slab = (k >> 2) * (TILE * 128), at = 32 * (k & 3);
            wgmma_bf16_m64n32k16(s, smem_desc(qs + (k >> 2) * (kWgaHeads * 128) + at),
                                 smem_desc(tile + slab + wg * 32 * 128 + at), k);
        }
        wgmma_commit();
        wgmma_wait<0>();

        // s[4j + c]: key 32·wg + 8j + 2·l4 + c % 2 for head row_a + 8·(c / 2).
        float top[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int key = 32 * wg + 8 * j + 2 * l4 + (c & 1);
                s[4 * j + c] = present[buf][key] ? s[4 * j + c] * scale : neg_inf();
                top[c >> 1] = fmaxf(top[c >> 1], s[4 * j + c]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 1));
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 2));
            if (l4 == 0) row_stat[wg * kWgaHeads + row_a + 8 * i] = top[i];
        }
        __syncthreads();
        float base_[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float next = fmaxf(mx[i], fmaxf(top[i], row_stat[(wg ^ 1) * kWgaHeads + row_a + 8 * i]));
            base_[i] = next == neg_inf() ? 0.f : next;  // no key yet: exp(-inf - 0) = 0, not exp(-inf + inf)
            const float a = __expf(mx[i] - base_[i]);
            mx[i] = next;
            l[i] *= a;
#pragma unroll
            for (int j = 0; j < 32; ++j) o[4 * j + 2 * i] *= a, o[4 * j + 2 * i + 1] *= a;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float e0 = __expf(s[4 * j + 2 * i] - base_[i]), e1 = __expf(s[4 * j + 2 * i + 1] - base_[i]);
                l[i] += e0 + e1;
                *reinterpret_cast<unsigned*>(ps_g + swizzled(row_a + 8 * i, 4 * wg + j) + 4 * l4) = bf16x2(e0, e1);
            }
        fence_proxy_async();
        __syncthreads();  // P whole; the partner's maxima read

        wgmma_fence();
#pragma unroll
        for (int k = 0; k < TILE / 16; ++k)
            wgmma_bf16_m64n256k16<1>(o, smem_desc(ps + 32 * k),
                                     smem_desc_mn(tile + 4 * wg * (TILE * 128) + 16 * k * 128, TILE * 128), 1);
        wgmma_commit();
        wgmma_wait<0>();
    }

    // o[4j + c]: head row_a + 8·(c / 2), dim 256·wg + 8j + 2·l4 + c % 2.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (l4 == 0) row_stat[wg * kWgaHeads + row_a + 8 * i] = l[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int h = row_a + 8 * i;
        if (h >= block_heads) continue;
        const float inv = 1.f / (l[i] + row_stat[(wg ^ 1) * kWgaHeads + h]);
        __nv_bfloat16* dst = out + (row0 + h) * hd + 256 * wg;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int d = 8 * j + 2 * l4;
            float v[2] = {o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv};
            rope_chunk(v, 256 * wg + d, hd, rd, m, inv_freq, true);
            *reinterpret_cast<unsigned*>(dst + d) = bf16x2(v[0], v[1]);
        }
    }
#endif
}
