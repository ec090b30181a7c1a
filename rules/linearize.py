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
from dataclasses import dataclass
from rewrite import UOp, UPat, PatternMatcher, Ops, graph_rewrite
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
  rename = PatternMatcher([(UPat(Ops.RANGE, name="r"), lambda r: moved.get(r))])
  val = graph_rewrite(red.src[0], rename, name="opt.move")
  idx, value = graph_rewrite(idx, rename, name="opt.move"), graph_rewrite(value, rename, name="opt.move")
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
  final = graph_rewrite(value, PatternMatcher([(UPat(Ops.REDUCE, name="x"), lambda x: partial if x is red else None)]), name="opt.move")
  return store.replace(src=(idx, not_last.where(partial, final)))


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
  return graph_rewrite(sink, PatternMatcher([(UPat(Ops.RANGE, name="r"), lambda r: swap.get(r))]), name="opt.mark")


opt_rules = PatternMatcher([
  (UPat(Ops.STORE, name="store", src=(UPat(Ops.INDEX, name="idx"), UPat.var("value"))), accumulate_in_memory),
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
  reduce_of = {r: red for red in sink.toposort if red.op is Ops.REDUCE for r in red.src[1:]}
  body: dict[UOp | None, list[UOp]] = {None: []}
  for n in sink.toposort:
    if n.op in (Ops.CONST, Ops.SINK) or n.op is Ops.RANGE: continue
    body.setdefault(block_of(n), []).append(n)
  children: dict[UOp | None, list[UOp]] = {}
  for r in sorted(parent, key=nesting_key): children.setdefault(parent[r], []).append(r)

  out: list[UOp] = []
  def emit_loop(r: UOp):
    out.append(r)
    emit_block(r)
    red = reduce_of.get(r)
    if red is not None and r is red.src[-1]: out.append(UOp(Ops.ASSIGN, red.dtype, (red,)))
    out.append(UOp(Ops.END, src=(r,)))
  def emit_block(b: UOp | None):
    # loops of a reduction open where it is; another loop of the same reduction nests here; output loops come last
    later = [c for c in children.get(b, []) if c not in reduce_of or (b is not None and reduce_of.get(b) is reduce_of[c])]
    for n in body.get(b, []):
      if n.op is Ops.REDUCE:
        out.append(UOp(Ops.DEFINE_ACC, n.dtype, (n,)))
        emit_loop(n.src[1])
      out.append(n)
    for c in later: emit_loop(c)
  emit_block(None)
  return UOp(Ops.SINK, sink.dtype, tuple(out), "linear")


linearize_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), linear_order)], name="linearize")
