"""Packing: an operand's tile is copied into a contiguous local buffer before the loop nest that reads it.

Stage `opt_pack` (rule set `pack_rules`, ctx: `OptContext`), for each record `pack(a)` of the plan, `a` an output
loop. In: a kernel after the loop stage, before the upcast and vector stages. Out: each load of a global buffer that does not depend on loop `a` but
does on loops nested inside it (the B panel of a matrix product, for a = the rows of A) reads a local buffer
instead. The buffer (`DEFINE_LOCAL`, one per load, its unrolled copies included; its source is the loop it lives in, so each iteration of that
loop, and each thread, has its own) holds the load's values for every iteration of those inner loops, in their
order, the vector lanes innermost, so the nest reads it front to back, one vector after another, however the global
operand is strided (a packed panel of W in x @ W.T is W transposed).
It is filled by a loop nest of its own (RANGE kind "pack"), first inside the last loop the load depends on (where
the buffer is declared); the reads take
`BARRIER(buffer, fill store, *fill loops)` as their buffer: a value that exists once the fill is done (the
linearizer closes the fill loops there, as a REDUCE closes its loops). Values are unchanged.

On a GPU (a tile plan, rules/opt/gpu_tile.py) a pack record names a reduction loop instead, and the rule is on the
REDUCE (`stage_operands`): the factors of the product are staged, slice by slice, in the block's shared memory (`stage`).
"""
from __future__ import annotations
import math
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, substitute
from rewrite.verify import evaluate
from rules.linearize import nesting_key
from rules.symbolic import terms_of
from .plan import OptContext, OptKind
from .upcast import at_values, part_kind

MAX_LOCAL_BYTES = 512 << 10   # a packed buffer lives on the stack of its thread (8 MiB: glibc's default for threads)


def pack_load(ctx: OptContext, ld: UOp, buf: UOp, idx: UOp) -> UOp | None:
  if buf.op is not Ops.DEFINE_GLOBAL or len(ld.src) != 1: return None
  if ctx.device_loops: return None   # a GPU stages a reduction's operands in shared memory: stage_operands
  loops = sorted((n for n in idx.toposort if n.op is Ops.RANGE), key=nesting_key)
  for o in ctx.opts_of_kind(OptKind.PACK):
    a = ctx.current_loop(o.axis)
    if a is None or a in ld.toposort: continue
    # the buffer's layout: the order the nest reads it in: the loops in nesting order, then the unrolled copies (a
    # register tile's vectors of one step, side by side), then the vector lanes (rules/opt/vector.py reads them with
    # vector loads). One stream: copies in buffers of their own would sit a power of two apart, in one cache set
    inner = sorted((q for q in loops if nesting_key(q) > nesting_key(a)), key=lambda q: (part_kind(q) == "vector", part_kind(q) == "upcast", nesting_key(q)))
    outer = [q for q in loops if nesting_key(q) < nesting_key(a)]
    size = math.prod(q.src[0].arg for q in inner)
    # a load that varies only along the lanes is one vector: nothing to pack (and the read would sit beside the fill,
    # not inside a loop after it, which the linearizer orders only by its loops)
    if all(part_kind(q) == "vector" for q in inner) or size * ld.dtype.itemsize > MAX_LOCAL_BYTES: continue
    # the fill nests right inside the last loop it depends on, before any other loop there (nesting_key: a tuple
    # that extends another sorts right after it)
    at = nesting_key(outer[-1])[1:] if outer else (-2,)
    fill_loops = [UOp(Ops.RANGE, q.dtype, q.src, ("pack", (*at, m), q.arg)) for m, q in enumerate(inner)]
    local = UOp(Ops.DEFINE_LOCAL, ld.dtype.ptr("local"), tuple(outer[-1:]), (ctx.next_local(), size))
    def slot(qs) -> UOp:
      flat = qs[0]
      for q in qs[1:]: flat = flat * q.src[0].arg + q
      return flat
    fill = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, local.dtype, (local, slot(fill_loops))), at_values(ld, dict(zip(inner, fill_loops)))))
    filled = UOp(Ops.BARRIER, local.dtype, (local, fill, *fill_loops))
    return UOp(Ops.LOAD, ld.dtype, (UOp(Ops.INDEX, local.dtype, (filled, slot(inner))),))
  return None


# ---- a GPU: the pack record of a reduction loop stages its operands' tiles in shared memory

SHARED_PAD = 4   # floats added to a shared tile's row: a transposed fill hits 32 banks, rows stay 16-byte aligned


def flat_index(loops: list[UOp], sizes: list[int]) -> UOp:
  flat = loops[0] if loops else UOp.const(dtypes.index, 0)
  for q, n in zip(loops[1:], sizes[1:]): flat = flat * n + q
  return flat


def stage_operands(ctx: OptContext, red: UOp) -> UOp | None:
  """A GPU tile plan's `pack(k)`, k a reduction loop: the factors of a sum of products over k's outer loop (a slice)
  are staged in the block's shared memory once per slice, each as a whole (an elementwise prologue, layer norm's
  `(x - mean) * rstd * g`, is computed once per element as the tile is filled, not once per use); `stage` says how."""
  if not ctx.device_loops or red.arg is not Ops.ADD: return None
  slices = [q for o in ctx.opts_of_kind(OptKind.PACK) if (q := ctx.current_loop(o.axis)) is not None and q in red.src[1:]]
  if not slices or any(n.op is Ops.DEFINE_LOCAL for n in red.src[0].toposort): return None
  factors = list(red.src[0].src) if red.src[0].op is Ops.MUL else [red.src[0]]
  tiles = {f: t for f in factors if (t := stage(ctx, f, slices[0])) is not None}
  if not tiles: return None
  fills, nexts, carried = prefetched([st for _, sts, _ in tiles.values() for st in sts], slices[0])
  # one wait per slice: every tile's read waits for every fill, so all fills come first and the block syncs once;
  # the next slice's loads are sources of the wait too, so they are issued before it and fly during the arithmetic
  reads = {f: UOp(Ops.LOAD, f.dtype, (UOp(Ops.INDEX, local.dtype, (UOp(Ops.BARRIER, local.dtype, (local, *fills, *nexts)), slot)),))
           for f, (local, _, slot) in tiles.items()}
  value = red.src[0].replace(src=tuple(reads.get(f, f) for f in factors)) if red.src[0].op is Ops.MUL else reads[red.src[0]]
  staged = red.replace(src=(value, *red.src[1:]))
  return UOp(Ops.NOOP, red.dtype, (staged, *carried)) if carried else staged


def prefetched(fills: list[UOp], slice_loop: UOp) -> tuple[tuple[UOp, ...], tuple[UOp, ...], tuple[UOp, ...]]:
  """Double buffering in registers: (the fills, the next slice's values, the carried registers' last values). Each
  fill stores a register (a CARRY) that holds its value for this slice: loaded before the loop for slice 0, and in
  each trip for the next slice (the last trip reloads its own: no address past the operand), so a slice's loads are
  in flight while the block computes the one before it, instead of each trip waiting for its loads first."""
  if slice_loop.src[0].arg < 2: return tuple(fills), (), ()
  last = UOp.const(slice_loop.dtype, slice_loop.src[0].arg - 1)
  following = (slice_loop < last).where(slice_loop + 1, last)
  # a register per loaded value (a vector's elements are stored from one register)
  values = list(dict.fromkeys(st.src[1].src[0] if st.src[1].op is Ops.GEP else st.src[1] for st in fills))
  regs = {v: UOp(Ops.CARRY, v.dtype, (slice_loop, at_values(v, {slice_loop: UOp.const(slice_loop.dtype, 0)})), ("prefetch", None))
          for v in values}
  nexts = tuple(at_values(v, {slice_loop: following}) for v in values)
  ends = tuple(UOp(Ops.REDUCE, v.dtype, (UOp(Ops.NOOP, v.dtype, (nxt, regs[v])), slice_loop), Ops.NOOP) for v, nxt in zip(values, nexts))
  return tuple(substitute(st, regs) for st in fills), nexts, ends


def stage(ctx: OptContext, value: UOp, slice_loop: UOp) -> tuple[UOp, list[UOp], UOp] | None:
  """(the shared tile, its fill stores, the slot the reduction reads) for a factor that moves only with the slice,
  the block's loops and the tile's parts (lanes, registers, the slice's inner loop), else None. The tile
  (`DEFINE_LOCAL` in address space "shared") is laid out with the reduction's parts outermost and the output's parts
  in their order (a row of the tile, padded by SHARED_PAD against bank conflicts); element f of it (in the order of
  the operand's memory, so consecutive lanes read consecutive addresses) is filled by lane f mod threads. The reads
  take `BARRIER(tile, *fill stores)` as their buffer: the block waits there until the tiles are filled (the
  renderer's __syncthreads), and again at the end of the slice before the next fill overwrites them."""
  from rules.gpu import special   # (the GPU rules import this package)
  if slice_loop not in value.toposort or any(n.op in (Ops.REDUCE, Ops.BARRIER) for n in value.toposort): return None
  loops = [q for q in value.toposort if q.op is Ops.RANGE and q is not slice_loop]
  parts = [q for q in loops if part_kind(q) in ("local", "upcast", "split")]
  # what else the value moves with must be the block's (a loop of blocks): uniform over the tile
  if any(part_kind(q) is not None and q not in parts for q in loops): return None
  if any(part_kind(q) is None and ((a := ctx.loop_axis.get(q)) is None or not ctx.opts(a, OptKind.GLOBAL)) for q in loops): return None
  order = lambda q: (q.arg[1][1], q.arg[1][0])   # by the loop it came from, outer parts first
  red = sorted((q for q in parts if q.arg[0] == "reduce"), key=order)
  out = sorted((q for q in parts if q.arg[0] != "reduce"), key=order)
  row = math.prod(q.src[0].arg for q in out)
  stride = row + (SHARED_PAD if red and row % 32 == 0 else 0)
  size = math.prod(q.src[0].arg for q in red) * stride
  total, threads = math.prod(q.src[0].arg for q in parts), ctx.threads
  if total % threads or size * value.dtype.itemsize > MAX_SHARED_BYTES: return None
  def slot(values: dict[UOp, UOp]) -> UOp:
    return flat_index([values.get(q, q) for q in red], [q.src[0].arg for q in red]) * stride + \
      flat_index([values.get(q, q) for q in out], [q.src[0].arg for q in out])
  # the fill follows the operand's memory (its load over the most parts): the part that moves it least varies fastest
  main = max((n for n in value.toposort if n.op is Ops.LOAD), key=lambda n: sum(q in n.toposort for q in parts), default=None)
  idx = main.src[0].src[1] if main is not None else value
  fill_order = sorted(parts, key=lambda q: -abs(mean_step(idx, q)))
  local = UOp(Ops.DEFINE_LOCAL, value.dtype.ptr("shared"), (), (ctx.next_local(), size))
  fastest, w = fill_order[-1], vector_width(value, idx, fill_order[-1], total, threads)
  sizes = [q.src[0].arg for q in fill_order[:-1]] + [fastest.src[0].arg // w]
  lane, fills = special("lidx0", threads), []
  def fill(at: dict[UOp, UOp], v: UOp) -> UOp: return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, local.dtype, (local, slot(at))), v))
  for c in range(total // (threads * w)):
    f = lane + c * threads if c else lane
    at = dict(zip(fill_order, split_flat(f, sizes)))
    if w == 1:
      fills.append(fill(at, at_values(value, at)))
      continue
    # a vector of w consecutive elements: one load; one store where they sit side by side in the tile too (a row
    # of it: 16 bytes at once, no bank conflicts), else w stores (a tile stored along the other axis)
    first = {**at, fastest: at[fastest] * w}
    vec = at_values(value, first).replace(dtype=value.dtype.vec(w))
    if out and fastest is out[-1] and all(k % w == 0 for _, k in terms_of(slot(first))): fills.append(fill(first, vec))
    else: fills += [fill({**first, fastest: first[fastest] + e}, UOp(Ops.GEP, value.dtype, (vec, UOp.const(dtypes.index, e)))) for e in range(w)]
  return local, fills, slot({})


VECTOR_BYTES = 16   # a lane's fill reads this much at once where it can: ld.global.v4, a quarter of the loads


def vector_width(value: UOp, idx: UOp, fastest: UOp, total: int, threads: int) -> int:
  """How many consecutive elements a lane's fill reads as one vector: VECTOR_BYTES' worth where the value is a plain
  load of float32 elements (the prelude's floatx4; a prologue's arithmetic stays scalar), consecutive along the fill's
  fastest part, and each vector's first element sits at a multiple of VECTOR_BYTES: the index's other terms and its
  constant are multiples of the width (a buffer is at least 256-byte aligned, cuMemAlloc; a view's offset is in the
  index); else 1."""
  w = VECTOR_BYTES // value.dtype.itemsize
  if value.op is not Ops.LOAD or len(value.src) != 1 or value.dtype is not dtypes.float32: return 1   # (floatx4 only)
  if fastest.src[0].arg % w or total % (threads * w): return 1
  terms = terms_of(idx)
  if (fastest, 1) not in terms: return 1
  return w if all(t is fastest or (k % w == 0 and (t is None or fastest not in t.toposort)) for t, k in terms) else 1


MAX_SHARED_BYTES = 24 << 10   # a block's shared tiles together stay under 48 KiB (the static limit)


def coefficient(index: UOp, r: UOp) -> int:
  """How far a flat index moves when loop r steps by one (0 if it does not depend on r linearly)."""
  return sum(k for t, k in terms_of(index) if t is r)


def mean_step(index: UOp, r: UOp) -> float:
  """How far a flat index moves, on average, when loop r steps over its range, the other loops at 0: its coefficient
  where the index is affine in r, and for an index gathered through r // n and r % n (a convolution's flat rows and
  flat reduction, rules/opt/implicit.py) the step that says which loop walks memory most closely."""
  if (c := coefficient(index, r)) or r not in index.toposort or (n := r.src[0].arg) < 2: return c
  zero = {u: UOp.const(u.dtype, 0) for u in index.toposort if u.op in (Ops.RANGE, Ops.SPECIAL)}
  at = lambda v: evaluate(substitute(index, {**zero, r: UOp.const(r.dtype, v)}), {})
  return (at(n - 1) - at(0)) / (n - 1)


def split_flat(flat: UOp, sizes: list[int]) -> list[UOp]:
  """The indices of loops of `sizes` (outermost first) that run through `flat` in row-major order."""
  out, stride = [], math.prod(sizes)
  for i, s in enumerate(sizes):
    stride //= s
    e = flat if stride == 1 else flat // stride
    out.append(e if i == 0 else e % s)
  return out


pack_rules = PatternMatcher([
  (UPat(Ops.REDUCE, name="red"), stage_operands),
  (UPat(Ops.LOAD, name="ld", src=(UPat(Ops.INDEX, src=(UPat.var("buf"), UPat.var("idx"))),)), pack_load),
], name="opt_pack")
