"""A rows plan's runs as vectors: stage `opt_grid_vector` (kernel scope, `grid_vector_rules`, ctx: `VectorRuns`, its
index filled by `VectorRuns.index`, the stage's prepare).

A GPU rows plan with a `vector(-1, w)` record lays a lane's elements out in runs of w consecutive ones (rules/gpu.py
`lay_out_rows`); stage opt_grid unrolls them like the lane's other trips, and opt_grid_index folds their indices into
`base + c` (c = 0 .. w-1, every other term of `base` and its constant a multiple of w). This stage reads and writes
each such run at once: 16 bytes, one `ld.global.v4` / `st.global.v4` in place of four (fewer instructions for the
same bytes in flight: the memory-bound rows, softmax and layer norm, issue 23).

In: a kernel after the GPU and CPU opt stages, with scalar loads and stores of buffers. Out: where the plan has the
record, the float32 loads of one buffer at `base + 0 .. base + w-1` (all w of them present, ungated) are the lanes of
one vector load at `base` (`GEP(LOAD(float32.vec(w)), c)`; hash-consing makes the w loads one node), and the stores of
one buffer at `base + 0 .. w-1` with one gate (or none) are one store of the `VECTORIZE` of their w values. Values are
unchanged. Alignment: `base` is a multiple of w elements from the buffer's start, and a buffer is its own cuMemAlloc
(256-byte aligned; a view's offset is part of the index), so each vector is 16-byte aligned. Anything else (other
dtypes, a run that is not whole, a clamped index past a size that does not divide) stays scalar.

The index (prepare) finds the whole runs once; the rules are per node: a load of a run becomes its lane of the run's
vector load, the store of a run's place 0 becomes the run's vector store, and the others become an empty SINK, which
`splice_sinks` drops from the kernel's list (the store keys are the target INDEX and gate, which this stage's
rewrites of float loads leave as they are).
"""
from __future__ import annotations
from collections import defaultdict
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, splice_sinks
from .symbolic import terms_of, sum_of
from .opt.plan import OptContext, is_tile_plan


def run_start(idx: UOp, w: int) -> tuple[frozenset, UOp, int] | None:
  """(key, base, c) where idx = base + c, 0 <= c < w, and every term of base and its constant are multiples of w;
  the key is base's terms as a set (one base written two ways by the index rules has one key)."""
  coef: dict[UOp | None, int] = defaultdict(int)
  for t, k in terms_of(idx): coef[t] += k
  if any(k % w for t, k in coef.items() if t is not None): return None
  c = coef.pop(None, 0)
  coef[None] = c - c % w
  key = frozenset((t, k) for t, k in coef.items() if k)
  return key, sum_of(idx.dtype, [(t, k) for t, k in coef.items() if t is not None and k] + [(None, coef[None])]), c % w


def plain_access(x: UOp) -> tuple[UOp, UOp] | None:
  """(buffer, index) of an ungated float32 load, or of a store's target, in a buffer of the kernel's arguments."""
  i = x.src[0]
  if i.op is not Ops.INDEX or len(i.src) != 2 or i.src[0].op is not Ops.DEFINE_GLOBAL: return None
  return i.src[0], i.src[1]


def runs(accesses: list[tuple[UOp, tuple, UOp]], w: int) -> list[tuple[UOp, dict[int, UOp]]]:
  """Accesses (node, key, index) grouped into whole runs: (base, {place in the run: node}) for each key and base whose
  w places are all there."""
  found: dict[tuple, tuple[UOp, dict[int, UOp]]] = {}
  for node, key, idx in accesses:
    if (start := run_start(idx, w)) is not None: found.setdefault((key, start[0]), (start[1], {}))[1][start[2]] = node
  return [(base, places) for base, places in found.values() if len(places) == w]


def at(x: UOp, base: UOp) -> UOp:
  """x's INDEX moved to `base`."""
  return x.src[0].replace(src=(x.src[0].src[0], base))


@dataclass
class VectorRuns:
  """The stage's context: the kernel's plan (the opt stages'), and the whole runs of its loads and stores: each load
  of one as its lane of the run's vector load; each store of one, by its target INDEX and gate, as the run's vector
  store (place 0) or None (the other places, which go)."""
  opt: OptContext | None
  loads: dict[UOp, UOp] = field(default_factory=dict)
  stores: dict[tuple, UOp | None] = field(default_factory=dict)

  def index(self, sink: UOp) -> None:
    from .gpu import run_length
    if self.opt is None or is_tile_plan(self.opt.plan) or (w := run_length(self.opt.plan)) == 1: return
    loads = [(n, a[0], a[1]) for n in sink.toposort if n.op is Ops.LOAD and len(n.src) == 1 and n.dtype is dtypes.float32
             and (a := plain_access(n)) is not None]
    for base, places in runs(loads, w):
      vector = UOp(Ops.LOAD, dtypes.float32.vec(w), (at(places[0], base),))
      self.loads.update({ld: UOp(Ops.GEP, ld.dtype, (vector, UOp.const(dtypes.index, c))) for c, ld in places.items()})
    stores = [(st, (a[0], st.src[2:]), a[1]) for st in sink.src if st.op is Ops.STORE and st.src[1].dtype is dtypes.float32
              and (a := plain_access(st)) is not None]
    for base, places in runs(stores, w):
      first = places[0]
      value = UOp(Ops.VECTORIZE, dtypes.float32.vec(w), tuple(places[c].src[1] for c in range(w)))
      self.stores.update({(st.src[0], st.src[2:]): None for st in places.values()})
      self.stores[(first.src[0], first.src[2:])] = first.replace(src=(at(first, base), value, *first.src[2:]))


def vector_store(ctx: VectorRuns, st: UOp) -> UOp | None:
  """A run's store at place 0: the run's vector store; at another place: nothing (an empty SINK, spliced away)."""
  if st.src[1].dtype.count > 1 or (key := (st.src[0], st.src[2:])) not in ctx.stores: return None   # (the vector store itself)
  return UOp(Ops.SINK) if (vector := ctx.stores[key]) is None else vector


grid_vector_rules = PatternMatcher([
  (UPat(Ops.LOAD, name="ld"), lambda ctx, ld: ctx.loads.get(ld)),
  (UPat(Ops.STORE, name="st"), vector_store),
  (UPat(Ops.SINK, name="node"), splice_sinks),   # the stores of a run's other places, gone
], name="opt_grid_vector")
