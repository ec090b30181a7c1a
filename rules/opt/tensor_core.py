"""Tensor cores on a GPU (stage `tensor_core`, kernel scope, before the GPU's own stages): a product of two 16-bit float
operands (float16 or bfloat16) summed in float32 -- the pattern `tensor/nn.py` `_mul_sum` makes for `a @ b` and for a
convolution -- or, with GRAFT_TF32=1, of two float32 operands (TF32), runs on `mma.sync` (m16n8k16; m16n8k8 for
TF32; or, a 16-bit product on Hopper, `wgmma.mma_async`) with whatever is elementwise around it (bias, activation,
residual, cast) applied to its accumulators before the store. A strict float32 convolution (two float32 operands,
GRAFT_TF32 unset, A gathered) takes the same tile's staging on the FMA units (`TileSpec.fma`).

Contract. In: a lowered kernel `SINK(STORE(out[idx], f(REDUCE(ADD, float32, CAST(LOAD A) * CAST(LOAD B), *ks))))`
(float32 loads without the CASTs for TF32) whose only loops are its output loops and the ks; both indices affine.
B: one output loop j in its index and not A's, its k loops one flat loop (`collapse`) along which B is contiguous, or
B contiguous along j. A: its rows, the output loops in its index and not B's; either a matrix (k one flat loop of
stride 1; its innermost row loop i, the others a batch; row stride a multiple of 16 bytes) or gathered (a
convolution's windows: `Gather`, every row loop and k loop with its stride; `chunked` where k's innermost loop is
contiguous and every offset a whole number of 16-byte chunks: a channels-last input, tensor/nn.py `conv2d`). Every
other output loop is a batch
(strides multiples of 16 bytes); the sizes divide a tile. A matrix A is preferred where either operand could be A.
Out: the same stores, one per accumulator a lane holds (or pair, below), over `MMA`, the node of a block's whole product tile:

- `MMA(INDEX(A, the tile's first row), INDEX(B, its first column)[, the first flat row], arg=TileSpec)`, dtype
  `float32.vec(regs)`: a block of WM x WN warps computes BM x BN outputs; for each slice of BK along k the block copies
  its tiles of A and B into shared memory (`cp.async`, STAGES slices in flight, rows swizzled so that `ldmatrix`
  reads hit 32 banks; a gathered A from its base at row 0 and the flat row given, in chunks where `chunked`, else
  element by element), and each warp
  reads its fragments with `ldmatrix` (`.trans` for a 16-bit B stored along j) and accumulates its (BM/WM) x (BN/WN)
  outputs in registers with `mma.sync` (renderers/cuda_mma.py renders it);
- `GEP(MMA, e)` is accumulator e of a lane, the output at row and column given by mma's fragment layout (lane//4 and
  8 rows further for the row, 2*(lane%4) and the next for the column); the epilogue f and the store index are the
  kernel's own, with the row loops (the flat row split back), j and the batch loops replaced by those indices; a
  16-bit output contiguous along j stores accumulators e and e + 1 (neighbouring columns) as one pair (`VECTORIZE`
  of 2, a 4-byte store: half as many stores, each filling twice the bytes of a sector), and the float32 reciprocals
  of a 16-bit output's epilogue are approximate (`RECIP` with arg "approx": `rcp.approx.f32`, within 1 ulp of
  float32, where its value is then rounded to 16 bits);
- blocks are numbered along j within groups of GROUP block rows (blocks that run together share their tiles of B and
  A in L2); the kernel's SINK carries the plan as `Opt(OptKind.TENSOR_CORE, axis, amount)` records: the row loops'
  and j's tile sizes and the k loops' slice.

On sm_90 (`TensorCoreContext.arch`, from the device) a product with a WGMMA tile (WGMMA_TILES: k a multiple of 64;
TF32_WGMMA_TILES for TF32 with B along k, TF32_SWAPPED_TILES with B along j: of 32) that gives every multiprocessor a
block takes it: `TileSpec.wgmma`, rendered by renderers/cuda_wgmma.py with Hopper's warpgroup MMA. Its warps hold 16
rows each (WM = BM/16, WN = 1) and its accumulators are laid out as mma.sync's per warp, so the stores above serve
both; a gathered A takes it where `chunked`. TF32 with B along j computes the tile's transpose (`TileSpec.swapped`:
its warps hold 16 columns each, WM = BN/16, and `accumulator_at` exchanges row and column). GRAFT_WGMMA=0 (or
GRAFT_TC_TILE) keeps mma.sync. A 16-bit product on wgmma whose A and B are both matrices and that has no batch loop takes its tiles by TMA
(`TileSpec.tma`, `TensorMaps`: A's rows, B's columns and each operand's offset, which the host's tensor maps need;
renderers/cuda_tma.py): a producer warpgroup of TMA_PRODUCER threads after the tile's, its threads ending in the
tile's call (in the graph they hold the accumulators of thread lidx % the tile's threads: the same outputs), and as
many slices in flight as shared memory holds; a tile of at most PERSISTENT_SLICES slices of k is persistent (a block a
multiprocessor loops over the tiles), in clusters of TMA_CLUSTER blocks that share B's tile by multicast where the rows
of tiles pair up (`TensorMaps.persistent`, `.cluster`). A gathered A, a batch, and TF32 keep the cp.async copies.
Such a tile's output, where it is a 16-bit matrix of the product's rows and columns (contiguous along j, not gated, rows
and offset in whole 16 bytes: `StoreMap`, `TensorMaps.store`), is stored by TMA: each (paired) store goes instead into
a staging tile in shared memory (a DEFINE_LOCAL ("tma_store", part, elements) per part of TMA_STORE_PARTS, its source
the output's buffer; `_staged` lays it out as the output map's 128-byte swizzled boxes), and renderers/cuda_tma.py
stores each part by `cp.async.bulk.tensor` once its warpgroup has written it.

Strict float32 (`TileSpec.fma`, FMA_TILES, renderers/cuda_mma.py `g_fma_tile`): only a gathered A of two or more row
loops or k loops (a convolution's windows; a float32 matrix product keeps the GPU's float32 tile plan,
rules/opt/gpu_tile.py). BM*BN/64 lanes each hold 8x8 outputs (`accumulator_at`); the tiles are staged as above by
4-byte cp.async, stored along k and read 4 floats at a time. A strict float32 convolution the FMA tiles do not divide
goes on to stage `implicit_product` (rules/opt/implicit.py).

A kernel that does not match, or any kernel on a GPU older than sm_80 (Ampere: cp.async, mma.sync m16n8k16 for bf16
and m16n8k8 for TF32 start there), is left alone (the GPU's other plans take it); so is one whose tiles all need more
shared memory than a block of the GPU may have (`max_shared`: 99 KiB on sm_86, sm_89 and sm_120; a smaller tile is
taken where one fits). GRAFT_TC=0 turns the stage off; GRAFT_TC_TILE="BM,BN,WM,WN,BK,STAGES" imposes one tile
(bench/tensor_cores.py measures tiles with it; one the GPU cannot hold is refused with a ValueError). These two,
GRAFT_WGMMA and GRAFT_TF32 are read as a kernel is lowered, and their text (`switches()`) is part of the compiled
kernel's and the warm-call program's keys (runtime/realize.py): changing one takes effect on the next call.
"""
from __future__ import annotations
import math, os
from dataclasses import dataclass, replace
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, substitute
from rewrite.env import env_flag
from rules.symbolic import terms_of
from .plan import Opt, OptKind, Plan, kernel_axes
from .pack import split_flat

HALVES = (dtypes.float16, dtypes.bfloat16)
# (BM, BN, WM, WN, BK, STAGES) from the largest: a block's tile, its warps, the slice of k staged at once and the slices
# in flight (3 x (128 + 128) x 32 halves: 48 KiB of shared memory); the first that divides the product and gives every
# multiprocessor a block is taken (else the smallest that divides). 4 warps of 64x64 outputs each: 8 ldmatrix feed 32
# mma per 16 of k (H100, fp16 8192^3: 388 TFLOP/s; 8 warps of 64x32 gave 327, tiles of 8 warps of 64x64 with 4 slices
# 314-318, 4 slices of 128x128 371: docs/design.md "Tensor cores and TF32")
TILES = ((128, 128, 2, 2, 32, 3), (64, 128, 2, 2, 32, 3), (64, 64, 2, 2, 32, 3))
# float32 (TF32) tiles: the same warps, slices of 32 floats (3 x (128 + 128) x 32 floats: 96 KiB of shared memory)
TF32_TILES = TILES
# Hopper (sm_90): warpgroup MMA tiles, BK 64 (one 128-byte swizzled row), a warp per 16 rows (WM = BM/16, WN = 1:
# warpgroup g holds rows 64g.., renderers/cuda_wgmma.py), 4 slices, 2 of them copied ahead of the one in use (128x256:
# 193 KiB of shared memory; 128x128: 129 KiB); taken where one gives every multiprocessor a block, else the mma.sync
# tiles above. H100, fp16 8192^3 / 4096^3 TFLOP/s by CUDA events, one wgmma group left in flight: 128x256 with 4 slices
# 554 / 462, with 3 379 / 326; 128x128 with 4 491 / 400, with 3 (2 blocks a multiprocessor) 438 / 365; 256x128 (4
# warpgroups) with 4 561 / 444 (docs/design.md "Tensor cores and TF32"). For operands read as matrices, and 16-bit
# ones gathered in 16-byte chunks (a channels-last convolution, 128x128 with 3 slices: 0.082 ms at 32x128x56x56 against
# mma.sync's 0.109): other gathered operands (TF32's) take mma.sync.
WGMMA_TILES = ((128, 256, 8, 1, 64, 4), (128, 128, 8, 1, 64, 4))
# float32 (TF32, GRAFT_TF32=1) on wgmma: the same tiles, slices of 32 floats (128 bytes too), B stored along k (TF32's
# wgmma reads only K-major operands). H100, 4096^3: x @ W.T 0.424 ms (cuBLAS TF32 0.343-0.357)
TF32_WGMMA_TILES = tuple((bm, bn, wm, wn, bk // 2, stages) for bm, bn, wm, wn, bk, stages in WGMMA_TILES)
# TF32 with B stored along j (x @ W): the transposed product (`TileSpec.swapped`): B's tile, copied as stored, is the
# wgmma's A, read into registers (a register A may have any layout), and A's tile its K-major B; the block is BN/64
# warpgroups (WM = BN/16 warps of 16 columns each) over all BM rows. Before (B transposed to K-major as copied, 4-byte
# cp.async 0.730 ms, 16-byte loads through registers 0.737, 128x128 tiles 0.848) it was no faster than mma.sync (0.713)
TF32_SWAPPED_TILES = ((256, 128, 8, 1, 32, 4), (128, 128, 8, 1, 32, 4))
WGMMA_GATHERED_STAGES = 3   # a gathered A's slices (each step waits for its own group: renderers/cuda_wgmma.py)
# a 16-bit product on wgmma whose operands are matrices (no batch, no gather) takes them by TMA (renderers/cuda_tma.py):
# a producer warpgroup of TMA_PRODUCER threads beside the tile's, and as many slices in flight as shared memory holds,
# up to TMA_STAGES (128x256: 4; 128x128: 6)
TMA_PRODUCER = 128
# the order blocks run in (`block_order`): groups of 8 rows of tiles, each group's blocks along j in turn
BLOCK_GROUP = (8, "rows")
TMA_STAGES = 6
# a TMA tile of at most this many slices of k is persistent (`TensorMaps.persistent`): a block a multiprocessor loops
# over its tiles, the producer copying the next tile's first slices while the consumers store the last one's; a longer
# one keeps a block per tile, which the hardware hands out as multiprocessors free up (H100: 8192x4096 @ 4096x4096 3%
# faster persistent, 4096^3 the same, 8192^3 6% slower, the static round of tiles finishing unevenly; docs/design.md)
PERSISTENT_SLICES = 64
# persistent TMA tiles run in clusters of TMA_CLUSTER blocks sharing B's tile by multicast (renderers/cuda_tma.py):
# consecutive rows of tiles of the same columns, which the grouped order (`block_order`) gives blocks 2c and 2c + 1 at
# every turn of the loop; each copies its share of B's slice into both, so a block reads 32 KiB of a 128x256 tile's
# slice out of L2 instead of 48. H100, side by side (bench/tma_epilogue.py): 8192x4096 @ 4096x4096 0.439 / 0.444 ms,
# with the GELU 0.450 / 0.456, 4096^3 0.209 / 0.215, 8192^3 persistent 1.635 / 1.697. Not with a block per tile (8192^3
# 1.691 against 1.675: a cluster's blocks start and end together), nor 4 blocks (0.505 ms: the GPU holds 30 clusters of
# 4 such blocks, 120 of its 132 multiprocessors)
TMA_CLUSTER = 2
# a TMA tile's 16-bit output matrix is stored by TMA (`TensorMaps.store`, renderers/cuda_tma.py): the lanes write the
# tile into shared memory (128-byte swizzled boxes of 64 x 64), and one thread of each consumer warpgroup stores its
# boxes with `cp.async.bulk.tensor`, in this many parts of BN/parts columns (each part's staging read by the copy
# engine before the next is written; 0: the lanes store the output themselves)
TMA_STORE_PARTS = 2
FMA_PAD = 4                # floats added to a row of the FMA tile's B (its column-wise copy then hits 32 banks)
CHUNK = 16                  # bytes: cp.async copies 16-byte chunks, so contiguous rows and their strides are aligned to it
MAX_GATHERED_K = 8192      # a gathered operand's k offsets are a table in shared memory (4 bytes each)
# strict float32 with a gathered A (a convolution) on the FMA units: (BM, BN, WM, WN, BK, STAGES), BM*BN/64 lanes of
# 8x8 outputs each (WM x WN: their warps). H100, conv 32x128x56x56 3x3 (bench/conv_variants.py), the product alone:
# 128x128 with BK 8 and 4 slices in flight 0.748 ms; BK 8 and 2 or 3 slices, BK 16 and 3: 0.740-0.765; 64x128 0.751;
# 128x64 0.800; 64x64 0.813 (the implicit product's float32 tiles before: 0.922)
FMA_TILES = ((128, 128, 8, 1, 8, 4), (64, 128, 4, 1, 8, 4), (64, 64, 2, 1, 8, 4))


def capability(arch: str) -> int:
  """The compute capability of a target "sm_XY" (or "sm_XYa") as the number XY."""
  return int(arch.removeprefix("sm_").rstrip("a"))


def max_shared(arch: str) -> int:
  """The shared memory one block may have on `arch` (bytes): 227 KiB from Hopper's sm_90 on (sm_100, sm_110 too), 163
  KiB on sm_80 and sm_87 (A100, Orin), 99 KiB on the others (sm_86, sm_89, sm_120: consumer Ampere, Ada, Blackwell)."""
  cap = capability(arch)
  return (227 if cap // 10 in (9, 10, 11) else 163 if cap in (80, 87) else 99) << 10


def tf32_requested() -> bool:
  """GRAFT_TF32=1: float32 products on the GPU run on tensor cores as TF32 (operands read with 10 bits of mantissa,
  sums in float32), in generated code and in cuBLAS calls alike; unset or 0 (the default), they are strict float32."""
  return env_flag("GRAFT_TF32", False, "TF32 tensor cores for float32 products on the GPU")


SWITCHES = ("GRAFT_TC", "GRAFT_TF32", "GRAFT_WGMMA", "GRAFT_TC_TILE")


def switches() -> tuple[str | None, ...]:
  """The text of each variable this stage reads (SWITCHES): a kernel lowered under other values may compile to another
  kernel, so the runtime keys its caches by them (as read, on every warm call; checked as a kernel is lowered)."""
  return tuple(map(os.environ.get, SWITCHES))


def tc_enabled() -> bool: return env_flag("GRAFT_TC", True, "tensor cores for 16-bit products")
def wgmma_enabled() -> bool: return env_flag("GRAFT_WGMMA", True, "Hopper's warpgroup MMA for 16-bit products")
def tile_text() -> str: return os.environ.get("GRAFT_TC_TILE", "").strip()


def tiles(itemsize: int = 2) -> tuple[tuple[int, ...], ...]:
  """The tiles for operands of `itemsize` bytes, or the one tile GRAFT_TC_TILE="BM,BN,WM,WN,BK,STAGES" names (for
  measuring other tiles; one that needs more shared memory than the GPU has is refused as a kernel is planned)."""
  text = tile_text()
  if not text: return TILES if itemsize == 2 else TF32_TILES
  try: t = tuple(int(v) for v in text.split(","))
  except ValueError: t = ()
  ok = len(t) == 6 and all(v > 0 for v in t)
  if ok:
    bm, bn, wm, wn, bk, stages = t
    threads, per_chunk = wm * wn * 32, CHUNK // itemsize
    ok = (bm % (wm * 16) == 0 and bn % (wn * 16) == 0 and bk % 16 == 0 and stages >= 2 and threads <= 1024
          and (bm * bk // per_chunk) % threads == 0 and (bn * bk // per_chunk) % threads == 0)
  if not ok:
    raise ValueError(f"GRAFT_TC_TILE={text!r}: give six numbers BM,BN,WM,WN,BK,STAGES such as "
                     f"{','.join(map(str, TILES[0]))} (the block's rows and columns, its warps along each, the slice of k "
                     f"and the slices in flight): BM a multiple of 16*WM, BN of 16*WN, BK of 16, STAGES 2 or more, at most "
                     f"32 warps, each slice of A and B a whole number of 16-byte copies per thread; or unset it")
  return (t,)


Dims = tuple[tuple[int, int], ...]   # (size, stride) of each loop a flat index runs through, outermost first


@dataclass(frozen=True)
class Gather:
  """An operand A read through a view that is not a matrix (a convolution's sliding windows): the element at flat row
  r and flat k of the block's product is at A's base + rows(r) + ks(k), each a sum over its loops of (the loop's value
  in the flat index) x (its stride). The row offsets of a lane's rows are computed once, the k offsets once per block
  into a table in shared memory; the tile is then staged element by element."""
  rows: Dims
  ks: Dims
  chunked: bool = False   # k's innermost loop contiguous and every offset a whole number of 16-byte chunks (a
                          # channels-last input): the tile is staged by 16-byte copies, as a matrix's is


@dataclass(frozen=True)
class TensorMaps:
  """A wgmma tile's operands copied by the tensor memory accelerator (renderers/cuda_tma.py; tensor maps made by the
  host, runtime/cuda.py): A's rows (M) and B's columns (N), and each operand's offset from its buffer's start
  (elements; a whole number of 16 bytes, as TMA needs the tensor's address 16-byte aligned)."""
  rows: int
  cols: int
  a_offset: int
  b_offset: int
  cluster: int = 1   # blocks of a cluster (consecutive rows of tiles, the same columns) sharing B's tile by multicast
  persistent: bool = False   # a block a multiprocessor, looping over the tiles (else a block per tile)
  store: StoreMap | None = None   # the output stored by TMA from a staging tile in shared memory (else the lanes store it)


@dataclass(frozen=True)
class StoreMap:
  """A TMA tile's output stored by the tensor memory accelerator (renderers/cuda_tma.py): a 16-bit matrix of the
  product's rows and columns, rows `stride` elements apart from `offset` elements into buffer `buffer` (the kernel's
  DEFINE_GLOBAL slot), both whole 16 bytes. The lanes write the tile into a staging tile in shared memory, in `parts`
  parts of BN/parts columns each (a part's TMA store reads the staging tile before the next part is written there)."""
  buffer: int
  stride: int
  offset: int
  parts: int


@dataclass(frozen=True)
class TileSpec:
  """How one block computes its tile (the MMA node's arg): operand dtype, block tile, warps, k slice and stages, the
  operands' layouts and strides (elements), the length of k, and A's gather (None: A's rows lda apart, each
  contiguous along k)."""
  dtype: str          # "float16", "bfloat16" or "float32" (TF32)
  bm: int
  bn: int
  wm: int
  wn: int
  bk: int
  stages: int
  b_along_k: bool     # B's elements of one column are contiguous along k (a transposed weight, x @ W.T), else along j
  k: int
  lda: int
  ldb: int
  wgmma: bool = False  # Hopper's warpgroup MMA (sm_90a; renderers/cuda_wgmma.py), else mma.sync (renderers/cuda_mma.py)
  gather: Gather | None = None
  fma: bool = False    # strict float32 on the FMA units (a lane's 8x8 outputs; renderers/cuda_mma.py g_fma_tile)
  tma: TensorMaps | None = None   # wgmma fed by TMA and a producer warpgroup (renderers/cuda_tma.py), else cp.async
  @property
  def swapped(self) -> bool:   # TF32 with B along j on wgmma: the tile's transpose is computed (rows j, columns i)
    return self.wgmma and self.dtype == "float32" and not self.b_along_k
  @property
  def threads(self) -> int:
    return self.bm * self.bn // 64 if self.fma else self.wm * self.wn * 32 + (TMA_PRODUCER if self.tma else 0)
  @property
  def mt(self) -> int: return (self.bn if self.swapped else self.bm) // self.wm // 16    # m16 fragments of a warp's tile
  @property
  def nt(self) -> int: return (self.bm if self.swapped else self.bn) // self.wn // 8     # n8 fragments of a warp's tile
  @property
  def regs(self) -> int: return 64 if self.fma else self.mt * self.nt * 4     # float accumulators of a lane
  @property
  def itemsize(self) -> int: return getattr(dtypes, self.dtype).itemsize
  @property
  def shared_bytes(self) -> int:   # wgmma's tiles start on a 1024-byte boundary: 1 KiB more to find it
    if self.fma: return (self.bm + self.bn + FMA_PAD) * self.bk * 4 * self.stages + 4 * self.k
    return (self.bm + self.bn) * self.bk * self.itemsize * self.stages + (1024 if self.wgmma else 0) + (4 * self.k if self.gather else 0) \
      + (16 * self.stages if self.tma else 0) + self.staging_bytes   # (TMA: two 8-byte mbarriers a slice)
  @property
  def staging_bytes(self) -> int:   # (a TMA store's staging tile: a part of the block's output tile)
    return self.bm * self.bn * 2 // self.tma.store.parts if self.tma and self.tma.store else 0


@dataclass
class Product:
  """A matched kernel: its store, reduction, operand loads and loops (A's rows: one loop, or several with a gather)."""
  store: UOp
  red: UOp
  a: UOp
  b: UOp
  rows: list[UOp]
  j: UOp
  ks: list[UOp]
  batch: list[UOp]
  spec: TileSpec


@dataclass
class TensorCoreContext:
  multiprocessors: int = 132
  arch: str = "sm_90"     # the GPU's target (runtime/cuda.py asks the driver; sm_90: an H100, whose wgmma the tiles use)
  product: Product | None = None


def _affine(idx: UOp) -> dict[UOp | None, int] | None:
  """idx as {loop: coefficient, None: constant}, or None where it is not a sum of loops times constants."""
  out: dict[UOp | None, int] = {}
  for t, c in terms_of(idx):
    if t is not None and t.op is not Ops.RANGE: return None
    out[t] = out.get(t, 0) + c
  return out


def _operand(x: UOp) -> UOp | None:
  """The 16-bit float load under a CAST to float32, or a float32 load (TF32 with GRAFT_TF32=1, else strict float32 on
  the FMA units, a gathered A only), or None."""
  ld = x.src[0] if x.op is Ops.CAST and x.dtype is dtypes.float32 and x.src[0].dtype in HALVES else x
  if ld.op is not Ops.LOAD or len(ld.src) != 1 or ld.src[0].src[0].op is not Ops.DEFINE_GLOBAL: return None
  if ld.dtype in HALVES: return ld if ld is not x else None
  return ld if ld.dtype is dtypes.float32 else None


def collapse(dims: Dims) -> Dims:
  """The same flat index through fewer loops: size-1 loops dropped, and a loop merged into the one inside it where
  it steps over all of it (strides (9, 3, 1) of sizes (c, 3, 3) are one loop of 9c, stride 1)."""
  out: list[tuple[int, int]] = []
  for size, stride in dims:
    if size == 1: continue
    if out and out[-1][1] == size * stride: out[-1] = (out[-1][0] * size, stride)
    else: out.append((size, stride))
  return tuple(out)


def match_product(sink: UOp, multiprocessors: int, arch: str = "sm_90") -> Product | None:
  if len(sink.src) != 1 or (st := sink.src[0]).op is not Ops.STORE or len(st.src) != 2: return None
  reds = [n for n in st.src[1].toposort if n.op is Ops.REDUCE]
  if len(reds) != 1 or (red := reds[0]).arg is not Ops.ADD or red.dtype is not dtypes.float32 or len(red.src) < 2: return None
  mul = red.src[0]
  if mul.op is not Ops.MUL or None in (ops := [_operand(s) for s in mul.src]) or ops[0].dtype is not ops[1].dtype: return None
  axes = kernel_axes(sink)
  if any(r.arg[0] != "out" and r not in red.src[1:] for r in axes): return None
  fa, fb = (_affine(ld.src[0].src[1]) for ld in ops)
  if fa is None or fb is None: return None
  # either operand may be A (its rows: the loops in its index only); a matrix A is taken before a gathered one
  found = [p for p in (_roles(st, red, ops[0], ops[1], fa, fb, axes, multiprocessors, arch),
                       _roles(st, red, ops[1], ops[0], fb, fa, axes, multiprocessors, arch)) if p is not None]
  return min(found, key=lambda p: p.spec.gather is not None, default=None)


def _roles(st: UOp, red: UOp, a: UOp, b: UOp, ia: dict, ib: dict, axes: list[UOp], multiprocessors: int, arch: str) -> Product | None:
  """The product with a as A and b as B, where their layouts and sizes fit a tile; else None."""
  size = lambda r: r.src[0].arg
  ks, outs = list(red.src[1:]), [r for r in axes if r.arg[0] == "out"]
  itemsize, align = a.dtype.itemsize, CHUNK // a.dtype.itemsize
  js = [r for r in outs if r in ib and r not in ia]
  rows = [r for r in outs if r in ia and r not in ib]
  if len(js) != 1 or not rows: return None
  j = js[0]
  # B: its k loops one flat loop, B contiguous along it (b_along_k) or along j
  bk_dims = collapse(tuple((size(k), ib.get(k, 0)) for k in ks))
  if len(bk_dims) != 1: return None
  b_along_k = bk_dims[0][1] == 1
  if not b_along_k and ib[j] != 1: return None
  ldb = ib[j] if b_along_k else bk_dims[0][1]
  # A: a matrix (rows: its innermost row loop, the others a batch; k one loop of stride 1), or gathered
  ak_dims, gather, lda = collapse(tuple((size(k), ia.get(k, 0)) for k in ks)), None, ia[rows[-1]]
  fma = itemsize == 4 and not tf32_requested()   # strict float32: the FMA units, for a gathered A only
  if len(ak_dims) == 1 and ak_dims[0][1] == 1 and lda % align == 0 and ia.get(None, 0) % align == 0: rows = rows[-1:]
  else:
    row_dims, k_dims = tuple((size(r), ia[r]) for r in rows), tuple((size(k), ia.get(k, 0)) for k in ks)
    # in 16-byte chunks where k's innermost loop (collapsed) is contiguous and every offset a whole number of chunks
    chunked = not fma and ak_dims[-1][1] == 1 and ak_dims[-1][0] % align == 0 and \
      all(c % align == 0 for c in (ia.get(None, 0), *(c for _, c in row_dims + ak_dims[:-1])))
    gather, lda = Gather(row_dims, k_dims, chunked), 0
    if math.prod(size(k) for k in ks) > MAX_GATHERED_K or sum((s - 1) * abs(c) for s, c in gather.ks) >= 2 ** 31: return None
  if fma and (gather is None or len(rows) < 2 and len(ak_dims) < 2): return None   # a convolution's windows only
  batch = [r for r in outs if r is not j and r not in rows]
  strides = [ldb, ib.get(None, 0)] + [c for r, c in ib.items() if r in batch]
  if gather is None: strides += [c for r, c in ia.items() if r in batch]
  if any(s % align for s in strides): return None
  m = math.prod(size(r) for r in rows)
  blocks = lambda t: math.prod(size(r) for r in batch) * (m // t[0]) * (size(j) // t[1])
  divides = lambda t: m % t[0] == 0 and size(j) % t[1] == 0 and bk_dims[0][0] % t[4] == 0
  def spec(t, wgmma):   # (a gathered A on wgmma: its steps wait for their own group, in WGMMA_GATHERED_STAGES slices)
    stages = WGMMA_GATHERED_STAGES if wgmma and gather is not None else t[5]
    return TileSpec(a.dtype.name, *t[:5], stages, b_along_k, bk_dims[0][0], lda, ldb, wgmma, gather, fma)
  # (a tile within the GPU's shared memory: sm_86, sm_89 and sm_120 allow a block 99 KiB)
  wgmma_tiles = WGMMA_TILES if itemsize == 2 else TF32_WGMMA_TILES if b_along_k else TF32_SWAPPED_TILES
  wgmma = [spec(t, True) for t in wgmma_tiles if divides(t) and blocks(t) >= multiprocessors
           and spec(t, True).shared_bytes <= max_shared(arch)] \
    if arch == "sm_90" and (gather is None or gather.chunked) and (itemsize == 2 or gather is None) \
    and not tile_text() and wgmma_enabled() else []
  fits = [spec(t, False) for t in (FMA_TILES if fma else tiles(itemsize)) if divides(t)]
  if tile_text() and fits and fits[0].shared_bytes > max_shared(arch):
    raise ValueError(f"GRAFT_TC_TILE={tile_text()!r}: its tiles need {fits[0].shared_bytes} bytes of shared memory, more than a "
                     f"block of {arch} may have ({max_shared(arch)}); take fewer STAGES, a smaller BK or tile, or unset it")
  fits = [t for t in fits if t.shared_bytes <= max_shared(arch)]
  if not wgmma and not fits: return None
  chosen = wgmma[0] if wgmma else next((t for t in fits if blocks((t.bm, t.bn)) >= multiprocessors), fits[-1])
  if chosen.wgmma and gather is None and itemsize == 2 and not batch:
    persistent = chosen.k // chosen.bk <= PERSISTENT_SLICES
    # (blocks 2c and 2c + 1 take consecutive rows of tiles of the same columns where the rows of tiles are even:
    # block_order's groups of rows; each block's share of B whole boxes of 64 columns)
    pairs = (m // chosen.bm) % TMA_CLUSTER == 0 and BLOCK_GROUP[1] == "rows" and chosen.bn // TMA_CLUSTER % 64 == 0
    maps = TensorMaps(m, size(j), ia.get(None, 0), ib.get(None, 0), TMA_CLUSTER if persistent and pairs else 1, persistent,
                      _store_map(st, rows[0], j, m, size(j), chosen))
    chosen = _on_tma(chosen, maps, max_shared(arch))
  return Product(st, red, a, b, rows, j, ks, batch, chosen)


def _store_map(st: UOp, row: UOp, j: UOp, m: int, n: int, spec: TileSpec) -> StoreMap | None:
  """The TMA store of a tile's output (TMA_STORE_PARTS parts; 0: none), where the output is a 16-bit matrix of the
  product's rows (loop `row`) and columns (j, contiguous), not gated, rows and offset in whole 16 bytes."""
  out = st.src[1].dtype
  if not TMA_STORE_PARTS or out not in HALVES or len(st.src) != 2 or spec.bm % 64 or spec.bn % (64 * TMA_STORE_PARTS): return None
  idx, align = _affine(st.src[0].src[1]), CHUNK // out.itemsize
  if idx is None or idx.get(j) != 1 or set(idx) - {row, j, None}: return None
  stride, offset = idx.get(row, 0), idx.get(None, 0)
  if stride < n or stride % align or offset % align: return None
  return StoreMap(st.src[0].src[0].arg, stride, offset, TMA_STORE_PARTS)


def _on_tma(spec: TileSpec, maps: TensorMaps, shared: int) -> TileSpec:
  """The wgmma tile fed by TMA, with the most slices in flight (up to TMA_STAGES) that its shared memory holds."""
  fits = [t for t in (replace(spec, tma=maps, stages=n) for n in range(TMA_STAGES, 1, -1)) if t.shared_bytes <= shared]
  return fits[0] if fits else spec




def choose_tensor_core(ctx: TensorCoreContext, sink: UOp) -> None:
  """The policy (Stage.prepare): whether this kernel's product runs on tensor cores, and its tile."""
  ctx.product = None
  if sink.arg == "linear" or isinstance(sink.arg, Plan) or not tc_enabled() or capability(ctx.arch) < 80: return
  if any(n.op in (Ops.SPECIAL, Ops.BARRIER, Ops.MMA) for n in sink.toposort): return
  ctx.product = match_product(sink, ctx.multiprocessors, ctx.arch)


def _split(flat: UOp, loops: list[UOp]) -> dict[UOp, UOp]:
  """The values loops (outermost first) take when `flat` runs through them in row-major order."""
  return dict(zip(loops, split_flat(flat, [r.src[0].arg for r in loops])))


def accumulator_at(s: TileSpec, lidx: UOp, e: int) -> tuple[UOp, UOp]:
  """The row and column in the block's tile of accumulator e of lane lidx. mma (m16n8k16's fragment layout, per
  warp): e = (mt * NT + nt) * 4 + c at row mt*16 + lane//4 + 8*(c//2), column nt*8 + 2*(lane%4) + c%2 of the warp's
  tile. FMA: lane (x, y) = (lidx % (BM/8), lidx // (BM/8)) holds rows 4x.. and BM/2 + 4x.., columns 4y.. and BN/2 +
  4y.., e = 8 * (its row of these 8) + its column (consecutive lanes: consecutive rows, whose outputs lie side by
  side in a convolution's output)."""
  if s.fma:
    x, y, i, j = lidx % (s.bm // 8), lidx // (s.bm // 8), e // 8, e % 8
    return x * 4 + ((i // 4) * (s.bm // 2) + i % 4), y * 4 + ((j // 4) * (s.bn // 2) + j % 4)
  warp, lane = lidx // 32, lidx % 32
  mt, nt, c = e // (s.nt * 4), e // 4 % s.nt, e % 4
  m, n = (s.bn, s.bm) if s.swapped else (s.bm, s.bn)   # a swapped tile's accumulators are its transpose's
  row = (warp // s.wn) * (m // s.wm) + lane // 4 + (mt * 16 + (c // 2) * 8)
  col = (warp % s.wn) * (n // s.wn) + (lane % 4) * 2 + (nt * 8 + c % 2)
  return (col, row) if s.swapped else (row, col)


def block_order(where: UOp, bms: int, bns: int) -> tuple[UOp, UOp]:
  """The tile (row, column) of block `where` of a bms x bns grid of tiles: groups of BLOCK_GROUP[0] (or the largest
  power of two below it that divides) tiles along BLOCK_GROUP[1] ("rows" or "cols"), the group's blocks taking the
  other dimension in turn, so that the blocks running at once share their tiles of A and B in L2."""
  size, along = BLOCK_GROUP
  n_along, n_across = (bms, bns) if along == "rows" else (bns, bms)
  group = next(g for g in (size, 8, 4, 2, 1) if g <= size and n_along % g == 0)
  first = (where // (group * n_across)) * group + where % group if group > 1 else where // n_across
  second = (where % (group * n_across)) // group if group > 1 else where % n_across
  return (first, second) if along == "rows" else (second, first)


def to_tensor_cores(ctx: TensorCoreContext, sink: UOp) -> UOp | None:
  if (p := ctx.product) is None or sink.arg == "linear" or isinstance(sink.arg, Plan): return None
  from rules.gpu import special   # (the GPU rules import rules.opt)
  s, size = p.spec, lambda r: r.src[0].arg
  bms, bns = math.prod(size(r) for r in p.rows) // s.bm, size(p.j) // s.bn
  per_batch = bms * bns
  gidx, lidx = special("gidx0", per_batch * math.prod(size(r) for r in p.batch)), special("lidx0", s.threads)
  where = gidx % per_batch if p.batch else gidx
  at = _split(gidx // per_batch, p.batch) if p.batch else {}
  pid_m, pid_n = block_order(where, bms, bns)
  zero = UOp.const(dtypes.index, 0)
  base = lambda ld, moves: UOp(Ops.INDEX, ld.src[0].dtype, (ld.src[0].src[0], substitute(ld.src[0].src[1], {**at, **{k: zero for k in p.ks}, **moves})))
  row0 = pid_m * s.bm
  # a gathered A: its base at row 0 and the block's first row apart (the template adds each row's offset)
  a_src = (base(p.a, {r: zero for r in p.rows}), row0) if s.gather else (base(p.a, {p.rows[0]: row0}),)
  if s.tma: a_src += (row0, pid_n * s.bn)   # (TMA: the tile's coordinates in the tensor maps, renderers/cuda_tma.py)
  mma = UOp(Ops.MMA, dtypes.float32.vec(s.regs), (a_src[0], base(p.b, {p.j: pid_n * s.bn}), *a_src[1:]), s)
  stores = []
  # (TMA: the producer warpgroup's threads, after the tile's, end in the tile's call; in the graph they hold the
  # accumulators of thread lidx % consumers, whose stores they would repeat)
  lane = lidx % (s.threads - TMA_PRODUCER) if s.tma else lidx
  store = _approximate_reciprocals(p.store) if p.store.src[1].dtype in HALVES else p.store
  for e in range(s.regs):
    acc = UOp(Ops.GEP, dtypes.float32, (mma, UOp.const(dtypes.index, e)))
    row, col = accumulator_at(s, lane, e)
    moves = {**at, **_split(row0 + row, p.rows), p.j: pid_n * s.bn + col}
    stores.append(substitute(store, {p.red: acc, **moves}))
  if _pairs_columns(p, s): stores = [_paired(lo, hi) for lo, hi in zip(stores[::2], stores[1::2])]
  if s.tma and s.tma.store: stores = _staged(s, lane, stores, p.store.src[0].src[0])
  axis = {r: n for n, r in enumerate(kernel_axes(sink))}
  plan = Plan((*(Opt(OptKind.TENSOR_CORE, axis[r], s.bm) for r in p.rows), Opt(OptKind.TENSOR_CORE, axis[p.j], s.bn),
               *(Opt(OptKind.TENSOR_CORE, axis[k], s.bk) for k in p.ks)), "tensor_core")
  return UOp(Ops.SINK, sink.dtype, tuple(stores), plan)


def _staged(s: TileSpec, lane: UOp, stores: list[UOp], out: UOp) -> list[UOp]:
  """The (paired) stores of a tile whose output TMA stores (`TensorMaps.store`), each into the staging tile in shared
  memory instead: part p (columns p*BN/parts..) a DEFINE_LOCAL of its own (arg ("tma_store", p, elements); its source
  the output's buffer, which the TMA store writes), all parts at the same place (renderers/cuda_tma.py stores each
  part before the next is written). Warpgroup g's rows 64g.. of a part are its boxes of 64 x 64 (8 KiB each) in turn,
  laid out as the 128-byte swizzle the output's map asks for: element (r, c) of a box at r*64 + ((c/8) ^ (r%8))*8 +
  c%8 (in wgmma's layout r%8 is lane/4 and c/8 one per accumulator, so a warp's 4-byte writes hit 32 banks)."""
  width = s.bn // s.tma.store.parts
  size = s.bm * width
  locals_ = [UOp(Ops.DEFINE_LOCAL, out.dtype.base.ptr("shared"), (out,), ("tma_store", part, size)) for part in range(s.tma.store.parts)]
  staged = []
  for n, st in enumerate(stores):
    row, col = accumulator_at(s, lane, n * (s.regs // len(stores)))   # (a pair's first accumulator)
    part = col.vmin // width
    assert col.vmax // width == part, "a store's columns in one part"
    c = col % 64
    at = (row // 64) * (64 * width) + ((col % width) // 64) * 4096 + (row % 64) * 64 + (((c // 8) ^ (row % 8)) * 8) + c % 8
    staged.append(st.replace(src=(UOp(Ops.INDEX, locals_[part].dtype, (locals_[part], at)), st.src[1])))
  return staged


def _approximate_reciprocals(store: UOp) -> UOp:
  """The store with each float32 reciprocal of its value marked approximate (`RECIP`'s arg "approx": `rcp.approx.f32`,
  within 1 ulp of float32 where the division is rounded to half an ulp, and ~10 instructions and a branch fewer, on
  each of a lane's accumulators): its value is rounded to 16 bits, 2^13 times coarser, before it is stored."""
  recips = {u: u.replace(arg="approx") for u in store.src[1].toposort if u.op is Ops.RECIP and u.dtype is dtypes.float32}
  return substitute(store, recips)


def _pairs_columns(p: Product, s: TileSpec) -> bool:
  """Whether accumulators e and e + 1 (e even: a lane's two neighbouring columns, mma's and wgmma's fragment layout)
  store as one 4-byte pair: 16-bit values, not gated, consecutive along j in the output, and every pair's first
  address 4-byte aligned (every other stride and the offset even; the pair's column is even)."""
  if s.fma or s.swapped or p.store.src[1].dtype not in HALVES or len(p.store.src) != 2: return False
  idx = _affine(p.store.src[0].src[1])
  return idx is not None and idx.get(p.j) == 1 and all(c % 2 == 0 for r, c in idx.items() if r is not p.j)


def _paired(lo: UOp, hi: UOp) -> UOp:
  """Two stores of neighbouring 16-bit elements as one store of both, at the first's address."""
  val = UOp(Ops.VECTORIZE, lo.src[1].dtype.vec(2), (lo.src[1], hi.src[1]))
  return lo.replace(src=(lo.src[0], val))


tensor_core_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), to_tensor_cores)], name="tensor_core")
