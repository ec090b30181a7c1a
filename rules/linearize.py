"""Linearization of a lowered kernel (its loops already shaped by the opt stages, rules/opt).

Stage `linearize` (rule set `linearize_rules`): the loop-level graph `SINK(STORE...)` becomes `SINK` of an ordered
instruction list, arg "linear": each loop is `RANGE ... END(RANGE)`, each node comes after its sources and inside
exactly the loops whose indices it uses (so loop-invariant work is hoisted), and each `REDUCE` becomes
`DEFINE_ACC(REDUCE)` before its loops, `ASSIGN(REDUCE)` (acc = acc op value) at the end of its innermost loop, and
the REDUCE itself (its result) after the loops.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops


def open_ranges(sink: UOp) -> dict[UOp, frozenset[UOp]]:
  """For each node, the loops it lies inside: the RANGEs it depends on, less those its REDUCEs closed (and the BARRIERs
  that say a packed buffer is filled, rules/opt/pack.py: `BARRIER(buffer, fill store, *fill loops)`)."""
  out: dict[UOp, frozenset[UOp]] = {}
  for n in sink.toposort:
    if n.op is Ops.RANGE: out[n] = frozenset({n}); continue
    rs = frozenset().union(*(out[s] for s in n.src)) if n.src else frozenset()
    if n.op is Ops.REDUCE or n.op is Ops.BARRIER: rs = rs - set(n.src[1:])
    out[n] = rs
  return out


def nesting_key(r: UOp) -> tuple:
  """Output loops nest outside reduction loops; within each kind, by (level, position): the kernel's own loops have
  level 0 and nest in axis order (reductions in order of creation); the opt stages (rules/opt) give a loop moved
  outward level -1, the inner loops of a tiling levels 1, 2, ..., and the loops filling a packed buffer a position
  just before the loop they serve (the arg's position is then a tuple (level, position, ...))."""
  kind, pos = r.arg[0], r.arg[1]
  return (1 if kind == "reduce" else 0, *(pos if isinstance(pos, tuple) else (0, pos)))


def loop_work(r: UOp, ranges: dict[UOp, frozenset[UOp]]) -> int:
  """Iterations of r and every loop nested in it."""
  work = r.src[0].arg
  inner = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) > nesting_key(r)}
  for q in inner: work *= q.src[0].arg
  return work


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
