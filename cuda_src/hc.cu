// dsv4rt-instantiate: hc_embed<float> hc_embed<__nv_bfloat16>
// dsv4rt-instantiate: hc_pre<float,2> hc_pre<float,4> hc_pre<__nv_bfloat16,2> hc_pre<__nv_bfloat16,4>
// dsv4rt-instantiate: hc_pre_decode<float,2,1> hc_pre_decode<float,2,8> hc_pre_decode<float,2,16>
// dsv4rt-instantiate: hc_pre_decode<float,4,1> hc_pre_decode<float,4,8> hc_pre_decode<float,4,16>
// dsv4rt-instantiate: hc_pre_decode<__nv_bfloat16,2,1> hc_pre_decode<__nv_bfloat16,2,8>
// dsv4rt-instantiate: hc_pre_decode<__nv_bfloat16,2,16> hc_pre_decode<__nv_bfloat16,4,1>
// dsv4rt-instantiate: hc_pre_decode<__nv_bfloat16,4,8> hc_pre_decode<__nv_bfloat16,4,16>
// dsv4rt-instantiate: hc_pre_finish<__nv_bfloat16,2> hc_pre_finish<__nv_bfloat16,4>
// dsv4rt-instantiate: hc_head<float,2> hc_head<float,4> hc_head<__nv_bfloat16,2> hc_head<__nv_bfloat16,4>
// dsv4rt-instantiate: hc_post<float,2> hc_post<float,4> hc_post<__nv_bfloat16,2> hc_post<__nv_bfloat16,4>
#include "common.cuh"
#include "fp8.cuh"

// Manifold-constrained hyper-connections (docs/model.md#hyper-connections) on streams X [T, HC, D].
// hc_pre and hc_head launch kHcThreads threads as (lanes, groups): each group of `lanes` threads
// splits the hc·D reduction of kHcTok tokens, so every fn value loaded feeds kHcTok tokens; fn
// (float32) stays in L2 across blocks. Groups of one warp share fn through shared memory instead.
constexpr int kHcThreads = 256;
constexpr int kHcTok = 4;
constexpr int kHcMaxTok = kHcTok * (kHcThreads / 32);

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
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float w[N];
        load_f32(fn + static_cast<size_t>(r) * K + k, w);
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < N; ++e) acc[t][r] += xv[t][e] * w[e];
    }
}

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

// out[t] = Σ_j w[t][j] · X[t, j] for the block's tokens, in T storage.
template <typename T, int HC>
__device__ __forceinline__ void combine(T* out, const T* x, const float (*w)[HC], int t0, int nb, int dim) {
    constexpr int V = kVec<T>;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const bool vec = dim % V == 0 && aligned16(out) && aligned16(x);
    const int chunks = vec ? dim / V : dim;
    for (int i = tid; i < nb * chunks; i += kHcThreads) {
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

// ---- Decode batches ----------------------------------------------------------------------------------------------
// hc_pre_decode serves short batches, where a block per kHcTok tokens would read all of fn (1.5 MB at Flash sizes)
// alone. Block (s, g) projects column slice s of the hc·D columns of token group g (NT tokens) onto every row of fn
// and writes the partial sums to the workspace. The last `finishers` blocks to be done with their slice then finish
// the tokens, one each in turn: v from the partials (added in slice order, so the results do not depend on which
// blocks finish), post, the Sinkhorn comb, u and, when xn is given, xn = RMSNorm(u) · norm_w. counters[0] counts the
// blocks done with their slice, counters[1] the finishers past the wait for all of them; both are zero before a
// launch and the last finisher zeroes them again. Only finishers wait, and there are fewer of them than SMs, so a
// block that has not started yet always finds an SM to run on (one block fits an SM).
// With f the launch first applies the previous sublayer's hc_post (x_prev, f, post_prev, comb_prev): each block
// computes its slice of the new streams, writes it to x and projects it. A slice needs every old stream at its
// columns, which other blocks' slices hold, so x_prev must not be x, nor post and comb the previous ones.
constexpr int kPreWarps = 9;  // a finisher combines on 8 warps, the 9th runs the Sinkhorn
constexpr int kPreThreads = 32 * kPreWarps;
constexpr int kPreCombiners = kPreThreads - 32;
constexpr int kPreKeep = 2;   // chunks of u per combining thread kept in registers for the norm

// Columns k.. of one token as floats: four (one 16-byte float or 8-byte bf16 load) or one.
template <typename T, int W>
__device__ __forceinline__ void load_cols(const T* p, float (&v)[W]) {
    static_assert(W == 1 || W == 4, "four columns or one");
    if constexpr (W == 1) {
        v[0] = to_float(*p);
    } else {
        const Raw4<T> raw = *reinterpret_cast<const Raw4<T>*>(p);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_float(e[i]);
    }
}

// The previous sublayer's hc_post, applied by hc_pre_decode as it reads the streams (f null: none). chunks: x and f
// allow load_cols of four columns and a four-column chunk never spans two streams.
template <typename T>
struct PrevPost {
    const T* x;
    const T* f;
    const float* post;
    const float* comb;
    bool chunks;
};

// Columns k.. of token t of hc_post's output X'[t, j, c] = post[t, j] · f[t, c] + Σ_i comb[t, i, j] · X[t, i, c]
// (flattened column k = j·D + c) in hc_post's float ops, rounded to T; warp 0 stores them to out.
template <typename T, int HC, int W>
__device__ __forceinline__ void post_cols(const PrevPost<T>& p, T* out, int t, int k, int dim, float (&v)[W]) {
    const T* xt = p.x + static_cast<size_t>(t) * HC * dim;
    const T* ft = p.f + static_cast<size_t>(t) * dim;
    const float* pt = p.post + t * HC;
    const float* ct = p.comb + t * HC * HC;
    if (W == 1 || p.chunks) {
        const int j = k / dim, c = k - j * dim;
        float xs[HC][W], fv[W];
        load_cols<T, W>(ft + c, fv);
#pragma unroll
        for (int i = 0; i < HC; ++i) load_cols<T, W>(xt + i * dim + c, xs[i]);
#pragma unroll
        for (int e = 0; e < W; ++e) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < HC; ++i) s += ct[i * HC + j] * xs[i][e];
            v[e] = pt[j] * fv[e] + s;
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) {
            const int j = (k + e) / dim, c = k + e - j * dim;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < HC; ++i) s += ct[i * HC + j] * to_float(xt[i * dim + c]);
            v[e] = pt[j] * to_float(ft[c]) + s;
        }
    }
    Raw4<T> raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < W; ++i) e[i] = from_float<T>(v[i]), v[i] = to_float(e[i]);
    if (threadIdx.x < 32) {
        if constexpr (W == 1) out[static_cast<size_t>(t) * HC * dim + k] = e[0];
        else *reinterpret_cast<Raw4<T>*>(out + static_cast<size_t>(t) * HC * dim + k) = raw;
    }
}

// This lane's share of the columns [k0, k1) of the group's nb ≤ NT tokens (rows of K) against fn rows
// warp + kPreWarps·i into acc[i·NT + t]; row R, one past fn's last, stands for the squares of x. W columns at a time.
template <typename T, int HC, int R, int NT, int W, int N>
__device__ __forceinline__ void project_slice(T* x, const PrevPost<T>& prev, const float* fn, int k0, int k1, int K,
                                              int nb, float (&acc)[N]) {
    constexpr int SLOTS = N / NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool last_row = warp < R % kPreWarps, squares = warp == R % kPreWarps;  // the last slot's role here
#pragma unroll(W == 4 ? 2 : 1)
    for (int k = k0 + W * lane; k < k1; k += 32 * W) {
        float w[SLOTS][W] = {};
#pragma unroll
        for (int i = 0; i < SLOTS; ++i)
            if (i < SLOTS - 1 || last_row) load_f32(fn + static_cast<size_t>(warp + kPreWarps * i) * K + k, w[i]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t >= nb) break;
            float xv[W];
            if (prev.f != nullptr) post_cols<T, HC, W>(prev, x, t, k, K / HC, xv);
            else load_cols<T, W>(x + static_cast<size_t>(t) * K + k, xv);
#pragma unroll
            for (int i = 0; i < SLOTS; ++i)
                if (i < SLOTS - 1 || last_row || squares)
#pragma unroll
                    for (int e = 0; e < W; ++e)
                        acc[i * NT + t] += (i == SLOTS - 1 && squares ? xv[e] : w[i][e]) * xv[e];
        }
    }
}

// How many of N values a lane holds after warp_fold.
__host__ __device__ constexpr int fold_count(int n) {
    for (int o = 16; o > 0; o >>= 1)
        if (n % 2 == 0) n /= 2;
    return n;
}

// The warp's totals of each lane's N values in about N shuffles rather than 5N: while N is even each step hands half
// of the values to the partner lane and keeps the other half. Afterwards the lane's a[p] (p < fold_count(N)) is the
// total of value fold_index(N) + p; lanes that differ only in bits where N was odd hold the same totals.
template <int N, int M, int O = 16>
__device__ __forceinline__ void warp_fold(float (&a)[M]) {
    if constexpr (O > 0) {
        const bool upper = threadIdx.x & O;
        if constexpr (N % 2 == 0) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                const float give = upper ? a[i] : a[i + N / 2], keep = upper ? a[i + N / 2] : a[i];
                a[i] = keep + __shfl_xor_sync(0xffffffffu, give, O);
            }
            warp_fold<N / 2, M, O / 2>(a);
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], O);
            warp_fold<N, M, O / 2>(a);
        }
    }
}

// The index of the first value whose total this lane holds after warp_fold<N>, or -1 where a lower lane holds the same.
template <int N>
__device__ __forceinline__ int fold_index() {
    int n = N, first = 0;
    for (int o = 16; o > 0; o >>= 1) {
        if (n % 2 == 0) {
            if (threadIdx.x & o) first += n / 2;
            n /= 2;
        } else if (threadIdx.x & o) {
            return -1;
        }
    }
    return first;
}

// 1/d to within one ulp in one MUFU op, where the rounded reciprocal or a division adds dependent ops to each of the
// Sinkhorn's 2·iters steps. The error of a step rescales a whole row or column, which later steps take out again
// (numpy model of the worst case, a one-ulp bias in every step: comb within 1e-6 of the divisions).
__device__ __forceinline__ float fast_rcp(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
}

template <int HC>
__device__ __forceinline__ void normalise_rows(float (&c)[HC][HC], float hc_eps) {
#pragma unroll
    for (int j = 0; j < HC; ++j) {
        float s = c[j][0];
#pragma unroll
        for (int k = 1; k < HC; ++k) s += c[j][k];
        const float r = fast_rcp(s + hc_eps);
#pragma unroll
        for (int k = 0; k < HC; ++k) c[j][k] *= r;
    }
}

template <int HC>
__device__ __forceinline__ void normalise_cols(float (&c)[HC][HC], float hc_eps) {
#pragma unroll
    for (int k = 0; k < HC; ++k) {
        float s = c[0][k];
#pragma unroll
        for (int j = 1; j < HC; ++j) s += c[j][k];
        const float r = fast_rcp(s + hc_eps);
#pragma unroll
        for (int j = 0; j < HC; ++j) c[j][k] *= r;
    }
}

// The Sinkhorn of one token in one thread: its 2·iters dependent normalisations need no shuffles. Sums run in index
// order like numpy's on these short axes.
template <int HC>
__device__ __forceinline__ void sinkhorn_thread(float (&c)[HC][HC], float hc_eps, int iters) {
#pragma unroll
    for (int j = 0; j < HC; ++j) {
        float m = c[j][0];
#pragma unroll
        for (int k = 1; k < HC; ++k) m = fmaxf(m, c[j][k]);
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < HC; ++k) c[j][k] = expf(c[j][k] - m), s += c[j][k];
        const float r = fast_rcp(s);
#pragma unroll
        for (int k = 0; k < HC; ++k) c[j][k] = c[j][k] * r + hc_eps;
    }
    normalise_cols(c, hc_eps);
    for (int it = 1; it < iters; ++it) {
        normalise_rows(c, hc_eps);
        normalise_cols(c, hc_eps);
    }
}

// W consecutive columns of u, xn or x: a 16-byte chunk (W = kVec<T>) or one element, as it sits in memory.
template <typename T, int W> struct ChunkOf { using type = uint4; };
template <typename T> struct ChunkOf<T, 1> { using type = T; };

template <typename T, int W>
__device__ __forceinline__ void unpack(const typename ChunkOf<T, W>::type& raw, float (&v)[W]) {
    if constexpr (W == 1) {
        v[0] = to_float(raw);
    } else {
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < W; ++i) v[i] = to_float(e[i]);
    }
}

// Stores v as T and leaves in it the stored (rounded) values.
template <typename T, int W>
__device__ __forceinline__ void store_rounded(T* p, float (&v)[W]) {
    typename ChunkOf<T, W>::type raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < W; ++i) e[i] = from_float<T>(v[i]), v[i] = to_float(e[i]);
    *reinterpret_cast<typename ChunkOf<T, W>::type*>(p) = raw;
}

// This combining thread's first kPreKeep chunks of W columns (chunk c goes to thread c mod kPreCombiners): those of
// every stream of token row xt into xr and, with norm_w, their weights into wr. Streams come from L2: with a fused
// post other blocks wrote them in this launch.
template <typename T, int HC, int W>
__device__ __forceinline__ void load_kept(typename ChunkOf<T, W>::type (&xr)[kPreKeep][HC], float (&wr)[kPreKeep][W],
                                          const T* xt, const float* norm_w, int dim) {
    using Chunk = typename ChunkOf<T, W>::type;
#pragma unroll
    for (int i = 0; i < kPreKeep; ++i) {
        const int c = threadIdx.x + kPreCombiners * i;
        if (c >= dim / W) break;
#pragma unroll
        for (int j = 0; j < HC; ++j) xr[i][j] = __ldcg(reinterpret_cast<const Chunk*>(xt + j * dim + c * W));
        if (norm_w != nullptr) load_f32(norm_w + c * W, wr[i]);
    }
}

// u[t] = Σ_j pre_j X[t, j] and, with xn, xn[t] = RMSNorm(u[t]) · norm_w, on the combining warps. The chunks load_kept
// loaded stay in registers for the norm; chunks past them (long rows) are read again from u. With xq (bf16 chunks,
// dim a multiple of 128) also act_quant(xn[t]): codes to xq, scale bytes to xs, as the act_quant kernel would.
template <typename T, int HC, int W>
__device__ __forceinline__ void combine_norm(T* u, T* xn, const T* xt, const float* norm_w, const float (&pre)[HC],
                                             const typename ChunkOf<T, W>::type (&xr)[kPreKeep][HC],
                                             const float (&wr)[kPreKeep][W], int dim, float norm_eps,
                                             unsigned char* xq = nullptr, unsigned char* xs = nullptr) {
    using Chunk = typename ChunkOf<T, W>::type;
    __shared__ float warp_sq[kPreCombiners / 32];
    const int tid = threadIdx.x, chunks = dim / W;
    float ur[kPreKeep][W], ss = 0.f;
#pragma unroll
    for (int i = 0; i < kPreKeep; ++i) {
        const int c = tid + kPreCombiners * i;
        if (c >= chunks) break;
#pragma unroll
        for (int e = 0; e < W; ++e) ur[i][e] = 0.f;
#pragma unroll
        for (int j = 0; j < HC; ++j) {
            float xj[W];
            unpack<T, W>(xr[i][j], xj);
#pragma unroll
            for (int e = 0; e < W; ++e) ur[i][e] += pre[j] * xj[e];
        }
        store_rounded<T, W>(u + c * W, ur[i]);
#pragma unroll
        for (int e = 0; e < W; ++e) ss += ur[i][e] * ur[i][e];
    }
    for (int c = tid + kPreCombiners * kPreKeep; c < chunks; c += kPreCombiners) {
        float a[W] = {};
#pragma unroll
        for (int j = 0; j < HC; ++j) {
            float xj[W];
            unpack<T, W>(__ldcg(reinterpret_cast<const Chunk*>(xt + j * dim + c * W)), xj);
#pragma unroll
            for (int e = 0; e < W; ++e) a[e] += pre[j] * xj[e];
        }
        store_rounded<T, W>(u + c * W, a);
#pragma unroll
        for (int e = 0; e < W; ++e) ss += a[e] * a[e];
    }
    if (xn == nullptr) return;
    ss = warp_sum(ss);
    if ((tid & 31) == 0) warp_sq[tid >> 5] = ss;
    __syncthreads();  // the finisher's last warp meets it in finish (a whole-block barrier: racecheck models those)
    ss = 0.f;
#pragma unroll
    for (int w = 0; w < kPreCombiners / 32; ++w) ss += warp_sq[w];
    const float inv_rms = rsqrtf(ss / dim + norm_eps);
#pragma unroll
    for (int i = 0; i < kPreKeep; ++i) {
        const int c = tid + kPreCombiners * i;
        if (c >= chunks) break;
#pragma unroll
        for (int e = 0; e < W; ++e) ur[i][e] = ur[i][e] * inv_rms * wr[i][e];
        store_rounded<T, W>(xn + c * W, ur[i]);
        if constexpr (W == 8)
            if (xq != nullptr) act_quant_chunk(ur[i], xq, xs, c);
    }
    for (int c = tid + kPreCombiners * kPreKeep; c < chunks; c += kPreCombiners) {
        float a[W], g[W];
        unpack<T, W>(*reinterpret_cast<const Chunk*>(u + c * W), a);  // this thread's own store above
        load_f32(norm_w + c * W, g);
#pragma unroll
        for (int e = 0; e < W; ++e) a[e] = a[e] * inv_rms * g[e];
        store_rounded<T, W>(xn + c * W, a);
        if constexpr (W == 8)
            if (xq != nullptr) act_quant_chunk(a, xq, xs, c);
    }
}

// Token t's finish from its partial sums [T][slices][R + 1] (fn's rows, then the squares): v, then post and the
// Sinkhorn comb on the last warp while the combining warps write u and, with xn, xn. params holds base then scale.
// Rows of 16-byte chunks (vec) come with the combining threads' chunks already loaded (load_kept: xr, wr); other rows
// go element by element. Ends with a barrier.
template <typename T, int HC>
__device__ __forceinline__ void finish_token(int t, bool vec, T* u, float* post, float* comb, const T* x,
                                             const float* params, int dim, float eps, float hc_eps, int iters, T* xn,
                                             const float* norm_w, float norm_eps, const float* partial, int slices,
                                             const uint4 (&xr)[kPreKeep][HC], const float (&wr)[kPreKeep][kVec<T>],
                                             unsigned char* xq = nullptr, unsigned char* xs = nullptr) {
    constexpr int R = (2 + HC) * HC, V = kVec<T>, BATCH = 16;  // BATCH: partial loads in flight per lane
    __shared__ float part[kPreWarps][32];
    __shared__ float v[R];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, K = HC * dim;
    const bool combines = warp < kPreWarps - 1;
    const T* xt = x + static_cast<size_t>(t) * K;
    // v: warp w adds the partials of slices w, w + kPreWarps, ... in order, then the warps' sums add in order.
    float sum = 0.f;
    if (lane <= R) {
        const float* pt = partial + static_cast<size_t>(t) * slices * (R + 1) + lane;
        for (int q0 = warp; q0 < slices; q0 += kPreWarps * BATCH) {
            float got[BATCH];
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                const int q = q0 + kPreWarps * b;
                got[b] = q < slices ? __ldcg(pt + static_cast<size_t>(q) * (R + 1)) : 0.f;
            }
#pragma unroll
            for (int b = 0; b < BATCH; ++b) sum += got[b];
        }
    }
    part[warp][lane] = sum;
    __syncthreads();
    if (tid < R) {
        float a = 0.f, ss = 0.f;
#pragma unroll
        for (int w = 0; w < kPreWarps; ++w) a += part[w][tid], ss += part[w][R];
        v[tid] = a * rsqrtf(ss / K + eps);
    }
    __syncthreads();
    if (!combines) {
        if (xn != nullptr) __syncthreads();  // combine_norm's barrier, before the Sinkhorn so that they overlap
        if (lane < HC) {
            const float p = params[R + 1] * v[HC + lane] + params[HC + lane];
            post[static_cast<size_t>(t) * HC + lane] = 2.f * sigmoid(p);
        }
        if (lane == 0) {
            float c[HC][HC];
#pragma unroll
            for (int i = 0; i < HC * HC; ++i)
                c[i / HC][i % HC] = params[R + 2] * v[2 * HC + i] + params[2 * HC + i];
            sinkhorn_thread<HC>(c, hc_eps, iters);
#pragma unroll
            for (int i = 0; i < HC * HC; ++i) comb[static_cast<size_t>(t) * HC * HC + i] = c[i / HC][i % HC];
        }
    } else {
        float pre[HC];
#pragma unroll
        for (int j = 0; j < HC; ++j) pre[j] = sigmoid(params[R] * v[j] + params[j]) + hc_eps;
        T* ut = u + static_cast<size_t>(t) * dim;
        T* xnt = xn != nullptr ? xn + static_cast<size_t>(t) * dim : nullptr;
        if (vec) {
            combine_norm<T, HC, V>(ut, xnt, xt, norm_w, pre, xr, wr, dim, norm_eps,
                                   xq != nullptr ? xq + static_cast<size_t>(t) * dim : nullptr,
                                   xq != nullptr ? xs + static_cast<size_t>(t) * (dim / kFp8Block) : nullptr);
        } else {
            T xs[kPreKeep][HC];
            float ws[kPreKeep][1];
            load_kept<T, HC, 1>(xs, ws, xt, xn != nullptr ? norm_w : nullptr, dim);
            combine_norm<T, HC, 1>(ut, xnt, xt, norm_w, pre, xs, ws, dim, norm_eps);
        }
    }
    __syncthreads();  // part, v and the norm's sums are reused for the next token
}

// Whether a row's finish goes by 16-byte chunks.
template <typename T>
__device__ __forceinline__ bool chunked_rows(int dim, const T* x, const T* u, const T* xn, const float* norm_w) {
    return dim % kVec<T> == 0 && aligned16(x) && aligned16(u) && (xn == nullptr || (aligned16(xn) && aligned16(norm_w)));
}

// A finisher's part of hc_pre_decode: tokens role, role + finishers, ... of the batch. Chunked rows have theirs
// loaded while the finisher waits, unless the other blocks write them (fused).
template <typename T, int HC>
__device__ __forceinline__ void finish(int role, int finishers, bool last, int blocks, bool vec, bool fused, T* u,
                                       float* post, float* comb, const T* x, const float* params, int tokens, int dim,
                                       float eps, float hc_eps, int iters, T* xn, const float* norm_w, float norm_eps,
                                       unsigned* counters, const float* partial, int slices) {
    constexpr int V = kVec<T>;
    const bool combines = (threadIdx.x >> 5) < kPreWarps - 1;
    const float* norm_wr = xn != nullptr ? norm_w : nullptr;
    unsigned left = 0;
    for (int t = role; t < tokens; t += finishers) {
        const T* xt = x + static_cast<size_t>(t) * HC * dim;
        uint4 xr[kPreKeep][HC];
        float wr[kPreKeep][V];
        if (vec && combines && !fused) load_kept<T, HC, V>(xr, wr, xt, norm_wr, dim);
        if (t == role) {
            if (threadIdx.x == 0) {
                if (!last)
                    while (*reinterpret_cast<volatile unsigned*>(counters) < static_cast<unsigned>(blocks)) {}
                __threadfence();
                left = atomicAdd(counters + 1, 1u);
            }
            __syncthreads();
        }
        if (vec && combines && fused) load_kept<T, HC, V>(xr, wr, xt, norm_wr, dim);
        finish_token<T, HC>(t, vec, u, post, comb, x, params, dim, eps, hc_eps, iters, xn, norm_w, norm_eps, partial,
                            slices, xr, wr);
    }
    if (threadIdx.x == 0 && left == static_cast<unsigned>(finishers - 1)) counters[0] = counters[1] = 0;
}

// Prefill steps of the bf16 build: token blockIdx.x's finish from hc_project_mma's partial sums (hc_mma.cu), which
// the launch before wrote. xq, xs (or null): act_quant of xn [T, dim], dim a multiple of 128, chunked rows.
template <typename T, int HC>
__global__ void __launch_bounds__(kPreThreads, 2)
    hc_pre_finish(T* u, float* post, float* comb, const T* x, const float* base, const float* scale, int dim,
                  float eps, float hc_eps, int iters, T* xn, const float* norm_w, float norm_eps,
                  const float* partial, int slices, unsigned char* xq, unsigned char* xs) {
    constexpr int R = (2 + HC) * HC, V = kVec<T>;
    __shared__ float params[R + 3];  // base, then scale
    if (threadIdx.x < R + 3) params[threadIdx.x] = threadIdx.x < R ? base[threadIdx.x] : scale[threadIdx.x - R];
    const int t = blockIdx.x;
    const bool vec = chunked_rows(dim, x, u, xn, norm_w);
    uint4 xr[kPreKeep][HC];
    float wr[kPreKeep][V];
    if (vec && (threadIdx.x >> 5) < kPreWarps - 1)
        load_kept<T, HC, V>(xr, wr, x + static_cast<size_t>(t) * HC * dim, xn != nullptr ? norm_w : nullptr, dim);
    __syncthreads();
    finish_token<T, HC>(t, vec, u, post, comb, x, params, dim, eps, hc_eps, iters, xn, norm_w, norm_eps, partial,
                        slices, xr, wr, xq, xs);
}

template <typename T, int HC, int NT>
__global__ void __launch_bounds__(kPreThreads, 1)
    hc_pre_decode(T* u, float* post, float* comb, T* x, const float* fn, const float* base, const float* scale,
                  int tokens, int dim, float eps, float hc_eps, int iters, T* xn, const float* norm_w, float norm_eps,
                  unsigned* counters, float* partial, int cols, int finishers, const T* x_prev, const T* f,
                  const float* post_prev, const float* comb_prev) {
    constexpr int R = (2 + HC) * HC, N = (R + kPreWarps) / kPreWarps * NT;
    static_assert(R + 3 <= 32, "one warp loads base and scale");
    __shared__ float params[R + 3];  // base, then scale
    __shared__ int ticket;
    const int K = HC * dim, s = blockIdx.x, slices = gridDim.x, blocks = slices * gridDim.y;
    const int t0 = blockIdx.y * NT, nb = min(NT, tokens - t0), k0 = s * cols, k1 = min(K, k0 + cols);
    // Loaded now, for whichever blocks finish, and stored to shared memory once they have arrived.
    const float param = threadIdx.x < R ? base[threadIdx.x] : threadIdx.x < R + 3 ? scale[threadIdx.x - R] : 0.f;
    if (xn != nullptr && s == 0 && blockIdx.y == 0)  // norm_w into L2 for them too
        for (int l = threadIdx.x; l < (dim + 31) / 32; l += kPreThreads)
            asm volatile("prefetch.L2 [%0];" ::"l"(norm_w + 32 * l));
    float acc[N] = {};
    T* xg = x + static_cast<size_t>(t0) * K;
    const auto raw4 = [](const void* p) {  // four columns' alignment
        return (reinterpret_cast<unsigned long long>(p) & (4 * sizeof(T) - 1)) == 0;
    };
    PrevPost<T> prev{};
    if (f != nullptr)
        prev = {x_prev + static_cast<size_t>(t0) * K, f + static_cast<size_t>(t0) * dim, post_prev + t0 * HC,
                comb_prev + t0 * HC * HC, dim % 4 == 0 && raw4(x_prev) && raw4(f)};
    if (K % 4 == 0 && aligned16(fn) && raw4(x))
        project_slice<T, HC, R, NT, 4>(xg, prev, fn, k0, k1, K, nb, acc);
    else
        project_slice<T, HC, R, NT, 1>(xg, prev, fn, k0, k1, K, nb, acc);
    // partial [T][slices][R + 1]: each token's sums over each slice, fn's rows then the squares.
    warp_fold<N>(acc);
    const int first = fold_index<N>();
    if (first >= 0) {
#pragma unroll
        for (int p = 0; p < fold_count(N); ++p) {
            const int i = (first + p) / NT, t = (first + p) % NT, r = (threadIdx.x >> 5) + kPreWarps * i;
            if (t < nb && r <= R) partial[(static_cast<size_t>(t0 + t) * slices + s) * (R + 1) + r] = acc[p];
        }
    }
    if (threadIdx.x < R + 3) params[threadIdx.x] = param;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's partials before its count
        ticket = atomicAdd(counters, 1u);
    }
    __syncthreads();
    if (ticket < blocks - finishers) return;
    const int role = ticket - (blocks - finishers);
    const bool last = ticket == blocks - 1;
    const bool vec = chunked_rows(dim, x, u, xn, norm_w);
    finish<T, HC>(role, finishers, last, blocks, vec, f != nullptr, u, post, comb, x, params, tokens, dim, eps, hc_eps,
                  iters, xn, norm_w, norm_eps, counters, partial, slices);
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
