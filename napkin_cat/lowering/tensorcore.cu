// Tensor-core and 16-bit primitives for napkin_cat's generated numba.cuda kernels.
//
// Each function is inline PTX behind numba's declare_device ABI (`int f(Ret* ret, args...)`,
// returning 0); numba-cuda links this file through NVRTC and LTO inlines the calls, so they
// compile to HMMA / F2F / PRMT inside the kernel with no call and no local memory.  No headers.
// The simulated twins of these functions (same arguments, same results) are in tensorcore.py.

struct nc_f4 { float x, y, z, w; };

// D = A B + C, one warp, m16n8k16, A row-major / B column-major fragments of packed 16-bit
// pairs, fp32 accumulators (PTX ISA 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16").
extern "C" __device__ int nc_mma_f16(nc_f4* ret, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                     unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
  float d0, d1, d2, d3;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
  ret->x = d0; ret->y = d1; ret->z = d2; ret->w = d3;
  return 0;
}

extern "C" __device__ int nc_mma_bf16(nc_f4* ret, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                      unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
  float d0, d1, d2, d3;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
  ret->x = d0; ret->y = d1; ret->z = d2; ret->w = d3;
  return 0;
}

// ---- fp32 on tensor cores by 3xTF32 (CUTLASS's "FastF32", what SDPA's fp32 kernels use on sm_80+):
// x = big + small with big = x rounded to tf32 (10 mantissa bits, ties away from zero) and small =
// x - big (exact) truncated to tf32, and a b ~ big_a big_b + big_a small_b + small_a big_b: the
// dropped small_a small_b is below 2^-20 of |a b| and small's truncation below 2^-21 of |x|, under
// fp32's accumulation error over a reduction.  Both by bit operations, 4 instructions a value:
// cvt.rna.tf32.f32 compiles to 4 on sm_90 (an inf / NaN guard around the same add and mask) and
// took 8 for the pair (ptxas + nvdisasm, kernels/BENCHMARKS.md).  Without the guard a NaN x may give
// any big, but its small is x - big = NaN and the mask keeps a NaN a NaN (exponent bits untouched),
// so the products are NaN as before; an infinite x gives big = x and small = NaN, as cvt.rna did.
// A pair of fp32 operands (lo, hi) travels as two 64-bit registers, the big pair and the small pair
// (lo in bits 0-31), in the ownership of the 16-bit A / B fragments: lane (g, t) holds columns 2t,
// 2t + 1, 2t + 8, 2t + 9 of a 16-wide step.
struct nc_u64x2 { unsigned long long x, y; };

#define NC_TF32_MASK 0xffffe000u

__device__ __forceinline__ unsigned nc_tf32_big(float x) {
  return (__float_as_uint(x) + 0x1000u) & NC_TF32_MASK;
}

__device__ __forceinline__ unsigned nc_tf32_small(float x, unsigned big) {
  return __float_as_uint(x - __uint_as_float(big)) & NC_TF32_MASK;
}

extern "C" __device__ int nc_pack_tf32x3(nc_u64x2* ret, float lo, float hi) {
  unsigned blo = nc_tf32_big(lo), bhi = nc_tf32_big(hi);
  unsigned slo = nc_tf32_small(lo, blo), shi = nc_tf32_small(hi, bhi);
  ret->x = ((unsigned long long)bhi << 32) | blo;
  ret->y = ((unsigned long long)shi << 32) | slo;
  return 0;
}

// One m16n8k8 tf32 mma into d (PTX ISA 9.7.14.5.7, "Matrix Fragments for mma.m16n8k8": lane (g, t)
// gives A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] and B[t][g], B[t+4][g]).
#define NC_MMA_TF32(d, a0, a1, a2, a3, b0, b1)                                                    \
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "                                      \
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                           \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
#define NC_LO(x) ((unsigned)(x))
#define NC_HI(x) ((unsigned)((x) >> 32))

// D = A B + C over one 16-wide step: two m16n8k8 halves, each with its reduced index permuted so
// that the lane's own columns are its operands (k' = t is column 2t, k' = t + 4 is column 2t + 1
// of the half; the sum over k does not depend on its order), three products per half, the small
// ones first.  mma_tf32x3 adds them into C on the tensor cores; mma_tf32x3s (staged, CUTLASS's
// staged accumulation for 3xTF32) sums them from zero and adds C after by an fp32 add: the tensor
// cores' own addition of C does not round to nearest, and over a stream of steps into one
// accumulator (FlashAttention's O, dK, dV, dQ) that error, not the split's, dominates (measured:
// 4e-5 of max |O| at 4096 keys against 1e-6 staged).  Staging costs four registers per chain.
#define NC_TF32X3_STEPS(d)                                                                       \
  NC_MMA_TF32(d, NC_LO(a0s), NC_LO(a1s), NC_HI(a0s), NC_HI(a1s), NC_LO(b0b), NC_HI(b0b));        \
  NC_MMA_TF32(d, NC_LO(a2s), NC_LO(a3s), NC_HI(a2s), NC_HI(a3s), NC_LO(b1b), NC_HI(b1b));        \
  NC_MMA_TF32(d, NC_LO(a0b), NC_LO(a1b), NC_HI(a0b), NC_HI(a1b), NC_LO(b0s), NC_HI(b0s));        \
  NC_MMA_TF32(d, NC_LO(a2b), NC_LO(a3b), NC_HI(a2b), NC_HI(a3b), NC_LO(b1s), NC_HI(b1s));        \
  NC_MMA_TF32(d, NC_LO(a0b), NC_LO(a1b), NC_HI(a0b), NC_HI(a1b), NC_LO(b0b), NC_HI(b0b));        \
  NC_MMA_TF32(d, NC_LO(a2b), NC_LO(a3b), NC_HI(a2b), NC_HI(a3b), NC_LO(b1b), NC_HI(b1b))
#define NC_TF32X3_ARGS                                                                           \
    unsigned long long a0b, unsigned long long a0s, unsigned long long a1b, unsigned long long a1s, \
    unsigned long long a2b, unsigned long long a2s, unsigned long long a3b, unsigned long long a3s, \
    unsigned long long b0b, unsigned long long b0s, unsigned long long b1b, unsigned long long b1s, \
    float c0, float c1, float c2, float c3

extern "C" __device__ int nc_mma_tf32x3(nc_f4* ret, NC_TF32X3_ARGS) {
  float d[4] = {c0, c1, c2, c3};
  NC_TF32X3_STEPS(d);
  ret->x = d[0]; ret->y = d[1]; ret->z = d[2]; ret->w = d[3];
  return 0;
}

extern "C" __device__ int nc_mma_tf32x3s(nc_f4* ret, NC_TF32X3_ARGS) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  NC_TF32X3_STEPS(d);
  ret->x = c0 + d[0]; ret->y = c1 + d[1]; ret->z = c2 + d[2]; ret->w = c3 + d[3];
  return 0;
}

// Two fp32 values rounded (to nearest even) into one packed pair: `lo` in bits 0-15.
// cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half and b in the lower one.
extern "C" __device__ int nc_pack_f16(unsigned* ret, float lo, float hi) {
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  *ret = d;
  return 0;
}

extern "C" __device__ int nc_pack_bf16(unsigned* ret, float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  *ret = d;
  return 0;
}

// Two raw 16-bit values (bit patterns, as numba's int16) into one pair: `lo` in bits 0-15.
extern "C" __device__ int nc_pair16(unsigned* ret, short lo, short hi) {
  *ret = ((unsigned)(unsigned short)hi << 16) | (unsigned)(unsigned short)lo;
  return 0;
}

// 16-bit bit patterns <-> fp32.
extern "C" __device__ int nc_h2f(float* ret, short bits) {
  float f;
  unsigned short h = (unsigned short)bits;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  *ret = f;
  return 0;
}

extern "C" __device__ int nc_bf2f(float* ret, short bits) {
  float f;
  unsigned u = ((unsigned)(unsigned short)bits) << 16;
  asm("mov.b32 %0, %1;\n" : "=f"(f) : "r"(u));
  *ret = f;
  return 0;
}

extern "C" __device__ int nc_f2h(short* ret, float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
  *ret = (short)h;
  return 0;
}

extern "C" __device__ int nc_f2bf(short* ret, float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
  *ret = (short)h;
  return 0;
}

// ---- shared-memory fragments and asynchronous copies.  Shared addresses are 32-bit shared-window
// addresses (the kernel converts its shared array's base once, tensorcore_gpu.shared_addr).
struct nc_u4 { unsigned x, y, z, w; };
struct nc_u2 { unsigned x, y; };

// `s`, through an instruction the compiler may neither hoist nor merge: a fragment load's address
// is then formed beside the load, not computed once before a loop and held in a register.
extern "C" __device__ int nc_pin(unsigned* ret, unsigned s) {
  unsigned d;
  asm volatile("mov.u32 %0, %1;\n" : "=r"(d) : "r"(s));
  *ret = d;
  return 0;
}

// ldmatrix: lanes 0-31 (x4) or 0-15 (x2) give the addresses of the 8x8 b16 matrices' rows;
// register q of lane l gets row l/4, elements 2(l%4), 2(l%4)+1 of matrix q (.trans: of its
// transpose).  PTX ISA 9.7.14.5.15.
extern "C" __device__ int nc_ldsm_x4(nc_u4* ret, unsigned s) {
  unsigned a, b, c, d;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(s));
  ret->x = a; ret->y = b; ret->z = c; ret->w = d;
  return 0;
}

extern "C" __device__ int nc_ldsm_x4_t(nc_u4* ret, unsigned s) {
  unsigned a, b, c, d;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(s));
  ret->x = a; ret->y = b; ret->z = c; ret->w = d;
  return 0;
}

extern "C" __device__ int nc_ldsm_x2(nc_u2* ret, unsigned s) {
  unsigned a, b;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(a), "=r"(b) : "r"(s));
  ret->x = a; ret->y = b;
  return 0;
}

extern "C" __device__ int nc_ldsm_x2_t(nc_u2* ret, unsigned s) {
  unsigned a, b;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(a), "=r"(b) : "r"(s));
  ret->x = a; ret->y = b;
  return 0;
}

// 16 bytes global -> shared, asynchronously; `bytes` < 16 zero-fills the rest (0: all zeros).
extern "C" __device__ int nc_cp_async16(int* ret, unsigned s, unsigned long long src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(src), "r"(bytes));
  *ret = 0;
  return 0;
}

// Add two adjacent fp32 values into global memory at p (8-byte aligned): one vector reduction on
// sm_90 (red.global.add.v2.f32: both words in one request), two scalar atomics before it.
extern "C" __device__ int nc_red_add2(int* ret, unsigned long long p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd((float*)p, a);
  atomicAdd((float*)p + 1, b);
#endif
  *ret = 0;
  return 0;
}

// Store a packed pair of 16-bit values (one 32-bit word, low half first) at p (4-byte aligned):
// a fragment's column pair in one store.
extern "C" __device__ int nc_st_pair16(int* ret, unsigned long long p, unsigned w) {
  asm volatile("st.global.b32 [%0], %1;\n" :: "l"(p), "r"(w) : "memory");
  *ret = 0;
  return 0;
}

// Wait for every cp.async this thread issued (then a barrier makes them visible to the block).
extern "C" __device__ int nc_cp_async_wait_all(int* ret) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Close this thread's current group of cp.asyncs.
extern "C" __device__ int nc_cp_async_commit(int* ret) {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Wait until at most one group of this thread's cp.asyncs is in flight.
extern "C" __device__ int nc_cp_async_wait1(int* ret) {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Wait until at most two groups of this thread's cp.asyncs are in flight.
extern "C" __device__ int nc_cp_async_wait2(int* ret) {
  asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// ---- warpgroup MMA (sm_90a): the fences around wgmma.mma_async.  The multiplications and the wait
// that passes the accumulators through depend on the width N (registers): generated by
// wgmma.cu_source and linked beside this file.
extern "C" __device__ int nc_wgmma_fence(int* ret) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_wgmma_commit(int* ret) {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Shared memory written by this thread's ordinary stores or cp.async, made visible to the async
// proxy (the tensor cores' descriptor reads) once a barrier follows.
extern "C" __device__ int nc_fence_proxy_async(int* ret) {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Bulk reductions of staged partial sums (staged_add.py), issued by one thread: `bytes` bytes of
// fp32 words at shared address `s` added into global memory at `p` by the copy engine (both
// 16-byte aligned, `bytes` a multiple of 16); a commit closes the issued ones into a group; the
// waits: every group has read its shared memory (`read`), or is complete.  Before sm_90: the same
// sums by atomics, complete at once.
extern "C" __device__ int nc_bulk_add(int* ret, unsigned long long p, unsigned s, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :: "l"(p), "r"(s), "r"(bytes) : "memory");
#else
  for (unsigned e = 0; e < bytes / 4; ++e) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(s + 4 * e));
    atomicAdd((float*)p + e, v);
  }
#endif
  *ret = 0;
  return 0;
}

// The commit and the two waits: one instruction each on sm_90, nothing before it.
#if __CUDA_ARCH__ >= 900
#define NC_BULK_STEP(name, instruction) \
  extern "C" __device__ int name(int* ret) { asm volatile(instruction ::: "memory"); *ret = 0; return 0; }
#else
#define NC_BULK_STEP(name, instruction) extern "C" __device__ int name(int* ret) { *ret = 0; return 0; }
#endif
NC_BULK_STEP(nc_bulk_commit, "cp.async.bulk.commit_group;\n")
NC_BULK_STEP(nc_bulk_wait_read, "cp.async.bulk.wait_group.read 0;\n")
NC_BULK_STEP(nc_bulk_wait_all, "cp.async.bulk.wait_group 0;\n")

// A barrier over the first `count` threads of the block only (barrier `id`, 1..15; 0 is
// __syncthreads'): the multiplying warps of a kernel whose copying warpgroup is elsewhere
// (lowering/producer.py).
extern "C" __device__ int nc_bar_named(int* ret, unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
  *ret = 0;
  return 0;
}

// Arrive at named barrier `id` without waiting (its `count` threads: those that arrive and those
// that wait there by nc_bar_named): a buffer handed over between warpgroups (lowering/producer.py).
extern "C" __device__ int nc_bar_arrive(int* ret, unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
  *ret = 0;
  return 0;
}

// ---- the tensor memory accelerator (tma.py), sm_90: mbarriers at 32-bit shared addresses; a
// tensor copy of the box at coordinates c0.. (innermost first) of the map at generic address
// `map` (device memory), completing on the mbarrier at `bar` with its bytes.
extern "C" __device__ int nc_mbar_init(int* ret, unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_mbar_fence_init(int* ret) {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  *ret = 0;
  return 0;
}

// Arrive once and expect `bytes` more transaction bytes in the current phase.
extern "C" __device__ int nc_mbar_expect(int* ret, unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
  *ret = 0;
  return 0;
}

// Wait until the phase of parity `parity` has completed.
extern "C" __device__ int nc_mbar_wait(int* ret, unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
  *ret = 0;
  return 0;
}

#define NC_TMA_PREFIX "cp.async.bulk.tensor."
#define NC_TMA_SUFFIX ".shared::cluster.global.tile.mbarrier::complete_tx::bytes"
extern "C" __device__ int nc_tma_load1(int* ret, unsigned dst, unsigned long long map, int c0, unsigned bar) {
  asm volatile(NC_TMA_PREFIX "1d" NC_TMA_SUFFIX " [%0], [%1, {%2}], [%3];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(bar) : "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_tma_load2(int* ret, unsigned dst, unsigned long long map, int c0, int c1,
                                       unsigned bar) {
  asm volatile(NC_TMA_PREFIX "2d" NC_TMA_SUFFIX " [%0], [%1, {%2, %3}], [%4];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_tma_load3(int* ret, unsigned dst, unsigned long long map, int c0, int c1, int c2,
                                       unsigned bar) {
  asm volatile(NC_TMA_PREFIX "3d" NC_TMA_SUFFIX " [%0], [%1, {%2, %3, %4}], [%5];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_tma_load4(int* ret, unsigned dst, unsigned long long map, int c0, int c1, int c2,
                                       int c3, unsigned bar) {
  asm volatile(NC_TMA_PREFIX "4d" NC_TMA_SUFFIX " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
  *ret = 0;
  return 0;
}

extern "C" __device__ int nc_tma_load5(int* ret, unsigned dst, unsigned long long map, int c0, int c1, int c2,
                                       int c3, int c4, unsigned bar) {
  asm volatile(NC_TMA_PREFIX "5d" NC_TMA_SUFFIX " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
  *ret = 0;
  return 0;
}
