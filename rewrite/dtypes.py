"""Scalar and pointer data types: itemsize, numpy equivalent and C name for each."""
from __future__ import annotations
from dataclasses import dataclass
import functools
import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
  """A scalar type. Each exists once (compared by identity; unpickling returns the same object)."""
  name: str
  itemsize: int
  kind: str            # 'b' bool, 'i' signed int, 'u' unsigned int, 'f' float
  cname: str
  np_name: str | None  # numpy dtype name, None where numpy has no equivalent (bfloat16)
  count: int = 1       # lanes: a vector of `count` scalars (`vec`); 1 for a scalar

  @property
  def np(self) -> np.dtype | None: return None if self.np_name is None else np.dtype(self.np_name)
  @property
  def is_float(self) -> bool: return self.kind == 'f'
  @property
  def is_half(self) -> bool:
    """A 16-bit float (float16, bfloat16): computed in float32 and rounded back where a chain would lose accuracy."""
    return self.kind == 'f' and self.itemsize == 2
  @property
  def is_int(self) -> bool: return self.kind in 'iu'
  @property
  def is_unsigned(self) -> bool: return self.kind == 'u'
  @property
  def is_bool(self) -> bool: return self.kind == 'b'
  def ptr(self, addrspace: str = "global") -> PtrDType: return _ptr(self, addrspace)
  def vec(self, count: int) -> DType:
    """The vector of `count` lanes of this scalar type (one register of a SIMD unit); `scalar` goes back."""
    if self.count != 1: raise TypeError(f"{self} is a vector already")
    return self if count == 1 else _vec(self, count)
  @property
  def scalar(self) -> DType: return getattr(dtypes, self.name.split("x")[0]) if self.count > 1 else self
  def __reduce__(self): return (_vec, (self.scalar, self.count)) if self.count > 1 else (getattr, (dtypes, self.name))
  def __repr__(self): return f"dtypes.{self.name}"


@functools.cache
def _vec(base: DType, count: int) -> DType:
  return DType(f"{base.name}x{count}", base.itemsize * count, base.kind, f"{base.cname.replace(' ', '_')}x{count}", None, count)


@functools.cache
def _ptr(base: DType, addrspace: str) -> PtrDType: return PtrDType(base, addrspace)


@dataclass(frozen=True, eq=False)
class PtrDType:
  """A pointer to `base` elements in an address space ('global', 'local' or 'reg').

  Each exists once, made by `_ptr` (`DType.ptr`, unpickling): compared by identity, hashed by id in C. A value
  hash would be a Python call in every construction of a node of pointer type (its key hashes the dtype)."""
  base: DType
  addrspace: str = "global"

  @property
  def name(self) -> str: return f"{self.base.name}*"
  @property
  def itemsize(self) -> int: return 8
  @property
  def cname(self) -> str: return f"{self.base.cname}*"
  kind = 'p'
  count = 1
  is_float = is_int = is_unsigned = is_bool = False
  def __reduce__(self): return _ptr, (self.base, self.addrspace)
  def __repr__(self): return f"{self.base!r}.ptr({self.addrspace!r})"


class dtypes:
  bool = DType("bool", 1, 'b', "bool", "bool")
  int8 = DType("int8", 1, 'i', "signed char", "int8")
  int16 = DType("int16", 2, 'i', "short", "int16")
  int32 = DType("int32", 4, 'i', "int", "int32")
  int64 = DType("int64", 8, 'i', "long long", "int64")
  uint8 = DType("uint8", 1, 'u', "unsigned char", "uint8")
  uint16 = DType("uint16", 2, 'u', "unsigned short", "uint16")
  uint32 = DType("uint32", 4, 'u', "unsigned int", "uint32")
  uint64 = DType("uint64", 8, 'u', "unsigned long long", "uint64")
  float16 = DType("float16", 2, 'f', "half", "float16")
  # stored as its 16 bits (float32's top half); arithmetic on it happens in float32 (tensor/elementwise.py), as torch
  # does, so a renderer only loads, stores, selects and converts it (bf16_bits / bf16_to_float32 on the host)
  bfloat16 = DType("bfloat16", 2, 'f', "g_bf16", None)
  float32 = DType("float32", 4, 'f', "float", "float32")
  float64 = DType("float64", 8, 'f', "double", "float64")
  void = DType("void", 0, 'v', "void", None)
  # the integer of index arithmetic (loop counters, offsets): 64-bit, so that bounds of index expressions are exact;
  # the index_width stage (rules/index_width.py) gives each index node int32 or int64 before it is rendered
  index = DType("index", 8, 'i', "long long", "int64")
  default_float = float32
  default_int = int32

  @staticmethod
  def all() -> list[DType]:
    return [v for v in vars(dtypes).values() if isinstance(v, DType) and v.kind != 'v']

  @staticmethod
  def from_numpy(dt) -> DType:
    # a dict of np.dtype: every tensor made from an array and every `.numpy()` asks (numpy's `dtype.name` is slow)
    found = _FROM_NUMPY.get(dt if isinstance(dt, np.dtype) else np.dtype(dt))
    if found is not None: return found
    dt = np.dtype(dt)   # (by name: a byte order other than the machine's)
    for d in dtypes.all():
      if d.np_name == dt.name: return d
    raise TypeError(f"numpy dtype {dt} has no Graft equivalent")

  @staticmethod
  def from_py(x) -> DType:
    """The dtype a Python scalar (or nested list of them) gets by default."""
    if isinstance(x, (bool, np.bool_)): return dtypes.bool
    if isinstance(x, (int, np.integer)): return dtypes.default_int
    if isinstance(x, (float, np.floating)): return dtypes.default_float
    if isinstance(x, (list, tuple)):
      kinds = [dtypes.from_py(v) for v in x]
      if not kinds: return dtypes.default_float
      return max(kinds, key=lambda d: "bif".index(d.kind) if d.kind in "bif" else 1)
    raise TypeError(f"cannot infer a dtype for {type(x).__name__} {x!r}")

  @staticmethod
  def min(d: DType):
    if d.is_bool: return False
    if d.is_int: return 0 if d.is_unsigned else -(2 ** (8 * d.itemsize - 1))
    return -float("inf")

  @staticmethod
  def max(d: DType):
    if d.is_bool: return True
    if d.is_int: return 2 ** (8 * d.itemsize) - 1 if d.is_unsigned else 2 ** (8 * d.itemsize - 1) - 1
    return float("inf")


# numpy dtype -> DType, the first of dtypes.all() of that numpy type (int64, not index)
_FROM_NUMPY = {d.np: d for d in reversed(dtypes.all()) if d.np_name is not None}


# ---- bfloat16 on the host: numpy has no such dtype, so its values travel as their 16 bits in a uint16 array ----
def bf16_bits(x) -> np.ndarray:
  """Each value of `x`, as float32, rounded to the nearest bfloat16 (ties to even, as the renderers' float32 ->
  bfloat16 conversion does), as uint16 bits. NaN stays a (quiet) NaN, infinities stay infinite."""
  f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
  u = f.view(np.uint32).astype(np.uint64)
  rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)   # carries into the exponent as it should
  return np.where(np.isnan(f), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_to_float32(bits) -> np.ndarray:
  """uint16 bfloat16 bits -> the same values as float32 (exact: bfloat16 is float32 with 16 bits of mantissa cut)."""
  b = np.asarray(bits, dtype=np.uint16)
  return (b.reshape(-1).astype(np.uint32) << 16).view(np.float32).reshape(b.shape)


def bf16_round(x: float) -> float:
  """A Python float rounded to the nearest bfloat16 (the value a bfloat16 constant holds)."""
  return float(bf16_to_float32(bf16_bits([x]))[0])
