"""CUDA text of a block's product tile on Hopper's warpgroup MMA (sm_90a): the `MMA` node of rules/opt/tensor_core.py
whose TileSpec has `wgmma` set.

`MMA(A, B, arg=TileSpec)` renders as a lane's accumulator array and one call of `g_wgmma_tile`, a template of the
prelude below (added to a source only when one of its kernels calls it; runtime/cuda.py then builds the source for
sm_90a, the only target with wgmma). A block is BM/64 warpgroups of 4 warps; warpgroup g computes rows 64g..64g+63 of
the block's BM x BN tile with `wgmma.mma_async.m64n{BN}k16` (f32 accumulators, f16 or bf16 operands, both read from
shared memory through 64-bit matrix descriptors), or with GRAFT_TF32=1 `m64n{BN}k8.f32.tf32.tf32` on float32 operands
with B along k (TF32's wgmma reads only K-major operands): every byte offset below is the same (a slice is 128 bytes
of k: 64 halves or 32 floats; one wgmma 32 bytes of it). A float32 B along j (x @ W) takes the transposed product
(SWAP, below).
The template:
- copies each slice of 64 along k of the block's A tile (BM rows of 128 bytes) and B tile into shared memory with
  `cp.async` 16-byte copies, in the canonical 128-byte-swizzle layout the descriptors name: 16-byte chunk c of a
  128-byte row r lands at chunk c ^ (r % 8) (the tensor cores undo the XOR on the address bits), 8 rows making an
  atom of 1024 bytes, every atom 1024-byte aligned;
  - A (K-major: a row of A is contiguous along k): row i of the tile is row i of the slice; descriptor SBO = 1024 (the
    next 8 rows), LBO unused; the 4 steps of 16 along k start 32 bytes apart inside the swizzled row;
  - B along k (K-major too, a transposed weight x @ W.T): the same, a row per column j;
  - a 16-bit B along j (MN-major, imm-trans-b = 1): the slice's 64 rows of k, in blocks of 64 columns (a 128-byte row of
    each block per k); SBO = 1024 (the next 8 rows of k), LBO = 64 x 128 bytes (the next block of 64 columns); the
    steps of 16 along k start 2048 bytes apart;
- keeps STAGES slices of shared memory, STAGES - 2 copied ahead of the one the tensor cores read, and one wgmma group
  left running across steps: each step waits for its slice (and, at the barrier, for every warpgroup to be done with
  the group of two steps back), issues its 4 wgmma (k16 each) as one group, then, while they run, the copies of the
  slice STAGES - 2 further into the stage that group read, then waits for the previous step's group
  (`wgmma.wait_group 1`). Each thread fences its landed copies into the async proxy (`fence.proxy.async`) before the
  barrier, as the tensor cores read shared memory through it.
- ptxas keeps the groups in flight only where no other instruction touches the accumulators between a wgmma and the
  wait that retires it; otherwise it serializes every wgmma of the kernel (warning C7514). The accumulators are a fixed
  array passed as "+f" operands to each wgmma and read only after the last wait; and the kernel reads its block and
  thread indices once, through `g_block_index()` and `g_thread_index()` (`wgmma_rules`): nvcc reads `%ctaid` or `%tid`
  again after the product where the epilogue uses them, which alone made ptxas serialize (ptxas 13.0: `%ctaid` in
  every product; `%tid` in some, such as one column of blocks over 9 or more slices, 16896x576 @ 576x128;
  tests/test_tensor_cores.py compiles every kernel and checks).
SWAP (TF32, B stored along j; rules/opt/tensor_core.py `TileSpec.swapped`): TF32's wgmma reads only K-major operands
from shared memory, but its A may come from registers, where any layout does. The block computes the transpose of its
BM x BN tile: warpgroup g the 64 columns 64g.. of B's tile (BN/64 warpgroups) against all BM rows of A's tile, with
`m64n{BM}k8` whose A is 4 registers a lane (mma.m16n8k8's A fragment per warp: B's element (k, j) for j = 16 (warp) +
lane/4 (+8) and k = lane%4 (+4) of each 8) and whose B is A's tile, K-major as above (SBO 1024). B's tile is copied as
stored (cp.async of 16 bytes: a row of BN floats per k, chunk c of row r at c ^ 2 (r % 4), so a warp's 32 fragment reads
hit 32 banks) and read with one 32-bit shared load per register. A wgmma reads its A registers while it runs (until the
wait that retires its group; the compilers do not see this): a slice's fragments are held (`g_wgmma_hold`, a store no
thread makes) up to that wait, so the next slice's are loaded into other registers (two sets, alternately). The
accumulators are the transposed tile's: the layout below with rows and columns exchanged.
A gathered A (a channels-last convolution of 16-bit operands: rules/opt/tensor_core.py `Gather.chunked`) is copied in the same 16-byte
chunks from its rows' offsets (per thread, once) and k's (a table after the tiles); its steps wait for their own group
(`wait_group 0`: with one left in flight ptxas serialized every wgmma of such a kernel, C7514), so its copies run
STAGES - 1 slices ahead, in 3 slices (97 KiB and the table: 2 blocks a multiprocessor).
Accumulator e of a lane (the PTX fragment layout of m64nNk16's D, which is mma.m16n8k16's C per 8 columns) holds the
output at row 16 * (warp % 4) + lane / 4 + 8 * ((e % 4) / 2) of its warpgroup's 64 rows and column
8 * (e / 4) + 2 * (lane % 4) + e % 2: the layout of renderers/cuda_mma.py with one m16 fragment per warp (WM = BM/16
warps along rows, WN = 1), so rules/opt/tensor_core.py places the epilogue's stores the same way for both.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes

WIDTHS = (128, 256)   # the n of m64nNk the tiles use (BN)
# operand type -> (its PTX type, the k of one wgmma: 32 bytes of a row)
TYPES = {"half": ("f16", 16), "__nv_bfloat16": ("bf16", 16), "float": ("tf32", 8)}


def _op(ctype: str, n: int) -> str:
  """One wgmma of m64n{n}k{k} on a warpgroup's n/2 accumulators; TB: B is MN-major (stored along j; 16-bit operands
  only: TF32 reads both operands K-major and takes no transpose immediates)."""
  ptx, k = TYPES[ctype]
  regs = n // 2
  d = ", ".join(f"%{i}" for i in range(regs))
  outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
  trans = f", 0, %{regs + 3}" if k == 16 else ""
  return (f"template <> struct g_wgmma_op<{ctype}, {n}> {{\n"
          f"  template <int TB> static __device__ __forceinline__ void run(float* d, unsigned long long a, unsigned long long b) {{\n"
          f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"\n'
          f'                 "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} {{{d}}}, %{regs}, %{regs + 1}, p, 1, 1{trans};\\n}}\\n"\n'
          f'                 : {outs}\n                 : "l"(a), "l"(b), "r"(1), "n"(TB));\n  }}\n}};')


def _op_rs(n: int) -> str:
  """One TF32 wgmma of m64n{n}k8 whose A is a warpgroup's registers (4 a lane: mma.m16n8k8's A fragment per warp) and
  whose B is read from shared memory (K-major): the transposed product of a B stored along j."""
  regs = n // 2
  d = ", ".join(f"%{i}" for i in range(regs))
  outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
  a = ", ".join(f"%{regs + i}" for i in range(4))
  return (f"template <> struct g_wgmma_rs<{n}> {{\n"
          f"  static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned long long b) {{\n"
          f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"\n'
          f'                 "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{d}}}, {{{a}}}, %{regs + 4}, p, 1, 1;\\n}}\\n"\n'
          f'                 : {outs}\n                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));\n  }}\n}};')


PRELUDE = "\n".join([r"""
template <class T, int N> struct g_wgmma_op;
template <int N> struct g_wgmma_rs;""", *(_op(c, n) for c in TYPES for n in WIDTHS), *(_op_rs(n) for n in WIDTHS), r"""
/* a shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte units), 128-byte swizzle */
__device__ __forceinline__ unsigned long long g_wgmma_desc(unsigned address, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16)
         | ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
/* the block's and the thread's index, each read once (a second read after the product, which nvcc makes where the
   epilogue uses them, made ptxas serialize every wgmma: C7514) */
__device__ __forceinline__ int g_block_index() { int r; asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ int g_thread_index() { int r; asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r)); return r; }
template <int N> __device__ __forceinline__ void g_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
/* a wgmma reads its A registers until the wait that retires its group (PTX: they must not be written before), which
   nvcc and ptxas do not see: this keeps a slice's 16 fragments alive up to here, read by stores no thread makes (the
   predicate, A's address equal to 1, is never true and unknown to the compilers), so the next slice's take others */
__device__ __forceinline__ void g_wgmma_hold(const unsigned (&f)[4][4], const void* never_one, unsigned to) {
  asm volatile("{\n.reg .pred q;\nsetp.eq.u64 q, %16, 1;\n"
               "@q st.shared.v4.b32 [%17], {%0, %1, %2, %3};\n@q st.shared.v4.b32 [%17+16], {%4, %5, %6, %7};\n"
               "@q st.shared.v4.b32 [%17+32], {%8, %9, %10, %11};\n@q st.shared.v4.b32 [%17+48], {%12, %13, %14, %15};\n}\n"
               :: "r"(f[0][0]), "r"(f[0][1]), "r"(f[0][2]), "r"(f[0][3]), "r"(f[1][0]), "r"(f[1][1]), "r"(f[1][2]), "r"(f[1][3]),
                  "r"(f[2][0]), "r"(f[2][1]), "r"(f[2][2]), "r"(f[2][3]), "r"(f[3][0]), "r"(f[3][1]), "r"(f[3][2]), "r"(f[3][3]),
                  "l"(never_one), "r"(to) : "memory");
}
/* a warpgroup's 4 wgmma (k16 each) over one 16-bit slice of 64 along k: its 64 rows of A's tile at sa (K-major), B's
   tile at sb (K-major, or MN-major in blocks of 64 columns 8 KiB apart); not committed (the caller commits the group) */
template <class T, int BN, bool B_ALONG_K>
__device__ __forceinline__ void g_wgmma_slice(float* acc, unsigned sa, unsigned sb) {
  const unsigned long long da = g_wgmma_desc(sa, 16, 1024);
  const unsigned long long db = B_ALONG_K ? g_wgmma_desc(sb, 16, 1024) : g_wgmma_desc(sb, 64 * 128, 1024);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < 4; kk++)   /* the start address field counts 16 bytes: A's and a K-major B's step is 32 bytes, an MN-major B's 16 rows of 128 */
    g_wgmma_op<T, BN>::template run<B_ALONG_K ? 0 : 1>(acc, da + kk * 2, db + (B_ALONG_K ? kk * 2 : kk * 128));
}
/* one block's BM x BN product tile on wgmma: acc[e] of each lane (see renderers/cuda_wgmma.py) */
template <class T, int BM, int BN, int STAGES, bool B_ALONG_K, int K, long long LDA, long long LDB, class G = g_matrix>
__device__ __forceinline__ void g_wgmma_tile(float* acc, const T* __restrict__ A, const T* __restrict__ B, G gather = G()) {
  /* a slice: 128 bytes of k (a swizzled row); a chunk: 16 bytes; one wgmma: 32 bytes of k */
  /* SWAP (TF32, B along j): the transposed product, warpgroup g holding columns 64g.. of B's tile and every row of A's
     (TF32's wgmma reads K-major operands only; a B along j is read from shared memory into registers as A's fragments) */
  constexpr int E = sizeof(T);
  constexpr bool SWAP = E == 4 && !B_ALONG_K;
  constexpr int M = SWAP ? BN : BM, N = SWAP ? BM : BN;   /* the wgmma's rows (64 a warpgroup) and columns */
  constexpr int BK = 128 / E, CE = 16 / E, KSTEP = 32 / E, THREADS = M * 2, KT = K / BK, REGS = N / 2;
  constexpr int A_BYTES = BM * 128, STAGE = (BM + BN) * 128;
  static_assert(M % 64 == 0 && (N == 128 || N == 256) && K % BK == 0 && STAGES >= 3, "tile sizes");
  static_assert((BM * 8) % THREADS == 0 && (BN * 8) % THREADS == 0, "a tile is copied in whole turns");
  /* 128-byte swizzle atoms start on 1024-byte boundaries: the tiles start at the first one (G_SHARED asks 1 KiB more) */
  const unsigned raw = g_shared_address(g_dynamic_shared), base = (raw + 1023u) & ~1023u;
  unsigned char* smem = g_dynamic_shared + (base - raw);
  const int tid = threadIdx.x, wg = tid >> 7;
  /* a gathered A (in 16-byte chunks: rules/opt/tensor_core.py Gather.chunked): the offsets of this thread's rows
     (tid + t * THREADS) / 8, and a table of k's offsets after the tiles */
  constexpr bool MATRIX = g_is_matrix<G>::value;
  constexpr int AHEAD = MATRIX ? STAGES - 2 : STAGES - 1;   /* slices copied ahead: a gathered A's steps wait for their group */
  static_assert(MATRIX || (G::chunked && E == 2), "a gathered A on wgmma: 16-bit, copied in 16-byte chunks");
  long long roff[BM * 8 / THREADS];
  int* koff = reinterpret_cast<int*>(smem + STAGES * STAGE);
  if constexpr (!MATRIX) {
#pragma unroll
    for (int t = 0; t < BM * 8 / THREADS; t++) roff[t] = gather.rows(gather.row0 + ((tid + t * THREADS) >> 3));
    for (int k = tid; k < K; k += THREADS) koff[k] = gather.ks(k);
    __syncthreads();
  }
#pragma unroll
  for (int e = 0; e < REGS; e++) acc[e] = 0.0f;
  auto load = [&](int stage, int k0) {
    unsigned char* sa = smem + stage * STAGE;
    unsigned char* sb = sa + A_BYTES;
    const T* a = MATRIX ? A + k0 + (tid & 7) * CE : A + koff[k0 + (tid & 7) * CE];
#pragma unroll
    for (int t = 0; t < BM * 8 / THREADS; t++) {
      const int c = tid + t * THREADS, row = c >> 3, chunk = c & 7;
      g_cp_async16(sa + row * 128 + ((chunk ^ (row & 7)) << 4), a + (MATRIX ? row * LDA : roff[t]));
    }
#pragma unroll
    for (int t = 0; t < BN * 8 / THREADS; t++) {
      const int c = tid + t * THREADS;
      if (B_ALONG_K) {
        const int row = c >> 3, chunk = c & 7;
        g_cp_async16(sb + row * 128 + ((chunk ^ (row & 7)) << 4), B + row * LDB + k0 + chunk * CE);
      } else if (SWAP) {   /* as stored: a row of BN floats per k, chunk c of row r at c ^ 2 (r % 4) (a warp's fragment reads hit 32 banks) */
        const int row = c / (BN / 4), chunk = c % (BN / 4);
        g_cp_async16(sb + row * (BN * 4) + ((chunk ^ ((row & 3) << 1)) << 4), B + (k0 + row) * LDB + chunk * CE);
      } else {   /* MN-major: a row of k per 64 columns (128 bytes) */
        const int row = c / (BN / 8), chunk = c % (BN / 8);
        g_cp_async16(sb + (chunk >> 3) * (BK * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4), B + (k0 + row) * LDB + chunk * CE);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < AHEAD; s++) {
    if (s < KT) load(s, s * BK);
    g_cp_async_commit();
  }
  /* SWAP: the B fragments of two slices, alternately: those of slice kt stay held (`g_wgmma_hold`) until the wait that
     retires its group, so the next slice's are loaded into other registers while the tensor cores still read them */
  unsigned frags[2][BK / KSTEP][4] = {};
  auto step = [&](int kt, unsigned (&frag)[BK / KSTEP][4], unsigned (&held)[BK / KSTEP][4]) {
    g_cp_async_wait<AHEAD - 1>();   /* slice kt has landed (for this thread's copies) */
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();   /* ... for every thread's; and every warpgroup's group kt - 2 is done (it waited at step kt - 1) */
    const unsigned sa = base + (kt % STAGES) * STAGE, sb = sa + A_BYTES;
    if constexpr (SWAP) {
      /* this lane's fragments of B's tile (m16n8k8's A per warp: columns 16w + lane/4 (+8), k lane%4 (+4) of each 8) */
      const float* bt = reinterpret_cast<const float*>(smem + (kt % STAGES) * STAGE + A_BYTES);
      const int col = (tid >> 5) * 16 + ((tid & 31) >> 2), kq = tid & 3;
#pragma unroll
      for (int kk = 0; kk < BK / KSTEP; kk++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
          const int r = kk * KSTEP + kq + 4 * (q >> 1), cq = col + 8 * (q & 1);
          frag[kk][q] = __float_as_uint(bt[r * BN + (((cq >> 2) ^ (kq << 1)) << 2) + (cq & 3)]);
        }
      const unsigned long long dx = g_wgmma_desc(sa, 16, 1024);   /* A's tile, all BM rows: the wgmma's K-major B */
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / KSTEP; kk++) g_wgmma_rs<N>::run(acc, frag[kk], dx + kk * 2);
    } else {
      g_wgmma_slice<T, BN, B_ALONG_K>(acc, sa + wg * 64 * 128, sb);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    /* while the tensor cores work: the copies of slice kt + AHEAD, into the stage slice kt - 2 left (kt - 1: gathered) */
    if (kt + AHEAD < KT) load((kt + AHEAD) % STAGES, (kt + AHEAD) * BK);
    g_cp_async_commit();
    if constexpr (MATRIX) g_wgmma_wait<1>();   /* group kt - 1 is done, group kt runs on */
    else g_wgmma_wait<0>();   /* (a gathered A: one left in flight, ptxas serialized every wgmma, C7514) */
    if constexpr (SWAP) g_wgmma_hold(held, A, base);   /* group kt - 1 is done: its fragments may be overwritten now */
  };
  if constexpr (SWAP)
    for (int kt = 0; kt < KT; kt += 2) {
      step(kt, frags[0], frags[1]);
      if (kt + 1 < KT) step(kt + 1, frags[1], frags[0]);
    }
  else
    for (int kt = 0; kt < KT; kt++) step(kt, frags[0], frags[1]);
  g_wgmma_wait<0>();
  g_cp_async_wait<0>();
}
"""])


def render_wgmma(ctx, m: UOp, gather: str = "") -> str:
  """The tile's call; `gather`: a gathered A's last argument (renderers/cuda_mma.py gather_text, which declares it)."""
  s = m.arg
  t = ctx.lang.type(getattr(dtypes, s.dtype))
  args = f"{t}, {s.bm}, {s.bn}, {s.stages}, {'true' if s.b_along_k else 'false'}, {s.k}, {s.lda}LL, {s.ldb}LL"
  return f"float {ctx.names[m]}[{s.regs}];\ng_wgmma_tile<{args}>({ctx.names[m]}, {ctx[m.src[0]]}, {ctx[m.src[1]]}{gather});"


def holds_wgmma(linear: UOp) -> bool: return any(u.op is Ops.MMA and u.arg.wgmma for u in linear.src)


# (before the CUDA renderer's own rules, in a kernel that holds wgmma) its block and thread indices, each read once
wgmma_rules = PatternMatcher([
  (UPat(Ops.SPECIAL, name="s"), lambda s: {"g": "g_block_index()", "l": "g_thread_index()"}.get(s.arg[0][0]),
   "render_wgmma_indices"),
], name="render.cuda_wgmma")
