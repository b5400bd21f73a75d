// Device helpers shared by the kernels in this folder.
//
// Kernels are templates over the storage type T (float or __nv_bfloat16) and compute in fp32,
// so a float build runs the same code as the bf16 one. Each .cu file names the instantiations
// to compile in comment lines that dsv4rt/cuda/build.py reads and hands to NVRTC:
//   // dsv4rt-instantiate: rmsnorm<float> rmsnorm<__nv_bfloat16>
// Expressions are separated by whitespace, so write none inside one (gemm<float,128>).
// Block reductions need blockDim.x to be a multiple of 32.
#pragma once
#include <cuda_bf16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Elements of T in one 16-byte access, the widest single load or store.
template <typename T> constexpr int kVec = 16 / sizeof(T);

// The raw bits of four consecutive T: one 16-byte (float) or 8-byte (bf16) load.
template <typename T> struct Raw4Of { using type = uint2; };
template <> struct Raw4Of<float> { using type = uint4; };
template <typename T> using Raw4 = typename Raw4Of<T>::type;

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15) == 0; }

// N elements from a 16-byte aligned p, converted to float.
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[N]) {
    static_assert(N % kVec<T> == 0, "whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < N / kVec<T>; ++c) {
        const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec<T>; ++i) v[c * kVec<T> + i] = to_float(e[i]);
    }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[N]) {
    static_assert(N % kVec<T> == 0, "whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < N / kVec<T>; ++c) {
        uint4 raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec<T>; ++i) e[i] = from_float<T>(v[c * kVec<T> + i]);
        reinterpret_cast<uint4*>(p)[c] = raw;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The block's total, returned to every thread; the last barrier lets the next call reuse `partial`.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = warp_sum(lane < (blockDim.x >> 5) ? partial[lane] : 0.f);
    __syncthreads();
    return v;
}

// 16 bytes of a weight row, read once: no L1 allocation, so the activations stay there. kSpan256: L2 also
// fetches the 256-byte span around it (skinny.cu measured: a median 1-3% faster, up to 7% on the LM head).
template <bool kSpan256 = false>
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    if constexpr (kSpan256)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// d += a·b on the tensor cores, d 16 x 8 fp32, a 16 rows (row-major) and b 8 columns (column-major) of 32 bytes:
// 16 bf16 each (m16n8k16) or 32 e4m3 (m16n8k32).
enum class Mma { bf16, e4m3 };

template <Mma kType>
__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    if constexpr (kType == Mma::bf16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Thread-block clusters in PTX (cooperative_groups needs headers NVRTC is not given here). A cluster barrier
// orders the shared-memory accesses of every thread of every block in it, local and remote.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address of `p` (this block's shared memory) in cluster block `rank`'s shared memory.
__device__ __forceinline__ unsigned cluster_addr(const void* p, int rank) {
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(a) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
    return a;
}
__device__ __forceinline__ unsigned cluster_load(unsigned a) {
    unsigned v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ uint4 cluster_load4(unsigned a) {
    uint4 v;
    asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}

// As the reference's sigmoid (0.5·(1 + tanh(x/2))), for bitwise agreement with the CPU twin.
__device__ __forceinline__ float sigmoid(float x) { return 0.5f * (1.f + tanhf(0.5f * x)); }

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// The byte offset of 16-byte chunk `chunk` of row `row` in a tile of 128-byte rows in the 128-byte swizzle (TMA's
// mode, and wgmma's operand layout): chunk c of row r at c ^ (r % 8), so that ldmatrix and the rows' copies meet
// no bank conflicts.
__device__ __forceinline__ unsigned swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// The dynamic shared memory raw from its first 1024-byte boundary (the 128-byte swizzle's period): the shared-window
// address and the generic pointer of the same byte. Launchers allow 1024 bytes more for it.
struct SmemBase {
    unsigned addr;
    unsigned char* ptr;
};
__device__ __forceinline__ SmemBase smem_base_1024(unsigned char* raw) {
    const unsigned addr = (smem_u32(raw) + 1023) & ~1023u;
    return {addr, raw + (addr - smem_u32(raw))};
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
// 16 bytes of gmem, or 16 zero bytes and no read when !valid; smem as a shared-window address.
__device__ __forceinline__ void cp_async16_or_zero(unsigned smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool valid) {
    cp_async16_or_zero(smem_u32(smem), gmem, valid);
}
// 4 bytes of gmem, or 4 zero bytes and no read when !valid.
__device__ __forceinline__ void cp_async4_or_zero(unsigned smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async4_or_zero(void* smem, const void* gmem, bool valid) {
    cp_async4_or_zero(smem_u32(smem), gmem, valid);
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Warp-specialised kernels (setmaxnreg, wgmma.cuh): setmaxnreg.inc waits until the block's pool holds what it asks
// for, and the pool is what the block was launched with: ptxas gives a kernel that uses it the most
// __launch_bounds__(threads, 1) allows, 65536 / threads rounded down to 8 a thread (168 at 384 threads). Asking for
// more than that waits for ever. Here, not in wgmma.cuh, so that the kernels' asserts hold on every arch.
__host__ __device__ constexpr bool fits_launch_registers(int consumers, int consumer_regs, int producers,
                                                         int producer_regs) {
    const int threads = consumers + producers;
    return consumers * consumer_regs + producers * producer_regs <= threads * (65536 / threads / 8 * 8);
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
