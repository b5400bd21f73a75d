// dsv4rt-instantiate: moe_gemm_mma<true> moe_gemm_mma<false>
#include "common.cuh"
#include "moe.cuh"

// The grouped expert GEMM of moe.cu's moe_gemm for the bf16 build on the tensor cores (prefill, and decode batches
// past the skinny kernel's rows): the same operands, tiles and results, bf16 mma.sync m16n8k16 with fp32
// accumulation. A block takes kMmaRows sorted rows and kMmaCols weight rows (GATED: 128 columns of w1 and of w3,
// interleaved 8 by 8 so that a thread holds g and u of the same element; else 256 columns) over k in steps of
// kMmaK, kMmaStages steps in flight through cp.async. Warp w multiplies all rows by weight rows 64·w.. with the
// ldmatrix lane addressing of attention_mqa.cu (rows of kMmaStride elements: the 8 row addresses of an ldmatrix
// fall on distinct banks). A warp's 64 × 64 tile takes 8 ldmatrix for 32 mma: with 32 × 64 (6 for 16) shared
// memory bandwidth bounded the kernel (H200, flash-slice 8K prefill: 222 TFLOP/s).
constexpr int kMmaRows = 64, kMmaCols = 256, kMmaK = 32, kMmaStages = 4, kMmaWarps = 4;
constexpr int kMmaTiles = kMmaRows / 16;  // m16 tiles of a warp
constexpr int kMmaStride = kMmaK + 8;
constexpr int kMmaStageElems = (kMmaRows + kMmaCols) * kMmaStride;

// Arguments as moe_gemm<__nv_bfloat16, kMmaRows, GATED> (moe_sort with tile_rows kMmaRows); grid
// (ceil(n / (GATED ? 64 : 128)), row tiles), block kMmaWarps · 32, dynamic shared memory kMmaStages ·
// kMmaStageElems · 2 bytes. n and k must be multiples of 64, a and the weights 16-byte aligned.
template <bool GATED>
__global__ void __launch_bounds__(kMmaWarps * 32)
    moe_gemm_mma(__nv_bfloat16* out, const __nv_bfloat16* a, const int* perm, int active, const float* weight,
                 const unsigned long long* w_first, const unsigned long long* w_second, const int* offsets,
                 const int* tile_offsets, int experts, int n, int k, float limit) {
    using T = __nv_bfloat16;
    constexpr int A_COPIES = kMmaRows * kMmaK / 8 / (kMmaWarps * 32);  // 16-byte copies a thread makes per step
    constexpr int B_COPIES = kMmaCols * kMmaK / 8 / (kMmaWarps * 32);
    constexpr int COLS = GATED ? kMmaCols / 2 : kMmaCols;  // output columns of a block
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sa = reinterpret_cast<T*>(smem_raw);           // [stage][kMmaRows][kMmaStride]
    T* sb = sa + kMmaStages * kMmaRows * kMmaStride;  // [stage][kMmaCols][kMmaStride]

    const int tile = blockIdx.y;
    if (tile >= tile_offsets[experts]) return;
    const int e = tile_expert(tile_offsets, experts, tile);
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kMmaRows, row_end = offsets[e + 1];
    const int col0 = blockIdx.x * COLS;

    // Thread t copies 16-byte part t % 4 of tile rows t / 4 + 32i. Rows past the expert or past n read nothing
    // and land as zeros.
    const int part = (threadIdx.x & 3) * 8, copy_row = threadIdx.x >> 2;
    const T* a_src[A_COPIES];
    bool a_ok[A_COPIES];
    tile_sources(a_src, a_ok, a, perm, active, row0 + copy_row, row_end, k, part);
    const T* b_src[B_COPIES];
    bool b_ok[B_COPIES];
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        b_src[i] = reinterpret_cast<const T*>(
            tile_weight_row<GATED>(w_first, w_second, e, copy_row + 32 * i, col0, n, 2 * k, b_ok[i]) + 2 * part);
    }
    const unsigned sa_copy = smem_u32(sa + copy_row * kMmaStride + part);
    const unsigned sb_copy = smem_u32(sb + copy_row * kMmaStride + part);
    const int steps = k / kMmaK;
    auto load = [&](int step) {  // always commits a group, empty past the last step, so that the waits count alike
        if (step < steps) {
            const int slot = step % kMmaStages, k0 = step * kMmaK;
#pragma unroll
            for (int i = 0; i < A_COPIES; ++i)
                cp_async16_or_zero(sa_copy + (slot * kMmaRows + 32 * i) * kMmaStride * 2, a_src[i] + k0, a_ok[i]);
#pragma unroll
            for (int i = 0; i < B_COPIES; ++i)
                cp_async16_or_zero(sb_copy + (slot * kMmaCols + 32 * i) * kMmaStride * 2, b_src[i] + k0, b_ok[i]);
        }
        cp_async_commit();
    };

    const int lane = threadIdx.x & 31, wn = threadIdx.x >> 5;
    const int g = lane >> 2, l4 = lane & 3;
    // ldmatrix lane addresses: A rows 16 at a time (16 x 16 fragments), weight rows as the B operand (8 rows x 16 k
    // per fragment, two fragments per x4).
    const unsigned a_addr = smem_u32(sa + (lane & 15) * kMmaStride + 8 * (lane >> 4));
    const unsigned b_addr =
        smem_u32(sb + (wn * 64 + (lane & 7) + 8 * (lane >> 4)) * kMmaStride + 8 * ((lane >> 3) & 1));

    // acc[mi][nt]: rows 16·mi + g, + 8 × weight rows 64·wn + 8·nt + 2·l4, +1 of the tile.
    float acc[kMmaTiles][8][4];
#pragma unroll
    for (int mi = 0; mi < kMmaTiles; ++mi)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][nt][c] = 0.f;

#pragma unroll
    for (int s = 0; s < kMmaStages - 1; ++s) load(s);
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<kMmaStages - 2>();
        __syncthreads();  // step landed for every thread; step - 1 is consumed, its slot free for step + stages - 1
        load(step + kMmaStages - 1);
        const int slot = step % kMmaStages;
        const unsigned a_slot = a_addr + slot * kMmaRows * kMmaStride * 2;
        const unsigned b_slot = b_addr + slot * kMmaCols * kMmaStride * 2;
#pragma unroll
        for (int ks = 0; ks < kMmaK / 16; ++ks) {
            unsigned af[kMmaTiles][4];
#pragma unroll
            for (int mi = 0; mi < kMmaTiles; ++mi) ldmatrix_x4(af[mi], a_slot + (mi * 16 * kMmaStride + ks * 16) * 2);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned b[4];
                ldmatrix_x4(b, b_slot + (j * 16 * kMmaStride + ks * 16) * 2);
#pragma unroll
                for (int mi = 0; mi < kMmaTiles; ++mi) {
                    mma<Mma::bf16>(acc[mi][2 * j], af[mi][0], af[mi][1], af[mi][2], af[mi][3], b[0], b[1]);
                    mma<Mma::bf16>(acc[mi][2 * j + 1], af[mi][0], af[mi][1], af[mi][2], af[mi][3], b[2], b[3]);
                }
            }
        }
    }

#pragma unroll
    for (int mi = 0; mi < kMmaTiles; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mi * 16 + g + 8 * h;
            if (row >= row_end) continue;
            T* out_row = out + static_cast<size_t>(row) * n;
            if constexpr (GATED) {
                // the warp's weight rows 8·nt..: w1 (nt even) and w3 (nt odd) of columns 32·wn + 8·(nt / 2)..
                const float scale = weight[perm[row]];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const int col = col0 + wn * 32 + p * 8 + 2 * l4;
                    float v[2];
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float gv = fminf(acc[mi][2 * p][2 * h + c], limit);
                        const float uv = fminf(fmaxf(acc[mi][2 * p + 1][2 * h + c], -limit), limit);
                        v[c] = gv * sigmoid(gv) * uv * scale;
                    }
                    if (col < n) *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(v[0], v[1]);
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    const int col = col0 + wn * 64 + nt * 8 + 2 * l4;
                    if (col < n)
                        *reinterpret_cast<__nv_bfloat162*>(out_row + col) =
                            __floats2bfloat162_rn(acc[mi][nt][2 * h], acc[mi][nt][2 * h + 1]);
                }
            }
        }
}
