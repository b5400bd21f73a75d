// dsv4rt-instantiate: indexer_scores<float> indexer_scores<__nv_bfloat16> indexer_topk
#include "compress.cuh"

// The lightning indexer of MODEL.md section 6 in two kernels: scores into a float32 workspace
// [rows, n_max], then an exact top-k per row. Row t is one query: req[t] (< 0: padding), pos[t];
// it sees entries j < min((pos[t] + 1) / ratio, n_max) of its request's indexer-key cache.

constexpr int kHeads = 64;        // heads per block: n_heads ≤ 64, the missing ones weigh 0
constexpr int kKeys = 64;         // keys per tile
constexpr int kScoreThreads = 256;  // 16 head groups × 16 key groups, 4 × 4 dot products each
constexpr int kSelectThreads = 512;

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
template <typename T>
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
    constexpr int V = kVec<T>;
    const int vecs = dim / V;

    const T* qt = q + static_cast<size_t>(t) * n_heads * dim;
    for (int i = threadIdx.x; i < kHeads * vecs; i += kScoreThreads) {
        const int h = i / vecs, c = i % vecs * V;
        load_or_zero<T, V>(qt + static_cast<size_t>(h) * dim + c, h < n_heads, qs + h * stride + c);
    }
    for (int h = threadIdx.x; h < kHeads; h += kScoreThreads) weight[h] = h < n_heads ? w[t * n_heads + h] : 0.f;
    __syncthreads();
    if (inv_freq) {
        const int pairs = rope_dim / 2;
        for (int i = threadIdx.x; i < n_heads * pairs; i += kScoreThreads) {
            const int h = i / pairs, k = i % pairs;
            float* x = qs + h * stride + dim - rope_dim + 2 * k;
            float s, c;
            sincosf(static_cast<float>(m) * inv_freq[k], &s, &c);
            const float ev = x[0], od = x[1];
            x[0] = ev * c - od * s;
            x[1] = od * c + ev * s;
        }
    }

    const long long* pages = key_pages + page_start[request];
    const int hg = threadIdx.x >> 4, kg = threadIdx.x & 15;  // heads hg + 16i, keys kg + 16i
    for (int j0 = blockIdx.x * kKeys; j0 < visible; j0 += gridDim.x * kKeys) {
        __syncthreads();  // the last tile's keys and partials are consumed (and q is roped)
        for (int i = threadIdx.x; i < kKeys * vecs; i += kScoreThreads) {
            const int r = i / vecs, c = i % vecs * V, j = j0 + r;
            const T* key = j < visible
                ? reinterpret_cast<const T*>(paged_entry(key_base, pages, per_page, entry_bytes, j)) + c : nullptr;
            load_or_zero<T, V>(key, key != nullptr, ks + r * stride + c);
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

// Float bits made unsigned-comparable in the float order; −0 and +0 tie, as in the reference.
__device__ __forceinline__ unsigned order_key(float s) {
    const unsigned u = __float_as_uint(s == 0.f ? 0.f : s);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// Exclusive count of `flag` over the threads before this one, and the block's total.
__device__ __forceinline__ int block_prefix(bool flag, int& total) {
    __shared__ int warp_counts[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    total = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
        before += i < warp ? warp_counts[i] : 0;
        total += warp_counts[i];
    }
    __syncthreads();
    return before + __popc(ballot & ((1u << lane) - 1));
}

// selected [rows, topk]: the min(topk, visible) best entries of each row in ascending index order,
// ties toward the lower index, then −1. One block per row: a 4-pass MSB radix select finds the
// k-th largest key τ and how many entries equal to τ to take; one ordered pass compacts.
__global__ void __launch_bounds__(kSelectThreads) indexer_topk(
        int* selected, const float* scores, const int* pos, const int* req, int n_max, int topk, int ratio) {
    __shared__ unsigned hist[256];
    __shared__ unsigned found_key;
    __shared__ int found_need;
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    int* out = selected + static_cast<size_t>(t) * topk;
    const int visible = req[t] < 0 ? 0 : min((pos[t] + 1) / ratio, n_max);
    if (visible <= topk) {
        for (int i = threadIdx.x; i < topk; i += blockDim.x) out[i] = i < visible ? i : -1;
        return;
    }
    const float* row = scores + static_cast<size_t>(t) * n_max;

    unsigned prefix = 0;  // the high bits of τ fixed so far
    int need = topk;      // how many of the entries matching prefix still belong to the top-k
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned high = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int base = 0; base < visible; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const unsigned key = i < visible ? order_key(row[i]) : 0u;
            const bool match = i < visible && (key & high) == prefix;
            const unsigned bin = match ? (key >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);  // one atomic per distinct bin and warp
            if (match && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l owns bins 255 − 8l … 248 − 8l; counts accumulate from the top bin down.
            unsigned local = 0;
            for (int b = 0; b < 8; ++b) local += hist[255 - 8 * lane - b];
            unsigned upto = local;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, upto, o);
                if (lane >= o) upto += v;
            }
            unsigned above = upto - local;
            if (above < static_cast<unsigned>(need) && static_cast<unsigned>(need) <= upto) {
                for (int b = 0; b < 8; ++b) {
                    const unsigned bin = 255 - 8 * lane - b, count = hist[bin];
                    if (above + count >= static_cast<unsigned>(need)) {
                        found_key = prefix | bin << shift;
                        found_need = need - static_cast<int>(above);
                        break;
                    }
                    above += count;
                }
            }
        }
        __syncthreads();
        prefix = found_key;
        need = found_need;
    }

    int taken = 0, ties_seen = 0;
    for (int base = 0; base < visible; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const unsigned key = i < visible ? order_key(row[i]) : 0u;
        const bool tie = i < visible && key == prefix;
        int ties, takes;
        const int tie_rank = ties_seen + block_prefix(tie, ties);
        const bool take = i < visible && (key > prefix || (tie && tie_rank < need));
        const int slot = taken + block_prefix(take, takes);
        if (take) out[slot] = i;
        ties_seen += ties;
        taken += takes;
    }
}
