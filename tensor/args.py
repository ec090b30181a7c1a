"""Reading the user's arguments: shapes and int lists (given as ints or one tuple), axes, devices. Each check raises
at the user's call, with a message naming the call and the values it got."""
from __future__ import annotations
import math
import numpy as np

MAX_ELEMENTS = 2**63 - 1  # kernels index elements with signed 64-bit integers at most


class AxisError(ValueError, IndexError):
  """An axis outside -ndim..ndim-1, or given twice (both a ValueError and an IndexError, like numpy's AxisError)."""


def ints(args: tuple, what: str) -> tuple[int, ...]:
  """Int arguments come as ints (`reshape(2, 3)`) or one tuple or list (`reshape((2, 3))`)."""
  if len(args) == 1 and isinstance(args[0], (tuple, list)): args = tuple(args[0])
  if any(isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)) for a in args):
    raise TypeError(f"{what}{args}: arguments must be ints")
  return tuple(int(a) for a in args)


def shape_arg(args: tuple, what: str) -> tuple[int, ...]:
  """A shape, as ints or one tuple; every dimension >= 0."""
  shape = ints(args, what)
  if any(s < 0 for s in shape): raise ValueError(f"{what}: shape {shape} has a negative dimension")
  return countable(shape, what)


def countable(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
  """`shape`, whose elements a 64-bit index can count (ValueError otherwise)."""
  if (n := math.prod(shape)) > MAX_ELEMENTS:
    raise ValueError(f"{what}: shape {shape} has {n} elements, more than a 64-bit index can count (2**63 - 1)")
  return shape


def normalize_axes(axis, shape: tuple[int, ...], what: str) -> tuple[int, ...]:
  """Axes as sorted non-negative ints: None means all; ints may be negative."""
  ndim = len(shape)
  if axis.__class__ is int and -ndim <= axis < ndim: return (axis % ndim,)   # (most calls: one valid int axis)
  if axis is None: return tuple(range(ndim))
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  out = []
  for a in axes:
    if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
      raise TypeError(f"{what}: axis {a!r} is not an int")
    if not -ndim <= a < ndim: raise AxisError(f"{what}: axis {a} is out of range for a tensor of shape {shape} ({ndim} dims)")
    out.append(int(a) % ndim)
  if len(set(out)) != len(out): raise AxisError(f"{what}: axis {axis} repeats an axis")
  return tuple(sorted(out))


def axis_of(a, shape: tuple[int, ...], what: str) -> int:
  """One axis as a non-negative int."""
  if isinstance(a, (tuple, list)): raise TypeError(f"{what}: axis must be one int, not {a!r}")
  return normalize_axes(a, shape, what)[0]


def device_name(device) -> str:
  """The canonical name of a device argument ("cpu" -> "CPU"); None means the one the DEVICE environment variable
  names. Unknown names raise ValueError listing the devices."""
  from runtime.device import Device, get_device  # the runtime is only needed once a tensor is made
  return Device.default().name if device is None else get_device(device).name
