// dsv4rt-instantiate: compress_pool<float> compress_pool<__nv_bfloat16>
// dsv4rt-instantiate: compress_pool<float,true> compress_pool<__nv_bfloat16,true>
// dsv4rt-instantiate: compress_pool<float,false,true>
#include "compress.cuh"
#include "indexer_fp4.cuh"

// The KV compressor of docs/model.md#compressor fused with its RMSNorm, RoPE and cache insert.
//
// Rows t of the launch are tokens: req[t] (< 0: a padding row) and pos[t]; the rows of one request
// are contiguous, at consecutive positions. a, z: float32 [rows, c·width], z without ape (c = 2 for
// the overlapping form, else 1). One block per row:
//  * the row at position p = r·j + r − 1 completes entry j: its candidates are positions
//    r·j − (c−1)·r … r·j + r − 1, read from this launch's rows when the request has them here and
//    from the state cache (entry = raw position, float32 [a | z], c·width each) otherwise;
//    the pooled entry is normed, roped at position r·j and stored into entry j of `out` (T);
//  * the row's (a, z) goes into the state cache iff a later chunk still reads it:
//    p ≥ r·⌊L/r⌋ − (c−1)·r with L the request's length after this launch (CacheKind.keep_from(L)).
// Reads of the state cache touch positions before this launch's rows only, writes its rows only.
// Fp8Kv (the main cache, width <= kMaxHeadDim): `out` holds faithful-mode entries (kv_fp8.cuh); the first warp
// norms, ropes and encodes the pooled entry, a lane's chunks as in attention.cuh.
// Fp4Keys (the indexer cache): `out` holds the packed entries of indexer_fp4.cuh, whatever the storage type (T is
// unused); the first warp rotates and encodes the normed, roped entry.

struct Candidate {
    const float* a;    // nullptr: absent (the previous window of entry 0)
    const float* z;
    const float* ape;
};

template <typename T, bool Fp8Kv = false, bool Fp4Keys = false>
__global__ void __launch_bounds__(512) compress_pool(
        char* out_base, const long long* out_pages, const int* out_start, int out_per_page, int out_entry_bytes,
        char* state_base, const long long* state_pages, const int* state_start, int state_per_page,
        int state_entry_bytes, const float* a, const float* z, const float* ape, const float* norm,
        const float* inv_freq, const int* pos, const int* req, int rows, int width, int ratio, int overlap,
        int rope_dim, float eps) {
    static_assert(!(Fp8Kv && Fp4Keys), "one cache format");
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = blockIdx.x, request = req[t];
    if (request < 0) return;
    const int p = pos[t], span = (1 + overlap) * ratio, cd = (1 + overlap) * width;
    const long long* state_list = state_pages + state_start[request];

    // A later chunk reads p only if the request ends fewer than span positions after it.
    int later = 0;
    for (int k = threadIdx.x; k < span; k += blockDim.x) later += t + 1 + k < rows && req[t + 1 + k] == request;
    later = static_cast<int>(block_sum(static_cast<float>(later)));
    const int length = p + 1 + later;
    if (later < span && p >= length / ratio * ratio - overlap * ratio) {
        float* dst = reinterpret_cast<float*>(
            paged_entry(state_base, state_list, state_per_page, state_entry_bytes, p));
        const float* ra = a + static_cast<size_t>(t) * cd;
        const float* rz = z + static_cast<size_t>(t) * cd;
        for (int i = threadIdx.x; i < cd; i += blockDim.x) {
            dst[i] = ra[i];
            dst[cd + i] = rz[i];
        }
    }
    if (p % ratio != ratio - 1) return;

    const int j = p / ratio;
    Candidate* cand = reinterpret_cast<Candidate*>(smem);
    float* pooled = reinterpret_cast<float*>(cand + span);
    for (int k = threadIdx.x; k < span; k += blockDim.x) {
        const int q = j * ratio + k - overlap * ratio;
        const int half = overlap && k >= ratio ? width : 0;  // overlapping form: current window, second half
        Candidate c{nullptr, nullptr, nullptr};
        if (q >= 0) {
            const int row = t - (p - q);
            if (row >= 0 && req[row] == request) {
                c.a = a + static_cast<size_t>(row) * cd + half;
                c.z = z + static_cast<size_t>(row) * cd + half;
            } else {
                c.a = reinterpret_cast<const float*>(
                          paged_entry(state_base, state_list, state_per_page, state_entry_bytes, q)) + half;
                c.z = c.a + cd;
            }
            c.ape = ape + static_cast<size_t>(q % ratio) * cd + half;
        }
        cand[k] = c;
    }
    __syncthreads();

    // Per channel: softmax over the candidates' z + ape, weighted sum of their a (two passes, as the reference).
    float ss = 0.f;
    for (int ch = threadIdx.x; ch < width; ch += blockDim.x) {
        float top = __int_as_float(0xff800000);  // −inf (NVRTC has no INFINITY)
        for (int k = 0; k < span; ++k)
            if (cand[k].a) top = fmaxf(top, cand[k].z[ch] + cand[k].ape[ch]);
        float sum = 0.f, acc = 0.f;
        for (int k = 0; k < span; ++k) {
            if (!cand[k].a) continue;
            const float e = expf(cand[k].z[ch] + cand[k].ape[ch] - top);
            sum += e;
            acc += e * cand[k].a[ch];
        }
        const float v = acc / sum;
        pooled[ch] = v;
        ss += v * v;
    }
    const float scale = 1.f / sqrtf(block_sum(ss) / width + eps);

    if constexpr (Fp8Kv) {
        if (threadIdx.x >= 32) return;
        constexpr int V = kVec<T>, C = kLaneChunks<T>;
        float v[C][V];
#pragma unroll
        for (int i = 0; i < C; ++i) {
            const int d0 = (threadIdx.x + 32 * i) * V;
#pragma unroll
            for (int k = 0; k < V; ++k) v[i][k] = d0 + k < width ? pooled[d0 + k] * scale * norm[d0 + k] : 0.f;
            if (d0 < width) rope_chunk(v[i], d0, width, rope_dim, j * ratio, inv_freq, false);
        }
        store_kv_entry<T>(paged_entry(out_base, out_pages + out_start[request], out_per_page, out_entry_bytes, j), v,
                          width, rope_dim, threadIdx.x);
        return;
    }
    T* dst = reinterpret_cast<T*>(
        paged_entry(out_base, out_pages + out_start[request], out_per_page, out_entry_bytes, j));
    float* x = pooled + width;  // Fp4Keys: hadamard_size(width) floats, the entry and zeros after it
    const int rope_from = width - rope_dim;
    for (int ch = threadIdx.x; ch < width; ch += blockDim.x) {
        float y = pooled[ch] * scale * norm[ch];
        if (ch >= rope_from) {
            const int pair = ch - rope_from, other = pair & 1 ? ch - 1 : ch + 1;
            const float partner = pooled[other] * scale * norm[other];
            float s, c;
            sincosf(static_cast<float>(j * ratio) * inv_freq[pair >> 1], &s, &c);
            y = (pair & 1) ? y * c + partner * s : y * c - partner * s;
        }
        if constexpr (Fp4Keys) {
            x[ch] = y;
        } else {
            dst[ch] = from_float<T>(y);
        }
    }
    if constexpr (Fp4Keys) {
        for (int ch = width + threadIdx.x; ch < hadamard_size(width); ch += blockDim.x) x[ch] = 0.f;
        __syncthreads();
        if (threadIdx.x < 32) store_fp4_key(reinterpret_cast<unsigned char*>(dst), x, width, threadIdx.x);
    }
}
