"""The host program: the schedule becomes a list of steps for the runtime, and its memory is planned.

Stage `host` (rule set `host_rules`, ctx: `HostContext`). In: `SINK(kernels and copies in execution order,
arg="steps")`, the schedule stages' result. Out: `SINK(steps, arg="steps")`, each step one of
  - `CALL(*buffers, arg=kernel)`: a generated kernel, `kernel` its normalized form (buffers as numbered slots),
    `buffers` what fills each slot;
  - `EXTERN(*buffers, arg=Extern)`: a library routine (gemm: sgemm, hgemm, batched or not) doing what a kernel that
    is exactly a matrix product (or a batch of them) does; the generated kernel stays in `Extern.kernel`, the other
    candidate for the runtime's measured pick (runtime/pick.py);
  - `PICK(*buffers, arg=Choice)`: implementations of one kernel's work, each one or more kernel calls, that the
    runtime times on first use (runtime/pick.py): on a GPU, a reduction of few, long rows as one kernel or split over
    blocks into partials (rules/split.py), the partials in scratch buffers among `buffers`; a product that is
    also a library's gemm has the library call as a third option (attention's p @ v: the split may beat cuBLAS);
  - `COPY(dst, src)`: a copy between devices.
A kernel whose result an assignment wants in an existing buffer stores into that buffer: directly when the kernel
reads the buffer only at the element it writes, else into a new buffer that a copy kernel then writes across.

Stage `memory` (rule set `memory_rules`, ctx: `HostContext` with its `MemoryPlan`, whose index of lifetimes
`index_lifetimes` makes before the rules run). In: the steps. Out: `SINK(steps, arg="planned")` with
`ALLOC(b, arg=Storage)` before the first step that uses an intermediate buffer b (one the pipeline made and the
realize does not return) and `FREE(b, arg=Storage or None)` after its last, so no two buffers alive at once share a
storage. The rule on each step (CALL, EXTERN, PICK, COPY) plans its memory into the context, in program order: storage is
shared best fit, a buffer takes the smallest free storage of its device that is large enough, else a new one, and a
buffer dying there puts its storage back on the free list. The last rule, on the program, lays each step out between
its ALLOCs and FREEs; a `FREE`'s arg names the storage it gives back to the device (the last use of that storage).
"""
from __future__ import annotations
import itertools, math
from dataclasses import dataclass, field
from typing import Callable
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes, splice_sinks, InOrder
from .realize import NewBuffer, normalize, buffers_written
from .strided_view import View, compose, contiguous_strides
from .split import cache_split_plan, split_reduction_plan, split_reduction


@dataclass(frozen=True)
class Storage:
  """Memory of one device that one or more intermediate buffers of disjoint lifetimes live in."""
  number: int
  nbytes: int
  device: str


@dataclass(frozen=True)
class Extern:
  """A library routine standing in for a kernel: a routine of `family` ("gemm", the only one so far) with its
  parameters (for gemm: operand dtypes, batch count, the BLAS layout of each operand, offsets and batch strides in
  elements), which of the step's buffers are its output and inputs, and the generated kernel that computes the same.
  `name` is the variant a library exports and the listing shows: "sgemm" (float32), "hgemm" (float16 operands, the
  product accumulated in float32), "_batched" added for more than one product."""
  family: str
  params: tuple[tuple[str, int | str], ...]
  operands: tuple[int, ...]   # indices into the step's buffers: output first
  kernel: UOp
  pick: bool                  # time both on first use (True), or always the library (False)

  @property
  def name(self) -> str:
    p = dict(self.params)
    return {"float32": "s", "float16": "h"}[p["dtype"]] + self.family + ("_batched" if p["batch"] > 1 else "")

  @property
  def flops(self) -> int:
    """Multiplies and adds: 2 x batch x m x n x k (for DEBUG=2's rate; the generated kernel's count may differ)."""
    p = dict(self.params)
    return 2 * p["batch"] * p["m"] * p["n"] * p["k"]

  def __str__(self) -> str:
    """`sgemm 64x48x40 (A, B^T)`: (batch x) m x n x k, each operand as BLAS reads it (^T: transposed), a broadcast
    operand (one matrix for the whole batch) and an output dtype other than the operands' named after."""
    p = dict(self.params)
    size = "x".join(str(p[d]) for d in (("batch",) if p["batch"] > 1 else ()) + ("m", "n", "k"))
    layout = ", ".join(x + ("^T" if p[f"trans_{x.lower()}"] == "T" else "") for x in "AB")
    shared = "".join(f"; {x} broadcast" for x in "AB" if p["batch"] > 1 and p[f"stride_{x.lower()}"] == 0)
    out = f" -> {p['c_dtype']}" if p["c_dtype"] != p["dtype"] else ""
    return f"{self.name} {size} ({layout}{shared}){out}"


@dataclass(frozen=True)
class Choice:
  """What a PICK step may run: named options, each its calls in order as (normalized kernel, indices of the step's
  buffers that fill its slots), or as (Extern, indices) for a library call (its operands index those buffers). The
  first option is the kernel as scheduled."""
  options: tuple[tuple[str, tuple[tuple[UOp | Extern, tuple[int, ...]], ...]], ...]


@dataclass
class HostContext:
  """What the host stages know beyond the schedule: the buffers the realize returns, the existing buffers some
  outputs must be written into (an assignment: output BUFFER -> (existing BUFFER, the View of it written)), and
  which library routines the runtime can call (`externs(device) -> names`; `extern_mode` "off", "on" or "pick"),
  and the SM count of a device whose loops are a grid of threads (`multiprocessors(device)`, None for any other: only
  such a device splits reductions; `split_mode` "off", "on" or "pick")."""
  returned: frozenset[UOp]
  targets: dict[UOp, tuple[UOp, View]] = field(default_factory=dict)
  externs: Callable[[str], tuple[str, ...]] = lambda device: ()
  extern_mode: str = "pick"
  multiprocessors: Callable[[str], int | None] = lambda device: None
  split_mode: str = "pick"
  storages: itertools.count = field(default_factory=itertools.count)
  memory: MemoryPlan | None = None   # stage memory's index and free list (index_lifetimes)


def nbytes(b: UOp) -> int: return b.arg.size * b.dtype.itemsize


def is_intermediate(ctx: HostContext, b: UOp) -> bool:
  return b.op is Ops.BUFFER and isinstance(b.arg, NewBuffer) and b not in ctx.returned


# ---- stage host: kernels become calls ----
def _reads_only_where_it_writes(k: UOp, st: UOp, target: UOp, view: View) -> bool:
  """Every read of `target` in kernel k is of the element store `st` writes at the same index: an elementwise use of
  VIEW(target, view), one that st's own value makes (the other stores of a kernel of several may use it too: it is
  one load), and no op of st's value other than an elementwise one is computed from it (a view or a reduction on the
  way reads it at other indices: `x.assign((x + 1).flip(0))`). Then each element is read before it is written, by the
  same iteration: st's value needs the load.
  One walk, users before sources: a node is in st's value when a user of it is, and below a view or reduction of st's
  value when a user of it in the value is one or is below one; a read is judged once all its users are seen."""
  inside, below = {st.src[1]}, set()
  for n in reversed(k.toposort):
    if n.op is Ops.VIEW and n.src[0] is target and (n.arg != view or n not in inside or n in below): return False
    if n in inside:
      inside.update(n.src)
      if n in below or n.op not in GroupOp.Elementwise: below.update(n.src)
    for s in n.src:
      if s is target and n.op is not Ops.VIEW: return False
      if s.op is Ops.VIEW and s.src[0] is target and n.op not in GroupOp.Elementwise and n.op is not Ops.STORE: return False
  return True


def store_into_assigned_buffer(ctx: HostContext, k: UOp) -> UOp | None:
  """Each output an assignment wants in an existing buffer: stored there directly when safe, else computed aside and
  copied there after the kernel (every store of a kernel of several outputs at once: the kernel runs once)."""
  stores, copies = list(k.src), []
  for i, st in enumerate(k.src):
    if (t := ctx.targets.get(st.src[0].src[0])) is None: continue
    target, view = t
    if _reads_only_where_it_writes(k, st, target, view):
      stores[i] = st.replace(src=(UOp(Ops.VIEW, st.src[0].dtype, (target,), view), st.src[1]))
      continue
    # the kernel reads the target elsewhere (a[::-1], a reduction over it, another output's value): write a new
    # buffer first, then copy
    done = st.src[0].src[0]
    ctx.returned = ctx.returned - {done}
    copies.append(UOp(Ops.KERNEL, src=(UOp(Ops.STORE, src=(UOp(Ops.VIEW, done.dtype, (target,), view), st.src[0])),), arg=k.arg))
  if not copies: return k.replace(src=tuple(stores)) if stores != list(k.src) else None
  return UOp(Ops.SINK, src=(call_kernel(ctx, k.replace(src=tuple(stores))), *copies))


def call_kernel(ctx: HostContext, k: UOp) -> UOp | None:
  # (a kernel storing into an assignment's output never gets here: store_into_assigned_buffer, first, takes it)
  norm, buffers = normalize(k)
  return UOp(Ops.CALL, src=tuple(buffers), arg=norm)


def product_operand(x: UOp) -> tuple[UOp, View] | None:
  """(buffer, the one View it is read through) of an operand of a product: a chain of VIEWs over a BUFFER that merges
  into one view, where a float16 buffer may be widened to float32 on the way (a view commutes with the cast)."""
  if x.op is Ops.CAST and x.dtype is dtypes.float32 and x.src[0].dtype is dtypes.float16:
    inner = product_operand(x.src[0])
    return inner if inner is not None and inner[0].dtype is dtypes.float16 else None
  if x.op is not Ops.VIEW: return None
  if x.src[0].op is Ops.BUFFER: return x.src[0], x.arg
  inner = product_operand(x.src[0])
  return None if inner is None or (v := compose(inner[1], x.arg)) is None else (inner[0], v)


def merged_batch(sizes: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
  """(count, one stride per operand) of batch axes that walk every operand's memory as a single axis would (axes of
  size 1 dropped), else None; no axes is a batch of 1."""
  axes = [i for i, s in enumerate(sizes) if s > 1]
  for st in strides:
    if any(st[i] < 0 for i in axes) or any(st[i] != st[j] * sizes[j] for i, j in zip(axes, axes[1:])): return None
  return math.prod(sizes), tuple(st[axes[-1]] if axes else 0 for st in strides)


def blas_layout(s_rows: int, s_cols: int, rows: int, cols: int) -> tuple[str, int] | None:
  """("N", leading dimension) for a rows x cols matrix stored row-major, ("T", ...) for one stored transposed."""
  if s_cols == 1 and s_rows >= cols: return "N", s_rows
  if s_rows == 1 and s_cols >= rows: return "T", s_cols
  return None


def product_strides(out: View, value: UOp, shape: tuple[int, ...]) -> tuple[int, ...] | None:
  """The strides in C's buffer along each axis of the sum (of shape `shape`) that `value` stores through `out`: the sum
  stored through views that each reshape it in order or permute its axes (a batch of heads written back between a
  sequence's rows); None for any other view."""
  strides = out.strides   # along the axes of `value`, as the loop walks down to the sum
  while value.op is Ops.VIEW:
    v, inner = value.arg, value.src[0]
    inner_shape = inner.arg.shape if inner.op is Ops.VIEW else shape
    inner_contiguous = contiguous_strides(inner_shape)
    if v.is_contiguous and v.size == math.prod(inner_shape):   # a reshape: element order kept
      if strides != contiguous_strides(v.shape): return None
      strides = inner_contiguous
    elif v.offset == 0 and v.mask is None:                     # a permutation: each axis of the inner value is one of v's
      unused = [d for d, size in enumerate(v.shape) if size > 1]
      permuted = []
      for size, stride in zip(inner_shape, inner_contiguous):
        d = next((d for d in unused if v.shape[d] == size and v.strides[d] == stride), None) if size > 1 else -1
        if d is None: return None
        if d >= 0: unused.remove(d)
        permuted.append(strides[d] if d >= 0 else 0)
      if unused: return None
      strides = tuple(permuted)
    else: return None
    value = inner
  return strides


GEMM_DTYPES = (dtypes.float32, dtypes.float16)
INT32_MAX = 2 ** 31 - 1   # BLAS takes sizes and leading dimensions as 32-bit ints


def gemm_operands(k: UOp):
  """(C, A, B, gemm parameters) when kernel k is exactly a (batch of) matrix product(s) C = A @ B and nothing else,
  else None. The kernel's form, as the front end builds a matmul: STORE(C, [CAST to float16]([VIEWs](REDUCE_AXIS(ADD
  over the last axis, MUL(A, B))))), A and B read through views of shape (*batch, m, n, k) that repeat A along n and
  B along m, float32 or float16 widened to float32 (products exact, summed in float32, one rounding at the end). Each
  operand's layout must be one BLAS reads (either possibly transposed; C's rows unit-stride, anywhere in its buffer:
  an assignment to t[i:j] stores at an offset), and the batch axes must walk each operand at one stride (0: an operand
  shared by the batch). A batch sharing B whose A and C rows follow on from one product to the next is one product
  with batch x m rows."""
  if len(k.src) != 1: return None
  out, value = k.src[0].src
  c = out.src[0]
  if out.arg.mask is not None or c.dtype not in GEMM_DTYPES: return None
  if value.op is Ops.CAST:   # float16 out: the float32 sum rounded once
    if c.dtype is not dtypes.float16: return None
    value = value.src[0]
  elif c.dtype is not dtypes.float32: return None
  r = value
  while r.op is Ops.VIEW: r = r.src[0]
  if r.op is not Ops.REDUCE_AXIS or r.dtype is not dtypes.float32 or r.src[0].op is not Ops.MUL: return None
  loads = [product_operand(x) for x in r.src[0].src]
  if None in loads or any(v.mask is not None for _, v in loads): return None
  (a, av), (b, bv) = loads
  shape = av.shape
  if len(shape) < 3 or bv.shape != shape or r.arg != (Ops.ADD, (len(shape) - 1,)) or a.dtype is not b.dtype: return None
  if c.dtype is dtypes.float16 and a.dtype is not dtypes.float16: return None   # no library variant rounds a float32 product to float16
  *batch, m, n, kk = shape
  if av.strides[-2] != 0: (a, av), (b, bv) = (b, bv), (a, av)  # the operand that does not vary along n is A
  if av.strides[-2] != 0 or bv.strides[-3] != 0 or c in (a, b) or min(m, n, kk) < 2: return None
  if (cs := product_strides(out.arg, value, (*batch, m, n, 1))) is None or cs[-2] != 1 or cs[-3] < n: return None
  if (merged := merged_batch(tuple(batch), av.strides[:-3], bv.strides[:-3], cs[:-3])) is None: return None
  count, (stride_a, stride_b, stride_c) = merged
  if (la := blas_layout(av.strides[-3], av.strides[-1], m, kk)) is None or (lb := blas_layout(bv.strides[-1], bv.strides[-2], kk, n)) is None:
    return None
  (ta, lda), (tb, ldb), ldc = la, lb, cs[-3]
  if count > 1 and stride_b == 0 and ta == "N" and stride_a == m * lda and stride_c == m * ldc:
    m, count, stride_a, stride_c = m * count, 1, 0, 0
  if max(m, n, kk, lda, ldb, ldc, count) > INT32_MAX: return None
  return c, a, b, (("dtype", a.dtype.name), ("c_dtype", c.dtype.name), ("batch", count), ("trans_a", ta), ("trans_b", tb),
                   ("m", m), ("n", n), ("k", kk), ("lda", lda), ("ldb", ldb), ("ldc", ldc), ("offset_a", av.offset),
                   ("offset_b", bv.offset), ("offset_c", out.arg.offset), ("stride_a", stride_a), ("stride_b", stride_b),
                   ("stride_c", stride_c))


def call_library_for_matmul(ctx: HostContext, k: UOp) -> UOp | None:
  """A matrix product the device's BLAS can do: an EXTERN gemm step, the generated kernel kept as the other choice;
  where the product is also offered a split over k (a GPU, both picks timed), a PICK among the three."""
  if ctx.extern_mode == "off": return None
  if (mm := gemm_operands(k)) is None: return None
  norm, buffers = normalize(k)
  ext = Extern("gemm", mm[3], tuple(buffers.index(x) for x in mm[:3]), norm, ctx.extern_mode == "pick")
  # the shape first: asking for the routine loads the library
  if ext.name not in ctx.externs(k.arg): return None
  if ext.pick and ctx.split_mode == "pick" and (split := offer_split_reduction(ctx, k)) is not None:
    options = split.arg.options
    library = ("library", ((ext, tuple(range(len(buffers)))),))   # the step's buffers start with the kernel's own
    return split.replace(arg=Choice((*options, library)))
  return UOp(Ops.EXTERN, src=tuple(buffers), arg=ext)


def offer_split_reduction(ctx: HostContext, k: UOp) -> UOp | None:
  """A reduction of few, long rows on a GPU, or a product whose panels would not stay in the CPU's cache: a PICK between
  the kernel and its split into partials and their combine (rules/split.py); with split_mode "on", the two calls
  alone."""
  if ctx.split_mode == "off": return None
  # a kernel that reads what it writes (an update in place) would apply itself again on every timed run
  written = buffers_written(k)
  if any(n in written for st in k.src for n in st.src[1].toposort): return None
  sms = ctx.multiprocessors(k.arg)
  if (split := cache_split_plan(k) if sms is None else split_reduction_plan(k, sms)) is None: return None
  partials, combine, scratches = split_reduction(k, split)
  if ctx.split_mode == "on": return UOp(Ops.SINK, src=(call_kernel(ctx, partials), call_kernel(ctx, combine)))
  norm, buffers = normalize(k)
  whole = ((norm, tuple(range(len(buffers)))),)
  buffers += scratches
  calls = tuple((n, tuple(buffers.index(b) for b in bs)) for n, bs in map(normalize, (partials, combine)))
  return UOp(Ops.PICK, src=tuple(buffers), arg=Choice((("one kernel", whole), (repr(split), calls))))


def skip_empty_kernel(k: UOp) -> UOp | None:
  """A kernel whose every store writes no element has nothing to do: no step. (Lowered, its loop over a dimension of
  size 0 leaves no index, since a view of no elements has stride 0, and the body ran once and wrote one element past
  a buffer of none: found by GRAFT_SANITIZE's fuzzing, issue 22.)"""
  if all(st.src[0].op is Ops.VIEW and st.src[0].arg.size == 0 for st in k.src): return UOp(Ops.SINK, src=(), arg="steps")
  return None


host_rules = PatternMatcher([
  (UPat(Ops.KERNEL, name="k"), skip_empty_kernel),
  (UPat(Ops.KERNEL, name="k"), store_into_assigned_buffer),
  (UPat(Ops.KERNEL, name="k"), call_library_for_matmul),
  (UPat(Ops.KERNEL, name="k"), offer_split_reduction),
  (UPat(Ops.KERNEL, name="k"), call_kernel),
  (UPat(Ops.SINK, name="node", arg="steps"), splice_sinks)  # a rule that made several steps of one,
], name="host")


# ---- stage memory: lifetimes and shared storage, planned step by step ----
STEP_OPS = (Ops.CALL, Ops.EXTERN, Ops.PICK, Ops.COPY)   # the steps of a host program


@dataclass
class MemoryPlan:
  """What stage memory knows: an index of the program's lifetimes (made by `index_lifetimes` before the rules run) and
  the free list, kept as the steps are planned one by one in program order."""
  place: dict[UOp, int]                 # a step -> its place in the program
  born: dict[int, list[UOp]]            # a place -> the intermediates first used there
  dying: dict[int, list[UOp]]           # a place -> the intermediates last used there
  free: list[Storage] = field(default_factory=list)            # storages no live buffer holds, in the order freed
  storage_of: dict[UOp, Storage] = field(default_factory=dict)
  last_free: dict[Storage, UOp] = field(default_factory=dict)  # a storage -> the buffer whose FREE is its last
  allocs: dict[int, list[UOp]] = field(default_factory=dict)   # a step's place -> the ALLOCs before it
  steps: InOrder = field(default_factory=InOrder)             # steps are planned in program order


def index_lifetimes(ctx: HostContext, program: UOp) -> None:
  """The memory stage's index (its Stage.prepare): where each intermediate buffer is first and last used. Every step
  must be one the memory rules plan (`STEP_OPS`)."""
  if (unknown := next((s for s in program.src if s.op not in STEP_OPS), None)) is not None:
    raise ValueError(f"host program step {unknown.op} is not a CALL, EXTERN, PICK or COPY: its memory cannot be planned")
  first: dict[UOp, int] = {}
  last: dict[UOp, int] = {}
  for i, step in enumerate(program.src):
    for b in step.src:
      if is_intermediate(ctx, b): first.setdefault(b, i); last[b] = i
  born: dict[int, list[UOp]] = {}
  dying: dict[int, list[UOp]] = {}
  for b, i in first.items(): born.setdefault(i, []).append(b)
  for b, i in last.items(): dying.setdefault(i, []).append(b)
  ctx.memory = MemoryPlan({step: i for i, step in enumerate(program.src)}, born, dying)


def plan_step(m: MemoryPlan, storages: itertools.count, i: int) -> None:
  """Step i, the steps before it planned: each buffer first used there takes the smallest free storage of its device
  that holds it (best fit; ties: the oldest), else a new one; each last used there puts its storage back on the free
  list."""
  allocs = []
  for b in m.born.get(i, ()):
    fits = [s for s in m.free if s.device == b.arg.device and s.nbytes >= nbytes(b)]
    if fits: m.free.remove(s := min(fits, key=lambda s: (s.nbytes, s.number)))
    else: s = Storage(next(storages), nbytes(b), b.arg.device)
    m.storage_of[b] = s
    allocs.append(UOp(Ops.ALLOC, src=(b,), arg=s))
  m.allocs[i] = allocs
  for b in m.dying.get(i, ()):
    m.free.append(m.storage_of[b])
    m.last_free[m.storage_of[b]] = b


def plan_memory_of_step(ctx: HostContext, step: UOp) -> None:
  """A step's buffers get their storage, into the context (the step itself is unchanged). Steps are planned in program
  order whatever order the rules fire in: the free list a step sees is what the steps before it left."""
  if (i := ctx.memory.place.get(step)) is not None:
    ctx.memory.steps.up_to(i, lambda j: plan_step(ctx.memory, ctx.storages, j))


def place_allocs_and_frees(ctx: HostContext, program: UOp) -> UOp:
  """Every step planned (rewriting is bottom-up), each is laid out between its ALLOCs and its FREEs; the FREE after
  which no ALLOC takes its storage again names that storage: the runtime gives it back to the device there."""
  m = ctx.memory
  def free(b: UOp) -> UOp: return UOp(Ops.FREE, src=(b,), arg=m.storage_of[b] if m.last_free[m.storage_of[b]] is b else None)
  steps = [x for i, step in enumerate(program.src) for x in (*m.allocs[i], step, *map(free, m.dying.get(i, ())))]
  return program.replace(src=tuple(steps), arg="planned")


memory_rules = PatternMatcher([
  (UPat(STEP_OPS, name="step"), plan_memory_of_step),
  (UPat(Ops.SINK, name="program", arg="steps"), place_allocs_and_frees),
], name="memory")
