// dsv4rt-instantiate: sample_tokens<1> sample_tokens<2> sample_tokens<4> sample_tokens<8>
#include "common.cuh"

// Token sampling (twin: dsv4rt/reference/sampling.py): greedy, temperature, top-k, top-p for rows of fp32
// logits, parameters per row so one graph serves mixed requests. A cluster of C blocks takes each row, block
// r its r-th contiguous share; all blocks take the same decisions from histograms added over the cluster.
//
// Order: tokens sort by (logit desc, index asc), the reference's stable order. Packing
// key = (monotone bits of the logit) << 32 | (0xffffffff − index) makes every key distinct and that
// order plain integer order. Probability mass is fixed point, m = floor(exp((l − lmax)/T) · 2^42), summed
// with integer atomics: the cuts and the draw are exact and deterministic, whatever the order of the atomics
// or the split of the row. The pool: tokens with m > 0 and l ≥ lmax − 30·T (the others can never be drawn).
// Top-k, then top-p on what it leaves, cut a prefix of the pool's order. The draw: r from Philox4x32-10 keyed
// by (seed, step), u = r·Z / 2^64 for the remaining mass Z, and the token where the running mass in index
// order passes u.
//
// Passes over the row: the largest key; then the pool, counted and weighed in coarse bins linear in the logit
// (lmax down to the lowest pool logit), its members (key and mass) copied to shared memory where they fit.
// A cut finds its coarse bin in that histogram, then its key among the bin's members by radix select (8-bit
// digits from the first bit where they differ). The members come from shared memory, copied by one more pass
// when the first copy overflowed, or from the row when even the bin does not fit. The draw finds the block
// whose share holds u, and there the token by radix select over indices weighted by mass.
typedef unsigned long long u64;

constexpr float kMassScale = 4398046511104.f;  // 2^42: a vocabulary of up to 2^22 sums below 2^64
constexpr float kPoolLogitSpan = 30.f;         // exp(−30)·2^42 < 1: tokens further below lmax have m = 0
constexpr int kCoarseBins = 2048;              // per cluster: each block adds C histograms of 2048 / C bins
constexpr int kDigitBins = 256;
constexpr int kMaxLoads = 8, kMemberLoads = 4;  // loads in flight per thread
constexpr unsigned kAll = 0xffffffffu;

__device__ __forceinline__ unsigned monotone_bits(float v) {
    // −0 → +0 so that equal logits compare equal; not through v + 0.f, which turns a negative NaN positive
    const unsigned u = v == 0.f ? 0u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float logit_of(u64 key) {
    const unsigned b = static_cast<unsigned>(key >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

__device__ __forceinline__ u64 sort_key(float logit, int i) {
    return (static_cast<u64>(monotone_bits(logit)) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

// m is the float held here, truncated: members keep it in 4 bytes.
__device__ __forceinline__ float scaled_mass(float logit, float lmax, float temperature) {
    return expf((logit - lmax) / temperature) * kMassScale;
}

__device__ __forceinline__ u64 mass_of(float scaled) { return __float2ull_rz(scaled); }

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

// A barrier of the row's blocks (a cluster of C) that orders their shared-memory accesses, local and remote.
template <int C>
__device__ __forceinline__ void row_sync() {
    if constexpr (C > 1) {
        cluster_sync();
    } else {
        __syncthreads();
    }
}

// p (this block's shared memory) in block `rank` of the cluster.
template <int C, typename T>
__device__ __forceinline__ T* peer(T* p, unsigned rank) {
    if constexpr (C == 1) return p;
    u64 a;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(a) : "l"(reinterpret_cast<u64>(p)), "r"(rank));
    return reinterpret_cast<T*>(a);
}

struct Pair {
    u64 a, b;
};

__device__ __forceinline__ Pair warp_max(Pair v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v.a = max(v.a, __shfl_xor_sync(kAll, v.a, o));
        v.b = max(v.b, __shfl_xor_sync(kAll, v.b, o));
    }
    return v;
}

__device__ __forceinline__ Pair warp_scan(Pair v) {  // inclusive, in lane order
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 a = __shfl_up_sync(kAll, v.a, o), b = __shfl_up_sync(kAll, v.b, o);
        if (lane >= o) v.a += a, v.b += b;
    }
    return v;
}

// Both maxima over the block, to every thread.
__device__ __forceinline__ Pair block_max(Pair v, u64 (*part)[32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) part[0][warp] = v.a, part[1][warp] = v.b;
    __syncthreads();
    const bool in = lane < static_cast<int>(blockDim.x >> 5);
    v = warp_max(Pair{in ? part[0][lane] : 0, in ? part[1][lane] : 0});
    __syncthreads();
    return v;
}

// Inclusive prefix sums over the block in thread order; *total gets the block's sums.
__device__ __forceinline__ Pair block_scan(Pair v, u64 (*part)[32], Pair* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_scan(v);
    if (lane == 31) part[0][warp] = v.a, part[1][warp] = v.b;
    __syncthreads();
    if (warp == 0) {
        const Pair w = warp_scan(Pair{lane < warps ? part[0][lane] : 0, lane < warps ? part[1][lane] : 0});
        part[0][lane] = w.a, part[1][lane] = w.b;
    }
    __syncthreads();
    const Pair before{warp ? part[0][warp - 1] : 0, warp ? part[1][warp - 1] : 0};
    *total = Pair{part[0][warps - 1], part[1][warps - 1]};
    __syncthreads();
    return Pair{v.a + before.a, v.b + before.b};
}

// *mass += m by 32-bit shared atomics (64-bit ones are a compare-and-swap loop): the low word's carry goes to
// the high word, so the sum is exact in any order and reads back as one little-endian u64.
__device__ __forceinline__ void add_mass(u64* mass, u64 m) {
    unsigned* word = reinterpret_cast<unsigned*>(mass);
    const unsigned low = static_cast<unsigned>(m), before = atomicAdd(word, low);
    const unsigned high = static_cast<unsigned>(m >> 32) + (before + low < before ? 1u : 0u);
    if (high) atomicAdd(word + 1, high);
}

// count[bin] += 1, mass[bin] += m for each lane with `member`; a warp whose members share one bin adds once.
__device__ __forceinline__ void hist_add(unsigned* count, u64* mass, int bin, u64 m, bool member) {
    const unsigned lanes = __ballot_sync(kAll, member);
    if (!lanes) return;
    const int leader = __ffs(lanes) - 1;
    const int first = __shfl_sync(kAll, bin, leader);
    if (__all_sync(kAll, !member || bin == first)) {
        u64 sum = member ? m : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kAll, sum, o);
        if (static_cast<int>(threadIdx.x & 31) == leader) {
            atomicAdd(count + first, static_cast<unsigned>(__popc(lanes)));
            add_mass(mass + first, sum);
        }
    } else if (member) {
        atomicAdd(count + bin, 1u);
        add_mass(mass + bin, m);
    }
}

template <int C>
struct Shared {
    static constexpr int kBins = kCoarseBins / C;
    u64 bin_mass[kBins];                  // this block's share of the pool
    u64 merged_mass[C > 1 ? kBins : 1];   // the cluster's (C = 1: bin_mass)
    u64 digit_mass[2][kDigitBins];        // radix rounds alternate: one fills a histogram while peers read the other
    u64 part[2][32];
    u64 best, low;           // published: this share's largest key, the complement of its smallest monotone bits
    u64 rank_max, rank_low;  // published: radix bounds of this block's members (rank_low complemented)
    u64 z;                   // published: this block's mass of the final set
    u64 sel_count, sel_mass, sel_above_count, sel_above_mass;
    unsigned bin_count[kBins];
    unsigned merged_count[C > 1 ? kBins : 1];
    unsigned digit_count[2][kDigitBins];
    unsigned pool_n;  // published: pool members of this share (beyond the capacity: not all copied)
    unsigned n;       // copy counter
    int sel_bin;
};

// Which members a pass visits: the current set (keys ≥ floor), in coarse bins [bin_lo, bin_hi], whose rank
// (the key, or for the draw the inverted index) shares bits [top, 64) with prefix (top 64: any).
struct Filter {
    u64 floor;
    int bin_lo, bin_hi;
    bool by_index;
    int top;
    u64 prefix;

    __device__ u64 rank(u64 key) const { return by_index ? (key & 0xffffffffull) : key; }
};

struct Cut {
    u64 rank;         // the members ranked ≥ this reach the target
    u64 count, mass;  // of those members
};

// What a pass does with the members it visits: the pool's histogram and copies; copies; the bounds of their
// ranks; the histogram of one digit of their ranks.
enum Action { kPool, kCopy, kBounds, kDigits };

template <int C>
struct Sampler {
    Shared<C>& sh;
    const float* row;
    int vocab, capacity, share_lo, share_hi;
    bool vec4;
    unsigned rank;
    int bins;  // coarse bins in use: 2048 / C, fewer for small vocabularies (the same in every block)
    float lmax, temperature, scale;
    unsigned lowest;  // monotone bits of lmax − 30·T: no pool member is below
    u64 floor;
    unsigned* count;  // the cluster's coarse histogram of the current set (pool ∩ keys ≥ floor)
    u64* mass;
    u64* held_key;  // member copies: this thread's at threadIdx.x + j·blockDim.x, j < mine
    float* held_mass;
    int mine, longest;     // longest: the block's largest `mine`
    int held_lo, held_hi;  // the copies hold every member of the current set in coarse bins [held_lo, held_hi]
    int buf;               // the digit histogram the next radix round fills
    bool overflowed;       // this warp saw the copies overflow

    __device__ int coarse_bin(float logit) const {
        const float x = (lmax - logit) * scale;  // monotone in the logit: bins follow the key order
        return x < static_cast<float>(bins) ? max(0, __float2int_rz(x)) : bins - 1;
    }

    __device__ bool admits(const Filter& f, u64 key) const {
        if (key < f.floor || (f.top < 64 && (f.rank(key) >> f.top) != (f.prefix >> f.top))) return false;
        if (f.bin_lo == 0 && f.bin_hi == bins - 1) return true;
        const int b = coarse_bin(logit_of(key));
        return f.bin_lo <= b && b <= f.bin_hi;
    }

    // visit(valid, index, logit) over [lo, hi), warps in step (warp-uniform trip counts). Each thread keeps
    // kLoads loads in flight in a queue it shifts by one per step, so the visitor is inlined once per element.
    template <int kLoads, class Visit>
    __device__ void for_row(int lo, int hi, const Visit& visit) const {
        const int threads = blockDim.x, warp_first = threadIdx.x & ~31u;
        if (vec4) {
            const float4* groups = reinterpret_cast<const float4*>(row);
            const int g_lo = lo >> 2, g_hi = (hi + 3) >> 2;
            const auto load = [&](int g) { return g < g_hi ? groups[g] : make_float4(0.f, 0.f, 0.f, 0.f); };
            float4 queue[kLoads];
#pragma unroll
            for (int u = 0; u < kLoads; ++u) queue[u] = load(g_lo + u * threads + threadIdx.x);
#pragma unroll 1
            for (int g0 = g_lo; g0 + warp_first < g_hi; g0 += threads) {
                const int g = g0 + threadIdx.x, i = 4 * g;
                const float x[4] = {queue[0].x, queue[0].y, queue[0].z, queue[0].w};
#pragma unroll
                for (int u = 0; u + 1 < kLoads; ++u) queue[u] = queue[u + 1];
                queue[kLoads - 1] = load(g + kLoads * threads);
#pragma unroll
                for (int c = 0; c < 4; ++c) visit(g < g_hi && i + c >= lo && i + c < hi, i + c, x[c]);
            }
        } else {
            const auto load = [&](int i) { return i < hi ? row[i] : 0.f; };
            float queue[kLoads];
#pragma unroll
            for (int u = 0; u < kLoads; ++u) queue[u] = load(lo + u * threads + threadIdx.x);
#pragma unroll 1
            for (int i0 = lo; i0 + warp_first < hi; i0 += threads) {
                const int i = i0 + threadIdx.x;
                const float x = queue[0];
#pragma unroll
                for (int u = 0; u + 1 < kLoads; ++u) queue[u] = queue[u + 1];
                queue[kLoads - 1] = load(i + kLoads * threads);
                visit(i < hi, i, x);
            }
        }
    }

    // Lanes with `member` add (key, scaled mass) to the copies. Past the capacity the counter only has to
    // show the overflow: a warp that has seen it stops adding.
    __device__ void append(bool member, u64 key, float scaled) {
        const unsigned lanes = __ballot_sync(kAll, member && !overflowed);
        if (!lanes) return;
        const int lane = threadIdx.x & 31, leader = __ffs(lanes) - 1;
        unsigned base = 0;
        if (lane == leader) base = atomicAdd(&sh.n, static_cast<unsigned>(__popc(lanes)));
        base = __shfl_sync(kAll, base, leader);
        const unsigned slot = base + __popc(lanes & ((1u << lane) - 1));
        if (member && slot < static_cast<unsigned>(capacity)) held_key[slot] = key, held_mass[slot] = scaled;
        overflowed = base >= static_cast<unsigned>(capacity);
    }

    // `action` over this block's members that f admits: the copies (held), else the pool members of the
    // share's indices [lo, hi). Digits: bits [shift, shift + width) of the rank. Returns kBounds' bounds.
    __device__ Pair pass(Action action, bool held, const Filter& f, int lo, int hi, int shift, int width) {
        Pair bounds{0, 0};  // the largest rank, the complement of the smallest
        unsigned* hist_count = action == kPool ? sh.bin_count : sh.digit_count[buf];
        u64* hist_mass = action == kPool ? sh.bin_mass : sh.digit_mass[buf];
        const auto visit = [&](bool member, u64 key, float scaled) {
            if (action == kBounds) {
                if (member) bounds.a = max(bounds.a, f.rank(key)), bounds.b = max(bounds.b, ~f.rank(key));
                return;
            }
            if (action != kCopy) {
                const int bin = action == kPool ? coarse_bin(logit_of(key))
                                                : static_cast<int>(f.rank(key) >> shift) & ((1 << width) - 1);
                hist_add(hist_count, hist_mass, bin, mass_of(scaled), member);
            }
            if (action == kPool || action == kCopy) append(member, key, scaled);
        };
        if (action == kPool || action == kCopy) {
            if (threadIdx.x == 0) sh.n = 0;
            overflowed = false;
            __syncthreads();
        }
        if (held) {
            for (int j = 0; j < longest; ++j) {
                const int at = threadIdx.x + j * blockDim.x;
                const u64 key = j < mine ? held_key[at] : 0;
                const bool member = j < mine && admits(f, key);
                visit(member, key, member ? held_mass[at] : 0.f);
            }
        } else {
            for_row<kMemberLoads>(max(lo, share_lo), min(hi, share_hi), [&](bool valid, int i, float logit) {
                const u64 key = sort_key(logit, i);
                const bool maybe = valid && static_cast<unsigned>(key >> 32) >= lowest && admits(f, key);
                if (!__any_sync(kAll, maybe)) return;
                const float scaled = maybe ? scaled_mass(logit, lmax, temperature) : 0.f;
                visit(maybe && mass_of(scaled) > 0, key, scaled);
            });
        }
        if (action == kPool || action == kCopy) {
            __syncthreads();
            const int n = static_cast<int>(sh.n), t = threadIdx.x, threads = blockDim.x;
            mine = n > t ? (n - t - 1) / threads + 1 : 0;
            longest = (n + threads - 1) / threads;
            held_lo = f.bin_lo, held_hi = f.bin_hi;
        }
        return bounds;
    }

    // Drops the copies outside the current set or above coarse bin hi_bin; each thread moves only its own.
    __device__ void shrink(int hi_bin) {
        int kept = 0;
        for (int j = 0; j < mine; ++j) {
            const int at = threadIdx.x + j * blockDim.x;
            const u64 key = held_key[at];
            if (key >= floor && coarse_bin(logit_of(key)) <= hi_bin) {
                const int to = threadIdx.x + kept * blockDim.x;
                held_key[to] = key, held_mass[to] = held_mass[at];
                ++kept;
            }
        }
        mine = kept;
        longest = static_cast<int>(block_max(Pair{static_cast<u64>(kept), 0}, sh.part).a);
        held_hi = hi_bin;
    }

    // The largest rank K such that the members f admits with ranks ≥ K weigh at least target (by count or
    // mass), over the cluster. The draw ranks by index instead, the target coming from the masses of the
    // blocks' shares: the block whose share holds it finishes alone and writes the token.
    __device__ Cut radix(bool held, Filter f, u64 target, bool by_mass, bool draw, int* out, int argmax,
                         u64 seed, u64 step) {
        u64 rank_max = 0xffffffffull - static_cast<u64>(share_lo);
        u64 rank_min = share_hi > share_lo ? 0xffffffffull - static_cast<u64>(share_hi - 1) : rank_max;
        int top = 64;
        u64 prefix = 0, above_count = 0, above_mass = 0;
        for (int round = draw ? 0 : -1;; ++round) {
            if (round == 0) {  // bits [top, 64) are common to all members
                top = 64 - __clzll(rank_max ^ rank_min);
                prefix = top == 64 ? 0 : rank_max & ~((1ull << top) - 1);
            }
            const int width = min(8, top), shift = top - width;
            unsigned* dc = sh.digit_count[buf];
            u64* dm = sh.digit_mass[buf];
            if (round >= 0) {
                for (int d = threadIdx.x; d < kDigitBins; d += blockDim.x) dc[d] = 0, dm[d] = 0;
                __syncthreads();
            }
            f.top = top, f.prefix = prefix;
            int lo = 0, hi = vocab;
            if (f.by_index && top < 64) {  // ranks prefix … prefix + 2^top − 1 are indices 0xffffffff − rank
                lo = static_cast<int>(min(static_cast<u64>(vocab), 0xffffffffull - (prefix | ((1ull << top) - 1))));
                hi = static_cast<int>(min(static_cast<u64>(vocab), 0xffffffffull - prefix + 1));
            }
            Pair b = pass(round < 0 ? kBounds : kDigits, held, f, lo, hi, shift, width);
            if (round < 0) {
                b = block_max(b, sh.part);
                if (threadIdx.x == 0) sh.rank_max = b.a, sh.rank_low = b.b;
                row_sync<C>();
                for (int r = 0; r < C; ++r)
                    b.a = max(b.a, *peer<C>(&sh.rank_max, r)), b.b = max(b.b, *peer<C>(&sh.rank_low, r));
                rank_max = b.a, rank_min = ~b.b;
                continue;
            }
            if (draw) __syncthreads(); else row_sync<C>();
            if (draw && round == 0) {
                // This block's mass: the draw's u picks the block, which alone goes on.
                if (threadIdx.x < 32) {
                    u64 z = 0;
                    for (int d = threadIdx.x; d < kDigitBins; d += 32) z += dm[d];
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(kAll, z, o);
                    if (threadIdx.x == 0) sh.z = z;
                }
                row_sync<C>();
                u64 before = 0, total = 0;
                for (int r = 0; r < C; ++r) {
                    const u64 zr = *peer<C>(&sh.z, r);
                    before += r < static_cast<int>(rank) ? zr : 0;
                    total += zr;
                }
                const u64 z = sh.z;
                row_sync<C>();  // no block leaves while another may read its shared memory
                if (total == 0) {  // no finite mass (NaN or all −inf logits): the first maximum
                    if (rank == 0 && threadIdx.x == 0) *out = argmax;
                    return Cut{0, 0, 0};
                }
                const uint4 r = philox4x32_10(
                        make_uint4(static_cast<unsigned>(step), static_cast<unsigned>(step >> 32), 0x53414d50u, 0),
                        make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32)));
                const u64 u = __umul64hi((static_cast<u64>(r.x) << 32) | r.y, total);  // uniform in [0, total)
                if (u < before || u - before >= z) return Cut{0, 0, 0};
                target = u - before + 1;  // the token where the running mass in index order passes u
            }
            if (threadIdx.x < 32) {
                // Lane L holds digits 255−8L … 248−8L, highest first: the crossing digit in one warp scan.
                const int lane = threadIdx.x, r0 = draw ? static_cast<int>(rank) : 0, r1 = draw ? r0 + 1 : C;
                Pair group{0, 0};
                for (int j = 0; j < 8; ++j)
                    for (int r = r0; r < r1; ++r)
                        group.a += peer<C>(dc, r)[255 - 8 * lane - j], group.b += peer<C>(dm, r)[255 - 8 * lane - j];
                const Pair incl = warp_scan(group);
                Pair cum{incl.a - group.a, incl.b - group.b};
                const u64 w = by_mass ? cum.b : cum.a, g = by_mass ? group.b : group.a;
                if (w < target && target <= w + g) {
                    for (int d = 255 - 8 * lane;; --d) {
                        Pair here{0, 0};
                        for (int r = r0; r < r1; ++r) here.a += peer<C>(dc, r)[d], here.b += peer<C>(dm, r)[d];
                        if ((by_mass ? cum.b + here.b : cum.a + here.a) >= target) {
                            sh.sel_bin = d, sh.sel_count = here.a, sh.sel_mass = here.b;
                            sh.sel_above_count = cum.a, sh.sel_above_mass = cum.b;
                            break;
                        }
                        cum.a += here.a, cum.b += here.b;
                    }
                }
            }
            __syncthreads();
            const u64 n = sh.sel_count, m = sh.sel_mass;
            above_count += sh.sel_above_count, above_mass += sh.sel_above_mass;
            target -= by_mass ? sh.sel_above_mass : sh.sel_above_count;
            prefix |= static_cast<u64>(sh.sel_bin) << shift;
            top = shift;
            buf ^= 1;
            if (top == 0 || (!draw && n == 1)) {
                if (draw && threadIdx.x == 0) *out = static_cast<int>(0xffffffffu - static_cast<unsigned>(prefix));
                return Cut{prefix, above_count + n, above_mass + m};
            }
        }
    }

    // (count, mass) of the current set, from the coarse histogram.
    __device__ Pair totals() {
        Pair mine_sum{0, 0}, total;
        for (int b = threadIdx.x; b < bins; b += blockDim.x) mine_sum.a += count[b], mine_sum.b += mass[b];
        block_scan(mine_sum, sh.part, &total);
        return total;
    }

    // Top-k (phase 0), top-p on what it leaves (1), then the draw (2). A cut finds the coarse bin where its
    // target falls, makes sure the bin's members are copied if they fit, and radix selects among them.
    __device__ void cut_and_draw(int* out, int argmax, int k, float p, u64 seed, u64 step) {
        for (int phase = 0; phase < 3; ++phase) {
            const Pair set = totals();
            u64 target = 0;
            if (phase == 0) {
                if (!(k > 0 && k < vocab && set.a > static_cast<u64>(k))) continue;
                target = static_cast<u64>(k);
            } else if (phase == 1) {
                if (!(p < 1.f) || set.b == 0) continue;
                target = max(1ull, static_cast<u64>(ceil(static_cast<double>(p) * set.b)));
            }
            const bool by_mass = phase > 0;
            int need_lo = 0, need_hi = 0;  // the coarse bins whose members the radix select visits
            u64 need_count = set.a, copy_count = set.a;
            if (phase < 2) {
                const int per = (bins + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
                Pair group{0, 0}, total;
                for (int b = first; b < min(bins, first + per); ++b) group.a += count[b], group.b += mass[b];
                const Pair incl = block_scan(group, sh.part, &total);
                Pair cum{incl.a - group.a, incl.b - group.b};
                const u64 w = by_mass ? cum.b : cum.a, g = by_mass ? group.b : group.a;
                if (w < target && target <= w + g) {
                    for (int b = first;; ++b) {
                        if ((by_mass ? cum.b + mass[b] : cum.a + count[b]) >= target) {
                            sh.sel_bin = b, sh.sel_above_count = cum.a, sh.sel_above_mass = cum.b;
                            break;
                        }
                        cum.a += count[b], cum.b += mass[b];
                    }
                }
                __syncthreads();
                need_lo = need_hi = sh.sel_bin;
                need_count = count[need_hi], copy_count = sh.sel_above_count + need_count;
                target -= by_mass ? sh.sel_above_mass : sh.sel_above_count;
                __syncthreads();
                if (held_lo <= need_lo && need_hi < held_hi) shrink(need_hi);
            } else {
                Pair deepest{0, 0};  // 1 + the last coarse bin with members
                for (int b = threadIdx.x; b < bins; b += blockDim.x)
                    if (count[b]) deepest.a = max(deepest.a, static_cast<u64>(b + 1));
                need_hi = max(0, static_cast<int>(block_max(deepest, sh.part).a) - 1);
            }
            if (!(held_lo <= need_lo && need_hi <= held_hi) && need_count <= static_cast<u64>(capacity)) {
                // Copies from the first bin serve the later phases too, where they fit.
                const int from = copy_count <= static_cast<u64>(capacity) ? 0 : need_lo;
                pass(kCopy, false, Filter{floor, from, need_hi, false, 64, 0}, 0, vocab, 0, 0);
            }
            const bool held = held_lo <= need_lo && need_hi <= held_hi;
            const Filter f{floor, phase < 2 ? need_lo : 0, phase < 2 ? need_hi : bins - 1, phase == 2, 64, 0};
            const Cut cut = radix(held, f, target, by_mass, phase == 2, out, argmax, seed, step);
            if (phase == 2) return;
            floor = max(floor, cut.rank);
            for (int b = need_hi + threadIdx.x; b < bins; b += blockDim.x) {
                count[b] = b == need_hi ? static_cast<unsigned>(cut.count) : 0u;
                mass[b] = b == need_hi ? cut.mass : 0ull;
            }
            __syncthreads();
        }
    }
};

// out[row] = the sampled token of logits[row, :vocab]. temperature 0 (or top_k 1) is greedy: the first maximum.
// top_k 0 means no cut, top_p ≥ 1 likewise. Grid: C blocks per row (a cluster); blockDim.x a multiple of 32,
// ≤ 512; dynamic shared memory: `capacity` member copies (key and scaled mass, 12 bytes each).
template <int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(512, 1) sample_tokens(
        int* out, const float* logits, int vocab, const float* temperature, const int* top_k, const float* top_p,
        const u64* seed, const u64* step, int capacity) {
    __shared__ Shared<C> sh;
    extern __shared__ __align__(16) unsigned char held_memory[];
    const int row = blockIdx.x / C;
    Sampler<C> s{sh, logits + static_cast<size_t>(row) * vocab, vocab, capacity};
    s.rank = cluster_rank();
    s.vec4 = vocab % 4 == 0 && aligned16(logits);
    const int unit = s.vec4 ? 4 : 1, per = ((vocab + unit - 1) / unit + C - 1) / C * unit;
    s.share_lo = min(vocab, static_cast<int>(s.rank) * per), s.share_hi = min(vocab, s.share_lo + per);

    Pair top{0, 0};  // the largest key, the complement of the smallest monotone bits
    s.template for_row<kMaxLoads>(s.share_lo, s.share_hi, [&](bool valid, int i, float logit) {
        if (valid) top.a = max(top.a, sort_key(logit, i)), top.b = max(top.b, static_cast<u64>(~monotone_bits(logit)));
    });
    top = block_max(top, sh.part);
    if (threadIdx.x == 0) sh.best = top.a, sh.low = top.b;
    row_sync<C>();
    for (int r = 0; r < C; ++r) top.a = max(top.a, *peer<C>(&sh.best, r)), top.b = max(top.b, *peer<C>(&sh.low, r));
    const int argmax = static_cast<int>(0xffffffffu - static_cast<unsigned>(top.a));
    const float t = temperature[row], p = top_p[row];
    const int k = top_k[row];
    if (!(t > 0.f) || k == 1) {
        if (s.rank == 0 && threadIdx.x == 0) out[row] = argmax;
        row_sync<C>();  // no block leaves while another may read its `best`
        return;
    }

    s.lmax = s.row[argmax], s.temperature = t;
    s.bins = min(Shared<C>::kBins, (vocab + 31) / 32 * 32);
    s.lowest = monotone_bits(__fmaf_rn(t, -kPoolLogitSpan, s.lmax));
    const float range = s.lmax - logit_of(static_cast<u64>(max(~static_cast<unsigned>(top.b), s.lowest)) << 32);
    s.scale = range > 0.f ? fminf(s.bins / range, 1e38f) : 0.f;  // the pool's logits over the bins
    s.floor = 0, s.buf = 0, s.mine = 0, s.longest = 0;
    s.held_key = reinterpret_cast<u64*>(held_memory);
    s.held_mass = reinterpret_cast<float*>(s.held_key + capacity);
    s.count = sh.bin_count, s.mass = sh.bin_mass;
    for (int b = threadIdx.x; b < s.bins; b += blockDim.x) sh.bin_count[b] = 0, sh.bin_mass[b] = 0;
    s.pass(kPool, false, Filter{0, 0, s.bins - 1, false, 64, 0}, 0, vocab, 0, 0);
    if (threadIdx.x == 0) sh.pool_n = sh.n;  // sh.n changes with later copies while peers may still read this
    row_sync<C>();
    if constexpr (C > 1) {
        for (int b = threadIdx.x; b < s.bins; b += blockDim.x) {
            unsigned n = 0;
            u64 m = 0;
            for (int r = 0; r < C; ++r) n += peer<C>(sh.bin_count, r)[b], m += peer<C>(sh.bin_mass, r)[b];
            sh.merged_count[b] = n, sh.merged_mass[b] = m;
        }
        s.count = sh.merged_count, s.mass = sh.merged_mass;
    }
    bool copied = true;  // pass B copied every pool member, in every block
    for (int r = 0; r < C; ++r) copied = copied && *peer<C>(&sh.pool_n, r) <= static_cast<unsigned>(capacity);
    if (!copied) s.held_lo = 1, s.held_hi = 0;
    __syncthreads();
    s.cut_and_draw(out + row, argmax, k, p, seed[row], step[row]);
}
