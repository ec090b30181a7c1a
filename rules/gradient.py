"""Gradients as rules: reverse-mode differentiation of the tensor-level graph (docs/design.md, "The tensor-level graph").

Contract of a gradient rule set (`gradient_rules`, and any rule set a user places before it): a rule matches a node
of the tensor-level graph and is called with `ctx` = the gradient of the loss with respect to that node (a node of
the node's shape and dtype); it returns the gradient with respect to each of the node's sources, a tuple in source
order (None: no gradient flows into that source, an integer or a condition, say), or a dict from nodes below the
node to their gradients (a rule for a composition of several primitives: the gradient skips the nodes between).
Every primitive op has a rule; a composition (matmul, softmax, layernorm, gelu) needs none.

`gradients(root, root_grad, targets)` is the reverse walk: over the nodes between `root` and the targets, latest
first, it applies the rules and sums the gradients of a node read by several others. It runs the rule sets of the
pipeline's "gradient" scope in order (the first rule that answers wins), so `pipeline.insert("gradient", my_rules,
where="before")` gives an op of a user's its own gradient (docs/rules.md); REWRITE_STATS counts it like any stage.
Only floating-point nodes carry gradients: a path through an integer or bool node (a comparison, a cast to int) is
cut there, as in torch.
"""
from __future__ import annotations
import contextlib, math
from rewrite import UOp, UPat, PatternMatcher, Ops, DType, rewrite_each, substitute
from .shapes import shape_of
from .realize import holds_reduction, expands, is_constant
from .strided_view import View, contiguous_strides

LN_2 = math.log(2)


# ---- building tensor-level nodes (shapes are derived, not stored: every helper keeps sources of one shape) ----
def const_like(u: UOp, value, dtype: DType | None = None) -> UOp:
  """The constant `value` in u's shape (VIEW(CONST) with strides 0, the graph's form of a broadcast constant)."""
  shape = shape_of(u)
  dtype = dtype or u.dtype
  return UOp(Ops.VIEW, dtype, (UOp.const(dtype, value),), View(shape, (0,) * len(shape)))


def move(u: UOp, fn) -> UOp:
  """u moved by `fn` (a View -> View movement, None where no single View can say it): onto u's own VIEW when one View
  says both, else a VIEW on top of u's contiguous layout. The front end's movements do the same (tensor/movement.py)."""
  shape = shape_of(u)
  stacked = fn(View.contiguous(shape))
  if stacked.is_contiguous and stacked.shape == shape: return u
  if u.op is Ops.VIEW and (merged := fn(u.arg)) is not None:
    src = u.src[0]
    if merged.is_contiguous and src.op not in (Ops.BUFFER, Ops.CONST) and shape_of(src) == merged.shape: return src
    return UOp(Ops.VIEW, u.dtype, (src,), merged)
  return UOp(Ops.VIEW, u.dtype, (u,), stacked)


def reshape(u: UOp, shape) -> UOp: return move(u, lambda v: v.reshape(tuple(shape)))
def expand(u: UOp, shape) -> UOp: return move(u, lambda v: v.expand(tuple(shape)))
def permute(u: UOp, order) -> UOp: return move(u, lambda v: v.permute(tuple(order)))
def flip(u: UOp, axes) -> UOp: return move(u, lambda v: v.flip(tuple(axes))) if axes else u
def pad(u: UOp, padding) -> UOp: return u if not any(b or a for b, a in padding) else move(u, lambda v: v.pad(tuple(padding)))
def shrink(u: UOp, bounds) -> UOp: return move(u, lambda v: v.shrink(tuple(bounds)))


def sum_axes(u: UOp, axes, kept: list[int] | None = None) -> UOp:
  """u summed over `axes`, which are dropped; the other axes stay in their order, or in the order `kept` lists them.
  The summed axes are moved last and merged: a product of two views summed that way (the gradient of a matmul's
  operand: a contraction of two stored operands) is a matrix product over one axis, the form a library gemm takes,
  and it is stored by a kernel of its own, in the order of `kept`."""
  shape = shape_of(u)
  axes = sorted(set(axes))
  if not axes: return u if kept is None else permute(u, kept)
  kept = [d for d in range(len(shape)) if d not in axes] if kept is None else list(kept)
  out_shape = tuple(shape[d] for d in kept)
  if all(shape[d] == 1 for d in axes): return reshape(permute(u, kept + axes), out_shape)
  order, merged = kept + axes, (*out_shape, math.prod(shape[d] for d in axes))
  if u.op is Ops.MUL and all(s.op is Ops.VIEW for s in u.src):   # moved in its operands: they stay single views
    moved = u.replace(src=tuple(reshape(permute(s, order), merged) for s in u.src))
    red = UOp(Ops.CONTIGUOUS, u.dtype, (UOp(Ops.REDUCE_AXIS, u.dtype, (moved,), (Ops.ADD, (len(kept),))),))
  else: red = UOp(Ops.REDUCE_AXIS, u.dtype, (reshape(permute(u, order), merged),), (Ops.ADD, (len(kept),)))
  return reshape(red, out_shape)


def broadcast_back(g: UOp, shape) -> UOp:
  """g (a reduction's shape: 1 on the reduced axes) expanded to `shape`."""
  return expand(g, shape)


# ---- the gradient of a view: the transpose of a strided read ----
def unview(g: UOp, view: View, src_shape: tuple[int, ...]) -> UOp:
  """The gradient with respect to the source of `view` (of shape src_shape, read through its contiguous layout) of g,
  the gradient with respect to the view: each source element receives the sum of g over every index that reads it.

  Built from movements and sums only: the masked part reads nothing (shrink g to the mask), stride-0 axes read one
  element many times (sum them), negative strides read backwards (flip). What is left reads `offset + sum(i * st)`
  with positive strides; placed innermost first, each axis lays its s rows of the length L built so far at stride st:
  rows that do not overlap (st >= L) are padded to st and joined by a reshape; rows that overlap (a convolution's
  windows) are padded so that a reshape shifts row r by r*st, then summed. The flat result is padded to the source."""
  n = math.prod(src_shape)
  if view.size == 0 or view.is_padding: return reshape(const_like(g, 0.0) if not shape_of(g) else _zeros(g, (n,)), src_shape)
  if view.mask is not None:
    g, view = shrink(g, view.mask), view.shrink(view.mask)
  zero = [d for d, st in enumerate(view.strides) if st == 0]
  # the other axes in the order they lie in the source's memory (largest stride first): a summed gradient (a weight's,
  # read by a product through a transpose) is stored in the source's layout, and what reads it (an optimizer's update)
  # reads it in order, not transposed with a stride per element
  keep = sorted((d for d, st in enumerate(view.strides) if st != 0), key=lambda d: -abs(view.strides[d]))
  if zero: g, view = sum_axes(g, zero, keep), view.permute(tuple(keep + zero))
  keep = [d for d, st in enumerate(view.strides) if st != 0]
  shape, strides, offset = [view.shape[d] for d in keep], [view.strides[d] for d in keep], view.offset
  neg = [i for i, st in enumerate(strides) if st < 0]
  g = flip(g, neg)
  for i in neg: offset += (shape[i] - 1) * strides[i]; strides[i] = -strides[i]
  order = sorted(range(len(strides)), key=lambda i: -strides[i])
  g = permute(g, order)
  shape, strides = [shape[i] for i in order], [strides[i] for i in order]
  if offset == 0 and math.prod(shape) == n and tuple(strides) == contiguous_strides(tuple(shape)):
    return reshape(g, src_shape)   # a read of the whole source in some order (a reshape, a permutation): laid out now
  # g: (*shape[:d + 1], *block) before axis d is laid out; the block holds the source's positions base + [0, its size)
  g, block, base = reshape(g, (*shape, 1)), (1,), offset
  for d in reversed(range(len(shape))):
    s, st, outer = shape[d], strides[d], tuple(shape[:d])
    nd, length = len(outer), math.prod(block)
    at = base % st
    if st == length:  # rows that meet: the axis joins the block as a dimension of its own (no index arithmetic)
      block = (s, *block)
      continue
    g = reshape(g, (*outer, s, length))   # (the block as one dimension)
    if st > length and at + length <= st and base - at + s * st <= n:
      # rows apart, each padded to the stride with the block at its place in it: the axis and the row stay two
      # dimensions (a q, k or v read out of a (B, T, 3*W) projection: its gradient is a pad of the last axis)
      g = pad(g, ((0, 0),) * (nd + 1) + ((at, st - length - at),))
      block, base = (s, st), base - at
      continue
    if st >= length:  # rows apart: pad each to the stride, join them
      g = pad(g, ((0, 0),) * (nd + 1) + ((0, st - length),))
      g = reshape(g, (*outer, s * st))
      g = shrink(g, tuple((0, x) for x in outer) + ((0, (s - 1) * st + length),))
    else:  # overlapping rows: in rows of length P = T + st, row r starts at r*P; read as rows of T it starts at r*st
      total = (s - 1) * st + length
      g = pad(g, ((0, 0),) * (nd + 1) + ((0, total + st - length),))
      g = reshape(g, (*outer, s * (total + st)))
      g = shrink(g, tuple((0, x) for x in outer) + ((0, s * total),))
      g = sum_axes(reshape(g, (*outer, s, total)), [nd])
    block = ((s - 1) * st + length,)
  length = math.prod(block)
  if base == 0 and length == n: return reshape(g, src_shape)
  g = pad(reshape(g, (length,)), ((base, n - base - length),))
  return reshape(g, src_shape)


def _zeros(like: UOp, shape) -> UOp:
  return UOp(Ops.VIEW, like.dtype, (UOp.const(like.dtype, 0.0),), View(tuple(shape), (0,) * len(shape)))


# ---- the rules: ctx is the incoming gradient, the result the gradients of the sources ----
def _max_grad(ctx: UOp, node: UOp):
  # ties share the gradient equally (torch's maximum and amax)
  a, b = kept(node.src[0]), kept(node.src[1])
  half = ctx * const_like(ctx, 0.5)
  zero = const_like(ctx, 0.0)
  a_wins, b_wins = b < a, a < b
  return (a_wins.where(ctx, b_wins.where(zero, half)), b_wins.where(ctx, a_wins.where(zero, half)))


def _reduce_grad(ctx: UOp, node: UOp):
  op, axes = node.arg
  x = node.src[0]
  shape = shape_of(x)
  g = broadcast_back(ctx, shape)
  if op is Ops.ADD: return (g,)
  if op is not Ops.MAX: return None
  # the maximum's gradient goes to every element equal to it, shared equally among them (torch's amax)
  hit = kept(x).ne(broadcast_back(kept(node), shape)).ne(True)
  ones = hit.where(const_like(x, 1.0), const_like(x, 0.0))
  count = UOp(Ops.REDUCE_AXIS, x.dtype, (ones,), (Ops.ADD, axes))
  return (ones * broadcast_back(ctx / count, shape),)


def _view_grad(ctx: UOp, node: UOp):
  src = node.src[0]
  if src.op is Ops.CONST: return (None,)
  return (unview(ctx, node.arg, shape_of(src)),)


def _sin_grad(ctx: UOp, x: UOp):
  h = UOp(Ops.SIN, x.dtype, (kept(x) * const_like(x, 0.5),))
  return (ctx * (const_like(x, 1.0) - const_like(x, 2.0) * h * h),)   # cos x = 1 - 2 sin^2(x/2), as tensor cos


def _sigmoid_grad(ctx: UOp, node: UOp, x: UOp, c: UOp):
  # s = 1 / (1 + 2^(c x)): ds/dx = -s^2 2^(c x) c ln2 = -s (1 - s) c ln2. Through the primitives one at a time, 2^(c x)
  # overflows to inf where s is 0, and the chain rule meets 0 * inf (NaN in the gradient of a saturated tanh or gelu)
  s = kept(node)
  return {x: ctx * s * (const_like(node, 1.0) - s) * const_like(node, -c.arg * LN_2)}


def _stored(u: UOp) -> UOp:
  """u as a buffer: itself when it is one (or a constant), else CONTIGUOUS(u)."""
  if u.op is Ops.CONTIGUOUS or (u.op is Ops.VIEW and u.src[0].op in (Ops.BUFFER, Ops.CONST)): return u
  if u.op is Ops.VIEW and u.src[0].op is Ops.CONTIGUOUS: return u
  return UOp(Ops.CONTIGUOUS, u.dtype, (u,))


def _stored_view(u: UOp) -> UOp:
  """u read from a buffer: a view keeps its View over its stored source."""
  if u.op is Ops.VIEW: return u if u.src[0].op in (Ops.BUFFER, Ops.CONST, Ops.CONTIGUOUS) else u.replace(src=(_stored(u.src[0]),))
  return _stored(u)


_holds: dict[UOp, bool] = {}   # _holds_reduction's answers during one gradients() walk (cleared after: it holds graphs)


def _holds_reduction(u: UOp) -> bool:
  """u is computed (not read from a buffer or a copy) from a reduction through elementwise ops and views."""
  return holds_reduction(u, _holds, lambda n: n.op in (Ops.BUFFER, Ops.CONTIGUOUS, Ops.COPY))


def kept(u: UOp) -> UOp:
  """A forward value a gradient reads, each reduction it is computed from (a product's output, a norm's mean) read
  from a buffer: the backward kernels that read it recompute only its elementwise part over those buffers (it fuses
  into them) and never the product again, and the forward pass stores the reductions, not every value between them
  and the gradient (a GELU's backward reads four of its intermediates: stored, they were four more buffers)."""
  if not _holds_reduction(u): return u
  return substitute(u, {r: _stored(r) for r in _inline_reductions(u)}, opaque=lambda n: not _holds_reduction(n))


def _inline_reductions(u: UOp) -> list[UOp]:
  """The reductions u computes itself: reached through elementwise ops and views, not behind a buffer."""
  out, seen, stack = [], set(), [u]
  while stack:
    n = stack.pop()
    if n in seen or not _holds_reduction(n): continue
    seen.add(n)
    if n.op is Ops.REDUCE_AXIS: out.append(n)
    else: stack.extend(n.src)
  return out


def _contraction_grad(ctx: UOp, node: UOp, m: UOp):
  # sum(x * y) over axes (a matrix product, an embedding's one-hot sum): each operand's gradient is the other times
  # the broadcast gradient, summed back by the views' rules. Both factors are read from buffers (the gradient stored
  # once, the forward operand stored again if it was computed inline), so the gradient is a product of two buffers:
  # the form a library gemm takes, and a layout the kernel planner tiles
  if node.arg[0] is not Ops.ADD: return None
  g = expand(_stored(ctx), shape_of(m))
  if m.op is Ops.MUL:
    x, y = m.src
    if x is y: return None
    # an operand computed from a product (a GELU's input) stores that product, as `kept` does for the GELU's own
    # gradient: one buffer of it, which the operand's kernel reads, not a second product computed inline
    return {x: g * _stored_view(kept(y)), y: g * _stored_view(kept(x))}
  c, x, zero = m.src   # WHERE(c, x, 0): the one-hot pick; its gradient is the one-hot (stored as 0/1) times g
  if not (is_constant(zero) and zero.src[0].arg == 0): return None
  if not (x.op is Ops.VIEW and expands(x.arg)):
    # x is not broadcast (a gather's, cross-entropy's pick of one logit per row): its gradient is elementwise, the
    # incoming gradient where the pick hit; no product follows, so nothing is stored
    return {x: c.where(expand(ctx, shape_of(m)), const_like(m, 0.0))}
  # the one-hot as 0/1 in x's dtype, stored at its own shape (c is usually a broadcast of a smaller comparison)
  src, view = (c.src[0], c.arg) if c.op is Ops.VIEW else (c, None)
  hits = _stored(src.where(const_like(src, 1.0, x.dtype), const_like(src, 0.0, x.dtype)))
  return {x: g * (hits if view is None else UOp(Ops.VIEW, x.dtype, (hits,), view))}


_constant = UPat(Ops.VIEW, src=(UPat.cvar("c"),))
_one = UPat(Ops.VIEW, src=(UPat.cvar(arg=1.0),))

gradient_rules = PatternMatcher([
  # the sigmoid as the front end builds it (tensor/elementwise.py), as one op: its gradient never overflows
  (UPat(Ops.RECIP, name="node", src=(UPat(Ops.ADD, src=[UPat(Ops.EXP2, src=(UPat(Ops.MUL, src=[UPat.var("x"), _constant]),)),
                                                        _one]),)), _sigmoid_grad),
  (UPat(Ops.ADD, name="node"), lambda ctx, node: (ctx, ctx), "grad_add"),
  # (a constant operand has no gradient, so none is made for it: `kept` of the other operand walks that operand's graph,
  # and x * 1.0001 at every step of a deep chain made the backward quadratic)
  (UPat(Ops.MUL, name="node", src=(UPat.var("a"), UPat.var("b"))),
   lambda ctx, node, a, b: (None if is_constant(a) else ctx * kept(b), None if is_constant(b) else ctx * kept(a)),
   "grad_mul"),
  (UPat(Ops.MULACC, name="node"), lambda ctx, node: (ctx * node.src[1], ctx * node.src[0], ctx), "grad_mulacc"),
  (UPat(Ops.NEG), lambda ctx: (-ctx,), "grad_neg"),
  (UPat(Ops.FDIV, src=(UPat.var("a"), UPat.var("b"))),
   lambda ctx, a, b: (ctx / kept(b), None if is_constant(b) else -(ctx * kept(a)) / (kept(b) * kept(b))), "grad_fdiv"),
  (UPat(Ops.RECIP, name="node"), lambda ctx, node: (-(ctx * kept(node) * kept(node)),), "grad_recip"),
  (UPat(Ops.SQRT, name="node"), lambda ctx, node: (ctx / (kept(node) * const_like(node, 2.0)),), "grad_sqrt"),
  (UPat(Ops.EXP2, name="node"), lambda ctx, node: (ctx * kept(node) * const_like(node, LN_2),), "grad_exp2"),
  (UPat(Ops.LOG2, src=(UPat.var("x"),)), lambda ctx, x: (ctx / (kept(x) * const_like(x, LN_2)),), "grad_log2"),
  (UPat(Ops.SIN, src=(UPat.var("x"),)), _sin_grad),
  (UPat(Ops.MAX, name="node"), _max_grad),
  # piecewise constant: no gradient (torch's floor, round, comparisons); integer ops never carry one
  (UPat((Ops.TRUNC, Ops.CMPLT, Ops.CMPNE, Ops.IDIV, Ops.MOD, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR, Ops.BITCAST),
        name="node"), lambda node: (None,) * len(node.src), "no_gradient"),
  (UPat(Ops.WHERE, src=(UPat.var("c"), UPat(), UPat())),
   lambda ctx, c: (None, kept(c).where(ctx, const_like(ctx, 0.0)), kept(c).where(const_like(ctx, 0.0), ctx)), "grad_where"),
  (UPat(Ops.CAST, src=(UPat.var("x"),)), lambda ctx, x: (ctx.cast(x.dtype) if x.dtype.is_float else None,), "grad_cast"),
  (UPat(Ops.REDUCE_AXIS, name="node", src=(UPat((Ops.MUL, Ops.WHERE), name="m"),)), _contraction_grad),
  (UPat(Ops.REDUCE_AXIS, name="node"), _reduce_grad),
  (UPat(Ops.VIEW, name="node"), _view_grad),
  (UPat(Ops.CONTIGUOUS), lambda ctx: (ctx,), "grad_contiguous"),
  (UPat(Ops.DETACH), lambda: (None,), "detached"),
  (UPat(Ops.COPY, name="node"), lambda ctx, node: (UOp(Ops.COPY, ctx.dtype, (ctx,), (node.arg[1], node.arg[0])),), "grad_copy"),
  (UPat(Ops.ASSIGN), lambda ctx: (None, ctx), "grad_assign"),
], name="gradient")


class GradientError(RuntimeError):
  """A node on the path from the loss to a target that no gradient rule answers for."""


def _stages() -> list[tuple[str, PatternMatcher]]:
  from .pipeline import pipeline
  return [(s.name, s.rules) for s in pipeline if s.scope == "gradient"]


def gradients(root: UOp, root_grad: UOp, targets: list[UOp]) -> list[UOp | None]:
  """The gradient of `root` (seeded with `root_grad`, of root's shape) with respect to each target (None for a target
  the root does not depend on through floating-point nodes). Targets are nodes of root's graph."""
  order = list(root.toposort)  # sources before users
  wanted = set(targets)
  on_path: set[UOp] = set()
  for n in order:
    if n in wanted or (n.dtype.is_float and n.op is not Ops.DETACH and any(s in on_path for s in n.src)): on_path.add(n)
  grads: dict[UOp, UOp] = {root: root_grad} if root in on_path else {}
  with contextlib.ExitStack() as stack:
    stack.callback(_holds.clear)
    rewrites = [stack.enter_context(rewrite_each(rules, name, len(order))) for name, rules in _stages()]
    for n in reversed(order):
      if (g := grads.get(n)) is None or not n.src or not any(s in on_path for s in n.src): continue
      result = next((r for rewrite in rewrites if (r := rewrite(n, g)) is not None), None)
      if result is None:
        raise GradientError(f"no gradient rule for {n.op} (dtype {n.dtype.name}) on the path from the loss to a "
                            f"target; add one to the 'gradient' stage (docs/rules.md)")
      pairs = result.items() if isinstance(result, dict) else zip(n.src, result)
      for s, sg in pairs:
        if sg is None or s not in on_path: continue
        grads[s] = grads[s] + sg if s in grads else sg
  return [grads.get(t) for t in targets]
