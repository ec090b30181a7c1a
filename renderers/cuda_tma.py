"""CUDA text of a Hopper wgmma tile fed by the tensor memory accelerator (TMA): the `MMA` node of
rules/opt/tensor_core.py whose TileSpec has `tma` set (a 16-bit matrix product, no batch, on sm_90).

The block is BM/64 consumer warpgroups (threads 0..2*BM-1, as in renderers/cuda_wgmma.py, so the accumulators and the
epilogue's stores are laid out the same) and one producer warpgroup after them. One thread of the producer copies each
slice of 64 along k of the A tile (BM rows of 128 bytes) and the B tile into shared memory with
`cp.async.bulk.tensor.2d` (one box of 64 x BM for A; B along k one box of 64 x BN, B along j BN/64 boxes of 64 columns
by 64 k), through tensor maps the host made (runtime/cuda.py: `G_TMAP(...)` before the kernel's name declares each,
its tensor passed as `const __grid_constant__ g_tensor_map` after the buffers). The maps ask for the 128-byte swizzle,
which lays a box out as renderers/cuda_wgmma.py's descriptors read it (chunk c of a 128-byte row r at c ^ (r % 8),
atoms of 8 rows 1024-byte aligned), so the descriptors are the cp.async template's.

STAGES slices in flight, each with two mbarriers: `full` (the producer's expected bytes; the copies complete it) and
`empty` (one arrival per consumer warp, of each block of the cluster, once the wgmma group that read the slice is
retired). A consumer waits on `full`, issues its 4 wgmma as one group, retires the group before (`wgmma.wait_group 1`)
and releases that one's slice; the producer waits on `empty` before refilling a slice. No block barrier in the loop. Registers: the kernel is
launched with `__launch_bounds__(threads, 1)`, and `setmaxnreg` gives the producer 40 and the consumers 232 (128
accumulators of a 128x256 tile and the epilogue).

The rendered kernel's body runs in a loop over its tiles (`persistent`), `g_tile` from the block index on by the grid's
size, in two branches: the producer warpgroup's first thread computes each tile's place and copies its slices
(`g_tma_pipeline::produce`), the consumers compute each tile (`consume`) and its epilogue. A persistent tile
(`TensorMaps.persistent`: at most rules/opt/tensor_core.py PERSISTENT_SLICES slices of k) is marked `G_PERSISTENT`,
and the host launches at most one block a multiprocessor (runtime/cuda.py), so the producer copies the next tile's first
slices while the consumers store the last one's, and no block starts or ends between tiles. Longer tiles keep a block
per tile (each loop runs once), which the hardware hands out as multiprocessors free up.

Clusters (`TensorMaps.cluster` > 1, persistent tiles; `__cluster_dims__(CLUSTER, 1, 1)` before the kernel's name):
the blocks of a cluster compute consecutive rows of tiles of the same columns at every turn of the loop (the order of
rules/opt/tensor_core.py `block_order`), so they share B's tile: each block's producer copies BN / CLUSTER of its
columns into the slice of every block of the cluster (`.multicast::cluster`, completing each one's `full` barrier),
each block's `full` expects the whole slice, and a slice's `empty` barrier counts the consumer warps of every block (a
consumer warp arrives on its own block's and, through `mapa`, on the others'). Barriers are made before a cluster-wide
barrier, and every thread meets the others at the end (`finish`): no block ends while another may still copy into it
or arrive on its barriers. The host launches whole clusters, at most as many as the GPU holds at once.

A 16-bit output matrix (`TensorMaps.store`, PARTS > 0) is stored by TMA, as cuBLAS's kernels store theirs: the lanes
write their (paired) values into a staging tile after the slices (`staged`; the graph's stores into the DEFINE_LOCAL
parts, rules/opt/tensor_core.py `_staged`, each part rendered as a pointer there), and `persistent` puts around each
part's writes a `store_wait` (the warpgroup's first thread waits until the copy engine has read the part before out of
the staging tile, `cp.async.bulk.wait_group.read`, and its warpgroup meets it at a named barrier) and a `store_tile`
(each writer's `fence.proxy.async.shared::cta`, the barrier, then the first thread stores the warpgroup's boxes of 64 x
64 by `cp.async.bulk.tensor.2d.global.shared::cta` through the output's map, a third `G_TMAP`); before the block ends,
`store_drain` waits for its stores. The consumers go on into the next tile while the copy engine stores: no lane
stores the output, and each store is of whole 128-byte lines (the lanes' half2 stores filled 8 half-used sectors a
warp instruction, ~11% of x @ W's time).
"""
from __future__ import annotations
import re
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes

BK = 64            # a slice: 128 bytes of 16-bit k (one swizzled row)
PRODUCER = 128     # the producer warpgroup's threads
PRODUCER_REGS, CONSUMER_REGS = 40, 232   # setmaxnreg: 128 x 40 + 256 x 232 <= 65536 registers

PRELUDE = r"""
/* a tensor map (the driver's CUtensorMap: 128 opaque bytes), made on the host (runtime/cuda.py) and passed by value;
   G_TMAP(...) before a kernel's name declares one for the host (see runtime/cuda.py tensor_maps) */
struct __align__(64) g_tensor_map { unsigned long long opaque[16]; };
#define G_TMAP(...)
#define G_PERSISTENT
__device__ __forceinline__ void g_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void g_mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void g_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
/* until the phase of parity `parity` of the barrier has completed */
__device__ __forceinline__ void g_mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred p;\nG_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra G_WAIT;\n}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
/* the box at (c0 inner, c1 outer) of `map`'s tensor into shared memory at dst; its bytes complete `bar` */
__device__ __forceinline__ void g_tma_load(unsigned dst, const g_tensor_map& map, int c0, int c1, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               :: "r"(dst), "l"(&map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
/* the same box into shared memory at dst of every block of the cluster in `mask` (their ranks), completing each one's
   barrier at bar */
__device__ __forceinline__ void g_tma_multicast(unsigned dst, const g_tensor_map& map, int c0, int c1, unsigned bar, unsigned short mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n"
               :: "r"(dst), "l"(&map), "r"(c0), "r"(c1), "r"(bar), "h"(mask) : "memory");
}
/* an arrival on the barrier at bar in the cluster's block `rank`. Its semantics are the default's, release at the
   block's scope: it says that the wgmma reading a slice are done, and orders no write of this thread for the other
   block (`.release.cluster` made every product of a cluster of 2 run twice as long on an H100, of 4 four times) */
__device__ __forceinline__ void g_mbar_arrive_at(unsigned bar, unsigned rank) {
  asm volatile("{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [r];\n}\n"
               :: "r"(bar), "r"(rank) : "memory");
}
/* every thread of every block of the cluster */
__device__ __forceinline__ void g_cluster_sync() { asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory"); }
/* the TMA pipeline of a block that computes BM x BN product tiles one after the other (renderers/cuda_tma.py): the
   producer thread's `produce` copies a tile's slices, each consumer's `consume` computes its accumulators acc[e]
   (laid out as g_wgmma_tile's); each keeps its place in the ring of STAGES slices from tile to tile. CLUSTER blocks
   (consecutive rows of tiles, the same columns, tile for tile) share B's tile: each block's producer copies BN / CLUSTER
   of its columns into every block's slice (multicast), so a slice is refilled once the consumers of every block of the
   cluster released it, and no block ends before the others are done with its barriers (`finish`) */
template <class T, int BM, int BN, int STAGES, bool B_ALONG_K, int K, int CLUSTER = 1, int PARTS = 0> struct g_tma_pipeline {
  static constexpr int BK = 64, CONSUMERS = BM * 2, KT = K / BK, REGS = BN / 2;
  static constexpr int A_BYTES = BM * 128, STAGE = (BM + BN) * 128, B_PART = BN / CLUSTER;
  /* (PARTS > 0: the output tile stored by TMA from a staging tile after the slices, in PARTS parts of BN / PARTS
     columns; a consumer warpgroup's share of a part: its 64 rows, boxes of 64 x 64 of 8 KiB each) */
  static constexpr int PART = PARTS ? BN / PARTS : 0, BOXES = PART / 64, STAGING = BM * PART * 2;
  static_assert(sizeof(T) == 2 && BM % 64 == 0 && (BN == 128 || BN == 256) && K % BK == 0 && STAGES >= 2, "tile sizes");
  static_assert(B_PART % 64 == 0 && PART % 64 == 0, "a block's share of B, a part of the output: whole boxes of 64 columns");
  unsigned base, bars, rank = 0;   /* the slices (1024-byte aligned); full[s] at bars + 8s, empty[s] at bars + 8 (STAGES + s) */
  unsigned staged;                 /* the staging tile's offset in g_dynamic_shared (after the slices, 1024-byte aligned) */
  int stage = 0;
  unsigned phase = 0;
  __device__ __forceinline__ g_tma_pipeline() {
    const unsigned raw = g_shared_address(g_dynamic_shared);
    base = (raw + 1023u) & ~1023u;
    staged = base - raw + STAGES * STAGE;
    bars = base + STAGES * STAGE + STAGING;
    if (CLUSTER > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; s++) { g_mbar_init(bars + 8 * s, 1); g_mbar_init(bars + 8 * (STAGES + s), CLUSTER * CONSUMERS / 32); }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");   /* the inits, seen by the copy engine */
    }
    if (CLUSTER > 1) g_cluster_sync(); else __syncthreads();   /* (a cluster: the others' copies and arrivals reach them) */
  }
  /* (every thread, last) the cluster's blocks wait for each other: none ends while another may arrive on its barriers */
  __device__ __forceinline__ void finish() { if (CLUSTER > 1) g_cluster_sync(); }
  __device__ __forceinline__ void next() { if (++stage == STAGES) { stage = 0; phase ^= 1; } }
  /* (the producer thread) the tile at (row0, col0): each slice once its last readers released it */
  __device__ __forceinline__ void produce(const g_tensor_map& ta, const g_tensor_map& tb, int row0, int col0) {
    for (int kt = 0; kt < KT; kt++, next()) {
      g_mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);   /* (a fresh barrier's phase before the first has "completed") */
      const unsigned sa = base + stage * STAGE, sb = sa + A_BYTES, full = bars + 8 * stage;
      g_mbar_expect(full, STAGE);
      g_tma_load(sa, ta, kt * BK, row0, full);
      if (CLUSTER == 1 && B_ALONG_K) g_tma_load(sb, tb, kt * BK, col0, full);
      else if (B_ALONG_K) g_tma_multicast(sb + rank * B_PART * 128, tb, kt * BK, col0 + rank * B_PART, full, (1 << CLUSTER) - 1);
      else {
#pragma unroll
        for (int i = 0; i < B_PART / 64; i++) {
          const int c = rank * (B_PART / 64) + i;
          if (CLUSTER == 1) g_tma_load(sb + c * (BK * 128), tb, col0 + 64 * c, kt * BK, full);
          else g_tma_multicast(sb + c * (BK * 128), tb, col0 + 64 * c, kt * BK, full, (1 << CLUSTER) - 1);
        }
      }
    }
  }
  /* (each consumer thread) its accumulators of the next tile; every slice it read released when it returns */
  __device__ __forceinline__ void consume(float* acc) {
    const int tid = threadIdx.x, wg = tid >> 7;
#pragma unroll
    for (int e = 0; e < REGS; e++) acc[e] = 0.0f;
    int last = 0;
    for (int kt = 0; kt < KT; kt++, next()) {
      g_mbar_wait(bars + 8 * stage, phase);
      const unsigned sa = base + stage * STAGE, sb = sa + A_BYTES;
      g_wgmma_slice<T, BN, B_ALONG_K>(acc, sa + wg * 64 * 128, sb);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      g_wgmma_wait<1>();   /* the group before is done: its slice goes back to the producer */
      if (kt > 0 && (tid & 31) == 0) release(last);
      last = stage;
    }
    g_wgmma_wait<0>();
    if ((tid & 31) == 0) release(last);
  }
  /* (each consumer thread, PARTS > 0) before its warpgroup writes a part into the staging tile: the TMA store of the
     part before has read it (the warpgroup's first thread committed that store and waits; its warpgroup with it) */
  __device__ __forceinline__ void store_wait() {
    if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    g_warpgroup_sync();
  }
  /* (each consumer thread) its warpgroup's rows of part `part` of the tile at (row0, col0) are in the staging tile:
     seen by the copy engine (each writer's proxy fence, then the warpgroup's barrier), its first thread stores them */
  __device__ __forceinline__ void store_tile(const g_tensor_map& tc, int row0, int col0, int part) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    g_warpgroup_sync();
    if ((threadIdx.x & 127) == 0) {
      const int wg = threadIdx.x >> 7;
      const unsigned src = base + STAGES * STAGE + wg * (64 * PART * 2);
#pragma unroll
      for (int b = 0; b < BOXES; b++)
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                     :: "l"(&tc), "r"(col0 + part * PART + 64 * b), "r"(row0 + 64 * wg), "r"(src + b * 8192) : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
  /* (each consumer thread, last) the stores are done before the block ends (its shared memory goes to the next) */
  __device__ __forceinline__ void store_drain() {
    if (PARTS && (threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
  /* (each thread of a consumer warpgroup) its warpgroup's barrier (named barrier 1 + its index, 128 threads) */
  __device__ __forceinline__ void g_warpgroup_sync() { asm volatile("bar.sync %0, 128;\n" :: "r"(1 + (threadIdx.x >> 7)) : "memory"); }
  /* (a consumer warp's first lane) slice s read: one arrival on its `empty` barrier in each block of the cluster */
  __device__ __forceinline__ void release(int s) {
    g_mbar_arrive(bars + 8 * (STAGES + s));
    for (unsigned r = 0; r < CLUSTER; r++) if (r != rank) g_mbar_arrive_at(bars + 8 * (STAGES + s), r);
  }
};
/* the producer warpgroup's and the consumers' registers (setmaxnreg, under __launch_bounds__(threads, 1)) */
__device__ __forceinline__ void g_producer_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(""" + str(PRODUCER_REGS) + r""")); }
__device__ __forceinline__ void g_consumer_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(""" + str(CONSUMER_REGS) + r""")); }
"""


def holds_tma(linear: UOp) -> bool: return any(u.op is Ops.MMA and u.arg.tma is not None for u in linear.src)


def _param(linear: UOp, buf: UOp) -> int:
  """The position among the kernel's parameters of the buffer `buf` (cstyle.kernel_params: globals by slot)."""
  return sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL).index(buf.arg)


def tensor_map_decls(linear: UOp) -> tuple[str, tuple[str, ...]]:
  """The kernel's head declarations (`G_PERSISTENT` where its tiles are short enough, and `G_TMAP(param, element bytes,
  inner size, outer size, outer stride, inner box, outer box, offset)` of each tensor map, sizes and offsets in
  elements) and the maps' parameters, after the buffers."""
  m = next(u for u in linear.src if u.op is Ops.MMA and u.arg.tma is not None)
  s, t = m.arg, m.arg.tma
  a, b = (_param(linear, m.src[i].src[0]) for i in (0, 1))
  # A: rows of k (K-major); B along k: a row of k per column; B along j: a row of columns per k
  maps = [(a, s.k, t.rows, s.lda, BK, s.bm, t.a_offset),
          (b, s.k, t.cols, s.ldb, BK, s.bn // t.cluster, t.b_offset) if s.b_along_k else (b, t.cols, s.k, s.ldb, 64, BK, t.b_offset)]
  if t.store:   # the output: N columns of M rows, in boxes of 64 x 64 (a consumer warpgroup's rows of 64 columns)
    maps.append((sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL).index(t.store.buffer), t.cols, t.rows,
                 t.store.stride, 64, 64, t.store.offset))
  head = "".join(f" G_TMAP({p}, {s.itemsize}, {inner}, {outer}, {ld}, {bi}, {bo}, {off})" for p, inner, outer, ld, bi, bo, off in maps)
  maps_params = ("const __grid_constant__ g_tensor_map g_map_a", "const __grid_constant__ g_tensor_map g_map_b") \
    + (("const __grid_constant__ g_tensor_map g_map_c",) if t.store else ())
  cluster = f" __cluster_dims__({t.cluster}, 1, 1)" if t.cluster > 1 else ""
  return (" G_PERSISTENT" if t.persistent else "") + cluster + head, maps_params


_MARK = "/* G_TMA "   # the consumer's call carries the pipeline's type and the producer's call for `persistent`


def render_tma(ctx, m: UOp) -> str:
  """The consumers' call (`persistent` then gives the producer its own): the tile's accumulators; the two maps and the
  tile's first row and column (the MMA's third and fourth sources) go to the producer's."""
  s = m.arg
  t = ctx.lang.type(getattr(dtypes, s.dtype))
  parts = f", {s.tma.store.parts}" if s.tma.store else ""
  pipe = f"g_tma_pipeline<{t}, {s.bm}, {s.bn}, {s.stages}, {'true' if s.b_along_k else 'false'}, {s.k}, {s.tma.cluster}{parts}>"
  at = f"{ctx[m.src[2]]}, {ctx[m.src[3]]}"
  return f"float {ctx.names[m]}[{s.regs}];\ng_pipe.consume({ctx.names[m]});   {_MARK}{pipe} | g_pipe.produce(g_map_a, g_map_b, {at}); | {at} */"


def _staging(ctx, b: UOp) -> str:
  """A part of a TMA store's staging tile (rules/opt/tensor_core.py `_staged`): a pointer into the pipeline's shared
  memory, marked with its part for `persistent` (which stores each part after its last write)."""
  return f"{ctx.lang.type(b.dtype.base)}* {ctx.names[b]} = ({ctx.lang.type(b.dtype.base)}*)(g_dynamic_shared + g_pipe.staged);   {_STAGE}{b.arg[1]} */"


_STAGE = "/* G_STAGE "


def _stored_parts(lines: list[str], epilogue: list[str], at: str) -> list[str]:
  """The epilogue with each staging part's TMA store after its last write, and a wait before its first (the part
  before read out of the staging tile); `lines`: the whole kernel, where the parts' pointers are declared."""
  names = {m.group(1): int(m.group(2)) for ln in lines if (m := re.search(r"\* (local\d+) = .*" + re.escape(_STAGE) + r"(\d+) \*/", ln))}
  if not names: return epilogue
  writes = {p: [i for i, ln in enumerate(epilogue) if re.search(rf"\({name}\+", ln)] for name, p in names.items()}
  spans = [(min(writes[p]), max(writes[p]), p) for p in sorted(writes)]
  assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), "a staging part's writes all before the next part's"
  out = list(epilogue)
  for first, last, p in reversed(spans):
    indent = re.match(r"\s*", out[last]).group(0)
    out[last + 1:last + 1] = [f"{indent}g_pipe.store_tile(g_map_c, {at}, {p});"]
    out[first:first] = [f"{indent}g_pipe.store_wait();"]
  return out


def persistent(kernel: str, tiles: int, consumers: int) -> str:
  """The rendered kernel with its body run for each of its `tiles` tiles in turn (the graph's block index: blockIdx.x,
  then gridDim.x further; runtime/cuda.py launches at most one block a multiprocessor, `G_PERSISTENT`), as one if/else
  of the producer warpgroup (its first thread copies every tile's slices, the body up to the product computing the
  tile's place) and the consumers (the whole body: the product, then the epilogue's stores, while the producer copies
  the next tile's first slices)."""
  lines = kernel.split("\n")
  at = next(i for i, ln in enumerate(lines) if _MARK in ln)
  call, mark = lines[at].split(_MARK)
  pipe, produce, tile = mark.removesuffix(" */").split(" | ")
  head, prologue, declare, epilogue = lines[0], lines[1:at - 1], lines[at - 1], _stored_parts(lines, lines[at + 1:-1], tile)
  loop = f"for (int g_tile = blockIdx.x; g_tile < {tiles}; g_tile += gridDim.x) {{"
  indent = lambda block, n: ["  " * n + ln for ln in block]
  return "\n".join([head, f"  {pipe} g_pipe;", f"  if (threadIdx.x >= {consumers}) {{", "    g_producer_registers();",
                    f"    if (threadIdx.x == {consumers}) {loop}", *indent(prologue, 2), f"      {produce}", "    }",
                    "    g_pipe.finish();", "  } else {", "    g_consumer_registers();", f"    {loop}", *indent(prologue, 2),
                    *indent([declare, call.rstrip()], 2), *indent(epilogue, 2), "    }", "    g_pipe.store_drain();",
                    "    g_pipe.finish();", "  }", "}"])


# (before the CUDA renderer's own rules, in a kernel on TMA) the graph's block index is the tile the loop is at
tma_rules = PatternMatcher([
  (UPat(Ops.SPECIAL, name="s"), lambda s: "g_tile" if s.arg[0][0] == "g" else None, "render_tma_tile"),
  (UPat(Ops.DEFINE_LOCAL, name="b"), lambda ctx, b: _staging(ctx, b) if b.arg[0] == "tma_store" else None, "render_tma_staging"),
], name="render.cuda_tma")
