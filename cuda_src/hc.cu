// dsv4rt-instantiate: hc_embed<float> hc_embed<__nv_bfloat16>
// dsv4rt-instantiate: hc_pre<float,2> hc_pre<float,4> hc_pre<__nv_bfloat16,2> hc_pre<__nv_bfloat16,4>
// dsv4rt-instantiate: hc_pre_split<float,2,1> hc_pre_split<float,4,1> hc_pre_split<float,2,4> hc_pre_split<float,4,4>
// dsv4rt-instantiate: hc_pre_split<__nv_bfloat16,2,1> hc_pre_split<__nv_bfloat16,4,1>
// dsv4rt-instantiate: hc_pre_split<__nv_bfloat16,2,4> hc_pre_split<__nv_bfloat16,4,4>
// dsv4rt-instantiate: hc_head<float,2> hc_head<float,4> hc_head<__nv_bfloat16,2> hc_head<__nv_bfloat16,4>
// dsv4rt-instantiate: hc_post<float,2> hc_post<float,4> hc_post<__nv_bfloat16,2> hc_post<__nv_bfloat16,4>
#include "common.cuh"

// Manifold-constrained hyper-connections (MODEL.md section 7) on streams X [T, HC, D].
// hc_pre and hc_head launch kHcThreads threads as (lanes, groups): each group of `lanes` threads
// splits the hc·D reduction of kHcTok tokens, so every fn value loaded feeds kHcTok tokens; fn
// (float32) stays in L2 across blocks. Groups of one warp share fn through shared memory instead.
constexpr int kHcThreads = 256;
constexpr int kHcTok = 4;
constexpr int kHcMaxTok = kHcTok * (kHcThreads / 32);
constexpr int kHcSplit = 8;  // blocks of a cluster in hc_pre_split (the portable maximum)

__device__ __forceinline__ float sigmoid(float x) { return 0.5f * (1.f + tanhf(0.5f * x)); }

// Thread block clusters (sm_90) in PTX: cooperative_groups' cluster API needs CCCL headers NVRTC lacks here.
__device__ __forceinline__ int cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return static_cast<int>(r);
}

// A barrier of every thread of the cluster that also orders their shared-memory writes before it, in two
// halves so that a block may work between announcing its writes and waiting for everyone else's.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

// The float at the address of `local` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float cluster_load(const float* local, int rank) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

template <int N>
__device__ __forceinline__ void load_f32(const float* p, float (&w)[N]) {
    if constexpr (N == 1) {
        w[0] = __ldg(p);
    } else {
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            const float4 q = __ldg(reinterpret_cast<const float4*>(p) + c);
            w[4 * c] = q.x, w[4 * c + 1] = q.y, w[4 * c + 2] = q.z, w[4 * c + 3] = q.w;
        }
    }
}

// N consecutive elements at k of each of the group's ntok ≤ NT tokens (rows of K) against the R rows of fn.
template <typename T, int R, int N, int NT>
__device__ __forceinline__ void project_chunk(const T* x, const float* fn, int k, int K, int ntok,
                                              float (&acc)[NT][R], float (&ss)[NT]) {
    float xv[NT][N];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < ntok) {
            if constexpr (N == 1) xv[t][0] = to_float(x[static_cast<size_t>(t) * K + k]);
            else load_vec(x + static_cast<size_t>(t) * K + k, xv[t]);
        } else {
#pragma unroll
            for (int e = 0; e < N; ++e) xv[t][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < N; ++e) ss[t] += xv[t][e] * xv[t][e];
    }
    // fn rows loaded ahead of their use: all R for one token (decode, paced by the loads in flight), else one
    // at a time (the registers hold NT tokens' accumulators).
    constexpr int AHEAD = NT == 1 ? R : 1;
#pragma unroll
    for (int r0 = 0; r0 < R; r0 += AHEAD) {
        float w[AHEAD][N];
#pragma unroll
        for (int r = 0; r < AHEAD; ++r) load_f32(fn + static_cast<size_t>(r0 + r) * K + k, w[r]);
#pragma unroll
        for (int r = 0; r < AHEAD; ++r)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int e = 0; e < N; ++e) acc[t][r0 + r] += xv[t][e] * w[r][e];
    }
}

// The raw bits of four consecutive T: one 16-byte (float) or 8-byte (bf16) load.
template <typename T> struct Raw4Of { using type = uint2; };
template <> struct Raw4Of<float> { using type = uint4; };
template <typename T> using Raw4 = typename Raw4Of<T>::type;

// The direct path above with fn staged through shared memory, for blocks of 8 one-warp groups: per tile of
// 128 columns every fn value loaded from L2 feeds the block's 32 tokens, and lane l reads float4 l of each
// tile row (conflict-free). The next tile's fn and x wait in registers while this one is multiplied.
// Four columns per lane rather than a 16-byte vector of T keeps bf16 within the registers.
// Every thread of the block must call it (barriers).
template <typename T, int R>
__device__ __forceinline__ void project_tiled(const T* x, const float* fn, int K, int ntok,
                                              float (&acc)[kHcTok][R], float (&ss)[kHcTok]) {
    constexpr int KT = 128, PER = (R * 32 + kHcThreads - 1) / kHcThreads;
    __shared__ float4 tile[R][32];
    const int lane = threadIdx.x, tid = threadIdx.y * 32 + lane;
    float4 fn_next[PER];
    Raw4<T> x_next[kHcTok];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int i = tid + p * kHcThreads, r = i / 32, k = k0 + 4 * (i % 32);
            if (i < R * 32) fn_next[p] = k < K ? __ldg(reinterpret_cast<const float4*>(fn + static_cast<size_t>(r) * K + k))
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        const int k = k0 + 4 * lane;
#pragma unroll
        for (int t = 0; t < kHcTok; ++t)
            x_next[t] = t < ntok && k < K ? *reinterpret_cast<const Raw4<T>*>(x + static_cast<size_t>(t) * K + k)
                                          : Raw4<T>{};
    };
    fetch(0);
    for (int k0 = 0; k0 < K; k0 += KT) {
        __syncthreads();
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int i = tid + p * kHcThreads;
            if (i < R * 32) tile[i / 32][i % 32] = fn_next[p];
        }
        float xv[kHcTok][4];
#pragma unroll
        for (int t = 0; t < kHcTok; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) xv[t][e] = to_float(reinterpret_cast<const T*>(&x_next[t])[e]);
        __syncthreads();
        if (k0 + KT < K) fetch(k0 + KT);
#pragma unroll
        for (int t = 0; t < kHcTok; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) ss[t] += xv[t][e] * xv[t][e];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float4 q = tile[r][lane];
            const float w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int t = 0; t < kHcTok; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[t][r] += xv[t][e] * w[e];
        }
    }
}

// Each token's R projection sums and its sum of squares, reduced over the warp into out[t][0..R] by lane 0.
template <int NT, int R>
__device__ __forceinline__ void store_warp_sums(float (*out)[R + 1], const float (&acc)[NT][R], const float (&ss)[NT]) {
    const bool lane0 = (threadIdx.x & 31) == 0;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float s = warp_sum(acc[t][r]);
            if (lane0) out[t][r] = s;
        }
        const float s = warp_sum(ss[t]);
        if (lane0) out[t][R] = s;
    }
}

// v[i][r] = n_i · (fn_r · x̂_i) for the block's tokens i < nb (starting at token t0), with
// n_i = rsqrt(mean(x̂_i²) + eps) over the flattened K = HC·D values. Ends with a barrier.
template <typename T, int R>
__device__ __forceinline__ void project(const T* x, const float* fn, int t0, int nb, int K, float eps,
                                        float (*v)[R + 1]) {
    constexpr int V = kVec<T>;
    __shared__ float partial[kHcThreads / 32][kHcTok][R + 1];
    const int group = threadIdx.y, lanes = blockDim.x;
    const int first = group * kHcTok, ntok = min(kHcTok, nb - first);
    const T* xg = x + static_cast<size_t>(t0 + first) * K;
    float acc[kHcTok][R] = {}, ss[kHcTok] = {};
    if (K % V == 0 && aligned16(x) && aligned16(fn)) {
        if (lanes == 32) project_tiled<T, R>(xg, fn, K, ntok, acc, ss);
        else if (ntok > 0)
            for (int k = threadIdx.x * V; k < K; k += lanes * V) project_chunk<T, R, V>(xg, fn, k, K, ntok, acc, ss);
    } else if (ntok > 0) {
        for (int k = threadIdx.x; k < K; k += lanes) project_chunk<T, R, 1>(xg, fn, k, K, ntok, acc, ss);
    }
    store_warp_sums<kHcTok, R>(partial[(group * lanes + threadIdx.x) >> 5], acc, ss);
    __syncthreads();
    const int tid = group * lanes + threadIdx.x, warps = lanes >> 5;
    for (int i = tid; i < nb * (R + 1); i += kHcThreads) {
        const int tok = i / (R + 1), r = i - tok * (R + 1), w0 = tok / kHcTok * warps;
        float s = 0.f;
        for (int w = w0; w < w0 + warps; ++w) s += partial[w][tok % kHcTok][r];
        v[tok][r] = s;
    }
    __syncthreads();
    for (int i = tid; i < nb * R; i += kHcThreads) {
        const int tok = i / R, r = i - tok * R;
        v[tok][r] *= rsqrtf(v[tok][R] / K + eps);
    }
    __syncthreads();
}

// out[t] = Σ_j w[t][j] · X[t, j] for the block's tokens, in T storage: the part-th of `parts` equal runs
// of the (token, column chunk) pairs.
template <typename T, int HC>
__device__ __forceinline__ void combine(T* out, const T* x, const float (*w)[HC], int t0, int nb, int dim,
                                        int part = 0, int parts = 1) {
    constexpr int V = kVec<T>;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const bool vec = dim % V == 0 && aligned16(out) && aligned16(x);
    const int chunks = vec ? dim / V : dim, run = (nb * chunks + parts - 1) / parts;
    const int end = min(nb * chunks, (part + 1) * run);
    for (int i = part * run + tid; i < end; i += kHcThreads) {
        const int tok = i / chunks, c = i - tok * chunks;
        const T* xt = x + static_cast<size_t>(t0 + tok) * HC * dim;
        T* ot = out + static_cast<size_t>(t0 + tok) * dim;
        if (vec) {
            float a[V] = {}, xj[V];
#pragma unroll
            for (int j = 0; j < HC; ++j) {
                load_vec(xt + j * dim + c * V, xj);
#pragma unroll
                for (int e = 0; e < V; ++e) a[e] += w[tok][j] * xj[e];
            }
            store_vec(ot + c * V, a);
        } else {
            float a = 0.f;
#pragma unroll
            for (int j = 0; j < HC; ++j) a += w[tok][j] * to_float(xt[j * dim + c]);
            ot[c] = from_float<T>(a);
        }
    }
}

// Lane j·HC+k of a warp holds C[j][k]; sums run in index order like numpy's on these short axes.
template <int HC>
__device__ __forceinline__ float sinkhorn(float c, float hc_eps, int iters) {
    const int lane = threadIdx.x & 31, row = lane / HC, col = lane % HC;
    auto row_sum = [&](float x) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < HC; ++i) s += __shfl_sync(0xffffffffu, x, row * HC + i);
        return s;
    };
    auto col_sum = [&](float x) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < HC; ++i) s += __shfl_sync(0xffffffffu, x, i * HC + col);
        return s;
    };
    float m = __shfl_sync(0xffffffffu, c, row * HC);
#pragma unroll
    for (int i = 1; i < HC; ++i) m = fmaxf(m, __shfl_sync(0xffffffffu, c, row * HC + i));
    const float e = expf(c - m);
    c = e / row_sum(e) + hc_eps;
    c = c / (col_sum(c) + hc_eps);
    for (int it = 1; it < iters; ++it) {
        c = c / (row_sum(c) + hc_eps);
        c = c / (col_sum(c) + hc_eps);
    }
    return c;
}

// pre [tok][j] (shared memory) of the block's tokens from their projections v, and when `outputs` also
// post [T, HC] and comb [T, HC, HC] (comb[t, j, k] weighs X_j into X'_k). One warp per token. Ends with a barrier.
template <int HC, int R>
__device__ __forceinline__ void mix(const float (*v)[R + 1], float (*pre)[HC], float* post, float* comb,
                                    const float* base, const float* scale, int t0, int nb, float hc_eps, int iters,
                                    bool outputs) {
    static_assert(HC * HC <= 32, "Sinkhorn holds the matrix in one warp");
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid & 31;
    for (int tok = tid >> 5; tok < nb; tok += kHcThreads / 32) {
        const float* vt = v[tok];
        if (lane < HC) {
            pre[tok][lane] = sigmoid(scale[0] * vt[lane] + base[lane]) + hc_eps;
            if (outputs)
                post[static_cast<size_t>(t0 + tok) * HC + lane] =
                    2.f * sigmoid(scale[1] * vt[HC + lane] + base[HC + lane]);
        }
        if (!outputs) continue;
        const float c0 = lane < HC * HC ? scale[2] * vt[2 * HC + lane] + base[2 * HC + lane] : 0.f;
        const float c = sinkhorn<HC>(c0, hc_eps, iters);
        if (lane < HC * HC) comb[static_cast<size_t>(t0 + tok) * HC * HC + lane] = c;
    }
    __syncthreads();
}

// Block input u [T, D], post [T, HC] and comb [T, HC, HC].
template <typename T, int HC>
__global__ void __launch_bounds__(kHcThreads) hc_pre(T* u, float* post, float* comb, const T* x, const float* fn,
                                                     const float* base, const float* scale, int tokens, int dim,
                                                     float eps, float hc_eps, int iters) {
    constexpr int R = (2 + HC) * HC;
    __shared__ float v[kHcMaxTok][R + 1];
    __shared__ float pre[kHcMaxTok][HC];
    const int t0 = blockIdx.x * blockDim.y * kHcTok, nb = min(blockDim.y * kHcTok, tokens - t0);
    project<T, R>(x, fn, t0, nb, HC * dim, eps, v);
    mix<HC, R>(v, pre, post, comb, base, scale, t0, nb, hc_eps, iters, true);
    combine<T, HC>(u, x, pre, t0, nb, dim);
}

// The rows u [t0, t0 + nb) of dim values as combine() stored them, walked over the same run of (token, column
// chunk) pairs (so each thread reads back only its own stores): the sums of squares per token into sq (pass 1),
// then xn = u · inv_rms[tok] · w (pass 2, sq unused).
template <typename T, int NT>
__device__ __forceinline__ void norm_pass(bool second, T* xn, const T* u, const float* w, const float* inv_rms,
                                          float (&sq)[NT], int t0, int nb, int dim, int part, int parts) {
    constexpr int V = kVec<T>;
    const bool vec = dim % V == 0 && aligned16(u) && aligned16(xn) && aligned16(w);
    const int chunks = vec ? dim / V : dim, run = (nb * chunks + parts - 1) / parts;
    const int end = min(nb * chunks, (part + 1) * run);
    for (int i = part * run + threadIdx.x; i < end; i += kHcThreads) {
        const int tok = i / chunks, c = i - tok * chunks;
        const size_t at = static_cast<size_t>(t0 + tok) * dim + (vec ? c * V : c);
        float a[V], g[V];
        if (vec) load_vec(u + at, a);
        else a[0] = to_float(u[at]);
        if (!second) {
            float s = vec ? 0.f : a[0] * a[0];
#pragma unroll
            for (int e = 0; e < V; ++e) s += vec ? a[e] * a[e] : 0.f;
#pragma unroll
            for (int q = 0; q < NT; ++q) sq[q] += tok == q ? s : 0.f;
            continue;
        }
        if (vec) {
            load_vec(w + (at - static_cast<size_t>(t0 + tok) * dim), g);
#pragma unroll
            for (int e = 0; e < V; ++e) a[e] *= inv_rms[tok] * g[e];
            store_vec(xn + at, a);
        } else {
            xn[at] = from_float<T>(a[0] * inv_rms[tok] * w[c]);
        }
    }
}

// hc_pre for short batches, where one block per kHcTok tokens would read all of fn alone: a cluster of
// kHcSplit blocks (blockDim.x = kHcThreads) takes NT tokens, each block one slice of the hc·D reduction.
// The blocks exchange their slice sums through distributed shared memory and add them in rank order, so
// all hold the same v; rank 0 then writes post and comb (the serial Sinkhorn) while the others combine u.
//
// With xn given it also writes xn = RMSNorm(u) · norm_w (the block's attention or FFN norm), saving a launch:
// the combining blocks add their runs' sums of squares through distributed shared memory in rank order.
template <typename T, int HC, int NT>
__global__ void __cluster_dims__(kHcSplit, 1, 1) __launch_bounds__(kHcThreads)
    hc_pre_split(T* u, float* post, float* comb, const T* x, const float* fn, const float* base, const float* scale,
                 int tokens, int dim, float eps, float hc_eps, int iters, T* xn, const float* norm_w, float norm_eps) {
    constexpr int R = (2 + HC) * HC, V = kVec<T>;
    __shared__ float partial[kHcThreads / 32][NT][R + 1];
    __shared__ float slice[NT][R + 1];
    __shared__ float v[NT][R + 1];
    __shared__ float pre[NT][HC];
    const int rank = cluster_rank();
    const int t0 = blockIdx.y * NT, nb = min(NT, tokens - t0), K = HC * dim;
    const bool vec = K % V == 0 && aligned16(x) && aligned16(fn);
    const int width = vec ? (K / V + kHcSplit - 1) / kHcSplit * V : (K + kHcSplit - 1) / kHcSplit;
    const int k_end = min(K, (rank + 1) * width);
    const T* xt = x + static_cast<size_t>(t0) * K;
    float acc[NT][R] = {}, ss[NT] = {};
    if (vec) {
        for (int k = rank * width + threadIdx.x * V; k < k_end; k += kHcThreads * V)
            project_chunk<T, R, V>(xt, fn, k, K, nb, acc, ss);
    } else {
        for (int k = rank * width + threadIdx.x; k < k_end; k += kHcThreads)
            project_chunk<T, R, 1>(xt, fn, k, K, nb, acc, ss);
    }
    store_warp_sums<NT, R>(partial[threadIdx.x >> 5], acc, ss);
    __syncthreads();
    for (int i = threadIdx.x; i < nb * (R + 1); i += kHcThreads) {
        const int tok = i / (R + 1), r = i - tok * (R + 1);
        float s = 0.f;
        for (int w = 0; w < kHcThreads / 32; ++w) s += partial[w][tok][r];
        slice[tok][r] = s;
    }
    cluster_sync();
    for (int i = threadIdx.x; i < nb * (R + 1); i += kHcThreads) {
        const int tok = i / (R + 1), r = i - tok * (R + 1);
        float s = 0.f;
        for (int q = 0; q < kHcSplit; ++q) s += cluster_load(&slice[tok][r], q);
        v[tok][r] = s;
    }
    // No block may leave (its slice going with it) before every block has read it.
    cluster_sync();
    for (int i = threadIdx.x; i < nb * R; i += kHcThreads) {
        const int tok = i / R, r = i - tok * R;
        v[tok][r] *= rsqrtf(v[tok][R] / K + eps);
    }
    __syncthreads();
    // Rank 0 adds nothing to the norm's sums: it arrives at once, so its serial Sinkhorn holds nobody up.
    if (xn != nullptr && rank == 0) cluster_arrive();
    mix<HC, R>(v, pre, post, comb, base, scale, t0, nb, hc_eps, iters, rank == 0);
    if (rank > 0) combine<T, HC>(u, x, pre, t0, nb, dim, rank - 1, kHcSplit - 1);
    if (xn == nullptr) return;
    float sq[NT] = {};
    if (rank > 0) norm_pass<T, NT>(false, xn, u, norm_w, nullptr, sq, t0, nb, dim, rank - 1, kHcSplit - 1);
    __shared__ float warp_sq[kHcThreads / 32][NT];
    __shared__ float block_sq[NT];
    __shared__ float inv_rms[NT];
#pragma unroll
    for (int q = 0; q < NT; ++q) {
        const float s = warp_sum(sq[q]);
        if ((threadIdx.x & 31) == 0) warp_sq[threadIdx.x >> 5][q] = s;
    }
    __syncthreads();
    if (threadIdx.x < NT) {
        float s = 0.f;
        for (int w = 0; w < kHcThreads / 32; ++w) s += warp_sq[w][threadIdx.x];
        block_sq[threadIdx.x] = s;
    }
    if (rank > 0) cluster_arrive();
    cluster_wait();
    if (threadIdx.x < NT) {
        float s = 0.f;
        for (int q = 1; q < kHcSplit; ++q) s += cluster_load(&block_sq[threadIdx.x], q);
        inv_rms[threadIdx.x] = rsqrtf(s / dim + norm_eps);
    }
    cluster_sync();  // every block_sq read before any block leaves; inv_rms visible to the block
    if (rank > 0) norm_pass<T, NT>(true, xn, u, norm_w, inv_rms, sq, t0, nb, dim, rank - 1, kHcSplit - 1);
}

// Final head: y [T, D] = Σ_j (sigmoid(scale·v_j + base_j) + hc_eps) X_j.
template <typename T, int HC>
__global__ void __launch_bounds__(kHcThreads) hc_head(T* y, const T* x, const float* fn, const float* base,
                                                      const float* scale, int tokens, int dim, float eps, float hc_eps) {
    __shared__ float v[kHcMaxTok][HC + 1];
    __shared__ float pre[kHcMaxTok][HC];
    const int t0 = blockIdx.x * blockDim.y * kHcTok, nb = min(blockDim.y * kHcTok, tokens - t0);
    project<T, HC>(x, fn, t0, nb, HC * dim, eps, v);
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int i = tid; i < nb * HC; i += kHcThreads) {
        const int tok = i / HC, j = i - tok * HC;
        pre[tok][j] = sigmoid(scale[0] * v[tok][j] + base[j]) + hc_eps;
    }
    __syncthreads();
    combine<T, HC>(y, x, pre, t0, nb, dim);
}

// X'[t, k] = post[t, k] · f[t] + Σ_j comb[t, j, k] · X[t, j]; one block per token. Each thread reads
// all HC streams of its columns before writing them, so out may be x (in place).
template <typename T, int HC>
__global__ void __launch_bounds__(kHcThreads) hc_post(T* out, const T* x, const T* f, const float* post,
                                                      const float* comb, int dim) {
    constexpr int V = kVec<T>;
    const size_t t = blockIdx.x;
    float p[HC], cm[HC][HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) {
        p[j] = post[t * HC + j];
#pragma unroll
        for (int k = 0; k < HC; ++k) cm[j][k] = comb[(t * HC + j) * HC + k];
    }
    const T* xt = x + t * HC * dim;
    T* ot = out + t * HC * dim;
    const T* ft = f + t * dim;
    if (dim % V == 0 && aligned16(out) && aligned16(x) && aligned16(f)) {
        for (int c = threadIdx.x * V; c < dim; c += blockDim.x * V) {
            float xs[HC][V], fv[V];
            load_vec(ft + c, fv);
#pragma unroll
            for (int j = 0; j < HC; ++j) load_vec(xt + j * dim + c, xs[j]);
#pragma unroll
            for (int k = 0; k < HC; ++k) {
                float o[V];
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < HC; ++j) s += cm[j][k] * xs[j][e];
                    o[e] = p[k] * fv[e] + s;
                }
                store_vec(ot + k * dim + c, o);
            }
        }
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            float xs[HC];
            const float fv = to_float(ft[c]);
#pragma unroll
            for (int j = 0; j < HC; ++j) xs[j] = to_float(xt[j * dim + c]);
#pragma unroll
            for (int k = 0; k < HC; ++k) {
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < HC; ++j) s += cm[j][k] * xs[j];
                ot[k * dim + c] = from_float<T>(p[k] * fv + s);
            }
        }
    }
}

// X [T, hc, D] = the table row of each id in every stream; an id outside [0, vocab) gives zeros
// (the host rejects such ids; this only keeps the kernel from reading out of bounds). One block per token.
template <typename T>
__global__ void __launch_bounds__(1024) hc_embed(T* out, const int* ids, const T* table, int vocab, int hc, int dim) {
    constexpr int V = kVec<T>;
    const size_t t = blockIdx.x;
    const int id = ids[t];
    const bool valid = id >= 0 && id < vocab;
    const T* row = table + static_cast<size_t>(valid ? id : 0) * dim;
    T* ot = out + t * hc * dim;
    if (dim % V == 0 && aligned16(out) && aligned16(table)) {
        for (int c = threadIdx.x * V; c < dim; c += blockDim.x * V) {
            const uint4 raw = valid ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0, 0, 0, 0);
            for (int j = 0; j < hc; ++j) *reinterpret_cast<uint4*>(ot + j * dim + c) = raw;
        }
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const T e = valid ? row[c] : from_float<T>(0.f);
            for (int j = 0; j < hc; ++j) ot[j * dim + c] = e;
        }
    }
}
