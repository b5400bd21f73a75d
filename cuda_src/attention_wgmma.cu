// dsv4rt-instantiate: sparse_attention_wgmma<false> sparse_attention_wgmma<true>
#include "attention_keys.cuh"
#include "kv_fp8.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

// attention_mqa.cu's sparse attention on Hopper's warpgroup MMA, for steps with a block per row (no split): the 64
// heads of a query row are wgmma's m; keys come in blocks of 64 K = V rows, taken in pairs. Warpgroup 0 owns the
// even block of a pair and head dims 0 .. 255, warpgroup 1 the odd block and dims 256 .. 511. Each scores its block
// against the whole q (m64n64, k = 512); warpgroup 0's row maxima go to warpgroup 1, which folds in its own and
// sends back the pair's maxima, so both keep the same softmax state. Each adds its own P (registers) times its
// block's half of V, then the partner's P (shared memory) times the partner block's half (m64n256, V read MN-major
// from the key tile). Each denominator counts its own keys; the halves meet in the epilogue.
// A third warpgroup copies q and the key blocks (fp8 entries widened to bf16 in place) into two tiles, each in
// two halves of four 64-dim slabs with their own full and empty mbarriers, so that a half is refilled as soon as
// its last reader is done: the even block's low half after warpgroup 0's own P·V, its high half after warpgroup 1's
// P·V with the partner's P, and the mirror image for the odd block (docs/kernels.md#tensor-cores-for-many-rows).
// Shared tiles are 128-byte rows in the 128-byte swizzle: q and every key tile as 8 slabs of 64 dims.
constexpr int kWgaHd = 512, kWgaRd = 64, kWgaHeads = 64, kWgaKeys = 64, kWgaThreads = 384;
constexpr int kWgaSlab = kWgaKeys * 128, kWgaTileBytes = kWgaKeys * kWgaHd * 2, kWgaQBytes = kWgaHeads * kWgaHd * 2;
constexpr int kWgaPBytes = kWgaHeads * kWgaKeys * 2;
constexpr int kWgaMiscBytes = 1024;  // row maxima, row sums of both warpgroups, key flags of both tiles, 9 mbarriers
static_assert(4 * kWgaHeads + 8 * kWgaHeads + 2 * kWgaKeys + 9 * 8 <= kWgaMiscBytes, "the launcher's 1024");
static_assert(1024 + kWgaQBytes + 2 * kWgaTileBytes + 2 * kWgaPBytes + kWgaMiscBytes <= 227 * 1024,
              "a block's shared memory");
constexpr int kWgaConsumerRegs = 216, kWgaProducerRegs = 72;
static_assert(fits_launch_registers(256, kWgaConsumerRegs, 128, kWgaProducerRegs), "setmaxnreg's budget");
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float fast_exp2(float x) {  // 2^x, +0 at -inf
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Named barriers, ids past __syncthreads' 0: between the consumer warpgroups (256 threads), and the producer
// warpgroup's own (kWidening, 128 threads).
enum WgaBarrier { kMax0 = 1, kMax1, kP0Ready, kP1Ready, kSums, kWidening };

// Arguments as sparse_attention_mqa (attention_mqa.cu) without the split outputs, hd = kWgaHd, heads <= kWgaHeads
// a block. grid (rows, ceil(heads / kWgaHeads)), kWgaThreads threads, dynamic shared memory 1024 (alignment) + q
// + two key tiles + two P tiles + kWgaMiscBytes (row statistics, key flags, mbarriers).
template <bool Fp8Kv>
__global__ void __launch_bounds__(kWgaThreads, 1)
sparse_attention_wgmma(__nv_bfloat16* out, const __nv_bfloat16* q, const int* positions, const int* req,
                       const float* sink, const float* inv_freq,
                       const char* win_base, const long long* win_pages, const int* win_start, int win_per_page,
                       int win_bytes, const char* cmp_base, const long long* cmp_pages, const int* cmp_start,
                       int cmp_per_page, int cmp_bytes, const int* selected, int top_k, int ratio, int window,
                       int heads, int rd, float scale, const char* step_rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int hd = kWgaHd;
    extern __shared__ unsigned char smem_raw[];
    const SmemBase aligned = smem_base_1024(smem_raw);
    const unsigned base = aligned.addr;
    unsigned char* smem = aligned.ptr;  // generic address of base
    const unsigned qs = base, tiles = qs + kWgaQBytes, ps = tiles + 2 * kWgaTileBytes;
    unsigned char* tiles_g = smem + kWgaQBytes;
    unsigned char* ps_g = tiles_g + 2 * kWgaTileBytes;
    float* row_max = reinterpret_cast<float*>(ps_g + 2 * kWgaPBytes);  // [head]: the pair's maxima, log2 units
    float* row_sum = row_max + kWgaHeads;                              // [warpgroup][head]
    bool* present = reinterpret_cast<bool*>(row_sum + 2 * kWgaHeads);  // [tile][key]
    const unsigned bars = smem_u32(present + 2 * kWgaKeys);            // q, then full and empty of half (tile, h)
    const auto full = [&](int tile, int h) { return bars + 8 + 8 * (2 * tile + h); };
    const auto empty = [&](int tile, int h) { return bars + 40 + 8 * (2 * tile + h); };

    const int t = blockIdx.x, h0 = blockIdx.y * kWgaHeads, m = positions[t];
    const Candidates cand = row_candidates(t, req[t], m, win_base, win_pages, win_start, win_per_page, win_bytes,
                                           cmp_base, cmp_pages, cmp_start, cmp_per_page, cmp_bytes, selected, top_k,
                                           ratio, window, step_rows, req);
    const int n_blocks = (cand.count + kWgaKeys - 1) / kWgaKeys, n_pairs = (n_blocks + 1) / 2;
    const int block_heads = min(kWgaHeads, heads - h0);
    const long long row0 = static_cast<long long>(t) * heads + h0;
    if (n_blocks == 0) {  // no key: zeros
        for (int i = threadIdx.x; i < block_heads * hd / 8; i += blockDim.x)
            reinterpret_cast<uint4*>(out + row0 * hd)[i] = make_uint4(0, 0, 0, 0);
        return;
    }
    if (threadIdx.x == 0) {
        mbar_init(bars, kWgaThreads / 3);  // the producer's copies of q
        for (int i = 0; i < 4; ++i) {
            mbar_init(full(i >> 1, i & 1), Fp8Kv ? kWgaThreads / 3 : 2 * kWgaThreads / 3);
            mbar_init(empty(i >> 1, i & 1), 4);  // one warpgroup's four warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp >= 8) {
        setmaxnreg_dec<kWgaProducerRegs>();
        // Thread (g, i) copies 16-byte chunk i of slab c of rows g + 16r: eight threads read a row's 128 bytes.
        const int pt = threadIdx.x - 256, g = pt >> 3, i = pt & 7;
        const __nv_bfloat16* q_row = q + row0 * hd;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int head = g + 16 * r;
#pragma unroll
            for (int c = 0; c < 8; ++c)
                cp_async16_or_zero(qs + c * (kWgaHeads * 128) + swizzled(head, i),
                                   q_row + (head < block_heads ? head * hd + (8 * c + i) * 8 : 0), head < block_heads);
        }
        mbar_arrive_on_copies(bars);
        const auto source = [&](int n, int r) {  // row g + 16r of block n: its entry, or none
            const int k = n * kWgaKeys + g + 16 * r;
            return n < n_blocks && k < cand.count ? cand.entry(k) : nullptr;
        };
        if constexpr (!Fp8Kv) {
            // Half h (slabs 4h .. 4h + 3) of block n into tile n % 2; the first half of a block written also sets
            // the block's key flags. Absent keys and those past the count land as zeros, whose P·V terms vanish.
            const auto load_half = [&](int n, int h, bool flags) {
                const int tile = n & 1;
                mbar_wait(empty(tile, h), ((n >> 1) & 1) ^ 1);  // a fresh barrier passes parity 1 at once
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int key = g + 16 * r;
                    const char* src = source(n, r);
                    if (flags && i == 0) present[tile * kWgaKeys + key] = src != nullptr;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int slab = 4 * h + c;
                        cp_async16_or_zero(tiles + tile * kWgaTileBytes + slab * kWgaSlab + swizzled(key, i),
                                           src ? src + (8 * slab + i) * 16 : win_base, src != nullptr);
                    }
                }
                mbar_arrive_on_copies(full(tile, h));
                mbar_arrive(full(tile, h));
            };
            // The order in which the halves are freed: the even block's low half, the odd one's high, then the rest.
            for (int p = 0; p < n_pairs; ++p) {
                const bool odd = 2 * p + 1 < n_blocks;
                load_half(2 * p, 0, true);
                if (odd) load_half(2 * p + 1, 1, true);
                load_half(2 * p, 1, false);
                if (odd) load_half(2 * p + 1, 0, false);
            }
        } else {
            // fp8 entries (kv_fp8.cuh: nope dim d's code at d, the rope dims as bf16 at nope, the scale of dims
            // 64b .. at nope + 2·kWgaRd + b) land in their half tile and are widened in place: the scale words in its
            // first 4 KiB, the codes of its slab c (c < 3, or 4 when h = 0) 4 KiB each from kRawAt[h], each thread's
            // chunks in slots of its own; the rope slab (7) is bf16 already and goes straight to its place. A half's
            // copies are in flight while the one before it is widened, except the first half of a pair, which waits
            // for its buffer's last readers, and they for the half before it.
            constexpr int nope = kWgaHd - kWgaRd, kRawAt[2] = {16384, 12288};
            const int full_pairs = n_blocks / 2, halves = 4 * full_pairs + 2 * (n_blocks & 1);
            const auto block_of = [&](int x) { return x < 4 * full_pairs ? 2 * (x >> 2) + (x & 1) : n_blocks - 1; };
            const auto half_of = [&](int x) { return x < 4 * full_pairs ? ((x & 3) + 1) >> 1 & 1 : x - 4 * full_pairs; };
            const auto pair_start = [&](int x) { return x < 4 * full_pairs ? (x & 3) == 0 : x == 4 * full_pairs; };
            const auto slot = [&](int r) { return (r * 128 + pt) * 8; };
            const auto issue = [&](int x) {
                const int n = block_of(x), h = half_of(x), tile = n & 1;
                const unsigned at = tiles + tile * kWgaTileBytes + 4 * h * kWgaSlab;
                mbar_wait(empty(tile, h), ((n >> 1) & 1) ^ 1);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int key = g + 16 * r;
                    const char* e = source(n, r);
                    if (tile == h && i == 0) present[tile * kWgaKeys + key] = e != nullptr;  // the block's first half
                    cp_async8_or_zero(at + slot(r), e ? e + nope + 2 * kWgaRd : win_base, e != nullptr);
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int slab = 4 * h + c;
                        if (slab < 7) {
                            cp_async8_or_zero(at + kRawAt[h] + 4096 * c + slot(r), e ? e + (8 * slab + i) * 8 : win_base,
                                              e != nullptr);
                        } else {
                            const unsigned dst = at + 3 * kWgaSlab + swizzled(key, i);
                            cp_async8_or_zero(dst, e ? e + nope + 16 * i : win_base, e != nullptr);
                            cp_async8_or_zero(dst + 8, e ? e + nope + 16 * i + 8 : win_base, e != nullptr);
                        }
                    }
                }
                cp_async_commit();
            };
            const auto widen = [&](int x) {  // every producer thread: a named barrier between its reads and writes
                const int n = block_of(x), h = half_of(x), tile = n & 1;
                unsigned char* at = tiles_g + tile * kWgaTileBytes + 4 * h * kWgaSlab;
                uint2 codes[4][4];
                unsigned scales[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const uint2 w = *reinterpret_cast<const uint2*>(at + slot(r));
                    scales[r] = h ? w.y : w.x;  // the bytes of slabs 4h .. 4h + 3
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        if (4 * h + c < 7) codes[r][c] = *reinterpret_cast<const uint2*>(at + kRawAt[h] + 4096 * c + slot(r));
                }
                bar_sync(kWidening, kWgaThreads / 3);  // every thread holds its codes: the slabs may cover them
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        if (4 * h + c < 7)
                            *reinterpret_cast<uint4*>(at + c * kWgaSlab + swizzled(g + 16 * r, i)) =
                                e4m3x8_scaled(codes[r][c].x, codes[r][c].y, e8m0_bf16x2(scales[r] >> 8 * c & 0xffu));
                fence_proxy_async();  // this thread's stores and copies become visible to the consumers' wgmma
                mbar_arrive(full(tile, h));
            };
            if (halves > 0) issue(0);
            for (int x = 0; x < halves; ++x) {
                const bool ahead = x + 1 < halves && !pair_start(x + 1);
                if (ahead) {
                    issue(x + 1);
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                widen(x);
                if (!ahead && x + 1 < halves) issue(x + 1);
            }
        }
        cp_async_commit();  // the bf16 path's copies are in no group yet: wait_group waits on committed ones
        cp_async_wait<0>();  // no copy outlives its thread
        return;
    }
    setmaxnreg_inc<kWgaConsumerRegs>();

    // wgmma under a branch that ptxas cannot prove warp-uniform is serialized: shuffled values are uniform.
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), l4 = lane & 3;
    const int n_blocks_u = __shfl_sync(0xffffffffu, n_blocks, 0), n_pairs_u = (n_blocks_u + 1) / 2;
    const int row_a = (warp & 3) * 16 + (lane >> 2);  // heads row_a (d[4j], d[4j + 1]) and row_a + 8
    const unsigned own = tiles + wg * kWgaTileBytes, other = tiles + (wg ^ 1) * kWgaTileBytes;
    const unsigned v_half = 4 * wg * kWgaSlab;  // this warpgroup's head dims in every tile
    const float c = scale * kLog2e;
    float o[128], s[32], mx[2], l[2];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the sink enters as a key of value zero: max sink, sum 1, counted once
        const int h = row_a + 8 * i;
        const float sk = h < block_heads ? sink[h0 + h] * kLog2e : 0.f;
        mx[i] = fmaxf(sk, -3.402823466e38f);  // finite, so that no rescale below is exp2(-inf - -inf)
        l[i] = wg == 0 && l4 == 0 && sk != neg_inf() ? 1.f : 0.f;
    }
    // S (+)= q · Kᵀ over half h of this warpgroup's tile (warpgroup 0 scores the low half first, 1 the high half:
    // their order of arrival), left in flight.
    const auto score_half = [&](int p, int h) {
        mbar_wait(full(wg, h), p & 1);
        fence_proxy_async();
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int slab = 4 * h + (k >> 2), at = 32 * (k & 3);
            wgmma_bf16_m64n64k16(s, smem_desc(qs + slab * (kWgaHeads * 128) + at),
                                 smem_desc(own + slab * kWgaSlab + at), h != wg || k > 0);
        }
        wgmma_commit();
    };
    // o += P · V over this warpgroup's head dims of `tile`, P from registers (a) or the partner's shared tile.
    const auto pv_own = [&](const unsigned (&a)[4][4]) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
            wgmma_bf16_m64n256k16_rs<1>(o, a[k], smem_desc_mn(own + v_half + 16 * k * 128, kWgaSlab), 1);
        wgmma_commit();
    };
    const auto pv_partner = [&](int p) {
        mbar_wait(full(wg ^ 1, wg), p & 1);
        fence_proxy_async();
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
            wgmma_bf16_m64n256k16<1>(o, smem_desc(ps + (wg ^ 1) * kWgaPBytes + 32 * k),
                                  smem_desc_mn(other + v_half + 16 * k * 128, kWgaSlab), 1);
        wgmma_commit();
    };
    const auto rescale = [&](const float (&a)[2]) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[i] *= a[i];
#pragma unroll
            for (int j = 0; j < 32; ++j) o[4 * j + 2 * i] *= a[i], o[4 * j + 2 * i + 1] *= a[i];
        }
    };
    // s[4j + c]: key 8j + 2·l4 + c % 2 of the block for head row_a + 8·(c / 2); masked, scaled to log2 units,
    // and each row's maximum over the block (-inf when none is present).
    const auto block_max = [&](float (&top)[2]) {
        const bool* flags = present + wg * kWgaKeys;
        top[0] = top[1] = neg_inf();
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * j + e] = flags[8 * j + 2 * l4 + (e & 1)] ? s[4 * j + e] * c : neg_inf();
                top[e >> 1] = fmaxf(top[e >> 1], s[4 * j + e]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 1));
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffffu, top[i], 2));
        }
    };
    // P = exp2(s - mx) into s and as wgmma A fragments (k step of 16 keys), its sums into l.
    const auto exponentiate = [&](unsigned (&a)[4][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                s[4 * j + 2 * i] = fast_exp2(s[4 * j + 2 * i] - mx[i]);
                s[4 * j + 2 * i + 1] = fast_exp2(s[4 * j + 2 * i + 1] - mx[i]);
                l[i] += s[4 * j + 2 * i] + s[4 * j + 2 * i + 1];
                a[j >> 1][2 * (j & 1) + i] = bf16x2(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]);
            }
    };
    const auto store_p = [&](const float (&f)[2]) {  // P·f as bf16 into this warpgroup's shared P tile
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i)
                *reinterpret_cast<unsigned*>(ps_g + wg * kWgaPBytes + swizzled(row_a + 8 * i, j) + 4 * l4) =
                    bf16x2(s[4 * j + 2 * i] * f[i], s[4 * j + 2 * i + 1] * f[i]);
        fence_proxy_async();
    };
    const auto release = [&](int tile, int h) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(tile, h));
    };

    mbar_wait(bars, 0);  // q
    fence_proxy_async();
    unsigned a[4][4];
    if (wg == 0) {
        // nothing is in flight across the loop's back edge: ptxas serializes every wgmma otherwise
        for (int p = 0; p < n_pairs_u; ++p) {
            const bool odd = 2 * p + 1 < n_blocks_u;
            if (p == 0) {
                score_half(0, 0);
                score_half(0, 1);
                wgmma_wait<0>();
            }
            float top[2], f[2];
            block_max(top);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float next = fmaxf(mx[i], top[i]);
                f[i] = fast_exp2(mx[i] - next);
                mx[i] = next;
                if (l4 == 0) row_max[row_a + 8 * i] = next;
            }
            bar_arrive(kMax0, 256);
            rescale(f);
            exponentiate(a);
            pv_own(a);
            bar_sync(kMax1, 256);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float pair = row_max[row_a + 8 * i];
                f[i] = fast_exp2(mx[i] - pair);
                mx[i] = pair;
            }
            store_p(f);
            bar_arrive(kP0Ready, 256);
            wgmma_wait<0>();
            release(0, 0);
            rescale(f);
            if (odd) {
                bar_sync(kP1Ready, 256);
                pv_partner(p);
            }
            if (p + 1 < n_pairs_u) {  // the next pair's scores go in behind the partner's P·V
                score_half(p + 1, 0);
                wgmma_wait<1>();
                release(1, 0);
                score_half(p + 1, 1);
            }
            wgmma_wait<0>();
            if (odd && p + 1 == n_pairs_u) release(1, 0);
        }
    } else {
        for (int p = 0; p < n_pairs_u; ++p) {
            const bool odd = 2 * p + 1 < n_blocks_u;
            float top[2] = {neg_inf(), neg_inf()}, f[2];
            if (odd) {
                score_half(p, 1);
                score_half(p, 0);
                wgmma_wait<0>();
                block_max(top);
            }
            bar_sync(kMax0, 256);
            float pair[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) pair[i] = fmaxf(row_max[row_a + 8 * i], top[i]);
            __syncwarp();  // the quad's reads before its first lane's write
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                f[i] = fast_exp2(mx[i] - pair[i]);
                mx[i] = pair[i];
                if (l4 == 0) row_max[row_a + 8 * i] = pair[i];
            }
            bar_arrive(kMax1, 256);
            rescale(f);
            if (odd) {
                exponentiate(a);
                pv_own(a);
                const float one[2] = {1.f, 1.f};
                store_p(one);
                bar_arrive(kP1Ready, 256);
            }
            bar_sync(kP0Ready, 256);
            pv_partner(p);
            if (odd) {
                wgmma_wait<1>();
                release(1, 1);
            }
            wgmma_wait<0>();
            release(0, 1);
        }
    }

    wgmma_wait<0>();  // done on every path already; said so that ptxas need not insert it
    // o[4j + c]: head row_a + 8·(c / 2), dim 256·wg + 8j + 2·l4 + c % 2.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (l4 == 0) row_sum[wg * kWgaHeads + row_a + 8 * i] = l[i];
    }
    bar_sync(kSums, 256);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int h = row_a + 8 * i;
        if (h >= block_heads) continue;
        const float inv = 1.f / (l[i] + row_sum[(wg ^ 1) * kWgaHeads + h]);
        __nv_bfloat16* dst = out + (row0 + h) * hd + 256 * wg;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int d = 8 * j + 2 * l4;
            float v[2] = {o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv};
            rope_chunk(v, 256 * wg + d, hd, rd, m, inv_freq, true);
            *reinterpret_cast<unsigned*>(dst + d) = bf16x2(v[0], v[1]);
        }
    }
#endif
}
