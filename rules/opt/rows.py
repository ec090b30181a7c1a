"""One-pass rows on the CPU: which row reductions a reader's kernel computes itself (the gpu_fuse stage's decision,
rules/gpu.py, with the CPU's limits; one mechanism on both devices).

Inlined, a softmax or a layer norm is one kernel whose threads take rows: each row is read from memory once (the max,
or the mean), then again from cache (the sum, the variance, the normalized output), where three kernels read it
from memory three times and write and read back the row statistics in between. On a GPU a row's lanes hold it in
registers, of any length. On the CPU a row must stay in a core's cache between its passes, and the rows are the only
parallel loop of the fused kernel, so `cpu_rows_fit(reductions)` admits a reduction only where
- its rows are at least MIN_ROWS (threads have work; a full reduction, one row, keeps its parallel reader), and
- one row of everything it reads, `row elements x (bytes of an element of each buffer it reads)`, is at most
  ROW_CACHE_BYTES (a core's share of L2 on the machines we run on).

A row's value computed in two passes is computed once (stage `opt_pack`, rule set `row_value_rules`, CPU only): where
a kernel's store reads a value f(c) along its innermost output loop c and also sums f(k) over a reduction loop k of
the same length (softmax's `exp(x - max)`: summed, then divided by the sum), and f calls a transcendental function
(exp2, log2, sin: the costly part), f is stored once per row in a local buffer (`DEFINE_LOCAL`, at most
ROW_VALUE_BYTES) by a fill loop of its own, and both the sum and the store read it back from cache. Values are
unchanged (the same operations on the same operands). In: a lowered kernel before the upcast and vector stages. Out:
the same kernel, the sum's value and the store's f(c) as loads of `BARRIER(buffer, fill store, fill loop)`
(rules/opt/pack.py's form of a filled buffer: the linearizer runs the fill loop, whole, before the first read).
"""
from __future__ import annotations
import math
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, substitute
from rules.shapes import shape_of
from rules.linearize import nesting_key, open_ranges
from .upcast import at_values

MIN_ROWS = 16
ROW_CACHE_BYTES = 256 << 10
ROW_VALUE_BYTES = 64 << 10   # a row's local copy lives on the stack of its thread, beside the L1-resident row
TRANSCENDENTAL = (Ops.EXP2, Ops.LOG2, Ops.SIN)


def _buffers_read(value: UOp) -> list[UOp]:
  return list(dict.fromkeys(n for n in value.toposort if n.op is Ops.BUFFER))


def cpu_rows_fit(reductions: list[UOp]) -> bool:
  for red in reductions:
    shape, axes = shape_of(red.src[0]), red.arg[1]
    row = math.prod(shape[a] for a in axes)
    rows = math.prod(shape) // max(row, 1)
    if rows < MIN_ROWS or row * sum(b.dtype.itemsize for b in _buffers_read(red.src[0])) > ROW_CACHE_BYTES: return False
  return True


def compute_row_value_once(ctx, st: UOp) -> UOp | None:
  if ctx.device_loops or len(st.src) != 2: return None
  value = st.src[1]
  outs = [n for n in st.src[0].toposort if n.op is Ops.RANGE and n.arg[0] == "out"]
  if not outs: return None
  c = max(outs, key=nesting_key)
  for red in (n for n in value.toposort if n.op is Ops.REDUCE and n.arg is Ops.ADD and len(n.src) == 2):
    f, k = red.src
    n = k.src[0].arg
    if k.src[0] is not c.src[0] or f.dtype.count != 1: continue
    # (a value read from a filled buffer is done: its fill, under the BARRIER, calls the function)
    if not any(u.op in TRANSCENDENTAL for u in f.toposort) or any(u.op is Ops.BARRIER for u in f.toposort): continue
    if n * f.dtype.itemsize > ROW_VALUE_BYTES or (g := at_values(f, {k: c})) not in value.toposort: continue
    # the loops the row lives in: those f depends on besides k (a head, a row); the buffer is declared in the
    # innermost, the fill loop nests first inside it
    around = sorted(open_ranges(f)[f] - {k}, key=nesting_key)
    if not around or c in around: continue
    at = nesting_key(around[-1])[1:]
    fill_loop = UOp(Ops.RANGE, k.dtype, k.src, ("pack", (*at, 0), k.arg))
    local = UOp(Ops.DEFINE_LOCAL, f.dtype.ptr("local"), (around[-1],), (ctx.next_local(), n))
    fill = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, local.dtype, (local, fill_loop)), at_values(f, {k: fill_loop})))
    filled = UOp(Ops.BARRIER, local.dtype, (local, fill, fill_loop))
    read = lambda i: UOp(Ops.LOAD, f.dtype, (UOp(Ops.INDEX, local.dtype, (filled, i)),))
    new_value = substitute(value, {g: read(c), red: red.replace(src=(read(k), k))})
    return st.replace(src=(st.src[0], new_value))
  return None


row_value_rules = PatternMatcher([
  (UPat(Ops.STORE, name="st"), compute_row_value_once),
], name="opt_rows")
