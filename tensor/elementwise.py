"""Elementwise tensor operations: arithmetic, comparisons, logic and math functions, with numpy broadcasting.

Everything is built from the ALU ops of rewrite/ops.py: exp(x) is exp2(x * log2(e)), a - b is a + (-b), tanh comes
from the sigmoid, and numpy's floor division comes from C's truncating IDIV. Operands are first promoted to one dtype
(promotion.py) and broadcast to one shape with VIEWs (reshape + expand), because the graph's ALU nodes take sources of
one shape and one dtype.
"""
from __future__ import annotations
import math
import numpy as np
from rewrite import UOp, Ops, DType, dtypes
from .recorded import recorded
from .promotion import result_dtype, promoted, with_scalar, is_scalar, py_scalar, check_fits, out_of_range

LOG2_E, LN_2 = math.log2(math.e), math.log(2)


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
  """numpy's broadcast: align shapes on the right; each dimension is equal or 1."""
  if len(shapes) == 2 and len(a := shapes[0]) == len(b := shapes[1]):   # (most calls: two shapes of one length)
    out = []
    for x, y in zip(a, b):
      if x == y or y == 1: out.append(x)
      elif x == 1: out.append(y)
      else: break
    else: return tuple(out)
  ndim = max(len(s) for s in shapes)
  padded = [(1,) * (ndim - len(s)) + tuple(s) for s in shapes]
  out = []
  for dims in zip(*padded):
    sizes = {d for d in dims if d != 1}
    if len(sizes) > 1: raise ValueError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} cannot be broadcast together")
    out.append(sizes.pop() if sizes else 1)
  return tuple(out)


def operands(*xs, dtype: DType | None = None, like=None) -> list:
  """Tensors and scalars as tensors of one device, one shape and one dtype (the promoted one unless `dtype`).
  Scalars become constants on the device of the first tensor (or of `like`, which also joins the broadcast)."""
  if like is None and len(xs) == 2 and (pair := _two_operands(*xs, dtype)) is not None: return pair
  like = like if like is not None else next(x for x in xs if hasattr(x, "uop"))
  xs = [x if x.__class__ is like.__class__ else _as_operand(x, like) for x in xs]
  scalar = [is_scalar(x) for x in xs]
  own = [x for x, s in zip(xs, scalar) if not s]
  # each operand once (`like` is usually one of xs), in the order the user gave them
  tensors = own if any(x is like for x in own) else [like] + own
  if any(t.device != like.device for t in tensors):
    raise ValueError(f"operands live on different devices ({', '.join(t.device for t in tensors)}): move them with .to()")
  dt = dtype or promoted(own, [x for x, s in zip(xs, scalar) if s])
  shape = tensors[0].shape
  if any(t.shape != shape for t in tensors): shape = broadcast_shape(*(t.shape for t in tensors))
  return [like._const(check_fits(x, dt), dt, shape) if s else x.cast(dt)._broadcast(shape) for x, s in zip(xs, scalar)]


def _two_operands(a, b, dtype: DType | None) -> list | None:
  """`operands(a, b)` in the cases almost every call is (two tensors of one dtype and device; a tensor and a Python
  int or float): the same result without the general path's lists (a warm call builds its graph anew every time).
  None for any other case."""
  ca, cb = a.__class__, b.__class__
  if ca is cb:
    if not isinstance(a, ElementwiseMixin): return None
    dt = a.uop.dtype
    if b.uop.dtype is not dt or (dtype is not None and dtype is not dt) or a.device != b.device: return None
    if a.shape == b.shape: return [a, b]
    shape = broadcast_shape(a.shape, b.shape)
    return [a._broadcast(shape), b._broadcast(shape)]
  if cb is float or cb is int: t, x, scalar_last = a, b, True
  elif ca is float or ca is int: t, x, scalar_last = b, a, False
  else: return None
  if not isinstance(t, ElementwiseMixin): return None
  dt = dtype or t.uop.dtype
  # a float meets a float tensor in its dtype and fits it (as with_scalar and check_fits say): no need to ask them
  c = t._const(x, dt, t.shape) if cb is float and dt.is_float and dt is t.uop.dtype else \
    t._const(check_fits(x, dt := dtype or with_scalar(t.uop.dtype, x)), dt, t.shape)
  return [t.cast(dt), c] if scalar_last else [c, t.cast(dt)]


def _as_operand(x, like):
  """A scalar stays a (weak) scalar; arrays and lists become tensors on `like`'s device."""
  if is_scalar(x) or hasattr(x, "uop"): return x
  if isinstance(x, (list, tuple, np.ndarray)): return type(like)(x, device=like.device)
  raise TypeError(f"cannot combine a Tensor with {type(x).__name__} {x!r}")


def _is_operand(x) -> bool: return is_scalar(x) or hasattr(x, "uop") or isinstance(x, (list, tuple, np.ndarray))


def _alu(op: Ops, *srcs) -> object:
  uops = tuple([s.uop for s in srcs])
  # bfloat16 arithmetic happens in float32, rounded back after each operation (torch's results; renderers then only
  # convert, load, store and select bfloat16); a WHERE only selects, so its values stay bfloat16
  if op is not Ops.WHERE and dtypes.bfloat16 in [u.dtype for u in uops]:
    out = _alu(op, *(s.float() if s.dtype is dtypes.bfloat16 else s for s in srcs))
    return out if out.dtype.is_bool else out.cast(dtypes.bfloat16)
  dtype = dtypes.bool if op is Ops.CMPLT or op is Ops.CMPNE else uops[-1].dtype if op is Ops.WHERE else uops[0].dtype
  return srcs[0]._new(UOp(op, dtype, uops))


def _not(b):  # logical not of a bool tensor
  return _alu(Ops.CMPNE, b, b._const(True))


def _isnan(x): return _alu(Ops.CMPNE, x, x)


class ElementwiseMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields
  # ---- arithmetic ----
  def add(self, x, reverse=False):
    a, b = operands(*((x, self) if reverse else (self, x)))
    return _alu(Ops.OR if a.dtype.is_bool else Ops.ADD, a, b)

  def sub(self, x, reverse=False):
    a, b = operands(*((x, self) if reverse else (self, x)))
    if a.dtype.is_bool: raise TypeError("subtracting bool tensors is not supported (numpy neither); use logical_xor or ^")
    return _alu(Ops.ADD, a, b.neg())

  def mul(self, x, reverse=False):
    a, b = operands(*((x, self) if reverse else (self, x)))
    return _alu(Ops.AND if a.dtype.is_bool else Ops.MUL, a, b)

  def div(self, x, reverse=False):
    """True division; integers divide as float32 (the default float), like torch."""
    dt = with_scalar(self.dtype, x) if x.__class__ is float or x.__class__ is int else result_dtype((self, x))
    a, b = operands(*((x, self) if reverse else (self, x)), dtype=dt if dt.is_float else dtypes.default_float)
    return _alu(Ops.FDIV, a, b)

  def floordiv(self, x, reverse=False):
    """numpy's floor division: rounds toward -inf; an integer divided by 0 gives 0, as numpy does."""
    a, b = operands(*((x, self) if reverse else (self, x)), dtype=_arith_dtype(self, x))
    if a.dtype.is_float: return (a / b).floor()
    b_raw = py_scalar(x) if is_scalar(x) and not reverse else None
    if b_raw is not None and b_raw > 0:  # a positive constant divisor needs no guard, and only a < 0 rounds
      q = _alu(Ops.IDIV, a, b)
      return q if a.dtype.is_unsigned else (a < 0).where(_alu(Ops.MOD, a, b).ne(0).where(q - 1, q), q)
    zero, minus_one, safe_b = _guard_divisor(b)
    q, r = _alu(Ops.IDIV, a, safe_b), _alu(Ops.MOD, a, safe_b)
    if a.dtype.is_unsigned: return zero.where(0, q)
    q = (r.ne(0) & ((r < 0).ne(safe_b < 0))).where(q - 1, q)
    return zero.where(0, minus_one.where(-a, q))

  def mod(self, x, reverse=False):
    """numpy's remainder: it takes the divisor's sign; an integer modulo 0 gives 0, as numpy does."""
    a, b = operands(*((x, self) if reverse else (self, x)), dtype=_arith_dtype(self, x))
    if a.dtype.is_float: return a - (a / b).floor() * b
    zero, _, safe_b = _guard_divisor(b)  # x % -1 is x % 1: both 0
    r = _alu(Ops.MOD, a, safe_b)
    if not a.dtype.is_unsigned: r = (r.ne(0) & ((r < 0).ne(safe_b < 0))).where(r + safe_b, r)
    return zero.where(0, r)

  def pow(self, x, reverse=False):
    """x ** y. Small integer exponents multiply (exact), 0.5 is sqrt; otherwise exp2(y * log2|x|) with numpy's signs:
    a negative base gives a real result only for an integer exponent, and x ** 0 is 1."""
    if not reverse and is_scalar(x) and not isinstance(py_scalar(x), bool):
      e = py_scalar(x)
      if isinstance(e, int) and e < 0 and not self.dtype.is_float:
        raise ValueError(f"integer tensor ** {e}: integers to negative integer powers are not allowed (numpy neither); "
                         f"use a float tensor")
      base = self if result_dtype((self, e)) is self.dtype else self.cast(result_dtype((self, e)))
      if float(e).is_integer() and abs(e) <= 16 and (e >= 0 or base.dtype.is_float):
        out = _int_power(base, int(e))
        return self._new_unless_self(out)   # (x ** 1)
      if e == 0.5 and base.dtype.is_float: return base.sqrt()
    a, y = operands(*((x, self) if reverse else (self, x)), dtype=_arith_dtype(self, x))
    if not a.dtype.is_float:  # integer ** integer: square-and-multiply over the exponent's bits (exact, wrapping)
      acc, sq = a._const(1), a
      for bit in range(min(8 * a.dtype.itemsize - 1, 31)):  # an exponent past 2**31 overflows any base but 0, 1, -1
        acc = ((y >> bit) & 1).ne(0).where(acc * sq, acc)
        sq = sq * sq
      return (y < 0).where(0, acc)  # numpy raises for negative integer powers; C-style truncation gives 0 (mostly)
    return _upcast_half(_float_pow, a, y)

  def neg(self):
    if self.dtype.is_bool: raise TypeError("negating a bool tensor is not supported (numpy neither); use logical_not()")
    if self.dtype.is_float: return _alu(Ops.NEG, self)
    # unsigned: multiplying by the all-ones value is two's complement negation, which is what wrapping means
    return _alu(Ops.MUL, self, self._const(dtypes.max(self.dtype) if self.dtype.is_unsigned else -1))

  __add__ = add
  def __radd__(self, x): return self.add(x, reverse=True)
  __sub__ = sub
  def __rsub__(self, x): return self.sub(x, reverse=True)
  __mul__ = mul
  def __rmul__(self, x): return self.mul(x, reverse=True)
  __truediv__ = div
  def __rtruediv__(self, x): return self.div(x, reverse=True)
  __floordiv__ = floordiv
  def __rfloordiv__(self, x): return self.floordiv(x, reverse=True)
  __mod__ = mod
  def __rmod__(self, x): return self.mod(x, reverse=True)
  __pow__ = pow
  def __rpow__(self, x): return self.pow(x, reverse=True)
  def __neg__(self): return self.neg()
  def __pos__(self): return self
  def __abs__(self): return self.abs()

  # ---- comparisons (bool results; NaN compares like numpy: unequal to all, not ordered) ----
  def __lt__(self, x): return _compare(self, x, lambda a, b: _alu(Ops.CMPLT, a, b), true_above=True)
  def __gt__(self, x): return _compare(self, x, lambda a, b: _alu(Ops.CMPLT, b, a), true_above=False)
  def __le__(self, x): return _compare(self, x, _less_equal, true_above=True)
  def __ge__(self, x): return _compare(self, x, lambda a, b: _less_equal(b, a), true_above=False)
  def ne(self, x): return _compare(self, x, lambda a, b: _alu(Ops.CMPNE, a, b), true_above=None)
  def eq(self, x): return _not(self.ne(x))
  # == with something that is no operand (None, a string) is plain "not equal", so `t in [None]` still works
  def __eq__(self, x): return self.eq(x) if _is_operand(x) else NotImplemented  # type: ignore[override]
  def __ne__(self, x): return self.ne(x) if _is_operand(x) else NotImplemented  # type: ignore[override]

  # ---- logic and bits (bool and integer tensors) ----
  def _bitwise(self, op: Ops, x, reverse=False):
    a, b = operands(*((x, self) if reverse else (self, x)))
    if a.dtype.is_float: raise TypeError(f"{op.name.lower()} of {a.dtype.name} tensors: bitwise ops need bool or integer tensors")
    return _alu(op, a, b)
  def __and__(self, x): return self._bitwise(Ops.AND, x)
  def __rand__(self, x): return self._bitwise(Ops.AND, x, True)
  def __or__(self, x): return self._bitwise(Ops.OR, x)
  def __ror__(self, x): return self._bitwise(Ops.OR, x, True)
  def __xor__(self, x): return self._bitwise(Ops.XOR, x)
  def __rxor__(self, x): return self._bitwise(Ops.XOR, x, True)
  def __lshift__(self, x): return self._bitwise(Ops.SHL, x)
  def __rshift__(self, x): return self._bitwise(Ops.SHR, x)
  def __invert__(self):
    if self.dtype.is_bool: return _not(self)
    if self.dtype.is_float: raise TypeError(f"~ of a {self.dtype.name} tensor: bitwise not needs bool or integer tensors")
    return _alu(Ops.XOR, self, self._const(dtypes.max(self.dtype) if self.dtype.is_unsigned else -1))
  def logical_not(self): return _not(self) if self.dtype.is_bool else self == 0
  def logical_and(self, x): return self.bool() & (x.bool() if hasattr(x, "uop") else bool(x))
  def logical_or(self, x): return self.bool() | (x.bool() if hasattr(x, "uop") else bool(x))
  def isnan(self): return _isnan(self) if self.dtype.is_float else self._const(False, dtypes.bool)

  @recorded
  def where(self, x, y):
    """`x` where this (condition) tensor is true, `y` elsewhere; all three broadcast together."""
    cond = self if self.dtype.is_bool else self.ne(0)
    a, b = operands(x, y, like=cond)
    return _alu(Ops.WHERE, cond.broadcast_to(a.shape), a, b)

  def maximum(self, x):
    a, b = operands(self, x)
    if a.dtype.is_bool: return _alu(Ops.OR, a, b)
    if not a.dtype.is_float: return _alu(Ops.MAX, a, b)
    return _isnan(b).where(b, (a < b).where(b, a))  # a NaN on either side wins, as in numpy
  def minimum(self, x):
    a, b = operands(self, x)
    if a.dtype.is_bool: return _alu(Ops.AND, a, b)
    if not a.dtype.is_float: return (b < a).where(b, a)
    return _isnan(b).where(b, (b < a).where(b, a))
  def clip(self, lo=None, hi=None):
    """Values below lo become lo, above hi become hi; NaN stays NaN. Either bound may be None."""
    if lo is None and hi is None: raise ValueError("clip needs lo or hi")
    # an integer bound beyond the dtype on its own side cannot bind (numpy drops it too); one beyond the other side
    # raises OverflowError in where()
    if lo is not None and out_of_range(lo, self.dtype) and lo < 0: lo = None
    if hi is not None and out_of_range(hi, self.dtype) and hi > 0: hi = None
    out = self
    if lo is not None: out = (out < lo).where(lo, out)
    if hi is not None: out = (out > hi).where(hi, out)
    return self._new_unless_self(out)   # (no bound binds)
  def abs(self):
    if self.dtype.is_bool or self.dtype.is_unsigned: return self.clone()   # (every value as it was: a copy, numpy's)
    return (self < 0).where(-self, self)
  def sign(self):
    if self.dtype.is_unsigned: return (self > 0).cast(self.dtype)
    return (self > 0).where(1, (self < 0).where(-1, self * 0)).cast(self.dtype)  # * 0 keeps NaN and the zero's sign

  # ---- math functions (integers compute in float32; 16-bit floats compute in float32 and round once at the end) ----
  def exp2(self): return _upcast_half(lambda x: _alu(Ops.EXP2, x), self)
  def log2(self): return _upcast_half(lambda x: _alu(Ops.LOG2, x), self)
  def exp(self): return _upcast_half(lambda x: _alu(Ops.EXP2, x * LOG2_E), self)
  def log(self): return _upcast_half(lambda x: _alu(Ops.LOG2, x) * LN_2, self)
  def sqrt(self): return _upcast_half(lambda x: _alu(Ops.SQRT, x), self)
  def rsqrt(self): return _upcast_half(lambda x: _alu(Ops.RECIP, _alu(Ops.SQRT, x)), self)
  def reciprocal(self): return _upcast_half(lambda x: _alu(Ops.RECIP, x), self)
  def sin(self): return _upcast_half(lambda x: _alu(Ops.SIN, x), self)
  def cos(self): return _upcast_half(_cos, self)
  def tan(self): return _upcast_half(lambda x: _alu(Ops.SIN, x) / _cos(x), self)
  @recorded
  def sigmoid(self): return _upcast_half(_sigmoid, self)
  @recorded
  def tanh(self): return _upcast_half(lambda x: _sigmoid(x * 2) * 2 - 1, self)
  @recorded
  def relu(self): return (self < 0).where(0, self)  # NaN stays NaN, as in torch
  @recorded
  def silu(self): return _upcast_half(lambda x: x * _sigmoid(x), self)
  @recorded
  def gelu(self):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as x sigmoid(2 sqrt(2/pi)
    (x + 0.044715 x^3)) (the same function: 1 + tanh(u) = 2 sigmoid(2u)), the sigmoid's exponent's factors one constant:
    half the operations of the tanh's form (a product's epilogue on tensor cores is bound by them), and no cancellation
    of 1 + tanh(u) where tanh(u) is near -1."""
    k = -2 * math.sqrt(2 / math.pi) * LOG2_E
    # (the sigmoid in the form whose gradient rules/gradient.py takes as one op: 1 / (1 + 2^(y * k)))
    return _upcast_half(lambda x: x * _alu(Ops.RECIP, _alu(Ops.EXP2, x * (1 + 0.044715 * x * x) * k) + 1), self)
  def square(self): return self * self

  def floor(self):
    """Round toward -inf (floats); C's cast truncates toward 0, so step down where that went up. Values of 2**52 and
    more are integers already, and passing them (and NaN, inf) through keeps the cast in range."""
    if not self.dtype.is_float: return self.clone()   # (integers are whole already: a copy, as numpy's)
    t = self.cast(dtypes.int64).cast(self.dtype)
    return (self.abs() < 2.0 ** 52).where((t > self).where(t - 1, t), self)
  def ceil(self): return -((-self).floor()) if self.dtype.is_float else self.clone()
  def trunc(self):
    if not self.dtype.is_float: return self.clone()
    return (self.abs() < 2.0 ** 52).where(self.cast(dtypes.int64).cast(self.dtype), self)


def _arith_dtype(a, b) -> DType:
  """Arithmetic that has no bool meaning (//, %, **) computes bools as the default int."""
  dt = result_dtype((a, b))
  return dtypes.default_int if dt.is_bool else dt


def _guard_divisor(b):
  """(b == 0, b == -1, b with both replaced by 1). C's integer division traps (SIGFPE on x86) on a zero divisor and
  on MIN / -1, where numpy gives 0 and a wrapped -MIN; dividing by 1 instead keeps every kernel safe."""
  zero = b == 0
  if b.dtype.is_unsigned: return zero, None, zero.where(1, b)
  minus_one = b == -1
  return zero, minus_one, (zero | minus_one).where(1, b)


def _upcast_half(fn, *xs):
  """fn over float operands: integers become float32; float16 and bfloat16 compute in float32 (more accurate than a
  chain of half roundings, and renderable everywhere) and are rounded back once."""
  dt = xs[0].dtype
  work = dt if dt in (dtypes.float32, dtypes.float64) else dtypes.float32
  out = fn(*(x.cast(work) for x in xs))
  return out.cast(dt) if dt.is_half else out


def _sigmoid(x):
  # 1 / (1 + e^-x): exp2 overflows to inf for very negative x, and RECIP(inf) is the right limit 0
  return _alu(Ops.RECIP, _alu(Ops.EXP2, x * -LOG2_E) + 1)


def _cos(x):
  # 1 - 2 sin^2(x/2): x/2 is exact, where sin(x + pi/2) would round the shifted argument (an error of half an ulp
  # of x, large for large x)
  h = _alu(Ops.SIN, x * 0.5)
  return 1 - h * h * 2


def _compare(t, x, compare, true_above: bool | None):
  """compare(t, x) over their promoted operands. A Python int beyond that dtype is compared exactly, as in numpy 2:
  every element lies below it (or above it), so the answer is one constant, `true_above` when x is above the range
  (its negation when below; None for !=, always true)."""
  if is_scalar(x) and out_of_range(x, dt := result_dtype((t, x))):
    answer = True if true_above is None else true_above == (py_scalar(x) > dtypes.max(dt))
    return t._const(answer, dtypes.bool)
  return compare(*operands(t, x))


def _less_equal(a, b):
  if a.dtype.is_float: return (a < b) | _not(_alu(Ops.CMPNE, a, b))  # not(b < a) would call NaN <= x true
  return _not(_alu(Ops.CMPLT, b, a))


def _int_power(x, n: int):
  """x ** n for an integer n, by square-and-multiply; negative n is the reciprocal (floats only)."""
  if n == 0: return x._const(1)
  result, sq, k = None, x, abs(n)
  while k:
    if k & 1: result = sq if result is None else result * sq
    k >>= 1
    if k: sq = sq * sq
  return result.reciprocal() if n < 0 else result


def _float_pow(x, y):
  ax = x.abs()
  mag = _alu(Ops.EXP2, y * _alu(Ops.LOG2, ax))
  # the exponent's parity decides a negative base's sign; past 2**53 every float is an even integer
  big = y.abs() >= 2.0 ** 53
  yi = big.where(0, y).cast(dtypes.int64)
  y_int = big | (yi.cast(y.dtype) == y)
  y_odd = _not(big) & ((yi & 1) == 1)
  signed = (x < 0).where(y_int.where(y_odd.where(-mag, mag), math.nan), mag)
  return ((y == 0) | (x == 1)).where(1.0, signed)
