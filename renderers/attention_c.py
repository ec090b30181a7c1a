"""The CPU's tiled fused-attention kernel: C source for a fused attention kernel (rules/attention.py) whose operands it
can address, used in place of the row-at-a-time kernel the generic stages lower it to (runtime/realize.py `_compile`).

In: a normalized kernel `STORE(VIEW(out), [VIEWs](REDUCE_AXIS(values, scores, arg=(OnlineSoftmax, axes))))` where
  - the scores are `E(dot)`: `dot = REDUCE_AXIS(ADD)(VIEW(q) * VIEW(k))` over the head dimension, read through the
    contiguous view of shape (*batch, Tq, Tk), and E an elementwise expression (+, *, /, -, max, <, !=, where, casts)
    of the dot, constants, buffers read through views, and index arithmetic (IOTA: tril's causal mask);
  - q, k and the values are buffers read through one view each (any strides: a head of a qkv product included);
  - the output is stored through views that only reshape or permute (heads merged back).
Out: C source of one function taking the kernel's buffers in slot order (Unsupported, saying why, where any of that
does not hold: the generic kernel then, and DEBUG=2 says why):

    parallel over (batch, chunk of CHUNK query rows):           K^T and V of the batch packed (keys zero-padded to W)
      for a tile of R query rows:                               q rows in a local tile
        for a block of W keys (W = vector lanes):
          s[r] = q[r] . K^T[:, block]   R vectors of W keys: D broadcast-FMAs each (keys in lanes, no horizontal sum)
          s = E(s) * log2(e), keys past the end -inf
          m' = max(m, hmax s)  c = exp2(m - m')  p = exp2(s - m')  (vectors: g_exp2f_x<W>)
          l = l c + p (lanes summed at the end)   acc[r] = acc[r] c + sum_jj p[jj] V[jj, :]  (D/W vectors a row)
        out rows = acc / sum(l)
A row masked so far reads its exponents against 0 (no -inf - -inf); a row masked whole is 0/0 = NaN, as numpy's.
"""
from __future__ import annotations
import math
from dataclasses import dataclass
from rewrite import UOp, Ops, dtypes
from rules.shapes import shape_of
from rules.strided_view import View, contiguous_strides
from .c import C, team_entries   # (its literals: the C renderer's own; the entries of a kernel a team shares)

R, CHUNK = 4, 256         # query rows of a register tile; query rows of a parallel task (K^T and V packed once per task)
KEY_VECTORS = 3           # vectors of keys a step of the online softmax takes (its max and rescaling once for them all)
LOG2_E = 1 / math.log(2)


C_TYPES = {dtypes.float32: "float", dtypes.bool: "bool", dtypes.int32: "int"}   # the buffers the kernel may read


class Unsupported(Exception):
  """Why the tiled kernel does not apply (DEBUG=2)."""


def _views(x: UOp) -> tuple[UOp, View]:
  """(buffer slot, the one view it is read through) of a chain of VIEWs over a BUFFER."""
  from rules.strided_view import compose
  if x.op is not Ops.VIEW: raise Unsupported(f"an operand is computed ({x.op.name}), not read from a buffer")
  if x.src[0].op is Ops.BUFFER: return x.src[0], x.arg
  b, inner = _views(x.src[0])
  if (v := compose(inner, x.arg)) is None: raise Unsupported("an operand's views do not merge into one")
  return b, v


BINARY = {Ops.ADD: "({} + {})", Ops.MUL: "({} * {})", Ops.FDIV: "({} / {})", Ops.CMPLT: "({} < {})", Ops.CMPNE: "({} != {})"}


class NotVector(Exception):
  """The scores' expression has no vector form here (a load, a max or a cast of a vector): lane by lane instead."""


class Epilogue:
  """E(x, batch indices, i, j) as one C expression: the scores with the dot product's value named `x`. `lanes`: as C
  of vectors (x a floatx<lanes>, j an intx<lanes> `jv` of the block's keys; a comparison a 0/-1 mask, a select bitwise
  on it), else of scalars. `lang`: the language whose literals it writes (renderers/cstyle.py; CUDA's for the GPU's
  kernel)."""
  def __init__(self, dot: UOp, lanes: int = 0, lang=C):
    self.dot, self.lanes, self.lang = dot, lanes, lang

  def vec(self, code: str) -> bool: return bool(self.lanes) and ("x" in code.replace("INFINITY", "") or "jv" in code)

  def mask(self, code: str, u: UOp) -> str:
    """A bool as a vector operand: a scalar bool's 1 is a mask's -1."""
    return f"(-({code}))" if u.dtype is dtypes.bool and not self.vec(code) else code

  def expr(self, u: UOp, idx: list[str], top: bool) -> str:
    if u.op is Ops.VIEW and u.src[0] is self.dot:
      if not top or u.arg != View.contiguous(shape_of(self.dot)).reshape(u.arg.shape): raise Unsupported("the dot product is read through a view")
      return "x"
    if u.op is Ops.VIEW:
      v, inner = u.arg, u.src[0]
      if v.mask is not None: raise Unsupported("the scores read a padded view")
      if inner.op is Ops.CONST: return self.lang.literal(inner.dtype, inner.arg)
      flat = " + ".join([str(v.offset)] + [f"({i})*{s}" for i, s in zip(idx, v.strides) if s != 0])
      if inner.op is Ops.BUFFER:
        if self.lanes: raise NotVector()
        return f"data{inner.arg.number}[{flat}]"
      shape = shape_of(inner)
      return self.expr(inner, [unravel(v, idx, flat, n, st) for n, st in zip(shape, contiguous_strides(shape))], False)
    if u.op is Ops.IOTA: return f"({idx[0]})"
    if u.op is Ops.CONST: return self.lang.literal(u.dtype, u.arg)
    args = [self.expr(s, idx, top) for s in u.src]
    vector = any(map(self.vec, args))
    if vector and u.op in (Ops.CMPNE, Ops.WHERE):
      args = [self.mask(a, s) for a, s in zip(args, u.src)]
    if u.op in BINARY: return BINARY[u.op].format(*args)
    if u.op is Ops.NEG: return f"(-{args[0]})"
    if u.op is Ops.WHERE and vector:
      f, i = f"floatx{self.lanes}", f"intx{self.lanes}"
      t = f if u.dtype.is_float else i
      lift = lambda a: a if self.vec(a) else f"((({t}){{}}) + {a})"   # a scalar broadcast to the lanes
      c = args[0] if self.vec(args[0]) else f"((({i}){{}}) + {args[0]})"
      return f"(({t})((({i}){lift(args[1])} & {c}) | (({i}){lift(args[2])} & ~{c})))"
    if vector: raise NotVector()
    if u.op is Ops.MAX: return f"({args[0]} > {args[1]} ? {args[0]} : {args[1]})"
    if u.op is Ops.WHERE: return f"({args[0]} ? {args[1]} : {args[2]})"
    if u.op is Ops.CAST: return f"(({'float' if u.dtype is dtypes.float32 else 'long' if not u.dtype is dtypes.bool else 'bool'}){args[0]})"
    raise Unsupported(f"the scores hold a {u.op.name}")


def unravel(v: View, idx: list[str], flat: str, n: int, st: int) -> str:
  """The index along an axis (n long, contiguous stride st) of the value that view v reads at `idx` (flat: its offset
  in that value): an index of idx itself, or 0, where v broadcasts or permutes that axis (a causal mask's iota), with no
  division; else the division and remainder of the flat offset."""
  if n == 1: return "0"
  terms = [(i, s, size) for i, s, size in zip(idx, v.strides, v.shape) if s != 0 and size > 1]
  below = sum((size - 1) * s for _, s, size in terms if s < st)   # the most the axes inside this one add
  along = [(i, s, size) for i, s, size in terms if st <= s < st * n]
  if v.offset == 0 and below < st and all(s % (st * n) == 0 for _, s, _ in terms if s >= st * n):
    if not along: return "0"
    if len(along) == 1 and along[0][1] == st and along[0][2] <= n: return f"({along[0][0]})"
  return f"((({flat}) / {st}) % {n})"


def _dot(scores: UOp) -> UOp:
  dots = [n for n in scores.toposort if n.op is Ops.REDUCE_AXIS]
  if len(dots) != 1 or dots[0].arg[0] is not Ops.ADD or dots[0].src[0].op is not Ops.MUL: raise Unsupported("the scores are not one dot product")
  return dots[0]


def lanes(d: int) -> int:
  from rules.opt.heuristic import vector_width
  w = vector_width(4)
  while w > 4 and d % w: w //= 2
  if d % w: raise Unsupported(f"head dimension {d} is not a multiple of 4")
  return w


@dataclass
class Operands:
  """What a tiled attention kernel (this one, or renderers/attention_cuda.py) reads and writes, in its kernel's terms:
  q, k and the values as (buffer, view), the output buffer, its view and its strides along (*batch, Tq, D), the dot
  product and the scores' expression around it, and the buffers' dtypes by slot."""
  out: UOp
  out_view: View
  out_strides: tuple[int, ...]
  batch: tuple[int, ...]
  tq: int
  d: int
  tk: int
  q: tuple[UOp, View]
  k: tuple[UOp, View]
  v: tuple[UOp, View]
  dot: UOp
  scores: UOp
  slots: dict[int, object]
  @property
  def dk(self) -> int: return self.q[1].shape[-1]   # the dot product's length (the values' head dimension may differ)
  @property
  def strides(self) -> tuple[int, ...]:
    """(qi, qd, kj, kd, vd, vj, oi, od): the elements between q's rows and along d, k's keys and d, the values' d and
    keys, the output's rows and d."""
    nbt, qv, kv, vv, os_ = len(self.batch), self.q[1], self.k[1], self.v[1], self.out_strides
    return (qv.strides[nbt], qv.strides[-1], kv.strides[nbt + 1], kv.strides[-1], vv.strides[nbt + 1], vv.strides[-1],
            os_[nbt], os_[nbt + 1])
  def batch_indices(self) -> str:
    """C lines naming the batch indices b0, b1, ... of flat batch index `bt`."""
    return "".join(f"  long b{n} = (bt / {math.prod(self.batch[n + 1:])}) % {size};\n" for n, size in enumerate(self.batch))
  def params(self, args: list[int], restrict: str) -> str:
    """The kernel's parameters: the buffers of slots `args` as data<slot>, the output's the only one not const."""
    return ", ".join(("" if n == self.out.arg.number else "const ") + f"{C_TYPES[self.slots[n]]}* {restrict} data{n}" for n in args)


def attention_operands(norm: UOp) -> Operands:
  """The operands of fused attention kernel `norm`, or Unsupported saying why a tiled kernel cannot address them."""
  from rules.attention import OnlineSoftmax
  from rules.host import product_strides
  if len(norm.src) != 1: raise Unsupported("the kernel stores more than the attention")
  out, value = norm.src[0].src
  r = value
  while r.op is Ops.VIEW: r = r.src[0]
  if r.op is not Ops.REDUCE_AXIS or not isinstance(r.arg[0], OnlineSoftmax): raise Unsupported("not a fused attention kernel")
  values, scores = r.src
  *batch, tq, d, tk = shape_of(values)
  if out.src[0].dtype is not dtypes.float32: raise Unsupported("the output is not float32")
  if out.arg.mask is not None or (os_ := product_strides(out.arg, value, (*batch, tq, d, 1))) is None:
    raise Unsupported("the output is stored through a view other than a reshape or permutation")
  vb, vv = _views(values)
  dot = _dot(scores)
  (a, av), (b, bv) = (_views(x) for x in dot.src[0].src)
  if av.strides[-2] != 0: (a, av), (b, bv) = (b, bv), (a, av)   # q does not vary along the keys, k along the rows
  if av.strides[-2] != 0 or bv.strides[-3] != 0: raise Unsupported("the dot product is not q . k")
  slots = {u.arg.number: u.dtype for u in norm.toposort if u.op is Ops.BUFFER}
  if any(dt not in C_TYPES for dt in slots.values()): raise Unsupported(f"it reads a buffer of {next(dt for dt in slots.values() if dt not in C_TYPES).name}")
  return Operands(out.src[0], out.arg, tuple(os_), tuple(batch), tq, d, tk, (a, av), (b, bv), (vb, vv), dot, scores, slots)


def base(v: View, n_batch: int) -> str:
  """A view's offset at batch indices b0, b1, ... (C names) as C text."""
  return " + ".join([str(v.offset)] + [f"b{n}*{s}" for n, s in enumerate(v.strides[:n_batch]) if s])


def attention_source(norm: UOp, args: list[int]) -> str:
  """The tiled kernel's source (KERNEL_NAME for its name) for normalized kernel `norm`; Unsupported says why not."""
  ops = attention_operands(norm)
  batch, tq, d, tk, os_, dot, scores = list(ops.batch), ops.tq, ops.d, ops.tk, ops.out_strides, ops.dot, ops.scores
  (a, av), (b, bv), (vb, vv) = ops.q, ops.k, ops.v
  out = UOp(Ops.VIEW, ops.out.dtype, (ops.out,), ops.out_view)
  dk = av.shape[-1]   # the dot product's length (the values' head dimension d may differ)
  w = lanes(d)
  nb = math.prod(batch)
  idx = [f"b{n}" for n in range(len(batch))]
  ep = Epilogue(dot).expr(scores, idx + ["i", "j"], True)   # lane by lane (raises Unsupported where E has no C form)
  try: vector_ep = Epilogue(dot, w).expr(scores, [f"(int){b}" for b in idx] + ["i", "jv"], True)
  except NotVector: vector_ep = None
  bidx, nbt = ops.batch_indices(), len(batch)
  qi, qd, kj, kd, vd, vj, oi, od = ops.strides
  # KEY_VECTORS, or fewer where that pads the keys much less (128 keys: 3 vectors of 16 pad them to 144, 2 to 128)
  padded = lambda n: -(-tk // (w * n)) * w * n
  kb = min(range(2, KEY_VECTORS + 1), key=lambda n: (padded(n) > padded(KEY_VECTORS) * 0.94 if n < KEY_VECTORS else 0, padded(n), -n))
  nv, f = d // w, f"floatx{w}"
  tkp, block = -(-tk // (w * kb)) * w * kb, w * kb
  rows = max(1, min(R, 16 // nv))   # the accumulators of a tile: rows x nv vectors, at most 16 registers
  params = ops.params(args, "restrict")
  call = ", ".join(f"data{n}" for n in args)
  chunks = -(-tq // CHUNK)
  zero = f"(({f}){{{', '.join(['0.0f'] * w)}}})"
  # a line per row of the tile ({r}), and per vector of keys of a block ({u}) or of the head dimension ({t})
  def each(text: str, inner: str = "", n: int = 1) -> str:
    return "\n".join(text.replace("{r}", str(r)).replace(inner or "{r}", str(x)) for x in range(n) for r in range(rows))
  # the scores of a block: E applied to the vector where it reads only the dot product and constants through +, *, /, -
  # (a scale), else lane by lane; keys past the end -inf
  past = f" if (j0 + {{u}}*{w} + {w} > {tk}) for (int jj = 0; jj < {w}; jj++) if (j0 + {{u}}*{w} + jj >= {tk}) s{{r}}_{{u}}[jj] = -INFINITY;" if tk % block else ""
  lane = f"(intx{w}){{{', '.join(map(str, range(w)))}}}"
  if vector_ep is not None:
    scored = each(f"      {{ int i = (int)(r0 + {{r}} < i1 ? r0 + {{r}} : i1 - 1); intx{w} jv = (int)(j0 + {{u}}*{w}) + {lane}; {f} x = s{{r}}_{{u}};"
                  f" s{{r}}_{{u}} = {vector_ep} * {LOG2_E!r}f; }}" + past, "{u}", kb)
  else:
    scored = each(f"""      {{ long i = r0 + {{r}} < i1 ? r0 + {{r}} : i1 - 1; float sv[{w}]; *({f}*)sv = s{{r}}_{{u}};
        for (int jj = 0; jj < {w}; jj++) {{ long j = j0 + {{u}}*{w} + jj; float x = sv[jj]; sv[jj] = j < {tk} ? (float)({ep}) * {LOG2_E!r}f : -INFINITY; }}
        s{{r}}_{{u}} = *({f}*)sv; }}""", "{u}", kb)
  rescale = " ".join(f"a{{r}}_{t} *= c;" for t in range(nv))
  most = "s{r}_0"
  for u in range(1, kb): most = f"KERNEL_NAME_max({most}, s{{r}}_{u})"
  # a block masked whole for every row of the tile (a causal mask's upper blocks) changes nothing: skipped
  block_max = each(f"      float bm{{r}} = KERNEL_NAME_hmax({most});")
  all_masked = " && ".join(f"bm{r} == -INFINITY" for r in range(rows))
  online = each(f"""      {{ float bm = bm{{r}}, mn = m{{r}} > bm ? m{{r}} : bm, safe = mn == -INFINITY ? 0.0f : mn;
        float c = g_exp2f(m{{r}} - safe); m{{r}} = mn; l{{r}} *= c;
        {" ".join(f"{{ {f} p = g_exp2f_x{w}(s{{r}}_{u} - safe); l{{r}} += p; *({f}*)(pb[{{r}}] + {u * w}) = p; }}" for u in range(kb))}
        {rescale} }}""")
  def across(name: str, combine: str) -> str:   # a vector's lanes combined by halves (shuffles)
    steps, n = [], w
    while n > 1:
      n //= 2
      steps.append(f"  u = __builtin_shufflevector(v, v, {', '.join(str((k + n) % w) for k in range(w))}); v = {combine};")
    return f"static inline float KERNEL_NAME_{name}({f} v) {{\n  {f} u;\n" + "\n".join(steps) + "\n  return v[0];\n}"
  return f"""#include <stdlib.h>
{across("hmax", f"({f})(((intx{w})v & (v > u)) | ((intx{w})u & ~(v > u)))")}
{across("hsum", "v + u")}
static inline {f} KERNEL_NAME_max({f} v, {f} u) {{ return ({f})(((intx{w})v & (v > u)) | ((intx{w})u & ~(v > u))); }}
static __attribute__((noinline)) void KERNEL_NAME_task(long task, float* restrict kt, float* restrict vp, {params}) {{
  long bt = task / {chunks}, i0 = (task % {chunks}) * {CHUNK}, i1 = i0 + {CHUNK} < {tq} ? i0 + {CHUNK} : {tq};
{bidx}  const float* restrict q = data{a.arg.number} + {base(av, nbt)};
  const float* restrict k = data{b.arg.number} + {base(bv, nbt)};
  const float* restrict v = data{vb.arg.number} + {base(vv, nbt)};
  float* restrict o = data{out.src[0].arg.number} + {" + ".join([str(out.arg.offset)] + [f"b{n}*{s}" for n, s in enumerate(os_[:nbt]) if s])};
  /* K transposed (keys in lanes) and V, packed; keys past the end are 0 (their scores are masked) */
  for (long j = 0; j < {tkp}; j++) {{
    for (long dd = 0; dd < {dk}; dd++) kt[dd*{tkp} + j] = j < {tk} ? k[j*{kj} + dd*{kd}] : 0.0f;
    for (long dd = 0; dd < {d}; dd++) vp[j*{d} + dd] = j < {tk} ? v[j*{vj} + dd*{vd}] : 0.0f;
  }}
  for (long r0 = i0; r0 < i1; r0 += {rows}) {{
    float qt[{rows}][{dk}] __attribute__((aligned(64)));
    float pb[{rows}][{block}] __attribute__((aligned(64)));
    for (int r = 0; r < {rows}; r++) {{
      long i = r0 + r < i1 ? r0 + r : i1 - 1;   /* a last, partial tile repeats its last row (not stored) */
      for (int dd = 0; dd < {dk}; dd++) qt[r][dd] = q[i*{qi} + dd*{qd}];
    }}
{each(f"    float m{{r}} = -INFINITY; {f} l{{r}} = {zero};")}
{each("    " + f + " a{r}_{t} = " + zero + ";", "{t}", nv)}
    for (long j0 = 0; j0 < {tkp}; j0 += {block}) {{
{each(f"      {f} s{{r}}_{{u}} = {zero};", "{u}", kb)}
      for (int dd = 0; dd < {dk}; dd++) {{
{chr(10).join(f"        {{ {f} kv = *({f}*)(kt + dd*{tkp} + j0 + {u * w});" + "".join(f" s{r}_{u} += qt[{r}][dd] * kv;" for r in range(rows)) + " }" for u in range(kb))}
      }}
{scored}
{block_max}
      if ({all_masked}) continue;
{online}
      for (int jj = 0; jj < {block}; jj++) {{
        const float* restrict vr = vp + (j0 + jj)*{d};
{chr(10).join(f"        {{ {f} vv = *({f}*)(vr + {t * w});" + " ".join(f" a{r}_{t} += pb[{r}][jj] * vv;" for r in range(rows)) + " }" for t in range(nv))}
      }}
    }}
{each("    if (r0 + {r} < i1) { float ov[" + str(w) + "]; *(" + f + "*)ov = a{r}_{t} / KERNEL_NAME_hsum(l{r}); for (int jj = 0; jj < " + str(w) + "; jj++) o[(r0 + {r})*" + str(oi) + " + (" + "{t}*" + str(w) + " + jj)*" + str(od) + "] = ov[jj]; }", "{t}", nv)}
  }}
}}

static __attribute__((noinline)) void KERNEL_NAME_work({params}) {{
  float* kt = aligned_alloc(64, {(tkp * dk * 4 + 63) // 64 * 64});
  float* vp = aligned_alloc(64, {(tkp * d * 4 + 63) // 64 * 64});
  #pragma omp for schedule(dynamic, 1) nowait
  for (long task = 0; task < {nb * chunks}; task++) KERNEL_NAME_task(task, kt, vp, {call});
  free(kt); free(vp);
}}

{team_entries("KERNEL_NAME", params.split(", "))}"""
