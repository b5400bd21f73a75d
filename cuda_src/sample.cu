// dsv4rt-instantiate: sample_tokens
#include "common.cuh"

// Token sampling (twin: dsv4rt/reference/sampling.py): greedy, temperature, top-k, top-p, one block
// per row of fp32 logits, parameters per row so one graph serves mixed requests.
//
// Order: tokens sort by (logit desc, index asc), the reference's stable order. Packing
// key = (monotone bits of the logit) << 32 | (0xffffffff − index) makes every key distinct and that
// order plain integer order. Top-k and top-p cut a prefix of that order; both cuts are found by radix
// select over the keys (8-bit digits from the top, histograms in shared memory). Probability mass is
// fixed point, m = floor(exp((l − lmax)/T) · 2^42), summed with integer atomics: the cuts and the
// draw are then exact and deterministic, whatever the order of the atomics. Tokens with m = 0
// (mass below 2^-42 of the top token) can never be drawn and are left out of the pool throughout.
// The draw: r from Philox4x32-10 keyed by (seed, step), u = r·Z / 2^64 for the pool's mass Z, and
// the token where the running mass in index order passes u.
typedef unsigned long long u64;

constexpr float kMassScale = 4398046511104.f;  // 2^42: a vocabulary of up to 2^22 sums below 2^64
constexpr float kPoolLogitSpan = 30.f;         // exp(−30)·2^42 < 1: tokens further below lmax have m = 0

__device__ __forceinline__ unsigned monotone_bits(float v) {
    const unsigned u = __float_as_uint(v + 0.f);  // −0 → +0: equal logits compare equal
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 sort_key(float logit, int i) {
    return (static_cast<u64>(monotone_bits(logit)) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

__device__ __forceinline__ u64 mass(float logit, float lmax, float temperature) {
    return __float2ull_rz(expf((logit - lmax) / temperature) * kMassScale);
}

__device__ __forceinline__ u64 block_max_u64(u64 v, u64* partial) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? partial[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
}

// Inclusive prefix sum over the block in thread order; *total gets the block's sum.
__device__ __forceinline__ u64 block_scan_u64(u64 v, u64* partial, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    if (lane == 31) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < warps ? partial[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        partial[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const u64 before = warp ? partial[warp - 1] : 0;
    *total = partial[warps - 1];
    __syncthreads();
    return v + before;
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

struct Pool {
    const float* row;
    int vocab;
    float lmax, temperature;
    u64 lowest;  // no pool key is below: sort_key(lmax − 30·T, ∞)
    u64 floor;   // keys below were cut already (top-k before top-p)

    __device__ bool holds(u64 key, u64 m) const { return m > 0 && key >= lowest && key >= floor; }
};

struct SelectScratch {
    u64 weight[256];
    unsigned count[256];
    u64 above, target;
    int bin;
    unsigned bin_count;
};

// The largest key K such that the pool's keys ≥ K weigh at least the target: `k` tokens (BY_MASS
// false) or ceil(top_p · pool mass) (BY_MASS true). Every pool key lies between pool.lowest and
// `highest`, so their common top bits are skipped. Returns pool.floor when the whole pool is within
// the cut (fewer than k tokens) or the pool is empty.
template <bool BY_MASS>
__device__ __forceinline__ u64 radix_select(const Pool pool, u64 highest, float top_p, int k, SelectScratch& s) {
    int top = 64 - __clzll(highest ^ pool.lowest);  // bits [top, 64) are common to all pool keys
    u64 prefix = top == 64 ? 0 : highest & ~((1ull << top) - 1);
    u64 above = 0;  // weight of the pool keys already known to be above the digit being decided
    for (bool first = true;; first = false) {
        const int width = min(8, top), shift = top - width;
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s.weight[b] = 0, s.count[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < pool.vocab; i += blockDim.x) {
            const float l = pool.row[i];
            const u64 key = sort_key(l, i), m = mass(l, pool.lmax, pool.temperature);
            if (!pool.holds(key, m) || (top < 64 && (key >> top) != (prefix >> top))) continue;
            const int d = static_cast<int>(key >> shift) & ((1 << width) - 1);
            atomicAdd(&s.weight[d], BY_MASS ? m : 1ull);
            if (BY_MASS) atomicAdd(&s.count[d], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane L holds bins 255−8L … 248−8L, highest first: the crossing bin in one warp scan.
            const int lane = threadIdx.x;
            u64 mine = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) mine += s.weight[255 - 8 * lane - j];
            u64 incl = mine;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            if (first) {
                const u64 total = __shfl_sync(0xffffffffu, incl, 31);
                const u64 t = BY_MASS ? max(1ull, static_cast<u64>(ceil(static_cast<double>(top_p) * total)))
                                      : static_cast<u64>(k);
                if (lane == 0) s.target = (total == 0 || (!BY_MASS && total <= t)) ? 0 : t;
            }
            __syncwarp();
            const u64 target = s.target;
            u64 cum = above + incl - mine;
            if (target && cum < target && cum + mine >= target) {
                int b = 255 - 8 * lane;
                for (; cum + s.weight[b] < target; --b) cum += s.weight[b];
                s.above = cum;
                s.bin = b;
                s.bin_count = BY_MASS ? s.count[b] : static_cast<unsigned>(s.weight[b]);
            }
        }
        __syncthreads();
        if (!s.target) return pool.floor;
        above = s.above;
        prefix |= static_cast<u64>(s.bin) << shift;
        top = shift;
        const bool done = s.bin_count == 1 || top == 0;
        __syncthreads();  // everyone has read s before the next level clears it
        if (done) return prefix;
    }
}

// out[row] = the sampled token of logits[row, :vocab]. temperature 0 (or top_k 1) is greedy: the
// first maximum. top_k 0 means no cut, top_p ≥ 1 likewise. blockDim.x: a multiple of 32, ≤ 1024.
__global__ void __launch_bounds__(1024, 1) sample_tokens(int* out, const float* logits, int vocab,
                                                      const float* temperature, const int* top_k,
                                                      const float* top_p, const u64* seed, const u64* step) {
    __shared__ u64 partial[32];
    __shared__ SelectScratch scratch;
    const int row = blockIdx.x;
    const float* l = logits + static_cast<size_t>(row) * vocab;
    u64 best = 0;
    if (vocab % 4 == 0 && aligned16(l)) {  // 16-byte loads: one block reads the whole row
        const float4* l4 = reinterpret_cast<const float4*>(l);
        for (int j = threadIdx.x; j < vocab / 4; j += blockDim.x) {
            const float4 v = l4[j];
            const int i = 4 * j;
            best = max(max(best, max(sort_key(v.x, i), sort_key(v.y, i + 1))),
                       max(sort_key(v.z, i + 2), sort_key(v.w, i + 3)));
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = max(best, sort_key(l[i], i));
    }
    best = block_max_u64(best, partial);
    const int argmax = static_cast<int>(0xffffffffu - static_cast<unsigned>(best));
    const float t = temperature[row], p = top_p[row];
    const int k = top_k[row];
    if (!(t > 0.f) || k == 1) {
        if (threadIdx.x == 0) out[row] = argmax;
        return;
    }
    Pool pool{l, vocab, l[argmax], t, 0, 0};
    pool.lowest = static_cast<u64>(monotone_bits(pool.lmax - kPoolLogitSpan * t)) << 32;
    if (k > 0 && k < vocab) pool.floor = radix_select<false>(pool, best, p, k, scratch);
    if (p < 1.f) pool.floor = max(pool.floor, radix_select<true>(pool, best, p, k, scratch));

    // The draw, in index order: thread j owns a contiguous chunk, a block scan orders the chunks.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(vocab, threadIdx.x * chunk), end = min(vocab, begin + chunk);
    u64 mine = 0;
    for (int i = begin; i < end; ++i) {
        const u64 m = mass(l[i], pool.lmax, t);
        if (pool.holds(sort_key(l[i], i), m)) mine += m;
    }
    u64 total;
    const u64 incl = block_scan_u64(mine, partial, &total);
    if (total == 0) {  // no finite mass (NaN or all −inf logits): fall back to the first maximum
        if (threadIdx.x == 0) out[row] = argmax;
        return;
    }
    const u64 s = seed[row], n = step[row];
    const uint4 r = philox4x32_10(make_uint4(static_cast<unsigned>(n), static_cast<unsigned>(n >> 32), 0x53414d50u, 0),
                                  make_uint2(static_cast<unsigned>(s), static_cast<unsigned>(s >> 32)));
    const u64 u = __umul64hi((static_cast<u64>(r.x) << 32) | r.y, total);  // uniform in [0, total)
    u64 cum = incl - mine;
    if (cum <= u && u < incl) {
        for (int i = begin; i < end; ++i) {
            const u64 m = mass(l[i], pool.lmax, t);
            if (!pool.holds(sort_key(l[i], i), m)) continue;
            cum += m;
            if (u < cum) {
                out[row] = i;
                break;
            }
        }
    }
}
