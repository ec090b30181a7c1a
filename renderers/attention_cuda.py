"""The GPU's tiled fused-attention kernel: CUDA source for a fused attention kernel (rules/attention.py) whose operands
renderers/attention_c.py `attention_operands` can address (q, k and the values buffers read through one view each, the
output stored through reshapes and permutations), used in place of the row-at-a-time kernel the generic GPU stages
lower it to (runtime/realize.py `tiled_attention`; DEBUG=2 says which and why).

The generic kernel takes a query row a thread and reads every key and value from global memory for it: a load per
multiply-add. This one is a product's tiling (the shape of rules/opt/gpu_tile.py's) around the online softmax:

    a block: BR query rows (BR/4 x 8 threads); its q tile Qs[dk][BR] staged in shared memory once
    for each tile of BC = 64 keys:
      Ks[dk][BC] (K transposed) and Vs[BC][Dp] staged in shared memory by all the block's threads (16-byte loads where
        the operand's view allows; K's threads along the keys, so that their stores meet no bank conflict)
      s[4][8]: a thread's register tile of 4 query rows x 8 keys (keys 4 consecutive, twice, 32 apart): per d one
        16-byte read of q and two of k for 32 multiply-adds
      s = E(s) * log2(e) (the scores' expression, renderers/attention_c.py `Epilogue`), keys past the end -inf
      (the loops over d and keys unrolled UNROLL steps at a time: a thread's shared addresses its base and constants)
      a row's max over its 8 threads (shuffles), m' c p as the online softmax (rules/attention.py), l kept per thread
      (its 8 parts summed at the end), the accumulator row rescaled by c
      (a tile masked for every row of the block, a causal mask's upper tiles, is skipped here: __syncthreads_or)
      p stored to Ps[BC][BR+4] (rows in 16-byte units), then acc[4][Dp/8] += p[r][j] * Vs[j][d]: per key one
        16-byte read of p and Dp/32 of v for 4 x Dp/8 multiply-adds
    out = acc / l, stored where the row and d exist

BR (128, 64 or 32) is the one whose blocks best fill the multiprocessors (`block_rows`). A row masked whole is 0/0 =
NaN, as numpy's. Float math is IEEE (exp2f), as the generic kernel's. Contract beyond attention_operands': the dot
product's length and the values' head dimension at most MAX_HEAD, buffers float32/int32/bool.

Design debt (as the CPU's tiled kernel): a template asked before the generic stages, not a plan of rules/opt. What
the vocabulary lacks for it: shared-memory tiles of a carried reduction's operands (PACK of the online softmax's key
loop), a register tile over query rows x keys of that loop, and the exchange of p between the threads of a row (here
through shared memory) before the second product. tests/test_attention.py runs this source on CPU threads
(tests/cuda_threads.py) as well as on a GPU.
"""
from __future__ import annotations
import math
from rewrite import dtypes
from .attention_c import Epilogue, Unsupported, attention_operands, base, LOG2_E
from .cuda import CUDA
from rules.opt.tensor_core import max_shared

BC = 64              # keys a tile
UNROLL = 16          # steps of the loops over d and over a tile's keys unrolled at a time: 16 compiles in a third of
                     # the time of whole loops (bench/nvcc_time.py) and ran faster on an H100 (32x1024x64: 0.517
                     # against 0.591 ms, bench/attention_gpu_check.py --unroll 64,16; docs/design.md)
MAX_HEAD = 128       # dot product length and head dimension the register tiles are written for


def shared_floats(br: int, dk: int, dp: int) -> int:
  """The block's shared tiles: Qs, Ks, Vs and Ps, in floats."""
  return dk * br + dk * BC + BC * dp + BC * (br + 4)


ROWS = 4   # R: query rows of a thread's register tiles (a multiple of 4). 8 (8 x 8 scores; 243 registers, 8 warps a
          # multiprocessor) measured slower on an H100: 32x1024x64 0.678 ms against 0.363 with 4, 12 heads x 1024 causal
          # 0.649-0.707 against 0.508-0.535 (warm calls of uncommitted variants, one run: not a bench/ figure)


def per_multiprocessor(br: int, dk: int, dp: int, shared: int) -> int:
  """Blocks of BR rows (8 BR / R threads) a multiprocessor of `shared` bytes holds at once, by their shared memory and
  threads."""
  return max(1, min(shared // (shared_floats(br, dk, dp) * 4 + 1024), 2048 // (8 * br // ROWS), 32))


def block_rows(blocks_of, dk: int, dp: int, multiprocessors: int, arch: str) -> int:
  """BR: the query rows a block, of 128, 64 or 32, whose tiles fit the shared memory a block may have on `arch` and
  whose grid takes least time, counting a wave of blocks as the rows its fullest multiprocessor holds (the blocks that
  share one run at its speed divided among them); ties: the larger (each key tile read once for more rows).
  blocks_of(br): the grid's blocks. Unsupported where no block fits (a head of 128 on a GPU of 99 KiB a block fits
  32 rows; one of a larger head than MAX_HEAD is refused before)."""
  shared = max_shared(arch)
  def cost(br: int) -> tuple[int, int]:
    per_sm, blocks = per_multiprocessor(br, dk, dp, shared), blocks_of(br)
    busy = min(per_sm, -(-blocks // multiprocessors))   # blocks on the fullest multiprocessor in a wave
    return -(-blocks // (multiprocessors * busy)) * busy * br, -br
  fits = [br for br in (128, 64, 32) if 8 * br // ROWS >= 64 and shared_floats(br, dk, dp) * 4 <= shared]   # two warps a block at least
  if not fits: raise Unsupported(f"its tiles pass the {shared >> 10} KiB of shared memory a block may have on {arch}")
  return min(fits, key=cost)


def _stage(name: str, src: str, rows: int, cols: int, row_stride: int, col_stride: int, limit: str, transposed: bool,
           threads: int, vec: bool, width: int) -> str:
  """The loop by which the block's threads copy a tile of `rows` (along memory: stride row_stride, at most `limit`
  present) x `cols` elements of src into shared memory, zero past the end. transposed: stored as [col][row] (rows
  `width` floats), the threads along the tile's rows (consecutive threads write consecutive words: no bank conflict;
  their reads, a row apart, meet in L1); else [row][col] (rows `width` floats), the threads along cols (reads that
  follow memory). vec: 16-byte loads along cols (contiguous, aligned)."""
  step = 4 if vec else 1
  per_row = cols // step
  total = rows * per_row
  if transposed: where = f"int rr = e % {rows}, cc = (e / {rows}) * {step};"
  else: where = f"int rr = e / {per_row}, cc = (e % {per_row}) * {step};"
  lines = [f"  #pragma unroll\n  for (int e = threadIdx.x; e < {total}; e += {threads}) {{", f"    {where}", f"    bool in = {limit} > rr;"]
  if vec:
    lines.append(f"    floatx4 x = in ? *(const floatx4*)({src} + (long)rr*{row_stride} + cc) : floatx4{{0.0f, 0.0f, 0.0f, 0.0f}};")
    if not transposed: return "\n".join(lines + [f"    *(floatx4*)({name} + rr*{width} + cc) = x;"]) + "\n  }"
    vals = [f"x.v[{c}]" for c in range(4)]
  else:
    lines.append(f"    float x = in ? {src}[(long)rr*{row_stride} + (long)cc*{col_stride}] : 0.0f;")
    vals = ["x"]
  for c, x in enumerate(vals):
    lines.append(f"    {name}[(cc + {c})*{width} + rr] = {x};" if transposed else f"    {name}[rr*{width} + cc + {c}] = {x};")
  return "\n".join(lines) + "\n  }"


def attention_cuda_source(norm, args: list[int], multiprocessors: int = 132, arch: str = "sm_90") -> tuple[str, tuple[int, int]]:
  """(source with KERNEL_NAME for its name, (blocks, threads)) of the tiled kernel for normalized kernel `norm` on a
  GPU of `multiprocessors` SMs and architecture `arch`; Unsupported says why not."""
  ops = attention_operands(norm)
  batch, tq, d, tk, dk = ops.batch, ops.tq, ops.d, ops.tk, ops.dk
  if d > MAX_HEAD or dk > MAX_HEAD: raise Unsupported(f"a head of {max(d, dk)} passes the {MAX_HEAD} the GPU's tiles are written for")
  (qb, qv), (kb, kv), (vb, vv) = ops.q, ops.k, ops.v
  nbt, nb = len(batch), math.prod(batch)
  dp = -(-d // 32) * 32          # the values' head dimension padded to 8 threads x 4 lanes
  dkp = -(-dk // 4) * 4
  br = block_rows(lambda br: nb * -(-tq // br), dkp, dp, multiprocessors, arch)
  rt = ROWS
  threads, chunks = 8 * br // rt, -(-tq // br)
  ep = Epilogue(ops.dot, lang=CUDA).expr(ops.scores, [f"b{n}" for n in range(nbt)] + ["i", "j"], True)
  qi, qd, kj, kd, vd, vj, oi, od = ops.strides
  # 16-byte loads along d where the operand is contiguous along it and every row starts 16-byte aligned
  def vec(view, row_stride: int, d_stride: int, n: int) -> bool:
    return d_stride == 1 and n % 4 == 0 and row_stride % 4 == 0 and view.offset % 4 == 0 and \
        all(s % 4 == 0 for s in view.strides[:nbt])
  qvec, kvec, vvec = vec(qv, qi, qd, dk), vec(kv, kj, kd, dk), vec(vv, vj, vd, d)
  floats = shared_floats(br, dkp, dp)
  bidx, params = ops.batch_indices(), ops.params(args, "__restrict__")
  pu, vu = br // 4 + 1, dp // 4   # 16-byte units a row of Ps, Vs
  groups = dp // 32
  # the blocks a multiprocessor holds, as a bound on registers, where a thread's tiles leave it room: about 64 for its
  # s tile, q and k, indices, and 16 a group of 4 x 4 accumulators
  need = 32 + 8 * rt + 4 * rt * groups
  blocks_sm = min(per_multiprocessor(br, dkp, dp, max_shared(arch)), 65536 // (threads * need))
  occupancy = f", {blocks_sm}" if blocks_sm > 1 else ""
  src = f"""extern "C" __global__ __launch_bounds__({threads}{occupancy}) G_SHARED({floats * 4}) void KERNEL_NAME({params}) {{
  float* Qs = (float*)g_dynamic_shared;          /* [dk][{br}] */
  float* Ks = Qs + {dkp * br};                     /* [dk][{BC}] */
  float* Vs = Ks + {dkp * BC};                     /* [{BC}][{dp}] */
  float* Ps = Vs + {BC * dp};                      /* [{BC}][{br} + 4] */
  const int tid = threadIdx.x, rg = tid >> 3, cg = tid & 7;   /* rows rg*{rt}.., keys and dims cg*4.. (+32, +64..) */
  const long bt = blockIdx.x / {chunks}, row0 = (long)(blockIdx.x % {chunks}) * {br};
{bidx}  const float* __restrict__ q = data{qb.arg.number} + {base(qv, nbt)} + row0*{qi};
  const float* __restrict__ k = data{kb.arg.number} + {base(kv, nbt)};
  const float* __restrict__ v = data{vb.arg.number} + {base(vv, nbt)};
  float* __restrict__ o = data{ops.out.arg.number} + {" + ".join([str(ops.out_view.offset)] + [f"b{n}*{s}" for n, s in enumerate(ops.out_strides[:nbt]) if s])};
{_stage("Qs", "q", br, dkp if qvec else dk, qi, qd, f"{tq} - row0", True, threads, qvec, br)}
  float m[{rt}], l[{rt}], acc[{rt}][{4 * groups}];
  #pragma unroll
  for (int r = 0; r < {rt}; r++) {{
    m[r] = {CUDA.literal(dtypes.float32, -math.inf)}; l[r] = 0.0f;
    #pragma unroll
    for (int c = 0; c < {4 * groups}; c++) acc[r][c] = 0.0f;
  }}
  for (long j0 = 0; j0 < {tk}; j0 += {BC}) {{
    {{ const float* __restrict__ kt = k + j0*{kj}; const float* __restrict__ vt = v + j0*{vj};
{_stage("Ks", "kt", BC, dkp if kvec else dk, kj, kd, f"{tk} - j0", True, threads, kvec, BC)}
{_stage("Vs", "vt", BC, d, vj, vd, f"{tk} - j0", False, threads, vvec, dp)}
    }}
    __syncthreads();
    float s[{rt}][8];
    #pragma unroll
    for (int r = 0; r < {rt}; r++)
      #pragma unroll
      for (int c = 0; c < 8; c++) s[r][c] = 0.0f;
    #pragma unroll {UNROLL}
    for (int dd = 0; dd < {dk}; dd++) {{
      float av[{rt}], bv[8];
      #pragma unroll
      for (int u = 0; u < {rt // 4}; u++) {{ floatx4 a = *(const floatx4*)(Qs + dd*{br} + rg*{rt} + u*4); av[u*4] = a.v[0]; av[u*4 + 1] = a.v[1]; av[u*4 + 2] = a.v[2]; av[u*4 + 3] = a.v[3]; }}
      floatx4 b0 = *(const floatx4*)(Ks + dd*{BC} + cg*4), b1 = *(const floatx4*)(Ks + dd*{BC} + 32 + cg*4);
      #pragma unroll
      for (int c = 0; c < 4; c++) {{ bv[c] = b0.v[c]; bv[4 + c] = b1.v[c]; }}
      #pragma unroll
      for (int r = 0; r < {rt}; r++)
        #pragma unroll
        for (int c = 0; c < 8; c++) s[r][c] += av[r] * bv[c];
    }}
    int live = 0;
    #pragma unroll
    for (int r = 0; r < {rt}; r++) {{
      const long i = row0 + rg*{rt} + r < {tq} ? row0 + rg*{rt} + r : {tq - 1};
      float bm = {CUDA.literal(dtypes.float32, -math.inf)};
      #pragma unroll
      for (int c = 0; c < 8; c++) {{
        const long key = j0 + cg*4 + (c & 3) + (c >> 2)*32, j = key < {tk} ? key : {tk - 1};
        float x = s[r][c];
        s[r][c] = key < {tk} ? (float)({ep}) * {LOG2_E!r}f : {CUDA.literal(dtypes.float32, -math.inf)};
        bm = fmaxf(bm, s[r][c]);
      }}
      bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 1));
      bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 2));
      bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 4));
      live |= bm != {CUDA.literal(dtypes.float32, -math.inf)};
      const float mn = fmaxf(m[r], bm), safe = mn == {CUDA.literal(dtypes.float32, -math.inf)} ? 0.0f : mn, c0 = exp2f(m[r] - safe);
      m[r] = mn; l[r] *= c0;
      #pragma unroll
      for (int c = 0; c < 8; c++) {{ s[r][c] = exp2f(s[r][c] - safe); l[r] += s[r][c]; }}
      #pragma unroll
      for (int c = 0; c < {4 * groups}; c++) acc[r][c] *= c0;
    }}
    /* a tile masked for every row of the block changes nothing (its p are 0): its product is skipped */
    if (!__syncthreads_or(live)) continue;
    #pragma unroll
    for (int c = 0; c < 8; c++)
      #pragma unroll
      for (int u = 0; u < {rt // 4}; u++)
        *(floatx4*)(Ps + (cg*4 + (c & 3) + (c >> 2)*32)*{pu * 4} + rg*{rt} + u*4) = floatx4{{s[u*4][c], s[u*4 + 1][c], s[u*4 + 2][c], s[u*4 + 3][c]}};
    __syncthreads();
    #pragma unroll {UNROLL}
    for (int jj = 0; jj < {BC}; jj++) {{
      float pv[{rt}];
      #pragma unroll
      for (int u = 0; u < {rt // 4}; u++) {{ floatx4 p = *(const floatx4*)(Ps + jj*{pu * 4} + rg*{rt} + u*4); pv[u*4] = p.v[0]; pv[u*4 + 1] = p.v[1]; pv[u*4 + 2] = p.v[2]; pv[u*4 + 3] = p.v[3]; }}
      #pragma unroll
      for (int g = 0; g < {groups}; g++) {{
        floatx4 w = *(const floatx4*)(Vs + jj*{vu * 4} + (cg + 8*g)*4);
        #pragma unroll
        for (int r = 0; r < {rt}; r++)
          #pragma unroll
          for (int c = 0; c < 4; c++) acc[r][g*4 + c] += pv[r] * w.v[c];
      }}
    }}
    __syncthreads();
  }}
  #pragma unroll
  for (int r = 0; r < {rt}; r++) {{
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    const long i = row0 + rg*{rt} + r;
    if (i < {tq}) {{
      #pragma unroll
      for (int c = 0; c < {4 * groups}; c++) {{
        const int dd = cg*4 + (c & 3) + (c >> 2)*32;
        if (dd < {d}) o[i*{oi} + dd*{od}] = acc[r][c] / sum;
      }}
    }}
  }}
}}"""
  return src, (nb * chunks, threads)
