"""Kernel optimizations as rules: a plan (data, rules/opt/plan.py) carried out by one rule set per kind of loop
transformation, each its own stage, in this order:

| stage | rule set | does |
|---|---|---|
| opt | `plan_rules` | attaches the kernel's plan (the heuristic's, or the search's through the context) |
| opt_pad | `pad_rules` | pad records lengthen their loop to a multiple of a tile (the extra trips redo the last) |
| opt_split | `split_rules` | split / upcast / vector records split their loop into outer x inner parts |
| opt_loops | `loop_rules` | interchange, parallel and simd records mark the loops (upcast parts are unrolled next) |
| opt_pack | `pack_rules` | pack records: loads of an operand shared by a loop's iterations read a packed local copy |
| opt_upcast | `upcast_rules` | upcast parts are unrolled: a register tile of copies sharing their loads |
| opt_vector | `vector_rules` | the vector part becomes the lanes of vector values (loads, math, accumulators, stores) |

A new kind of optimization (a GPU's block and thread axes, shared memory, tensor-core tiles) is a new `OptKind`, a
rule set here and a line below: not a second mechanism.
"""
from .plan import Opt, OptKind, Plan, OptContext, InvalidPlan, kernel_axes, check_plan, plan_rules, opt_context
from .pad import pad_rules
from .split import split_rules
from .upcast import upcast_rules
from .vector import vector_rules
from .pack import pack_rules
from .loops import loop_rules

# the stages that carry out a plan, in order (the "opt" stage before them records the plan: rules/pipeline.py)
OPT_STAGES = [("opt_pad", pad_rules), ("opt_split", split_rules), ("opt_loops", loop_rules),
              ("opt_pack", pack_rules), ("opt_upcast", upcast_rules), ("opt_vector", vector_rules)]

__all__ = ["Opt", "OptKind", "Plan", "OptContext", "InvalidPlan", "kernel_axes", "check_plan", "OPT_STAGES", "opt_context",
           "plan_rules", "pad_rules", "split_rules", "pack_rules", "upcast_rules", "vector_rules", "loop_rules"]
