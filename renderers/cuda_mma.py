"""CUDA text of a block's product tile on tensor cores: the `MMA` node of rules/opt/tensor_core.py.

`MMA(A, B, arg=TileSpec)` renders as a lane's accumulator array and one call of `g_mma_tile`, a template of the
prelude below instantiated with the tile's sizes, layouts and strides (all compile-time: every loop unrolls, every
accumulator stays in a register); `GEP(MMA, e)` is element e of the array. The template:
- copies each slice of BK along k of the block's A tile (BM rows) and B tile (BN columns) into shared memory (dynamic
  shared memory, its size declared on the kernel with `G_SHARED(bytes)`, which runtime/cuda.py reads) with
  `cp.async` 16-byte copies, STAGES slices in flight (the copy of slice s + STAGES - 1 overlaps the math on slice s);
  a row of a tile is stored with its 16-byte chunks permuted by the row's low bits (`g_swizzle`), so that the 8 rows
  one `ldmatrix` reads lie in 32 different banks;
- per 16 of k, reads a warp's A fragments (m16 x k16) and B fragments (k16 x n8) with `ldmatrix.x4` (`.trans` where B
  is stored along j: the fragments are then transposed on the way) and issues `mma.sync.aligned.m16n8k16.row.col`
  with float32 accumulators.
Accumulator e = (mt * NT + nt) * 4 + c holds the output at row mt*16 + lane/4 + 8*(c/2) and column
nt*8 + 2*(lane%4) + c%2 of the warp's tile (the PTX fragment layout of m16n8k16's C).
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from .cuda_wgmma import render_wgmma

PRELUDE = r"""
__device__ __forceinline__ unsigned g_shared_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void g_cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(g_shared_address(dst)), "l"(src));
}
__device__ __forceinline__ void g_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void g_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
template <bool TRANS> __device__ __forceinline__ void g_ldmatrix4(unsigned (&r)[4], const void* p) {
  if (TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(g_shared_address(p)));
  else asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(g_shared_address(p)));
}
template <class T> struct g_mma_op;
template <> struct g_mma_op<half> {
  static __device__ __forceinline__ void run(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct g_mma_op<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
/* element offset of 16-byte chunk `chunk` of row `row` in a tile of rows of W 16-bit elements: the chunk index is
   XORed with row bits so that 8 consecutive rows' same chunk fall in 8 different 16-byte bank groups */
template <int W> __device__ __forceinline__ int g_swizzle(int row, int chunk) {
  constexpr int CHUNKS = W / 8;
  const int x = CHUNKS >= 8 ? (row & 7) : CHUNKS == 4 ? ((row >> 1) & 3) : CHUNKS == 2 ? ((row >> 2) & 1) : 0;
  return row * W + ((chunk ^ x) << 3);
}
/* the block's shared tiles: dynamic shared memory, as a tile may pass the 48 KiB of static shared memory (the kernel
   declares its size with G_SHARED(bytes): runtime/cuda.py reads it, raises the function's limit and launches with it) */
#define G_SHARED(bytes)
extern __shared__ __align__(128) unsigned char g_dynamic_shared[];
/* one block's BM x BN product tile: acc[(mt * NT + nt) * 4 + c] of each lane (see renderers/cuda_mma.py) */
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, bool B_ALONG_K, int K, long long LDA, long long LDB>
__device__ __forceinline__ void g_mma_tile(float* acc, const T* __restrict__ A, const T* __restrict__ B) {
  constexpr int THREADS = WM * WN * 32, MT = BM / WM / 16, NT = BN / WN / 8, KT = K / BK;
  static_assert(K % BK == 0 && BK % 16 == 0 && NT % 2 == 0 && MT >= 1, "tile sizes");
  static_assert((BM * BK / 8) % THREADS == 0 && (BN * BK / 8) % THREADS == 0, "a tile is copied in whole turns");
  T (*sa)[BM * BK] = reinterpret_cast<T (*)[BM * BK]>(g_dynamic_shared);
  T (*sb)[BN * BK] = reinterpret_cast<T (*)[BN * BK]>(g_dynamic_shared + STAGES * BM * BK * sizeof(T));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
#pragma unroll
  for (int e = 0; e < MT * NT * 4; e++) acc[e] = 0.0f;
  auto load = [&](int stage, int k0) {
#pragma unroll
    for (int t = 0; t < BM * BK / 8 / THREADS; t++) {
      const int c = tid + t * THREADS, row = c / (BK / 8), chunk = c % (BK / 8);
      g_cp_async16(&sa[stage][g_swizzle<BK>(row, chunk)], A + row * LDA + k0 + chunk * 8);
    }
#pragma unroll
    for (int t = 0; t < BN * BK / 8 / THREADS; t++) {
      const int c = tid + t * THREADS;
      if (B_ALONG_K) {
        const int row = c / (BK / 8), chunk = c % (BK / 8);
        g_cp_async16(&sb[stage][g_swizzle<BK>(row, chunk)], B + row * LDB + k0 + chunk * 8);
      } else {
        const int row = c / (BN / 8), chunk = c % (BN / 8);
        g_cp_async16(&sb[stage][g_swizzle<BN>(row, chunk)], B + (k0 + row) * LDB + chunk * 8);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < KT) load(s, s * BK);
    g_cp_async_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    g_cp_async_wait<STAGES - 2>();   /* slice kt has landed (for this thread) */
    __syncthreads();                 /* ... for every thread; and every warp is done with slice kt - 1's stage */
    if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * BK);
    g_cp_async_commit();
    const T* ta = sa[kt % STAGES];
    const T* tb = sb[kt % STAGES];
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MT][4], bf[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const int row = wm * (BM / WM) + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        g_ldmatrix4<false>(af[mt], &ta[g_swizzle<BK>(row, (kk >> 3) + (lane >> 4))]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        unsigned r[4];
        if (B_ALONG_K) {
          const int n = wn * (BN / WN) + nt * 8 + (lane & 7) + (lane >> 4) * 8;
          g_ldmatrix4<false>(r, &tb[g_swizzle<BK>(n, (kk >> 3) + ((lane >> 3) & 1))]);
        } else {
          const int k = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
          g_ldmatrix4<true>(r, &tb[g_swizzle<BN>(k, ((wn * (BN / WN) + nt * 8) >> 3) + (lane >> 4))]);
        }
        bf[nt][0] = r[0]; bf[nt][1] = r[1]; bf[nt + 1][0] = r[2]; bf[nt + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) g_mma_op<T>::run(&acc[(mt * NT + nt) * 4], af[mt], bf[nt][0], bf[nt][1]);
    }
  }
  g_cp_async_wait<0>();
}
"""


def render_mma(ctx, m: UOp) -> str:
  s = m.arg
  if s.wgmma: return render_wgmma(ctx, m)
  t = ctx.lang.type(getattr(dtypes, s.dtype))
  args = f"{t}, {s.bm}, {s.bn}, {s.bk}, {s.wm}, {s.wn}, {s.stages}, {'true' if s.b_along_k else 'false'}, {s.k}, {s.lda}LL, {s.ldb}LL"
  return f"float {ctx.names[m]}[{s.regs}];\ng_mma_tile<{args}>({ctx.names[m]}, {ctx[m.src[0]]}, {ctx[m.src[1]]});"


def shared_bytes(linear: UOp) -> int:
  """The dynamic shared memory a linear kernel's MMA tiles take (0 without one)."""
  return max((u.arg.shared_bytes for u in linear.src if u.op is Ops.MMA), default=0)


mma_rules = PatternMatcher([
  (UPat(Ops.MMA, name="m"), render_mma),
  (UPat(Ops.GEP, src=(UPat(Ops.MMA, name="m"), UPat(Ops.CONST, name="e"))), lambda ctx, m, e: f"{ctx.names[m]}[{e.arg}]", "render_mma_element"),
], name="render.cuda_mma")
