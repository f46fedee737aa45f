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
