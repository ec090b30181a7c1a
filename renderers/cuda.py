"""The CUDA renderer: linear kernels whose loops the `gpu` stage mapped onto blocks and threads -> CUDA C for nvcc.

Rules (`cuda_rules`, before the shared `cstyle_rules`) for what only CUDA says: thread and block indices
(`SPECIAL` -> threadIdx.x, blockIdx.x), the combine of a row's lanes (`BARRIER` -> a call to `g_row_reduce` of the
prelude, warp shuffles within a row of up to 32 lanes, or to `g_block_reduce`: warp shuffles, then one value per warp
through shared memory), and math functions
for half. Everything else (arithmetic, loads, gated stores, loops, accumulators) is C-family text shared with the C
renderer. Each kernel is `extern "C" __global__ __launch_bounds__(threads) void NAME(...)` (the symbol is its name;
the CUDA device reads its parameters from that line). Float math stays IEEE (no fast-math), like the C renderer.
"""
from __future__ import annotations
import re
from dataclasses import dataclass, replace
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from rules.gpu import launch_dims
from runtime.cuda import SELF_CONTAINED
from .cstyle import Language, RenderContext, cstyle_rules, render_kernel, reduce_identity, loop_head
from .cuda_mma import PRELUDE as MMA_PRELUDE, mma_rules, shared_bytes
from .cuda_wgmma import PRELUDE as WGMMA_PRELUDE, holds_wgmma, wgmma_rules
from .cuda_tma import PRELUDE as TMA_PRELUDE, PRODUCER, holds_tma, persistent, tensor_map_decls, tma_rules

# What the kernels without half, bfloat16 or tensor cores use of CUDA's headers, declared here, so that nvcc compiles
# their translation unit without cuda_runtime.h (runtime/cuda.py: a source that starts with SELF_CONTAINED). That
# header is 1.3 MB once preprocessed: gcc and cicc spent 0.27 of the 0.31 s nvcc took for an empty kernel on it, and
# a first call waits for it in every compile group. The qualifiers are the attributes cicc reads; the indices, the
# barrier, the bit cast and the math functions are cicc's builtins, known by name (libdevice's code, as through the
# headers); the shuffle splits a value into 32-bit words as the headers' does. Where cuda_runtime.h was included
# after all (a plain `nvcc` of the source) the declarations step aside, so the source compiles both ways;
# tests/test_cuda_declarations.py compares the two PTX.
DECLARATIONS = SELF_CONTAINED + r"""
#ifndef __CUDA_RUNTIME_H__
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define __align__(n) __attribute__((aligned(n)))
#define G_BUILTIN __attribute__((device)) __attribute__((device_builtin))
struct __attribute__((device_builtin)) uint3 { unsigned int x, y, z; };
extern const G_BUILTIN uint3 threadIdx, blockIdx, blockDim;
extern "C" {
G_BUILTIN void __syncthreads(void); G_BUILTIN int __syncthreads_or(int);
G_BUILTIN float __int_as_float(int);
G_BUILTIN unsigned __nvvm_shfl_bfly_sync(unsigned, unsigned, unsigned, unsigned);
G_BUILTIN float exp2f(float); G_BUILTIN double exp2(double);
G_BUILTIN float log2f(float); G_BUILTIN double log2(double);
G_BUILTIN float sinf(float); G_BUILTIN double sin(double);
G_BUILTIN float sqrtf(float); G_BUILTIN double sqrt(double);
G_BUILTIN float truncf(float); G_BUILTIN double trunc(double);
G_BUILTIN float fmaf(float, float, float); G_BUILTIN double fma(double, double, double);
G_BUILTIN float fmaxf(float, float);
}
/* v of each lane exchanged with lane ^ o's, a 32-bit word at a time (a warp's 32 lanes) */
template <class T> __device__ __forceinline__ T __shfl_xor_sync(unsigned mask, T v, int o) {
  union { T v; unsigned w[sizeof(T) / 4]; } u;
  u.v = v;
  for (int i = 0; i < (int)(sizeof(T) / 4); i++) u.w[i] = __nvvm_shfl_bfly_sync(mask, u.w[i], o, 0x1f);
  return u.v;
}
#endif
"""

PRELUDE = r"""
/* a vector of 4 floats (dtype float32.vec(4)): a shared tile's fill reads 16 bytes at once (rules/opt/pack.py) */
struct __align__(16) floatx4 { float v[4]; };
/* the block's shared tiles: dynamic shared memory, as a tile may pass the 48 KiB of static shared memory (the kernel
   declares its size with G_SHARED(bytes): runtime/cuda.py reads it, raises the function's limit and launches with it) */
#define G_SHARED(bytes)
extern __shared__ __align__(128) unsigned char g_dynamic_shared[];
struct g_op_add { template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct g_op_max {  /* NaN wins, as in numpy */
  template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return (b > a || b != b) ? b : a; }
};
/* Every thread of the block calls this with its value and gets back the values of all threads combined by op.
   blockDim.x is a multiple of 32 (rules/gpu.py). */
template <class T, class Op> __device__ __forceinline__ T g_block_reduce(T v, T identity, Op op) {
  __shared__ T partial[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  /* the previous combine has read partial[] */
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? partial[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
/* Every lane of a row of W lanes (W a power of two up to 32, rows aligned to W in the warp) gets the row's values
   combined by op; every thread of the warp calls it. */
template <int W, class T, class Op> __device__ __forceinline__ T g_row_reduce(T v, Op op) {
  for (int o = W / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
"""


@dataclass
class CUDALanguage(Language):
  kernel_prefix: str = 'extern "C" __global__ void'
  # per kernel (CUDARenderer.render): the loops that end with a barrier (a shared tile refilled next trip) and the
  # shared tiles' BARRIERs that wait for a fill (the others come after one that waited already)
  synced_loops: frozenset = frozenset()
  waiting_barriers: frozenset = frozenset()
  restrict: str = "__restrict__"
  half: str = "half"
  infinity: str = "__int_as_float(0x7f800000)"
  nan: str = "__int_as_float(0x7fffffff)"
  headers: tuple[str, ...] = ("#include <cuda_fp16.h>", "#include <cuda_bf16.h>", PRELUDE, MMA_PRELUDE)
  bf16: str = "__nv_bfloat16"
  bf16_bits_literal: str = "__ushort_as_bfloat16((unsigned short){bits:#06x})"
  bf16_from_float: str = "__float2bfloat16_rn"
  bf16_to_float: str = "__bfloat162float"

  def math(self, fn: str, dt) -> str:
    # half math goes through float (cuda_fp16.h converts both ways)
    return fn if dt is dtypes.float64 else f"{fn}f"

  def type(self, dt):
    # a pair of 16-bit values (a tensor-core epilogue's neighbouring columns, rules/opt/tensor_core.py): CUDA's own
    return _PAIRS.get(dt) or super().type(dt)


# the CUDA types of 2 lanes of 16 bits, and how two scalars make one (cuda_fp16.h, cuda_bf16.h)
_PAIRS = {dtypes.float16.vec(2): "half2", dtypes.bfloat16.vec(2): "__nv_bfloat162"}
_MAKE_PAIR = {dtypes.float16.vec(2): "__halves2half2", dtypes.bfloat16.vec(2): "__halves2bfloat162"}


CUDA = CUDALanguage()

# the type a block combine runs in: the shuffles take 32- and 64-bit values; narrower ones widen and come back
_COMBINE_TYPE = {dtypes.float16: dtypes.float32, dtypes.bool: dtypes.int32, dtypes.int8: dtypes.int32,
                 dtypes.uint8: dtypes.int32, dtypes.int16: dtypes.int32, dtypes.uint16: dtypes.int32}


def _row_reduce(ctx: RenderContext, b: UOp) -> str:
  """BARRIER(partial, arg=(op, lanes)): the row's lanes combined; a warp's shuffles for up to 32 lanes, else the
  whole block's (a row of more than a warp is alone in its block)."""
  (red_op, lanes), wide = b.arg, _COMBINE_TYPE.get(b.dtype, b.dtype)
  op = "g_op_add" if red_op is Ops.ADD else "g_op_max"
  val = ctx[b.src[0]] if wide is b.dtype else f"(({ctx.lang.type(wide)})({ctx[b.src[0]]}))"
  if lanes <= 32: call = f"g_row_reduce<{lanes}, {ctx.lang.type(wide)}>({val}, {op}())"
  else:
    ident = reduce_identity(ctx, UOp(Ops.REDUCE, wide, (), red_op))
    call = f"g_block_reduce<{ctx.lang.type(wide)}>({val}, {ident}, {op}())"
  return call if wide is b.dtype else f"(({ctx.lang.type(b.dtype)})({call}))"


def _shared_tile(ctx: RenderContext, b: UOp) -> str:
  """A shared tile (rules/opt/pack.py): __shared__, 16-byte aligned (rows of a tile are read as float4 by nvcc)."""
  return f"__shared__ __align__(16) {ctx.lang.type(b.dtype.base)} {ctx.names[b]}[{b.arg[1]}];"


def _filled(ctx: RenderContext, b: UOp, local: UOp) -> str:
  """BARRIER(tile, *fill stores): the block waits until every lane's share of the tile is stored."""
  return f"(__syncthreads(), {ctx[local]})" if b in ctx.lang.waiting_barriers else ctx[local]


def _loop(ctx: RenderContext, r: UOp) -> str:
  # a slice's inner loop (a split part) reading shared tiles is unrolled: its loads stay in registers
  tag = r.arg[-1] if isinstance(r.arg, tuple) else None
  head = loop_head(ctx, r)
  return f"#pragma unroll\n{head}" if isinstance(tag, tuple) and tag[0] == "split" and tag[1] <= 16 else head


def _end(ctx: RenderContext, e: UOp) -> str:
  # the next trip refills the shared tiles: every lane must be done reading them
  return "__syncthreads();\n}" if e.src[0] in ctx.lang.synced_loops else "}"


cuda_rules = PatternMatcher([
  # a vector load or store (16-byte aligned: rules/opt/pack.py `vector_width`) and one of its elements
  (UPat(Ops.LOAD, name="ld", src=(UPat(Ops.INDEX, name="i"),)),
   lambda ctx, ld, i: f"(*({ctx.lang.type(ld.dtype)}*){ctx[i]})" if ld.dtype.count > 1 else None, "render_vector_load"),
  (UPat(Ops.STORE, src=(UPat(Ops.INDEX, name="i"), UPat(name="v"))),
   lambda ctx, i, v: f"*({ctx.lang.type(v.dtype)}*){ctx[i]} = {ctx[v]};" if v.dtype.count > 1 else None, "render_vector_store"),
  (UPat(Ops.VECTORIZE, name="v"), lambda ctx, v: f"{_MAKE_PAIR[v.dtype]}({ctx[v.src[0]]}, {ctx[v.src[1]]})" if v.dtype in _MAKE_PAIR else None,
   "render_pair"),
  # a reciprocal whose value is rounded to 16 bits before it is stored (rules/opt/tensor_core.py)
  (UPat(Ops.RECIP, name="x", arg="approx"), lambda ctx, x: f"g_rcp_approx({ctx[x.src[0]]})", "render_approximate_recip"),
  # the w values of a vector store (rules/gpu_vector.py): the struct's aggregate initializer
  (UPat(Ops.VECTORIZE, name="v"), lambda ctx, v: f"{ctx.lang.type(v.dtype)}{{{{{', '.join(ctx[s] for s in v.src)}}}}}"
   if len(v.src) == v.dtype.count else None, "render_vectorize"),
  (UPat(Ops.GEP, name="g", src=(UPat(), UPat(Ops.CONST, name="e"))),
   lambda ctx, g, e: f"({ctx[g.src[0]]}.v[{e.arg}])" if g.src[0].op is not Ops.MMA else None, "render_vector_element"),
  (UPat(Ops.SPECIAL, name="s"), lambda s: {"g": "blockIdx.x", "l": "threadIdx.x"}[s.arg[0][0]], "render_special"),
  (UPat(Ops.DEFINE_LOCAL, name="b"), _shared_tile),
  (UPat(Ops.BARRIER, name="b", src=(UPat(Ops.DEFINE_LOCAL, name="local"),), allow_any_len=True), _filled),
  (UPat(Ops.BARRIER, name="b"), _row_reduce),
  (UPat(Ops.RANGE, name="r"), _loop),
  (UPat(Ops.END, name="e"), _end),
], name="render.cuda")


def barriers(linear: UOp) -> tuple[frozenset, frozenset]:
  """(loops whose trips refill a shared tile, the shared tiles' BARRIERs that must wait for a fill)."""
  open_loops, synced, waiting, filling = [], set(), set(), False
  for u in linear.src:
    if u.op is Ops.RANGE: open_loops.append(u)
    elif u.op is Ops.END: open_loops.pop()
    elif u.op is Ops.STORE and u.src[0].src[0].op is Ops.DEFINE_LOCAL: filling = True
    elif u.op is Ops.BARRIER and u.src[0].op is Ops.DEFINE_LOCAL:
      if filling: waiting.add(u)
      filling = False
      if open_loops: synced.add(open_loops[-1])
  return frozenset(synced), frozenset(waiting)


class CUDARenderer:
  """Renders the kernels of one realize into one CUDA source (one nvcc call)."""
  language = CUDA
  device_loops = True  # the gpu stages map loops onto blocks and threads

  def render(self, name: str, linear: UOp) -> str:
    dims = launch_dims(linear)
    threads = dims[1][0] if dims else 1
    synced, waiting = barriers(linear)
    shared = f" G_SHARED({n})" if (n := shared_bytes(linear)) else ""   # dynamic shared memory (renderers/cuda_mma.py)
    # a block that refills shared tiles waits at their barriers: a second block on the multiprocessor computes
    # meanwhile. Asking for 2 (at most 128 registers a lane for 256) keeps the 8x8 register tile with its prefetched
    # next slice at 2 blocks: ptxas took 130 registers, 1 block, and 4096^3 ran 17% slower (docs/design.md)
    bounds = f"{threads}, 2" if synced and threads <= 256 else f"{threads}"
    maps, params_after = tensor_map_decls(linear) if holds_tma(linear) else ("", ())
    if maps: bounds = f"{threads}, 1"   # (a register cap at entry: setmaxnreg rebalances it, renderers/cuda_tma.py)
    lang = replace(CUDA, kernel_prefix=f'extern "C" __global__ __launch_bounds__({bounds}){shared}{maps} void', synced_loops=synced,
                   waiting_barriers=waiting, params_after=params_after)
    rules = mma_rules + cuda_rules + cstyle_rules
    if maps: return persistent(render_kernel(name, linear, tma_rules + wgmma_rules + rules, lang), dims[0][0], threads - PRODUCER)
    return render_kernel(name, linear, wgmma_rules + rules if holds_wgmma(linear) else rules, lang)

  def source(self, kernels: list[str]) -> str:
    """One translation unit of `kernels`. The CUDA headers (cuda_runtime.h, the half and bfloat16 ones) and the
    tensor cores' prelude only where a kernel names what they define; else the few DECLARATIONS above: parsing the
    headers is most of nvcc's time for a small kernel (a first call)."""
    # the warpgroup MMA's prelude only where a kernel calls it: its source is then built for sm_90a (runtime/cuda.py)
    wgmma = [WGMMA_PRELUDE] if any("g_wgmma_" in k or "g_tma_pipeline<" in k for k in kernels) else []
    wgmma += [TMA_PRELUDE] if any("g_tma_pipeline<" in k for k in kernels) else []
    heavy = bool(wgmma) or any(_NEEDS_HEADERS.search(k) for k in kernels)
    return "\n".join([*(CUDA.headers if heavy else (DECLARATIONS, PRELUDE)), *wgmma]) + "\n\n" + "\n\n".join(kernels) + "\n"


# a kernel that names a half or bfloat16 type or function, or anything the tensor cores' prelude has that the light
# PRELUDE does not (the dynamic shared memory of tiles is the light one's)
_NEEDS_HEADERS = re.compile("|".join(["half", "bfloat16", *sorted(set(re.findall(r"\b[gG]_\w+", MMA_PRELUDE))
                                                                  - set(re.findall(r"\b[gG]_\w+", PRELUDE)))]))


renderer = CUDARenderer()
