"""The host program (rules/host.py, runtime/program.py): its listing, its replay on warm calls, and memory planning."""
import numpy as np
import pytest
from tensor import Tensor
from runtime.realize import last_program

rng = np.random.default_rng(0)


def arr(*shape): return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(autouse=True)
def generated_code_only(monkeypatch): monkeypatch.setenv("GRAFT_EXTERN", "0")  # listings without library calls


def test_listing_of_two_kernels_names_buffers_sizes_and_steps():
  x, y = Tensor(arr(8, 4)), Tensor(arr(8, 4))
  out = ((x + y).contiguous() * 2).sum(axis=1)
  np.testing.assert_allclose(out.numpy(), ((x.numpy() + y.numpy()) * 2).sum(1), rtol=1e-5)
  p = last_program()
  first, second = (ck.name for ck in p.kernels_called())
  assert str(p) == f"""host program: 4 steps, 2 calls; intermediates peak 128 B (unplanned 128 B)
  buffers: out0 float32[8], in0 float32[32], in1 float32[32]
  alloc  t0 float32[32] 128 B in storage s0
  call   {first}  t0 <- in0, in1
  call   {second}  out0 <- t0
  free   t0 (storage s0 back to {x.device})"""


def test_consecutive_cpu_kernels_run_in_one_parallel_region():
  # a 3-layer mlp: its threads wake once per call, not once per kernel (renderers/c.py, runtime/cpu.py run_team); the
  # intermediates' allocs move before the team and their frees after it
  x, ws = arr(64, 128), [arr(128, 128) / 12 for _ in range(3)]
  out = Tensor(x, device="CPU")   # (OpenMP threads: the CPU's, whatever device DEVICE names)
  for w in ws: out = (out @ Tensor(w, device="CPU")).relu()
  ref = x
  for w in ws: ref = np.maximum(ref @ w, 0)
  np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
  p = last_program()
  assert [s[0] for s in p.run_steps] == ["alloc", "alloc", "team", "free", "free"]
  assert [ck.name for ck, _ in p.run_steps[2][2]] == [ck.name for ck in p.kernels_called()]
  assert "team" not in str(p)   # the listing is the plan's, a step per kernel


def test_a_single_kernel_needs_no_allocation():
  x = Tensor(arr(3, 5))
  (x * 3).realize()
  p = last_program()
  assert str(p).splitlines()[2:] == [f"  call   {p.kernels_called()[0].name}  out0 <- in0"]
  assert p.peak_bytes == p.unplanned_bytes == 0


def test_warm_call_replays_the_stored_program():
  x = Tensor(arr(16, 16))
  def step(): return ((x * 2).contiguous() + 1).numpy()
  a = step()
  first = last_program()
  b = step()
  assert last_program() is first      # the graph was not walked through the pipeline again
  np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(b, x.numpy() * 2 + 1)


MLP_BATCH, MLP_WIDTH = 32, 64


def mlp_forward(layers: int) -> Tensor:
  h = Tensor(arr(MLP_BATCH, MLP_WIDTH))
  for i in range(layers):
    h = (h @ Tensor(arr(MLP_WIDTH, MLP_WIDTH) * 0.1)).relu().contiguous()
  return h


def test_eight_layer_mlp_peaks_at_two_activations_not_seven():
  h = mlp_forward(8)
  h.realize()
  p = last_program()
  activation = MLP_BATCH * MLP_WIDTH * 4
  assert p.unplanned_bytes == 7 * activation   # 7 intermediates (the 8th is the output)
  assert p.peak_bytes == 2 * activation        # a layer reads one and writes the next
  assert str(p).count("(reused)") == 5


def test_planning_never_changes_a_result():
  # the same MLP by numpy, layer by layer
  r = np.random.default_rng(1)
  x, ws = r.standard_normal((8, 16)).astype(np.float32), [r.standard_normal((16, 16)).astype(np.float32) for _ in range(6)]
  h, ref = Tensor(x), x
  for w in ws: h, ref = (h @ Tensor(w)).relu().contiguous(), np.maximum(ref @ w, 0)
  np.testing.assert_allclose(h.numpy(), ref, rtol=1e-4, atol=1e-5)


def check_no_live_buffers_share_storage(p) -> None:
  live: dict[int, int] = {}   # storage -> the buffer living in it
  owner: dict[int, int] = {}  # buffer -> its storage
  for step in p.steps:
    if step[0] == "alloc":
      _, buf, storage, *_ = step
      assert storage not in live, f"{p.names[buf]} takes storage s{storage} while {p.names[live[storage]]} lives in it"
      live[storage], owner[buf] = buf, storage
    elif step[0] == "free": del live[owner[step[1]]]
  assert not live


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_agree_with_numpy_and_never_overlap_live_buffers(seed):
  """Random graphs of elementwise ops, reductions and contiguous() over a few shapes: the planner shares storage
  between buffers of disjoint lifetimes only, and the result is numpy's."""
  r = np.random.default_rng(seed)
  shapes = [(6, 10), (10, 6)]
  values = [(Tensor(a), a) for a in (r.standard_normal(shapes[0]).astype(np.float32),)]
  for _ in range(r.integers(4, 12)):
    t, a = values[r.integers(len(values))]
    kind = r.integers(5)
    if kind == 0: t, a = (t * 1.5 + 0.25), a * np.float32(1.5) + np.float32(0.25)
    elif kind == 1: t, a = t.T, a.T
    elif kind == 2:
      u, b = values[r.integers(len(values))]
      if u.shape == t.shape: t, a = t + u, a + b
      else: t, a = t + u.T, a + b.T
    elif kind == 3: t, a = (t - t.max(axis=1, keepdim=True)), a - a.max(axis=1, keepdims=True)
    else: t, a = t.relu(), np.maximum(a, 0)
    if r.integers(2): t = t.contiguous()
    values.append((t, a))
  outs = [values[-1], values[r.integers(1, len(values))]]
  Tensor.realize_all(*(t for t, _ in outs))
  p = last_program()
  check_no_live_buffers_share_storage(p)
  assert p.peak_bytes <= p.unplanned_bytes
  for t, a in outs: np.testing.assert_allclose(t.numpy(), a, rtol=1e-5, atol=1e-5)


def test_the_readme_shows_the_mlp_examples_host_program(monkeypatch, on_cpu):  # the README shows a CPU run
  import pathlib, re
  from runtime.realize import plan
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
  from mlp import mlp
  r = np.random.default_rng(0)
  x = Tensor(r.standard_normal((256, 1024), dtype=np.float32))
  layers = [(Tensor(r.standard_normal((1024, 1024), dtype=np.float32)), Tensor(r.standard_normal(1024, dtype=np.float32)))
            for _ in range(3)]
  out = mlp(x, layers)
  listing = str(plan([(out.uop, out.device)])).splitlines()
  readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
  shown = re.search(r"```\n(host program: .*?)```", readme, re.S).group(1).splitlines()
  def steps(lines): return [re.sub(r"_[0-9a-f]{8}\b", "_<hash>", ln) for ln in lines if "buffers:" not in ln]  # no hashes
  assert steps(shown) == steps(listing)


def test_debug_2_prints_the_host_program(monkeypatch, capsys):
  monkeypatch.setenv("DEBUG", "2")
  x = Tensor(arr(4, 4))
  ((x + 1).contiguous() * 2).realize()
  out = capsys.readouterr().out
  assert str(last_program()) in out and "alloc  t0 float32[16] 64 B in storage s0" in out



def test_memory_is_planned_in_program_order_whatever_order_the_step_rules_fire_in():
  # the memory stage's rule on each step plans it against the free list in the context; a step met before the steps
  # ahead of it has them planned first, so rules fired last step first make the same program
  from rewrite import UOp, Ops, graph_rewrite
  from rules.pipeline import schedule, Run
  from rules.host import HostContext, host_rules, index_lifetimes, plan_memory_of_step, place_allocs_and_frees
  out = mlp_forward(5)
  kernels, realized = schedule([out.uop], ["CPU"], Run("CPU"))
  def planned(order):
    ctx = HostContext(frozenset({realized[0].src[0]}))
    steps = graph_rewrite(UOp(Ops.SINK, src=tuple(kernels), arg="steps"), host_rules, ctx, name="host")
    index_lifetimes(ctx, steps)
    for step in order(steps.src): plan_memory_of_step(ctx, step)
    return place_allocs_and_frees(ctx, steps)
  forward = planned(list)
  assert planned(lambda steps: steps[::-1]) is forward
  allocs = [s.arg for s in forward.src if s.op is Ops.ALLOC]
  assert len(allocs) == 4 and len(set(allocs)) == 2   # four intermediates in two storages


def test_a_step_memory_planning_does_not_know_is_named():
  from rewrite import UOp, Ops
  from rules.host import HostContext, index_lifetimes
  call = UOp(Ops.CALL, src=(), arg=UOp(Ops.SINK))
  program = UOp(Ops.SINK, src=(UOp(Ops.NOOP), call), arg="steps")   # a known step after it changes nothing
  with pytest.raises(ValueError, match="step Ops.NOOP is not a CALL, EXTERN, PICK or COPY"): index_lifetimes(HostContext(frozenset()), program)


def test_a_cpu_product_whose_packed_panel_would_not_stay_in_cache_is_offered_split_over_k(monkeypatch):
  from rules.opt.heuristic import PANEL_BYTES, vector_width
  k = 2 * PANEL_BYTES // (vector_width(4) * 4)   # twice the longest k whose panel of B stays in cache
  x, h, w = (Tensor(arr(*s), device="CPU") for s in ((16, 64), (16, k), (k, 64)))
  want = x.numpy() + h.numpy() @ w.numpy()
  np.testing.assert_allclose((x + h @ w).numpy(), want, rtol=1e-4, atol=1e-3)
  assert "pick" in str(last_program()) and "split_reduce(2, 2)" in str(last_program())   # timed on first use
  monkeypatch.setenv("GRAFT_SPLIT_REDUCE", "1")
  np.testing.assert_allclose((x + h @ w).numpy(), want, rtol=1e-4, atol=1e-3)
  assert len(last_program().kernels_called()) == 2   # the partials of the two halves of k, then their sum plus x
  monkeypatch.setenv("GRAFT_SPLIT_REDUCE", "0")
  np.testing.assert_allclose((x + h @ w).numpy(), want, rtol=1e-4, atol=1e-3)
  assert len(last_program().kernels_called()) == 1
  x_small = Tensor(arr(16, k // 2), device="CPU") @ Tensor(arr(k // 2, 64), device="CPU")   # its panel fits: one kernel
  monkeypatch.delenv("GRAFT_SPLIT_REDUCE")
  x_small.realize()
  assert "pick" not in str(last_program())
