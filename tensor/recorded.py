"""Composite operations recorded once per kind of input and replayed: the graph of `x.softmax(1)` is built by ten
tensor operations (promotion, broadcasting, views, a Tensor each), and a warm call of a model builds it anew on
every call, over a new input. Its nodes above the inputs are the same on every call for inputs of one kind, so the
first call records them and later calls make just those nodes again over the new inputs (hash-consing makes them
the very nodes the operations would have built: the graph is the same, and so is everything that follows). A later
call's result is `Unbuilt` until its graph is read: realized at once, its program is found by the record and the
inputs, and the nodes are not made at all.

What a record stands on. An input that is a VIEW is replayed from its source (a movement of a VIEW merges into it,
so the record depends on the View, not on what is under it); any other input from its own node; each such node once
(two arguments read through one node, attention's q and k of one qkv, are one input, and which argument reads which
input is in the key: a + a is not a + b). The key is the method and its arguments that are no tensors (with their
types: `axis=True` is not `axis=1`), and for each tensor argument its shape, dtype, device, class and that form (its
op; for a VIEW its View, its source's op, and the source's shape where a movement may drop a VIEW that reads it
whole; a constant by its View and value, which the record then holds as it is: a constant folds); and whether
gradients are on (no_grad() detaches every result). A result made of constants alone (a causal mask,
`Tensor.full((n, n), True).triu(1)`) is recorded as that node.

Not recorded (built by the operations on every call): a graph that reads a buffer other than the inputs' (the record
would keep it alive); a result that is an input, or a movement of one (a view of another tensor's memory:
tensor/assign.py), or a bare constant. Errors are raised by the operations, on every call: a call that fails records
nothing.
"""
from __future__ import annotations
import functools, math, threading
from rewrite import UOp, Ops, DType, dtypes
from rewrite.uop import _intern, _UOpFields
from rules.shapes import shape_of
from rules.realize import is_constant
from .autograd import grad_enabled
from .assign import drop_internal_view

MAX_RECORDS = 512


class Record:
  """One composite's record for one kind of input: `fixed` and `steps` (as `_record` makes them) and the result's
  shape. Its result node is marked as made by it (UOp._made: this record, the stand-ins), so a program's key names
  that node by the record and its stand-ins (runtime/realize.py graph_key), not by the nodes between; compared by
  identity."""
  __slots__ = ("name", "fixed", "steps", "shape", "dtype")

  def __init__(self, name: str, fixed: list[UOp], steps: list[tuple], shape: tuple[int, ...], dtype: DType):
    self.name, self.fixed, self.steps, self.shape, self.dtype = name, fixed, steps, shape, dtype

  def mark(self, out: UOp, stands: list[UOp]) -> UOp:
    _made.__set__(out, (self, tuple(stands)))
    return out

  def __repr__(self) -> str: return self.name


class Unbuilt:
  """A replay not made yet: the result of `record` over the nodes `stands`, as a program's key names it (`_made`,
  `dtype`: runtime/realize.py graph_key). A warm call that realizes a composite's result at once (`x.softmax(1)`,
  `.realize()`) finds its program by the key alone and never builds the nodes between; anything else that reads the
  result's graph builds it first (Tensor.uop), the very nodes a replay makes."""
  __slots__ = ("_made", "dtype")

  def __init__(self, record: Record, stands: list[UOp]):
    self._made, self.dtype = (record, tuple(stands)), record.dtype

  def build(self) -> UOp:
    record, stands = self._made
    return record.mark(_replay(record, list(stands)), stands)


_records: dict[tuple, Record] = {}


class _Nesting(threading.local):
  depth = 0   # first calls (recording) running in this thread, one inside another


# A composite called inside another's first call runs as plain operations: its result node unmarked, as the outer
# composite's replays build it (a gradient reads the nodes inside; marked on the first call only, the first call's
# program would be another than the replays')
_first_calls = _Nesting()
_made = _UOpFields._made   # the slot's descriptor (UOp itself refuses attribute writes)


def _stand_in(u: UOp) -> tuple[UOp, tuple] | None:
  """(the node a record stands on for an input of graph `u`, what of u's form the record depends on); None for a
  constant."""
  if u.op is not Ops.VIEW: return u, (u.op,)
  s = u.src[0]
  if s.op is Ops.CONST: return None
  return s, (u.arg, s.op, None if s.op is Ops.BUFFER else shape_of(s))


def _constant_form(u: UOp) -> tuple:
  """What a record depends on of a constant input (a VIEW of a CONST): its View and its value, a float by its hex text
  and sign (a NaN is then equal to itself as a key, -NaN is not NaN, and -0.0 is not 0.0)."""
  value = u.src[0].arg
  return ("constant", u.arg, value.__class__, (value.hex(), math.copysign(1.0, value)) if value.__class__ is float else value)


def _record(out: UOp, inputs: list[UOp]) -> tuple[list[UOp], list[tuple]] | None:
  """(fixed, steps): the nodes of `out` that depend on the inputs, sources first, as (op, dtype, arg, the arg's key
  in UOp's table, sources), each source numbered in the list a replay builds: the fixed nodes (those the steps read
  that do not depend on the inputs, kept as they are), then the inputs, then the steps' own nodes. None where the
  graph cannot be replayed."""
  where: dict[UOp, int] = {u: -1 - i for i, u in enumerate(inputs)}   # absent: no dependence on the inputs
  if len(where) < len(inputs) or out in where or (out.op is Ops.VIEW and out.src[0] in where): return None
  fixed: set[UOp] = set()
  steps: list[tuple] = []
  stack = [(out, False)]
  while stack:
    n, ready = stack.pop()
    if n in where or n in fixed: continue
    if not ready:
      stack.append((n, True))
      stack.extend((s, False) for s in n.src if s not in where and s not in fixed)
      continue
    if any(s in where for s in n.src):
      where[n] = len(steps)
      steps.append((n.op, n.dtype, n.arg, n._key[2], tuple([where.get(s, s) for s in n.src])))
    elif n.op is Ops.BUFFER: return None
    else: fixed.add(n)
  if out in fixed:   # made of constants alone (a causal mask): the record is that node (a bare constant is no work;
    # with inputs that folded away the mark would hold their stand-ins, a user's buffer among them, in the record)
    return ([out], []) if not inputs and not is_constant(out) else None
  if out not in where: return None
  kept = list(dict.fromkeys(s for *_, srcs in steps for s in srcs if s.__class__ is not int))
  at, first = {u: k for k, u in enumerate(kept)}, len(kept) + len(inputs)
  number = lambda s: at[s] if s.__class__ is not int else first + s if s >= 0 else len(kept) - 1 - s
  return kept, [(*step[:4], tuple(map(number, step[4]))) for step in steps]


def _replay(rec: Record, inputs: list[UOp]) -> UOp:
  nodes = rec.fixed + inputs
  get, put = nodes.__getitem__, nodes.append
  for op, dtype, arg, key, srcs in rec.steps: put(_intern(op, dtype, tuple(map(get, srcs)), arg, key))
  return nodes[-1] if rec.steps else rec.fixed[0]


def _plain(a) -> bool:
  """Whether argument `a` is a value the key can hold: a number, a string, None, a dtype or a tuple of ints (a
  tensor inside a tuple, say, is not: the record would hold its graph of the first call)."""
  c = a.__class__
  return a is None or c in (int, float, bool, str, DType) or (c is tuple and all(x.__class__ is int for x in a))


def _key_of(a) -> tuple:
  """A plain argument in the key: a float by its bits too (-0.0 == 0.0 as a dict key, yet a different constant)."""
  return (float, a, math.copysign(1.0, a)) if a.__class__ is float else (a.__class__, a)


def recorded(method):
  """`method(self, *args, **kwargs)` (a Tensor method building a graph from its tensor arguments and self),
  recorded on its first call for each kind of input and replayed after (the module docstring says which calls)."""
  name = method.__qualname__

  @functools.wraps(method)
  def run(self, *args, **kwargs):
    if _first_calls.depth: return method(self, *args, **kwargs)   # inside a first call: as its replays build it
    # (default_float and default_int: what integer inputs and Python numbers compute in, read by the operations on the
    # first call)
    # each stand-in once, numbered in the key: two arguments read through one node (q and k, views of one qkv) are
    # one input of the record, and a + a is not a + b
    stands: dict[UOp, int] = {}
    parts = [name, grad_enabled(), dtypes.default_float, dtypes.default_int]
    for a in (self, *args):
      if hasattr(a, "uop"):
        u = a.uop
        if (s := _stand_in(u)) is None: parts.append((a.shape, u.dtype, a.device, a.__class__, _constant_form(u)))
        else: parts.append((a.shape, u.dtype, a.device, a.__class__, s[1], stands.setdefault(s[0], len(stands))))
      elif _plain(a): parts.append(_key_of(a))
      else: return method(self, *args, **kwargs)
    for k, v in sorted(kwargs.items()):
      if not _plain(v): return method(self, *args, **kwargs)
      parts.append((k, *_key_of(v)))
    key = tuple(parts)
    try: rec = _records.get(key)
    except TypeError: return method(self, *args, **kwargs)   # an argument that does not hash (a list of axes)
    if rec is not None: return self._from_uop(Unbuilt(rec, list(stands)), rec.shape, self.device)
    _first_calls.depth += 1
    try: out = method(self, *args, **kwargs)
    finally: _first_calls.depth -= 1
    if (made := _record(out.uop, list(stands))) is not None:
      if len(_records) >= MAX_RECORDS: _records.clear()
      _records[key] = rec = Record(name, *made, out.shape, out.uop.dtype)
      rec.mark(out.uop, list(stands))   # (the first call's key is the replays')
      drop_internal_view(out)
    return out
  return run
