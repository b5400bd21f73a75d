// dsv4rt-instantiate: rmsnorm<float> rmsnorm<__nv_bfloat16>
#include "common.cuh"

// 16-byte vectors per thread held in registers between the two passes: a row of up to
// kRmsVecs * kVec<T> * blockDim.x elements is read from memory once. Launch that many threads,
// dim / (kRmsVecs * kVec<T>) rounded up to a multiple of 32 (128 for 4096 bf16): bigger blocks
// leave registers idle and lower occupancy (8192 x 4096 bf16 on H200: 3.6 TB/s with 128, 1.8 with 512).
constexpr int kRmsVecs = 4;

// out = x * rsqrt(mean(x^2) + eps) * weight per row of `dim`; weight may be nullptr, out may be x.
// One block per row, rows past gridDim.x taken in strides; misaligned or odd shapes go scalar.
template <typename T>
__global__ void __launch_bounds__(1024) rmsnorm(T* out, const T* x, const float* weight, int rows, int dim, float eps) {
    constexpr int V = kVec<T>;
    const bool vec = dim % V == 0 && aligned16(out) && aligned16(x) && aligned16(weight);
    const int tile = kRmsVecs * V * blockDim.x;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + static_cast<size_t>(row) * dim;
        T* yr = out + static_cast<size_t>(row) * dim;
        float v[kRmsVecs][V];
        auto load_tile = [&](int t) {
#pragma unroll
            for (int r = 0; r < kRmsVecs; ++r) {
                const int i = t + (r * blockDim.x + threadIdx.x) * V;
                if (i < dim) load_vec(xr + i, v[r]);
            }
        };
        float ss = 0.f;
        if (vec) {
            for (int t = 0; t < dim; t += tile) {
                load_tile(t);
#pragma unroll
                for (int r = 0; r < kRmsVecs; ++r)
                    if (t + (r * blockDim.x + threadIdx.x) * V < dim)
#pragma unroll
                        for (int j = 0; j < V; ++j) ss += v[r][j] * v[r][j];
            }
        } else {
            for (int i = threadIdx.x; i < dim; i += blockDim.x) {
                const float s = to_float(xr[i]);
                ss += s * s;
            }
        }
        const float scale = rsqrtf(block_sum(ss) / dim + eps);
        if (vec) {
            for (int t = 0; t < dim; t += tile) {
                if (dim > tile) load_tile(t);
#pragma unroll
                for (int r = 0; r < kRmsVecs; ++r) {
                    const int i = t + (r * blockDim.x + threadIdx.x) * V;
                    if (i >= dim) continue;
                    float w[V];
                    if (weight) load_vec(weight + i, w);
#pragma unroll
                    for (int j = 0; j < V; ++j) v[r][j] = weight ? v[r][j] * scale * w[j] : v[r][j] * scale;
                    store_vec(yr + i, v[r]);
                }
            }
        } else {
            for (int i = threadIdx.x; i < dim; i += blockDim.x) {
                const float s = to_float(xr[i]) * scale;
                yr[i] = from_float<T>(weight ? s * weight[i] : s);
            }
        }
    }
}
