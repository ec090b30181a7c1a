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
from typing import Any, Callable
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
  # a GPU's kinds (rules/gpu.py carries them out; a CPU plan never holds them)
  GLOBAL = "global"            # what is left of the loop runs on the blocks of the grid (several merge row-major);
                               # an amount > 1 on a kernel's first global loop groups its blocks by that many (L2 reuse)
  LOCAL = "local"              # the loop's next-inner `amount` trips are the lanes of a block (its threads); axis -1:
                               # the kernel's global loops, merged, `amount` of them per block
  GROUP = "group"              # a reduction loop spread over `amount` lanes, each a partial, combined across the lanes
  TENSOR_CORE = "tensor_core"  # a GPU's product on mma.sync or wgmma: the loop's tile (i, j) or slice (k) (rules/opt/tensor_core.py)
  def __repr__(self): return self.value


SPLITTING = (OptKind.SPLIT, OptKind.UPCAST, OptKind.VECTOR)
VECTOR_WIDTHS = (2, 4, 8, 16)   # lanes a vector may have (the C renderer declares these)


def trip_product(opts) -> int: return math.prod(o.amount for o in opts)


@dataclass(frozen=True)
class Opt:
  """One transformation of a kernel's loops: a kind, the loop it acts on (numbered as the kernel's plan numbers them;
  -1 for a GPU record about the kernel's global loops merged) and an amount."""
  kind: OptKind
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


GPU_KINDS = (OptKind.GLOBAL, OptKind.LOCAL, OptKind.GROUP)
CPU_KINDS = tuple(k for k in OptKind if k not in GPU_KINDS)   # what a CPU plan may hold


def is_tile_plan(plan: Plan) -> bool:
  """A GPU plan that splits single loops (a product's tiles: blocks, lanes, registers, shared memory) rather than
  mapping whole loops onto blocks and lanes (rules/gpu.py's rows)."""
  return any(o.axis >= 0 and o.kind in (*SPLITTING, OptKind.PACK, OptKind.PAD) for o in plan.opts)


def check_plan(plan: Plan, axes: list[UOp], device_loops: bool = False) -> None:
  """Raise InvalidPlan unless every record names a loop whose remaining trip count (padded first by its pad records)
  its amount divides. A GPU's plan is checked by rules/gpu.py (its rows, or its tiles here and there)."""
  if any(not isinstance(o, Opt) for o in plan.opts): raise InvalidPlan(f"{plan}: a plan holds Opt records")
  if not device_loops and (gpu := [o for o in plan.opts if o.kind in GPU_KINDS]):
    raise InvalidPlan(f"{gpu[0]!r}: a GPU's record in a plan for a CPU")
  if device_loops:
    from rules.gpu import check_gpu_plan
    return check_gpu_plan(plan, axes)
  check_splits(plan, axes, SPLITTING)


def check_splits(plan: Plan, axes: list[UOp], splitting) -> None:
  """The loop records of a plan fit the loops (the amounts of `splitting` kinds divide what is left of theirs)."""
  left = [r.src[0].arg for r in axes]
  if sum(o.kind is OptKind.VECTOR for o in plan.opts) > 1: raise InvalidPlan(f"{plan}: one vector record per kernel")
  for o in plan.opts:
    if not 0 <= o.axis < len(axes):
      raise InvalidPlan(f"{o!r} names no loop of this kernel ({len(axes)} loops)")
    if o.kind is OptKind.PAD:
      if o.amount < 2: raise InvalidPlan(f"{o!r}: pads to a multiple of 2 or more trips")
      left[o.axis] = math.ceil(left[o.axis] / o.amount) * o.amount
  for o in plan.opts:
    if o.kind in splitting:
      if o.amount < 2 or left[o.axis] % o.amount: raise InvalidPlan(f"{o!r}: {o.amount} does not divide the {left[o.axis]} trips left")
      left[o.axis] //= o.amount
    if o.kind is OptKind.VECTOR and o.amount not in VECTOR_WIDTHS: raise InvalidPlan(f"{o!r}: a vector has 2, 4, 8 or 16 lanes")
    if o.kind in (OptKind.PARALLEL, OptKind.PAD) and axes[o.axis].arg[0] != "out": raise InvalidPlan(f"{o!r}: names a reduction loop")
    if o.kind is OptKind.PACK and (axes[o.axis].arg[0] != "out") != (OptKind.LOCAL in splitting):
      raise InvalidPlan(f"{o!r}: packs over an output loop on a CPU, a reduction loop (shared memory) on a GPU")


@dataclass
class OptContext:
  """What the opt stages share while one kernel goes through them."""
  device_loops: bool = False                     # the device maps loops to its threads (CUDA): a GPU's plan
  choose: Callable[[UOp, list[UOp]], Plan] | None = None  # the policy (default: the device's heuristic)
  heuristic: bool = True                         # without a policy, the heuristic plans (else: an empty plan)
  multiprocessors: int = 132                     # a GPU's SM count (the pipeline's Run.multiprocessors)
  grid: Any = None                               # a GPU plan laid out for the opt_grid stage (rules/gpu.py)
  plan: Plan = field(default_factory=Plan)
  axis_of: dict[UOp, int] = field(default_factory=dict)     # the kernel's loops as the plan numbers them
  loop_axis: dict[UOp, int] = field(default_factory=dict)   # each loop that still is one -> the axis it came from
  padded: dict[UOp, int] = field(default_factory=dict)      # loops the pad stage lengthened -> their axis
  lane: UOp | None = None                                   # the vector stage's lane loop

  locals_made: int = 0                                      # local buffers made so far (their names)

  def opts(self, axis: int, *kinds: OptKind) -> list[Opt]: return [o for o in self.plan.opts if o.axis == axis and o.kind in kinds]
  def opts_of_kind(self, kind: OptKind) -> list[Opt]: return [o for o in self.plan.opts if o.kind is kind]
  def splitting(self) -> tuple[OptKind, ...]:
    """The kinds that split a loop: a GPU tile plan's lanes (local) too."""
    return (*SPLITTING, OptKind.LOCAL) if self.device_loops and is_tile_plan(self.plan) else SPLITTING
  @property
  def threads(self) -> int:
    """Threads per block of a GPU tile plan: its lanes."""
    return math.prod(o.amount for o in self.opts_of_kind(OptKind.LOCAL))
  def current_loop(self, axis: int) -> UOp | None:
    """The loop that stands for `axis` now: the one made last from it (its outer part, once split or marked)."""
    return next((r for r, a in reversed(self.loop_axis.items()) if a == axis), None)
  def next_local(self) -> int:
    self.locals_made += 1
    return self.locals_made - 1


def opt_context(run) -> OptContext:
  """The context the opt stages share for one kernel: the pipeline's Run holds it (a caller may preset it)."""
  if run.opt is None: run.opt = OptContext(device_loops=run.device_loops, heuristic=run.device_loops or run.parallel,
                                           multiprocessors=run.multiprocessors)
  return run.opt


def choose_plan(ctx: OptContext, sink: UOp) -> None:
  """The policy, run by the pipeline before the `opt` rules (Stage.prepare): the plan the context's chooser gives (the
  heuristic by default), checked against the kernel's loops, into the context with the loops' axis numbers. Choosing
  reads the whole kernel by nature (its shape decides), so it is a function the pipeline calls, not a rule."""
  # a kernel planned already (a stage before mapped it: tensor cores, a user's stage onto a grid) is not planned again:
  # the stages after this one find nothing of theirs in an empty plan
  if isinstance(sink.arg, Plan) or sink.arg == "linear" or (ctx.device_loops and any(n.op in (Ops.SPECIAL, Ops.BARRIER) for n in sink.toposort)):
    ctx.plan, ctx.grid, ctx.axis_of, ctx.loop_axis, ctx.padded = Plan((), "mapped"), None, {}, {}, {}
    return
  axes = kernel_axes(sink)
  if ctx.choose is not None: plan = ctx.choose(sink, axes)
  elif ctx.device_loops:
    from rules.gpu import gpu_plan
    plan = gpu_plan(sink, axes, ctx.multiprocessors)
  elif not ctx.heuristic: plan = Plan((), "heuristic")
  else:
    from .heuristic import heuristic_plan
    plan = heuristic_plan(sink, axes)
  check_plan(plan, axes, ctx.device_loops)
  ctx.plan, ctx.axis_of = plan, {r: i for i, r in enumerate(axes)}
  ctx.loop_axis, ctx.padded, ctx.lane, ctx.locals_made, ctx.grid = dict(ctx.axis_of), {}, None, 0, None


def attach_plan(ctx: OptContext, sink: UOp) -> UOp | None:
  """The kernel carries the plan chosen for it (part of its identity: cache key, statistics, DEBUG=2)."""
  if ctx.plan.origin == "mapped": return None   # choose_plan found the kernel planned or mapped already
  return sink.replace(arg=ctx.plan)


plan_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), attach_plan)], name="opt")
