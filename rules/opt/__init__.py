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

On a GPU (CUDA) the same plan also holds the GPU's kinds (global: blocks, local: lanes of a block, group: a reduction
over lanes), and stage `opt_grid` (rules/gpu.py) maps them onto block and thread indices after opt_pack, where a pack
record of a reduction loop stages operand tiles in shared memory; the GPU's heuristic is rules/gpu.py `gpu_plan`
(rows) and rules/opt/gpu_tile.py (a product's tiles). A new kind of optimization (tensor-core tiles) is a new
`OptKind`, a rule set and a stage: not a second mechanism.
"""
from .plan import Opt, OptKind, Plan, OptContext, InvalidPlan, kernel_axes, check_plan, plan_rules, opt_context, CPU_KINDS, GPU_KINDS
from .pad import pad_rules
from .split import split_rules
from .upcast import upcast_rules
from .vector import vector_rules
from .pack import pack_rules
from .loops import loop_rules
from .rows import row_value_rules

# the stages that carry out a plan, in order (the "opt" stage before them records the plan: rules/pipeline.py)
OPT_STAGES = [("opt_pad", pad_rules), ("opt_split", split_rules), ("opt_loops", loop_rules),
              ("opt_pack", pack_rules + row_value_rules), ("opt_upcast", upcast_rules), ("opt_vector", vector_rules)]

__all__ = ["CPU_KINDS", "GPU_KINDS", "Opt", "OptKind", "Plan", "OptContext", "InvalidPlan", "kernel_axes", "check_plan", "OPT_STAGES", "opt_context",
           "plan_rules", "pad_rules", "split_rules", "pack_rules", "upcast_rules", "vector_rules", "loop_rules"]
