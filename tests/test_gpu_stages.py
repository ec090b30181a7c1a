"""The GPU stages (rules/gpu.py) compute the right values, checked without a GPU: kernels lowered for a device whose
loops are its threads run in a small numpy model of a CUDA grid (every thread of every block at once, as arrays over
(block, thread); loops are uniform across threads; a BARRIER combines over the lanes of a row: that many consecutive
threads of a block), and must give what numpy gives. Covers one thread per element (and several per thread), a block
of lanes per long row, a warp or less per short row with several rows a block, sizes that do not divide (gated
stores, clamped indices), unrolled and looped per-lane trips, fused softmax, log_softmax, layer norm and variance,
grid plans as data (the heuristic's, a given one, bad ones refused), and the launch limits."""
import numpy as np
import pytest

from rewrite import Ops, UOp, dtypes
from rules.gpu import MAX_THREADS, MULTIPROCESSORS, FLAT_THREADS, launch_dims, InvalidGridPlan, lanes_of, rows_per_block, rows_per_thread
from rules.opt import Opt, OptKind, Plan, OptContext, InvalidPlan, check_plan
from rules.split import split_reduction_plan, SplitReduce
from rules.pipeline import Run, lower_kernel, schedule, pipeline
from rules.host import HostContext
from rules.realize import NewBuffer, normalize
from tensor import Tensor

rng = np.random.default_rng(3)


def _cdiv(a, b):
  q = np.abs(a) // np.where(b == 0, 1, np.abs(b))
  return np.where((a < 0) != (b < 0), -q, q)


ALU = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.MAX: np.maximum, Ops.FDIV: np.divide, Ops.CMPLT: np.less,
       Ops.CMPNE: np.not_equal, Ops.AND: np.bitwise_and, Ops.OR: np.bitwise_or, Ops.XOR: np.bitwise_xor,
       Ops.SHL: np.left_shift, Ops.SHR: np.right_shift, Ops.NEG: np.negative, Ops.RECIP: np.reciprocal,
       Ops.EXP2: np.exp2, Ops.LOG2: np.log2, Ops.SIN: np.sin, Ops.SQRT: np.sqrt, Ops.TRUNC: np.trunc,
       Ops.WHERE: np.where, Ops.MULACC: lambda a, b, c: a * b + c, Ops.IDIV: _cdiv, Ops.MOD: lambda a, b: a - b * _cdiv(a, b)}


def run_grid(linear, memory: dict[int, np.ndarray]) -> None:
  """Run one linear kernel over `memory` (argument slot -> flat array) on every thread of its grid at once."""
  dims = launch_dims(linear)
  shape = (dims[0][0], dims[1][0]) if dims else (1, 1)
  val: dict = {}
  def v(u): return np.array(u.arg, u.dtype.np) if u.op is Ops.CONST else val[u]
  loop_start: dict = {}
  pc, src = 0, linear.src
  with np.errstate(all="ignore"):
    while pc < len(src):
      u = src[pc]
      if u.op is Ops.DEFINE_GLOBAL: val[u] = memory[u.arg]
      # a shared tile: one array per block (threads run in lockstep here, so a barrier only has to exist: the
      # structure tests check where it is)
      elif u.op is Ops.DEFINE_LOCAL: val[u] = np.zeros((shape[0], u.arg[-1]), u.dtype.base.np)
      elif u.op is Ops.BARRIER and u.src[0].op is Ops.DEFINE_LOCAL: val[u] = val[u.src[0]]
      elif u.op is Ops.SPECIAL: val[u] = np.arange(u.arg[1], dtype=np.int32).reshape((-1, 1) if u.arg[0][0] == "g" else (1, -1))
      elif u.op is Ops.INDEX:
        buf, idx = v(u.src[0]), np.broadcast_to(v(u.src[1]), shape)
        # a block's own row of a shared tile
        val[u] = (buf.reshape(-1), idx + np.arange(shape[0]).reshape(-1, 1) * buf.shape[1]) if buf.ndim == 2 else (buf, idx)
      elif u.op is Ops.LOAD:
        buf, idx = v(u.src[0])
        if len(u.src) == 1: val[u] = buf[idx] if u.dtype.count == 1 else buf[idx[..., None] + np.arange(u.dtype.count)]
        else:
          ok = np.broadcast_to(v(u.src[1]), shape)
          val[u] = np.where(ok, buf[np.where(ok, idx, 0)], np.zeros((), buf.dtype))
      elif u.op is Ops.STORE:
        buf, idx = v(u.src[0])   # (the stored value takes the target's dtype, not that of the last buffer loaded)
        if (n := u.src[1].dtype.count) > 1: idx, shape_ = idx[..., None] + np.arange(n), (*shape, n)   # a vector
        else: shape_ = shape
        x = np.broadcast_to(v(u.src[1]), shape_).astype(buf.dtype)
        gate = np.broadcast_to(v(u.src[2]), shape) if len(u.src) > 2 else np.ones(shape, bool)
        buf[idx[gate]] = x[gate]
      elif u.op is Ops.RANGE:
        if u not in loop_start: loop_start[u], val[u] = pc, np.array(0, np.int32)
      elif u.op is Ops.END:
        r = u.src[0]
        val[r] = val[r] + 1
        if val[r] < r.src[0].arg: pc = loop_start[r]
        else: del loop_start[r]
      elif u.op is Ops.DEFINE_ACC:
        red = u.src[0]
        carry = red.src[0].src[1] if red.arg is Ops.NOOP else None
        init = (v(carry.src[1]) if carry.arg[1] is None else carry.arg[1]) if carry is not None else \
          0 if red.arg is Ops.ADD else dtypes.min(red.dtype)
        val[red] = np.array(init, red.dtype.scalar.np)
      elif u.op is Ops.ASSIGN:   # a carried accumulator (REDUCE of NOOP, rules/attention.py) takes its new value
        red = u.src[0]
        new = v(red.src[0]) if red.arg is Ops.NOOP else ALU[red.arg](val[red], v(red.src[0]))
        val[red] = np.asarray(new).astype(red.dtype.scalar.np)
      elif u.op is Ops.CARRY: val[u] = next(val[r] for r in val if getattr(r, "op", None) is Ops.REDUCE and r.arg is Ops.NOOP and r.src[0].src[1] is u)
      elif u.op is Ops.NOOP: val[u] = v(u.src[0])
      elif u.op is Ops.GEP: val[u] = v(u.src[0])[..., u.src[1].arg]   # an element of a vector (its last axis)
      elif u.op is Ops.VECTORIZE: val[u] = np.stack([np.broadcast_to(v(s), shape) for s in u.src], -1)
      elif u.op is Ops.REDUCE: pass  # its value is its accumulator
      elif u.op is Ops.BARRIER:
        (op, lanes), x = u.arg, np.broadcast_to(v(u.src[0]), shape)
        rows = x.reshape(shape[0], -1, lanes)   # each row's lanes are `lanes` consecutive threads
        got = rows.sum(2, keepdims=True, dtype=x.dtype) if op is Ops.ADD else rows.max(2, keepdims=True)
        val[u] = np.broadcast_to(got, rows.shape).reshape(shape).astype(u.dtype.np)
      elif u.op is Ops.CAST: val[u] = np.asarray(v(u.src[0])).astype(u.dtype.np)
      else: val[u] = np.asarray(ALU[u.op](*[v(s) for s in u.src])).astype(u.dtype.np)
      pc += 1
  for u in linear.src:
    if u.op is Ops.DEFINE_LOCAL and u.arg[0] == "tma_store": tma_store(linear, u, val)


def tma_store(linear, staging, val) -> None:
  """What the TMA stores of a staging tile's part (renderers/cuda_tma.py, rules/opt/tensor_core.py `_staged`) write:
  per block, warpgroup g's rows of the part as boxes of 64 x 64, each in the 128-byte swizzle (element (r, c) of a box
  at r*64 + ((c/8) ^ (r%8))*8 + c%8), to the output's rows row0 + 64g.. and columns col0 + part*width + 64b.."""
  (mma,) = [u for u in linear.src if u.op is Ops.MMA]
  spec, (_, part, size) = mma.arg, staging.arg
  out, store, width = val[staging.src[0]], mma.arg.tma.store, size // spec.bm
  row0, col0 = (np.broadcast_to(val[mma.src[i]], val[staging].shape[:1] + (1,))[:, 0] for i in (2, 3))
  r, c = np.arange(64)[:, None], np.arange(64)[None, :]
  for blk, tile in enumerate(val[staging]):
    for g in range(spec.bm // 64):
      for b in range(width // 64):
        box = tile[g * 64 * width + b * 4096 + r * 64 + ((c // 8) ^ (r % 8)) * 8 + c % 8]
        out[store.offset + (row0[blk] + 64 * g + r) * store.stride + col0[blk] + part * width + 64 * b + c] = box


def host_steps(tensors, multiprocessors: int = MULTIPROCESSORS, split: str = "off") -> tuple[list[UOp], list[UOp]]:
  """(the host program's steps, the realized outputs) of the tensors scheduled for a GPU of `multiprocessors` SMs;
  `split` "on" splits every reduction the heuristic offers to split, "off" none."""
  run = Run("CPU", parallel=False, device_loops=True)
  kernels, realized = schedule([t.uop for t in tensors], ["CPU"] * len(tensors), run)
  run.host = HostContext(frozenset(u.src[0] for u in realized), multiprocessors=lambda device: multiprocessors, split_mode=split)
  return list(pipeline.run(UOp(Ops.SINK, src=tuple(kernels), arg="steps"), "host", run).src), realized


def run_on_model_gpu(*tensors: Tensor, multiprocessors: int = MULTIPROCESSORS, split: str = "off") -> list[np.ndarray]:
  """The tensors computed through the GPU stages for a GPU of `multiprocessors` SMs, in the model grid, each kernel
  call of the host program in turn; inputs come from their CPU buffers."""
  steps, realized = host_steps(tensors, multiprocessors, split)
  arrays: dict = {}
  def array_of(b):
    if b not in arrays: arrays[b] = np.zeros(b.arg.size, b.dtype.np) if isinstance(b.arg, NewBuffer) else b.arg.numpy()
    return arrays[b]
  for step in steps:
    if step.op in (Ops.ALLOC, Ops.FREE): continue
    assert step.op is Ops.CALL
    linear = lower_kernel(step.arg, Run("CPU", parallel=False, device_loops=True, multiprocessors=multiprocessors))
    if (dims := launch_dims(linear)) is not None: assert dims[1][0] <= MAX_THREADS
    run_grid(linear, {i: array_of(b) for i, b in enumerate(step.src)})
  return [array_of(u.src[0]).reshape(t.shape) for u, t in zip(realized, tensors)]


def gpu(**kw) -> OptContext: return OptContext(device_loops=True, **kw)


def T(*shape): return Tensor(rng.standard_normal(shape).astype(np.float32), device="CPU")


def softmax(x, axis=-1):
  e = np.exp(x - x.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


ROW_SHAPES = [(64, 2048), (5, 300), (3, 130), (2, 40000), (300, 7), (1, 1), (32, 48), (17, 1), (1, 33), (100, 127),
              (2, 128), (33, 31), (1000, 3), (7, 2), (9, 64)]


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_row_reductions_softmax_layernorm(shape):
  x = T(*shape)
  xn = x.numpy()
  got = run_on_model_gpu(x.sum(1), x.max(1), x.softmax(1), x.layernorm(1), x.sum(0), x.sum())
  want = [xn.sum(1), xn.max(1), softmax(xn, 1), (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5),
          xn.sum(0), xn.sum()]
  for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_each_row_normalization_alone_is_one_kernel_and_right(shape):
  # alone, each program is one kernel on a GPU: the row reductions run in the lanes that write the row
  x = T(*shape)
  xn = x.numpy().astype(np.float64)
  ddof = 1 if shape[1] > 1 else 0
  programs = [(x.softmax(1), softmax(xn, 1)), (x.log_softmax(1), np.log(softmax(xn, 1))),
              (x.var(1, correction=ddof), xn.var(1, ddof=ddof)),
              (x - x.mean(1, keepdim=True), xn - xn.mean(1, keepdims=True)),
              ((x - x.max(1, keepdim=True)).exp().sum(1), np.exp(xn - xn.max(1, keepdims=True)).sum(1))]
  for t, want in programs:
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    assert len(kernels) == 1
    np.testing.assert_allclose(run_on_model_gpu(t)[0], want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("shape", [(32, 48), (300, 7), (3, 1000)])
def test_row_reductions_of_other_dtypes(shape):
  # half, int and bool rows combine in a wider type across lanes (renderers/cuda.py) and come back exact
  x = T(*shape)
  xn = x.numpy()
  got = run_on_model_gpu(x.half().max(1), (x * 4).int().sum(1), (x > 1).any(1), (x > -3).all(1))
  want = [xn.astype(np.float16).max(1), (xn * 4).astype(np.int32).sum(1), (xn > 1).any(1), (xn > -3).all(1)]
  for g, w in zip(got, want): np.testing.assert_array_equal(g, w)


def plan_of(t: Tensor, multiprocessors: int = MULTIPROCESSORS) -> Plan:
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  run = Run("CPU", parallel=False, device_loops=True, multiprocessors=multiprocessors)
  lower_kernel(normalize(kernels[0])[0], run)
  return run.opt.plan


def test_grid_plans_are_data_the_heuristic_chooses():
  # one thread per element: every output loop a row, FLAT_THREADS rows a block
  assert str(plan_of(T(32, 48) + 1)) == f"global(0) global(1) local(-1, {FLAT_THREADS}) [heuristic]"
  # a short row: a warp of lanes per row (loops 1: the columns, 2 and 3: the max and the sum), 4 rows a block
  assert str(plan_of(T(32, 48).softmax(1))) == "global(0) local(1, 32) group(3, 32) group(2, 32) local(-1, 4) [heuristic]"
  # rows of 7: 8 lanes each, 16 rows a block; a long row: a block of lanes, 16 elements or fewer each
  assert lanes_of(plan_of(T(300, 7).sum(1))) == 8 and rows_per_block(plan_of(T(300, 7).sum(1))) == 16
  assert lanes_of(plan_of(T(64, 4096).sum(1), multiprocessors=1)) == 256 and rows_per_block(plan_of(T(4, 4096).sum(1))) == 1
  # ... and more lanes where the rows would not fill the multiprocessors (2048 threads each) otherwise
  assert lanes_of(plan_of(T(4, 4096).sum(1), multiprocessors=1)) == 512 and lanes_of(plan_of(T(4, 4096).sum(1))) == 1024


def test_a_given_grid_plan_is_carried_out_and_a_bad_one_refused():
  x = T(8, 40)
  kernels, _ = schedule([x.sum(1).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  norm, bufs = normalize(kernels[0])
  mine = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 64)))
  run = Run("CPU", parallel=False, device_loops=True, opt=gpu(choose=lambda sink, loops: mine))
  linear = lower_kernel(norm, run)
  assert launch_dims(linear) == ((8, 1, 1), (64, 1, 1))
  out = np.zeros(8, np.float32)
  run_grid(linear, {0: out, 1: bufs[1].arg.numpy()})
  np.testing.assert_allclose(out, x.numpy().sum(1), rtol=1e-5)
  bad = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 64), Opt(OptKind.LOCAL, -1, 2)))
  odd_lanes = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 24), Opt(OptKind.LOCAL, -1, 4)))
  for plan, why in ((bad, "not a block"), (odd_lanes, "power of two"), (Plan(()), "not planned")):
    # the plan is checked where the policy gives it, before any rule runs; the error says which stage asked
    with pytest.raises(InvalidGridPlan, match=why) as err:
      lower_kernel(norm, Run("CPU", parallel=False, device_loops=True, opt=gpu(choose=lambda sink, loops: plan)))
    assert any("preparing stage 'opt'" in note for note in err.value.__notes__)


def test_the_grid_stages_carry_on_from_a_users_stage_before_them():
  # the plan is made from the kernel as the stages before it left it (no stage is re-run privately): a user's rule
  # set inserted before the opt stage, here doubling every stored value, is in what the grid runs
  from rewrite import UPat, PatternMatcher
  from rules.pipeline import pipeline
  def store_twice_the_value(i, v):
    return None if v.op is Ops.MUL and v.src[1].op is Ops.CONST and v.src[1].arg == 2.0 else UOp(Ops.STORE, dtypes.void, (i, v * 2.0))
  mine = PatternMatcher([(UPat(Ops.STORE, src=(UPat.var("i"), UPat.var("v"))), store_twice_the_value)], name="double_stores")
  x = T(32, 48)
  pipeline.insert("opt", mine, where="before")
  try: got = run_on_model_gpu(x.softmax(1))[0]
  finally: pipeline.remove("double_stores")
  np.testing.assert_allclose(got, 2 * softmax(x.numpy(), 1), rtol=2e-4, atol=2e-4)


def test_elementwise_views_and_odd_sizes():
  x, y = T(33, 45), T(45)
  xn, yn = x.numpy(), y.numpy()
  got = run_on_model_gpu(((x * y + 1).exp() - x).relu(), x.T.flip(0)[3:40:2] * 2, x.pad(((1, 2), (0, 1))))
  want = [np.maximum(np.exp(xn * yn + 1) - xn, 0), xn.T[::-1][3:40:2] * 2, np.pad(xn, ((1, 2), (0, 1)))]
  for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, per_thread", [((200, 300), 4), ((129, 200), 2), ((3, 5), 1)])
def test_a_thread_takes_several_elements_where_the_grid_stays_full(shape, per_thread):
  # on a GPU of one multiprocessor a small grid fills it: each thread takes 2 or 4 elements, FLAT_THREADS apart
  x, y = T(*shape), T(shape[1])
  t = ((x * y + 1).exp() - x).relu()
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  run = Run("CPU", parallel=False, device_loops=True, multiprocessors=1)
  lower_kernel(normalize(kernels[0])[0], run)
  assert rows_per_thread(run.opt.plan) == per_thread
  got = run_on_model_gpu(t, x.sum(1), multiprocessors=1)
  np.testing.assert_allclose(got[0], np.maximum(np.exp(x.numpy() * y.numpy() + 1) - x.numpy(), 0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[1], x.numpy().sum(1), rtol=2e-4, atol=2e-4)


def test_matmul_conv_and_attention():
  a, b = T(17, 200), T(200, 9)
  img, w = T(2, 3, 8, 8), T(4, 3, 3, 3)
  q = T(2, 130, 16)
  got = run_on_model_gpu(a @ b, img.conv2d(w, padding=1), (q @ q.transpose(-1, -2) / 4).softmax(-1) @ q)
  qn = q.numpy()
  want = [a.numpy() @ b.numpy(), img.conv2d(w, padding=1).numpy(), softmax(qn @ qn.transpose(0, 2, 1) / 4) @ qn]
  for g, w_ in zip(got, want): np.testing.assert_allclose(g, w_, rtol=2e-4, atol=2e-4)


def test_softmax_and_layernorm_are_one_kernel_on_a_gpu():
  x = T(64, 2048)
  for t in (x.softmax(1), x.layernorm(1)):
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    assert len(kernels) == 1


def test_a_causally_masked_softmax_is_one_kernel_on_a_gpu():
  # the mask is computed from indices (triu of a constant), which reads no memory: the row's max and sum are inlined
  # into the kernel that writes the probabilities, as for an unmasked softmax (the GPT's attention: 3 kernels before)
  heads, n = 3, 70
  s = T(heads, n, n)
  later = Tensor.full((n, n), True, device="CPU").triu(1)
  p = s.masked_fill(later, -np.inf).softmax(-1)
  kernels, _ = schedule([p.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  assert len(kernels) == 1
  want = softmax(np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s.numpy()))
  np.testing.assert_allclose(run_on_model_gpu(p)[0], want, rtol=1e-5, atol=1e-6)


# ---- a reduction of few, long rows split over blocks: partials into a scratch buffer, then a kernel combining them

def split_cases():
  x, tall, wide = T(1024, 1024), T(8192, 96), T(4, 65536)
  xn, tn, wn = x.numpy(), tall.numpy(), wide.numpy()
  return [(x.sum(), xn.sum()), (x.mean(), xn.mean()), (x.max(), xn.max()), (tall.sum(0), tn.sum(0)),
          (tall.max(0), tn.max(0)), (wide.sum(1), wn.sum(1)), (wide.max(1), wn.max(1)), (tall.var(0), tn.var(0, ddof=1)),
          ((tall * 4).int().sum(0), (tn * 4).astype(np.int32).sum(0)), ((x > 3).any(), (xn > 3).any()),
          (x.T.sum(), xn.sum()), (((x + 1).exp() * 0.5).sum(), (np.exp(xn + 1) * 0.5).sum())]


@pytest.mark.parametrize("case", range(12))
def test_a_split_reduction_and_the_one_kernel_give_numpys_values_in_the_model_grid(case):
  t, want = split_cases()[case]
  steps, _ = host_steps([t], split="on")
  calls = [s for s in steps if s.op is Ops.CALL]
  assert len(calls) >= 2 and any(s.op is Ops.ALLOC for s in steps)   # partials into a scratch buffer, then the combine
  for split in ("on", "off"):
    np.testing.assert_allclose(run_on_model_gpu(t, split=split)[0], want, rtol=2e-4, atol=2e-4)


def test_reductions_of_one_shape_grouped_in_one_kernel_split_together():
  x = T(1024, 1024)
  xn = x.numpy()
  steps, _ = host_steps([x.sum(), x.max(), x.mean() + 1], split="on")
  calls = [s for s in steps if s.op is Ops.CALL]
  # one kernel of partials with a scratch buffer per reduction: the sum (which the mean shares) and the max
  assert len(calls) == 2 and len(calls[0].arg.src) == 2 and len(calls[1].arg.src) == 3
  for split in ("on", "off"):
    got = run_on_model_gpu(x.sum(), x.max(), x.mean() + 1, split=split)
    for g, w in zip(got, (xn.sum(), xn.max(), xn.mean() + 1)): np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)


def test_the_split_heuristic_spreads_few_long_rows_over_the_gpu_and_leaves_the_rest():
  def plan(t):
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    return [split_reduction_plan(k) for k in kernels]
  # a row reduction: partial blocks for two waves of the GPU, each at least SPLIT_MIN_ROW_CHUNK long; the outer axis
  assert plan(T(1024, 1024).sum()) == [SplitReduce(0, 512)] and repr(plan(T(1024, 1024).sum())[0]) == "split_reduce(0, 512)"
  assert plan(T(4, 65536).sum(1)) == [SplitReduce(1, 32)]
  # a column reduction: a thread per partial, one wave of them
  assert plan(T(8192, 96).sum(0)) == [SplitReduce(0, 256)]
  # many rows fill the GPU already; short rows, lengths without a divisor, reductions of several shapes: not split
  # a reduction nested in another (x.mean() inlined into x.var()'s kernel by gpu_fuse): not split either
  for t in (T(4096, 4096).sum(1), T(64, 2048).sum(1), T(4099).sum(), T(1024, 1024).softmax(1), T(32, 48) + 1,
            T(1024, 1024).var()):
    assert plan(t) == [None] * len(plan(t)), t


def test_a_gpu_plan_offers_both_and_graft_split_reduce_forces_one(monkeypatch):
  # the host program planned for CUDA (rendered, not compiled: no GPU needed; t0 stands in for x there) lists the choice
  from runtime.realize import plan
  x = T(1024, 1024)
  monkeypatch.delenv("GRAFT_SPLIT_REDUCE", raising=False)
  listing = str(plan([(x.sum().uop, "CPU")], device="CUDA"))
  assert "pick   r_scalar_" in listing and "out0 <- t0 (scratch t1)  or split_reduce(0, 512): r_512_1_1_" in listing
  monkeypatch.setenv("GRAFT_SPLIT_REDUCE", "1")
  listing = str(plan([(x.sum().uop, "CPU")], device="CUDA"))
  assert "pick" not in listing and listing.count("call   ") == 2 and "alloc  t0 float32[512]" in listing
  monkeypatch.setenv("GRAFT_SPLIT_REDUCE", "0")
  assert str(plan([(x.sum().uop, "CPU")], device="CUDA")).count("call   ") == 1
  monkeypatch.setenv("GRAFT_SPLIT_REDUCE", "2")
  with pytest.raises(ValueError, match="GRAFT_SPLIT_REDUCE='2': use 0"): plan([(x.sum().uop, "CPU")], device="CUDA")


def test_fusion_is_decided_in_schedule_order_whatever_order_the_kernel_rules_fire_in():
  # layer norm: the mean is inlined into the variance before the variance is judged, then both into the output; the
  # rule on each KERNEL decides the kernels ahead of it first, so rules fired last kernel first give the same schedule
  from rules.gpu import FuseContext, inline_broadcast_reductions
  t = T(8, 64).layernorm(-1)   # 8 rows: too few for the CPU to fuse them (rules/opt/rows.py), not for a GPU
  kernels, realized = schedule([t.uop], ["CPU"], Run("CPU", parallel=False))   # what gpu_fuse would be given
  def fused(order):
    ctx = FuseContext({realized[0].src[0]})
    ctx.index_schedule(UOp(Ops.SINK, src=tuple(kernels)))
    made = {k: inline_broadcast_reductions(ctx, k) for k in order(kernels)}
    return [k if made[k] is None else made[k] for k in kernels]
  forward = fused(list)
  assert len(kernels) == 3 and fused(lambda ks: ks[::-1]) == forward
  assert [k.op for k in forward] == [Ops.SINK, Ops.SINK, Ops.KERNEL]   # two dropped (spliced out), one kernel left


def test_a_split_record_in_a_kernels_plan_is_refused():
  # a split is two kernels, the host stage's record: no kernel's plan may hold one
  with pytest.raises(InvalidPlan, match="a plan holds Opt records"): check_plan(Plan((SplitReduce(1, 4),)), [], device_loops=True)


def lowered(t: Tensor, plan: Plan | None = None, multiprocessors: int = MULTIPROCESSORS):
  """(the plan, the linear kernel) of t's last kernel lowered for a GPU: the heuristic's plan, or `plan`."""
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  ctx = gpu(multiprocessors=multiprocessors, choose=(lambda sink, loops: plan) if plan is not None else None)
  run = Run("CPU", parallel=False, device_loops=True, opt=ctx)
  linear = lower_kernel(normalize(kernels[-1])[0], run)
  return run.opt.plan, linear


def vector_accesses(linear) -> tuple[int, int, int, int]:
  """(vector loads, vector stores, scalar loads, scalar stores) of global memory in a linear kernel."""
  glob = lambda x: x.src[0].src[0].op is Ops.DEFINE_GLOBAL
  loads = [u for u in linear.src if u.op is Ops.LOAD and glob(u)]
  stores = [u for u in linear.src if u.op is Ops.STORE and glob(u)]
  return (sum(u.dtype.count == 4 for u in loads), sum(u.src[1].dtype.count == 4 for u in stores),
          sum(u.dtype.count == 1 for u in loads), sum(u.src[1].dtype.count == 1 for u in stores))


@pytest.mark.parametrize("shape, sms", [((8, 2048), 1), ((300, 4096), MULTIPROCESSORS), ((6, 8192), 1)])
def test_long_rows_are_read_and_written_in_runs_of_four_floats(shape, sms):
  # issue 23: a softmax or layer norm row held in registers is read once and written once as floatx4 (16 bytes a
  # lane's access): vector(-1, 4) makes a lane's elements runs of 4, and stage opt_grid_vector reads each run at once
  x = T(*shape)
  xn = x.numpy().astype(np.float64)
  for t, want in ((x.softmax(1), softmax(xn, 1)), (x.layernorm(1), (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5)),
                  (x.sum(1), xn.sum(1))):
    plan, linear = lowered(t, multiprocessors=sms)
    assert Opt(OptKind.VECTOR, -1, 4) in plan.opts, plan
    vloads, vstores, sloads, sstores = vector_accesses(linear)
    per_lane = shape[1] // lanes_of(plan)
    assert (vloads, sloads) == (per_lane // 4, 0)   # the row once, in registers, 16 bytes at a time
    assert (vstores, sstores) == ((per_lane // 4, 0) if t.shape == shape else (0, 1))
    np.testing.assert_allclose(run_on_model_gpu(t, multiprocessors=sms)[0], want, rtol=2e-4, atol=2e-4)


def test_runs_of_four_where_sizes_do_not_divide_stay_scalar_and_right():
  # a given vector(-1, 4) on rows and columns that do not divide: indices past the end are clamped, so those reads
  # and the gated stores stay scalar; where a whole run is in bounds it is one vector; values are numpy's
  x, y = T(5, 300), T(33, 100)
  sums = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 128), Opt(OptKind.VECTOR, -1, 4)))
  flat = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GLOBAL, 1), Opt(OptKind.LOCAL, -1, 256), Opt(OptKind.VECTOR, -1, 4)))
  even = Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GLOBAL, 1), Opt(OptKind.LOCAL, -1, 64), Opt(OptKind.UPCAST, -1, 2), Opt(OptKind.VECTOR, -1, 4)))
  for t, plan, want, vectors in ((x.sum(1), sums, x.numpy().sum(1), False), ((y * 2 + 1).relu(), flat, np.maximum(y.numpy() * 2 + 1, 0), False),
                                 ((x[:, :256] * 2 + 1).relu(), even, np.maximum(x.numpy()[:, :256] * 2 + 1, 0), True)):
    _, linear = lowered(t, plan)
    vloads, vstores, _, _ = vector_accesses(linear)
    assert (vloads > 0, vstores > 0) == (vectors, vectors)
    out = np.zeros(want.size, np.float32)
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    bufs = normalize(kernels[-1])[1]
    run_grid(linear, {0: out, **{i: b.arg.numpy() for i, b in enumerate(bufs) if i}})
    np.testing.assert_allclose(out.reshape(want.shape), want, rtol=2e-4, atol=2e-4)


def test_a_run_that_is_not_16_byte_aligned_stays_scalar():
  # x[:, 1:] of rows of 4097: a row starts at 4097 * row + 1 floats, so its runs of 4 are not 16-byte aligned and
  # are read element by element; the output's rows (4096, contiguous) are written a run at a time
  x = T(64, 4097)
  t = x[:, 1:].softmax(1)
  plan, linear = lowered(t)
  assert Opt(OptKind.VECTOR, -1, 4) in plan.opts and vector_accesses(linear) == (0, 1, 4, 0)
  np.testing.assert_allclose(run_on_model_gpu(t)[0], softmax(x.numpy()[:, 1:], 1), rtol=2e-4, atol=2e-4)


def test_a_vector_record_of_a_rows_plan_is_four_floats():
  x = T(8, 2048)
  for bad in (Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 256), Opt(OptKind.VECTOR, -1, 8))),
              Plan((Opt(OptKind.GLOBAL, 0), Opt(OptKind.GROUP, 1, 256), Opt(OptKind.VECTOR, -1, 2)))):
    with pytest.raises(InvalidGridPlan, match="floatx4"): lowered(x.sum(1), bad)
