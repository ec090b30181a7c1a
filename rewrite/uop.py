"""UOp: the one immutable, hash-consed graph node of every level of the compiler.

Building a UOp equal to a live one returns that very object, so `a is b` is structural equality, equal
subexpressions are shared for free, and a UOp keys a dict by identity in O(1).
"""
from __future__ import annotations
import math, weakref
from typing import Any, Iterator
from .ops import Ops, GroupOp
from .dtypes import DType, PtrDType, dtypes


def _arg_key(arg):
  # 0.0 == -0.0 and 1 == 1.0 == True in Python; the cache key must tell them apart (a CONST -0.0 is not a CONST 0.0)
  if arg.__class__ is float: return (float, arg.hex() if arg == arg else "nan")
  if arg.__class__ is bool: return (bool, arg)
  return arg


class _UOpFields:
  # The fields are set on an instance of this mutable base, then the instance becomes a UOp by a __class__ switch:
  # that is three times cheaper than object.__setattr__ on an immutable class, and UOp construction is a hot path.
  # _topo and _bounds cache walks of the graph under a node; _made, where set, is (maker, inputs): the node is what
  # replaying a recorded composite `maker` over the nodes `inputs` builds (tensor/recorded.py; None: no composite's result,
  # set on every node: a read of an unset slot raises inside, ten times the cost), so a program's key
  # may name it by them instead of walking everything between (runtime/realize.py graph_key)
  # _loops caches the RANGE nodes at or under a node (UOp.loops)
  __slots__ = ("op", "dtype", "src", "arg", "_key", "_topo", "_bounds", "_loops", "_made", "__weakref__")


_cache: dict[tuple, weakref.ReferenceType] = {}
_KEEP = object()  # replace(): "field not given" (None is a real arg)


class UOp(_UOpFields):
  __slots__ = ()
  op: Ops
  dtype: DType
  src: tuple[UOp, ...]
  arg: Any

  def __new__(cls, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = (), arg: Any = None):
    # a list would not hash, and must not be shared mutable
    return _make(op, dtype, src if src.__class__ is tuple else tuple(src), arg)

  def __setattr__(self, name, value): raise AttributeError(f"UOp is immutable: cannot set {name!r}; build a new one with .replace()")
  def __delattr__(self, name): raise AttributeError(f"UOp is immutable: cannot delete {name!r}")
  def __del__(self):
    # runs for every node that dies: keep it short. The entry may already belong to a newer equal node (when the
    # cyclic collector cleared this one's weakref first), which must stay.
    try:
      ref = _cache.pop(key := self._key)  # one hash of the key; putting a newer node's entry back is the rare case
      if (o := ref()) is not None and o is not self: _cache[key] = ref
    except Exception: pass  # interpreter shutdown, or a node that never finished construction
  def __reduce__(self):
    # The pickler recurses once per nesting level, so a deep graph pickles as a flat list of its deep nodes, sources
    # given as indices into that list; shallow subgraphs (and shallow graphs) pickle as nested UOp(...) calls.
    order, height = _walk_heights(self)
    if height[self] <= _SHALLOW: return UOp, (self.op, self.dtype, self.src, self.arg)
    index: dict[UOp, int] = {}
    flat = []
    for n in order:
      if height[n] <= _SHALLOW: continue
      index[n] = len(flat)
      flat.append((n.op, n.dtype, tuple(index.get(s, s) for s in n.src), n.arg))
    return _from_flat, (flat,)
  def __copy__(self): return self
  def __deepcopy__(self, memo): return self
  def __bool__(self): raise TypeError("a UOp has no truth value; compare with `is`, or use .where() to select")

  def replace(self, op=_KEEP, dtype=_KEEP, src=_KEEP, arg=_KEEP, **unknown) -> UOp:
    """This node with some fields changed (the same node when nothing changes)."""
    if unknown: raise TypeError(f"UOp.replace got unknown fields {sorted(unknown)}")
    return _make(self.op if op is _KEEP else op, self.dtype if dtype is _KEEP else dtype,
                 self.src if src is _KEEP else src if src.__class__ is tuple else tuple(src), self.arg if arg is _KEEP else arg)

  # ---- graph walks (iterative: a 200,000-deep chain must not hit the recursion limit) ----
  @property
  def toposort(self) -> dict[UOp, None]:
    """Every node reachable from self, sources before users (self last), as an ordered dict of its own (the caller
    may keep or change it). The nodes below self are cached on self, and self is not among them: a node that held
    itself would be garbage of the cyclic collector, and so would the whole graph under it and the buffers it holds."""
    try: below = _UOpFields._topo.__get__(self)
    except AttributeError: below = _below(self)
    order = below.copy()
    order[self] = None
    return order

  def sparents(self) -> Iterator[UOp]: return iter(self.toposort)

  # ---- construction helpers ----
  @staticmethod
  def const(dtype: DType, value) -> UOp:
    return _make(Ops.CONST, dtype, (), _as_dtype_value(dtype, value))

  @staticmethod
  def variable(name: str, vmin: int, vmax: int, dtype: DType = dtypes.index) -> UOp:
    if vmin > vmax: raise ValueError(f"variable {name!r}: min {vmin} > max {vmax}")
    return UOp(Ops.DEFINE_VAR, dtype, (), (name, vmin, vmax))

  def alu(self, op: Ops, *src: UOp | int | float | bool) -> UOp:
    srcs = (self,) + tuple(s if isinstance(s, UOp) else UOp.const(self.dtype, s) for s in src)
    out_dtype = dtypes.bool if op in GroupOp.Comparison else (srcs[-1].dtype if op is Ops.WHERE else self.dtype)
    return UOp(op, out_dtype, srcs)

  def cast(self, dtype: DType) -> UOp: return self if self.dtype is dtype else UOp(Ops.CAST, dtype, (self,))

  def _other(self, x) -> UOp: return x if isinstance(x, UOp) else UOp.const(self.dtype, x)
  def __add__(self, x): return _make(Ops.ADD, self.dtype, (self, self._other(x)), None)
  def __radd__(self, x): return _make(Ops.ADD, self.dtype, (self._other(x), self), None)
  def __mul__(self, x): return _make(Ops.MUL, self.dtype, (self, self._other(x)), None)
  def __rmul__(self, x): return _make(Ops.MUL, self.dtype, (self._other(x), self), None)
  def __neg__(self): return UOp(Ops.NEG, self.dtype, (self,)) if self.dtype.is_float else self * -1
  def __sub__(self, x): return self + (-self._other(x))
  def __rsub__(self, x): return self._other(x) + (-self)
  def __floordiv__(self, x): return _make(Ops.IDIV, self.dtype, (self, self._other(x)), None)
  def __rfloordiv__(self, x): return _make(Ops.IDIV, self.dtype, (self._other(x), self), None)
  def __truediv__(self, x): return _make(Ops.FDIV, self.dtype, (self, self._other(x)), None)
  def __mod__(self, x): return _make(Ops.MOD, self.dtype, (self, self._other(x)), None)
  def __rmod__(self, x): return _make(Ops.MOD, self.dtype, (self._other(x), self), None)
  def __lt__(self, x): return _make(Ops.CMPLT, dtypes.bool, (self, self._other(x)), None)
  def __gt__(self, x): return _make(Ops.CMPLT, dtypes.bool, (self._other(x), self), None)
  def __and__(self, x): return _make(Ops.AND, self.dtype, (self, self._other(x)), None)
  def __or__(self, x): return _make(Ops.OR, self.dtype, (self, self._other(x)), None)
  def __xor__(self, x): return _make(Ops.XOR, self.dtype, (self, self._other(x)), None)
  def __lshift__(self, x): return _make(Ops.SHL, self.dtype, (self, self._other(x)), None)
  def __rshift__(self, x): return _make(Ops.SHR, self.dtype, (self, self._other(x)), None)
  def ne(self, x): return _make(Ops.CMPNE, dtypes.bool, (self, self._other(x)), None)
  def eq(self, x): return self.ne(x) ^ True
  def maximum(self, x): return _make(Ops.MAX, self.dtype, (self, self._other(x)), None)
  def minimum(self, x): return -((-self).maximum(-self._other(x)))
  def where(self, a, b):
    a = a if isinstance(a, UOp) else UOp.const(b.dtype if isinstance(b, UOp) else dtypes.from_py(a), a)
    return UOp(Ops.WHERE, a.dtype, (self, a, a._other(b)))
  def logical_not(self): return self.ne(True)

  # ---- value bounds ----
  @property
  def vmin(self): return self._bounds_of()[0]
  @property
  def vmax(self): return self._bounds_of()[1]
  def _bounds_of(self) -> tuple: return _cached_up(self, _UOpFields._bounds, _bounds)

  @property
  def loops(self) -> tuple[UOp, ...]:
    """The RANGE nodes at or under self, in toposort's order. Cached on every node (its sources' loops, then itself if
    a RANGE), so that asking it of a copy of a graph (an unrolled store, a substituted loop) costs the copy's new
    nodes, where a walk of toposort costs the whole graph each time."""
    return _cached_up(self, _UOpFields._loops, _loops)

  @property
  def is_const(self) -> bool: return self.op is Ops.CONST

  # ---- printing ----
  def __repr__(self) -> str:
    return pretty(self) if len(self.toposort) <= 12 else _short(self) + f" <{len(self.toposort)} nodes; .pretty() shows all>"
  def pretty(self) -> str: return pretty(self)


_new_fields, _weakref = object.__new__, weakref.ref


def _make(op: Ops, dtype: DType, src: tuple, arg) -> UOp:
  """UOp(op, dtype, src, arg) minus the class-call machinery (src must be a tuple): for the engine's hot paths."""
  return _intern(op, dtype, src, arg, arg if arg.__class__ is not float and arg.__class__ is not bool else _arg_key(arg))


def _with_src(n: UOp, src: tuple) -> UOp:
  """n with new sources (graph_rewrite's rebuild): n's arg is already in key form."""
  return _intern(n.op, n.dtype, src, n.arg, n._key[2])


def _intern(op: Ops, dtype: DType, src: tuple, arg, arg_key) -> UOp:
  # The key names the sources by id, not by the nodes: an entry must not keep its node's sources alive once that node
  # is gone (with the nodes in the keys, a dead graph went back one layer per cyclic collection). The ids are those of
  # live nodes while the entry's node lives, since it holds its sources; an entry whose node died is found dead below.
  n = len(src)
  if n == 2: key = (op, dtype, arg_key, id(src[0]), id(src[1]))
  elif n == 1: key = (op, dtype, arg_key, id(src[0]))
  elif n == 0: key = (op, dtype, arg_key)
  else: key = (op, dtype, arg_key, *map(id, src))
  if (ref := _cache.get(key)) is not None and (u := ref()) is not None: return u
  u = _new_fields(_UOpFields)
  u.op = op; u.dtype = dtype; u.src = src; u.arg = arg; u._key = key; u._made = None   # (read on every warm call's key)
  u.__class__ = UOp
  # setdefault, not a store: a thread that built the same node at the same moment keeps the one node made first
  if (ref := _cache.setdefault(key, w := _weakref(u))) is not w:
    if (first := ref()) is not None: return first
    _cache[key] = w  # the entry was a dead node's
  return u


def _below(root: UOp) -> dict[UOp, None]:
  """The nodes under root, sources first, without root; cached on root. A node whose own is cached brings it whole."""
  get = _UOpFields._topo.__get__
  order: dict[UOp, None] = {}
  stack = [(s, False) for s in reversed(root.src)]
  while stack:
    node, expanded = stack.pop()
    if node in order: continue
    if expanded: order[node] = None; continue
    try: order.update(get(node))   # keys already in order keep their place: the order stays sources-first
    except AttributeError: pass
    else:
      order[node] = None
      continue
    stack.append((node, True))
    for s in reversed(node.src):
      if s not in order: stack.append((s, False))
  _UOpFields._topo.__set__(root, order)
  return order


def _short(u: UOp) -> str:
  arg = "" if u.arg is None else f", arg={u.arg!r}"
  return f"UOp({u.op}, {u.dtype}{arg}, src=<{len(u.src)}>)"


MAX_INDENT = 40
_SHALLOW = 24  # height up to which a graph pickles as nested calls


def _walk_heights(root: UOp) -> tuple[list[UOp], dict[UOp, int]]:
  """Nodes under root, sources first, and each one's height (capped just above _SHALLOW); caches nothing."""
  height: dict[UOp, int] = {}
  order: list[UOp] = []
  stack = [(root, False)]
  while stack:
    node, expanded = stack.pop()
    if node in height: continue
    if expanded:
      height[node] = min(_SHALLOW + 1, 1 + max([height[s] for s in node.src], default=-1))
      order.append(node)
      continue
    stack.append((node, True))
    stack.extend((s, False) for s in node.src if s not in height)
  return order, height


def _from_flat(flat: list) -> UOp:
  """Rebuild (and re-intern) a graph pickled by UOp.__reduce__ as a flat list; the last entry is the root."""
  built: list[UOp] = []
  for op, dtype, src, arg in flat: built.append(UOp(op, dtype, tuple(built[s] if s.__class__ is int else s for s in src), arg))
  return built[-1]


def pretty(root: UOp) -> str:
  """Multi-line form of a graph; a node used more than once is labelled `%n` where first printed, then named by its label."""
  users: dict[UOp, int] = {}
  for n in root.toposort:
    for s in n.src: users[s] = users.get(s, 0) + 1
  labels: dict[UOp, str] = {}
  lines: list[str] = []
  stack: list[tuple[UOp | None, int]] = [(root, 0)]  # (None, depth) closes the source list opened at that depth
  while stack:
    node, depth = stack.pop()
    # indentation stops growing at MAX_INDENT levels (a deep chain would otherwise print quadratically many spaces);
    # deeper lines say their depth instead
    pad = "  " * depth if depth <= MAX_INDENT else "  " * MAX_INDENT + f"[{depth}] "
    if node is None: lines[-1] = lines[-1].rstrip(",") + ")),"; continue
    if node in labels: lines.append(f"{pad}{labels[node]},"); continue
    label = ""
    if users.get(node, 0) > 1:
      labels[node] = f"%{len(labels)}"
      label = f"{labels[node]} = "
    arg = "" if node.arg is None else f", arg={node.arg!r}"
    if not node.src: lines.append(f"{pad}{label}UOp({node.op}, {node.dtype}{arg}),"); continue
    lines.append(f"{pad}{label}UOp({node.op}, {node.dtype}{arg}, src=(")
    stack.append((None, depth))
    for s in reversed(node.src): stack.append((s, depth + 1))
  return "\n".join(lines).rstrip(",")


def _as_dtype_value(dtype: DType, value):
  if isinstance(dtype, PtrDType): raise TypeError(f"a constant cannot have pointer type {dtype}")
  if dtype.is_bool: return bool(value)
  if dtype.is_int:
    if isinstance(value, float) and not value.is_integer(): raise TypeError(f"constant {value!r} is not an integer of {dtype}")
    return int(value)
  if dtype.is_float: return float(value)
  return value


def _cached_up(root: UOp, slot, compute) -> Any:
  """root's value of a per-node cache `slot` whose value is `compute(node)` from its sources' values: filled sources
  first, so that nothing is computed recursively, and stopping at nodes already known (a node built over known ones,
  a rewrite's new index say, costs its own value, not a walk of its graph)."""
  get, put = slot.__get__, slot.__set__
  try: return get(root)
  except AttributeError: pass
  stack = [root]
  while stack:
    node = stack[-1]
    try: get(node); stack.pop(); continue
    except AttributeError: pass
    missing = []
    for s in node.src:
      try: get(s)
      except AttributeError: missing.append(s)
    if missing: stack.extend(missing); continue
    put(node, compute(node))
    stack.pop()
  return get(root)


def _loops(u: UOp) -> tuple:
  own = (u,) if u.op is Ops.RANGE else ()
  if len(u.src) == 1 and not own: return u.src[0]._loops   # most nodes: share the source's tuple
  return tuple(dict.fromkeys(r for s in u.src for r in s._loops)) + own if u.src else own


def _bounds(u: UOp) -> tuple:
  """(vmin, vmax) of u from the bounds of its sources, which are already cached."""
  op, s, dt = u.op, u.src, u.dtype
  if op is Ops.CONST: return (u.arg, u.arg)
  if op is Ops.DEFINE_VAR: return (u.arg[1], u.arg[2])
  if op is Ops.RANGE: return (0, s[0].vmax - 1) if s else (dtypes.min(dt), dtypes.max(dt))
  if op is Ops.SPECIAL: return (0, u.arg[1] - 1)
  if isinstance(dt, PtrDType) or dt.kind == 'v': return (None, None)
  b = [x._bounds_of() for x in s]
  if any(lo is None for lo, _ in b): return (dtypes.min(dt), dtypes.max(dt))
  if op is Ops.ADD: return _fit(dt, b[0][0] + b[1][0], b[0][1] + b[1][1])
  if op is Ops.MUL:
    if any(isinstance(v, float) and (math.isinf(v) or math.isnan(v)) for v in b[0] + b[1]): return (dtypes.min(dt), dtypes.max(dt))
    prods = [x * y for x in b[0] for y in b[1]]
    return _fit(dt, min(prods), max(prods))
  if op is Ops.NEG: return (-b[0][1], -b[0][0])
  if op is Ops.MAX: return (max(b[0][0], b[1][0]), max(b[0][1], b[1][1]))
  if op is Ops.WHERE:
    if b[0] == (True, True): return b[1]
    if b[0] == (False, False): return b[2]
    return (min(b[1][0], b[2][0]), max(b[1][1], b[2][1]))
  if dt.is_bool:
    if op is Ops.CMPLT:
      if b[0][1] < b[1][0]: return (True, True)
      if b[0][0] >= b[1][1]: return (False, False)
    elif op is Ops.CMPNE:
      if b[0][1] < b[1][0] or b[0][0] > b[1][1]: return (True, True)
      if b[0][0] == b[0][1] == b[1][0] == b[1][1]: return (False, False)
    elif op is Ops.AND: return (b[0][0] and b[1][0], b[0][1] and b[1][1])
    elif op is Ops.OR: return (b[0][0] or b[1][0], b[0][1] or b[1][1])
    elif op is Ops.CAST: return (bool(b[0][0]) if b[0][0] == b[0][1] else False, bool(b[0][1]) or b[0][0] != 0)
    return (False, True)
  if dt.is_int:
    lo_t, hi_t = dtypes.min(dt), dtypes.max(dt)
    if op is Ops.IDIV and s[1].op is Ops.CONST and s[1].arg > 0:  # C division truncates: monotonic in the dividend
      c = s[1].arg
      return (_trunc_div(b[0][0], c), _trunc_div(b[0][1], c))
    if op is Ops.MOD and s[1].op is Ops.CONST and s[1].arg > 0:
      c = s[1].arg
      if b[0][0] >= 0: return (b[0][0] % c, b[0][1] % c) if b[0][1] // c == b[0][0] // c else (0, c - 1)
      return (max(b[0][0], -(c - 1)), min(max(b[0][1], 0), c - 1))
    if op is Ops.CAST:  # C wraps an integer that does not fit (and a float out of range is undefined): no bound then
      lo, hi = _int_or(b[0][0], None), _int_or(b[0][1], None)
      return (lo, hi) if lo is not None and hi is not None and lo_t <= lo and hi <= hi_t else (lo_t, hi_t)
    if op in (Ops.AND,) and b[0][0] >= 0 and b[1][0] >= 0: return (0, min(b[0][1], b[1][1]))
    # (non-negative operands: no bit above the larger one's highest)
    if op in (Ops.OR, Ops.XOR) and b[0][0] >= 0 and b[1][0] >= 0: return (0, (1 << max(b[0][1], b[1][1]).bit_length()) - 1)
    return (lo_t, hi_t)
  return (dtypes.min(dt), dtypes.max(dt))


def _fit(dt: DType, lo, hi) -> tuple:
  """Bounds of an integer result that may wrap around: the whole range of the dtype once it leaves that range."""
  if dt.is_int and (lo < dtypes.min(dt) or hi > dtypes.max(dt)): return (dtypes.min(dt), dtypes.max(dt))
  return (lo, hi)


def _trunc_div(a: int, c: int) -> int: return -((-a) // c) if a < 0 else a // c
def _int_or(x, default):
  return int(x) if isinstance(x, (int, bool)) or (isinstance(x, float) and math.isfinite(x)) else default
