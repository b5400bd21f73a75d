// Hopper warpgroup MMA (sm_90a only: include under __CUDA_ARCH_FEAT_SM90_ALL) on K-major operands of 128-byte
// rows in shared memory, swizzled as TMA's 128-byte mode leaves them (chunk c of row r at chunk c ^ (r % 8)).
#pragma once

// 8-row groups 1024 bytes apart (stride offset, bits 32-45), swizzle mode 1 (bits 62-63); the leading offset is
// unused for this layout. Stepping k by 32 bytes moves the start address alone: the hardware swizzles the final
// address bits.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return 1ull << 62 | static_cast<unsigned long long>(1024 >> 4) << 32 | 1ull << 16 | (addr & 0x3FFFF) >> 4;
}

// The same 128-byte rows read as an MN-major operand (wgmma's transposed B): row r holds k = r, its 64 elements
// are 64 consecutive n; the next 64 n start `atom_stride` bytes on, the next 8 k rows 1024 bytes on.
__device__ __forceinline__ unsigned long long smem_desc_mn(unsigned addr, unsigned atom_stride) {
    return 1ull << 62 | static_cast<unsigned long long>(1024 >> 4) << 32 |
           static_cast<unsigned long long>(atom_stride >> 4) << 16 | (addr & 0x3FFFF) >> 4;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Writes by the generic proxy (st.shared, cp.async) become visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// mbarriers in shared memory (addresses from __cvta_generic_to_shared), waited on by phase parity.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// A warpgroup's register budget for the rest of the kernel (warp-specialised kernels: producers give registers
// back, consumers take them). Every warp of the warpgroup executes it.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

// The accumulator operands of an asm statement: %0 .. %63 (m64n128, fp32), %0 .. %127 (m64n256).
#define DSV4RT_ACC64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
    "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DSV4RT_ACC128 DSV4RT_ACC64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, " \
    "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127"
#define DSV4RT_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
    "+f"(d[i + 6]), "+f"(d[i + 7])
#define DSV4RT_D32(i) DSV4RT_D8(i), DSV4RT_D8(i + 8), DSV4RT_D8(i + 16), DSV4RT_D8(i + 24)

// d (+)= a · bᵀ, a 64 x 16 and b 256 x 16 bf16 in shared memory (TransB: b's descriptor is MN-major,
// smem_desc_mn), fp32 accumulators; accumulate = 0 overwrites d.
// d[4j + c]: row lane / 4 + 8·(c / 2) of the warp's 16, column 8j + 2·(lane % 4) + c % 2.
template <int TransB = 0>
__device__ __forceinline__ void wgmma_bf16_m64n256k16(float (&d)[128], unsigned long long a, unsigned long long b,
                                                      int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        DSV4RT_ACC128
        "}, %128, %129, p, 1, 1, 0, %131;\n}"
        : DSV4RT_D32(0), DSV4RT_D32(32), DSV4RT_D32(64), DSV4RT_D32(96)
        : "l"(a), "l"(b), "r"(accumulate), "n"(TransB));
}

// wgmma_bf16_m64n256k16 at n = 32 (b 32 x 16, K-major).
__device__ __forceinline__ void wgmma_bf16_m64n32k16(float (&d)[16], unsigned long long a, unsigned long long b,
                                                     int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}"
        : DSV4RT_D8(0), DSV4RT_D8(8)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (+)= a · bᵀ, a 64 x 32 and b 128 x 32 e4m3 in shared memory (K-major); accumulate = 0 overwrites d.
// d[4j + c]: row lane / 4 + 8·(c / 2) of the warp's 16, column 8j + 2·(lane % 4) + c % 2.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], unsigned long long a, unsigned long long b,
                                                 int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        DSV4RT_ACC64
        "}, %64, %65, p, 1, 1;\n}"
        : DSV4RT_D32(0), DSV4RT_D32(32)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (+)= a · bᵀ, a 64 x 16 bf16 in registers and b 256 x 16 in shared memory (K-major; TransB: MN-major,
// smem_desc_mn); d as wgmma_bf16_m64n256k16's.
// a[0..3]: row lane / 4 (a[0], a[2]) and 8 below (a[1], a[3]) of the warp's 16, elements 2·(lane % 4) and the next
// (a[0], a[1]) and 8 on (a[2], a[3]), the lower element in the low half. The wgmma reads a until it completes
// (wgmma_wait).
template <int TransB = 0>
__device__ __forceinline__ void wgmma_bf16_m64n256k16_rs(float (&d)[128], const unsigned (&a)[4], unsigned long long b,
                                                         int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        DSV4RT_ACC128
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}"
        : DSV4RT_D32(0), DSV4RT_D32(32), DSV4RT_D32(64), DSV4RT_D32(96)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TransB));
}

#undef DSV4RT_D32
#undef DSV4RT_D8
#undef DSV4RT_ACC128
#undef DSV4RT_ACC64

// One k step of 64 of a block of two warpgroups: d (+)= a · bᵀ, a the warpgroup's 64 rows and b 256 rows of 64
// elements (128-byte swizzled rows); first overwrites d. Leaves this step in flight and the previous one done.
__device__ __forceinline__ void wgmma_k64_step(float (&d)[128], unsigned a_tile, unsigned b_tile, bool first) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        wgmma_bf16_m64n256k16(d, smem_desc(a_tile + 32 * ks), smem_desc(b_tile + 32 * ks), !first || ks > 0);
    wgmma_commit();
    wgmma_wait<1>();
}

// Row h (0: lane / 4 of the warp's 16, 1: 8 below) of d as bf16 into out_row's columns col0 .. col0 + 255 below n.
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16* out_row, const float (&d)[128], int h, int col0, int n) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j + 2 * (threadIdx.x & 3);
        if (col < n)
            *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
}
