// dsv4rt-instantiate: moe_route moe_sort swiglu<float> swiglu<__nv_bfloat16>
// dsv4rt-instantiate: moe_combine<float> moe_combine<__nv_bfloat16>
// dsv4rt-instantiate: moe_gemm<float,64,true> moe_gemm<float,64,false>
// dsv4rt-instantiate: moe_gemm<__nv_bfloat16,64,true> moe_gemm<__nv_bfloat16,64,false>
// dsv4rt-instantiate: moe_skinny<float,true> moe_skinny<float,false>
// dsv4rt-instantiate: moe_skinny<__nv_bfloat16,true> moe_skinny<__nv_bfloat16,false>
#include "common.cuh"
#include "moe.cuh"

// Mixture of experts (docs/model.md#moe) without host synchronisation: routing, a counting sort of
// the (token, slot) pairs by expert, grouped GEMMs over the sorted rows (the routing weight scales the SwiGLU
// output before w2, the official order), a sum of each token's rows.
constexpr int kMaxExperts = 384;
constexpr int kMaxActive = 8;
constexpr float kLowest = -3.402823466e38f;  // below every real score

// As np.logaddexp(0, x).
__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }

// One warp per token. s = sqrt(softplus(logit)); hash layers take the experts from tid2eid[ids[t]],
// routed layers the top `active` of s + bias (lowest index first among equals); the weights are
// s / (sum + 1e-20) · scaling over the chosen experts, in slot order.
__global__ void __launch_bounds__(256) moe_route(int* idx, float* weight, const float* logits, const float* bias,
                                                 const int* tid2eid, const int* ids, int tokens, int experts,
                                                 int active, float scaling) {
    constexpr int kPerLane = kMaxExperts / 32;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= tokens) return;
    const float* row = logits + static_cast<size_t>(t) * experts;
    int mine_e = 0;     // lane j < active holds slot j
    float mine_s = 0.f;
    if (tid2eid) {
        if (lane < active) {
            mine_e = tid2eid[static_cast<size_t>(ids[t]) * active + lane];
            mine_s = sqrtf(softplus(row[mine_e]));
        }
    } else {
        // NaN scores rank lowest and chosen ones below them, so `active` distinct experts always come out.
        const float taken = -__int_as_float(0x7f800000);
        float s[kPerLane], key[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int e = lane + 32 * j;
            s[j] = e < experts ? sqrtf(softplus(row[e])) : 0.f;
            key[j] = e >= experts ? taken : isnan(s[j] + bias[e]) ? kLowest : s[j] + bias[e];
        }
        for (int slot = 0; slot < active; ++slot) {
            float best = taken;
            int best_e = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j)
                if (key[j] > best) best = key[j], best_e = lane + 32 * j;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o);
                const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
                if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
            }
            float chosen = 0.f;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j)
                if (lane + 32 * j == best_e) chosen = s[j], key[j] = taken;
            chosen = __shfl_sync(0xffffffffu, chosen, best_e & 31);
            if (lane == slot) mine_e = best_e, mine_s = chosen;
        }
    }
    float sum = 0.f;
    for (int j = 0; j < active; ++j) sum += __shfl_sync(0xffffffffu, mine_s, j);
    if (lane < active) {
        idx[static_cast<size_t>(t) * active + lane] = mine_e;
        weight[static_cast<size_t>(t) * active + lane] = mine_s / (sum + 1e-20f) * scaling;
    }
}

// Exclusive prefix sums of per-expert counts (and of their row tiles) by warp 0; offsets[experts]
// is the total. Each lane takes a contiguous run of experts.
__device__ void scan_experts(const int* count, int experts, int tile_rows, int* offsets, int* tile_offsets,
                             int* s_offsets) {
    constexpr int kPerLane = (kMaxExperts + 1 + 31) / 32;
    const int lane = threadIdx.x;
    int rows = 0, tiles = 0;
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane * kPerLane + j;
        if (e < experts) rows += count[e], tiles += (count[e] + tile_rows - 1) / tile_rows;
    }
    int rows_incl = rows, tiles_incl = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int r = __shfl_up_sync(0xffffffffu, rows_incl, o), q = __shfl_up_sync(0xffffffffu, tiles_incl, o);
        if (lane >= o) rows_incl += r, tiles_incl += q;
    }
    rows = rows_incl - rows, tiles = tiles_incl - tiles;
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane * kPerLane + j;
        if (e <= experts) {
            offsets[e] = s_offsets[e] = rows;
            tile_offsets[e] = tiles;
        }
        if (e < experts) rows += count[e], tiles += (count[e] + tile_rows - 1) / tile_rows;
    }
}

// Counting sort of the pairs p = t·active + slot by expert, in one block: rows of expert e are
// offsets[e] .. offsets[e+1]; perm[row] = p and pos[p] = row. Within an expert the order follows the
// shared-memory atomics, which changes no value: every row of a grouped GEMM is computed alike.
__global__ void __launch_bounds__(1024) moe_sort(int* offsets, int* tile_offsets, int* perm, int* pos,
                                                 const int* idx, int pairs, int experts, int tile_rows) {
    __shared__ int count[kMaxExperts + 1];
    __shared__ int start[kMaxExperts + 1];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) pos[p] = atomicAdd(&count[idx[p]], 1);
    __syncthreads();
    if (threadIdx.x < 32) scan_experts(count, experts, tile_rows, offsets, tile_offsets, start);
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int row = start[idx[p]] + pos[p];
        pos[p] = row;
        perm[row] = p;
    }
}

constexpr int kTileN = 64, kTileK = 32, kGemmThreads = 256;

// Loads of one k-tile, 16 bytes per vector, held in registers while the previous tile is computed.
template <typename T, int ROWS>
struct TileLoader {
    static constexpr int kPerRow = kTileK / kVec<T>;
    static constexpr int kVectors = ROWS * kPerRow;
    static constexpr int kPerThread = (kVectors + kGemmThreads - 1) / kGemmThreads;
    const T* row_ptr[kPerThread];
    uint4 regs[kPerThread];

    __device__ void load(int k0, int k) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int v = threadIdx.x + i * kGemmThreads, kk = k0 + (v % kPerRow) * kVec<T>;
            regs[i] = make_uint4(0, 0, 0, 0);
            if (v < kVectors && row_ptr[i] && kk < k) regs[i] = *reinterpret_cast<const uint4*>(row_ptr[i] + kk);
        }
    }

    // Transposed into smem[k][row] (row stride ROWS + 1: the padding spreads the stores over banks).
    __device__ void store(float* smem) const {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int v = threadIdx.x + i * kGemmThreads;
            if (v >= kVectors) continue;
            const T* e = reinterpret_cast<const T*>(&regs[i]);
#pragma unroll
            for (int j = 0; j < kVec<T>; ++j)
                smem[((v % kPerRow) * kVec<T> + j) * (ROWS + 1) + v / kPerRow] = to_float(e[j]);
        }
    }
};

// Grouped GEMM over the expert-sorted rows: out[r, n] = a_row(r) · W_e[n]ᵀ for the rows r of expert e.
// blockIdx.y is a row tile of BM rows counted over all experts (tile_offsets from moe_sort; tiles past
// the total return at once), blockIdx.x a tile of 64 columns. a_row(r) is a[perm[r] / active] when
// perm is given (tokens gathered on the fly), else a[r]. GATED: two weights (w1, w3) and the clamped
// SwiGLU silu(min(g, L)) · clamp(u, −L, L) times the pair's routing weight[perm[r]] on the way out. 16x16
// threads, each BM/16 rows × 4 columns, fp32 accumulation in registers. k must be a multiple of 8 and rows
// 16-byte aligned.
template <typename T, int BM, bool GATED>
__global__ void __launch_bounds__(kGemmThreads) moe_gemm(T* out, const T* a, const int* perm, int active,
                                                         const float* weight, const unsigned long long* w_first,
                                                         const unsigned long long* w_second, const int* offsets,
                                                         const int* tile_offsets, int experts, int n, int k,
                                                         float limit) {
    constexpr int RM = BM / 16;
    __shared__ float sa[kTileK * (BM + 1)];
    __shared__ float sb[GATED ? 2 : 1][kTileK * (kTileN + 1)];
    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * BM, row_end = offsets[e + 1];
    const int col0 = blockIdx.x * kTileN;

    TileLoader<T, BM> la;
    TileLoader<T, kTileN> lb[GATED ? 2 : 1];
#pragma unroll
    for (int i = 0; i < la.kPerThread; ++i) {
        const int r = row0 + (threadIdx.x + i * kGemmThreads) / la.kPerRow;
        la.row_ptr[i] = r < row_end ? a + static_cast<size_t>(perm ? perm[r] / active : r) * k : nullptr;
    }
#pragma unroll
    for (int g = 0; g < (GATED ? 2 : 1); ++g) {
        const T* w = reinterpret_cast<const T*>((g ? w_second : w_first)[e]);
#pragma unroll
        for (int i = 0; i < lb[g].kPerThread; ++i) {
            const int c = col0 + (threadIdx.x + i * kGemmThreads) / lb[g].kPerRow;
            lb[g].row_ptr[i] = c < n ? w + static_cast<size_t>(c) * k : nullptr;
        }
    }

    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[GATED ? 2 : 1][RM][4] = {};
    la.load(0, k);
#pragma unroll
    for (int g = 0; g < (GATED ? 2 : 1); ++g) lb[g].load(0, k);
    for (int k0 = 0; k0 < k; k0 += kTileK) {
        la.store(sa);
#pragma unroll
        for (int g = 0; g < (GATED ? 2 : 1); ++g) lb[g].store(sb[g]);
        __syncthreads();
        if (k0 + kTileK < k) {
            la.load(k0 + kTileK, k);
#pragma unroll
            for (int g = 0; g < (GATED ? 2 : 1); ++g) lb[g].load(k0 + kTileK, k);
        }
#pragma unroll 8
        for (int kk = 0; kk < kTileK; ++kk) {
            float av[RM];
#pragma unroll
            for (int r = 0; r < RM; ++r) av[r] = sa[kk * (BM + 1) + ty + 16 * r];
#pragma unroll
            for (int g = 0; g < (GATED ? 2 : 1); ++g)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float bv = sb[g][kk * (kTileN + 1) + tx + 16 * c];
#pragma unroll
                    for (int r = 0; r < RM; ++r) acc[g][r][c] = fmaf(av[r], bv, acc[g][r][c]);
                }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const int row = row0 + ty + 16 * r;
        if (row >= row_end) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int col = col0 + tx + 16 * c;
            if (col >= n) continue;
            float v = acc[0][r][c];
            if constexpr (GATED) {
                const float g = fminf(v, limit), u = fminf(fmaxf(acc[1][r][c], -limit), limit);
                v = g * sigmoid(g) * u * weight[perm[row]];
            }
            out[static_cast<size_t>(row) * n + col] = from_float<T>(v);
        }
    }
}

// The decode path of the grouped GEMM, for row tiles of at most kSkinnyRows rows: it streams each weight
// row once per tile at close to memory bandwidth. A warp takes kSkinnyW weight rows (GATED: two columns of
// w1 and w3, else four columns) over all of k, 16-byte loads that bypass L1; the tile's activation rows come
// through L1, which every warp of the block reads alike; fp32 accumulation, warp-shuffle sums.
constexpr int kSkinnyRows = 8, kSkinnyWarps = 4, kSkinnyW = 4, kSkinnySteps = 2;

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[kVec<T>]) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec<T>; ++i) v[i] = to_float(e[i]);
}

// One tile of RR ≥ rows rows against the warp's weight rows w: out[row0 + r, col0 + c] for r < rows. Row r of
// the tile is a[(gather ? gather[row0 + r] / active : row0 + r)]; rows from `rows` to RR repeat a valid one and
// are never stored. Weight columns past n likewise. GATED rows that are gathered (routed pairs) are scaled by
// their routing weight[gather[row]].
template <typename T, int RR, bool GATED>
__device__ __forceinline__ void skinny_tile(T* out, float* out_f32, const T* a, const int* gather, int active,
                                            const float* weight, int row0, int rows, const T* const (&w)[kSkinnyW],
                                            int col0, int n, int k, float limit) {
    constexpr int V = kVec<T>, STEP = 32 * V, COLS = GATED ? kSkinnyW / 2 : kSkinnyW;
    constexpr int STEPS = RR >= 8 ? 1 : kSkinnySteps;  // loads in flight, within the registers of 3 blocks an SM
    const int lane = threadIdx.x & 31;
    int arow[RR];  // element offsets into a (32 bits: decode-sized a, and registers for 8 rows)
    float scale[RR];  // loaded before the weight stream so that the epilogue does not wait on it
#pragma unroll
    for (int r = 0; r < RR; ++r) {
        const int row = row0 + min(r, rows - 1);
        arow[r] = (gather ? gather[row] / active : row) * k;
        scale[r] = GATED && gather ? weight[gather[row]] : 1.f;
    }
    float acc[RR][kSkinnyW] = {};
    for (int k0 = lane * V; k0 < k; k0 += STEPS * STEP) {
        uint4 wv[STEPS][kSkinnyW];
#pragma unroll
        for (int s = 0; s < STEPS; ++s)
#pragma unroll
            for (int c = 0; c < kSkinnyW; ++c)
                wv[s][c] = k0 + s * STEP < k ? load_stream(w[c] + k0 + s * STEP) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            const int kk = k0 + s * STEP;
            if (kk >= k) break;
            float wf[kSkinnyW][V];
#pragma unroll
            for (int c = 0; c < kSkinnyW; ++c) unpack<T>(wv[s][c], wf[c]);
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                float xf[V];
                unpack<T>(__ldg(reinterpret_cast<const uint4*>(a + arow[r] + kk)), xf);
#pragma unroll
                for (int c = 0; c < kSkinnyW; ++c)
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[r][c] = fmaf(xf[j], wf[c][j], acc[r][c]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RR; ++r) {
        if (r >= rows) break;
        const size_t at = static_cast<size_t>(row0 + r) * n;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            float v = warp_sum(acc[r][c]);
            if constexpr (GATED) {
                const float u = fminf(fmaxf(warp_sum(acc[r][c + COLS]), -limit), limit), g = fminf(v, limit);
                v = g * sigmoid(g) * u * scale[r];
            }
            if (lane != (r * COLS + c) % 32 || col0 + c >= n) continue;
            if (out_f32) out_f32[at + col0 + c] = v;
            else out[at + col0 + c] = from_float<T>(v);
        }
    }
}

// As moe_gemm with kSkinnyRows-row tiles (blockIdx.y < routed_tiles), blockIdx.x a run of
// kSkinnyWarps · (kSkinnyW / (GATED ? 2 : 1)) columns. The shared expert rides along when shared_rows > 0:
// tile routed_tiles + i holds its rows 8i.. of shared_a [shared_rows, k] against shared_first (and
// shared_second), written to shared_out in T, or in fp32 when not GATED (its down projection, which the
// combine adds in fp32). k must be a multiple of 8 and rows 16-byte aligned.
template <typename T, bool GATED>
__global__ void __launch_bounds__(32 * kSkinnyWarps, 3)
    moe_skinny(T* out, const T* a, const int* perm, int active, const float* weight,
               const unsigned long long* w_first, const unsigned long long* w_second, const int* offsets,
               const int* tile_offsets, int experts, int routed_tiles, void* shared_out, const T* shared_a,
               const T* shared_first, const T* shared_second, int shared_rows, int n, int k, float limit) {
    constexpr int COLS = GATED ? kSkinnyW / 2 : kSkinnyW;
    const int tile = blockIdx.y;
    const bool shared = tile >= routed_tiles;
    int row0, rows, e = 0;
    if (shared) {
        row0 = (tile - routed_tiles) * kSkinnyRows;
        rows = min(kSkinnyRows, shared_rows - row0);
        out = GATED ? static_cast<T*>(shared_out) : nullptr;
        a = shared_a, perm = nullptr;
    } else {
        if (tile >= tile_offsets[experts]) return;
        e = tile_expert(tile_offsets, experts, tile);
        row0 = offsets[e] + (tile - tile_offsets[e]) * kSkinnyRows;
        rows = min(kSkinnyRows, offsets[e + 1] - row0);
    }
    float* out_f32 = shared && !GATED ? static_cast<float*>(shared_out) : nullptr;
    const int col0 = (blockIdx.x * kSkinnyWarps + (threadIdx.x >> 5)) * COLS;
    const T* w[kSkinnyW];
#pragma unroll
    for (int c = 0; c < kSkinnyW; ++c) {
        const bool second = GATED && c >= COLS;
        const T* base = shared ? (second ? shared_second : shared_first)
                               : reinterpret_cast<const T*>((second ? w_second : w_first)[e]);
        w[c] = base + static_cast<size_t>(min(col0 + c % COLS, n - 1)) * k;
    }
    if (rows == 1)
        skinny_tile<T, 1, GATED>(out, out_f32, a, perm, active, weight, row0, rows, w, col0, n, k, limit);
    else if (rows == 2)
        skinny_tile<T, 2, GATED>(out, out_f32, a, perm, active, weight, row0, rows, w, col0, n, k, limit);
    else if (rows <= 4)
        skinny_tile<T, 4, GATED>(out, out_f32, a, perm, active, weight, row0, rows, w, col0, n, k, limit);
    else
        skinny_tile<T, kSkinnyRows, GATED>(out, out_f32, a, perm, active, weight, row0, rows, w, col0, n, k, limit);
}

// h = silu(min(g, L)) · clamp(u, −L, L) over `count` elements of rows of `cols`. When weight is given, rows from
// `unweighted` on are routed pairs in expert order, scaled by their routing weight[perm[row − unweighted]].
template <typename T>
__global__ void __launch_bounds__(256) swiglu(T* h, const float* g, const float* u, long long count, float limit,
                                              const float* weight, const int* perm, int cols, int unweighted) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const float gi = fminf(g[i], limit), ui = fminf(fmaxf(u[i], -limit), limit);
        float v = gi * sigmoid(gi) * ui;
        if (weight) {
            const long long row = i / cols - unweighted;
            if (row >= 0) v *= weight[perm[row]];
        }
        h[i] = from_float<T>(v);
    }
}

// y[t] = shared[t] + Σ_slot expert_out[pos[t, slot]] (the rows carry their routing weights), one block per token,
// 16-byte vectors along dim (a multiple of 8). shared may be nullptr (no shared expert).
template <typename T>
__global__ void __launch_bounds__(256) moe_combine(T* y, const T* expert_out, const float* shared, const int* pos,
                                                   int active, int dim) {
    constexpr int V = kVec<T>;
    const int t = blockIdx.x;
    __shared__ int rows[kMaxActive];
    if (threadIdx.x < active) rows[threadIdx.x] = pos[static_cast<size_t>(t) * active + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.x * V; i < dim; i += blockDim.x * V) {
        float acc[V], v[V];
        if (shared) {
            load_vec<float, V>(shared + static_cast<size_t>(t) * dim + i, acc);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = 0.f;
        }
        for (int s = 0; s < active; ++s) {
            load_vec<T, V>(expert_out + static_cast<size_t>(rows[s]) * dim + i, v);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += v[j];
        }
        store_vec<T, V>(y + static_cast<size_t>(t) * dim + i, acc);
    }
}
