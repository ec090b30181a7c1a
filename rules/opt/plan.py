"""The optimization plan of a kernel: plain data, chosen by a policy, attached to the kernel by the `opt` stage.

A plan is a tuple of `Opt(kind, axis, amount)` records. `axis` numbers the kernel's loops as `kernel_axes` lists
them when the plan is chosen (output loops in order, then reduction loops); several records may name one axis, and
each splitting kind (split, upcast, vector) then takes the next-inner factor of it, in plan order:
`(vector(1, 16), upcast(1, 2))` makes loop 1 `(outer*2 + u)*16 + lane`.

Stage `opt` (rule set `plan_rules`, ctx: `OptContext`, prepared by `choose_plan`): in, a lowered kernel `SINK(STORE...)`
whose arg is its device; out, the same SINK with arg `Plan`. The plan is chosen before the rules run, by the policy
`choose_plan` that the pipeline calls (the context's chooser, else the heuristic), checked against the kernel's
loops; the context keeps the plan and the loops' axis numbers for the stages after it (rules/opt/*.py).
"""
from __future__ import annotations
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable
from rewrite import UOp, UPat, PatternMatcher, Ops
from rules.linearize import nesting_key


class OptKind(str, Enum):
  SPLIT = "split"              # the loop becomes outer x inner loops; the inner one nests inside the other loops
  UPCAST = "upcast"            # an inner loop of `amount` trips is unrolled into copies (a tile of registers)
  VECTOR = "vector"            # an inner loop of `amount` trips becomes the lanes of vector registers
  INTERCHANGE = "interchange"  # the (outer) loop nests outside every other loop of its kind
  PARALLEL = "parallel"        # the (outer) loop's iterations run on threads (OpenMP)
  SIMD = "simd"                # the innermost loop of a reduction is vectorized by the C compiler (omp simd)
  PACK = "pack"                # loads that do not depend on the (output) loop are read from a packed local copy
  PAD = "pad"                  # the (output) loop runs a multiple of `amount` trips, the extra ones redo its last
  TENSOR_CORE = "tensor_core"  # a GPU's product on mma.sync: the loop's tile (i, j) or slice (k) (rules/opt/tensor_core.py)
  def __repr__(self): return self.value


SPLITTING = (OptKind.SPLIT, OptKind.UPCAST, OptKind.VECTOR)
VECTOR_WIDTHS = (2, 4, 8, 16)   # lanes a vector may have (the C renderer declares these)


def trip_product(opts) -> int: return math.prod(o.amount for o in opts)


@dataclass(frozen=True)
class Opt:
  """One transformation of a kernel's loops: a kind (OptKind on the CPU, rules/gpu.py's GridKind on a GPU), the loop
  it acts on (numbered as the kernel's plan numbers them) and an amount."""
  kind: Enum
  axis: int
  amount: int = 0
  def __repr__(self): return f"{self.kind.value}({self.axis}{f', {self.amount}' if self.amount else ''})"


@dataclass(frozen=True)
class Plan:
  """A kernel's optimizations, and who chose them ("heuristic", "search", "cache" or "given")."""
  opts: tuple[Opt, ...] = ()
  origin: str = "given"
  def __str__(self): return f"{' '.join(map(repr, self.opts)) or 'none'} [{self.origin}]"


class InvalidPlan(ValueError):
  """A plan that does not fit the kernel it was given to."""


def kernel_axes(sink: UOp) -> list[UOp]:
  """The kernel's loops in nesting order: what a plan's axis numbers name."""
  return sorted((n for n in sink.toposort if n.op is Ops.RANGE), key=nesting_key)


def check_plan(plan: Plan, axes: list[UOp]) -> None:
  """Raise InvalidPlan unless every record names a loop whose remaining trip count (padded first by its pad records)
  its amount divides."""
  left = [r.src[0].arg for r in axes]
  if sum(o.kind is OptKind.VECTOR for o in plan.opts) > 1: raise InvalidPlan(f"{plan}: one vector record per kernel")
  for o in plan.opts:
    if not isinstance(o, Opt) or not 0 <= o.axis < len(axes):
      raise InvalidPlan(f"{o!r} names no loop of this kernel ({len(axes)} loops)")
    if o.kind is OptKind.PAD:
      if o.amount < 2: raise InvalidPlan(f"{o!r}: pads to a multiple of 2 or more trips")
      left[o.axis] = math.ceil(left[o.axis] / o.amount) * o.amount
  for o in plan.opts:
    if o.kind in SPLITTING:
      if o.amount < 2 or left[o.axis] % o.amount: raise InvalidPlan(f"{o!r}: {o.amount} does not divide the {left[o.axis]} trips left")
      left[o.axis] //= o.amount
    if o.kind is OptKind.VECTOR and o.amount not in VECTOR_WIDTHS: raise InvalidPlan(f"{o!r}: a vector has 2, 4, 8 or 16 lanes")
    if o.kind in (OptKind.PARALLEL, OptKind.PACK, OptKind.PAD) and axes[o.axis].arg[0] != "out": raise InvalidPlan(f"{o!r}: names a reduction loop")


@dataclass
class OptContext:
  """What the opt stages share while one kernel goes through them."""
  device_loops: bool = False                     # the device maps loops to its threads (CUDA): no CPU plan
  choose: Callable[[UOp, list[UOp]], Plan] | None = None  # the policy (default: rules/opt/heuristic.py)
  plan: Plan = field(default_factory=Plan)
  axis_of: dict[UOp, int] = field(default_factory=dict)     # the kernel's loops as the plan numbers them
  loop_axis: dict[UOp, int] = field(default_factory=dict)   # each loop that still is one -> the axis it came from
  padded: dict[UOp, int] = field(default_factory=dict)      # loops the pad stage lengthened -> their axis
  lane: UOp | None = None                                   # the vector stage's lane loop

  locals_made: int = 0                                      # local buffers made so far (their names)

  def opts(self, axis: int, *kinds: OptKind) -> list[Opt]: return [o for o in self.plan.opts if o.axis == axis and o.kind in kinds]
  def opts_of_kind(self, kind: OptKind) -> list[Opt]: return [o for o in self.plan.opts if o.kind is kind]
  def current_loop(self, axis: int) -> UOp | None:
    """The loop that stands for `axis` now: the one made last from it (its outer part, once split or marked)."""
    return next((r for r, a in reversed(self.loop_axis.items()) if a == axis), None)
  def next_local(self) -> int:
    self.locals_made += 1
    return self.locals_made - 1


def opt_context(run) -> OptContext:
  """The context the opt stages share for one kernel: the pipeline's Run holds it (a caller may preset it)."""
  if run.opt is None: run.opt = OptContext(device_loops=run.device_loops or not run.parallel)
  return run.opt


def choose_plan(ctx: OptContext, sink: UOp) -> None:
  """The policy, run by the pipeline before the `opt` rules (Stage.prepare): the plan the context's chooser gives (the
  heuristic by default), checked against the kernel's loops, into the context with the loops' axis numbers. Choosing
  reads the whole kernel by nature (its shape decides), so it is a function the pipeline calls, not a rule."""
  if isinstance(sink.arg, Plan) or sink.arg == "linear": return
  axes = kernel_axes(sink)
  if ctx.choose is not None: plan = ctx.choose(sink, axes)
  elif ctx.device_loops: plan = Plan((), "heuristic")
  else:
    from .heuristic import heuristic_plan
    plan = heuristic_plan(sink, axes)
  check_plan(plan, axes)
  ctx.plan, ctx.axis_of = plan, {r: i for i, r in enumerate(axes)}
  ctx.loop_axis, ctx.padded, ctx.lane, ctx.locals_made = dict(ctx.axis_of), {}, None, 0


def attach_plan(ctx: OptContext, sink: UOp) -> UOp | None:
  """The kernel carries the plan chosen for it (part of its identity: cache key, statistics, DEBUG=2)."""
  if isinstance(sink.arg, Plan) or sink.arg == "linear": return None
  return sink.replace(arg=ctx.plan)


plan_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), attach_plan)], name="opt")
