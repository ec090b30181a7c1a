"""Optimization marks and linearization of a lowered kernel.

Stage `opt` (rule set `opt_rules`, ctx: `OptContext`): on the kernel's SINK, marks the outermost loop worth running
in parallel (`RANGE.arg` gains "parallel") and the innermost reduction loops a vector unit can run (`RANGE.arg`
gains "simd"). Values are unchanged; only how loops run.

Stage `linearize` (rule set `linearize_rules`): the loop-level graph `SINK(STORE...)` becomes `SINK` of an ordered
instruction list, arg "linear": each loop is `RANGE ... END(RANGE)`, each node comes after its sources and inside
exactly the loops whose indices it uses (so loop-invariant work is hoisted), and each `REDUCE` becomes
`DEFINE_ACC(REDUCE)` before its loops, `ASSIGN(REDUCE)` (acc = acc op value) at the end of its innermost loop, and
the REDUCE itself (its result) after the loops.
"""
from __future__ import annotations
import itertools
from dataclasses import dataclass
from rewrite import UOp, UPat, PatternMatcher, Ops, substitute
from .symbolic import terms_of


def open_ranges(sink: UOp) -> dict[UOp, frozenset[UOp]]:
  """For each node, the loops it lies inside: the RANGEs it depends on, less those its REDUCEs closed."""
  out: dict[UOp, frozenset[UOp]] = {}
  for n in sink.toposort:
    if n.op is Ops.RANGE: out[n] = frozenset({n}); continue
    rs = frozenset().union(*(out[s] for s in n.src)) if n.src else frozenset()
    if n.op is Ops.REDUCE: rs = rs - set(n.src[1:])
    out[n] = rs
  return out


def nesting_key(r: UOp) -> tuple:
  """Output loops nest in axis order, outside reduction loops, which nest in order of creation. A reduction loop
  moved among the output loops ("acc", by accumulate_in_memory) has a fractional axis position."""
  kind, n = r.arg[0], r.arg[1]
  return (0, n) if kind in ("out", "acc") else (1, n)


def loop_work(r: UOp, ranges: dict[UOp, frozenset[UOp]]) -> int:
  """Iterations of r and every loop nested in it."""
  work = r.src[0].arg
  inner = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) > nesting_key(r)}
  for q in inner: work *= q.src[0].arg
  return work


# ---- reductions that read across rows accumulate in the output instead ----
def _coefficient(index: UOp, r: UOp) -> int:
  """How far the flat index moves when loop r steps by one (0 if it does not depend on r linearly)."""
  return sum(k for t, k in terms_of(index) if t is r)


def accumulate_in_memory(ctx: OptContext, store: UOp, idx: UOp, value: UOp) -> UOp | None:
  """out[i, j] = g(sum_k f(i, j, k)) with loops i, j, k becomes loops i, k, j with out[i, j] holding the partial sum,
  when the innermost output loop j walks memory contiguously and the reduction does not (a matrix product, a
  convolution): the inner loop then streams rows and vectorizes. The first k reads nothing, the last applies g."""
  if not ctx.parallel: return None
  reduces = [n for n in value.toposort if n.op is Ops.REDUCE]
  if len(reduces) != 1 or idx.dtype.base is not reduces[0].dtype: return None
  red = reduces[0]
  if red.arg not in (Ops.ADD, Ops.MAX) or not red.dtype.is_float: return None
  outs = sorted((n for n in idx.toposort if n.op is Ops.RANGE and n.arg[0] == "out"), key=nesting_key)
  if not outs or any(n.op is Ops.RANGE and n.arg[0] == "acc" for n in value.toposort): return None
  j, ks = outs[-1], red.src[1:]
  loads = [n.src[0].src[1] for n in red.src[0].toposort if n.op is Ops.LOAD]
  streams_j = any(_coefficient(i, j) == 1 for i in loads)
  short_or_strided = ks[-1].src[0].arg < 32 or any(_coefficient(i, ks[-1]) not in (0, 1) for i in loads)
  if not (streams_j and short_or_strided) or any(_coefficient(i, ks[-1]) == 1 and _coefficient(i, j) not in (0, 1) for i in loads): return None
  pos = j.arg[1]
  moved = {k: k.replace(arg=("acc", pos - 1 + (m + 1) / (len(ks) + 1), k.arg)) for m, k in enumerate(ks)}
  # j gets a loop of its own inside the moved ones: another store of this kernel may share the old j
  moved[j] = j.replace(arg=j.arg + (("inside", ks[-1].arg),))
  val, idx, value = (substitute(u, moved, "opt.move") for u in (red.src[0], idx, value))
  red = next(n for n in value.toposort if n.op is Ops.REDUCE)
  not_first, not_last = None, None
  for k in (moved[k] for k in ks):
    nf, nl = k.ne(0), k.ne(k.src[0].arg - 1)
    not_first = nf if not_first is None else not_first | nf
    not_last = nl if not_last is None else not_last | nl
  identity = UOp.const(red.dtype, 0.0 if red.arg is Ops.ADD else float("-inf"))
  before = not_first.where(UOp(Ops.LOAD, red.dtype, (idx, not_first)), identity)
  partial = UOp(red.arg, red.dtype, (before, val))
  if value is red: return store.replace(src=(idx, partial))
  final = substitute(value, {red: partial}, "opt.move")
  return store.replace(src=(idx, not_last.where(partial, final)))


# ---- dot products: a tile of outputs shares its loads ----
UPCAST = 4


def upcast_outputs(ctx: OptContext, sink: UOp) -> UOp | None:
  """A store of a reduction along contiguous memory (a dot product: x @ w.T, q @ k.T) computes a tile of UPCAST x
  UPCAST outputs at once: each output loop that some load does not depend on is split into loop*UPCAST + copy, and
  the copies, sharing the reduction loop, share the loads that do not move with them (hash-consing merges them)."""
  if not ctx.parallel or sink.arg == "linear" or any(n.op is Ops.RANGE and "up" in n.arg for n in sink.toposort): return None
  stores = []
  for st in sink.src:
    reduces = [n for n in st.src[1].toposort if n.op is Ops.REDUCE] if st.op is Ops.STORE else []
    tiled = _tile(st, reduces[0]) if len(reduces) == 1 else None
    stores += tiled if tiled else [st]
  return None if len(stores) == len(sink.src) else sink.replace(src=tuple(stores))


def _tile(st: UOp, red: UOp) -> list[UOp] | None:
  if red.arg is not Ops.ADD or not red.dtype.is_float or any(r.arg[0] != "reduce" for r in red.src[1:]): return None
  loads = [n.src[0].src[1] for n in red.src[0].toposort if n.op is Ops.LOAD]
  k = red.src[-1]
  if not any(_coefficient(i, k) == 1 for i in loads): return None
  outs = sorted((n for n in st.src[0].toposort if n.op is Ops.RANGE and n.arg[0] == "out"), key=nesting_key)
  chosen = [r for r in outs if r.src[0].arg % UPCAST == 0 and r.src[0].arg >= 2 * UPCAST and
            any(r not in i.toposort for i in loads)][-2:]
  if not chosen: return None
  split = {r: UOp(Ops.RANGE, r.dtype, (UOp.const(r.dtype, r.src[0].arg // UPCAST),), r.arg + ("up",)) for r in chosen}
  tiles = []
  for copies in itertools.product(range(UPCAST), repeat=len(chosen)):
    sub = {r: split[r] * UPCAST + c for r, c in zip(chosen, copies)}
    tiles.append(substitute(st, sub, "opt.upcast"))
  return tiles


@dataclass
class OptContext:
  parallel_threshold: int = 1 << 15   # iterations below which starting threads costs more than it saves
  parallel: bool = True               # a device whose loops become thread indices has no use for the mark


def mark_loops(ctx: OptContext, sink: UOp) -> UOp | None:
  if any(n.op is Ops.RANGE and len(n.arg) > 2 and n.arg[-1] in ("parallel", "simd", "serial") for n in sink.toposort): return None
  ranges = open_ranges(sink)
  marks: dict[UOp, str] = {}
  all_ranges = [n for n in sink.toposort if n.op is Ops.RANGE]
  for r in all_ranges:
    outer = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) < nesting_key(r)}
    if not outer and r.arg[0] == "out" and ctx.parallel and loop_work(r, ranges) >= ctx.parallel_threshold: marks[r] = "parallel"
  for red in (n for n in sink.toposort if n.op is Ops.REDUCE):
    rs = red.src[1:]
    inner_loops = {q for n, qs in ranges.items() if rs[-1] in qs for q in qs if nesting_key(q) > nesting_key(rs[-1])}
    if red.dtype.is_float and not inner_loops and red.arg in (Ops.ADD, Ops.MAX): marks[rs[-1]] = "simd"
  if not marks: marks = {all_ranges[0]: "serial"} if all_ranges else {}
  if not marks: return None
  swap = {r: r.replace(arg=r.arg + (m,)) for r, m in marks.items()}
  return substitute(sink, swap, "opt.mark")


opt_rules = PatternMatcher([
  (UPat(Ops.STORE, name="store", src=(UPat(Ops.INDEX, name="idx"), UPat.var("value"))), accumulate_in_memory),
  (UPat(Ops.SINK, name="sink"), upcast_outputs),
  (UPat(Ops.SINK, name="sink"), lambda ctx, sink: None if sink.arg == "linear" else mark_loops(ctx, sink)),
], name="opt")


def linear_order(sink: UOp) -> UOp | None:
  """The instruction list of a loop-level SINK (see the module docstring)."""
  if sink.arg == "linear": return None
  ranges = open_ranges(sink)
  def block_of(n: UOp) -> UOp | None: return max(ranges[n], key=nesting_key, default=None)
  # the loop each loop sits in: the deepest enclosing loop of any node inside it
  parent: dict[UOp, UOp | None] = {}
  for n, rs in ranges.items():
    for r in rs:
      outer = [q for q in rs if nesting_key(q) < nesting_key(r)]
      cand = max(outer, key=nesting_key, default=None)
      if r not in parent or (cand is not None and (parent[r] is None or nesting_key(cand) > nesting_key(parent[r]))): parent[r] = cand
  # reductions over the same loops share them (an unrolled tile of outputs): one loop, one accumulator each
  group_of: dict[UOp, tuple[UOp, ...]] = {}
  groups: dict[tuple[UOp, ...], list[UOp]] = {}
  for red in sink.toposort:
    if red.op is not Ops.REDUCE: continue
    groups.setdefault(red.src[1:], []).append(red)
    for r in red.src[1:]: group_of[r] = red.src[1:]
  body: dict[UOp | None, list[UOp]] = {None: []}
  for n in sink.toposort:
    if n.op in (Ops.CONST, Ops.SINK) or n.op is Ops.RANGE: continue
    body.setdefault(block_of(n), []).append(n)
  children: dict[UOp | None, list[UOp]] = {}
  for r in sorted(parent, key=nesting_key): children.setdefault(parent[r], []).append(r)

  out: list[UOp] = []
  opened: set[tuple[UOp, ...]] = set()
  emitted: set[UOp] = set()
  def emit_loop(r: UOp):
    out.append(r)
    emit_block(r)
    if r in group_of and r is group_of[r][-1]: out.extend(UOp(Ops.ASSIGN, red.dtype, (red,)) for red in groups[group_of[r]])
    out.append(UOp(Ops.END, src=(r,)))
  def emit_block(b: UOp | None):
    # loops of a reduction open where it is; another loop of the same reduction nests here; output loops come last
    later = [c for c in children.get(b, []) if c not in group_of or (b is not None and group_of.get(b) == group_of[c])]
    nodes = body.get(b, [])
    here = set(nodes)
    def emit(n: UOp):
      if n in emitted: return
      if n.op is Ops.REDUCE and n.src[1:] not in opened:
        opened.add(n.src[1:])
        # what any reduction of the group needs from this block comes before their shared loop (sources first)
        for red in groups[n.src[1:]]:
          for d in red.src[0].toposort:
            if d in here: emit(d)
        out.extend(UOp(Ops.DEFINE_ACC, red.dtype, (red,)) for red in groups[n.src[1:]])
        emit_loop(n.src[1])
      emitted.add(n)
      out.append(n)
    for n in nodes: emit(n)
    for c in later: emit_loop(c)
  emit_block(None)
  return UOp(Ops.SINK, sink.dtype, tuple(out), "linear")


linearize_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), linear_order)], name="linearize")
