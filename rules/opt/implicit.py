"""Implicit products on a GPU (stage `implicit_product`, kernel scope, GPU only, after `tensor_core`): a convolution
is a product whose rows are several loops and whose reduction is several loops; this stage makes each one loop, so
that the GPU's product tiles (rules/opt/gpu_tile.py) take it as they take `a @ b`.

Contract. In: a lowered kernel, not planned yet, whose one store holds one float sum over two or more loops of a
product of two factors, one of which (A, the windows of the input) moves with two or more output loops that the
other (B, the filters) does not, and the other with exactly one (j, the output channel) that A does not, placed
after A's first (NCHW: n, then o, then oh and ow). Out: the same kernel over a loop R of A's row loops' product, in
their row-major order, at the place of the first of them, and a loop K of the reduction loops' product: each old loop
is the flat loop's value split back (`R // (OH*OW)`, `R // OW % OH`, `R % OW`), so every load and the store read and
write what they did. The tile plan then stages A's tile in shared memory with each element's index gathered through
those splits (no im2col buffer), and runs the epilogue (bias, activation) on each register before its store.
Other kernels are left alone; a kernel on tensor cores (its SPECIALs) is planned already, as is a strict float32
convolution whose sizes divide an FMA tile (rules/opt/tensor_core.py `TileSpec.fma`): this stage takes the others.
"""
from __future__ import annotations
import math
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, substitute
from .plan import Plan, kernel_axes
from .pack import split_flat


def flatten_implicit_product(sink: UOp) -> UOp | None:
  if sink.arg == "linear" or isinstance(sink.arg, Plan) or len(sink.src) != 1 or (st := sink.src[0]).op is not Ops.STORE: return None
  if any(n.op in (Ops.SPECIAL, Ops.BARRIER, Ops.MMA) for n in sink.toposort): return None
  reds = [n for n in st.src[1].toposort if n.op is Ops.REDUCE]
  if len(reds) != 1 or (red := reds[0]).arg is not Ops.ADD or not red.dtype.is_float or red.src[0].op is not Ops.MUL: return None
  ks = list(red.src[1:])
  outs = [r for r in kernel_axes(sink) if r.arg[0] == "out"]
  for fa, fb in (red.src[0].src, reversed(red.src[0].src)):
    rows = [r for r in outs if r in fa.toposort and r not in fb.toposort]
    js = [r for r in outs if r in fb.toposort and r not in fa.toposort]
    if len(rows) >= 2 and len(js) == 1 and outs.index(js[0]) > outs.index(rows[0]): break
  else: return None
  if len(ks) < 2 or any(k not in fa.toposort or k not in fb.toposort for k in ks): return None
  size = lambda r: r.src[0].arg
  flat_rows = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, math.prod(map(size, rows))),), ("out", rows[0].arg[1], "implicit rows"))
  flat_k = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, math.prod(map(size, ks))),), ("reduce", ks[0].arg[1]))
  at = dict(zip(rows + ks, split_flat(flat_rows, [size(r) for r in rows]) + split_flat(flat_k, [size(k) for k in ks])))
  product = UOp(Ops.REDUCE, red.dtype, (substitute(red.src[0], at), flat_k), red.arg)
  return sink.replace(src=(substitute(substitute(st, {red: product}), at),))


implicit_product_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), flatten_implicit_product)], name="implicit_product")
