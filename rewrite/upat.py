"""UPat: a pattern over UOps. A pattern says what a node must look like; a rule says what it becomes."""
from __future__ import annotations
import itertools, os, sys
from typing import Any
from .ops import Ops, GroupOp
from .dtypes import DType, PtrDType

_ANY = object()  # "arg not constrained" (None is a real arg value)
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))


def caller_location() -> str:
  """file:line of the first frame outside the engine: where the user wrote the pattern or rule."""
  f = sys._getframe(1)
  while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) == _ENGINE_DIR: f = f.f_back
  return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


class UPat:
  """Matches a UOp by op (or set of ops), dtype (or set), arg, and sources.

  src: a tuple matches the sources in order; a list matches them in any order (commutative); a single UPat must
  match every source. `name` captures the node and passes it to the rule by keyword; one name used twice must bind
  one node. Alternatives: UPat.any(p1, p2, ...).
  """
  __slots__ = ("op", "dtype", "arg", "name", "src", "src_kind", "allow_any_len", "alternatives", "location")

  def __init__(self, op: Ops | tuple[Ops, ...] | set[Ops] | frozenset[Ops] | None = None,
               dtype: DType | tuple[DType, ...] | set[DType] | None = None,
               src: tuple[UPat, ...] | list[UPat] | UPat | None = None, arg: Any = _ANY, name: str | None = None,
               allow_any_len: bool = False):
    self.location = None
    ops = op if op is None or isinstance(op, (tuple, list, set, frozenset)) else (op,)
    if ops is not None:
      ops = tuple(ops)
      bad = [o for o in ops if not isinstance(o, Ops)]
      if bad: raise ValueError(f"{caller_location()}: UPat has unknown op {bad[0]!r}; ops are members of rewrite.Ops")
      ops = frozenset(ops)
    self.op: frozenset[Ops] | None = ops
    dts = dtype if dtype is None or isinstance(dtype, (tuple, list, set, frozenset)) else (dtype,)
    if dts is not None:
      dts = tuple(dts)
      bad = [d for d in dts if not isinstance(d, (DType, PtrDType))]
      if bad: raise ValueError(f"{caller_location()}: UPat has unknown dtype {bad[0]!r}; dtypes are members of rewrite.dtypes")
      dts = frozenset(dts)
    self.dtype: frozenset | None = dts
    self.arg, self.name, self.allow_any_len, self.alternatives = arg, name, allow_any_len, None
    if src is None: self.src, self.src_kind = None, None
    elif isinstance(src, UPat): self.src, self.src_kind = (src,), "each"
    elif isinstance(src, list): self.src, self.src_kind = tuple(src), "any_order"
    elif isinstance(src, tuple): self.src, self.src_kind = src, "in_order"
    else: raise ValueError(f"{caller_location()}: UPat src must be a tuple, a list or a UPat, not {type(src).__name__}")
    for s in self.src or ():
      if not isinstance(s, UPat): raise ValueError(f"{caller_location()}: UPat source {s!r} is not a UPat")

  # ---- constructors ----
  # The short forms take every argument of the long form but the one they fix (the op, or the arg of const):
  # `UPat.cvar("c", arg=1000)` pins a constant's value and still binds it to a name.
  @staticmethod
  def var(name: str | None = None, dtype: DType | tuple | None = None, src: tuple | list | UPat | None = None,
          arg: Any = _ANY, allow_any_len: bool = False) -> UPat:
    """Any node (of `dtype`, with `src`, with `arg` when given), bound to `name`."""
    return UPat(None, dtype, src, arg, name, allow_any_len)
  @staticmethod
  def cvar(name: str | None = None, dtype: DType | tuple | None = None, arg: Any = _ANY) -> UPat:
    """A constant (of `dtype`, of value `arg` when given), bound to `name`."""
    return UPat(Ops.CONST, dtype, arg=arg, name=name)
  @staticmethod
  def const(dtype: DType | tuple | None, value, name: str | None = None) -> UPat:
    """The constant `value` (of `dtype` when not None), bound to `name` when given."""
    return UPat(Ops.CONST, dtype, arg=value, name=name)
  @staticmethod
  def any(*pats: UPat) -> UPat:
    """Matches when any of `pats` matches, tried in order."""
    p = UPat()
    p.alternatives = pats
    return p

  # ---- operator sugar: commutative ops build any-order patterns ----
  @staticmethod
  def _lift(x) -> UPat: return x if isinstance(x, UPat) else UPat.const(None, x)
  def _binary(self, op: Ops, other, reverse=False) -> UPat:
    srcs = (UPat._lift(other), self) if reverse else (self, UPat._lift(other))
    return UPat(op, src=list(srcs) if op in GroupOp.Commutative else srcs)
  def __add__(self, x): return self._binary(Ops.ADD, x)
  def __radd__(self, x): return self._binary(Ops.ADD, x, True)
  def __mul__(self, x): return self._binary(Ops.MUL, x)
  def __rmul__(self, x): return self._binary(Ops.MUL, x, True)
  def __floordiv__(self, x): return self._binary(Ops.IDIV, x)
  def __mod__(self, x): return self._binary(Ops.MOD, x)
  def __truediv__(self, x): return self._binary(Ops.FDIV, x)
  def __lt__(self, x): return self._binary(Ops.CMPLT, x)
  def __and__(self, x): return self._binary(Ops.AND, x)
  def __or__(self, x): return self._binary(Ops.OR, x)
  def __xor__(self, x): return self._binary(Ops.XOR, x)
  def ne(self, x): return self._binary(Ops.CMPNE, x)
  def maximum(self, x): return self._binary(Ops.MAX, x)
  def where(self, a, b): return UPat(Ops.WHERE, src=(self, UPat._lift(a), UPat._lift(b)))
  def cast(self, dtype=None): return UPat(Ops.CAST, dtype, src=(self,))
  def named(self, name: str) -> UPat:
    p = UPat(self.op, self.dtype, None, self.arg, name, self.allow_any_len)
    p.src, p.src_kind, p.alternatives = self.src, self.src_kind, self.alternatives
    return p

  # ---- introspection ----
  def expand_alternatives(self) -> list[UPat]:
    """This pattern as a list of patterns without UPat.any, in the order they are tried."""
    if self.alternatives is not None:
      out = [a2 for a in self.alternatives for a2 in a.expand_alternatives()]
      return [a.named(self.name) if self.name and a.name is None else a for a in out]
    if not self.src: return [self]
    out = []
    for combo in itertools.product(*(s.expand_alternatives() for s in self.src)):
      p = UPat(self.op, self.dtype, None, self.arg, self.name, self.allow_any_len)
      p.src, p.src_kind = tuple(combo), self.src_kind
      out.append(p)
    return out

  def names(self) -> set[str]:
    out = {self.name} if self.name else set()
    for a in self.alternatives or (): out |= a.names()
    for s in self.src or (): out |= s.names()
    return out

  def __repr__(self) -> str:
    if self.alternatives is not None: return f"UPat.any({', '.join(map(repr, self.alternatives))})"
    if self.op == frozenset({Ops.CONST}) and self.arg is not _ANY and not self.name and not self.src: return repr(self.arg)
    if self.op is None and self.src is None and self.arg is _ANY: return self.name or "_"
    ops = "|".join(sorted(o.name for o in self.op)) if self.op else "_"
    s = ops
    if self.src is not None:
      inner = ", ".join(map(repr, self.src))
      s += {"in_order": f"({inner}{',' if len(self.src) == 1 else ''})", "any_order": f"[{inner}]", "each": f"(each {inner})"}[self.src_kind]
    if self.arg is not _ANY: s += f"{{arg={self.arg!r}}}"
    return f"{s}:{self.name}" if self.name else s
