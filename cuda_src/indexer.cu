// dsv4rt-instantiate: indexer_scores<float> indexer_scores<__nv_bfloat16> indexer_scores_mma<false> indexer_topk<8>
// dsv4rt-instantiate: indexer_scores<float,true>
// dsv4rt-instantiate: indexer_scores<__nv_bfloat16,true> indexer_scores_mma<true> indexer_topk<1>
#include "compress.cuh"
#include "indexer_fp4.cuh"

// The lightning indexer of docs/model.md#indexer in two kernels: scores into a float32 workspace
// [rows, n_max], then an exact top-k per row. Row t is one query: req[t] (< 0: padding), pos[t];
// it sees entries j < min((pos[t] + 1) / ratio, n_max) of its request's indexer-key cache.
// Faithful numerics (Fp4Keys): the keys are indexer_fp4.cuh's packed entries, dequantised exactly into the
// shared-memory key tiles, and indexer_q_fp4 (indexer_q.cu) has rotated and rounded q beforehand.

constexpr int kHeads = 64;        // heads per block: n_heads ≤ 64, the missing ones weigh 0
constexpr int kKeys = 64;         // keys per tile
constexpr int kScoreThreads = 256;  // 16 head groups × 16 key groups, 4 × 4 dot products each

template <typename T, int N>
__device__ __forceinline__ void load_or_zero(const T* p, bool valid, float* dst) {
    float v[N];
    if (valid) {
        load_vec(p, v);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < N; i += 4)
        *reinterpret_cast<float4*>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

// score[t, j] = Σ_h w[t,h] · relu(q[t,h] · k[j]). q [rows, n_heads, dim] (T), roped here at pos[t] on
// the last rope_dim channels when inv_freq is given; w float32 [rows, n_heads]; keys: T [dim] entries.
// Grid (splits, rows): block x walks the key tiles x, x + splits, ... of its row; dim % 8 == 0.
// Exact float32 arithmetic: the float build, and the bf16 build where the tensor-core kernel does not fit.
template <typename T, bool Fp4Keys = false>
__global__ void __launch_bounds__(kScoreThreads, 2) indexer_scores(
        float* scores, const T* q, const float* w, char* key_base, const long long* key_pages,
        const int* page_start, int per_page, int entry_bytes, const int* pos, const int* req,
        const float* inv_freq, int rope_dim, int n_heads, int dim, int n_max, int ratio) {
    extern __shared__ __align__(16) float tiles[];
    __shared__ float weight[kHeads];
    __shared__ float partial[16][kKeys];
    const int t = blockIdx.y, request = req[t];
    if (request < 0) return;
    const int m = pos[t], visible = min((m + 1) / ratio, n_max);
    if (blockIdx.x * kKeys >= visible) return;
    // Rows padded by 4 floats: the 8 lanes of a float4 phase read 8 different rows on distinct banks.
    const int stride = dim + 4;
    float* qs = tiles;
    float* ks = tiles + kHeads * stride;
    float2* cs = reinterpret_cast<float2*>(ks + kKeys * stride);
    constexpr int V = kVec<T>;
    const int vecs = dim / V;

    const T* qt = q + static_cast<size_t>(t) * n_heads * dim;
    for (int i = threadIdx.x; i < kHeads * vecs; i += kScoreThreads) {
        const int h = i / vecs, c = i % vecs * V;
        load_or_zero<T, V>(qt + static_cast<size_t>(h) * dim + c, h < n_heads, qs + h * stride + c);
    }
    for (int h = threadIdx.x; h < kHeads; h += kScoreThreads) weight[h] = h < n_heads ? w[t * n_heads + h] : 0.f;
    if (inv_freq) rope_table(cs, inv_freq, rope_dim, m);
    __syncthreads();
    if (inv_freq) {
        const int pairs = rope_dim / 2;
        for (int i = threadIdx.x; i < n_heads * pairs; i += kScoreThreads) {
            const int h = i / pairs, k = i % pairs;
            float* x = qs + h * stride + dim - rope_dim + 2 * k;
            const float ev = x[0], od = x[1];
            x[0] = ev * cs[k].x - od * cs[k].y;
            x[1] = od * cs[k].x + ev * cs[k].y;
        }
    }

    const long long* pages = key_pages + page_start[request];
    const int hg = threadIdx.x >> 4, kg = threadIdx.x & 15;  // heads hg + 16i, keys kg + 16i
    for (int j0 = blockIdx.x * kKeys; j0 < visible; j0 += gridDim.x * kKeys) {
        __syncthreads();  // the last tile's keys and partials are consumed (and q is roped)
        if constexpr (Fp4Keys) {
            const int octets = dim / 8;
            for (int i = threadIdx.x; i < kKeys * octets; i += kScoreThreads) {
                const int r = i / octets, o = i % octets, j = j0 + r;
                float v[8] = {};
                if (j < visible)
                    load_fp4_octet(reinterpret_cast<const unsigned char*>(
                                       paged_entry(key_base, pages, per_page, entry_bytes, j)), dim, o, v);
                float4* dst = reinterpret_cast<float4*>(ks + r * stride + 8 * o);
                dst[0] = make_float4(v[0], v[1], v[2], v[3]);
                dst[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
        } else {
            for (int i = threadIdx.x; i < kKeys * vecs; i += kScoreThreads) {
                const int r = i / vecs, c = i % vecs * V, j = j0 + r;
                const T* key = j < visible
                    ? reinterpret_cast<const T*>(paged_entry(key_base, pages, per_page, entry_bytes, j)) + c : nullptr;
                load_or_zero<T, V>(key, key != nullptr, ks + r * stride + c);
            }
        }
        __syncthreads();
        float acc[4][4] = {};
        for (int d = 0; d < dim; d += 4) {
            float4 qv[4], kv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                qv[i] = *reinterpret_cast<const float4*>(qs + (hg + 16 * i) * stride + d);
                kv[i] = *reinterpret_cast<const float4*>(ks + (kg + 16 * i) * stride + d);
            }
#pragma unroll
            for (int h = 0; h < 4; ++h)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    acc[h][k] = fmaf(qv[h].x, kv[k].x, acc[h][k]);
                    acc[h][k] = fmaf(qv[h].y, kv[k].y, acc[h][k]);
                    acc[h][k] = fmaf(qv[h].z, kv[k].z, acc[h][k]);
                    acc[h][k] = fmaf(qv[h].w, kv[k].w, acc[h][k]);
                }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float s = 0.f;
#pragma unroll
            for (int h = 0; h < 4; ++h) s += weight[hg + 16 * h] * fmaxf(acc[h][k], 0.f);
            partial[hg][kg + 16 * k] = s;
        }
        __syncthreads();
        if (threadIdx.x < kKeys && j0 + threadIdx.x < visible) {
            float s = 0.f;
#pragma unroll
            for (int g = 0; g < 16; ++g) s += partial[g][threadIdx.x];
            scores[static_cast<size_t>(t) * n_max + j0 + threadIdx.x] = s;
        }
    }
}

// ---------------------------------------------------------------- bf16 scores on the tensor cores

constexpr int kMmaDim = 128;         // head_dim of the tensor-core kernel (Flash and Pro)
constexpr int kMmaThreads = 256;     // 8 warps: 2 halves of the heads × 4 strips of 16 keys
constexpr int kStages = 4;           // key tiles in flight per block (cp.async)
constexpr int kKeyStride = kMmaDim + 8;  // bf16 per key row in shared memory: 272 B, ldmatrix rows on distinct banks
constexpr int kFp4Stages = 8;        // packed key tiles in flight per block (a quarter of the bytes of a bf16 tile)
constexpr int kFp4Words = kMmaDim / 8 + kMmaDim / kFp4Block / 4;  // a packed entry: 16 words of codes, 1 of scales

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}

// d += a·b: a 16 × 16 bf16 (row-major), b 16 × 8 bf16 (column-major), d 16 × 8 float32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Raw packed entries [kKeys][kFp4Words] into the bf16 key tile; thread: key row tid % kKeys, scale block
// tid / kKeys (conflict-free: raw rows are an odd number of words apart, a warp's 16-byte stores 8 rows apart).
__device__ __forceinline__ void dequantise_fp4_tile(__nv_bfloat16* tile, const unsigned* raw) {
    static_assert(kKeys * kMmaDim / kFp4Block == kMmaThreads, "a scale block per thread");
    const int row = threadIdx.x % kKeys, block = threadIdx.x / kKeys;
    const unsigned* src = raw + row * kFp4Words;
    const __nv_bfloat162 scale = e8m0_bf16x2(src[kFp4Words - 1] >> 8 * block & 0xffu);
    uint4* dst = reinterpret_cast<uint4*>(tile + row * kKeyStride + kFp4Block * block);
#pragma unroll
    for (int c = 0; c < kFp4Block / 8; ++c) dst[c] = e2m1x8_scaled(src[kFp4Block / 8 * block + c], scale);
}

// The bf16 indexer_scores for head_dim kMmaDim (same arguments less dim): keys × qᵀ on the tensor cores
// with float32 accumulation. q is roped in float32 and rounded to bf16, as a caller-roped q is stored.
// Warp (half, strip) holds the B fragments of heads 32·half … +31 in registers for the whole launch and
// multiplies the 16 keys of its strip of every 64-key tile; the two halves' weighted sums meet in shared
// memory one tile later. Grid (splits, rows) as indexer_scores.
// Fp4Keys: the packed entries (4-byte aligned) stream into kFp4Stages raw tiles; each tile is dequantised into
// the one bf16 key tile (thread: key row tid % 64, scale block tid / 64) between two barriers.
template <bool Fp4Keys>
__global__ void __launch_bounds__(kMmaThreads, 2) indexer_scores_mma(
        float* scores, const __nv_bfloat16* q, const float* w, char* key_base, const long long* key_pages,
        const int* page_start, int per_page, int entry_bytes, const int* pos, const int* req,
        const float* inv_freq, int rope_dim, int n_heads, int n_max, int ratio) {
    // [kStages][kKeys][kKeyStride]; Fp4Keys: [kKeys][kKeyStride], then raw words [kFp4Stages][kKeys][kFp4Words]
    extern __shared__ __align__(16) __nv_bfloat16 stage[];
    __shared__ float2 cs[kMmaDim / 2];
    __shared__ float partial[2][2][kKeys];  // [tile parity][half][key]
    constexpr int kSteps = kMmaDim / 16, kChunks = kKeys * kMmaDim / 8 / kMmaThreads;
    constexpr int S = Fp4Keys ? kFp4Stages : kStages;
    unsigned* raw = reinterpret_cast<unsigned*>(stage + kKeys * kKeyStride);
    const int t = blockIdx.y, request = req[t];
    if (request < 0) return;
    const int m = pos[t], visible = min((m + 1) / ratio, n_max);
    if (blockIdx.x * kKeys >= visible) return;
    const int tiles = (visible + kKeys - 1) / kKeys, mine = (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const long long* pages = key_pages + page_start[request];

    // Thread copies key row tid / 4 of a tile, 16-byte chunks tid % 4 + 4c (Fp4Keys: 4-byte words tid % 4 + 4c, and
    // the scale word 16 if tid % 4 == 0).
    const int copy_row = threadIdx.x >> 2, copy_chunk = threadIdx.x & 3;
    auto issue = [&](int i) {
        if (i < mine) {
            const int j = (blockIdx.x + i * gridDim.x) * kKeys + copy_row;
            const bool valid = j < visible;
            const char* src = valid ? paged_entry(key_base, pages, per_page, entry_bytes, j) : key_base;
            if constexpr (Fp4Keys) {
                unsigned* dst = raw + ((i % S) * kKeys + copy_row) * kFp4Words;
#pragma unroll
                for (int c = 0; c < kFp4Words / 4; ++c)
                    cp_async4_or_zero(dst + copy_chunk + 4 * c, src + (copy_chunk + 4 * c) * 4, valid);
                if (copy_chunk == 0) cp_async4_or_zero(dst + kFp4Words - 1, src + (kFp4Words - 1) * 4, valid);
            } else {
                __nv_bfloat16* dst = stage + ((i % S) * kKeys + copy_row) * kKeyStride;
#pragma unroll
                for (int c = 0; c < kChunks; ++c)
                    cp_async16_or_zero(dst + (copy_chunk + 4 * c) * 8, src + (copy_chunk + 4 * c) * 16, valid);
            }
        }
        cp_async_commit();
    };
    for (int i = 0; i < S - 1; ++i) issue(i);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = warp & 1, strip = warp >> 1;
    const int g = lane >> 2, l4 = lane & 3;
    if (inv_freq) rope_table(cs, inv_freq, rope_dim, m);
    __syncthreads();
    // B fragment of n-tile n, k-step s: b0 = q[h][16s + 2·l4, +1], b1 = q[h][16s + 8 + 2·l4, +1], h = 32·half + 8n + g.
    unsigned b[4][kSteps][2];
    float wt[4][2];
    const __nv_bfloat16* qt = q + static_cast<size_t>(t) * n_heads * kMmaDim;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        const int h = 32 * half + 8 * n + g;
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int d = 16 * s + 8 * r + 2 * l4;
                float2 x = make_float2(0.f, 0.f);
                if (h < n_heads) x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qt + h * kMmaDim + d));
                const int k = (d - (kMmaDim - rope_dim)) / 2;
                if (inv_freq && d >= kMmaDim - rope_dim)
                    x = make_float2(x.x * cs[k].x - x.y * cs[k].y, x.y * cs[k].x + x.x * cs[k].y);
                b[n][s][r] = pack_bf16(x.x, x.y);
            }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int hw = 32 * half + 8 * n + 2 * l4 + c;
            wt[n][c] = hw < n_heads ? w[t * n_heads + hw] : 0.f;
        }
    }

    float* out = scores + static_cast<size_t>(t) * n_max;
    auto store = [&](int i) {  // tile i's scores, from both halves' sums
        const int j = (blockIdx.x + i * gridDim.x) * kKeys + threadIdx.x;
        if (threadIdx.x < kKeys && j < visible) out[j] = partial[i & 1][0][threadIdx.x] + partial[i & 1][1][threadIdx.x];
    };
    // ldmatrix.x4 lane address: row lane % 16 of the strip, column half lane / 16 of the k-step.
    const unsigned a_base = smem_u32(stage + (strip * 16 + (lane & 15)) * kKeyStride + 8 * (lane >> 4));
    for (int i = 0; i < mine; ++i) {
        cp_async_wait<S - 2>();
        __syncthreads();  // tile i landed for every thread; tile i − 1 is consumed, its stage free again
        if (i > 0) store(i - 1);
        issue(i + S - 1);
        if constexpr (Fp4Keys) {
            dequantise_fp4_tile(stage, raw + (i % S) * kKeys * kFp4Words);
            __syncthreads();
        }
        float acc[4][4] = {};
        const unsigned a_tile = a_base + (Fp4Keys ? 0 : (i % S) * kKeys * kKeyStride * 2);
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
            unsigned a[4];
            ldmatrix_x4(a, a_tile + s * 32);
#pragma unroll
            for (int n = 0; n < 4; ++n) mma_bf16(acc[n], a, b[n][s][0], b[n][s][1]);
        }
        // acc[n]: keys g (0, 1) and g + 8 (2, 3) × heads 8n + 2·l4 + (0, 1) of this half.
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            lo += wt[n][0] * fmaxf(acc[n][0], 0.f) + wt[n][1] * fmaxf(acc[n][1], 0.f);
            hi += wt[n][0] * fmaxf(acc[n][2], 0.f) + wt[n][1] * fmaxf(acc[n][3], 0.f);
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            lo += __shfl_xor_sync(0xffffffffu, lo, o);
            hi += __shfl_xor_sync(0xffffffffu, hi, o);
        }
        if (l4 == 0) {
            partial[i & 1][half][strip * 16 + g] = lo;
            partial[i & 1][half][strip * 16 + g + 8] = hi;
        }
    }
    __syncthreads();
    store(mine - 1);
}

// ---------------------------------------------------------------- exact top-k

// A cluster of Cluster blocks shares each row: block r takes the r-th share of its entries, the
// blocks add their histograms through distributed shared memory. kCluster when rows are few (decode);
// one block a row when they fill the GPU anyway (prefill), where more would only repeat each block's
// fixed cost. The key is selected in three MSB
// digits (12, 10, 10 bits). Entries whose first digit matches the threshold's are copied to shared
// memory once (unless some block has more than `capacity`: then every pass re-reads the row).
constexpr int kCluster = 8;
constexpr int kSelectThreads = 512;
constexpr int kBins1 = 4096, kBins = 1024;
constexpr int kUnroll = 4;  // float4 loads in flight per thread

// Float bits made unsigned-comparable in the float order; −0 and +0 tie, as in the reference.
__device__ __forceinline__ unsigned order_key(float s) {
    const unsigned u = __float_as_uint(s == 0.f ? 0.f : s);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// hist[bin] += 1 for each lane with `valid`; a warp whose lanes share one bin adds once (ties, zeros).
__device__ __forceinline__ void count(unsigned* hist, unsigned bin, bool valid) {
    const unsigned lanes = __ballot_sync(0xffffffffu, valid);
    const int leader = __ffs(lanes) - 1;
    const unsigned first = __shfl_sync(0xffffffffu, bin, max(leader, 0));
    if (__all_sync(0xffffffffu, !valid || bin == first)) {
        if (lanes && static_cast<int>(threadIdx.x & 31) == leader) atomicAdd(hist + first, __popc(lanes));
    } else if (valid) {
        atomicAdd(hist + bin, 1u);
    }
}

// Exclusive prefix of v over the block's threads in order, and the block's total.
__device__ __forceinline__ unsigned block_scan(unsigned v, unsigned& total) {
    __shared__ unsigned warp_sums[kSelectThreads / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    unsigned before = 0;
    total = 0;
#pragma unroll
    for (int i = 0; i < kSelectThreads / 32; ++i) {
        before += i < warp ? warp_sums[i] : 0;
        total += warp_sums[i];
    }
    __syncthreads();
    return before + inc - v;
}

struct Cut {
    unsigned bin;  // the digit of the k-th largest key
    int need;      // how many keys with that digit (and the prefix) belong to the top-k
};

// hist [bins] over one digit of the keys that match the prefix; `need` of them belong to the top-k.
__device__ __forceinline__ Cut find_cut(const unsigned* hist, int bins, int need, Cut& shared) {
    const int per = bins / kSelectThreads, top = bins - per * static_cast<int>(threadIdx.x);  // bins top − per … top − 1
    unsigned local = 0;
    for (int b = 1; b <= per; ++b) local += hist[top - b];
    unsigned total;
    unsigned above = block_scan(local, total);
    if (above < static_cast<unsigned>(need) && static_cast<unsigned>(need) <= above + local) {
        for (int b = 1; b <= per; ++b) {
            const unsigned c = hist[top - b];
            if (above + c >= static_cast<unsigned>(need)) {
                shared = {static_cast<unsigned>(top - b), need - static_cast<int>(above)};
                break;
            }
            above += c;
        }
    }
    __syncthreads();
    return shared;
}

// total[b] = Σ over the cluster's blocks of their hist[b]; hist is complete in every block (cluster_sync).
template <int Cluster>
__device__ __forceinline__ void cluster_hist(const unsigned* hist, unsigned* total, int bins) {
    for (int i = threadIdx.x; i < bins / 4; i += kSelectThreads) {
        uint4 s = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < Cluster; ++r) {
            const uint4 v = cluster_load4(cluster_addr(hist + 4 * i, r));
            s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
        }
        reinterpret_cast<uint4*>(total)[i] = s;
    }
    __syncthreads();
}

__device__ __forceinline__ void set_bit(unsigned* bits, int i) { atomicOr(bits + (i >> 5), 1u << (i & 31)); }

// One block's share of a row and the selection's shared-memory state.
struct Share {
    const float4* groups;  // aligned float4 group k holds entries 4k − skew … 4k − skew + 3
    int g_lo, g_hi;        // this block's groups
    int skew, lo, visible;  // bit i of the bitmaps is entry lo + i
    unsigned *hist1, *hist2, *hist3;
    unsigned *greater, *ties;  // bitmaps: entries above the threshold key τ (then every selected one), equal to it
    unsigned *cand_key, *cand_at, *n_cand;
    unsigned bin1, prefix, tau;  // τ's first digit, first two digits, all of it
    bool in_shared;              // the entries whose first digit is bin1 are the candidates
};

enum Pass { kFirstDigit, kCollect, kThirdDigit, kMark };

template <int P>
__device__ __forceinline__ void visit(Share& s, int bit, unsigned key, bool valid) {
    if (P == kFirstDigit) count(s.hist1, key >> 20, valid);
    if (P == kCollect) {
        const unsigned digit = key >> 20;
        if (valid && digit > s.bin1) set_bit(s.greater, bit);
        const bool candidate = valid && digit == s.bin1;
        count(s.hist2, key >> 10 & (kBins - 1), candidate);
        if (s.in_shared) {
            const int lane = threadIdx.x & 31;
            const unsigned lanes = __ballot_sync(0xffffffffu, candidate);
            const int leader = max(__ffs(lanes) - 1, 0);
            unsigned slot = 0;
            if (lanes && lane == leader) slot = atomicAdd(s.n_cand, __popc(lanes));
            slot = __shfl_sync(0xffffffffu, slot, leader) + __popc(lanes & ((1u << lane) - 1));
            if (candidate) s.cand_key[slot] = key, s.cand_at[slot] = bit;
        }
    }
    if (P == kThirdDigit) count(s.hist3, key & (kBins - 1), valid && key >> 10 == s.prefix);
    if (P == kMark) {
        if (valid && key > s.tau) set_bit(s.greater, bit);
        if (valid && key == s.tau) set_bit(s.ties, bit);
    }
}

// visit<P> over the block's entries read from the row, every thread in step (warp-uniform trip counts);
// the passes after the second see only the entries whose first digit is bin1.
template <int P>
__device__ __forceinline__ void each_entry(Share& s) {
    for (int g0 = s.g_lo; g0 < s.g_hi; g0 += kUnroll * kSelectThreads) {
        float4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int g = g0 + u * kSelectThreads + threadIdx.x;
            v[u] = g < s.g_hi ? s.groups[g] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (g0 + u * kSelectThreads + static_cast<int>(threadIdx.x & ~31u) >= s.g_hi) continue;  // a warp with no entry
            const int g = g0 + u * kSelectThreads + threadIdx.x, i = 4 * g - s.skew;
            const float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const unsigned key = order_key(x[c]);
                bool valid = g < s.g_hi && i + c >= 0 && i + c < s.visible;
                if (P >= kThirdDigit) valid = valid && key >> 20 == s.bin1;
                visit<P>(s, i + c - s.lo, key, valid);
            }
        }
    }
}

// visit<P> over the entries whose first digit is bin1: the candidates, or the row again.
template <int P>
__device__ __forceinline__ void each_candidate(Share& s) {
    if (!s.in_shared) {
        each_entry<P>(s);
        return;
    }
    const unsigned n = *s.n_cand;
    for (unsigned base = 0; base < n; base += kSelectThreads) {
        const unsigned i = base + threadIdx.x;
        const bool valid = i < n;
        visit<P>(s, valid ? s.cand_at[i] : 0, valid ? s.cand_key[i] : 0u, valid);
    }
}

// selected [rows, topk]: the min(topk, visible) best entries of each row in ascending index order,
// ties toward the lower index, then −1. Grid (Cluster, rows), kSelectThreads threads; dynamic shared
// memory: two bitmaps of the block's share of entries, then `capacity` candidates (key and index).
template <int Cluster>
__global__ void __cluster_dims__(Cluster, 1, 1) __launch_bounds__(kSelectThreads) indexer_topk(
        int* selected, const float* scores, const int* pos, const int* req, int n_max, int topk, int ratio,
        int capacity) {
    extern __shared__ unsigned dyn[];
    __shared__ __align__(16) unsigned hist1[kBins1];
    __shared__ __align__(16) unsigned hist2[kBins];
    __shared__ __align__(16) unsigned hist3[kBins];
    __shared__ __align__(16) unsigned total[kBins1];
    __shared__ unsigned n_cand, counts[2];
    __shared__ Cut cut;
    const int t = blockIdx.y, rank = blockIdx.x, tid = threadIdx.x;
    int* out = selected + static_cast<size_t>(t) * topk;
    const int visible = req[t] < 0 ? 0 : min((pos[t] + 1) / ratio, n_max);
    if (visible <= topk) {
        for (int i = rank * kSelectThreads + tid; i < topk; i += Cluster * kSelectThreads) out[i] = i < visible ? i : -1;
        return;
    }
    Share s;
    const float* row = scores + static_cast<size_t>(t) * n_max;
    s.skew = static_cast<int>(reinterpret_cast<size_t>(row) >> 2 & 3);
    s.groups = reinterpret_cast<const float4*>(row - s.skew);
    s.visible = visible;
    const int n_groups = (visible + s.skew + 3) / 4, share = (n_groups + Cluster - 1) / Cluster;
    s.g_lo = min(n_groups, rank * share);
    s.g_hi = min(n_groups, s.g_lo + share);
    s.lo = 4 * s.g_lo - s.skew;
    const int words = (share + 7) / 8;
    s.hist1 = hist1, s.hist2 = hist2, s.hist3 = hist3, s.n_cand = &n_cand;
    s.greater = dyn, s.ties = dyn + words, s.cand_key = dyn + 2 * words, s.cand_at = s.cand_key + capacity;

    for (int i = tid; i < kBins1; i += kSelectThreads) hist1[i] = 0;
    for (int i = tid; i < kBins; i += kSelectThreads) hist2[i] = hist3[i] = 0;
    for (int i = tid; i < 2 * words; i += kSelectThreads) dyn[i] = 0;
    if (tid == 0) n_cand = 0;
    __syncthreads();

    each_entry<kFirstDigit>(s);
    cluster_sync();
    cluster_hist<Cluster>(hist1, total, kBins1);
    const Cut c1 = find_cut(total, kBins1, topk, cut);
    s.bin1 = c1.bin;
    s.in_shared = !__syncthreads_or(tid < Cluster && cluster_load(cluster_addr(hist1 + c1.bin, tid)) > capacity);

    each_entry<kCollect>(s);
    cluster_sync();
    cluster_hist<Cluster>(hist2, total, kBins);
    const Cut c2 = find_cut(total, kBins, c1.need, cut);
    s.prefix = c1.bin << 10 | c2.bin;

    each_candidate<kThirdDigit>(s);
    cluster_sync();
    cluster_hist<Cluster>(hist3, total, kBins);
    const Cut c3 = find_cut(total, kBins, c2.need, cut);
    s.tau = s.prefix << 10 | c3.bin;  // the k-th largest key; c3.need entries equal to it are taken

    each_candidate<kMark>(s);
    __syncthreads();

    // Thread tid owns bitmap words [w_lo, w_hi): counts in index order within the block, then across it.
    unsigned* greater = s.greater;
    const unsigned* ties = s.ties;
    const int per_thread = (words + kSelectThreads - 1) / kSelectThreads;
    const int w_lo = min(words, tid * per_thread), w_hi = min(words, w_lo + per_thread);
    unsigned my_ties = 0, my_greater = 0;
    for (int k = w_lo; k < w_hi; ++k) my_ties += __popc(ties[k]), my_greater += __popc(greater[k]);
    unsigned block_ties, block_greater;
    unsigned tie_rank = block_scan(my_ties, block_ties);
    block_scan(my_greater, block_greater);
    if (tid == 0) counts[0] = block_greater, counts[1] = block_ties;
    cluster_sync();
    // Ties go to the lowest indices: blocks before this one take theirs first.
    int quota = c3.need, offset = 0;
    for (int r = 0; r < rank; ++r) {
        const int g = cluster_load(cluster_addr(&counts[0], r)), n = cluster_load(cluster_addr(&counts[1], r));
        offset += g + min(max(quota, 0), n);
        quota -= n;
    }
    cluster_arrive();  // this block reads no other block's memory from here on
    quota = min(max(quota, 0), static_cast<int>(block_ties));

    unsigned my_selected = 0;
    for (int k = w_lo; k < w_hi; ++k) {
        unsigned take = ties[k];
        const int n = __popc(take);
        for (int extra = static_cast<int>(tie_rank) + n - quota; extra > 0 && take; --extra)
            take &= ~(0x80000000u >> __clz(take));  // drop the highest-index ties beyond the quota
        tie_rank += n;
        greater[k] |= take;
        my_selected += __popc(greater[k]);
    }
    unsigned block_selected;
    int slot = offset + static_cast<int>(block_scan(my_selected, block_selected));
    for (int k = w_lo; k < w_hi; ++k)
        for (unsigned bits = greater[k]; bits; bits &= bits - 1) out[slot++] = s.lo + 32 * k + __ffs(bits) - 1;
    cluster_wait();  // no block leaves while another may still read its counts
}
