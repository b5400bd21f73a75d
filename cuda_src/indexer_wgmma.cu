// dsv4rt-instantiate: indexer_scores_wgmma<false> indexer_scores_wgmma<true>
#include "compress.cuh"
#include "fp8.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// indexer.cu's scores for prefill steps on Hopper's warpgroup MMA (sm_90a; other targets compile a stub and the
// launcher never picks it): bf16 keys of 128 dims, 64 heads. indexer_scores_mma multiplies each key tile by one
// row's q, so every row reads every key of its request from L2 (64 FLOP a byte: L2-bound at about 220 TFLOP/s);
// here a block holds kRows consecutive rows' q (4 x 64 heads as wgmma's n = 256) and each key tile feeds them all.
// Warpgroup g multiplies keys 64g.. of a 128-key tile: acc = keys x (rows·heads)ᵀ, fp32; then per key and row the
// ReLU'd products weighted by w and summed over the heads (the quad's lanes hold a row's heads together).
// Rows of one block may belong to different requests (a step's chunks lie end to end): the block runs a pass per
// request, storing only its rows. Same arguments as indexer_scores_mma less n_heads (64), plus rows; grid
// (splits, ceil(rows / kRows)), 256 threads, dynamic shared memory kQBytes + kStages · kTileBytes + 1024.
// Fp4Keys (faithful numerics: indexer_q_fp4 has rotated and rounded q in place): the 68-byte packed entries
// (indexer_fp4.cuh, 4-byte aligned) stream into kStages raw tiles, and each is widened into the one bf16 key tile
// (codes times their block's scale: exact in bf16) between two barriers; dynamic shared memory kQBytes + kTileBytes
// + kStages · kRawBytes + 1024. A key then costs L2 68 bytes instead of 256.
constexpr int kRows = 4, kHeads = 64, kDim = 128, kTileKeys = 128, kStages = 4;
constexpr int kHalfBytes = kTileKeys * 128;              // one 64-dim half of a key tile: 128 rows of 128 bytes
constexpr int kTileBytes = 2 * kHalfBytes;
constexpr int kQHalfBytes = kRows * kHeads * 128;        // one 64-dim half of the q tile: 256 rows of 128 bytes
constexpr int kQBytes = 2 * kQHalfBytes;
constexpr int kEntryWords = kDim / 8 + 1;                // a packed entry: 16 words of codes, one of 4 scale bytes
constexpr int kRawBytes = kTileKeys * kEntryWords * 4;

template <bool Fp4Keys>
__global__ void __launch_bounds__(256, 1) indexer_scores_wgmma(
        float* scores, const __nv_bfloat16* q, const float* w, char* key_base, const long long* key_pages,
        const int* page_start, int per_page, int entry_bytes, const int* pos, const int* req,
        const float* inv_freq, int rope_dim, int rows, int n_max, int ratio) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    __shared__ float2 cs[kRows][kDim / 2];
    __shared__ float weights[kRows][kHeads];
    const SmemBase aligned = smem_base_1024(smem_raw);
    const unsigned base = aligned.addr;
    unsigned char* tiles = aligned.ptr;  // generic address of base
    const unsigned keys0 = base + kQBytes;   // Fp4Keys: the bf16 key tile, then the raw stages
    const unsigned raw0 = keys0 + kTileBytes;
    unsigned char* key_tile = tiles + kQBytes;
    const int tid = threadIdx.x, t0 = blockIdx.y * kRows;
    int request[kRows], visible[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const int t = t0 + r;
        request[r] = t < rows ? req[t] : -1;
        visible[r] = request[r] >= 0 ? min((pos[t] + 1) / ratio, n_max) : 0;
    }
    if (inv_freq)
        for (int i = tid; i < kRows * rope_dim / 2; i += blockDim.x) {
            const int r = i / (rope_dim / 2), k = i % (rope_dim / 2);
            float s = 0.f, c = 1.f;
            if (request[r] >= 0) sincosf(static_cast<float>(pos[t0 + r]) * inv_freq[k], &s, &c);
            cs[r][k] = make_float2(c, s);
        }
    {
        const int r = tid / kHeads, h = tid % kHeads;
        weights[r][h] = request[r] >= 0 ? w[static_cast<size_t>(t0 + r) * kHeads + h] : 0.f;
    }
    __syncthreads();
    // q row tid = (row r, head h): roped in float32 and rounded to bf16 as indexer_scores_mma does; rows of padding
    // or past the step are zeros.
    {
        const int r = tid / kHeads, h = tid % kHeads;
        const __nv_bfloat16* src = q + (static_cast<size_t>(min(t0 + r, rows - 1)) * kHeads + h) * kDim;
#pragma unroll
        for (int c = 0; c < kDim / 8; ++c) {
            uint4 v = request[r] >= 0 ? *reinterpret_cast<const uint4*>(src + 8 * c) : make_uint4(0, 0, 0, 0);
            if (inv_freq && 8 * c + 8 > kDim - rope_dim) {
                unsigned* p = reinterpret_cast<unsigned*>(&v);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = 8 * c + 2 * e, k = (d - (kDim - rope_dim)) / 2;
                    if (d < kDim - rope_dim) continue;
                    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p + e));
                    const __nv_bfloat162 y = __floats2bfloat162_rn(x.x * cs[r][k].x - x.y * cs[r][k].y,
                                                                   x.y * cs[r][k].x + x.x * cs[r][k].y);
                    p[e] = *reinterpret_cast<const unsigned*>(&y);
                }
            }
            *reinterpret_cast<uint4*>(tiles + (c / 8) * kQHalfBytes + swizzled(tid, c % 8)) = v;
        }
    }

    const int wg = tid >> 7, lane = tid & 31, l4 = lane & 3;
    const int key_in_tile = wg * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2);  // acc rows: this key and the one 8 on
    float acc[128];
    for (int lead = 0; lead < kRows; ++lead) {
        // one pass per request among the block's rows, in the order of their first row
        const int rq = request[lead];
        bool first = rq >= 0;
#pragma unroll
        for (int r = 0; r < kRows; ++r) first &= r >= lead || request[r] != rq;
        if (!first) continue;
        int seen = 0;
#pragma unroll
        for (int r = 0; r < kRows; ++r) seen = request[r] == rq ? max(seen, visible[r]) : seen;
        const int n_tiles = (seen + kTileKeys - 1) / kTileKeys;
        const int x = blockIdx.x;
        const int mine = x < n_tiles ? (n_tiles - x + gridDim.x - 1) / gridDim.x : 0;
        const long long* pages = key_pages + page_start[rq];
        // thread t copies 64-dim half t % 2 of key row t / 2: eight 16-byte chunks (Fp4Keys: words 9h .. of the
        // packed entry, nine or eight)
        auto issue = [&](int i) {
            if (i < mine) {
                const int j = (blockIdx.x + i * gridDim.x) * kTileKeys + (tid >> 1), h = tid & 1;
                const bool valid = j < seen;
                const char* entry = valid ? paged_entry(key_base, pages, per_page, entry_bytes, j) : key_base;
                if constexpr (Fp4Keys) {
                    const unsigned dst = raw0 + (i % kStages) * kRawBytes + (tid >> 1) * kEntryWords * 4;
#pragma unroll
                    for (int c = 0; c < 9; ++c)
                        if (9 * h + c < kEntryWords)
                            cp_async4_or_zero(dst + 4 * (9 * h + c), entry + 4 * (9 * h + c), valid);
                } else {
                    const unsigned dst = keys0 + (i % kStages) * kTileBytes + h * kHalfBytes;
#pragma unroll
                    for (int c = 0; c < 8; ++c)
                        cp_async16_or_zero(dst + swizzled(tid >> 1, c), entry + 128 * h + 16 * c, valid);
                }
            }
            cp_async_commit();
        };
        __syncthreads();  // the last pass's tiles are consumed (and, before the first, q is staged)
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) issue(s);
        for (int i = 0; i < mine; ++i) {
            cp_async_wait<kStages - 2>();
            fence_proxy_async();  // this thread's copies, and before the first tile its q stores
            __syncthreads();      // tile i landed for every thread; tile i - 1's wgmma is done, its stage free
            issue(i + kStages - 1);
            if constexpr (Fp4Keys) {  // thread t widens the half it copied the row of: 8 words, 2 scale blocks
                const unsigned* raw = reinterpret_cast<const unsigned*>(tiles + (raw0 - base) + (i % kStages) * kRawBytes) +
                                      (tid >> 1) * kEntryWords;
                const unsigned scales = raw[kEntryWords - 1];
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    const int block = 2 * (tid & 1) + c / 4;
                    *reinterpret_cast<uint4*>(key_tile + (tid & 1) * kHalfBytes + swizzled(tid >> 1, c)) =
                        e2m1x8_scaled(raw[8 * (tid & 1) + c], e8m0_bf16x2(scales >> 8 * block & 0xffu));
                }
                fence_proxy_async();
                __syncthreads();  // the bf16 tile whole
            }
            const unsigned stage = Fp4Keys ? keys0 : keys0 + (i % kStages) * kTileBytes;
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kDim / 16; ++ks) {
                const unsigned half = ks / 4, at = (ks % 4) * 32;
                wgmma_bf16_m64n256k16(acc, smem_desc(stage + half * kHalfBytes + wg * 64 * 128 + at),
                                      smem_desc(base + half * kQHalfBytes + at), ks > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            // acc[4(8r + jj) + 2h + c]: key key_in_tile + 8h, row r, head 8jj + 2·l4 + c
            float sum[kRows][2];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float s = 0.f;
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                        for (int c = 0; c < 2; ++c)
                            s += weights[r][8 * jj + 2 * l4 + c] * fmaxf(acc[4 * (8 * r + jj) + 2 * h + c], 0.f);
                    s += __shfl_xor_sync(0xffffffffu, s, 1);
                    sum[r][h] = s + __shfl_xor_sync(0xffffffffu, s, 2);
                }
            // lane l4 of the quad stores row l4
            int mine_req = -1, mine_visible = 0;
            float mine_sum[2] = {0.f, 0.f};
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                if (r == l4)
                    mine_req = request[r], mine_visible = visible[r], mine_sum[0] = sum[r][0], mine_sum[1] = sum[r][1];
            if (mine_req == rq) {
                const int j = (blockIdx.x + i * gridDim.x) * kTileKeys + key_in_tile;
                float* out = scores + static_cast<size_t>(t0 + l4) * n_max;
                if (j < mine_visible) out[j] = mine_sum[0];
                if (j + 8 < mine_visible) out[j + 8] = mine_sum[1];
            }
        }
    }
#else
    __trap();
#endif
}
