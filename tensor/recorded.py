"""Composite operations recorded once per kind of input and replayed: the graph of `x.softmax(1)` is built by ten
tensor operations (promotion, broadcasting, views, a Tensor each), and a warm call of a model builds it anew on
every call, over a new input. Its nodes above the input are the same on every call for inputs of one kind, so the
first call records them and later calls make just those nodes again over the new input (hash-consing makes them
the very nodes the operations would have built: the graph is the same, and so is everything that follows).

A method is recorded when it is decorated with `@recorded` and reads its input only as the source of elementwise
operations and reductions (never moves it: a movement of a VIEW merges into it, so its nodes depend on the input's
View). The key is the method and its arguments (with their types: `axis=True` is not `axis=1`), the input's shape,
dtype, device and class, and whether gradients are on (no_grad() detaches every result). A constant input is not
recorded (a cast of a constant folds); nor is a graph that holds a buffer other than the input's (the record would
keep it alive), or a result that is the input itself. Errors are raised by the operations, on every call: a call
that fails records nothing.
"""
from __future__ import annotations
import functools
from rewrite import UOp, Ops
from rewrite.uop import _make
from .autograd import grad_enabled

MAX_RECORDS = 512
_records: dict[tuple, tuple] = {}    # key -> (steps, shape of the result)


def _record(out: UOp, inp: UOp) -> list[tuple] | None:
  """The nodes of `out` that depend on `inp`, sources first, as (op, dtype, arg, sources) with each source None (the
  input), an int (an earlier step) or a node that does not depend on the input (kept as it is); None where the graph
  cannot be replayed."""
  where: dict[UOp, int | None] = {inp: None}   # a step's index, None for the input; absent: no dependence
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
      steps.append((n.op, n.dtype, n.arg, tuple([where[s] if s in where else s for s in n.src])))
    elif n.op is Ops.BUFFER: return None
    else: fixed.add(n)
  return steps if out in where and where[out] is not None else None


def _replay(steps: list[tuple], inp: UOp) -> UOp:
  built: list[UOp] = []
  for op, dtype, arg, srcs in steps:
    built.append(_make(op, dtype, tuple([inp if s is None else built[s] if s.__class__ is int else s for s in srcs]), arg))
  return built[-1]


def recorded(method):
  """`method(self, *args)` (a Tensor method of the kind the module docstring describes), recorded on its first call
  for each kind of input and replayed after."""
  name = method.__qualname__

  @functools.wraps(method)
  def run(self, *args, **kwargs):
    u = self.uop
    if u.op is Ops.VIEW and u.src[0].op is Ops.CONST: return method(self, *args, **kwargs)
    key = (name, tuple([(a.__class__, a) for a in args]), tuple([(k, v.__class__, v) for k, v in sorted(kwargs.items())]),
           self.shape, u.dtype, self.device, self.__class__, grad_enabled())
    try: rec = _records.get(key)
    except TypeError: return method(self, *args, **kwargs)   # an argument that does not hash (a list of axes)
    if rec is not None: return self._from_uop(_replay(rec[0], u), rec[1], self.device)
    out = method(self, *args, **kwargs)
    if (steps := _record(out.uop, u)) is not None:
      if len(_records) >= MAX_RECORDS: _records.clear()
      _records[key] = (steps, out.shape)
    return out
  return run
