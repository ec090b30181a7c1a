"""Realization: which tensor-level nodes become buffers, and the kernels that fill them.

Stage `share` (rule set `share_rules`, ctx: `StoreIndex` of `is_shared_value_store`, its stores chosen by the policy
`choose_shared_values` before the rules run) stores once a computed value that kernels of several depths read and
would each recompute from two or more stored values: the residual stream of a stack of layers. Its rules are those of
stored_reads: each reader reads the value from its store.

Stage `realize` (rule set `realize_rules`) takes `SINK(outputs...)` of a tensor-level graph and marks with
`CONTIGUOUS` every node that must be a buffer: the outputs, the source of a device copy, a computed value that
holds a reduction and is read through an expand (recomputing a reduction per broadcast element would multiply its
work), a reduction that feeds another reduction (it would be recomputed for every step of the outer one), and an
operand of a product that elementwise ops compute and the product reads PROLOGUE_REUSE or more times over (a layer
norm before a linear layer: computed once, not once per output column). A half-precision value widened to float32
for a product (`_mul_sum`) is stored as its halves from under its views (`store`): one qkv buffer serves q, k and v, and
the product keeps the form tensor cores take. Everything else stays inline and fuses into the kernel that reads it: chains of elementwise ops fuse, and a
reduction fuses with the elementwise work before and after it. Constants are never buffers.

Stage `stored_reads` (rule set `stored_read_rules`, before `share`, ctx: `StoreIndex` of `is_graph_store`) reads each
value the graph stores already (`contiguous()`: a user's, the gradient's) from its buffer wherever else it is computed
inline. Stage `stored_reductions` (rule set `read_store_rules`, after `reuse`, ctx: `StoreIndex` of
`is_stored_reduction`) does the same for each stored reduction. Both are rules on each node, top-down, over an index of
the stores made before each pass (`StoreIndex.index`), and run to a fixed point (`Stage.to_fixed_point`): when they
are done, no value a store of theirs stores is computed anywhere but in its store.

Stage `reuse` (rule set `reuse_rules`, ctx: `ReuseContext`, after `realize`) makes one CONTIGUOUS of each stored value
(the gradient's and a realize rule's of one node): no value is stored twice.

Stage `kernelize` (rule set `kernelize_rules`, bottom-up, ctx: `KernelizeContext`) replaces each `CONTIGUOUS(x)` by
`VIEW(BUFFER)` of a new buffer and records the kernel `KERNEL(STORE(VIEW(BUFFER), x))` that fills it, and each
`COPY` by a new buffer and a copy record. The order of the records means nothing: the schedule runs the kernels in
a toposort of the kernel graph (`in_dependency_order`: a kernel after the kernels whose buffers it reads).

Stage `group` (rule set `group_rules`, ctx: `GroupDecisions`, its index made by `GroupDecisions.index_schedule`
before the rules run) merges the kernels of one output shape, device, depth in the kernel graph and products (`_group_key`) into one
kernel with several stores: rules on each KERNEL look its group up in the index (never trying pairs: linear in the number of kernels);
kernels of one depth never need one another, so no merge makes a cycle. A kernel that reads one of its own shape is
refused with its reason.
"""
from __future__ import annotations
import itertools, math, sys
from dataclasses import dataclass, field
from typing import Callable
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes, graph_rewrite, substitute, splice_sinks
from .strided_view import View
from .shapes import shape_of


@dataclass(frozen=True, eq=False)
class NewBuffer:
  """A buffer the pipeline decided to create; the runtime allocates it. Hashed by identity."""
  size: int
  device: str
  number: int
  def __repr__(self): return f"NewBuffer#{self.number}({self.size} on {self.device})"


# ---- helpers for the rules' right-hand sides ----
def is_constant(u: UOp) -> bool:
  """u is a constant: the tensor-level form of one, a VIEW of a CONST (a value with no buffer and no gradient)."""
  return u.op is Ops.VIEW and u.src[0].op is Ops.CONST


def is_buffer_view(u: UOp) -> bool:
  """u is a whole buffer read in order: the realized form of a tensor."""
  return u.op is Ops.VIEW and u.src[0].op is Ops.BUFFER and u.arg.is_contiguous and u.arg.size == u.src[0].arg.size


def expands(view: View) -> bool: return any(st == 0 and s > 1 for s, st in zip(view.shape, view.strides))


@dataclass(frozen=True)
class Realized:
  """The arg of a CONTIGUOUS the realize stage put in: the device of the buffer (None: its inputs') and why it
  exists, naming the rule that decided it (shown at DEBUG=2). `own`: memory of its own even where the value is a
  whole buffer already (`Tensor.clone()`; a `contiguous()` of such a value is that buffer). `output`: the realize's
  output it is, so that two equal outputs (one node, by hash-consing) are two buffers: two tensors, and a write into
  one must not change the other."""
  device: str | None
  why: str
  own: bool = False
  output: int | None = None


CLONE = Realized(None, "clone(): memory of its own", own=True)


@dataclass
class RealizeContext:
  """The realize stage's context: each value decided into a buffer so far, and each the graph stores already (the
  value -> its CONTIGUOUS)."""
  stored: dict[UOp, UOp] = field(default_factory=dict)
  holds: dict[UOp, bool] = field(default_factory=dict)   # holds_reduction's answers: each node is asked once

  def index_stored(self, sink: UOp) -> None:
    """Each value the graph already stores (`contiguous()` of it: the gradient stores the forward reductions and
    product operands its backward reads, rules/gradient.py) counts as decided: a value decided into a buffer is that
    buffer, and reads those it computes from there (`read_realized_reductions`), instead of a second buffer of the
    same value or a second product, both filled by one kernel of several stores."""
    for n in sink.toposort:
      if n.op is Ops.CONTIGUOUS and not is_buffer_view(n.src[0]): self.stored.setdefault(n.src[0], n)

  def holds_reduction(self, u: UOp) -> bool: return holds_reduction(u, self.holds)


def holds_reduction(u: UOp, memo: dict[UOp, bool], stored: Callable[[UOp], bool] = lambda n: is_realized(n)) -> bool:
  """u computes a reduction itself, not behind what `stored` says is memory (a buffer). Each node's answer is kept in
  `memo`, so that asking at every VIEW of a long chain costs the chain once, not once per VIEW; iterative, as chains
  may be deeper than Python's recursion."""
  stack = [u]
  while stack:
    n = stack[-1]
    if n in memo: stack.pop(); continue
    if stored(n) or n.op is Ops.REDUCE_AXIS: memo[n] = n.op is Ops.REDUCE_AXIS; stack.pop(); continue
    if todo := [s for s in n.src if s not in memo]: stack.extend(todo); continue
    memo[n] = any(memo[s] for s in n.src)
    stack.pop()
  return memo[u]


def decide(ctx: RealizeContext, x: UOp, why: str, device: str | None = None, output: int | None = None) -> UOp:
  """x into a buffer, for a reason; the calling rule is named in the reason. A value decided before (each of its
  readers may ask), or a value the graph stores already, is that buffer: one buffer, and its graph is not walked again.
  An output (`device` given) gets a buffer of its own on that device."""
  if device is None and (done := ctx.stored.get(x)) is not None: return done
  frame = sys._getframe(1)
  # a comprehension inside the rule, or `store` deciding for it: the reason names the rule
  while frame.f_code.co_name.startswith("<") or frame.f_code is store.__code__: frame = frame.f_back
  rule = frame.f_code
  out = UOp(Ops.CONTIGUOUS, x.dtype, (read_realized_reductions(ctx, x),),
            Realized(device, f"{why} (rule {rule.co_name} at {rule.co_filename}:{rule.co_firstlineno})", output=output))
  if device is None: ctx.stored[x] = out   # (asked again, by another reader or a stored copy of the graph: that buffer)
  return out


def read_realized_reductions(ctx: RealizeContext, x: UOp) -> UOp:
  """x reading from its buffer each value it computes itself that is also decided into a buffer, or stored: attention's
  probabilities exp(s - max(s)) / sum(...) read the scores s the max and the sum read, not a second product q @ k.T.
  Only the part of x not behind a buffer is looked at (the rest is computed elsewhere): linear over a realize."""
  realized = {n: ctx.stored[n] for n in _unrealized(x) if n is not x and n in ctx.stored}
  return substitute(x, realized, opaque=is_realized) if realized else x


def _realize_output(ctx: RealizeContext, sink: UOp) -> UOp | None:
  # a value the program stores already (contiguous(): a user's, the gradient's, read as it is or reshaped) is the
  # output: its buffer is returned, and every reader inside reads it there (no second buffer, no copy kernel; a
  # parameter's gradient is written by its product)
  # (a value output twice, a gradient and the momentum buffer it starts, is left as it was: two buffers, not one)
  stored = [s if s.op is Ops.CONTIGUOUS else s.src[0] if _reshapes_store(s) else None for s in sink.src]
  once = {c for c in stored if c is not None and c.arg is None and stored.count(c) == 1}
  swap: dict[UOp, UOp] = {}
  def output(s: UOp, device: str, i: int) -> UOp:
    if s.op is Ops.CONTIGUOUS and s.arg is not None and s.arg.own and s.arg.device is None:   # a clone: on the output's
      return s.replace(arg=Realized(device, f"{s.arg.why}, an output of this realize", own=True, output=i))
    if is_buffer_view(s) or (s.op is Ops.CONTIGUOUS and s.arg is not None): return s
    if (c := s if s.op is Ops.CONTIGUOUS else s.src[0] if _reshapes_store(s) else None) in once:
      out = UOp(Ops.CONTIGUOUS, s.dtype, (c.src[0] if s is c else s.replace(src=c.src),),
                Realized(device, "contiguous() in the program, an output of this realize"))
      swap[c] = out if s is c else UOp(Ops.VIEW, c.dtype, (out,), View.contiguous(shape_of(c)))   # read back as stored
      return out
    # a user's contiguous() that is an output still lives on the output's device
    if s.op is Ops.CONTIGUOUS:
      return s.replace(arg=Realized(device, "contiguous() in the program, an output of this realize", output=i))
    return decide(ctx, s, "an output of this realize", device, output=i)
  srcs = tuple(output(s, sink.arg[i], i) for i, s in enumerate(sink.src))
  if srcs == sink.src: return None
  return substitute(UOp(Ops.SINK, sink.dtype, srcs, sink.arg), swap) if swap else UOp(Ops.SINK, sink.dtype, srcs, sink.arg)


def _reshapes_store(v: UOp) -> bool:
  """v only reshapes what a CONTIGUOUS stores."""
  return (v.op is Ops.VIEW and v.src[0].op is Ops.CONTIGUOUS and v.arg.is_contiguous
          and v.arg.size == math.prod(shape_of(v.src[0])))


def widened_half(x: UOp) -> bool:
  """x is a float16 or bfloat16 value cast to float32 (what `_mul_sum` makes of a half operand): such a value is stored
  as the half value, its cast left to the reader (half the bytes; tensor cores read CASTs of half LOADs)."""
  return x.op is Ops.CAST and x.dtype is dtypes.float32 and x.src[0].dtype.is_half


def store(ctx: RealizeContext, x: UOp, why: str) -> UOp:
  """x into a buffer (`decide`); a widened half value as its half value, and that from under its views (the views of
  a value are free to read, and one buffer serves them all: q, k and v of one qkv product)."""
  if not widened_half(x): return decide(ctx, x, why)
  value = x.src[0]
  if value.op is Ops.VIEW and not is_realized(value.src[0]) and not expands(value.arg):
    return x.replace(src=(value.replace(src=(decide(ctx, value.src[0], why),)),))
  return x.replace(src=(decide(ctx, value, why),))


def _realize_before_expand(ctx: RealizeContext, v: UOp, x: UOp) -> UOp | None:
  if x.op is Ops.CONTIGUOUS or not expands(v.arg) or not ctx.holds_reduction(x): return None
  return v.replace(src=(store(ctx, x, "a reduction read through an expand, computed once"),))


def _realize_reduction_inputs(ctx: RealizeContext, r: UOp, x: UOp) -> UOp | None:
  # a reduction inside another is recomputed for every step of the outer one (attention's scores, once per max,
  # once per sum, once per output): computed once into a buffer instead
  inner = [n for n in _unrealized(x) if n.op is Ops.REDUCE_AXIS]
  if not inner: return None
  swap = {n: decide(ctx, n, "a reduction read by another reduction, computed once") for n in inner}
  return r.replace(src=(substitute(x, swap, opaque=is_realized),))


PROLOGUE_REUSE = 8   # an operand of a product read this many times over (once per output column) is stored once


def _realize_product_operands(ctx: RealizeContext, r: UOp, m: UOp) -> UOp | None:
  # an operand that elementwise ops compute (a layer norm's (x - mean) * rstd * g + b before the qkv product) would be
  # computed again for every output column, inside the product's innermost loop: computed once into a buffer instead,
  # the product then reads buffers only (its register tile, or the library's gemm). A cast or a view of a buffer
  # (a float16 operand widened) costs nothing to recompute and keeps the product's form.
  # A widened half operand (`_mul_sum`'s CAST to float32 of a float16 or bfloat16 value) is stored as the half value,
  # its cast left in the product: half the bytes, and the product keeps the form tensor cores take (a CAST of a half
  # LOAD, rules/opt/tensor_core.py). For the same reason a half operand read through a view of a view (heads merged
  # back: `(p @ v).permute(1, 0, 2).reshape(T, D)`), whose rows are not contiguous along k, is stored in order.
  if r.arg[0] is not Ops.ADD or not r.dtype.is_float: return None
  swap = {}
  for v in m.src:
    if v.op is not Ops.VIEW or is_realized(x := v.src[0]) or x.op is Ops.CONST or ctx.holds_reduction(x): continue
    reuse = math.prod(s for s, st in zip(v.arg.shape, v.arg.strides) if st == 0 and s > 1)
    if reuse < PROLOGUE_REUSE: continue
    widened = widened_half(x)
    value = x.src[0] if widened else x
    if any(n.op in GroupOp.ALU for n in _unrealized(value)):
      why = f"an operand of a product computed once, not once per each of {reuse} output columns"
    elif widened and value.op is Ops.VIEW and value.src[0].op is Ops.VIEW:
      why = "a half operand of a product read through a view of a view, stored in order along k (for tensor cores)"
    else: continue
    swap[v] = v.replace(src=(store(ctx, x, why),))
  return r.replace(src=(m.replace(src=tuple(swap.get(s, s) for s in m.src)),)) if swap else None


def is_realized(u: UOp) -> bool: return u.op is Ops.BUFFER or u.op is Ops.CONTIGUOUS


def _unrealized(u: UOp) -> list[UOp]:
  """The nodes of u's graph not behind a buffer or a CONTIGUOUS (`is_realized`)."""
  stack, seen, out = [u], set(), []
  while stack:
    n = stack.pop()
    if n in seen or is_realized(n): continue
    seen.add(n); out.append(n)
    stack.extend(n.src)
  return out


def _realize_copy_source(ctx: RealizeContext, c: UOp, x: UOp) -> UOp | None:
  if is_buffer_view(x) or x.op is Ops.CONTIGUOUS: return None
  return c.replace(src=(decide(ctx, x, "the source of a copy between devices", c.arg[0]),))


# a detached value is its source's value: the mark only stops gradients (rules/gradient.py), which are built by now
detached_is_its_source = (UPat(Ops.DETACH, src=(UPat(name="x"),)), lambda x: x, "detached_is_its_source")
# (the first graph stage drops the mark too: a softmax's detached max is still the softmax the attention stage fuses)
detach_rules = PatternMatcher([detached_is_its_source], name="detach")

realize_rules = PatternMatcher([
  # the outputs are buffers (SINK.arg holds each output's device)
  (UPat(Ops.SINK, name="sink"), _realize_output),
  detached_is_its_source,
  # contiguous() of what already is a whole buffer in order is that buffer
  (UPat(Ops.CONTIGUOUS, name="c", src=(UPat(Ops.VIEW, name="v"),)),
   lambda c, v: v if is_buffer_view(v) and not (c.arg is not None and c.arg.own) else None, "buffer_view_is_realized"),
  (UPat(Ops.CONTIGUOUS, name="c", src=(UPat(Ops.CONTIGUOUS, name="x"),)), lambda c, x: x, "merge_nested_contiguous"),
  # a reduction read through an expand is computed once, into a buffer
  (UPat(Ops.VIEW, name="v", src=(UPat(name="x"),)), _realize_before_expand),
  # and so is a reduction that feeds another
  (UPat(Ops.REDUCE_AXIS, name="r", src=(UPat(name="x"),)), _realize_reduction_inputs),
  # an operand of a product that elementwise ops compute is computed once (not once per output column)
  (UPat(Ops.REDUCE_AXIS, name="r", src=(UPat(Ops.MUL, name="m"),)), _realize_product_operands),
  # a copy between devices reads a buffer
  (UPat(Ops.COPY, name="c", src=(UPat(name="x"),)), _realize_copy_source),
], name="realize")


# ---- reuse: one buffer per stored value, and a stored reduction is read from it wherever it is computed ----
@dataclass
class ReuseContext:
  """The reuse stage's context: each value a CONTIGUOUS stores (not an output's or a copy's) -> that CONTIGUOUS."""
  stored: dict[UOp, UOp] = field(default_factory=dict)


def _is_output(c: UOp) -> bool: return c.arg is not None and c.arg.device is not None


def one_buffer_per_value(ctx: ReuseContext, c: UOp) -> UOp | None:
  """A value stored for two reasons is one buffer: the gradient stores a forward product its backward reads, the
  realize stage the same product (a reduction another reads) once the operands inside it are stored too: a node of
  another identity until then, equal now that its sources are (bottom-up). Two buffers were filled by one kernel of
  two stores, which no product tile plan of the GPU takes. An output keeps a buffer of its own."""
  if _is_output(c): return None
  kept = ctx.stored.setdefault(c.src[0], c)
  return kept if kept is not c else None


reuse_rules = PatternMatcher([
  (UPat(Ops.CONTIGUOUS, name="c"), one_buffer_per_value),
], name="reuse")


# ---- stored_reads and stored_reductions: a value the graph stores is read from its store ----
@dataclass
class StoreIndex:
  """A reading-from-stores stage's context: which CONTIGUOUS are stores (`is_store`), and `store_of`: each value a store
  of the graph stores -> that store (an output's where it is one: the output keeps its buffer; else the first met),
  indexed before each pass (the stage's prepare, `index`), and each stored value as the pass rebuilds it (over sources
  that read stores now) -> its store rebuilt, noted as the rules meet it."""
  is_store: Callable[[UOp], bool]
  store_of: dict[UOp, UOp] = field(default_factory=dict)

  def index(self, sink: UOp) -> None:
    for n in sink.toposort:
      if n.op is Ops.CONTIGUOUS and self.is_store(n): self.note(n)

  def note(self, c: UOp) -> None:
    if _is_output(c) or c.src[0] not in self.store_of: self.store_of[c.src[0]] = c


def is_graph_store(c: UOp) -> bool:
  """A `contiguous()` in the program (a user's, the gradient's) of a computed value: stage stored_reads' stores."""
  return c.arg is None and not is_buffer_view(c.src[0]) and c.src[0].op is not Ops.CONST


def is_stored_reduction(c: UOp) -> bool: return c.src[0].op is Ops.REDUCE_AXIS   # stage stored_reductions' stores


def one_store_per_value(ctx: StoreIndex, c: UOp) -> UOp | None:
  """A second store of a stored value is its store, and so is a store of that store. A store met over a value the
  index does not hold (its sources read stores now) is noted: readers of that value met later read it."""
  x = c.src[0]
  if (s := ctx.store_of.get(x)) is not None and s is not c: return s
  if s is None and ctx.is_store(c): ctx.note(c)
  return x if x.op is Ops.CONTIGUOUS and ctx.store_of.get(x.src[0]) is x else None


def read_from_store(ctx: StoreIndex, u: UOp) -> UOp | None:
  """u reads each of its sources that a store stores from that store (the store itself reads the value)."""
  store_of = ctx.store_of
  for s in u.src:   # a loop, not a tuple built: this is asked of every node of the graph
    if s in store_of: break
  else: return None
  src = tuple(st if (st := store_of.get(s)) is not None and st is not u else s for s in u.src)
  return None if src == u.src else u.replace(src=src)


def store_the_reshaped_value(c: UOp) -> UOp | None:
  """A reshape stored (the gradient of a product, at the product's shape with its summed axis) stores the value itself,
  read through the reshape: the buffer is the value's, which its other readers read."""
  if c.arg is not None or not _is_reshape(v := c.src[0]): return None
  return UOp(Ops.VIEW, c.dtype, (UOp(Ops.CONTIGUOUS, c.dtype, (v.src[0],)),), View.contiguous(shape_of(c)))


def _is_reshape(v: UOp) -> bool:
  """v is a VIEW that only reshapes a computed value (not a buffer's or a constant's)."""
  return (v.op is Ops.VIEW and v.src[0].op not in (Ops.BUFFER, Ops.CONST, Ops.VIEW) and v.arg.is_contiguous
          and v.arg.size == math.prod(shape_of(v.src[0])))


# the three stages' rules are the same two (their StoreIndex says which stores they read), the stored reads' led by one
_store_once = [(UPat(Ops.CONTIGUOUS, name="c"), one_store_per_value), (UPat(name="u"), read_from_store)]
read_store_rules = PatternMatcher(_store_once, name="stored_reductions")
share_rules = PatternMatcher(_store_once, name="share")
stored_read_rules = PatternMatcher([(UPat(Ops.CONTIGUOUS, name="c", src=(UPat(Ops.VIEW),)), store_the_reshaped_value), *_store_once],
                                   name="stored_reads")


# ---- share: a value read by kernels of several depths is stored once ----
SHARED = Realized(None, "a value read by kernels of several depths, stored once (policy choose_shared_values)")


def is_shared_value_store(c: UOp) -> bool: return c.arg == SHARED   # stage share's stores


def reader_levels(sink: UOp) -> dict[UOp, tuple[int, int]]:
  """Each node -> the lowest and highest reduction level of the reductions and outputs that read it inline (not behind
  a buffer), where a node's level is how many reductions deep it is computed (a reduction is one above its input)."""
  order = list(sink.toposort)
  level: dict[UOp, int] = {}
  for n in order:
    below = max([level[s] for s in n.src], default=0)
    level[n] = below + 1 if n.op is Ops.REDUCE_AXIS else below
  readers: dict[UOp, tuple[int, int]] = {}
  for n in reversed(order):   # users before their sources
    if n.op is Ops.SINK: continue
    mine = readers.setdefault(n, (level[n], level[n]))   # unread below: an output
    # a reduction, a buffer or a copy is where inline reading stops: n's sources are read at its level
    lo, hi = (level[n],) * 2 if n.op in (Ops.REDUCE_AXIS, Ops.CONTIGUOUS, Ops.COPY) else mine
    for s in n.src:
      old = readers.get(s)
      readers[s] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
  return readers


def whole_reads(x: UOp, stored: set[UOp]) -> int:
  """How many stored values (buffers, reductions, values already chosen to be stored) x reads whole, each element at
  most once (not through an expand): what recomputing x costs each of its readers."""
  seen, found, stack = set(), set(), [(x, False)]
  while stack:
    n, expanded = stack.pop()
    if (n, expanded) in seen: continue
    seen.add((n, expanded))
    if n is not x and (n in stored or n.op in (Ops.BUFFER, Ops.REDUCE_AXIS, Ops.CONTIGUOUS, Ops.COPY)):
      if not expanded: found.add(n)
      continue
    expanded = expanded or (n.op is Ops.VIEW and expands(n.arg))
    stack.extend((s, expanded) for s in n.src)
  return len(found)


def choose_shared_values(ctx: StoreIndex, sink: UOp) -> None:
  """Stage share's policy (its prepare): each computed value read by kernels of several depths that would have each of
  them read two or more stored values to recompute it is stored once, its store the index's: the residual stream of a
  transformer (x + attention(x) read by the next layer norm's mean, its variance and the product after it) is one
  buffer per layer, not a sum recomputed from layer 0 by every later kernel. Values are chosen sources first, so a
  value over one chosen below reads that one buffer (the norm's x - mean is not stored once x is). The stage's rules
  then read each from its store (`read_from_store`, as stored_reads does)."""
  readers, chosen = reader_levels(sink), set()
  for n in sink.toposort:
    if n.op not in GroupOp.Elementwise or (r := readers.get(n)) is None or r[0] == r[1]: continue
    if whole_reads(n, chosen) >= 2:
      chosen.add(n)
      ctx.store_of[n] = UOp(Ops.CONTIGUOUS, n.dtype, (n,), SHARED)


# ---- kernelize ----
@dataclass
class KernelizeContext:
  default_device: str
  kernels: list[UOp] = field(default_factory=list)
  explanations: list[str] = field(default_factory=list)
  counter: itertools.count = field(default_factory=itertools.count)

  def new_buffer(self, dtype, size: int, device: str) -> UOp:
    return UOp(Ops.BUFFER, dtype, (), NewBuffer(size, device, next(self.counter)))


def device_of_inputs(x: UOp) -> str | None:
  for n in x.toposort:
    if n.op is Ops.BUFFER: return n.arg.device
  return None


def _kernel_for(ctx: KernelizeContext, c: UOp, x: UOp) -> UOp:
  shape = shape_of(x)
  device = (c.arg.device if c.arg else None) or device_of_inputs(x) or ctx.default_device
  out = UOp(Ops.VIEW, x.dtype, (ctx.new_buffer(x.dtype, View.contiguous(shape).size, device),), View.contiguous(shape))
  ctx.kernels.append(UOp(Ops.KERNEL, src=(UOp(Ops.STORE, src=(out, x)),), arg=device))
  why = c.arg.why if c.arg else "contiguous() in the program"
  ctx.explanations.append(f"kernel {len(ctx.kernels) - 1}: buffer of shape {shape} on {device}: {why}")
  return out


def _copy_for(ctx: KernelizeContext, c: UOp, x: UOp) -> UOp:
  out = UOp(Ops.VIEW, x.dtype, (ctx.new_buffer(x.dtype, x.arg.size, c.arg[1]),), x.arg)
  ctx.kernels.append(UOp(Ops.COPY, x.dtype, (out.src[0], x.src[0]), c.arg))
  return out


kernelize_rules = PatternMatcher([
  (UPat(Ops.CONTIGUOUS, name="c", src=(UPat(name="x"),)), _kernel_for),
  (UPat(Ops.COPY, name="c", src=(UPat(Ops.VIEW, name="x", src=(UPat(Ops.BUFFER),)),)), _copy_for),
], name="kernelize")


# ---- grouping kernels into multi-output kernels ----
def kernel_output_shape(k: UOp) -> tuple[int, ...]: return k.src[0].src[0].arg.shape


def buffers_read(k: UOp) -> frozenset[UOp]:
  written = {st.src[0].src[0] for st in k.src} if k.op is Ops.KERNEL else {k.src[0]}
  return frozenset(n for n in k.toposort if n.op is Ops.BUFFER) - written


def buffers_written(k: UOp) -> frozenset[UOp]:
  return frozenset(st.src[0].src[0] for st in k.src) if k.op is Ops.KERNEL else frozenset({k.src[0]})


class ScheduleIndex:
  """The index every schedule-scope stage looks kernels up in, so that none tries pairs of kernels: each kernel's place
  in the list, the places of each buffer's readers and writers (in order), and each kernel's depth in the kernel
  graph (kernel -> the kernels whose buffers it reads): 0 when it reads no buffer another kernel writes, else one
  more than the deepest of those. A kernel is deeper than every kernel it needs, directly or not, so kernels of one
  depth never need one another. Linear: each kernel's graph is walked once."""

  def __init__(self, kernels):
    self.kernels: list[UOp] = list(kernels)
    self.place = {k: i for i, k in enumerate(self.kernels)}
    self.readers: dict[UOp, list[int]] = {}
    self.writers: dict[UOp, list[int]] = {}
    for i, k in enumerate(self.kernels):
      for b in buffers_read(k): self.readers.setdefault(b, []).append(i)
      for b in buffers_written(k): self.writers.setdefault(b, []).append(i)
    self.depth = self._depths()

  def writer(self, b: UOp) -> UOp | None:
    """The kernel that writes b, the last in the list when several do (None when none does)."""
    return self.kernels[ws[-1]] if (ws := self.writers.get(b)) else None

  def _depths(self) -> dict[UOp, int]:
    needs = {i: set() for i in range(len(self.kernels))}
    for b, rs in self.readers.items():
      if (ws := self.writers.get(b)):
        for r in rs: needs[r].add(ws[-1])
    depth: dict[int, int] = {}
    for i in range(len(self.kernels)):
      stack, on_path = [i], set()
      while stack:  # iterative: a chain of thousands of kernels is no concern
        n = stack[-1]
        if n in depth: stack.pop(); continue
        if todo := [d for d in needs[n] if d not in depth]:
          if any(d in on_path for d in todo):  # a cycle: only several writers of one buffer can make one
            raise ValueError(f"kernels {sorted(on_path | {n})} need one another: a buffer has several writers "
                             "and no order runs them")
          on_path.add(n); stack.extend(todo); continue
        depth[n] = 1 + max((depth[d] for d in needs[n]), default=-1)
        on_path.discard(n); stack.pop()
    return {k: depth[i] for i, k in enumerate(self.kernels)}


def in_dependency_order(kernels: list[UOp]) -> list[UOp]:
  """The kernels in an order they can run in: a toposort of the kernel graph, by depth (ties keep the given order)."""
  return sorted(kernels, key=ScheduleIndex(kernels).depth.__getitem__)


def read_before_written(kernels: list[UOp], into: dict[UOp, UOp], new_buffer: Callable[[UOp], UOp]) -> list[UOp]:
  """The kernels (in the order they run) of a realize that writes existing buffers in place, each read as it was
  before the realize: `into` maps each buffer a kernel computes to the existing BUFFER its output goes into (an
  assignment's target; a kernel may also write an existing buffer itself). Where every kernel that reads a target,
  other than the one writing it, runs before that one, nothing changes (an optimizer's step: the update of a weight
  needs its gradient, which needs every kernel that reads the weight). Otherwise the target's old contents are
  first copied into a new buffer (`new_buffer(target)`) by a kernel, and every kernel reads that copy instead."""
  written_at: dict[UOp, int] = {}
  last_read: dict[UOp, int] = {}
  for i, k in enumerate(kernels):
    for b in buffers_written(k): written_at[into.get(b, b)] = i
    for b in buffers_read(k): last_read[b] = i
  late = [t for t, w in written_at.items() if not isinstance(t.arg, NewBuffer) and last_read.get(t, -1) > w]
  if not late: return kernels
  old, copies = {}, []
  for t in late:
    old[t] = new_buffer(t)
    whole = View.contiguous((t.arg.size,))
    copies.append(UOp(Ops.KERNEL, src=(UOp(Ops.STORE, src=(UOp(Ops.VIEW, t.dtype, (old[t],), whole),
                                                            UOp(Ops.VIEW, t.dtype, (t,), whole))),), arg=t.arg.device))

  def reading_old(k: UOp) -> UOp:   # (only what a kernel reads: where it stores stays)
    if k.op is Ops.COPY: return k.replace(src=(k.src[0], substitute(k.src[1], old)))
    return k.replace(src=tuple(st.replace(src=(st.src[0], substitute(st.src[1], old))) for st in k.src))
  return copies + [reading_old(k) for k in kernels]


def _group_key(k: UOp) -> tuple | None:
  """What kernels must share to become one: device, output shape and the products they compute (a copy is never
  merged). Two kernels of two different products (attention's dq and dk, say) stay apart: merged, neither loop nest
  could be tiled as a product; kernels of one product (its value and values computed from it) merge, and compute it
  once."""
  if k.op is not Ops.KERNEL: return None
  products = frozenset(n for st in k.src for n in st.src[1].toposort
                       if n.op is Ops.REDUCE_AXIS and n.arg[0] is Ops.ADD and n.src[0].op is Ops.MUL)
  return (k.arg, kernel_output_shape(k), products)


@dataclass
class GroupDecisions:
  """The group stage's context: its index of the schedule, and why kernels were or were not merged (read by DEBUG=2
  and the statistics). Kernels are numbered by their place in the schedule the group stage first saw; a merged
  kernel keeps the number of its first member."""
  refused: list[str] = field(default_factory=list)
  merged: list[str] = field(default_factory=list)
  numbers: dict[UOp, int] = field(default_factory=dict)
  said: set[str] = field(default_factory=set)
  group_of: dict[UOp, list[UOp]] = field(default_factory=dict)  # a kernel -> its group (2 or more), in schedule order
  index: ScheduleIndex | None = None                             # the schedule as the stage first saw it

  def note(self, to: list[str], why: str):
    if why not in self.said: self.said.add(why); to.append(why)

  def index_schedule(self, schedule: UOp) -> None:
    """The index the group rules look candidates up in (the stage's prepare): kernels by (group key, depth in the kernel
    graph), and each buffer's writer. Linear in the schedule; no pair of kernels is ever tried."""
    self.index = index = ScheduleIndex(schedule.src)
    for i, k in enumerate(index.kernels): self.numbers.setdefault(k, i)
    groups: dict[tuple, list[UOp]] = {}
    for k in index.kernels:
      if (key := _group_key(k)) is not None: groups.setdefault((key, index.depth[k]), []).append(k)
    self.group_of = {k: members for members in groups.values() if len(members) > 1 for k in members}


def explain_unmerged_reader(ctx: GroupDecisions, k: UOp) -> None:
  """A kernel that reads what a kernel of its own shape and device writes stays apart from it (merging would make a
  cycle); say so. Changes nothing."""
  if ctx.index.writer(next(iter(buffers_written(k)))) is not k: return None   # a kernel this stage made: said already
  needed = {w for b in buffers_read(k) if (w := ctx.index.writer(b)) is not None}
  for w in sorted((w for w in needed if _group_key(w) == _group_key(k)), key=ctx.numbers.__getitem__):
    ctx.note(ctx.refused, f"kernel {ctx.numbers[k]} was not fused into kernel {ctx.numbers[w]}: it reads what kernel "
                          f"{ctx.numbers[w]} writes (fusing would make a cycle)")


def merge_kernels_of_one_depth(ctx: GroupDecisions, k: UOp) -> UOp | None:
  """A kernel of a group (one output shape, device and depth in the kernel graph): the first member becomes the kernel
  of every member's stores, the others an empty SINK that the schedule drops. Kernels of one depth never need one
  another, so the merge makes no cycle, and the merged kernel takes its first member's place in a schedule ordered by
  depth."""
  if (members := ctx.group_of.get(k)) is None: return None
  if k is not members[0]: return UOp(Ops.SINK)
  merged = UOp(Ops.KERNEL, k.dtype, tuple(st for m in members for st in m.src), k.arg)
  ctx.numbers[merged] = ctx.numbers[k]
  ctx.note(ctx.merged, f"kernels {', '.join(str(ctx.numbers[m]) for m in members)} store to one shape "
                       f"{kernel_output_shape(k)} at one depth of the kernel graph: fused into one kernel")
  return merged


group_rules = PatternMatcher([
  (UPat(Ops.KERNEL, name="k"), explain_unmerged_reader),
  (UPat(Ops.KERNEL, name="k"), merge_kernels_of_one_depth),
  (UPat(Ops.SINK, name="node"), splice_sinks),   # a merged kernel's other members, now empty, leave the schedule
], name="group")


# ---- normalized kernels: equal kernels over different buffers are one UOp ----
@dataclass(frozen=True)
class Slot:
  """A kernel's n-th buffer argument, standing for whichever buffer a call passes there."""
  number: int
  size: int
  device: str


_to_slots = PatternMatcher([(UPat(Ops.BUFFER, name="b"), lambda ctx, b: ctx.get(b), "buffer_to_slot")], name="normalize")


def normalize(kernel: UOp) -> tuple[UOp, list[UOp]]:
  """The kernel with its buffers replaced by slots (written buffers first), and the buffers in slot order."""
  written = [st.src[0].src[0] for st in kernel.src]
  read = [n for n in kernel.toposort if n.op is Ops.BUFFER and n not in written]
  buffers = list(dict.fromkeys(written + read))
  slots = {b: UOp(Ops.BUFFER, b.dtype, (), Slot(i, b.arg.size, b.arg.device)) for i, b in enumerate(buffers)}
  return graph_rewrite(kernel, _to_slots, slots, name="normalize"), buffers


