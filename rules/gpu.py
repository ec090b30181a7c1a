"""GPU rules: for a device whose loops are its own threads (CUDA): a grid of blocks of threads.

These stages run only when `run.device_loops` (see rules/pipeline.py); the shared stages are unchanged.

Stage `gpu_fuse` (schedule scope, rule `inline_broadcast_reductions`, ctx: `FuseContext`): a kernel that only
computes a reduction which its readers read broadcast back along the reduced axes (the max and the sum of a row
softmax, the mean and the variance of a layer norm) is inlined into each reader and dropped, unless its buffer is an
output of the realize. The reader then computes the reduction itself, once per row: on a GPU one block owns a row
(stage `gpu` below), so the row is read from memory once and again from cache, instead of once per kernel.
Values are unchanged. Only a reduction that a block runs well (see `block_plan`: it walks memory along the reduced
axis, as a row reduction does, not down columns) is inlined; every reader must read the result only broadcast along
the reduced axes (else it would be recomputed per element); nothing between the two kernels may write what the
reduction reads.

Stage `gpu` (kernel scope, rule `map_to_grid`): in, a lowered kernel `SINK(STORE...)` with output loops
`RANGE("out", ...)` and `REDUCE`s; out, the same values with the output loops replaced by thread indices,
`SPECIAL(arg=("gidx0", blocks))` (the block) and `SPECIAL(arg=("lidx0", threads))` (the thread in its block).
Two mappings:
- one thread per output element (`flat`): element gidx0*threads + lidx0, so consecutive threads write (and, for an
  elementwise kernel, read) consecutive addresses; reductions run as loops in their thread;
- one block per output row (`block`), for a reduction that is long (>= BLOCK_REDUCE_MIN elements) and either walks
  memory along its reduced axis or has too few outputs to fill the GPU: each thread accumulates elements
  lidx0, lidx0+threads, ... (consecutive threads read consecutive addresses), then the block combines its threads'
  values in one `BARRIER(partial, arg=op)` node: every thread of the block waits there and leaves with the combined
  value (the renderer calls a warp-shuffle and shared-memory routine). Output elements of the row that do not
  depend on the reduction (the columns of a softmax) are spread over the threads the same way.
A thread loop of at most UNROLL trips is unrolled: the passes of a fused softmax then load the same elements as the
same UOps, which hash-consing shares, so the row is read from memory once and kept in registers.
Where the sizes do not divide, a thread past the end works on the last valid element (so every load stays in bounds
and every thread reaches the block's BARRIER) and its store is gated off (`STORE(index, value, gate)`); its share of
a reduction is the reduction's identity. Launch sizes are the SPECIALs' sizes: `launch_dims` reads them off the
linear kernel, always within CUDA's limits (MAX_THREADS threads per block, MAX_GRID blocks): a kernel that needs more
blocks loops over them, the launched blocks taking every MAX_GRID-th one in turn (`grid`: a grid-stride loop).

Stage `gpu_index` (kernel scope, `gpu_index_rules`): the shared symbolic rules plus `(x//c)*c + x%c -> x`, which
folds the thread-index arithmetic back into flat indices.
"""
from __future__ import annotations
import math
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes, graph_rewrite
from .view import View, contiguous_strides
from .realize import buffers_read, buffers_written
from .symbolic import symbolic_rules, terms_of, sum_of
from .linearize import open_ranges, nesting_key
from .views import view_rules
from .lower import lower_rules, LowerContext

MAX_THREADS = 1024           # threads per block, every CUDA GPU since compute capability 2.0
MAX_GRID = 2**31 - 1         # blocks along x
FLAT_THREADS = 256           # threads per block of a one-thread-per-element kernel
BLOCK_REDUCE_MIN = 128       # a reduction at least this long is shared by the threads of a block
FEW_OUTPUTS = 2048           # fewer outputs than this cannot keep a GPU busy with one thread each
UNROLL = 16                  # thread loops of at most this many trips are unrolled
LOOP_THREADS = 512           # threads per block when the thread loops stay loops


# ---------------------------------------------------------------- gpu_fuse (schedule scope)

@dataclass
class FuseContext:
  outputs: set = field(default_factory=set)   # BUFFERs the realize returns: their kernels stay
  inlined: list[str] = field(default_factory=list)


def _top_reduce_axes(value: UOp) -> set[int] | None:
  """The reduced axes of the reductions that `value` computes last (reached through elementwise ops only)."""
  axes, stack, seen = set(), [value], set()
  while stack:
    n = stack.pop()
    if n in seen: continue
    seen.add(n)
    if n.op is Ops.REDUCE_AXIS: axes |= set(n.arg[1])
    elif n.op in GroupOp.Elementwise: stack.extend(n.src)
  return axes or None


def _broadcasts_back(v: View, shape: tuple[int, ...], axes: set[int]) -> bool:
  """v reads a row-major `shape` whose `axes` have size 1, repeating it along those axes and nothing else."""
  want = contiguous_strides(shape)
  return (v.mask is None and v.offset == 0 and len(v.shape) == len(shape) and
          all((vs == s and (st == w or s == 1)) if d not in axes else st == 0 or vs == 1
              for d, (vs, st, s, w) in enumerate(zip(v.shape, v.strides, shape, want))))


def _reads_broadcast(reader: UOp, out_view: UOp, axes: set[int]) -> bool:
  """Every path from the reader's stores to `out_view` (the producer's result) goes through elementwise ops,
  reductions over `axes` only, and at most a view that broadcasts it back along `axes`: so the reader asks for the
  result at its own output indices on the other axes, once per row."""
  holds: set[UOp] = set()
  for n in reader.toposort:
    if n is out_view or any(s in holds for s in n.src): holds.add(n)
  shape = out_view.arg.shape
  for n in holds:
    if n is out_view or n.op in (Ops.KERNEL, Ops.STORE) or n.op in GroupOp.Elementwise: continue
    if n.op is Ops.REDUCE_AXIS and set(n.arg[1]) <= axes: continue
    if n.op is Ops.VIEW and n.src[0] is out_view and _broadcasts_back(n.arg, shape, axes): continue
    return False
  # the stores write the reader's own buffers, in order: the output view must not itself be on the path
  return all(st.src[0] not in holds for st in reader.src)


def _lowered(kernel: UOp) -> UOp:
  """The kernel through the shared stages from views to symbolic, to look at its loops and loads."""
  k = graph_rewrite(kernel, view_rules, name="gpu_fuse.views")
  k = graph_rewrite(k, lower_rules, LowerContext(), name="gpu_fuse.lower", top_down=True)
  return graph_rewrite(k, symbolic_rules, name="gpu_fuse.symbolic")


def inline_broadcast_reductions(ctx: FuseContext, schedule: UOp) -> UOp | None:
  kernels = list(schedule.src)
  for pi, p in enumerate(kernels):
    if p.op is not Ops.KERNEL or len(p.src) != 1: continue
    out_view, value = p.src[0].src
    buf = out_view.src[0]
    if buf in ctx.outputs or (axes := _top_reduce_axes(value)) is None: continue
    # only a reduction that a block would run well on its own (along rows in memory, not down columns)
    if block_plan(_lowered(p)) is None: continue
    readers = [i for i in range(pi + 1, len(kernels)) if buf in buffers_read(kernels[i])]
    if not readers or any(kernels[i].op is not Ops.KERNEL or kernels[i].arg != p.arg or
                          not _reads_broadcast(kernels[i], out_view, axes) for i in readers): continue
    # nothing run between the producer and its last reader may write what the producer reads
    if any(buffers_written(k) & buffers_read(p) for k in kernels[pi + 1:readers[-1]]): continue
    inline = PatternMatcher([(UPat(Ops.VIEW, name="v"), lambda v: value if v is out_view else None)])
    for i in readers: kernels[i] = graph_rewrite(kernels[i], inline, name="gpu_fuse.inline")
    ctx.inlined.append(f"kernel {pi} (a reduction over axes {sorted(axes)}) inlined into kernel(s) {readers}: "
                       "they read it broadcast along the reduced axes")
    return schedule.replace(src=tuple(kernels[:pi] + kernels[pi + 1:]))
  return None


fuse_rules = PatternMatcher([(UPat(Ops.SINK, name="schedule"), inline_broadcast_reductions)], name="gpu_fuse")


# ---------------------------------------------------------------- gpu (kernel scope)

def special(name: str, size: int) -> UOp:
  """A thread or block index, or the constant 0 when there is only one."""
  return UOp.const(dtypes.index, 0) if size == 1 else UOp(Ops.SPECIAL, dtypes.index, (), (name, size))


def grid(blocks: int) -> tuple[UOp, UOp | None]:
  """(the index of a block among `blocks`, the guard that it is one, or None where every index is). Within a grid's
  limit that is gidx0 itself; past it, a grid-stride loop: the launched blocks take blocks b, b + g, b + 2g, ..."""
  if blocks <= MAX_GRID: return special("gidx0", blocks), None
  turns = -(-blocks // MAX_GRID)
  g = -(-blocks // turns)
  turn = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, turns),), ("out", -1, "grid stride"))  # outermost
  b = turn * g + special("gidx0", g)
  return b, (b < blocks if turns * g != blocks else None)


def split(flat: UOp, sizes: list[int]) -> list[UOp]:
  """The indices of loops of `sizes` (outermost first) that run through `flat` in row-major order."""
  out, stride = [], math.prod(sizes)
  for i, s in enumerate(sizes):
    stride //= s
    e = flat if stride == 1 else flat // stride
    out.append(e if i == 0 else e % s)
  return out


def substitute(u: UOp, mapping: dict[UOp, UOp], copy: tuple | None = None, top_down: bool = False) -> UOp:
  """u with the RANGEs (or REDUCEs) of `mapping` replaced. With `copy` (a tag unique to this copy of u, when u is
  copied once per unrolled step), a reduction whose value changes gets loops of its own, tagged: two reductions may
  never share a loop (each loop accumulates one), and one unchanged stays shared (computed once for all copies)."""
  if not mapping: return u
  original = set(u.toposort) if copy is not None else ()
  def replace(x: UOp) -> UOp | None:
    if (y := mapping.get(x)) is not None: return y
    if copy is None or x.op is not Ops.REDUCE or x in original or any(r.arg[-1] == copy for r in x.src[1:]): return None
    own = x.src[1:]
    fresh = [r.replace(arg=r.arg + (copy,)) for r in own]
    return UOp(Ops.REDUCE, x.dtype, (substitute(x.src[0], dict(zip(own, fresh)), copy), *fresh), x.arg)
  return graph_rewrite(u, PatternMatcher([(UPat((Ops.RANGE, Ops.REDUCE), name="x"), replace)]),
                       name="gpu.substitute", top_down=top_down)


def identity(red: UOp) -> UOp:
  return UOp.const(red.dtype, 0 if red.arg is Ops.ADD else dtypes.min(red.dtype))


def combine(op: Ops, parts: list[UOp]) -> UOp:
  """parts combined pairwise as a balanced tree: short dependency chains, and float sums as accurate as numpy's."""
  while len(parts) > 1:
    nxt = [(a + b if op is Ops.ADD else a.maximum(b)) for a, b in zip(parts[::2], parts[1::2])]
    parts = nxt + ([parts[-1]] if len(parts) % 2 else [])
  return parts[0]


class ThreadLoop:
  """n elements spread over the `threads` threads of a block: thread lidx takes lidx, lidx+threads, ...
  Unrolled (one index per trip) when short, else a loop `RANGE(trips)`."""
  def __init__(self, n: int, threads: int, lidx: UOp, range_arg):
    self.n, self.threads, self.trips = n, threads, -(-n // threads)
    self.loop = None if self.trips <= UNROLL else UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, self.trips),), range_arg)
    self.lidx = lidx

  def steps(self) -> list[tuple[UOp, UOp | None]]:
    """(element index, guard or None) per unrolled trip, or the one step of the loop; the index is clamped in bounds."""
    out = []
    for c in ([None] if self.loop is not None else range(self.trips)):
      base = self.loop * self.threads if c is None else UOp.const(dtypes.index, c * self.threads)
      f = self.lidx if c == 0 else base + self.lidx
      last = self.n % self.threads != 0 and (c is None or c == self.trips - 1)
      guard = f < self.n if last else None
      out.append((guard.where(f, self.n - 1) if guard is not None else f, guard))
    return out


def lane_access(idx: UOp, lane: UOp) -> str:
  """How the threads of a warp, which differ in the loop index `lane`, read through the index `idx`: all one address
  ("uniform"), consecutive addresses ("coalesced"), or anything else ("strided")."""
  if lane not in idx.toposort: return "uniform"
  coef = sum(k for t, k in terms_of(idx) if t is lane) if any(t is lane for t, _ in terms_of(idx)) else None
  return "coalesced" if coef == 1 and not any(t is not lane and t is not None and lane in t.toposort
                                              for t, _ in terms_of(idx)) else "strided"


def _strided_loads(reductions: list[UOp], lane_of) -> int:
  return sum(lane_access(n.src[0].src[1], lane_of(red)) == "strided"
             for red in reductions for n in red.src[0].toposort if n.op is Ops.LOAD)


def block_plan(sink: UOp) -> tuple[list[UOp], list[UOp], list[UOp]] | None:
  """(output loops, the reductions the block shares, the row loops: those they depend on) when the kernel runs one
  block per row, or None when it runs one thread per output element. A block per row when there are long reductions
  (computed once per output element, of at least BLOCK_REDUCE_MIN elements, by ADD or MAX) and one of:
  - their rows are too few to fill the GPU with a thread each;
  - a row's value is shared by several outputs (a fused softmax): one thread per output would recompute it;
  - the loads in them walk memory along the reduced axis more than along the innermost output axis (a row sum, not
    a matrix product): so that consecutive threads read consecutive addresses."""
  nodes = sink.toposort
  ranges = open_ranges(sink)
  outs = sorted({n for n in nodes if n.op is Ops.RANGE and n.arg[0] == "out"}, key=nesting_key)
  size = lambda rs: math.prod(r.src[0].arg for r in rs)
  shared = [n for n in nodes if n.op is Ops.REDUCE and ranges[n] <= set(outs) and n.arg in (Ops.ADD, Ops.MAX)
            and size(n.src[1:]) >= BLOCK_REDUCE_MIN]
  if not shared: return None
  rows = sorted(set().union(*(ranges[r] for r in shared)), key=nesting_key)
  if (size(rows) < FEW_OUTPUTS or len(rows) < len(outs) or
      _strided_loads(shared, lambda red: red.src[-1]) < (_strided_loads(shared, lambda red: outs[-1]) if outs else 1)):
    return outs, shared, rows
  return None


def block_threads(n: int) -> int:
  for b in (128, 256, 512, 1024):
    if -(-n // b) <= UNROLL: return b
  return LOOP_THREADS


def _gate(st: UOp, gate: UOp | None) -> UOp:
  if gate is None: return st
  return UOp(Ops.STORE, st.dtype, (*st.src[:2], gate if len(st.src) < 3 else st.src[2] & gate))


def map_flat(sink: UOp, outs: list[UOp]) -> UOp:
  sizes = [r.src[0].arg for r in outs]
  n = math.prod(sizes)
  threads = FLAT_THREADS if n >= FLAT_THREADS else -(-n // 32) * 32
  blocks = -(-n // threads)
  (gidx, in_grid), lidx = grid(blocks), special("lidx0", threads)
  flat = lidx if blocks == 1 else gidx * threads + lidx
  guard = flat < n if n % threads or in_grid is not None else None
  idx = guard.where(flat, n - 1) if guard is not None else flat
  stores = [_gate(st, guard) for st in sink.src]
  return substitute(sink.replace(src=tuple(stores)), dict(zip(outs, split(idx, sizes))))


def map_block(sink: UOp, outs: list[UOp], top: list[UOp], rows: list[UOp]) -> UOp:
  """One block per row: the reductions `top` shared by its threads, the row's other outputs spread over them."""
  cols = [r for r in outs if r not in rows]
  longest = max(math.prod(r.src[0].arg for r in red.src[1:]) for red in top)
  threads = block_threads(longest)
  nrows = math.prod(r.src[0].arg for r in rows)
  assert threads <= MAX_THREADS
  (gidx, in_grid), lidx = grid(nrows), special("lidx0", threads)
  row = gidx if in_grid is None else in_grid.where(gidx, nrows - 1)  # a block past the end reads the last row
  replace: dict[UOp, UOp] = dict(zip(rows, split(row, [r.src[0].arg for r in rows])))
  # each reduction: a partial value per thread, then the block's combine
  for i, red in enumerate(top):
    rr = list(red.src[1:])
    sizes = [r.src[0].arg for r in rr]
    tl = ThreadLoop(math.prod(sizes), threads, lidx, rr[0].arg)
    parts = []
    for c, (f, guard) in enumerate(tl.steps()):
      v = substitute(red.src[0], dict(zip(rr, split(f, sizes))), ("part", i, c))
      parts.append(v if guard is None else guard.where(v, identity(red)))
    partial = combine(red.arg, parts) if tl.loop is None else UOp(Ops.REDUCE, red.dtype, (parts[0], tl.loop), red.arg)
    replace[red] = UOp(Ops.BARRIER, red.dtype, (partial,), red.arg)
  # the stores: spread the row's other output elements over the threads; a store of the row's one value by thread 0
  stores = []
  csizes = [r.src[0].arg for r in cols]
  if not cols: stores = [_gate(st, lidx < 1) for st in sink.src]
  else:
    tl = ThreadLoop(math.prod(csizes), threads, lidx, ("out", len(outs), "thread"))
    for c, (f, guard) in enumerate(tl.steps()):
      sub = dict(zip(cols, split(f, csizes)))
      stores += [_gate(substitute(st, sub, ("col", c)), guard) for st in sink.src]
  stores = [_gate(st, in_grid) for st in stores]  # and writes nothing
  return substitute(sink.replace(src=tuple(stores)), replace, top_down=True)


def map_to_grid(sink: UOp) -> UOp | None:
  if sink.arg == "linear": return None
  if any(n.op in (Ops.SPECIAL, Ops.BARRIER) for n in sink.toposort): return None   # mapped already
  if (plan := block_plan(sink)) is not None: return map_block(sink, *plan)
  outs = sorted({n for n in sink.toposort if n.op is Ops.RANGE and n.arg[0] == "out"}, key=nesting_key)
  return map_flat(sink, outs) if outs else None   # no loops: one output element, computed by one thread


gpu_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), map_to_grid)], name="gpu")


# ---------------------------------------------------------------- gpu_index

def fold_div_mod_pairs(u: UOp) -> UOp | None:
  """(x//c)*(c*k) + (x%c)*k -> x*k, in a sum of terms: the thread-index arithmetic back to flat indices."""
  terms = terms_of(u)
  coef = {t: k for t, k in terms if t is not None}
  for t, k in terms:
    if t is None or t.op is not Ops.MOD or t.src[1].op is not Ops.CONST: continue
    x, c = t.src[0], t.src[1].arg
    if c <= 0 or x.vmin < 0: continue
    # x//c, or, where x is itself y//d, the form the symbolic rules leave it in: y//(d*c)
    qs = [x // c] + ([x.src[0] // (x.src[1].arg * c)] if x.op is Ops.IDIV and x.src[1].op is Ops.CONST else [])
    for q in qs:
      if coef.get(q) == k * c:
        return sum_of(u.dtype, [(s, j) for s, j in terms if s is not t and s is not q] + [(x, k)])
  return None


gpu_index_rules = symbolic_rules + PatternMatcher([
  (UPat(Ops.ADD, dtype=tuple(d for d in dtypes.all() if d.is_int), name="u"), fold_div_mod_pairs),
], name="gpu_index")


# ---------------------------------------------------------------- launch

def launch_dims(linear: UOp) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
  """(global_size in blocks, local_size in threads) of a mapped kernel, or None when it runs on one thread."""
  sizes = {u.arg[0]: u.arg[1] for u in linear.toposort if u.op is Ops.SPECIAL}
  if not sizes: return None
  return (sizes.get("gidx0", 1), 1, 1), (sizes.get("lidx0", 1), 1, 1)
