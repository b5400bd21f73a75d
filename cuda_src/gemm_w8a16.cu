// dsv4rt-instantiate: w8a16_gemm
#include "common.cuh"
#include "fp8.cuh"
#include "moe.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// The faithful-mode output projection wo_a of prefill batches (docs/numerics.md#act-quant: its input is not
// quantised) on Hopper's warpgroup MMA, the many-row counterpart of fp8_skinny_gemm's W8A16 form: the checkpoint's
// e4m3 weight is widened to bf16 in registers, step by step, instead of being expanded whole into a scratch buffer
// for cuBLAS. Each weight value is dequantize_weight's (the e4m3 value times its e8m0 tile scale, rounded once to
// bf16), the activations are bf16, so every product is exact and the sums are fp32.
//
// The weight is wgmma's register operand and x its shared-memory operand (yᵀ = w · xᵀ), so that widened values never
// pass through shared memory (a widening there stores them and both warpgroups' wgmma read them back, on top of the
// copies and the other operand), and a block of kW8Rows = 256 rows of x widens each weight value once for 256 rows. A
// block takes kW8Cols weight rows of its group (one 128-row scale block; each warpgroup 64 of them, wgmma m64n256k16)
// against kW8Rows rows of x, over k in steps of kW8K. Every thread copies with cp.async, kW8Stages - 2 steps ahead, x
// rows into the 128-byte swizzle wgmma reads and weight bytes into a raw stage laid out for the fragments (raw_at);
// each k16 of a step is widened from two 16-byte loads a k32 and handed to wgmma as its own commit group, so that three
// k16 are queued on the tensor cores while the next is widened. Weight rows 2i and 2i + 1 of a warp's 16 are its
// fragment rows i and i + 8, so that a thread holds adjacent output columns and stores bf16 pairs.
constexpr int kW8Rows = 256, kW8Cols = 128, kW8K = 64, kW8Stages = 5, kW8Threads = 256;
static_assert(kW8Rows == 256 && kW8Cols == kFp8Block && kW8K == 64 && kW8Threads == 256, "the copy and fragment maps");
constexpr int kW8XBytes = kW8Rows * kW8K * 2, kW8RawBytes = kW8Cols * kW8K;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Where word `word` (4 codes, k = 4·word..) of a step's weight row r lands in the raw stage. Word 2h + p is word p
// of k group h (8 codes); fragment thread q takes codes 2q, 2q + 1 of every group, all in word q / 2, so a row keeps
// its eight words p = 0, then its eight words p = 1 (16-byte chunk 2p + h / 4), two rows a 128-byte line whose
// chunks are swizzled by the line as wgmma's tiles are: a warp's loads and copies meet no bank conflicts.
__device__ __forceinline__ unsigned raw_at(int r, int word) {
    const int h = word >> 1, p = word & 1;
    return swizzled(r >> 1, 4 * (r & 1) + 2 * p + (h >> 2)) + 4 * (h & 3);
}

// Codes 2i, 2i + 1 of an e4m3 word (sel 0x9180: i = 0, 0xb3a2: i = 1) in widen_e4m3x2's bf16 bits, which read the
// values times 2^-120: prmt puts each code in the low byte of its half and its sign in the high byte, so that one
// shift and one mask leave sign, exponent and mantissa where bf16 keeps them. A NaN code reads ±480·2^-120.
__device__ __forceinline__ unsigned e4m3x2_bits(unsigned word, unsigned sel) {
    unsigned v;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(word), "r"(0u), "r"(sel));
    return (v << 4) & 0x87f087f0u;
}

// Keeps the compiler from moving a write of v past this point: wgmma_fence must follow every write of a wgmma's
// register operands.
__device__ __forceinline__ void pin(unsigned& v) { asm volatile("" : "+r"(v)); }

__device__ __forceinline__ __nv_bfloat162 as_bf16x2(unsigned v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }
__device__ __forceinline__ unsigned as_u32(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }
#endif

// y [m, groups·n] = for each group g (blockIdx.z): x[:, g·k..] · dequant(w[g·n..])ᵀ into columns g·n..; x bf16
// [m, groups·k], w e4m3 [groups·n, k] with e8m0 scales w_scale [groups·n / 128, k / 128]. Grid (n / kW8Cols,
// ceil(m / kW8Rows), groups), kW8Threads threads, dynamic shared memory for kW8Stages stages of x and raw weight
// bytes and 1024 more to align the swizzled tiles. n and k are multiples of 128, x and w 16-byte aligned, y 4-byte.
__global__ void __launch_bounds__(kW8Threads, 1)
    w8a16_gemm(__nv_bfloat16* y, const __nv_bfloat16* x, const unsigned char* w, const unsigned char* w_scale, int m,
               int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = __nv_bfloat16;
    constexpr int X_COPIES = kW8Rows * 8 / kW8Threads, W_COPIES = kW8Cols * (kW8K / 4) / kW8Threads;
    constexpr int STAGE = kW8XBytes + kW8RawBytes;  // a multiple of 1024
    extern __shared__ unsigned char smem_raw[];
    const SmemBase aligned = smem_base_1024(smem_raw);
    const unsigned base = aligned.addr;
    const unsigned char* stages = aligned.ptr;  // generic address of base

    const int groups = gridDim.z, group = blockIdx.z, steps = k / kW8K;
    const int row0 = blockIdx.y * kW8Rows, col0 = blockIdx.x * kW8Cols;
    const int t = threadIdx.x, wg = t >> 7, warp = t >> 5 & 3, g = t >> 2 & 7, q = t & 3;
    // x: thread t copies chunk t % 8 of tile rows t / 8 + 32i, rows past m as zeros (rows 32 apart share a swizzle).
    const T* x_src[X_COPIES];
    bool x_ok[X_COPIES];
    tile_sources(x_src, x_ok, x, nullptr, 1, row0 + (t >> 3), m, groups * k, group * k + (t & 7) * 8);
    const unsigned x_at = swizzled(t >> 3, t & 7);
    // w: thread t copies word t % 16 of weight rows t / 16 + 16i (rows 16 apart share their place in a line).
    const unsigned char* w_src = w + static_cast<size_t>(group * n + col0 + (t >> 4)) * k + 4 * (t & 15);
    const unsigned w_at = kW8XBytes + raw_at(t >> 4, t & 15);
    const unsigned char* scales = w_scale + static_cast<size_t>((group * n + col0) / kFp8Block) * (k / kFp8Block);
    constexpr int steps_ahead = kW8Stages - 2;

    auto load = [&](int step) {  // always commits a group, empty past the last step, so that the waits count alike
        if (step < steps) {
            const unsigned stage = base + (step % kW8Stages) * STAGE;
            const int k0 = step * kW8K;
#pragma unroll
            for (int i = 0; i < X_COPIES; ++i)
                cp_async16_or_zero(stage + x_at + 32 * i * 128, x_src[i] + k0, x_ok[i]);
#pragma unroll
            for (int i = 0; i < W_COPIES; ++i)
                cp_async4_or_zero(stage + w_at + 16 * i * kW8K, w_src + static_cast<size_t>(16 * i) * k + k0, true);
        }
        cp_async_commit();
    };

    // Fragment thread (g, q) of warp `warp` holds weight rows 2g (fragment row g) and 2g + 1 (row g + 8) of the
    // warp's 16 in its warpgroup's 64, and of every k16 codes 2q, 2q + 1 (registers 0, 1) and 8 + 2q, 9 + 2q
    // (registers 2, 3): word q / 2 of the k groups, in chunk 2·(q / 2) + k32 half of the row (raw_at).
    const unsigned frag_line = (32 * wg + 8 * warp + g) * 128, frag_chunk = 2 * (q >> 1) ^ g;
    const unsigned sel = q & 1 ? 0xb3a2u : 0x9180u;
    float acc[128];
    unsigned frag[4][4];  // [k16 of the step][register]
    // Each fragment row's largest and smallest bits, starting from the extremes -480·2^-120 and 480·2^-120: either
    // at ±480·2^-120 marks a NaN code (magnitude 0x7f), which makes the row's output column NaN in every row of y.
    unsigned hi[2] = {0x87f087f0u, 0x87f087f0u}, lo[2] = {0x07f007f0u, 0x07f007f0u};
#pragma unroll
    for (int s = 0; s < steps_ahead; ++s) load(s);
    // a step's scale byte is read a step ahead, so that it has landed when its widening starts
    unsigned scale_byte = __ldg(scales);
    for (int step = 0; step < steps; ++step) {
        const unsigned next_scale_byte = __ldg(scales + min(step + 1, steps - 1) * kW8K / kFp8Block);
        cp_async_wait<steps_ahead - 1>();
        fence_proxy_async();
        // Every thread's copies of this step have landed, and every warpgroup is done with step - 2 (the
        // wgmma_wait<3> below), whose stage the next load takes.
        __syncthreads();
        load(step + steps_ahead);
        const unsigned stage = base + (step % kW8Stages) * STAGE;
        // x's tile as wgmma's b; k16 c starts 32 bytes on, 2 more in the descriptor's address field
        const unsigned long long x_desc = smem_desc(stage);
        const unsigned char* raw = stages + (stage - base) + kW8XBytes + frag_line;
        // Scale byte s <= 134: the bits (the code's value times 2^-120) times 2^(s - 7), a normal bf16, is the
        // exact product rounded once, dequantize_weight's value; larger bytes (255: NaN) multiply by
        // widen_e4m3x2's 2^120 and then by the scale, as e4m3x8_scaled does.
        const bool folded = scale_byte <= 134;
        const unsigned first = folded ? (scale_byte + 120) * 0x00800080u : 0x7b807b80u;
        const __nv_bfloat162 second = e8m0_bf16x2(scale_byte);
        uint4 v[2];  // fragment rows g, g + 8: the k32 half's four words
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (c % 2 == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    v[r] = *reinterpret_cast<const uint4*>(raw + (((4 * r + c / 2) ^ frag_chunk) << 4));
            }
            // frag[c] last fed k16 c of step - 1: done, by the wgmma_wait<3> after the k16 before this one
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int i = 0; i < 2; ++i) {  // k group 2c + i: codes 2q, 2q + 1 of k16 c, or 8 on
                    const unsigned b = e4m3x2_bits(word(v[r], 2 * (c % 2) + i), sel);
                    hi[r] = as_u32(__hmax2(as_bf16x2(hi[r]), as_bf16x2(b)));
                    lo[r] = as_u32(__hmin2(as_bf16x2(lo[r]), as_bf16x2(b)));
                    frag[c][2 * i + r] = as_u32(__hmul2_rn(as_bf16x2(b), as_bf16x2(first)));
                }
            if (!folded) {
#pragma unroll
                for (int j = 0; j < 4; ++j) frag[c][j] = as_u32(__hmul2_rn(as_bf16x2(frag[c][j]), second));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) pin(frag[c][j]);
            wgmma_fence();
            wgmma_bf16_m64n256k16_rs(acc, frag[c], x_desc + 2 * c, step > 0 || c > 0);
            wgmma_commit();
            wgmma_wait<3>();
        }
        scale_byte = next_scale_byte;
    }
    wgmma_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the four threads of a quad hold a row's k positions between them
        unsigned nan = ((hi[r] & 0x7fff7fffu) + 0x00100010u | (lo[r] & 0x7fff7fffu) + 0x00100010u) & 0x08000800u;
        nan |= __shfl_xor_sync(~0u, nan, 1);
        nan |= __shfl_xor_sync(~0u, nan, 2);
        if (nan) {
#pragma unroll
            for (int j = 0; j < 32; ++j) acc[4 * j + 2 * r] = acc[4 * j + 2 * r + 1] = __int_as_float(0x7fc00000);
        }
    }
    const size_t ld = static_cast<size_t>(groups) * n;
    T* out = y + (row0 + 2 * q) * ld + group * n + col0 + 64 * wg + 16 * warp + 2 * g;
    const int rows = m - row0 - 2 * q;
#pragma unroll
    for (int j = 0; j < 32; ++j, out += 8 * ld)
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // d[4j + c]: weight row 2g, x row 8j + 2q + c; d[4j + 2 + c]: row 2g + 1
            if (8 * j + c < rows)
                *reinterpret_cast<__nv_bfloat162*>(out + c * ld) =
                    __floats2bfloat162_rn(acc[4 * j + c], acc[4 * j + 2 + c]);
        }
#else
    __trap();
#endif
}
