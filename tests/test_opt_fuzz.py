"""Random valid plans on random small kernels give what numpy gives."""
import random
import numpy as np
import pytest
from numpy.testing import assert_allclose
from tensor import Tensor
from rules.opt import Opt, OptKind, Plan, InvalidPlan, check_plan, CPU_KINDS
from runtime.search import lower_with
from tests.opt_helpers import the_kernel, run_with

pytestmark = pytest.mark.usefixtures("on_cpu")  # the CPU's vocabulary: on the CPU also in a DEVICE=CUDA run


def conv_np(x, w, pad, stride=1):
  from numpy.lib.stride_tricks import sliding_window_view
  win = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))), w.shape[2:], axis=(2, 3))[:, :, ::stride, ::stride]
  return np.tensordot(win, w, axes=((1, 4, 5), (1, 2, 3))).transpose(0, 3, 1, 2)


def random_kernel(rng: random.Random):
  """(a tensor computed by one kernel, what numpy computes)."""
  d = lambda: rng.choice([2, 4, 6, 8, 12, 16])
  arr = lambda *s: np.random.default_rng(rng.randrange(1 << 30)).standard_normal(s, dtype=np.float32)
  kind = rng.choice(["matmul", "linear", "conv", "sum", "max", "views"])
  if kind == "matmul":
    a = arr(d(), d())
    b = arr(a.shape[1], d())
    return Tensor(a) @ Tensor(b), a @ b
  if kind == "linear":
    x = arr(d(), d())
    w = arr(d(), x.shape[1])
    b = arr(w.shape[0])
    return Tensor(x).linear(Tensor(w), Tensor(b)).relu(), np.maximum(x @ w.T + b, 0)
  if kind == "conv":
    x = arr(rng.choice([1, 2]), d(), rng.choice([4, 6, 8, 12]), 8)
    w = arr(rng.choice([2, 4, 8, 16]), x.shape[1], 3, 3)
    stride, pad = rng.choice([1, 2]), rng.choice([0, 1, 2])
    # conv2d stores a padded input first (a kernel of its own): the convolution's kernel reads it through its window
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    return Tensor(padded).conv2d(Tensor(w), stride=stride), conv_np(x, w, pad, stride)
  a = arr(d(), d(), d())
  if kind == "sum":
    axis = rng.choice([1, 2, (1, 2)])
    return Tensor(a).sum(axis=axis), a.sum(axis=axis)
  if kind == "max": return Tensor(a).max(axis=2), a.max(axis=2)
  t = Tensor(a).permute(2, 0, 1).flip(1).pad(((0, 0), (1, 1), (0, 0))) * 2 + 1
  return t, np.pad(np.flip(a.transpose(2, 0, 1), 1), ((0, 0), (1, 1), (0, 0))) * 2 + 1


def random_plan(rng: random.Random, sizes: list[int], kinds: list[str]) -> Plan:
  left, opts = list(sizes), []
  for _ in range(rng.randrange(1, 6)):
    axis = rng.randrange(len(sizes))
    kind = rng.choice(list(CPU_KINDS))
    if kind is OptKind.VECTOR and any(o.kind is kind for o in opts): continue
    if kind in (OptKind.SPLIT, OptKind.UPCAST, OptKind.VECTOR):
      divisors = [n for n in range(2, left[axis] + 1) if left[axis] % n == 0 and n <= 16 and (kind is not OptKind.VECTOR or n & (n - 1) == 0)]
      if not divisors: continue
      opts.append(Opt(kind, axis, rng.choice(divisors)))
      left[axis] //= opts[-1].amount
    elif kind in (OptKind.PARALLEL, OptKind.PACK, OptKind.PAD) and kinds[axis] != "out": continue
    elif kind is OptKind.PAD:   # pads the whole loop: before any record splits it
      if any(o.axis == axis and o.kind in (OptKind.SPLIT, OptKind.UPCAST, OptKind.VECTOR) for o in opts): continue
      opts.append(Opt(kind, axis, rng.choice([3, 4, 5, 6])))
      left[axis] = -(-left[axis] // opts[-1].amount) * opts[-1].amount
    else: opts.append(Opt(kind, axis))
  return Plan(tuple(opts))


@pytest.mark.parametrize("seed", range(100))
def test_random_plan_on_random_kernel(seed):
  rng = random.Random(seed)
  t, want = random_kernel(rng)
  norm, _ = the_kernel(t)
  _, ctx = lower_with(norm, "CPU", False, None)
  axes = sorted(ctx.axis_of, key=ctx.axis_of.get)
  plan = random_plan(rng, [r.src[0].arg for r in axes], [r.arg[0] for r in axes])
  check_plan(plan, axes)
  assert_allclose(run_with(t, *plan.opts), want, rtol=1e-4, atol=1e-4, err_msg=str(plan))


def test_a_plan_that_does_not_fit_says_why():
  t = Tensor(np.ones((6, 6), np.float32)) + 1
  with pytest.raises(InvalidPlan, match="4 does not divide the 6 trips"): run_with(t, Opt(OptKind.UPCAST, 1, 4))
  with pytest.raises(InvalidPlan, match="names no loop"): run_with(t, Opt(OptKind.SPLIT, 5, 2))
