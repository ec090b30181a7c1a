"""GPU rules: for a device whose loops are its own threads (CUDA): a grid of blocks of threads.

These stages run only when `run.device_loops` (see rules/pipeline.py), but for gpu_fuse, which the CPU runs too
within its own limits (`FuseContext.admits`: rules/opt/rows.py); the shared stages are unchanged.

Stage `gpu_fuse` (schedule scope, rule `inline_broadcast_reductions` on each KERNEL, ctx: `FuseContext` with its
index of the schedule, made by `FuseContext.index_schedule` before the rules run; kernels are decided one by one in
schedule order by `inline_into_readers`, readers and writers looked up in the index, never searched): a kernel that only
computes a row reduction which its readers read broadcast back along the reduced axes (the max and the sum of a
softmax, the mean and the variance of a layer norm) is inlined into each reader and dropped, unless its buffer is an
output of the realize. The reader then computes the reduction itself, once per row: on a GPU a group of lanes owns a
row (stage `gpu_grid` below), so the row is read from memory once and again from cache, instead of once per kernel.
Values are unchanged. Decided on the tensor-level graph alone (no other stage is run to decide): only a reduction
whose reads walk memory along its reduced axis (`walks_rows`: a row reduction, not a column one) is inlined, of any
row length; every reader must read the result only broadcast along the reduced axes (else it would be recomputed per
element); nothing between the two kernels may write what the reduction reads; the device's `admits` (if any)
agrees. On the CPU the reader's threads take rows, each row read from memory once and its other passes from cache.

The plan (one type for both devices: rules/opt's `Plan` of `Opt(kind, axis, amount)` records) is chosen by stage
`opt`'s policy; on a GPU, without a search's or a user's pick, by `gpu_plan`: a product's tile plan
(rules/opt/gpu_tile.py) where its sizes divide a tile, else a rows plan (`grid_plan`). A GPU plan holds the GPU's
kinds: `global(a)` (loop a, what the splitting records leave of it, runs on blocks; several merge row-major), `local(a,
n)` (n lanes of a block), `group(a, n)` (a reduction loop over n lanes, combined across them), and a rows plan's
records about the merged rows: `local(-1, R)` (R rows a block), `upcast(-1, E)` (E rows a thread), `vector(-1, 4)` (a
lane takes runs of 4 consecutive elements, of its row's spread loops or else of the rows: stage opt_grid_vector,
rules/gpu_vector.py, reads and writes each run as one floatx4).

A **tile plan** also holds the CPU's kinds: `split`/`upcast` (a register tile), `pack(k)` of a reduction loop (its
slices staged in shared memory, rules/opt/pack.py). Its local records split their loop like upcast ones (stage
opt_split), and stage `opt_grid` maps the parts: `lay_out_tiles`.

Stage `opt_grid` (kernel scope, `grid_rules`, ctx: `OptContext`, prepared by `lay_out_grid`, which lays the plan out
once: `GridLayout`, the index each planned loop becomes) runs after opt_pack. For a rows plan (`lay_out_rows`):
- a planned `RANGE` becomes its index in `SPECIAL(arg=("gidx0", blocks))` (the block) and
  `SPECIAL(arg=("lidx0", threads))` (the thread): a row loop takes the row, row = gidx0*rows_per_block + lidx0//lanes;
  a spread loop takes lane, lane+lanes, ... (lane = lidx0 % lanes: consecutive lanes read consecutive addresses);
- a `REDUCE` over spread loops becomes each lane's partial (its own trips: unrolled when at most UNROLL, else a loop),
  combined over the row's lanes by `BARRIER(partial, arg=(op, lanes))`: every lane waits there and leaves with the
  row's value (the renderer: warp shuffles, and shared memory when the row has more than a warp);
- a `STORE` is gated where it must not write: a row past the end, a lane past the row's end, or any lane but the
  first for a row's single value;
- unrolled output loops (the columns of a softmax) are copied per trip on the SINK: the passes of a fused softmax
  then load the same elements as the same UOps, which hash-consing shares, so the row is read once into registers;
  so are a thread's rows where it takes several (`upcast`: more independent loads in flight per thread).
Where sizes do not divide, an index past the end is clamped to the last valid one (every load stays in bounds and
every lane reaches the BARRIER), its share of a reduction is the identity and its store is gated off. Launch sizes
are the SPECIALs' sizes: `launch_dims` reads them off the linear kernel, within MAX_THREADS and MAX_GRID: a kernel that needs
more blocks loops over them, the launched blocks taking every MAX_GRID-th one in turn (`grid`: a grid-stride loop).

The two mappings the heuristic picks between are one mapping with other amounts: one thread per output element
(every output loop a row, one lane per row, FLAT_THREADS rows per block; 2 or 4 rows per thread where the grid would
still fill the GPU's multiprocessors WAVES times over) and lanes per row (a row reduction that is
shared by several outputs, walks memory along its row, or has too few rows to fill the GPU a thread each): a block of
128-1024 lanes for a row of at least BLOCK_REDUCE_MIN elements, else up to a warp of lanes per row and several rows
per block.

Stage `opt_grid_index` (kernel scope, `gpu_index_rules`): the shared symbolic rules plus `(x//c)*c + x%c -> x`, which
folds the thread-index arithmetic back into flat indices, and a store whose gate the bounds decided is not gated.
"""
from __future__ import annotations
import math
from typing import Callable
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes, substitute, splice_sinks, InOrder
from .strided_view import contiguous_strides, View
from .realize import buffers_read, ScheduleIndex
from .shapes import shape_of
from .symbolic import symbolic_rules, terms_of, sum_of
from .linearize import open_ranges, nesting_key
from .opt.plan import Opt, OptKind, Plan, OptContext, InvalidPlan, SPLITTING, is_tile_plan, check_splits
from .opt.upcast import part_kind
from .opt.pack import split_flat as split

MAX_THREADS = 1024           # threads per block, every CUDA GPU since compute capability 2.0
MAX_GRID = 2**31 - 1         # blocks along x
WARP = 32
FLAT_THREADS = 256           # threads per block of a one-thread-per-element kernel
BLOCK_REDUCE_MIN = 128       # a row at least this long is shared by a whole block; a shorter one by a warp or less
ROW_GROUP_THREADS = 128      # threads per block where several short rows share a block
FEW_OUTPUTS = 2048           # fewer outputs than this cannot keep a GPU busy with one thread each
UNROLL = 16                  # per-lane trips of at most this many are unrolled
LOOP_THREADS = 512           # lanes per row when the per-lane trips stay a loop
MULTIPROCESSORS = 132        # SMs of the GPU planned for when the device does not say (an H100 SXM, an H200)
RESIDENT_THREADS = 2048      # threads an SM holds at once (compute capability 8.0 and later)
WAVES = 4                    # a grid of fewer blocks than this many full GPUs takes no more rows per thread
RUN = 4                      # a lane's run of consecutive elements under a rows plan's vector(-1, RUN) record: a floatx4


def cdiv(a: int, b: int) -> int: return -(-a // b)
def size_of(loops) -> int: return math.prod(r.src[0].arg for r in loops)


# ---------------------------------------------------------------- gpu_fuse (schedule scope)

@dataclass
class FuseContext:
  """The gpu_fuse stage's context: its index of the schedule (`index_schedule`, before the rules run) and the decisions,
  made kernel by kernel in schedule order (a reduction is judged as the reductions inlined into it left it)."""
  outputs: set = field(default_factory=set)   # BUFFERs the realize returns: their kernels stay
  inlined: list[str] = field(default_factory=list)
  index: ScheduleIndex | None = None                            # the schedule as the stage first saw it
  current: list[UOp] = field(default_factory=list)              # each kernel with the reductions inlined into it so far
  dropped: set[int] = field(default_factory=set)                # places of kernels inlined into all their readers
  decisions: InOrder = field(default_factory=InOrder)          # kernels are decided in schedule order
  # the device's own limit on the reductions it inlines (None: any; the CPU's: rules/opt/rows.py)
  admits: Callable[[list[UOp]], bool] | None = None

  def index_schedule(self, schedule: UOp) -> None:
    """Kernels by place, and each buffer's readers and writers: linear in the schedule, no pair of kernels tried."""
    self.index = ScheduleIndex(schedule.src)
    self.current = list(self.index.kernels)


def _top_reductions(value: UOp) -> list[UOp]:
  """The reductions that `value` computes last (reached through elementwise ops only)."""
  out, stack, seen = [], [value], set()
  while stack:
    n = stack.pop()
    if n in seen: continue
    seen.add(n)
    if n.op is Ops.REDUCE_AXIS: out.append(n)
    elif n.op in GroupOp.Elementwise: stack.extend(n.src)
  return out


def _under_contiguous_views(u: UOp) -> UOp:
  """u without the contiguous views on top (a realized buffer read as its own shape): a view over them indexes
  memory with its own strides."""
  while u.op is Ops.VIEW and u.arg.is_contiguous: u = u.src[0]
  return u


def _index_only(u: UOp) -> bool:
  """u is computed from constants and indices alone (a constant, `arange`, a causal mask): reading it reads no memory."""
  return all(n.op in (Ops.CONST, Ops.IOTA, Ops.VIEW) or n.op in GroupOp.Elementwise for n in u.toposort)


def _buffer_views(value: UOp) -> list[View] | None:
  """The views through which `value` reads buffers (through elementwise ops), or None when it reads something
  else whose memory layout is not known here (a view of other computed data, a nested reduction)."""
  views, stack, seen = [], [value], set()
  while stack:
    n = stack.pop()
    if n in seen: continue
    seen.add(n)
    if n.op is Ops.VIEW and _under_contiguous_views(n.src[0]).op is Ops.BUFFER: views.append(n.arg)
    elif n.op is Ops.VIEW and _index_only(n.src[0]): continue   # a constant, a causal mask: no memory read
    # a reduction inlined here before, read broadcast: its own reads were judged when it was inlined
    elif n.op is Ops.VIEW and _top_reductions(n.src[0]): continue
    elif n.op in GroupOp.Elementwise: stack.extend(n.src)
    elif n.op not in (Ops.CONST, Ops.IOTA): return None
  return views


def walks_rows(reductions: list[UOp]) -> bool:
  """The reductions read memory along their last reduced axis (stride 0 or 1) more often than along the innermost
  axis they keep: a row reduction, whose lanes then read consecutive addresses, not a column one."""
  along = across = 0
  for red in reductions:
    shape, axes = shape_of(red.src[0]), red.arg[1]
    if (views := _buffer_views(red.src[0])) is None: return False
    kept = [d for d, s in enumerate(shape) if d not in axes and s > 1]
    for v in views:
      along += v.strides[max(axes)] not in (0, 1)
      across += v.strides[kept[-1]] not in (0, 1) if kept else 1
  return along < across or (along == 0 and across == 0)


def _broadcasts_back(v: View, shape: tuple[int, ...], axes: set[int]) -> bool:
  """v reads a row-major `shape` whose `axes` have size 1, repeating it along those axes and nothing else."""
  want = contiguous_strides(shape)
  return (v.mask is None and v.offset == 0 and len(v.shape) == len(shape) and
          all((vs == s and (st == w or s == 1)) if d not in axes else st == 0 or vs == 1
              for d, (vs, st, s, w) in enumerate(zip(v.shape, v.strides, shape, want))))


def _drops_unit_axes(v: View, shape: tuple[int, ...]) -> bool:
  """v only adds or removes axes of size 1 (a reduction's result reshaped: var(1) of shape (n,), not (n, 1))."""
  return v.is_contiguous and [s for s in v.shape if s != 1] == [s for s in shape if s != 1]


def _reads_broadcast(reader: UOp, out_view: UOp, axes: set[int]) -> bool:
  """Every path from the reader's stores to `out_view` (the producer's result) goes through elementwise ops,
  reductions over `axes` only, reshapes that only drop or add axes of size 1, and at most a view that broadcasts it
  back along `axes`: so the reader asks for the
  result at its own output indices on the other axes, once per row."""
  holds: set[UOp] = set()
  for n in reader.toposort:
    if n is out_view or any(s in holds for s in n.src): holds.add(n)
  shape = out_view.arg.shape
  for n in holds:
    if n is out_view or n.op in (Ops.KERNEL, Ops.STORE) or n.op in GroupOp.Elementwise: continue
    if n.op is Ops.REDUCE_AXIS and set(n.arg[1]) <= axes: continue
    if n.op is Ops.VIEW and n.src[0] is out_view and _broadcasts_back(n.arg, shape, axes): continue
    if n.op is Ops.VIEW and n.src[0] is not out_view and _drops_unit_axes(n.arg, shape_of(n.src[0])): continue
    return False
  # the stores write the reader's own buffers, in order: the output view must not itself be on the path
  return all(st.src[0] not in holds for st in reader.src)


def inline_into_readers(ctx: FuseContext, i: int) -> None:
  """Kernel i, as the reductions inlined into it so far left it: when it only computes a row reduction that each of
  its readers reads broadcast back along the reduced axes, it is inlined into them (their new form kept in ctx) and
  dropped, unless its buffer is an output. The readers and writers come from the index."""
  p = ctx.current[i]
  if p.op is not Ops.KERNEL or len(p.src) != 1: return
  out_view, value = p.src[0].src
  buf = out_view.src[0]
  if buf in ctx.outputs or not (reductions := _top_reductions(value)) or not walks_rows(reductions): return
  if ctx.admits is not None and not ctx.admits(reductions): return
  axes = set().union(*(r.arg[1] for r in reductions))
  readers = [j for j in ctx.index.readers.get(buf, ()) if j > i]
  if not readers or any(ctx.current[j].op is not Ops.KERNEL or ctx.current[j].arg != p.arg or
                        not _reads_broadcast(ctx.current[j], out_view, axes) for j in readers): return
  # nothing run between the producer and its last reader may write what the producer reads
  if any(i < w < readers[-1] and w not in ctx.dropped for b in buffers_read(p) for w in ctx.index.writers.get(b, ())): return
  for j in readers: ctx.current[j] = substitute(ctx.current[j], {out_view: value}, name="gpu_fuse.inline")
  ctx.dropped.add(i)
  ctx.inlined.append(f"kernel {i} (a reduction over axes {sorted(axes)}) inlined into kernel(s) {readers}: "
                     "they read it broadcast along the reduced axes")


def inline_broadcast_reductions(ctx: FuseContext, k: UOp) -> UOp | None:
  """A kernel of the schedule becomes what the fusion decisions made of it: an empty SINK (dropped from the schedule)
  when it was inlined into its readers, the kernel with the reductions inlined into it when it reads some."""
  if (i := ctx.index.place.get(k)) is None: return None
  # whether a reduction is inlined depends on the reductions inlined into it before
  ctx.decisions.up_to(i, lambda j: inline_into_readers(ctx, j))
  if i in ctx.dropped: return UOp(Ops.SINK)
  return None if ctx.current[i] is k else ctx.current[i]


fuse_rules = PatternMatcher([
  (UPat(Ops.KERNEL, name="k"), inline_broadcast_reductions),
  (UPat(Ops.SINK, name="node"), splice_sinks),   # inlined kernels, now empty, leave the schedule
], name="gpu_fuse")


# ---------------------------------------------------------------- a GPU plan's checks (one Plan type: rules/opt)

class InvalidGridPlan(InvalidPlan):
  """A GPU plan that does not fit the kernel it was given to."""


def lanes_of(plan: Plan) -> int:
  """Lanes of a row: the amount of every local record on a loop and every group record (a rows plan)."""
  return max((o.amount for o in plan.opts if o.kind in (OptKind.LOCAL, OptKind.GROUP) and o.axis >= 0), default=1)


def rows_per_block(plan: Plan) -> int: return max((o.amount for o in plan.opts if o.kind is OptKind.LOCAL and o.axis < 0), default=1)
def rows_per_thread(plan: Plan) -> int: return max((o.amount for o in plan.opts if o.kind is OptKind.UPCAST and o.axis < 0), default=1)
def run_length(plan: Plan) -> int:
  """Consecutive elements a lane takes at a time: the amount of a rows plan's `vector(-1, w)` record, else 1."""
  return max((o.amount for o in plan.opts if o.kind is OptKind.VECTOR and o.axis < 0), default=1)
def plan_axes(plan: Plan, *kinds: OptKind) -> list[int]: return [o.axis for o in plan.opts if o.kind in kinds and o.axis >= 0]


def check_gpu_plan(plan: Plan, loops: list[UOp]) -> None:
  """A GPU plan is a rows plan (whole loops onto blocks and lanes: global, local, group records, `local(-1, R)` R rows a
  block, `upcast(-1, E)` E rows a thread) or a tile plan (rules/opt's splitting records with local parts: see
  `lay_out_tiles`)."""
  for o in plan.opts:
    if o.axis >= len(loops) or o.axis < -1 or (o.axis == -1 and o.kind not in (OptKind.LOCAL, OptKind.UPCAST, OptKind.VECTOR)):
      raise InvalidGridPlan(f"{o!r} names no loop of this kernel ({len(loops)} loops)")
    if o.kind is OptKind.GLOBAL and loops[o.axis].arg[0] != "out": raise InvalidGridPlan(f"{o!r}: only an output loop runs on blocks")
  outs = [i for i, r in enumerate(loops) if r.arg[0] == "out"]
  if missing := set(outs) - set(plan_axes(plan, OptKind.GLOBAL, OptKind.LOCAL)):
    raise InvalidGridPlan(f"{plan}: output loops {sorted(missing)} are not planned")
  if is_tile_plan(plan): return check_tile_plan(plan, loops)
  lanes, rows = lanes_of(plan), rows_per_block(plan)
  for o in plan.opts:
    if o.kind is OptKind.UPCAST and not 2 <= o.amount <= UNROLL: raise InvalidGridPlan(f"{o!r}: a thread takes 2 to {UNROLL} rows")
    if o.kind is OptKind.VECTOR and o.amount != RUN:
      raise InvalidGridPlan(f"{o!r}: a lane's run is {RUN} consecutive elements (16 bytes of float32: one floatx4)")
    if o.kind is OptKind.GROUP and loops[o.axis].arg[0] == "out": raise InvalidGridPlan(f"{o!r}: only a reduction loop is grouped over lanes")
    if o.kind is OptKind.LOCAL and o.axis >= 0 and loops[o.axis].arg[0] != "out": raise InvalidGridPlan(f"{o!r}: a reduction loop over lanes is a group record")
    if o.kind in (OptKind.LOCAL, OptKind.GROUP) and o.axis >= 0 and o.amount != lanes:
      raise InvalidGridPlan(f"{o!r}: every spread loop has the row's {lanes} lanes")
  loop_records = [o.axis for o in plan.opts if o.axis >= 0]
  if len(set(loop_records)) != len(loop_records): raise InvalidGridPlan(f"{plan}: a loop is planned twice")
  if (lanes * rows > MAX_THREADS or (lanes > WARP and rows > 1) or (lanes > 1 and (lanes * rows) % WARP) or
      (lanes < WARP and lanes & (lanes - 1))):
    raise InvalidGridPlan(f"{plan}: {lanes} lanes x {rows} rows is not a block (whole warps, at most {MAX_THREADS} "
                          "threads; a row of up to a warp has a power of two of lanes, a longer one a block alone)")


def check_tile_plan(plan: Plan, loops: list[UOp]) -> None:
  """A tile plan: every record a CPU kind that the loops allow (local records split like upcast ones), whole loops
  only on blocks, at most MAX_THREADS lanes, no rows records and no group (lanes of a tile never combine)."""
  check_splits(plan, loops, (*SPLITTING, OptKind.LOCAL))
  for o in plan.opts:
    if o.axis < 0 or o.kind in (OptKind.GROUP, OptKind.PARALLEL, OptKind.SIMD, OptKind.INTERCHANGE):
      raise InvalidGridPlan(f"{o!r}: not a record of a GPU tile plan")
    if o.kind is OptKind.VECTOR: raise InvalidGridPlan(f"{o!r}: a GPU tile plan has no vector record yet")
  if (threads := math.prod(o.amount for o in plan.opts if o.kind is OptKind.LOCAL)) > MAX_THREADS:
    raise InvalidGridPlan(f"{plan}: {threads} lanes, more than a block's {MAX_THREADS}")
  if any(loops[o.axis].arg[0] != "out" for o in plan.opts if o.kind in (OptKind.LOCAL, OptKind.UPCAST)):
    raise InvalidGridPlan(f"{plan}: a reduction loop over lanes or unrolled into registers needs a group record")


def row_lanes(n: int) -> int:
  """Lanes for a row of n elements: a block of 128-1024 with at most UNROLL elements each (else LOOP_THREADS and a
  loop) for a long row; for a short one the next power of two up to a warp (a warp's shuffles combine it)."""
  if n < BLOCK_REDUCE_MIN: return min(WARP, 1 << (n - 1).bit_length())
  for b in (128, 256, 512, 1024):
    if cdiv(n, b) <= UNROLL: return b
  return LOOP_THREADS


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


def thread_rows(n: int, threads: int, multiprocessors: int) -> int:
  """Rows a thread takes (unrolled) so that each has several loads in flight, while the grid still has
  WAVES x multiprocessors x (RESIDENT_THREADS / threads) blocks: the whole GPU busy several times over."""
  for e in (4, 2):
    if cdiv(n, threads * e) >= WAVES * multiprocessors * (RESIDENT_THREADS // threads): return e
  return 1


def runs_fit(sink: UOp, columns: list[UOp], shared: list[UOp], lanes: int) -> bool:
  """Whether a lanes-per-row plan takes its elements in runs of RUN (`vector(-1, RUN)`: floatx4 loads and stores,
  rules/gpu_vector.py): every memory access is of float32, every spread (the columns, each shared reduction's loops)
  is whole runs of every lane (its size a multiple of lanes x RUN) and unrolled (at most UNROLL a lane: the row in
  registers), and some load walks memory along a spread by one element (consecutive lanes, consecutive runs)."""
  groups = [tuple(columns)] * bool(columns) + [red.src[1:] for red in shared]
  if any(size_of(g) % (lanes * RUN) or size_of(g) > lanes * UNROLL for g in groups): return False
  accesses = [n for n in sink.toposort if n.op in (Ops.LOAD, Ops.STORE)]
  if any((n.dtype if n.op is Ops.LOAD else n.src[1].dtype) is not dtypes.float32 for n in accesses): return False
  return any(lane_access(n.src[0].src[1], g[-1]) == "coalesced" for n in accesses if n.op is Ops.LOAD for g in groups)


def gpu_plan(sink: UOp, loops: list[UOp], multiprocessors: int = MULTIPROCESSORS) -> Plan:
  """The GPU's heuristic: a product's tiles (rules/opt/gpu_tile.py) where they fit, else rows (`grid_plan`)."""
  from .opt.gpu_tile import tile_plan
  return tile_plan(sink, loops, multiprocessors) or grid_plan(sink, loops, multiprocessors)


def grid_plan(sink: UOp, loops: list[UOp], multiprocessors: int = MULTIPROCESSORS) -> Plan:
  """The heuristic: lanes per row when the kernel has reductions computed once per output element (by ADD or MAX)
  and one of: their rows are too few to fill the GPU with a thread each; a row's value is shared by several outputs
  (a fused softmax): a thread per output would recompute it; the loads in them walk memory along the reduced axis
  more than along the innermost output axis (a row sum, not a matrix product). Else one thread per output element.
  A long row whose rows are too few to fill the multiprocessors gets up to MAX_THREADS lanes."""
  from .attention import attention_grid_plan, carried_reductions   # a fused attention kernel has a plan of its own
  if (plan := attention_grid_plan(sink, loops)) is not None: return plan
  axis = {r: i for i, r in enumerate(loops)}
  outs = [r for r in loops if r.arg[0] == "out"]
  ranges = open_ranges(sink)
  # (none of an online softmax's reductions is spread over lanes: they run inside the loop that carries its state)
  shared = [n for n in sink.toposort if n.op is Ops.REDUCE and ranges[n] <= set(outs) and n.arg in (Ops.ADD, Ops.MAX)
            and size_of(n.src[1:]) > 0] if not carried_reductions(sink) else []   # (an empty reduction: its identity)
  rows = sorted(set().union(*(ranges[r] for r in shared)), key=nesting_key) if shared else outs
  if shared and (size_of(rows) < FEW_OUTPUTS or len(rows) < len(outs) or
                 _strided_loads(shared, lambda red: red.src[-1]) < (_strided_loads(shared, lambda red: outs[-1]) if outs else 1)):
    longest = max(size_of(red.src[1:]) for red in shared)
    lanes = row_lanes(longest)
    # few long rows: more lanes per row (at least an element each) until the rows fill the GPU's multiprocessors
    while lanes >= BLOCK_REDUCE_MIN and lanes < MAX_THREADS and 2 * lanes <= longest and \
        size_of(rows) * lanes < multiprocessors * RESIDENT_THREADS: lanes *= 2
    per_block = 1 if lanes > WARP else ROW_GROUP_THREADS // lanes
    per_block = max(min(per_block, 1 << (size_of(rows) - 1).bit_length()), WARP // lanes)
    spread = [r for r in outs if r not in rows] + [r for red in shared for r in red.src[1:]]
    return Plan((*(Opt(OptKind.GLOBAL, axis[r]) for r in rows),
                 *(Opt(OptKind.LOCAL if r.arg[0] == "out" else OptKind.GROUP, axis[r], lanes) for r in spread),
                 *((Opt(OptKind.LOCAL, -1, per_block),) if per_block > 1 else ()),
                 *((Opt(OptKind.VECTOR, -1, RUN),) if runs_fit(sink, [r for r in outs if r not in rows], shared, lanes) else ())), "heuristic")
  n = size_of(outs)
  per_block = FLAT_THREADS if n >= FLAT_THREADS else cdiv(n, WARP) * WARP
  per_thread = thread_rows(n, per_block, multiprocessors)
  return Plan((*(Opt(OptKind.GLOBAL, axis[r]) for r in outs), *((Opt(OptKind.LOCAL, -1, per_block),) if outs else ()),
               *((Opt(OptKind.UPCAST, -1, per_thread),) if per_thread > 1 else ())), "heuristic")


# ---------------------------------------------------------------- gpu (kernel scope): the plan, laid out once

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


def clamped(i: UOp, n: int, guard: UOp | None) -> UOp: return i if guard is None else guard.where(i, n - 1)


def both(a: UOp | None, b: UOp | None) -> UOp | None: return a if b is None else b if a is None else a & b


@dataclass(frozen=True)
class Spread:
  """Loops of n elements (merged row-major) spread over the lanes of a row: lane takes trip*lanes + lane for each
  of its trips; `trip` is the per-lane loop (None for one trip), unrolled when `unrolled`; `guard` (in the trip and
  lane) is False past the end, where the index is clamped."""
  n: int
  lanes: int
  trip: UOp | None
  unrolled: bool
  guard: UOp | None

  def trips(self, u: UOp) -> list[UOp]:
    """u once per trip when unrolled, with the trip index made a constant; else u once."""
    if self.trip is None or not self.unrolled: return [u]
    return [substitute(u, {self.trip: UOp.const(dtypes.index, c)}, "gpu.unroll") for c in range(self.trip.src[0].arg)]

  def copies(self, u: UOp) -> list[tuple[UOp, UOp | None]]:
    """(u, its guard) per trip (see trips)."""
    us = self.trips(u)
    return list(zip(us, [None] * len(us) if self.guard is None else self.trips(self.guard)))


@dataclass
class GridLayout:
  """A GPU plan laid out once (stage opt_grid's prepare) for the stage's rules: the index each planned loop becomes."""
  index: dict[UOp, UOp] = field(default_factory=dict)          # planned RANGE -> its index in SPECIALs and trips
  spreads: dict[tuple[UOp, ...], Spread] = field(default_factory=dict)  # a reduction's new range sources -> its spread
  columns: Spread | None = None                                 # the spread of the output loops that are not rows
  rows: Spread | None = None                                    # a thread's rows, when it takes several
  gate: UOp | None = None                                       # where a store may write


def lay_out_rows(plan: Plan, sink: UOp, loops: list[UOp]) -> GridLayout:
  """A rows plan: global loops merge into rows (LOCAL(-1, R) of them a block, UPCAST(-1, E) a thread), local and group
  loops are spread over the lanes of a row (a lane takes lane, lane + lanes, ...), sizes that do not divide clamped and
  gated. With `vector(-1, w)` a lane takes runs of w consecutive elements instead of single ones (of its row's spread
  loops where the row has lanes, else of the rows themselves): run j of lane l is elements (j*lanes + l)*w ... + w-1,
  unrolled like the rest of its trips, so that stage opt_grid_vector reads and writes each run as one vector."""
  ctx = GridLayout()
  lanes, per_block, per_thread, w = lanes_of(plan), rows_per_block(plan), rows_per_thread(plan), run_length(plan)
  rw = w if lanes == 1 else 1   # the rows' own run: a plan with lanes per row runs along its spread loops instead
  rows = [loops[a] for a in plan_axes(plan, OptKind.GLOBAL)]
  nrows = size_of(rows)
  blocks = cdiv(nrows, per_block * per_thread * rw)
  (gidx, in_grid), lidx = grid(blocks), special("lidx0", per_block * lanes)
  lane = lidx if per_block == 1 else lidx % lanes
  # a thread's rows are per_block apart (runs of rw, per_block runs apart): consecutive threads still take
  # consecutive rows
  trip = None if per_thread * rw == 1 else UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, per_thread * rw),), ("out", -1, "rows"))
  first = gidx if per_thread == 1 else gidx * per_thread + (trip if rw == 1 else trip // rw)
  row = first if per_block == 1 else first * per_block + lidx // lanes
  if rw > 1: row = row * rw + trip % rw
  # a block past the end (of a grid-stride loop's last turn) has rows past the end too
  row_guard = row < nrows if nrows % (per_block * per_thread * rw) or in_grid is not None else None
  if trip is not None: ctx.rows = Spread(nrows, per_block, trip, True, row_guard)
  ctx.index = dict(zip(rows, split(clamped(row, nrows, row_guard), [r.src[0].arg for r in rows])))
  spread = {loops[a] for a in plan_axes(plan, OptKind.LOCAL, OptKind.GROUP)}
  owned = [red.src[1:] for red in sink.toposort if red.op is Ops.REDUCE and set(red.src[1:]) <= spread]
  columns = tuple(r for r in loops if r in spread and r.arg[0] == "out")
  if set(spread) - set(columns) - {r for g in owned for r in g}: raise InvalidGridPlan(f"{plan}: a spread loop is part of no reduction")
  sw = w if lanes > 1 else 1
  for group in dict.fromkeys([columns, *owned]):
    if not group: continue
    n = size_of(group)
    trips = cdiv(n, lanes * sw) * sw
    trip = None if trips == 1 else UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, trips),), group[0].arg[:2] + ("lanes",))
    f = lane if trip is None else trip * lanes + lane if sw == 1 else ((trip // sw) * lanes + lane) * sw + trip % sw
    guard = f < n if n % (lanes * sw) else None
    ctx.index.update(zip(group, split(clamped(f, n, guard), [r.src[0].arg for r in group])))
    s = Spread(n, lanes, trip, trips <= UNROLL, guard)
    if group is columns: ctx.columns = s
    else: ctx.spreads[tuple(ctx.index[r] for r in group)] = s
  # a row with no columns has one value per row: the first lane writes it
  ctx.gate = both(row_guard, lane < 1 if lanes > 1 and not columns else None)
  return ctx


def local_parts(sink: UOp) -> list[UOp]:
  """The lane parts of a tile plan's loops (rules/opt/split.py tags them ("local", n)), in the order they merge into
  the thread index: by the loop they came from, outer parts first."""
  return sorted((n for n in sink.toposort if n.op is Ops.RANGE and part_kind(n) == "local"), key=lambda r: (r.arg[1][1], r.arg[1][0]))


def lay_out_tiles(opt: OptContext, sink: UOp) -> GridLayout:
  """A tile plan, its loops split (stage opt_split): the lane parts merge row-major into the thread index (the first
  loop's outermost), what is left of the global loops merges row-major into the block index; where the first global
  record has an amount g > 1 and other global loops follow, blocks go in groups of g along the first loop (blocks
  next in order share their tiles of the other operand in L2). Every amount divides: nothing is gated."""
  ctx = GridLayout()
  parts = local_parts(sink)
  ctx.index.update(zip(parts, split(special("lidx0", size_of(parts)), [r.src[0].arg for r in parts])))
  records = [o for o in opt.plan.opts if o.kind is OptKind.GLOBAL]
  outer = [(o, r) for o in records if (r := opt.current_loop(o.axis)) is not None and part_kind(r) is None and r.op is Ops.RANGE]
  if not outer: return ctx
  sizes = [r.src[0].arg for _, r in outer]
  if math.prod(sizes) > MAX_GRID: raise InvalidGridPlan(f"{opt.plan}: {math.prod(sizes)} blocks, more than a grid holds")
  b = special("gidx0", math.prod(sizes))
  g, rest = outer[0][0].amount, math.prod(sizes[1:])
  if g > 1 and rest > 1 and sizes[0] % g == 0:
    first = (b // (g * rest)) * g + b % g
    ctx.index.update(zip([r for _, r in outer], [first, *split((b % (g * rest)) // g, sizes[1:])]))
  else: ctx.index.update(zip([r for _, r in outer], split(b, sizes)))
  return ctx


def lay_out_grid(ctx: OptContext, sink: UOp) -> None:
  """The policy's plan (stage opt's prepare chose it) laid out once for stage opt_grid's rules (Stage.prepare)."""
  # (a kernel a user's stage mapped already has no plan attached: nothing to lay out)
  if ctx.grid is not None or not isinstance(sink.arg, Plan) or sink.arg is not ctx.plan: return
  ctx.grid = lay_out_tiles(ctx, sink) if is_tile_plan(ctx.plan) else lay_out_rows(ctx.plan, sink, kernel_axes_of(ctx))


def kernel_axes_of(ctx: OptContext) -> list[UOp]: return sorted(ctx.axis_of, key=ctx.axis_of.get)


# ---------------------------------------------------------------- gpu_grid (kernel scope): the plan carried out

def identity(red: UOp) -> UOp:
  return UOp.const(red.dtype, 0 if red.arg is Ops.ADD else dtypes.min(red.dtype))


def combine(op: Ops, parts: list[UOp]) -> UOp:
  """parts combined pairwise as a balanced tree: short dependency chains, and float sums as accurate as numpy's."""
  while len(parts) > 1:
    nxt = [(a + b if op is Ops.ADD else a.maximum(b)) for a, b in zip(parts[::2], parts[1::2])]
    parts = nxt + ([parts[-1]] if len(parts) % 2 else [])
  return parts[0]


def loop_to_grid_index(ctx: OptContext, r: UOp) -> UOp | None: return None if ctx.grid is None else ctx.grid.index.get(r)


def reduce_over_lanes(ctx: OptContext, red: UOp) -> UOp | None:
  """A reduction over spread loops: each lane's partial over its trips, then the row's lanes combined."""
  if ctx.grid is None or (s := ctx.grid.spreads.get(red.src[1:])) is None: return None
  parts = [v if g is None else g.where(v, identity(red)) for v, g in s.copies(red.src[0])]
  partial = combine(red.arg, parts) if s.trip is None or s.unrolled else UOp(Ops.REDUCE, red.dtype, (parts[0], s.trip), red.arg)
  return UOp(Ops.BARRIER, red.dtype, (partial,), (red.arg, s.lanes))


def gate_store(ctx: OptContext, st: UOp) -> UOp | None:
  if (g := ctx.grid) is None: return None
  gate = both(g.gate, g.columns.guard if g.columns is not None else None)
  return None if gate is None else st.replace(src=(*st.src, gate))


def unroll_stores(ctx: OptContext, sink: UOp) -> UOp | None:
  """Each store over a thread's unrolled rows or column trips becomes one store per trip."""
  if ctx.grid is None: return None
  stores = list(sink.src)
  for s in (ctx.grid.rows, ctx.grid.columns):
    if s is None or s.trip is None or not s.unrolled or not any(s.trip in st.toposort for st in stores): continue
    stores = [c for st in stores for c in s.trips(st)]   # a store's gate is in the store already
  return None if stores == list(sink.src) else sink.replace(src=tuple(stores))


grid_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), loop_to_grid_index),
  (UPat(Ops.REDUCE, name="red"), reduce_over_lanes),
  # a store to global memory is gated (a shared tile's fill, to a DEFINE_LOCAL, is the whole block's: never gated)
  (UPat(Ops.STORE, name="st", src=(UPat(Ops.INDEX, src=(UPat(Ops.DEFINE_GLOBAL),), allow_any_len=True), UPat())), gate_store),
  (UPat(Ops.SINK, name="sink"), unroll_stores),
], name="opt_grid")


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


def drop_gate_that_always_holds(st: UOp) -> UOp:
  """A store whose gate the bounds decided (an unrolled trip that is never past the end) is not gated."""
  return st.replace(src=st.src[:2])


gpu_index_rules = symbolic_rules + PatternMatcher([
  (UPat(Ops.ADD, dtype=tuple(d for d in dtypes.all() if d.is_int), name="u"), fold_div_mod_pairs),
  (UPat(Ops.STORE, name="st", src=(UPat(), UPat(), UPat.const(dtypes.bool, True))), drop_gate_that_always_holds),
], name="opt_grid_index")


# ---------------------------------------------------------------- launch

def launch_dims(linear: UOp) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
  """(global_size in blocks, local_size in threads) of a mapped kernel, or None when it runs on one thread."""
  sizes = {u.arg[0]: u.arg[1] for u in linear.toposort if u.op is Ops.SPECIAL}
  if not sizes: return None
  return (sizes.get("gidx0", 1), 1, 1), (sizes.get("lidx0", 1), 1, 1)
