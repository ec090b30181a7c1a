"""What the optimization tests share: one kernel of a tensor expression, run with a plan of our choosing."""
from __future__ import annotations
import numpy as np
from rewrite import UOp, Ops
from rules.pipeline import Run, schedule
from rules.realize import normalize
from rules.opt import Opt, Plan
from runtime.buffer import Buffer
from runtime.device import get_device
from runtime.search import lower_with


def the_kernel(t) -> tuple[UOp, list[UOp]]:
  """The one kernel that computes tensor t from buffers (normalized), and its buffers in slot order."""
  kernels, _ = schedule([t.uop], [t.device], Run(t.device))
  kernels = [k for k in kernels if k.op is not Ops.COPY]
  assert len(kernels) == 1, f"expected one kernel, got {len(kernels)}"
  return normalize(kernels[0])


def lowered(t, *opts: Opt) -> tuple[UOp, Plan]:
  """The linear kernel of t with the plan `opts` (none: the heuristic's), and the plan it ran with."""
  norm, _ = the_kernel(t)
  linear, ctx = lower_with(norm, t.device, False, Plan(opts) if opts else None)
  return linear, ctx.plan


def run_with(t, *opts: Opt) -> np.ndarray:
  """t computed by its kernel lowered with the plan `opts` (none: the heuristic's)."""
  norm, bufs = the_kernel(t)
  linear, _ = lower_with(norm, t.device, False, Plan(opts) if opts else None)
  dev = get_device(t.device)
  prog = dev.build(dev.renderer.source([dev.renderer.render("planned", linear)]), ["planned"])["planned"]
  out = Buffer(t.device, bufs[0].arg.size, bufs[0].dtype)
  args = sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL)
  prog(*[out.handle if i == 0 else bufs[i].arg.handle for i in args])
  return out.numpy().reshape(t.shape)


def loops(linear: UOp) -> list[tuple]:
  """(trips, mark) of each loop of a linear kernel, in the order they open."""
  return [(u.src[0].arg, u.arg[-1] if u.arg[-1] in ("parallel", "simd") else None) for u in linear.src if u.op is Ops.RANGE]
