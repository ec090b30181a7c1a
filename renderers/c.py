"""The C renderer: linear kernels -> C source for gcc, loops run in parallel with OpenMP.

Rules (`c_rules`, before the shared `cstyle_rules`) for what only C says: a loop marked "parallel" by the opt stage
gets `#pragma omp parallel for` (or, in a kernel a team of threads may share, `#pragma omp for ... nowait`:
`CRenderer`), an innermost reduction loop marked "simd" gets `#pragma omp simd reduction(...)` so
that gcc vectorizes it without licence to reorder anything else (no -ffast-math). Vector values (dtype `T.vec(n)`,
made by rules/opt/vector.py) are gcc vector extensions, `floatx16` for `float32.vec(16)`: arithmetic is written as
for scalars, a vector load or store goes through a pointer to the vector type (declared with the element's alignment
and `may_alias`, so any element address will do), `VECTORIZE` is a vector literal, `GEP` a subscript.
"""
from __future__ import annotations
import dataclasses
from dataclasses import dataclass
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from .cstyle import Language, RenderContext, cstyle_rules, render_kernel, kernel_params, reduce_identity, loop_head, gated_read

# exp2 and log2 of float written out branch-free, so that gcc vectorizes the loops that call them (libm's exp2f and
# log2f are scalar calls without -ffast-math). Both are within 2 ulp of libm over the whole float range, and keep
# its results for 0, negatives, infinities and NaN; tests/test_renderer_c.py checks this against numpy.
PRELUDE = """
static inline float g_bits2f(int i) { union { int i; float f; } u; u.i = i; return u.f; }
static inline int g_f2bits(float f) { union { int i; float f; } u; u.f = f; return u.i; }
static inline float g_exp2f(float a) {
  /* clamped; NaN goes through the arithmetic as -151 (converting it to int would be undefined) and comes back at the
     end. Written as `a > c ? a : c`, gcc vectorizes the clamps as a max and a min, where a NaN test first and clamps
     after it made masked compares (attention's softmax kernel, 8x512x512 compiled alone, one thread: 1.47 -> 1.36 ms;
     the same results for every input) */
  float x = a > -151.0f ? a : -151.0f;
  x = x < 129.0f ? x : 129.0f;
  /* round to nearest by the float adder itself (floorf would stop gcc from vectorizing the loop) */
  float n = (x + 12582912.0f) - 12582912.0f, f = x - n;
  /* 2^f on [-0.5, 0.5]: Taylor series of e^(f ln 2) to degree 7 */
  float p = 1.5252733804059840e-05f;
  p = p * f + 1.5403530393381609e-04f; p = p * f + 1.3333558146428443e-03f; p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f; p = p * f + 2.4022650695910071e-01f; p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  int k = (int)n, k1 = k >> 1, k2 = k - k1;   /* 2^k as two factors: each stays a normal float */
  float r = p * g_bits2f((k1 + 127) << 23) * g_bits2f((k2 + 127) << 23);
  return a != a ? a : r;
}
static inline float g_log2f(float x) {
  int tiny = x < 1.17549435e-38f;
  float y = tiny ? x * 8388608.0f : x;             /* scale subnormals into the normal range */
  int bits = g_f2bits(y);
  int e = ((bits >> 23) & 255) - 127 - (tiny ? 23 : 0);
  float m = g_bits2f((bits & 0x7fffff) | 0x3f800000);   /* mantissa in [1, 2) */
  int big = m > 1.41421356f;
  m = big ? m * 0.5f : m; e += big;                /* m in [sqrt(1/2), sqrt(2)) */
  float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
  /* log2(m) = 2/ln2 * atanh(t) */
  float p = 0.1111111111f;
  p = p * t2 + 0.1428571429f; p = p * t2 + 0.2f; p = p * t2 + 0.3333333333f; p = p * t2 + 1.0f;
  float r = (float)e + 2.8853900817779268f * t * p;
  r = x == 0.0f ? -INFINITY : r;
  r = x < 0.0f ? NAN : r;
  return x != x || x == INFINITY ? x : r;
}
"""


# The bytes of the widest vector register (0: the asm below does not know this CPU's registers).
REGISTER_BYTES = """#if defined(__x86_64__) && defined(__AVX512F__)
#define G_REGISTER_BYTES 64
#elif defined(__x86_64__) && defined(__AVX__)
#define G_REGISTER_BYTES 32
#elif defined(__x86_64__)
#define G_REGISTER_BYTES 16
#else
#define G_REGISTER_BYTES 0
#endif"""


def _vector_typedefs() -> str:
  lines = [REGISTER_BYTES]
  for scalar, size in (("float", 4), ("double", 8), ("int", 4)):
    for n in (2, 4, 8, 16):
      t = f"{scalar}x{n}"
      lines.append(f"typedef {scalar} {t} __attribute__((vector_size({size * n}), aligned({size}), may_alias));")
      # a loaded vector stays in a register: without this gcc folds the load into each FMA that reads it (a register
      # tile's vector of B, read by every row of the tile, is loaded once per row: the load ports, not the FMA units,
      # then bound the kernel)
      lines += [f"#if G_REGISTER_BYTES >= {size * n}",
                f"static inline {t} g_register_{t}({t} v) {{ __asm__(\"\" : \"+x\"(v)); return v; }}",
                "#else", f"static inline {t} g_register_{t}({t} v) {{ return v; }}", "#endif"]
      # the lanes of a masked vector load, at the edges of padding: a call of its own keeps it out of the hot path
      # (base and index apart: base+index may lie outside the buffer, and only valid lanes form an address)
      lines.append(f"static __attribute__((noinline)) {t} g_masked_{t}(const {scalar}* base, long long index, int valid) {{ "
                   f"{t} v = {{0}}; for (int i = 0; i < {n}; i++) if (valid >> i & 1) v[i] = base[index + i]; return v; }}")
  # a vector of bool is what gcc's vector comparison of 32-bit lanes gives: 0 or -1 (all bits) per lane
  lines += [f"typedef intx{n} boolx{n};" for n in (2, 4, 8, 16)]
  return "\n".join(lines)


# bfloat16 is a struct of its bits (arithmetic on it does not compile, rather than silently act on integers); the
# conversions round to nearest even, as rewrite/dtypes.py bf16_bits does on the host and CUDA's __float2bfloat16_rn
BF16 = """
typedef struct { unsigned short bits; } g_bf16;
static inline float g_bf16_to_float(g_bf16 x) { union { unsigned int u; float f; } v; v.u = (unsigned int)x.bits << 16; return v.f; }
static inline g_bf16 g_float_to_bf16(float f) {
  union { unsigned int u; float f; } v; v.f = f;
  g_bf16 r;
  r.bits = f != f ? (unsigned short)((v.u >> 16) | 0x40u) : (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
  return r;
}
"""


def _vector_exp2(n: int) -> str:
  """g_exp2f over the lanes of a floatx{n}: the same operations in the same order (so the same bits in every lane),
  each select a bitwise one on gcc's 0/-1 masks (C has no `?:` of vectors)."""
  f, i = f"floatx{n}", f"intx{n}"
  c = lambda v: f"(({f}){{{', '.join([v] * n)}}})"
  sel = lambda m, a, b: f"(({f})((({i}){a} & {m}) | (({i}){b} & ~{m})))"
  poly = "".join(f" p = p * f + {k};" for k in ("1.5403530393381609e-04f", "1.3333558146428443e-03f", "9.6181291076284772e-03f",
                                              "5.5504108664821580e-02f", "2.4022650695910071e-01f", "6.9314718055994531e-01f", "1.0f"))
  return (f"static inline {f} g_exp2f_x{n}({f} a) {{\n"
          f"  {i} nan = a != a; {f} x = ({f})(({i})a & ~nan);\n"
          f"  {i} lo = x < {c('-151.0f')}; x = {sel('lo', c('-151.0f'), 'x')};\n"
          f"  {i} hi = x > {c('129.0f')}; x = {sel('hi', c('129.0f'), 'x')};\n"
          f"  {f} r0 = (x + 12582912.0f) - 12582912.0f, f = x - r0;\n"
          f"  {f} p = {c('1.5252733804059840e-05f')};{poly}\n"
          f"  {i} k = __builtin_convertvector(r0, {i}), k1 = k >> 1, k2 = k - k1;\n"
          f"  {f} r = p * ({f})((k1 + 127) << 23) * ({f})((k2 + 127) << 23);\n"
          f"  return {sel('nan', 'a', 'r')};\n}}")


@dataclass
class CLanguage(Language):
  # a parallel loop as a worksharing loop of a team that is already running (`#pragma omp for ... nowait`), not a team
  # of its own (`#pragma omp parallel for`): the kernel's `_work` function (CRenderer.render)
  worksharing: bool = False

  def math(self, fn: str, dt) -> str:
    if dt.scalar is dtypes.float32 and fn == "exp2" and dt.count > 1: return f"g_exp2f_x{dt.count}"
    if dt is dtypes.float32 and fn in ("exp2", "log2"): return f"g_{fn}f"
    return super().math(fn, dt)


# gcc 12 does not vectorize some loops inside OpenMP's outlined parallel region (a convolution's inner loop gets "no
# vectype"); the same loop in a function of its own does vectorize, so a parallel loop's body is one
C = CLanguage(headers=Language().headers + (_vector_typedefs(), PRELUDE, *(_vector_exp2(n) for n in (2, 4, 8, 16)), BF16),
              outline_parallel=True)


# A parallel loop's iterations are dealt to the threads in up to PARALLEL_CHUNKS chunks, each taken by the next thread
# that is free (`schedule(dynamic)`), not in one fixed block per thread (OpenMP's default, static): on a machine whose
# cores other processes share, or where a sleeping thread wakes late, a thread that has its core takes the chunks the
# other has not reached, where a static split waits at the loop's end for the slowest thread's whole half.
# Measured (attention's three kernels, 8x512x64, compiled alone, 2 threads, one core shared with a busy process:
# static 7.7-12.0 ms, dynamic 5.7-6.8 ms; Intel Xeon, 2 cores). 64 chunks bound the cost of dealing them (an atomic
# add each) and still balance 16 threads; a loop of fewer trips has one chunk a trip.
PARALLEL_CHUNKS = 64


def parallel_pragma(r: UOp, worksharing: bool = False) -> str:
  trips, (start, end) = r.src[0], ("#pragma omp for", " nowait") if worksharing else ("#pragma omp parallel for", "")
  if trips.op is not Ops.CONST: return start + end   # a symbolic trip count: OpenMP's static split
  return f"{start} schedule(dynamic, {-(-trips.arg // PARALLEL_CHUNKS)}){end}"


def _loop(ctx: RenderContext, r: UOp) -> str:
  head = loop_head(ctx, r)
  mark = r.arg[-1]
  if mark == "parallel": return f"{parallel_pragma(r, ctx.lang.worksharing)}\n{head}"
  # (a vector accumulator, rules/opt/vector.py, is vectorized already: OpenMP has no reduction of it)
  if mark == "simd" and (reds := [x for x in ctx.accumulators.get(r, []) if x.dtype.count == 1]):
    clauses = [f"reduction({sym}:{', '.join(ctx.names[x] for x in reds if x.arg is op)})"
               for op, sym in ((Ops.ADD, "+"), (Ops.MAX, "max")) if any(x.arg is op for x in reds)]
    if nan_flags := [f"{ctx.names[x]}_nan" for x in reds if _float_max(x)]: clauses.append(f"reduction(|:{', '.join(nan_flags)})")
    return f"#pragma omp simd {' '.join(clauses)}\n{head}"
  return head


# A float max must give NaN when any element is NaN (as numpy does), but OpenMP's max reduction combines its vector
# lanes with a plain comparison, which drops NaN. So each float max also ORs a flag of "saw a NaN" (a reduction the
# vectorizer handles) and applies it after the loop.
def _float_max(red: UOp) -> bool: return red.arg is Ops.MAX and red.dtype.is_float
float_max = UPat(Ops.REDUCE, name="red", arg=Ops.MAX, dtype=(dtypes.float16, dtypes.float32, dtypes.float64))


def _vector_load(ctx: RenderContext, ld: UOp) -> str | None:
  """A vector load; masked (rules/opt/vector.py), the whole vector is read at an in-bounds address (cstyle's
  `gated_read`) and kept when every lane is valid; otherwise the valid lanes are read one by one."""
  if ld.dtype.count == 1: return None
  t, (buf, idx), valid = ctx.lang.type(ld.dtype), ld.src[0].src, ld.src[1:]
  if not valid: return f"g_register_{t}(*({t}*){ctx[ld.src[0]]})"
  every = valid[0] if len(valid) == 1 else UOp(Ops.AND, dtypes.bool, valid)  # only named here, never in the graph
  if len(valid) > 1: ctx.names[every] = f"({'&&'.join(ctx[v] for v in valid)})"
  whole = gated_read(ctx, buf, idx, every, t, f"*({t}*)")
  if len(valid) == 1: return f"({ctx[every]}?{whole}:({t}){{0}})"
  return f"({ctx[every]}?{whole}:g_masked_{t}({ctx[buf]}, {ctx[idx]}, {'|'.join(f'({ctx[v]}<<{c})' for c, v in enumerate(valid))}))"


def _vector_store(ctx: RenderContext, idx: UOp, val: UOp) -> str | None:
  return f"*({ctx.lang.type(val.dtype)}*){ctx[idx]} = {ctx[val]};" if val.dtype.count > 1 else None


def _vector_literal(ctx: RenderContext, v: UOp) -> str:
  lanes = v.src * v.dtype.count if len(v.src) == 1 else v.src   # one source: a broadcast
  # a bool (0 or 1) becomes a mask lane (0 or -1), as a vector comparison makes them
  texts = [f"-({ctx[s]})" if v.dtype.scalar is dtypes.bool else ctx[s] for s in lanes]
  return f"(({ctx.lang.type(v.dtype)}){{{', '.join(texts)}}})"


def _vector_select(ctx: RenderContext, x: UOp) -> str | None:
  """A select of vectors by a mask (C has no `?:` of vectors): the bits of each lane taken from one side."""
  if x.dtype.count == 1: return None
  t, m = ctx.lang.type(x.dtype), ctx.lang.type(x.src[0].dtype)
  c, a, b = (ctx[s] for s in x.src)
  return f"(({t})((({m}){a}&{c})|(({m}){b}&~{c})))"


def _integer_select_of_zero(ctx: RenderContext, x: UOp) -> str | None:
  """`c ? a : 0` of integers (an index clamped where a view's mask is off, rules/lower.py) as the product `a*c`, for the
  reason of cstyle's `gated_read`: gcc 12.2 -O3 threads the select's branch back onto the load that the index feeds
  and makes the loads of an unrolled pair of them one interleaved group of masked vector loads, whose masks it gets
  wrong (`x.cast(int16).pad(((2, 1), (0, 0)))` of a (7, 2) tensor read zeros: found by bench/fuzz.py). A product has
  no branch to thread; the same value, as c is 0 or 1."""
  c, a, b = x.src
  if x.dtype.count != 1 or not x.dtype.is_int or b.op is not Ops.CONST or b.arg != 0: return None
  return f"({ctx[a]}*{ctx[c]})"


def _vector_accumulator(ctx: RenderContext, red: UOp) -> str | None:
  if red.dtype.count == 1 or red.arg is Ops.NOOP: return None   # a carried accumulator: renderers/cstyle.py
  if red.arg is not Ops.ADD: raise TypeError(f"no vector accumulator of {red.arg}")
  return f"{ctx.lang.type(red.dtype)} {ctx.names[red]} = ({ctx.lang.type(red.dtype)}){{0}};"


c_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), _loop),
  (UPat(Ops.LOAD, name="ld"), _vector_load),
  (UPat(Ops.STORE, src=(UPat.var("idx"), UPat.var("val"))), _vector_store),
  # a packed buffer's fill stores by subscript, so gcc sees the array it writes: through a pointer (`*(local+i)`) its
  # vectorizer gives up on the transposing fill of W's panel in x @ W.T (a float from each of 32 rows of W per step),
  # which by subscript it turns into 16x16 transposes in registers (vpermt2ps): the fill of the mlp layer's 32
  # panels of 1024 x 32 took 0.57 of its 4.1 ms (one thread, Xeon with AVX-512; the layer 146 -> 160 GFLOP/s)
  (UPat(Ops.STORE, src=(UPat(Ops.INDEX, src=(UPat(Ops.DEFINE_LOCAL, name="b"), UPat.var("i"))), UPat.var("val"))),
   lambda ctx, b, i, val: f"{ctx[b]}[{ctx[i]}] = {ctx[val]};" if val.dtype.count == 1 else None, "render_local_fill"),
  (UPat(Ops.VECTORIZE, name="v"), _vector_literal),
  (UPat(Ops.WHERE, name="x"), _integer_select_of_zero),
  (UPat(Ops.WHERE, name="x"), _vector_select),
  (UPat(Ops.RECIP, name="x"), lambda ctx, x: f"(1.0f/{ctx[x.src[0]]})" if x.dtype.count > 1 else None, "render_vector_recip"),
  (UPat(Ops.GEP, name="g"), lambda ctx, g: f"({ctx[g.src[0]]}[{ctx[g.src[1]]}])", "render_gep"),
  (UPat(Ops.DEFINE_ACC, src=(UPat(Ops.REDUCE, name="red"),)), _vector_accumulator),
  # a packed buffer (rules/opt/pack.py) is an array on the stack of the thread that fills it; the BARRIER that says
  # it is filled is the array itself
  (UPat(Ops.DEFINE_LOCAL, name="b"),
   lambda ctx, b: f"{ctx.lang.type(b.dtype.base)} {ctx.names[b]}[{b.arg[1]}] __attribute__((aligned(64)));", "render_local_buffer"),
  (UPat(Ops.BARRIER, src=(UPat(Ops.DEFINE_LOCAL, name="b"),), allow_any_len=True), lambda ctx, b: ctx[b], "render_barrier"),
  (UPat(Ops.DEFINE_ACC, src=(float_max,)),
   lambda ctx, red: f"{ctx.lang.type(red.dtype)} {ctx.names[red]} = {reduce_identity(ctx, red)}; int {ctx.names[red]}_nan = 0;", "render_float_max_accumulator"),
  (UPat(Ops.ASSIGN, src=(float_max,)),
   lambda ctx, red: (lambda acc, v: f"{acc} = ({v}>{acc})?{v}:{acc}; {acc}_nan |= ({v}!={v});")(ctx.names[red], ctx[red.src[0]]), "render_float_max_update"),
  (float_max, lambda ctx, red: f"if ({ctx.names[red]}_nan) {ctx.names[red]} = NAN;", "render_float_max_nan"),
], name="render.c")


# The worksharing form of a kernel (CRenderer.render): its work as every thread of a team runs it, its one parallel
# loop shared out with `nowait` (the caller waits for the team)
C_WORK = dataclasses.replace(C, worksharing=True, kernel_prefix="static __attribute__((noinline)) void")


def one_parallel_loop(linear: UOp) -> bool:
  """Whether the kernel has one parallel loop, outside every other, and outside it writes only arrays of its own (a
  packed operand): what every thread of a team may run as it is, the loop shared out. (Each thread then fills its
  own copy of such an array, on its own stack, in the time the one thread outside the loop took to fill it before; a
  store to a buffer outside the loop would run once per thread.)"""
  loops: list[UOp] = []   # the loops open here, outermost first
  parallel = 0
  for u in linear.src:
    if u.op is Ops.RANGE:
      if u.arg[-1] == "parallel":
        if loops: return False
        parallel += 1
      loops.append(u)
    elif u.op is Ops.END: loops.pop()
    elif u.op is Ops.STORE and not (loops and loops[0].arg[-1] == "parallel"):
      if (b := u.src[0]).op is Ops.INDEX: b = b.src[0]
      if b.op is not Ops.DEFINE_LOCAL: return False
  return parallel == 1


class CRenderer:
  """Renders the kernels of one realize into one C source (one compiler call).

  A kernel of one parallel loop (`one_parallel_loop`) is three functions: NAME_work, the work of one thread of a team
  (the loop a worksharing one, `#pragma omp for nowait`); NAME(buffers), which starts a team for it alone (a parallel
  region around NAME_work: what `#pragma omp parallel for` did); and NAME_team(void* const* buffers), the same work
  for a thread of a team that runs several kernels in one parallel region, its buffers in an array (runtime/cpu.py
  `run_team`: the threads of a host program's run wake once, not once per kernel)."""
  language = C
  device_loops = False  # loops stay loops on the CPU (CUDA maps them onto threads)

  def render(self, name: str, linear: UOp) -> str:
    if not one_parallel_loop(linear): return render_kernel(name, linear, c_rules + cstyle_rules, C)
    return render_kernel(f"{name}_work", linear, c_rules + cstyle_rules, C_WORK) + "\n\n" + team_entries(name, kernel_params(linear, C))

  def source(self, kernels: list[str]) -> str: return "\n".join(C.headers) + "\n\n" + "\n\n".join(kernels) + "\n"


def team_entries(name: str, params: list[str]) -> str:
  """NAME(params), a team of its own running NAME_work, and NAME_team(a), NAME_work on the buffers of array `a` (void pointers: no header needed) for a
  thread of a team already running (CRenderer)."""
  names = [p.rsplit(" ", 1)[1] for p in params]
  types = [p.rsplit(" ", 1)[0].replace(f" {C.restrict}", "") for p in params]
  return "\n".join([f"void {name}({', '.join(params)}) {{", "  #pragma omp parallel", f"  {name}_work({', '.join(names)});", "}", "",
                    f"void {name}_team(void* const* a) {{ {name}_work({', '.join(f'({t})a[{i}]' for i, t in enumerate(types))}); }}"])


renderer = CRenderer()
