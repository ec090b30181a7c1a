"""Which dtype a tensor operation produces: reading the user's dtype arguments, and promotion between operands.

Promotion follows numpy within a kind (int8 + int32 -> int32, uint8 + int8 -> int16, float16 + float32 -> float32) and
torch across kinds (the float operand's dtype wins: int32 + float16 -> float16, so that integer data never silently
turns into float64). A Python scalar is "weak": it takes the tensor's dtype when its kind fits (float16 + 2.0 stays
float16, int8 + 1 stays int8) and the default dtype of its kind otherwise (int32 tensor + 2.5 -> float32).
A Python int that the integer dtype it meets cannot hold raises OverflowError, as in numpy 2 (int8 tensor + 300):
never a silent wrap. Compared with such an int, a tensor gives the exact answer (int8 tensor < 300 is all true).
float16 and bfloat16 meet in float32, as in torch (neither holds the other's values).
"""
from __future__ import annotations
import numpy as np
from rewrite import DType, dtypes

# the dtypes a Tensor may hold; uint32 exists only inside the random generator, int16 only as uint8 + int8
USER_DTYPES = (dtypes.bool, dtypes.uint8, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64,
               dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
_KIND_RANK = {'b': 0, 'u': 1, 'i': 1, 'f': 2}


def to_dtype(x, what: str = "dtype") -> DType:
  """A DType from what a user may pass: a DType, a name ("float16"), or a numpy dtype or type (np.int8)."""
  if isinstance(x, DType): dt = x
  elif isinstance(x, str) and isinstance(getattr(dtypes, x, None), DType): dt = getattr(dtypes, x)
  else:
    try: npdt = np.dtype(x)
    except TypeError: raise TypeError(f"{what}={x!r} is not a dtype; use one of {_names()}") from None
    try: dt = dtypes.from_numpy(npdt)
    except TypeError: raise TypeError(f"{what}={x!r} (numpy {npdt}) is not supported; use one of {_names()}") from None
  if dt not in USER_DTYPES: raise TypeError(f"{what}={dt.name} is not supported by Tensor; use one of {_names()}")
  return dt


def _names() -> str: return ", ".join(d.name for d in USER_DTYPES)


def promote(a: DType, b: DType) -> DType:
  """The dtype two tensor operands meet in."""
  if a is b: return a
  ra, rb = _KIND_RANK[a.kind], _KIND_RANK[b.kind]
  if ra != rb: return a if ra > rb else b
  if a.is_float:
    if a.itemsize == b.itemsize: return dtypes.float32   # float16 and bfloat16
    return a if a.itemsize > b.itemsize else b
  if a.is_unsigned == b.is_unsigned: return a if a.itemsize > b.itemsize else b
  unsigned, signed = (a, b) if a.is_unsigned else (b, a)
  if signed.itemsize > unsigned.itemsize: return signed
  # a signed type holding every value of both; past 64 bits numpy gives float64
  return {1: dtypes.int16, 2: dtypes.int32, 4: dtypes.int64}.get(unsigned.itemsize, dtypes.float64)


def with_scalar(dt: DType, x) -> DType:
  """The dtype a tensor of dtype `dt` meets a (weak) Python scalar `x` in."""
  kind = dtypes.from_py(x).kind
  if _KIND_RANK[kind] <= _KIND_RANK[dt.kind]: return dt
  return dtypes.default_int if kind == 'i' else dtypes.default_float


_SCALARS = (bool, int, float, np.bool_, np.integer, np.floating)


def is_scalar(x) -> bool: return isinstance(x, _SCALARS)


def py_scalar(x):
  """A numpy scalar as the Python scalar of the same kind (numpy scalars are treated as weak, like Python's)."""
  if isinstance(x, np.bool_): return bool(x)
  if isinstance(x, np.integer): return int(x)
  if isinstance(x, np.floating): return float(x)
  return x


def result_dtype(operands) -> DType:
  """The dtype a mix of tensors (anything with .dtype) and Python scalars meets in: tensors first, then scalars."""
  return promoted([o for o in operands if not is_scalar(o)], [o for o in operands if is_scalar(o)])


def promoted(tensors: list, scalars: list) -> DType:
  """result_dtype of the operands already told apart: tensors, and (Python or numpy) scalars."""
  if not tensors: return dtypes.from_py([py_scalar(s) for s in scalars])
  dt = tensors[0].dtype
  for t in tensors[1:]: dt = promote(dt, t.dtype)
  for s in scalars: dt = with_scalar(dt, py_scalar(s))
  return dt


def out_of_range(value, dt: DType) -> bool:
  """Whether `value` is an integer (Python or numpy, not a bool) that the integer dtype `dt` cannot hold."""
  value = py_scalar(value)
  return (dt.is_int and isinstance(value, int) and not isinstance(value, bool)
          and not dtypes.min(dt) <= value <= dtypes.max(dt))


def check_fits(value, dt: DType, what: str = ""):
  """A Python scalar as a value of `dt`. An integer that does not fit raises OverflowError, as numpy 2 does: a
  scalar is weak (it takes the tensor's dtype), so wrapping it would silently compute with another number."""
  value = py_scalar(value)
  if out_of_range(value, dt):
    raise OverflowError(f"{what + ': ' if what else ''}Python integer {value} out of bounds for {dt.name} "
                        f"(range {dtypes.min(dt)}..{dtypes.max(dt)}); cast the tensor to a wider dtype first")
  return value
