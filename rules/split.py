"""Split reductions: a GPU's second way to run a reduction of few, long rows, and on the CPU a product's way to keep
its packed panels in cache (`cache_split_plan`); rules/host.py offers both forms, the runtime times them on first use
(runtime/pick.py).

One block of lanes per row (rules/gpu.py) leaves most of a GPU idle when the rows are few: `x.sum()` of 4096x4096 is one
block on one of 132 multiprocessors; a column sum `x.sum(0)` is a thread per output, 4096 threads. The record
`split_reduce(axis, parts)` (a `SplitReduce`, chosen by `split_reduction_plan`; the host stage's record, not a kernel plan's) says: read the reduction's source
with `axis` split into (parts, length / parts), reduce everything but `parts` into a scratch buffer of partials (many
rows: the grid planner gives them blocks or threads across the whole GPU), then reduce the partials over `parts`.

`split_reduction(kernel, split) -> (partials, combine, scratches)`: in, a tensor-level KERNEL whose reductions
`splittable_reductions` accepts; out, two tensor-level KERNELs over the same buffers plus new scratch BUFFERs, which
compute the same values up to float rounding (the sums are associated differently); they go through the kernel stages
like any other kernel.
"""
from __future__ import annotations
import math
from dataclasses import dataclass
from rewrite import UOp, Ops, substitute
from .strided_view import View
from .realize import NewBuffer
from .shapes import shape_of
from .gpu import (InvalidGridPlan, MAX_THREADS, MULTIPROCESSORS, RESIDENT_THREADS, LOOP_THREADS,
                  walks_rows, _buffer_views)

@dataclass(frozen=True)
class SplitReduce:
  """Run a kernel's reductions as `parts` partials along reduced axis `axis`, then their combine: two kernels, so a
  record of the host stage (rules/host.py offers it beside the kernel), not of one kernel's plan (rules/opt)."""
  axis: int
  parts: int
  def __repr__(self): return f"split_reduce({self.axis}, {self.parts})"


SPLIT_MIN_LENGTH = 4096      # a reduction shorter than this is never split: one block takes it in a few steps
SPLIT_MIN_ROW_CHUNK = 2048   # a partial of a row reduction keeps at least this many elements (a block of lanes, several each)
SPLIT_MIN_COLUMN_CHUNK = 32  # a partial of a column reduction (a thread each) keeps at least this many


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def splittable_reductions(kernel: UOp) -> list[UOp] | None:
  """The reductions of a kernel (several where kernels of one shape were grouped) when they all reduce sources of one
  shape over the same axes by ADD or MAX, and each source reads buffers through views and holds no other reduction;
  None for any other kernel."""
  if kernel.op is not Ops.KERNEL: return None
  reds = list(dict.fromkeys(n for st in kernel.src for n in st.src[1].toposort if n.op is Ops.REDUCE_AXIS))
  if not reds or len({(shape_of(r.src[0]), r.arg[1]) for r in reds}) != 1: return None
  if any(r.arg[0] not in (Ops.ADD, Ops.MAX) or _buffer_views(r.src[0]) is None or
         any(n.op is Ops.REDUCE_AXIS for n in r.src[0].toposort) for r in reds): return None
  return reds


def product_shape(reds: list[UOp]) -> tuple[int, ...] | None:
  """(*batch, m, n, k) of a matrix product: one sum over the last axis of a product of two factors, one of which reads
  nothing along n (the one before last), the other nothing along m (the one before that); else None."""
  if len(reds) != 1 or reds[0].arg[0] is not Ops.ADD or reds[0].src[0].op is not Ops.MUL: return None
  shape = shape_of(reds[0].src[0])
  if len(shape) < 3 or reds[0].arg[1] != (len(shape) - 1,): return None
  views = [_buffer_views(f) for f in reds[0].src[0].src]
  if any(v is None or not v for v in views): return None
  flat = lambda vs, d: all(v.strides[d] == 0 for v in vs)
  return shape if (flat(views[0], -2) and flat(views[1], -3)) or (flat(views[1], -2) and flat(views[0], -3)) else None


def product_split_plan(reds: list[UOp], multiprocessors: int) -> SplitReduce | None:
  """A matrix product whose blocks of 8x8 registers (rules/opt/gpu_tile.py) leave multiprocessors idle: its reduction
  split into the fewest parts that give FILL_BLOCKS blocks per multiprocessor (the most there are, where none does);
  None for another kernel, a product that fills the GPU as it is, or one whose k cannot be split."""
  from .opt.gpu_tile import product_tile, tiles_of, split_parts, fills, FILL_BLOCKS, TILES
  if (shape := product_shape(reds)) is None: return None
  *batch, m, n, k = shape
  if product_tile(m, n, math.prod(batch), multiprocessors) == TILES[0]: return None
  if (tile := next((t for t in tiles_of(m, n) if t[2] * t[3] == 64 and t != TILES[0]), None)) is None: return None
  blocks, parts = math.prod(batch) * (m // tile[0]) * (n // tile[1]), split_parts(k)
  if not parts or fills(blocks, multiprocessors): return None
  return SplitReduce(len(shape) - 1, next((p for p in parts if blocks * p >= FILL_BLOCKS * multiprocessors), parts[-1]))


def cache_split_plan(kernel: UOp) -> SplitReduce | None:
  """On the CPU: a matrix product whose packed panel of B (its k by one vector of columns, rules/opt/heuristic.py
  PANEL_BYTES) would not stay in cache, its k split into the fewest parts whose panels do (the GPT's MLP-out
  product, 128x768 over k = 3072, streamed B from memory once per tile of rows at 28-48 GFLOP/s); each part is then a
  product of the batch of partials, packed; None for another kernel."""
  from .opt.heuristic import PANEL_BYTES, vector_width
  if (reds := splittable_reductions(kernel)) is None or (shape := product_shape(reds)) is None: return None
  k, row = shape[-1], vector_width(reds[0].dtype.itemsize) * reds[0].dtype.itemsize
  if k * row <= PANEL_BYTES: return None
  parts = next((p for p in range(2, k + 1) if k % p == 0 and k // p * row <= PANEL_BYTES), None)
  return None if parts is None else SplitReduce(len(shape) - 1, parts)


def split_reduction_plan(kernel: UOp, multiprocessors: int = MULTIPROCESSORS) -> SplitReduce | None:
  """The heuristic for a kernel of reductions of few, long rows, or a product of few tiles (`product_split_plan`):
  `split_reduce(axis, parts)`, or None where the kernel's own grid already fills the GPU. A row reduction (lanes per row) gets at most MAX_THREADS threads a row,
  a column reduction one thread an output: when that, times the outputs, is less than the GPU holds at once
  (multiprocessors x RESIDENT_THREADS), the reduction is split along one reduced axis into `parts` partials, a divisor
  of the axis's length (sizes that do not divide are not split): as many as give two waves of blocks of LOOP_THREADS
  lanes (rows) or one wave of threads (columns), each partial keeping a chunk long enough to be worth its block or
  thread. The outermost axis wins a tie, so a row's partials read contiguous chunks."""
  if (reds := splittable_reductions(kernel)) is None: return None
  if product_shape(reds) is not None: return product_split_plan(reds, multiprocessors)
  shape, axes = shape_of(reds[0].src[0]), reds[0].arg[1]
  length = math.prod(shape[a] for a in axes)
  outputs = math.prod(shape) // length if length else 0
  rows = walks_rows(reds)
  resident = multiprocessors * RESIDENT_THREADS
  if length < SPLIT_MIN_LENGTH or outputs * (MAX_THREADS if rows else 1) >= resident: return None
  most = (2 * resident // LOOP_THREADS if rows else resident) // outputs
  chunk = SPLIT_MIN_ROW_CHUNK if rows else SPLIT_MIN_COLUMN_CHUNK
  best = max(((parts, -a) for a in sorted(axes) for parts in _divisors(shape[a])
              if 2 <= parts <= most and length // parts >= chunk), default=None)
  return None if best is None else SplitReduce(-best[1], best[0])


def split_reduction(kernel: UOp, split: SplitReduce) -> tuple[UOp, UOp, tuple[UOp, ...]]:
  """(partials, combine, scratch buffers) carrying out `split_reduce(axis, parts)` on a kernel `split_reduction_plan`
  chose: each reduction's source is read reshaped with `axis` split into (parts, its length / parts); the first kernel
  reduces every axis the reductions reduced but keeps `parts` (one partial per part) and stores the partials of each
  reduction in a new scratch buffer; the second is the kernel itself with each reduction replaced by the reduction of
  its partials over `parts`. Values are unchanged up to float rounding (the sums are associated differently)."""
  reds = splittable_reductions(kernel)
  (_, axes), shape, a, parts = reds[0].arg, shape_of(reds[0].src[0]), split.axis, split.parts
  if a not in axes or shape[a] % parts: raise InvalidGridPlan(f"{split!r}: axis {a} of {shape} is not a reduced axis that {parts} divides")
  # the source with `a` split into (parts, length / parts), the parts moved outermost: the partials are (parts, the
  # kernel's outputs), so a product's partials kernel is a batch of products (the tiles of rules/opt/gpu_tile.py) and
  # the combine's threads read consecutive partials
  split_shape = shape[:a] + (parts, shape[a] // parts) + shape[a + 1:]
  order = (a, *(d for d in range(len(split_shape)) if d != a))
  inner = tuple(order.index(b + (b >= a)) for b in axes)   # the reduced axes after the move: all but the parts
  partial_shape = tuple(1 if d in inner else split_shape[o] for d, o in enumerate(order))
  kept = tuple(1 if d in axes else s for d, s in enumerate(shape))
  # the combine reads the partials in the kernel's own shape, the parts along `a`
  combine = View.contiguous((parts, *kept)).permute((*range(1, a + 1), 0, *range(a + 1, len(shape) + 1)))
  stores, combined, scratches = [], {}, []
  for red in reds:
    scratch = UOp(Ops.BUFFER, red.dtype, (), NewBuffer(math.prod(partial_shape), kernel.arg, -1 - len(scratches)))
    src = UOp(Ops.VIEW, red.src[0].dtype, (red.src[0],), View.contiguous(split_shape))   # a reshape
    src = UOp(Ops.VIEW, src.dtype, (src,), View.contiguous(split_shape).permute(order))
    stores.append(UOp(Ops.STORE, src=(UOp(Ops.VIEW, red.dtype, (scratch,), View.contiguous(partial_shape)),
                                      UOp(Ops.REDUCE_AXIS, red.dtype, (src,), (red.arg[0], inner)))))
    read = UOp(Ops.VIEW, red.dtype, (scratch,), combine.reshape((*kept[:a], parts, *kept[a + 1:])))
    combined[red] = UOp(Ops.REDUCE_AXIS, red.dtype, (read,), (red.arg[0], (a,)))
    scratches.append(scratch)
  partials = UOp(Ops.KERNEL, src=tuple(stores), arg=kernel.arg)
  return partials, substitute(kernel, combined, name="split_reduce"), tuple(scratches)
