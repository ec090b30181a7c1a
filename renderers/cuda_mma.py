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
A gathered A (a convolution) passes `g_gather<rows, ks[, chunked]>`: its row offsets and k offsets as lambdas; the
copy computes a thread's row offsets once and the k offsets once per block into a table after the tiles, then copies
16-byte chunks (chunked: a channels-last input) or single elements. A strict float32 tile (`TileSpec.fma`) renders as
`g_fma_tile`: the same staging by 4-byte cp.async, 8x8 outputs per lane on the FMA units.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from .cuda_wgmma import render_wgmma
from .cuda_tma import render_tma

def _mma_op(ctype: str, shape: str, ptx: str) -> str:
  """g_mma_op<ctype>: one mma.sync of `shape` on `ptx` operands (a lane's 4 registers of A, 2 of B, 4 float sums)."""
  return (f"template <> struct g_mma_op<{ctype}> {{\n"
          "  static __device__ __forceinline__ void run(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {\n"
          f'    asm volatile("mma.sync.aligned.{shape}.row.col.f32.{ptx}.{ptx}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\\n"\n'
          '                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));\n'
          "  }\n};\n")


PRELUDE = r"""
/* a reciprocal within 1 ulp of float32 (IEEE's 1.0f/x: half an ulp, ~10 instructions more and a branch), for an
   epilogue whose value is rounded to 16 bits before it is stored (rules/opt/tensor_core.py); subnormals kept */
__device__ __forceinline__ float g_rcp_approx(float x) { float r; asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
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
""" + _mma_op("half", "m16n8k16", "f16") + _mma_op("__nv_bfloat16", "m16n8k16", "bf16") + r"""/* float32 operands as TF32 (GRAFT_TF32=1): the float's own bits, of which the tensor core reads the sign, the exponent
   and the top 10 bits of the mantissa (the 13 below are dropped: truncation, as cuBLAS's and torch's TF32 mode does) */
""" + _mma_op("float", "m16n8k8", "tf32") + r"""/* element offset of 16-byte chunk `chunk` of row `row` in a tile of rows of W elements of T: the chunk index is XORed
   with row bits so that 8 consecutive rows' same chunk fall in 8 different 16-byte bank groups (for ldmatrix); ROWS4
   (a float32 B stored along j, read one float per lane: 4 rows of k by 8 columns) XORs 2x(row mod 4) instead, so that
   those 4 rows' 8 columns fall in 32 different banks */
template <class T, int W, bool ROWS4 = false> __device__ __forceinline__ int g_swizzle(int row, int chunk) {
  constexpr int E = 16 / sizeof(T), CHUNKS = W / E;
  static_assert(!ROWS4 || CHUNKS >= 8, "rows of 8 chunks at least");
  const int x = ROWS4 ? ((row & 3) << 1) : CHUNKS >= 8 ? (row & 7) : CHUNKS == 4 ? ((row >> 1) & 3) : CHUNKS == 2 ? ((row >> 2) & 1) : 0;
  return row * W + (chunk ^ x) * E;
}
/* one element of a gathered tile: a float by a 4-byte cp.async (it lands with the slice's other copies); a 16-bit one
   (no cp.async that small) by a load and a store */
__device__ __forceinline__ void g_copy1(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(g_shared_address(dst)), "l"(src));
}
template <class T> __device__ __forceinline__ void g_copy1(T* dst, const T* src) { *dst = *src; }
/* (the block's dynamic shared memory is declared by renderers/cuda.py's PRELUDE, before this one) */
/* A's rows LDA apart, each contiguous along k (a matrix) */
struct g_matrix { static constexpr bool chunked = true; };
/* A gathered (a convolution's windows): element (row, k) at A + rows(row0 + row) + ks(k); CHUNKED: k's 16-byte chunks
   contiguous (a channels-last input), copied whole */
template <class Rows, class Ks, bool CHUNKED = false> struct g_gather { static constexpr bool chunked = CHUNKED; long long row0; Rows rows; Ks ks; };
template <class G> struct g_is_matrix { static constexpr bool value = false; };
template <> struct g_is_matrix<g_matrix> { static constexpr bool value = true; };
/* one block's BM x BN product tile: acc[(mt * NT + nt) * 4 + c] of each lane (see renderers/cuda_mma.py) */
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, bool B_ALONG_K, int K, long long LDA, long long LDB, class G = g_matrix>
__device__ __forceinline__ void g_mma_tile(float* acc, const T* __restrict__ A, const T* __restrict__ B, G gather = G()) {
  constexpr int THREADS = WM * WN * 32, MT = BM / WM / 16, NT = BN / WN / 8, KT = K / BK;
  constexpr int E = 16 / sizeof(T), KS = 32 / sizeof(T);   /* elements of a 16-byte chunk; k of one mma (16, or 8 for TF32) */
  constexpr bool MATRIX = g_is_matrix<G>::value, ROWS4 = sizeof(T) == 4 && !B_ALONG_K;
  static_assert(K % BK == 0 && BK % KS == 0 && NT % 2 == 0 && MT >= 1, "tile sizes");
  static_assert((BM * BK / E) % THREADS == 0 && (BN * BK / E) % THREADS == 0, "a tile is copied in whole turns");
  static_assert(MATRIX || BM % THREADS == 0 || THREADS % BM == 0, "a gathered tile's rows are spread evenly over the lanes");
  T (*sa)[BM * BK] = reinterpret_cast<T (*)[BM * BK]>(g_dynamic_shared);
  T (*sb)[BN * BK] = reinterpret_cast<T (*)[BN * BK]>(g_dynamic_shared + STAGES * BM * BK * sizeof(T));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  /* a gathered A: each lane copies rows tid % BM (+ THREADS, ...) at k tid / BM (+ THREADS / BM, ...) of a slice; its
     rows' offsets are computed once, the k offsets once per block into a table after the tiles */
  constexpr int RPT = BM >= THREADS ? BM / THREADS : 1, KSTEP = THREADS >= BM ? THREADS / BM : 1;
  /* a gathered A in chunks: lane copies chunk tid % (BK / E) of rows (tid + t * THREADS) / (BK / E), as a matrix's */
  constexpr bool CHUNKED = !MATRIX && G::chunked;
  constexpr int CPT = BM * BK / E / THREADS;
  long long roff[MATRIX || CHUNKED ? CPT : RPT];
  int* koff = reinterpret_cast<int*>(g_dynamic_shared + STAGES * (BM + BN) * BK * sizeof(T));
  if constexpr (CHUNKED) {
#pragma unroll
    for (int t = 0; t < CPT; t++) roff[t] = gather.rows(gather.row0 + (tid + t * THREADS) / (BK / E));
  } else if constexpr (!MATRIX) {
#pragma unroll
    for (int j = 0; j < RPT; j++) roff[j] = gather.rows(gather.row0 + tid % BM + j * THREADS);
  }
  if constexpr (!MATRIX) {
    for (int k = tid; k < K; k += THREADS) koff[k] = gather.ks(k);
    __syncthreads();
  }
#pragma unroll
  for (int e = 0; e < MT * NT * 4; e++) acc[e] = 0.0f;
  /* 16-bit gathered elements go through registers: a slice's loads are issued before the math on the slice before
     it and stored to shared memory after that math, so their latency hides behind it (no cp.async that small) */
  constexpr bool HELD = !MATRIX && !CHUNKED && sizeof(T) != 4;
  T held[HELD ? BK / KSTEP * RPT : 1];
  auto gather_a = [&](int stage, int k0, int mode) {   /* mode 0: copy (cp.async for floats), 1: load, 2: store */
#pragma unroll
    for (int t = 0; t < BK / KSTEP; t++) {
      const int q = tid / BM + t * KSTEP;
#pragma unroll
      for (int j = 0; j < RPT; j++) {
        T* dst = &sa[stage][g_swizzle<T, BK>(tid % BM + j * THREADS, q / E) + q % E];
        if (mode == 0) g_copy1(dst, A + roff[j] + koff[k0 + q]);
        else if (mode == 1) held[t * RPT + j] = A[roff[j] + koff[k0 + q]];
        else *dst = held[t * RPT + j];
      }
    }
  };
  auto load = [&](int stage, int k0, bool defer) {   /* defer: a gathered 16-bit A is only loaded (see HELD) */
    if constexpr (MATRIX || CHUNKED) {
      const int chunk = tid % (BK / E);
      const T* a = MATRIX ? A + k0 + chunk * E : A + koff[k0 + chunk * E];
#pragma unroll
      for (int t = 0; t < CPT; t++) {
        const int row = (tid + t * THREADS) / (BK / E);
        g_cp_async16(&sa[stage][g_swizzle<T, BK>(row, chunk)], a + (MATRIX ? row * LDA : roff[t]));
      }
    } else gather_a(stage, k0, HELD && defer ? 1 : 0);
#pragma unroll
    for (int t = 0; t < BN * BK / E / THREADS; t++) {
      const int c = tid + t * THREADS;
      if (B_ALONG_K) {
        const int row = c / (BK / E), chunk = c % (BK / E);
        g_cp_async16(&sb[stage][g_swizzle<T, BK>(row, chunk)], B + row * LDB + k0 + chunk * E);
      } else {
        const int row = c / (BN / E), chunk = c % (BN / E);
        g_cp_async16(&sb[stage][g_swizzle<T, BN, ROWS4>(row, chunk)], B + (k0 + row) * LDB + chunk * E);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < KT) load(s, s * BK, false);
    g_cp_async_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    g_cp_async_wait<STAGES - 2>();   /* slice kt has landed (for this thread) */
    __syncthreads();                 /* ... for every thread; and every warp is done with slice kt - 1's stage */
    const bool next = kt + STAGES - 1 < KT;
    if (next) load((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * BK, true);
    g_cp_async_commit();
    const T* ta = sa[kt % STAGES];
    const T* tb = sb[kt % STAGES];
#pragma unroll
    for (int kk = 0; kk < BK; kk += KS) {
      unsigned af[MT][4], bf[NT][2];
      /* ldmatrix's 8x8 matrices of 16-bit elements are, for floats, 8x4 matrices of floats: TF32's fragments */
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const int row = wm * (BM / WM) + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        g_ldmatrix4<false>(af[mt], &ta[g_swizzle<T, BK>(row, kk / E + (lane >> 4))]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        unsigned r[4];
        if (B_ALONG_K) {
          const int n = wn * (BN / WN) + nt * 8 + (lane & 7) + (lane >> 4) * 8;
          g_ldmatrix4<false>(r, &tb[g_swizzle<T, BK>(n, kk / E + ((lane >> 3) & 1))]);
        } else if constexpr (sizeof(T) == 4) {   /* no transposing ldmatrix for 32-bit elements: a float per register */
          const int n = wn * (BN / WN) + nt * 8 + (lane >> 2), k = kk + (lane & 3);
          r[0] = __float_as_uint(tb[g_swizzle<T, BN, true>(k, n / E) + n % E]);
          r[1] = __float_as_uint(tb[g_swizzle<T, BN, true>(k + 4, n / E) + n % E]);
          r[2] = __float_as_uint(tb[g_swizzle<T, BN, true>(k, n / E + 2) + n % E]);
          r[3] = __float_as_uint(tb[g_swizzle<T, BN, true>(k + 4, n / E + 2) + n % E]);
        } else {
          const int k = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
          g_ldmatrix4<true>(r, &tb[g_swizzle<T, BN>(k, ((wn * (BN / WN) + nt * 8) >> 3) + (lane >> 4))]);
        }
        bf[nt][0] = r[0]; bf[nt][1] = r[1]; bf[nt + 1][0] = r[2]; bf[nt + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) g_mma_op<T>::run(&acc[(mt * NT + nt) * 4], af[mt], bf[nt][0], bf[nt][1]);
    }
    if constexpr (HELD) if (next) gather_a((kt + STAGES - 1) % STAGES, 0, 2);
  }
  g_cp_async_wait<0>();
}
/* strict float32 on the FMA units, A gathered: one block's BM x BN tile, lane (x, y) = (tid % (BM/8), tid / (BM/8))
   holding rows 4x.. and BM/2 + 4x.., columns 4y.. and BN/2 + 4y.. in acc[8 * row + column] (rules/opt/tensor_core.py
   accumulator_at). Each slice of BK along k is copied by 4-byte cp.async, STAGES slices in flight, into tiles stored
   along k (A: BK rows of BM, B: BK rows of BN + 4), which each lane reads 4 floats at a time. A's copy: lane tid % BM
   of each row, so that consecutive lanes read consecutive output positions (consecutive addresses) */
template <int BM, int BN, int BK, int STAGES, bool B_ALONG_K, int K, long long LDB, class G>
__device__ __forceinline__ void g_fma_tile(float* acc, const float* __restrict__ A, const float* __restrict__ B, G gather) {
  constexpr int THREADS = BM * BN / 64, KT = K / BK, BNP = BN + 4;
  static_assert(K % BK == 0 && THREADS % BM == 0 && THREADS % BK == 0 && THREADS % BN == 0 && (BM * BK) % THREADS == 0
                && (BN * BK) % THREADS == 0, "tile sizes");
  float (*sa)[BK * BM] = reinterpret_cast<float (*)[BK * BM]>(g_dynamic_shared);
  float (*sb)[BK * BNP] = reinterpret_cast<float (*)[BK * BNP]>(g_dynamic_shared + STAGES * BK * BM * 4);
  int* koff = reinterpret_cast<int*>(g_dynamic_shared + STAGES * BK * (BM + BNP) * 4);
  const int tid = threadIdx.x, x = tid % (BM / 8), y = tid / (BM / 8);
  const long long roff = gather.rows(gather.row0 + tid % BM);
  for (int k = tid; k < K; k += THREADS) koff[k] = gather.ks(k);
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 64; e++) acc[e] = 0.0f;
  auto load = [&](int stage, int k0) {
#pragma unroll
    for (int t = 0; t < BM * BK / THREADS; t++) {
      const int k = tid / BM + t * (THREADS / BM);
      g_copy1(&sa[stage][k * BM + tid % BM], A + roff + koff[k0 + k]);
    }
#pragma unroll
    for (int t = 0; t < BN * BK / THREADS; t++) {   /* along k: 8 lanes read 32 bytes of a column */
      const int k = B_ALONG_K ? tid % BK : tid / BN + t * (THREADS / BN), n = B_ALONG_K ? tid / BK + t * (THREADS / BK) : tid % BN;
      g_copy1(&sb[stage][k * BNP + n], B + n * (B_ALONG_K ? LDB : 1) + (k0 + k) * (B_ALONG_K ? 1 : LDB));
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < KT) load(s, s * BK);
    g_cp_async_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    g_cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * BK);
    g_cp_async_commit();
    const float* ta = sa[kt % STAGES];
    const float* tb = sb[kt % STAGES];
#pragma unroll
    for (int k = 0; k < BK; k++) {
      float a[8], b[8];
      *reinterpret_cast<float4*>(a) = *reinterpret_cast<const float4*>(&ta[k * BM + x * 4]);
      *reinterpret_cast<float4*>(a + 4) = *reinterpret_cast<const float4*>(&ta[k * BM + BM / 2 + x * 4]);
      *reinterpret_cast<float4*>(b) = *reinterpret_cast<const float4*>(&tb[k * BNP + y * 4]);
      *reinterpret_cast<float4*>(b + 4) = *reinterpret_cast<const float4*>(&tb[k * BNP + BN / 2 + y * 4]);
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i * 8 + j] = fmaf(a[i], b[j], acc[i * 8 + j]);
    }
  }
  g_cp_async_wait<0>();
}
"""


def flat_offset(var: str, dims) -> str:
  """C text of the offset of flat index `var` running through loops `dims` ((size, stride), outermost first)."""
  terms, inner = [], 1
  for n, (size, stride) in enumerate(reversed(dims)):
    at = var if inner == 1 else f"{var} / {inner}"
    if n < len(dims) - 1: at = f"({at}) % {size}"
    if stride: terms.append(f"({at}) * {stride}LL")
    inner *= size
  return " + ".join(terms) or "0"


def gather_text(ctx, m: UOp) -> tuple[str, str]:
  """A gathered A's offsets as two lambdas declared before the tile's call, and its last argument to the template
  (", g_gather<...>{row0, rows, ks}"); ("", "") for a matrix A."""
  if (g := m.arg.gather) is None: return "", ""
  acc = ctx.names[m]
  decl = (f"auto {acc}_rows = [](long long r) -> long long {{ return {flat_offset('r', g.rows)}; }};\n"
          f"auto {acc}_ks = [](int k) -> int {{ return {flat_offset('k', g.ks)}; }};\n")
  chunked = ", true" if g.chunked else ""
  return decl, f", g_gather<decltype({acc}_rows), decltype({acc}_ks){chunked}>{{{ctx[m.src[2]]}, {acc}_rows, {acc}_ks}}"


def render_mma(ctx, m: UOp) -> str:
  s = m.arg
  decl, gather = gather_text(ctx, m)
  if s.tma: return render_tma(ctx, m)
  if s.wgmma: return decl + render_wgmma(ctx, m, gather)
  t = ctx.lang.type(getattr(dtypes, s.dtype))
  args = f"{t}, {s.bm}, {s.bn}, {s.bk}, {s.wm}, {s.wn}, {s.stages}, {'true' if s.b_along_k else 'false'}, {s.k}, {s.lda}LL, {s.ldb}LL"
  call = "g_mma_tile"
  if s.fma: call, args = "g_fma_tile", f"{s.bm}, {s.bn}, {s.bk}, {s.stages}, {'true' if s.b_along_k else 'false'}, {s.k}, {s.ldb}LL"
  return f"float {ctx.names[m]}[{s.regs}];\n{decl}{call}<{args}>({ctx.names[m]}, {ctx[m.src[0]]}, {ctx[m.src[1]]}{gather});"


def shared_bytes(linear: UOp) -> int:
  """The dynamic shared memory a linear kernel's MMA tiles take (0 without one)."""
  return max((u.arg.shared_bytes for u in linear.src if u.op is Ops.MMA), default=0)


mma_rules = PatternMatcher([
  (UPat(Ops.MMA, name="m"), render_mma),
  (UPat(Ops.GEP, src=(UPat(Ops.MMA, name="m"), UPat(Ops.CONST, name="e"))), lambda ctx, m, e: f"{ctx.names[m]}[{e.arg}]", "render_mma_element"),
], name="render.cuda_mma")
