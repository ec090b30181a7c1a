"""What C and CUDA C share: the text of expressions and statements, as rules over the linear instruction list.

`cstyle_rules` maps a UOp to its C text (ctx: `RenderContext`, which names every value already rendered). A target
adds its own rules in front (`target_rules + cstyle_rules`: the first match wins) for what it says differently, and
a `Language` for its type names, literals and math functions. `render_kernel` walks the list that the linearize
stage produced and lays the text out: loops open and close blocks, values that are not trivially inline get a
variable of their own.
"""
from __future__ import annotations
import math, re
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, DType, PtrDType, dtypes, rewrite_each
from rewrite.dtypes import bf16_bits


@dataclass
class Language:
  """How a C-family target names types and builds literals and math calls."""
  kernel_prefix: str = "void"
  restrict: str = "restrict"
  half: str = "_Float16"
  bool_type: str = "bool"
  infinity: str = "INFINITY"
  outline_parallel: bool = False  # a parallel loop's body becomes a function of its own (see renderers/c.py)
  params_after: tuple[str, ...] = ()   # parameters after the buffers (a CUDA kernel's tensor maps: renderers/cuda_tma.py)
  nan: str = "NAN"
  headers: tuple[str, ...] = ("#include <math.h>", "#include <stdbool.h>", "#include <stdint.h>")
  # bfloat16: its type, a literal from its 16 bits, and the two conversions with float32 (the only casts it takes:
  # tensor/ computes its arithmetic in float32)
  bf16: str = "g_bf16"
  bf16_bits_literal: str = "((g_bf16){{{bits:#06x}}})"
  bf16_from_float: str = "g_float_to_bf16"
  bf16_to_float: str = "g_bf16_to_float"

  def type(self, dt: DType | PtrDType) -> str:
    if isinstance(dt, PtrDType): return f"{self.type(dt.base)}*"
    if dt is dtypes.float16: return self.half
    if dt is dtypes.bool: return self.bool_type
    if dt is dtypes.bfloat16: return self.bf16
    return dt.cname

  def literal(self, dt: DType, v) -> str:
    """The C text of constant v of dtype dt. A negative one is in parentheses: a rule may put `-` or any operator
    before it (`-` before `-0.5f` would be the decrement `--`)."""
    if dt.is_bool: return "1" if v else "0"
    if dt is dtypes.bfloat16: return self.bf16_bits_literal.format(bits=int(bf16_bits([v])[0]))
    if dt.is_float:
      if math.isnan(v): s = self.nan
      elif math.isinf(v): s = self.infinity if v > 0 else f"(-{self.infinity})"
      else: s = repr(float(v)) + ("" if dt is dtypes.float64 else "f")
      if s.startswith("-"): s = f"({s})"   # also -0.0, whose sign matters (1/-0.0)
      return s if dt in (dtypes.float32, dtypes.float64) else f"(({self.type(dt)}){s})"
    if dt.is_int:
      v = int(v)
      suffix = {dtypes.int64: "LL", dtypes.uint64: "ULL", dtypes.uint32: "U"}.get(dt, "")
      # the most negative value has no literal of its own type (2147483648 is too wide for int)
      if v == dtypes.min(dt) and not dt.is_unsigned: return f"(({self.type(dt)})({v + 1}{suffix}-1))"
      s = f"({v}{suffix})" if v < 0 else f"{v}{suffix}"
      return s if suffix or dt is dtypes.int32 else f"(({self.type(dt)}){s})"
    raise TypeError(f"no literal of {dt}")

  def math(self, fn: str, dt: DType) -> str: return fn if dt is dtypes.float64 else f"{fn}f"


@dataclass
class RenderContext:
  lang: Language
  names: dict[UOp, str] = field(default_factory=dict)
  accumulators: dict[UOp, list[UOp]] = field(default_factory=dict)  # innermost loop of reductions -> the REDUCEs
  declared: list[tuple[str, str, str]] = field(default_factory=list)  # (type, name, text) to declare before the value
  temporaries: int = 0
  def __getitem__(self, u: UOp) -> str:
    # constants are not in the instruction list: each is its literal
    if u.op is Ops.CONST and u not in self.names: self.names[u] = self.lang.literal(u.dtype, u.arg)
    return self.names[u]

  def declare(self, type_: str, text: str) -> str:
    """A variable of its own for `text`, declared just before the value being rendered; returns its name."""
    self.temporaries += 1
    self.declared.append((type_, name := f"t{self.temporaries}", text))
    return name


def _max(ctx: RenderContext, x: UOp) -> str:
  a, b = ctx[x.src[0]], ctx[x.src[1]]
  # numpy's maximum propagates NaN: keep a when it is NaN
  return f"(({a}>{b}||{a}!={a})?{a}:{b})" if x.dtype.is_float else f"(({a}>{b})?{a}:{b})"


# C's infix operators; integer / and % truncate toward zero, as IDIV and MOD do (docs/design.md)
BINARY_SYMBOLS = {Ops.ADD: "+", Ops.MUL: "*", Ops.IDIV: "/", Ops.FDIV: "/", Ops.MOD: "%", Ops.CMPLT: "<", Ops.CMPNE: "!=",
                  Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^", Ops.SHL: "<<", Ops.SHR: ">>"}


def render_binary(ctx: RenderContext, x: UOp) -> str: return f"({ctx[x.src[0]]}{BINARY_SYMBOLS[x.op]}{ctx[x.src[1]]})"


def _reduce_update(ctx: RenderContext, a: UOp) -> str:
  red = a.src[0]
  acc, val = ctx.names[red], ctx[red.src[0]]
  if red.arg is Ops.ADD: return f"{acc} = {acc} + {val};"
  if red.arg is Ops.MAX:
    return f"{acc} = ({val}>{acc}||{val}!={val})?{val}:{acc};" if red.dtype.is_float else f"{acc} = ({val}>{acc})?{val}:{acc};"
  raise TypeError(f"no reduction {red.arg}")


def reduce_identity(ctx: RenderContext, red: UOp) -> str:
  if red.arg is Ops.ADD: return ctx.lang.literal(red.dtype, 0)
  return ctx.lang.literal(red.dtype, dtypes.min(red.dtype))


def loop_head(ctx: RenderContext, r: UOp) -> str:
  # the counter has the loop's own type: int64 where the index_width stage found that the trip count needs it
  return f"for ({ctx.lang.type(r.dtype)} {ctx[r]} = 0; {ctx[r]} < {ctx[r.src[0]]}; {ctx[r]}++) {{"


def _carried_accumulator(ctx: RenderContext, u: UOp) -> str:
  """CARRY (rules/attention.py): the accumulator of the REDUCE whose value is NOOP(new value, this CARRY)."""
  return next(ctx.names[r] for rs in ctx.accumulators.values() for r in rs if r.src[0].op is Ops.NOOP and r.src[0].src[1] is u)


def _carry_init(ctx: RenderContext, red: UOp) -> str:
  # a constant (an online softmax's running max), or a value computed before the loop (a prefetched register,
  # rules/opt/pack.py `prefetched`): the CARRY's source after its loop
  carry = red.src[0].src[1]
  if carry.arg[1] is None: return ctx[carry.src[1]]
  init = ctx.lang.literal(red.dtype.scalar, carry.arg[1])
  return init if red.dtype.count == 1 else f"(({ctx.lang.type(red.dtype)}){{{', '.join([init] * red.dtype.count)}}})"


def gated_read(ctx: RenderContext, buf: UOp, idx: UOp, valid: UOp, type_: str, deref: str = "*") -> str:
  """The value at buf[idx] where `valid` holds, read at an address that is always in bounds: where the gate is off
  the read is of element 0 (idx*valid), unconditional, and a select keeps it or not (the caller). No address outside
  the buffer is ever formed, and no branch guards a load. With the plain `valid ? buf[idx] : 0`, gcc 12.2 -O3 turns
  the guarded reads of an unrolled loop into a group of masked vector loads and reads a backward walk one element off
  (issue 22); a select in the index (`valid ? idx : 0`) does not help, since gcc threads the branch back onto the
  load. A product has no branch to thread; but a constant index is a select inside the address (`selected_address`).
  `deref` reads a vector: `*(floatx8*)`."""
  address = selected_address(ctx, buf, valid, idx) if idx.op is Ops.CONST else f"({ctx[buf]}+{ctx[idx]}*{ctx[valid]})"
  return ctx.declare(type_, f"{deref}{address}")


def selected_address(ctx: RenderContext, buf: UOp, c: UOp, k: UOp) -> str:
  """buf + (c ? k : 0) for a constant k, the select written inside the address: as a value of its own before the load
  (`1*c`, or `int i = c ? 1 : 0`) gcc 12.2 -O3 -march=native folds it into the bool's -1 lane mask at k = 1 and reads
  element -1 (a cat of a one-element view, `x[1].pad(...)` of a computed tensor: wrong numbers at 5 lanes, an internal
  compiler error from 16); inside the address it compiled right in every case of a sweep (docs/design.md, "Wrong
  answers the fuzzer found")."""
  return f"({ctx[buf]}+({ctx[c]}?{ctx[k]}:0))"


def _index_selected(ctx: RenderContext, buf: UOp, w: UOp) -> str | None:
  """An index clamped to a constant or 0 (`c ? k : 0`: a padded view of a computed tensor, rules/lower.py
  `index_view`), selected inside its address."""
  c, k, zero = w.src
  if k.op is not Ops.CONST or zero.op is not Ops.CONST or zero.arg != 0 or not w.dtype.is_int: return None
  return selected_address(ctx, buf, c, k)


def render_gated_load(ctx: RenderContext, ld: UOp, buf: UOp, idx: UOp, valid: UOp) -> str:
  return f"({ctx[valid]}?{gated_read(ctx, buf, idx, valid, ctx.lang.type(ld.dtype))}:{ctx.lang.literal(ld.dtype, 0)})"


def _cast(ctx: RenderContext, x: UOp) -> str:
  src = x.src[0].dtype
  if dtypes.bfloat16 not in (x.dtype, src): return f"(({ctx.lang.type(x.dtype)})({ctx[x.src[0]]}))"
  if src is dtypes.float32: return f"{ctx.lang.bf16_from_float}({ctx[x.src[0]]})"
  if x.dtype is dtypes.float32: return f"{ctx.lang.bf16_to_float}({ctx[x.src[0]]})"
  raise TypeError(f"a cast from {src.name} to {x.dtype.name}: bfloat16 converts only to and from float32 (Tensor.cast goes through it)")


def _no_bf16_arithmetic(x: UOp) -> None:
  if x.op is not Ops.WHERE and any(s.dtype is dtypes.bfloat16 for s in (x, *x.src)):
    raise TypeError(f"{x.op} on bfloat16 reached the renderer: bfloat16 arithmetic is computed in float32 "
                    f"(tensor/elementwise.py _alu); a rule that makes it must do the same")


carried = UPat(Ops.REDUCE, name="red", arg=Ops.NOOP)
cstyle_rules = PatternMatcher([
  (UPat(GroupOp.ALU, name="x"), _no_bf16_arithmetic),
  # a carried accumulator (rules/attention.py): declared with its initial value, read at the start of each step,
  # assigned its new value at the end
  (UPat(Ops.DEFINE_ACC, src=(carried,)), lambda ctx, red: f"{ctx.lang.type(red.dtype)} {ctx.names[red]} = {_carry_init(ctx, red)};",
   "render_carried_accumulator"),
  (UPat(Ops.ASSIGN, src=(carried,)), lambda ctx, red: f"{ctx.names[red]} = {ctx[red.src[0]]};", "render_carried_update"),
  (UPat(Ops.CARRY, name="u"), _carried_accumulator),
  (UPat(Ops.NOOP, name="u"), lambda ctx, u: ctx[u.src[0]], "render_value_after"),
  (UPat(Ops.CONST, name="c"), lambda ctx, c: ctx.lang.literal(c.dtype, c.arg), "render_const"),
  (UPat(Ops.DEFINE_GLOBAL, name="g"), lambda g: f"data{g.arg}", "render_define_global"),
  (UPat(Ops.INDEX, src=(UPat.var("buf"), UPat(Ops.WHERE, name="w"))), _index_selected, "render_index_selected"),
  (UPat(Ops.INDEX, name="i"), lambda ctx, i: f"({ctx[i.src[0]]}+{ctx[i.src[1]]})", "render_index"),
  (UPat(Ops.LOAD, src=(UPat.var("idx"),)), lambda ctx, idx: f"(*{ctx[idx]})", "render_load"),
  (UPat(Ops.LOAD, name="ld", src=(UPat(Ops.INDEX, src=(UPat.var("buf"), UPat.var("idx"))), UPat.var("valid"))), render_gated_load),
  (UPat(Ops.STORE, src=(UPat.var("idx"), UPat.var("val"))), lambda ctx, idx, val: f"*{ctx[idx]} = {ctx[val]};", "render_store"),
  (UPat(Ops.STORE, src=(UPat.var("idx"), UPat.var("val"), UPat.var("gate"))),
   lambda ctx, idx, val, gate: f"if ({ctx[gate]}) *{ctx[idx]} = {ctx[val]};", "render_gated_store"),
  (UPat(Ops.RANGE, name="r"), loop_head),
  (UPat(Ops.END), lambda: "}", "render_end"),
  (UPat(Ops.DEFINE_ACC, name="a"), lambda ctx, a: f"{ctx.lang.type(a.dtype)} {ctx.names[a.src[0]]} = {reduce_identity(ctx, a.src[0])};", "render_define_acc"),
  (UPat(Ops.ASSIGN, name="a"), _reduce_update),
  (UPat(tuple(BINARY_SYMBOLS), name="x"), render_binary),
  (UPat(Ops.MAX, name="x"), _max),
  (UPat(Ops.NEG, name="x"), lambda ctx, x: f"(-{ctx[x.src[0]]})", "render_neg"),
  (UPat(Ops.RECIP, name="x"), lambda ctx, x: f"({ctx.lang.literal(x.dtype, 1)}/{ctx[x.src[0]]})", "render_recip"),
  (UPat(Ops.EXP2, name="x"), lambda ctx, x: f"{ctx.lang.math('exp2', x.dtype)}({ctx[x.src[0]]})", "render_exp2"),
  (UPat(Ops.LOG2, name="x"), lambda ctx, x: f"{ctx.lang.math('log2', x.dtype)}({ctx[x.src[0]]})", "render_log2"),
  (UPat(Ops.SIN, name="x"), lambda ctx, x: f"{ctx.lang.math('sin', x.dtype)}({ctx[x.src[0]]})", "render_sin"),
  (UPat(Ops.SQRT, name="x"), lambda ctx, x: f"{ctx.lang.math('sqrt', x.dtype)}({ctx[x.src[0]]})", "render_sqrt"),
  (UPat(Ops.TRUNC, name="x"), lambda ctx, x: f"{ctx.lang.math('trunc', x.dtype)}({ctx[x.src[0]]})", "render_trunc"),
  (UPat(Ops.MULACC, name="x"), lambda ctx, x: f"{ctx.lang.math('fma', x.dtype)}({', '.join(ctx[s] for s in x.src)})", "render_mulacc"),
  (UPat(Ops.WHERE, name="x"), lambda ctx, x: f"({ctx[x.src[0]]}?{ctx[x.src[1]]}:{ctx[x.src[2]]})", "render_where"),
  (UPat(Ops.CAST, name="x"), _cast, "render_cast"),
], name="render.cstyle")

# values that are named by their text rather than given a variable
INLINE = frozenset({Ops.CONST, Ops.DEFINE_GLOBAL, Ops.INDEX})
STATEMENTS = frozenset({Ops.STORE, Ops.END, Ops.DEFINE_ACC, Ops.ASSIGN, Ops.DEFINE_LOCAL, Ops.MMA})


def kernel_params(linear: UOp, lang: Language) -> list[str]:
  globals_ = sorted((u for u in linear.src if u.op is Ops.DEFINE_GLOBAL), key=lambda g: g.arg)
  # (a buffer is written by its stores, or from a staging tile in shared memory: renderers/cuda_tma.py)
  written = {u.src[0].src[0] for u in linear.src if u.op is Ops.STORE} | \
    {g for u in linear.src if u.op is Ops.DEFINE_LOCAL for g in u.src if g.op is Ops.DEFINE_GLOBAL}
  return [f"{'' if g in written else 'const '}{lang.type(g.dtype)} {lang.restrict} data{g.arg}".replace("  ", " ") for g in globals_] \
    + list(lang.params_after)


def render_kernel(name: str, linear: UOp, rules: PatternMatcher, lang: Language, prefix_lines=None) -> str:
  """The text of one kernel from its linear instruction list (a SINK with arg "linear")."""
  if linear.arg != "linear": raise ValueError("render_kernel takes the output of the linearize stage")
  with rewrite_each(rules, "render", len(linear.src)) as rewrite:  # REWRITE_STATS sees the renderer's rules too
    return _render_lines(name, linear, rewrite, lang, prefix_lines)


def _render_lines(name: str, linear: UOp, rewrite, lang: Language, prefix_lines) -> str:
  ctx = RenderContext(lang)
  lines: list[str] = []
  helpers: list[str] = []
  outer_vars: dict[str, str] = {}            # variables declared outside every loop -> their C type
  outlining: tuple[UOp, int] | None = None   # the parallel loop being outlined, and where its body starts
  depth = 1
  for i, u in enumerate(linear.src):
    if u.op is Ops.RANGE: ctx.names[u] = f"ridx{i}"
    elif u.op is Ops.DEFINE_ACC: ctx.names[u.src[0]] = f"acc{i}"; ctx.accumulators.setdefault(u.src[0].src[-1], []).append(u.src[0])
    elif u.op is Ops.DEFINE_LOCAL: ctx.names[u] = f"local{i}"
    elif u.op is Ops.MMA: ctx.names[u] = f"mma{i}"   # an array the statement declares (renderers/cuda_mma.py)
    elif u.op is Ops.REDUCE:  # its value is its accumulator, named at DEFINE_ACC; a target may finish it here
      if (text := rewrite(u, ctx)) is not None: lines.append("  " * depth + text)
      continue
    text = rewrite(u, ctx)
    if text is None: raise NotImplementedError(f"the {lang.kernel_prefix!r} renderer has no rule for {u.op} of {u.dtype}")
    for type_, var, value in ctx.declared:
      lines.append(f"{'  ' * depth}{type_} {var} = {value};")
      if depth == 1: outer_vars[var] = type_
    ctx.declared.clear()
    if u.op is Ops.END: depth -= 1
    if outlining is not None and u.op is Ops.END and u.src[0] is outlining[0]:
      body, lines[outlining[1]:] = lines[outlining[1]:], []
      call = _outline(f"{name}_body{len(helpers)}", f"{lang.type(u.src[0].dtype)} {ctx[u.src[0]]}", body, outer_vars,
                      kernel_params(linear, lang), helpers)
      lines.append("  " * (depth + 1) + call)
      outlining = None
    if u.op is Ops.RANGE or u.op in STATEMENTS:
      lines += ["  " * depth + t for t in text.split("\n")]
      if depth == 1 and u.op is Ops.DEFINE_ACC: outer_vars[ctx.names[u.src[0]]] = lang.type(u.dtype)
    elif u.op in INLINE: ctx.names[u] = text
    else:
      ctx.names[u] = f"v{i}"
      lines.append(f"{'  ' * depth}{lang.type(u.dtype)} v{i} = {text};")
      if depth == 1: outer_vars[f"v{i}"] = lang.type(u.dtype)
    if u.op is Ops.RANGE:
      depth += 1
      if lang.outline_parallel and depth == 2 and u.arg[-1] == "parallel" and _holds_a_loop(linear.src, i):
        outlining = (u, len(lines))
  params = ", ".join(kernel_params(linear, lang))
  return "\n".join([*helpers, f"{lang.kernel_prefix} {name}({params}) {{", *(prefix_lines or []), *lines, "}"])


def _holds_a_loop(program: tuple[UOp, ...], i: int) -> bool:
  """Whether the loop opened at program[i] has a loop inside it. Only such a body is worth a function of its own:
  a body without one would be a call per element, where gcc vectorizes the parallel loop itself."""
  end = UOp(Ops.END, src=(program[i],))
  for u in program[i + 1:]:
    if u is end: return False
    if u.op is Ops.RANGE: return True
  return False


def _outline(fn: str, index: str, body: list[str], outer_vars: dict[str, str], params: list[str], helpers: list[str]) -> str:
  """Move a parallel loop's body into a function of its own; return the call that replaces it. `index` declares the
  loop's counter ("int ridx0")."""
  words = set(re.findall(r"\w+", "\n".join(body)))   # one scan of the body, not one per variable
  used = [v for v in outer_vars if v in words]
  args = [p.rsplit(" ", 1)[1] for p in params]
  helpers.append("\n".join([f"static __attribute__((noinline)) void {fn}({', '.join([index] + params + [f'{outer_vars[v]} {v}' for v in used])}) {{",
                            *(line[4:] for line in body), "}", ""]))
  return f"{fn}({', '.join([index.rsplit(' ', 1)[1]] + args + used)});"
