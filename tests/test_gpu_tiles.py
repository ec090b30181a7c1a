"""A product on a GPU: the tile plan (rules/opt/gpu_tile.py) in the one optimization vocabulary — blocks and lanes
(global, local), a register tile (upcast), a slice of the reduction (split) staged in shared memory (pack) — checked
without a GPU: the numbers in the numpy model of a grid (tests/test_gpu_stages.py), the structure of the CUDA source
(tiles, barriers, the fused epilogue), and random valid tile plans on random small products (fuzz)."""
import re
import numpy as np
import pytest

from rules.opt import Opt, OptKind, Plan, OptContext, InvalidPlan
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize
from rewrite import Ops
from tensor import Tensor
from test_gpu_stages import run_grid, run_on_model_gpu, T, gpu

rng = np.random.default_rng(7)


def plan_and_source(t: Tensor) -> tuple[str, str]:
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  run = Run("CPU", parallel=False, device_loops=True, opt=gpu())
  lower_kernel(normalize(kernels[-1])[0], run)
  return str(run.opt.plan), t.kernel_sources(device="CUDA")[-1]


def test_a_product_gets_a_tile_plan_in_the_cpu_vocabulary():
  plan, _ = plan_and_source(T(4096, 64) @ T(64, 4096))
  # rows: 8 registers x 16 lanes, blocks grouped by 8; columns: 4 + 4 registers around 16 lanes; k: slices of 16, staged
  assert plan == ("upcast(0, 8) local(0, 16) global(0, 8) upcast(1, 4) local(1, 16) upcast(1, 2) global(1) "
                  "split(2, 16) pack(2) [heuristic]")
  # slices of 8 where 16 does not divide k
  assert "split(2, 8) pack(2)" in plan_and_source(T(4096, 72) @ T(72, 4096))[0]
  # fewer blocks of that tile than 6 a multiprocessor (256 here): 64 x 128 of 8 x 8 registers, 128 lanes
  assert plan_and_source(T(2048, 64) @ T(64, 2048))[0] == ("upcast(0, 8) local(0, 8) global(0, 8) upcast(1, 4) local(1, 16) "
                                                          "upcast(1, 2) global(1) split(2, 16) pack(2) [heuristic]")
  # small products take smaller tiles, so their blocks still fill the multiprocessors
  assert plan_and_source(T(256, 128) @ T(128, 256))[0].startswith("upcast(0, 2) local(0, 16)")


def plan_of(k) -> str:
  run = Run("CPU", parallel=False, device_loops=True, opt=gpu())
  lower_kernel(normalize(k)[0], run)
  return str(run.opt.plan)


def test_the_gpt_forwards_products_fill_the_gpu_split_where_their_tiles_are_few():
  # examples/gpt.py at 1024 tokens, width 768 (bench/gpu_tiles.py --gpt measures these kernels on an H100): a product
  # takes 64 x 128 tiles of 8 x 8 registers (128 lanes) where they occupy the multiprocessors (132 here); where they
  # would leave some idle, the host stage offers its reduction split into parts, each a product of the batch of parts
  # (the 8 x 8 tile again), beside the one kernel in smaller tiles
  from rules.split import split_reduction_plan, split_reduction, SplitReduce
  x, h = T(1024, 768), T(1024, 3072)
  wide = "upcast(0, 8) local(0, 8) global(0, 8) upcast(1, 4) local(1, 16) upcast(1, 2) global(1) split(2, 16) pack(2)"
  small = "upcast(0, 4) local(0, 16) global(0, 8) upcast(1, 2) local(1, 16) upcast(1, 2) global(1) split(2, 16) pack(2)"
  cases = [(x @ T(768, 2304) + T(2304), wide, None),            # qkv: 288 blocks
           ((x @ T(768, 3072) + T(3072)).gelu(), wide, None),   # fc: 384 blocks
           (x + (x @ T(768, 768) + T(768)), small, 4),          # attention's projection and its residual: 96 blocks
           (x + (h @ T(3072, 768) + T(768)), small, 4)]         # the MLP's output, k 3072: 4 parts of 768
  for t, plan, parts in cases:
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    assert plan_of(kernels[-1]) == plan + " [heuristic]"
    opt = split_reduction_plan(kernels[-1])
    assert opt == (None if parts is None else SplitReduce(2, parts))
    if opt is None: continue
    partials, combine, _ = split_reduction(kernels[-1], opt)
    # the partials: the 8 x 8 tile over the product's loops, the parts a batch on blocks; the combine adds them up
    # and applies the epilogue (bias, residual) with a thread per output
    assert plan_of(partials) == ("upcast(1, 8) local(1, 8) global(1, 8) upcast(2, 4) local(2, 16) upcast(2, 2) global(2) "
                                 "global(0) split(3, 16) pack(3) [heuristic]")
    assert "group(" not in plan_of(combine) and "split(" not in plan_of(combine)
  # 1024^3: 128 blocks of 64 x 128 on 132 multiprocessors, one kernel
  kernels, _ = schedule([(T(1024, 1024) @ T(1024, 1024)).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  assert plan_of(kernels[-1]) == wide + " [heuristic]" and split_reduction_plan(kernels[-1]) is None


def test_the_host_program_offers_a_product_split_beside_the_one_kernel():
  from runtime.realize import plan
  x = T(1024, 768)
  listing = str(plan([((x + (x @ T(768, 768) + T(768))).uop, "CPU")], device="CUDA"))
  assert "pick   r_1024_768_" in listing and "or split_reduce(2, 4): r_4_1024_768_" in listing


@pytest.mark.parametrize("case", ["epilogue", "prologue", "batched", "transposed"])
def test_a_split_product_gives_numpys_values_in_the_model_grid(case):
  from test_gpu_stages import host_steps
  a, b, bias = T(64, 512), T(512, 128), T(128)
  an, bn = a.numpy(), b.numpy()
  if case == "epilogue": t, want = (a @ b + bias).relu() + 1, np.maximum(an @ bn + bias.numpy(), 0) + 1
  elif case == "prologue": t, want = (a * 2 + 1) @ b, (an * 2 + 1) @ bn
  elif case == "batched":
    q, k = T(2, 64, 256), T(2, 256, 128)
    t, want = q @ k, q.numpy() @ k.numpy()
  else:
    w = T(128, 512)
    t, want = a @ w.T, an @ w.numpy().T
  calls = {split: sum(s.op is Ops.CALL for s in host_steps([t], split=split)[0]) for split in ("on", "off")}
  assert calls["on"] == calls["off"] + 1   # the product's kernel became the partials and their combine
  for split in ("on", "off"):
    np.testing.assert_allclose(run_on_model_gpu(t, split=split)[0], want, rtol=2e-4, atol=2e-4)


def test_the_tile_kernel_stages_operands_in_shared_memory_between_barriers():
  x, w, b = T(2048, 64), T(64, 2048), T(2048)
  _, src = plan_and_source(((x @ w) + b).gelu())
  assert src.count("__shared__ __align__(16) float") == 2          # a tile of each operand
  assert src.count("(__syncthreads(), local") >= 1                 # the reads wait for the fill
  loop = src[src.index("for (int ridx"):]
  assert "__syncthreads();\n" in loop                              # and the next fill waits for the reads
  assert "#pragma unroll" in loop                                  # the slice's steps read shared tiles into registers
  # double buffering in registers: slice 0's share of each tile is loaded before the loop; each trip stores what it
  # holds, then issues the next slice's loads, which are in flight while the block waits and multiplies
  before = src[:src.index("for (int ridx")]
  assert "(data1+" in before and "(data2+" in before
  trip = loop[:loop.index("(__syncthreads(), local")]
  assert trip.index("*(local") < trip.index("(data1+") and trip.index("*(local") < trip.index("(data2+")
  # each lane reads 16 bytes of an operand at once (x's rows and w's rows are 64 floats: every vector is aligned)
  assert "(*(floatx4*)(data1+" in src and "(*(floatx4*)(data2+" in src
  # w's 4 columns sit side by side in its tile too: one 16-byte store; x's tile is stored along k: 4 stores
  assert "*(floatx4*)(local" in src and re.search(r"\*\(local\d+\+v\d+\) = v\d+;", src)
  # two blocks a multiprocessor: one computes while the other waits at a barrier
  assert re.search(r"__launch_bounds__\(\d+, 2\)", src)
  assert len(re.findall(r"acc\d+ = 0\.0f;", src)) == 64           # an 8 x 8 register tile per lane
  # the epilogue (bias, GELU's tanh through exp2) is in the same kernel, applied to each register before its store
  assert "exp2f" in src and src.count("*(data0+") == 64


@pytest.mark.parametrize("case", ["plain", "epilogue", "transposed", "batched", "prologue"])
def test_tiled_products_give_numpys_values_in_the_model_grid(case):
  a, b, bias = T(128, 64), T(64, 256), T(256)
  an, bn, biasn = a.numpy(), b.numpy(), bias.numpy()
  if case == "plain": t, want = a @ b, an @ bn
  elif case == "epilogue": t, want = ((a @ b) + bias).relu() * 0.5, np.maximum(an @ bn + biasn, 0) * 0.5
  elif case == "transposed":
    w = T(256, 64)
    t, want = a @ w.T, an @ w.numpy().T
  elif case == "batched":
    q, k = T(2, 128, 32), T(2, 32, 64)
    t, want = q @ k, q.numpy() @ k.numpy()
  else:
    g = T(64)
    norm = (an - an.mean(1, keepdims=True)) / np.sqrt(an.var(1, keepdims=True) + 1e-5)
    t, want = (a.layernorm(1) * g) @ b + bias, (norm * g.numpy()) @ bn + biasn
  assert plan_and_source(t)[0].count("local(") == 2
  np.testing.assert_allclose(run_on_model_gpu(t)[0], want, rtol=2e-4, atol=2e-4)


def test_a_prologue_is_computed_as_its_tile_is_staged_not_per_use():
  # layer norm's normalize-and-scale read by a product: computed once per element while the shared tile is filled,
  # the slice's loop only multiplies and adds what the tiles hold
  x, w, g = T(2048, 64), T(64, 2048), T(64)
  plan, src = plan_and_source((x.layernorm(1) * g) @ w)
  assert "pack(2)" in plan
  fill, steps = src[src.index("for (int ridx"):src.index("#pragma unroll")], src[src.index("#pragma unroll"):]
  steps = steps[:steps.index("__syncthreads();")]
  # a lane stores 8 elements of x's normalized tile one by one, and 16 of w's as 4 vectors; then one wait
  assert fill.count("*(local") == 8 and fill.count("*(floatx4*)(local") == 4 and fill.count("(__syncthreads(), local") == 1
  values = re.findall(r"float v\d+ = (.*);", steps)   # loads from the shared tiles, and their products
  assert values and all(v.startswith("(*(v") or re.fullmatch(r"\(v\d+\*v\d+\)", v) for v in values) and "data" not in steps


def tile_plans(m: int, n: int, k: int, count: int) -> list[Plan]:
  """Random valid tile plans of an m x n x k product (loops 0, 1, 2)."""
  def pick(choices): return int(rng.choice(choices))
  plans = []
  while len(plans) < count:
    tm, lm = pick([1, 2, 4]), pick([2, 4, 8])
    tn, ln = pick([1, 2, 4]), pick([4, 8, 16])
    if m % (tm * lm) or n % (tn * ln) or lm * ln > 256: continue
    slice_ = pick([2, 4, 8])
    opts = ([Opt(OptKind.UPCAST, 0, tm)] if tm > 1 else []) + [Opt(OptKind.LOCAL, 0, lm), Opt(OptKind.GLOBAL, 0, pick([0, 2]))]
    opts += ([Opt(OptKind.UPCAST, 1, tn)] if tn > 1 else []) + [Opt(OptKind.LOCAL, 1, ln), Opt(OptKind.GLOBAL, 1)]
    opts += [Opt(OptKind.SPLIT, 2, slice_)] + ([Opt(OptKind.PACK, 2)] if rng.random() < 0.8 else [])
    plans.append(Plan(tuple(opts), "given"))
  return plans


@pytest.mark.parametrize("seed", range(6))
def test_random_tile_plans_on_random_products_match_numpy(seed):
  global rng
  rng = np.random.default_rng(seed)
  m, n, k = (int(rng.choice([16, 32, 64])) for _ in range(3))
  a, b, c = T(m, k), T(k, n), T(n)
  t = ((a @ b) * c + 1) if seed % 2 else a @ b
  want = (a.numpy() @ b.numpy()) * c.numpy() + 1 if seed % 2 else a.numpy() @ b.numpy()
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  norm, bufs = normalize(kernels[-1])
  for plan in tile_plans(m, n, k, 3):
    linear = lower_kernel(norm, Run("CPU", parallel=False, device_loops=True, opt=gpu(choose=lambda s, a, p=plan: p)))
    memory = {i: (np.zeros(u.arg.size, np.float32) if i == 0 else u.arg.numpy().copy()) for i, u in enumerate(bufs)}
    run_grid(linear, memory)
    np.testing.assert_allclose(memory[0].reshape(m, n), want, rtol=2e-4, atol=2e-4, err_msg=str(plan))


def test_a_tile_plan_that_does_not_fit_is_refused():
  kernels, _ = schedule([(T(64, 32) @ T(32, 64)).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  norm, _ = normalize(kernels[-1])
  bad = [Plan((Opt(OptKind.LOCAL, 0, 48), Opt(OptKind.GLOBAL, 0), Opt(OptKind.GLOBAL, 1), Opt(OptKind.SPLIT, 2, 8))),   # 48 does not divide 64
         Plan((Opt(OptKind.LOCAL, 0, 64), Opt(OptKind.LOCAL, 1, 32), Opt(OptKind.GLOBAL, 0), Opt(OptKind.GLOBAL, 1), Opt(OptKind.SPLIT, 2, 8))),
         Plan((Opt(OptKind.LOCAL, 2, 4), Opt(OptKind.GLOBAL, 0), Opt(OptKind.GLOBAL, 1), Opt(OptKind.SPLIT, 2, 8)))]
  for plan, why in zip(bad, ("does not divide", "more than a block", "reduction loop")):
    with pytest.raises(InvalidPlan, match=why):
      lower_kernel(norm, Run("CPU", parallel=False, device_loops=True, opt=gpu(choose=lambda s, a, p=plan: p)))


def test_the_search_offers_valid_gpu_plans_around_the_heuristics():
  # GRAFT_SEARCH on a GPU times plans one change away from the heuristic's: other tiles, lanes, slices, groups
  from runtime.search import gpu_neighbours
  from rules.opt import check_plan
  from rules.opt.plan import kernel_axes
  for t in (T(2048, 64) @ T(64, 2048), T(64, 2048).softmax(1), T(300, 7) + 1):
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    run = Run("CPU", parallel=False, device_loops=True, opt=gpu())
    norm, _ = normalize(kernels[-1])
    lower_kernel(norm, run)
    axes = sorted(run.opt.axis_of, key=run.opt.axis_of.get)
    valid = []
    for p in gpu_neighbours(run.opt.plan, [r.src[0].arg for r in axes], [r.arg[0] for r in axes]):
      try: check_plan(p, axes, device_loops=True)
      except InvalidPlan: continue
      valid.append(p)
    assert len(valid) >= 3, (t.shape, run.opt.plan)
    # a rows plan with lanes per row is offered with runs of 4 floats too (or without, where it has them)
    if t.shape == (64, 2048): assert any(Opt(OptKind.VECTOR, -1, 4) in p.opts for p in valid)
    # and each lowers to a kernel whose launch fits a block
    for p in valid[:3]:
      lower_kernel(norm, Run("CPU", parallel=False, device_loops=True, opt=gpu(choose=lambda s, a, p=p: p)))


def test_a_tile_is_filled_16_bytes_at_a_time_only_where_every_vector_is_aligned():
  # rows of 64 floats: each lane reads 4 of x's (along k) and 4 of w's (along j) at once; a view one float into rows
  # of 65 reads x element by element, and w still by 4
  from test_gpu_stages import host_steps
  w = T(64, 256)
  def vector_loads(t) -> dict[int, int]:
    (*_, call), _ = host_steps([t], multiprocessors=1)   # one multiprocessor: the 64 x 128 tile of 8 x 8 registers
    linear = lower_kernel(call.arg, Run("CPU", parallel=False, device_loops=True, multiprocessors=1))
    loads = [u for u in linear.src if u.op is Ops.LOAD and u.src[0].src[0].op is Ops.DEFINE_GLOBAL]
    return {g: sum(u.dtype.count == 4 for u in loads if u.src[0].src[0].arg == g) for g in (1, 2)}
  # a lane fills 8 of x's 64 x 16 and 16 of w's 16 x 128 a slice: 2 and 4 vectors, before the loop and in it
  for x, want in ((T(128, 64), {1: 4, 2: 8}), (T(128, 65)[:, 1:], {1: 0, 2: 8})):
    assert vector_loads(x @ w) == want
    xn = x.numpy()
    np.testing.assert_allclose(run_on_model_gpu(x @ w, multiprocessors=1)[0], xn @ w.numpy(), rtol=2e-4, atol=2e-4)
