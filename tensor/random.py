"""Random tensors generated on the device: a counter-based integer hash of each element's index, never numpy.

Element i of a draw is hash(i ^ key), where the key comes from the seed; the hash is a few rounds of xor-shift and
multiply on uint32 (a bijection, so distinct indices never collide). Its top bits, scaled by a power of two, give a
float in [0, 1); randn turns two independent uniforms into a normal by Box-Muller. Because the result depends only on
(seed, index, shape), the same seed gives the same tensor on every device.
"""
from __future__ import annotations
import math
from rewrite import UOp, Ops, dtypes
from .promotion import to_dtype
from .args import shape_arg, device_name

_MASK32 = 0xFFFFFFFF
_state = {"seed": 0, "draws": 0}  # seed=None draws use the global seed and a counter, so each draw differs


def manual_seed(seed: int) -> None:
  """Restart the stream of draws that pass seed=None."""
  _state["seed"], _state["draws"] = int(seed), 0


def _mix_py(x: int) -> int:
  """The same hash as `_mix`, on a Python int (for deriving keys from seeds)."""
  x &= _MASK32
  x ^= x >> 16; x = (x * 0x7FEB352D) & _MASK32
  x ^= x >> 15; x = (x * 0x846CA68B) & _MASK32
  return x ^ (x >> 16)


def _mix(x):
  """An avalanche hash on uint32 tensors: every input bit flips about half the output bits."""
  x = x ^ (x >> 16)
  x = x * 0x7FEB352D
  x = x ^ (x >> 15)
  x = x * 0x846CA68B
  return x ^ (x >> 16)


def _keys(seed, n: int) -> list[int]:
  if seed is None:
    seed, _state["draws"] = (_state["seed"] << 20) + _state["draws"], _state["draws"] + 1
  base = _mix_py(int(seed) ^ _mix_py(int(seed) >> 32))
  return [_mix_py(base + 0x9E3779B9 * (k + 1)) for k in range(n)]


class RandomMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields
  @classmethod
  def _bits(cls, shape: tuple[int, ...], key: int, device):
    n = math.prod(shape)
    idx = cls._from_uop(UOp(Ops.IOTA, dtypes.int32, (), n), (n,), device).cast(dtypes.uint32)
    return _mix(idx ^ key).reshape(shape)

  @classmethod
  def _uniform(cls, shape, key: int, device, dtype):
    # keep as many top bits as the float's significand holds, so that rounding can never reach 1.0
    bits = {dtypes.float16: 11, dtypes.bfloat16: 8, dtypes.float32: 24}.get(dtype, 32)
    return (cls._bits(shape, key, device) >> (32 - bits)).cast(dtype) * (2.0 ** -bits)

  @classmethod
  def rand(cls, *shape, seed=None, dtype=None, device=None):
    """Uniform samples in [0, 1). The same seed gives the same values; seed=None takes the next draw of the global
    stream (see manual_seed)."""
    shape, device = shape_arg(shape, "rand"), device_name(device)
    dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
    if not dt.is_float: raise TypeError(f"rand: dtype {dt.name} is not a float dtype")
    (key,) = _keys(seed, 1)
    return cls._uniform(shape, key, device, dt)

  @classmethod
  def randn(cls, *shape, seed=None, dtype=None, device=None):
    """Standard normal samples, by Box-Muller: sqrt(-2 ln u1) cos(2 pi u2) of two independent uniforms."""
    shape, device = shape_arg(shape, "randn"), device_name(device)
    dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
    if not dt.is_float: raise TypeError(f"randn: dtype {dt.name} is not a float dtype")
    k1, k2 = _keys(seed, 2)
    work = dtypes.float64 if dt is dtypes.float64 else dtypes.float32
    u1 = 1 - cls._uniform(shape, k1, device, work)  # in (0, 1]: its log is finite
    u2 = cls._uniform(shape, k2, device, work)
    return ((u1.log() * -2).sqrt() * (u2 * (2 * math.pi)).cos()).cast(dt)
