"""The compiler on one screen: the ordered stages from a tensor graph to linear kernels.

Each stage is a named rule set applied with graph_rewrite under its name (so REWRITE_STATS reports per stage), with
a context made per application (`make_ctx`) and, where a stage has one, a `prepare(ctx, root)` called before its rules:
it fills the context with an index the rules look things up in, or a policy's choice (a kernel's plan); it never
rewrites.
Stages of scope "graph" rewrite the whole tensor graph; "gradient" is asked node by node by the reverse walk of
rules/gradient.py (backward); "schedule" rewrites the SINK of kernels; "kernel" rewrites
one kernel at a time; "host" rewrites the host program (rules/host.py: steps, then memory). A user adds a rule set before or after a stage, or replaces one, with `pipeline.insert`,
`pipeline.replace` (see docs/rules.md).
"""
from __future__ import annotations
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable
from rewrite import UOp, PatternMatcher, Ops, graph_rewrite
import sys
from .realize import detach_rules, stored_read_rules, share_rules, realize_rules, reuse_rules, ReuseContext, kernelize_rules, group_rules, RealizeContext, KernelizeContext, GroupDecisions, in_dependency_order
from .realize import read_store_rules, StoreIndex, is_graph_store, is_stored_reduction, is_shared_value_store, choose_shared_values
from .views import view_rules
from .lower import lower_rules, LowerContext
from .symbolic import symbolic_rules
from .one_hot import one_hot_rules
from .linearize import linearize_rules
from .opt import OPT_STAGES, opt_context
from .opt.plan import plan_rules, choose_plan
from .opt.rows import cpu_rows_fit
from .gpu import fuse_rules, FuseContext, grid_rules, lay_out_grid, gpu_index_rules, MULTIPROCESSORS
from .gpu_vector import grid_vector_rules, VectorRuns
from .opt.tensor_core import tensor_core_rules, choose_tensor_core, TensorCoreContext
from .opt.implicit import implicit_product_rules
from .index_width import index_width_rules
from .host import host_rules, memory_rules, index_lifetimes, HostContext
from .attention import attention_rules, AttentionContext, online_softmax_lower_rules, head_loop_rules, carry_vector_rules
from .gradient import gradient_rules


@dataclass
class Stage:
  name: str
  rules: PatternMatcher
  scope: str                                    # "graph", "schedule", "kernel", "host" or "gradient"
  make_ctx: Callable[[Any], Any] | None = None  # run -> ctx for one application
  top_down: bool = False
  origin: str = "graft"                         # where the rule set comes from (a user's module, say)
  applies: Callable[[Any], bool] | None = None  # run -> whether this stage runs (device-specific stages)
  # (ctx, the stage's input) -> None: reads the input once before the rules run, to fill the context with what they
  # look up (an index of the schedule, a kernel's chosen plan). A policy or an index, never a rewrite.
  prepare: Callable[[Any, UOp], None] | None = None
  # run again (a new context, prepare, the rules) on what a pass made until a pass changes nothing, at most
  # MAX_PASSES times: for rules that look nodes up in an index of the graph that their own rewrites change
  to_fixed_point: bool = False


MAX_PASSES = 8   # a stage still changing the graph after this many passes is left as it is (see its contract)


@dataclass
class Run:
  """What one pass through the pipeline knows: the default device and the decisions worth explaining."""
  device: str
  parallel: bool = True       # loops may run on CPU threads (OpenMP)
  device_loops: bool = False  # the device maps loops onto its own threads (CUDA grid and blocks)
  kernelize: KernelizeContext | None = None
  group: GroupDecisions | None = None
  outputs: tuple[UOp, ...] = ()  # the BUFFERs the realize returns (a schedule stage must keep their kernels)
  fuse: FuseContext | None = None
  opt: Any = None             # the kernel's optimization plan and context (rules/opt), made by the opt stage (a
                              # caller may preset one: a policy)
  multiprocessors: int = MULTIPROCESSORS  # a GPU's SM count, which sizes its grids (the runtime asks the driver)
  arch: str = "sm_90"         # a GPU's target, sm_XY of its compute capability (the runtime asks the driver; an H100)
  host: HostContext | None = None  # set by the runtime before the host stages run
  attention: AttentionContext | None = None  # what the attention stage fused and why not (DEBUG=2)


def _kernelize_ctx(run: Run) -> KernelizeContext:
  run.kernelize = KernelizeContext(run.device)
  return run.kernelize


def _group_ctx(run: Run) -> GroupDecisions:
  # kernels keep the numbers the kernelize stage's explanations gave them
  run.group = GroupDecisions(numbers={k: i for i, k in enumerate(run.kernelize.kernels)} if run.kernelize else {})
  return run.group


def _fuse_ctx(run: Run) -> FuseContext:
  # one mechanism on both devices: a GPU's lanes hold a row of any length, a CPU core's cache a row of some
  run.fuse = FuseContext(set(run.outputs), admits=None if run.device_loops else cpu_rows_fit)
  return run.fuse


def _tensor_core_ctx(run: Run) -> TensorCoreContext:
  return TensorCoreContext(multiprocessors=run.multiprocessors, arch=run.arch)


def _host_ctx(run: Run) -> HostContext: return run.host


def _attention_rows_ctx(run: Run) -> AttentionContext: return AttentionContext(run.device_loops, run.multiprocessors)


def _attention_ctx(run: Run) -> AttentionContext:   # (what it decided is kept for DEBUG=2)
  run.attention = _attention_rows_ctx(run)
  return run.attention


def _on_device_loops(run: Run) -> bool: return run.device_loops


def _caller() -> str:
  """file:line of the code that called the Pipeline method calling this: where a user placed a rule set."""
  f = sys._getframe(2)
  return f"{f.f_code.co_filename}:{f.f_lineno}"


@dataclass
class Pipeline:
  stages: list[Stage] = field(default_factory=list)
  version: int = 0  # bumped by every change: what was compiled by another version is not reused

  def __iter__(self): return iter(self.stages)
  def names(self) -> list[str]: return [s.name for s in self.stages]

  def index(self, name: str) -> int:
    for i, s in enumerate(self.stages):
      if s.name == name: return i
    raise ValueError(f"no stage named {name!r}; the stages are {', '.join(self.names())}")

  def insert(self, stage: str, rules: PatternMatcher, where: str = "after", name: str | None = None, top_down: bool = False) -> Stage:
    """Run `rules` as a stage of its own just before or after the stage named `stage`, on what that stage sees.
    Inserting the same rule set again changes nothing."""
    if where not in ("before", "after"): raise ValueError(f"where must be 'before' or 'after', not {where!r}")
    for s in self.stages:
      if s.rules is rules: return s
    target = self.stages[self.index(stage)]
    new = Stage(name or rules.name or f"{where}_{stage}", rules, target.scope, top_down=top_down, origin=_caller(),
                applies=target.applies)
    if new.name in self.names(): raise ValueError(f"a stage named {new.name!r} exists already; pass name=")
    self.stages.insert(self.index(stage) + (where == "after"), new)
    self.version += 1
    return new

  def replace(self, stage: str, rules: PatternMatcher) -> Stage:
    """Run `rules` instead of the rule set of the stage named `stage` (same place, scope and context)."""
    i = self.index(stage)
    old = self.stages[i]
    self.stages[i] = dataclasses.replace(old, rules=rules, origin=_caller())   # every other field kept, new ones too
    self.version += 1
    return self.stages[i]

  def remove(self, stage: str) -> Stage:
    self.version += 1
    return self.stages.pop(self.index(stage))

  def run(self, root: UOp, scope: str, run: Run) -> UOp:
    """Apply every stage of `scope` in order."""
    for stage in self.stages:
      if stage.scope != scope or (stage.applies is not None and not stage.applies(run)): continue
      for _ in range(MAX_PASSES if stage.to_fixed_point else 1):
        ctx = stage.make_ctx(run) if stage.make_ctx else None
        if stage.prepare is not None:
          try: stage.prepare(ctx, root)
          except Exception as e:   # the error keeps its type (InvalidPlan, say); the note says where it came from
            e.add_note(f"while preparing stage {stage.name!r} ({getattr(stage.prepare, '__qualname__', stage.prepare)})")
            raise
        root, before = graph_rewrite(root, stage.rules, ctx, name=stage.name, top_down=stage.top_down), root
        if root is before: break
    return root


pipeline = Pipeline([
  # softmax(scores) @ values becomes one node of an online softmax, before anything decides buffers (rules/attention.py)
  Stage("attention", detach_rules + attention_rules, "graph", _attention_ctx),
  Stage("stored_reads", stored_read_rules, "graph", lambda run: StoreIndex(is_graph_store), top_down=True, prepare=StoreIndex.index,
        to_fixed_point=True),
  Stage("share", share_rules, "graph", lambda run: StoreIndex(is_shared_value_store), top_down=True,
        prepare=choose_shared_values),
  Stage("realize", realize_rules, "graph", lambda run: RealizeContext(), prepare=RealizeContext.index_stored),
  Stage("reuse", reuse_rules, "graph", lambda run: ReuseContext()),
  Stage("stored_reductions", read_store_rules, "graph", lambda run: StoreIndex(is_stored_reduction), top_down=True,
        prepare=StoreIndex.index, to_fixed_point=True),
  Stage("kernelize", kernelize_rules, "graph", _kernelize_ctx),
  Stage("group", group_rules, "schedule", _group_ctx, prepare=GroupDecisions.index_schedule),
  Stage("gpu_fuse", fuse_rules, "schedule", _fuse_ctx, prepare=FuseContext.index_schedule),
  Stage("views", view_rules, "kernel"),
  Stage("lower", online_softmax_lower_rules + lower_rules, "kernel", lambda run: LowerContext(), top_down=True),
  # a one-hot sum (t[ids], gather) becomes a load at the picked index, and its index arithmetic is simplified with the rest
  Stage("symbolic", symbolic_rules + one_hot_rules, "kernel"),
  Stage("attention_rows", head_loop_rules, "kernel", _attention_rows_ctx),
  # a 16-bit product on tensor cores; a kernel it maps is mapped already for the opt stages (rules/opt/tensor_core.py)
  Stage("tensor_core", tensor_core_rules, "kernel", _tensor_core_ctx, applies=_on_device_loops, prepare=choose_tensor_core),
  # a convolution's rows and its reduction each one loop, for the GPU's product tiles (rules/opt/implicit.py)
  Stage("implicit_product", implicit_product_rules, "kernel", applies=_on_device_loops),
  # the opt stage's plan is chosen by a policy (choose_plan: the device's heuristic, the search's pick) before its rule
  # records it on the kernel; on a GPU the loops and parts its global, local and group records name become block and
  # thread indices (opt_grid) once split and packed, before the register tiles are unrolled
  Stage("opt", plan_rules, "kernel", opt_context, prepare=choose_plan),
  *(Stage(name, rules, "kernel", opt_context) for name, rules in OPT_STAGES[:4]),
  Stage("opt_grid", grid_rules, "kernel", opt_context, applies=_on_device_loops, prepare=lay_out_grid),
  Stage("opt_grid_index", gpu_index_rules, "kernel", applies=_on_device_loops),
  *(Stage(name, carry_vector_rules + rules if name == "opt_vector" else rules, "kernel", opt_context) for name, rules in OPT_STAGES[4:]),
  # a rows plan's runs of consecutive elements (vector(-1, 4)) read and written as floatx4, once their indices are folded
  Stage("opt_grid_vector", grid_vector_rules, "kernel", lambda run: VectorRuns(run.opt), applies=_on_device_loops,
        prepare=VectorRuns.index),
  Stage("index_width", index_width_rules, "kernel"),
  Stage("linearize", linearize_rules, "kernel"),
  Stage("host", host_rules, "host", _host_ctx),
  Stage("memory", memory_rules, "host", _host_ctx, prepare=index_lifetimes),
  # not a pass over a graph: the reverse walk of rules/gradient.py asks the stages of this scope, in order, for the
  # gradient of each node's sources (a user's rule set inserted before it answers first)
  Stage("gradient", gradient_rules, "gradient"),
])


def schedule(outputs: list[UOp], devices: list[str], run: Run) -> tuple[list[UOp], list[UOp]]:
  """(kernels in execution order, the outputs as views of their buffers)."""
  sink = UOp(Ops.SINK, src=tuple(outputs), arg=tuple(devices))
  realized = pipeline.run(sink, "graph", run)
  run.outputs = tuple(u.src[0] for u in realized.src)
  # the order the kernels run in is a toposort of the kernel graph, not the order in which the rules happened to fire
  kernels = pipeline.run(UOp(Ops.SINK, src=tuple(in_dependency_order(run.kernelize.kernels))), "schedule", run).src
  return list(kernels), list(realized.src)


def lower_kernel(kernel: UOp, run: Run) -> UOp:
  """A KERNEL through the kernel stages: the SINK of its linear instruction list."""
  return pipeline.run(kernel, "kernel", run)


# users' rule modules named in GRAFT_RULES go in last, once the pipeline they add to exists
from .custom import load_from_environment  # noqa: E402
load_from_environment()
