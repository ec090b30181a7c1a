"""The linearize stage's rule sets (rules/linearize.py) on small loop-level kernels built by hand, and its output
contract on every kernel of a representative set (CPU, serial and parallel, and CUDA's grid mapping)."""
import numpy as np
import pytest

from rewrite import UOp, Ops, dtypes, graph_rewrite, stats
from rules.linearize import linearize_rules, open_ranges, start_kernel_block, closed_loops
from rules.pipeline import Run, schedule, lower_kernel
from rules.realize import normalize
from tensor import Tensor


def loop(name: str, size: int, kind: str = "out", n: int = 0) -> UOp:
  return UOp(Ops.RANGE, dtypes.int32, (UOp.const(dtypes.int32, size),), (kind, n, name))


def load(slot: int, idx: UOp) -> UOp:
  g = UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(), (), slot)
  return UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, g.dtype, (g, idx)),))


def store(slot: int, idx: UOp, value: UOp) -> UOp:
  g = UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(), (), slot)
  return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, g.dtype, (g, idx)), value))


def total(value: UOp, *loops: UOp) -> UOp: return UOp(Ops.REDUCE, value.dtype, (value, *loops), Ops.ADD)


def linearize(*stores: UOp) -> list[UOp]:
  out = graph_rewrite(UOp(Ops.SINK, src=stores), linearize_rules, name="linearize")
  assert out.op is Ops.SINK and out.arg == "linear"
  check_contract(out)
  return list(out.src)


def check_contract(linear: UOp):
  """The stage's output contract: each loop RANGE ... END(RANGE); each node after its sources, inside every loop it
  uses, and in no loop inside its innermost one (invariant work hoisted); each REDUCE's DEFINE_ACC before its loops,
  its ASSIGN in its innermost loop, and the REDUCE after them."""
  values = tuple(u for u in linear.src if u.op not in (Ops.END, Ops.DEFINE_ACC, Ops.ASSIGN))
  ranges = open_ranges(UOp(Ops.SINK, src=values))
  done: set[UOp] = set()
  stack: list[UOp] = []
  for u in linear.src:
    if u.op is Ops.RANGE: stack.append(u); continue
    if u.op is Ops.END:
      assert stack and stack.pop() is u.src[0], f"END of {u.src[0].arg} closes another loop"
      continue
    if u.op is Ops.DEFINE_ACC:
      assert not set(u.src[0].src[1:]) & set(stack), "an accumulator is defined inside its own loop"
      done.add(u); continue
    if u.op is Ops.ASSIGN:
      red = u.src[0]
      assert stack and stack[-1] is red.src[-1] and UOp(Ops.DEFINE_ACC, red.dtype, (red,)) in done
      assert red.src[0].op is Ops.CONST or red.src[0] in done
      done.add(u); continue
    for s in (x for x in u.src if x not in closed_loops(u)):   # a REDUCE's loops are closed, a packed buffer's fill's too
      assert s.op in (Ops.CONST, Ops.RANGE) or s in done, f"{u.op} comes before its source {s.op}"
      if s.op is Ops.RANGE: assert s in stack, f"{u.op} uses loop {s.arg} outside it"
    assert ranges[u] <= set(stack), f"{u.op} is outside some loop it uses"
    assert (not stack and not ranges[u]) or stack[-1] in ranges[u], f"{u.op} is not hoisted out of {stack[-1].arg}"
    if u.op is Ops.REDUCE: assert UOp(Ops.ASSIGN, u.dtype, (u,)) in done and not set(u.src[1:]) & set(stack)
    done.add(u)
  assert not stack, "a loop is never closed"


def names(linear: list[UOp]) -> list[str]:
  """The loop structure: 'i{', '}i' for each loop, 'acc', 'update', 'reduce', 'store' and 'load' statements."""
  short = {Ops.DEFINE_ACC: "acc", Ops.ASSIGN: "update", Ops.REDUCE: "reduce", Ops.STORE: "store", Ops.LOAD: "load"}
  out = []
  for u in linear:
    if u.op is Ops.RANGE: out.append(u.arg[2] + "{")
    elif u.op is Ops.END: out.append("}" + u.src[0].arg[2])
    elif u.op in short: out.append(short[u.op])
  return out


def test_a_loop_nest_opens_and_closes_outermost_first():
  i, j = loop("i", 4, n=0), loop("j", 8, n=1)
  lin = linearize(store(0, i * 8 + j, load(1, i * 8 + j) + 1.0))
  assert names(lin) == ["i{", "j{", "load", "store", "}j", "}i"]


def test_loop_invariant_work_is_hoisted_to_the_loops_it_uses():
  i, j = loop("i", 4, n=0), loop("j", 8, n=1)
  a, b = load(1, i), load(2, j)
  lin = linearize(store(0, i * 8 + j, (a * 2.0) * b))
  assert names(lin) == ["i{", "load", "j{", "load", "store", "}j", "}i"]
  assert lin.index(a * 2.0) < lin.index(j)   # a[i] * 2 once per i, not once per (i, j)


def test_a_reduction_accumulates_inside_its_loop_and_is_read_after_it():
  i, k = loop("i", 4), loop("k", 16, "reduce")
  red = total(load(1, i * 16 + k), k)
  lin = linearize(store(0, i, red * 2.0))
  assert names(lin) == ["i{", "acc", "k{", "load", "update", "}k", "reduce", "store", "}i"]
  assert lin.index(red) < lin.index(red * 2.0)


def test_reductions_over_the_same_loop_share_it_behind_their_sources():
  # an unrolled tile: out[i] and out[i + 4] both sum over k; what the second reads is ready before the shared loop
  i, k = loop("i", 4), loop("k", 16, "reduce")
  r0 = total(load(1, i * 16 + k) * load(2, k), k)
  second_row = i + 4                    # computed in loop i, read only by the second reduction
  r1 = total(load(1, second_row * 16 + k) * load(2, k), k)
  lin = linearize(store(0, i, r0), store(0, second_row, r1))
  # each update right after its product (a register tile's products die as they are made)
  assert names(lin) == ["i{", "acc", "acc", "k{", "load", "load", "update", "load", "update", "}k",
                        "reduce", "store", "reduce", "store", "}i"]
  assert lin.index(second_row) < lin.index(k)
  assert lin.count(load(2, k)) == 1      # the shared load is read once per k for both


def test_a_nested_reduction_runs_inside_the_loop_of_the_outer_one():
  # sum_k x[k] * sum_j y[k, j]
  k, j = loop("k", 8, "reduce", 0), loop("j", 5, "reduce", 1)
  inner = total(load(2, k * 5 + j), j)
  outer = total(load(1, k) * inner, k)
  lin = linearize(store(0, UOp.const(dtypes.int32, 0), outer))
  assert names(lin) == ["acc", "k{", "load", "acc", "j{", "load", "update", "}j", "reduce", "update", "}k",
                        "reduce", "store"]


def test_a_reduction_over_two_loops_updates_in_the_inner_one():
  i, k0, k1 = loop("i", 3), loop("k0", 4, "reduce", 0), loop("k1", 5, "reduce", 1)
  red = total(load(1, i * 20 + k0 * 5 + k1), k0, k1)
  lin = linearize(store(0, i, red))
  assert names(lin) == ["i{", "acc", "k0{", "k1{", "load", "update", "}k1", "}k0", "reduce", "store", "}i"]


def test_a_reduction_of_a_value_its_loop_does_not_change_stays_inside_the_outer_loops():
  # sum_k x[i] (a broadcast, reduced): no node uses both i and k, yet k must run inside i, where the REDUCE is
  i, k = loop("i", 8), loop("k", 16, "reduce")
  lin = linearize(store(0, i, total(load(1, i), k)))
  assert names(lin) == ["i{", "load", "acc", "k{", "update", "}k", "reduce", "store", "}i"]


def test_a_node_under_part_of_a_nest_runs_in_the_whole_nest_down_to_its_loop():
  # out[i, j] = sum_k x[i, k] * y[k, j]: x[i, k] does not use j, but there is one loop k, inside j
  i, j, k = loop("i", 4, n=0), loop("j", 6, n=1), loop("k", 8, "reduce")
  lin = linearize(store(0, i * 6 + j, total(load(1, i * 8 + k) * load(2, k * 6 + j), k)))
  assert names(lin) == ["i{", "j{", "acc", "k{", "load", "load", "update", "}k", "reduce", "store", "}j", "}i"]


def test_sibling_loops_come_after_the_statements_they_need_in_nesting_order():
  i, j = loop("i", 4, n=1), loop("j", 6, n=0)
  scale = load(3, UOp.const(dtypes.int32, 0))
  lin = linearize(store(0, i, load(1, i) * scale), store(2, j, load(1, j) + scale))
  assert names(lin) == ["load", "j{", "load", "store", "}j", "i{", "load", "store", "}i"]


def test_start_kernel_block_wraps_statements_in_the_loops_they_run_in():
  i, k = loop("i", 4), loop("k", 16, "reduce")
  x = load(1, i * 16 + k)
  red = total(x, k)
  st = store(0, i, red)
  top = start_kernel_block(UOp(Ops.SINK, src=(st,))).src[0]
  assert top.op is Ops.BLOCK and top.arg == ()
  chain = {u: s.arg if s.op is Ops.BLOCK else () for s in top.src for u in (s.src if s.op is Ops.BLOCK else (s,))}
  update = UOp(Ops.ASSIGN, red.dtype, (red,))
  assert chain[x] == (i, k) and chain[red] == chain[st] == (i,) and chain[x.src[0].src[0]] == ()
  inner = next(s for s in top.src if s.op is Ops.BLOCK and x in s.src)
  assert chain[update] == (i, k) and inner.src.index(update) == inner.src.index(x) + 1   # the update follows its value


# ---- the contract on real kernels ----

rng = np.random.default_rng(0)
def T(*shape): return Tensor(rng.standard_normal(shape).astype(np.float32), device="CPU")


def kernels():
  x, w, img, q = T(33, 45), T(45, 64), T(2, 3, 8, 8), T(2, 20, 16)
  return {
    "elementwise_views": [((x * T(45) + 1).exp() - x).relu(), x.T.flip(0)[3:40:2] * 2, x.pad(((1, 2), (0, 1)))],
    "reductions": [x.sum(1), x.max(0), x.sum(), T(4, 5, 6).sum((0, 2)), x.argmax(1), Tensor.arange(12).reshape(3, 4).sum(1)],
    "softmax_layernorm": [x.softmax(1), x.layernorm(1), x.std(1)],
    "matmul_conv": [x @ w, T(64, 128) @ T(96, 128).T, img.conv2d(T(4, 3, 3, 3), padding=1)],
    "attention": [(q @ q.transpose(-1, -2) / 4).softmax(-1) @ q],
  }


@pytest.mark.parametrize("name", list(kernels()))
@pytest.mark.parametrize("mode", ["parallel", "serial", "gpu"])
def test_every_kernel_meets_the_contract(name, mode):
  outs = kernels()[name]
  run = lambda: Run("CPU", parallel=mode == "parallel", device_loops=mode == "gpu")
  ks, _ = schedule([t.uop for t in outs], ["CPU"] * len(outs), run())
  checked = [check_contract(lower_kernel(normalize(k)[0], run())) for k in ks if k.op is Ops.KERNEL]
  assert checked   # every representative graph has at least one kernel to check


def linear_matmul() -> UOp:
  """x @ W.T through the CPU pipeline: one kernel."""
  kernels, _ = schedule([(T(64, 128) @ T(96, 128).T).uop], ["CPU"], Run("CPU"))
  return lower_kernel(normalize(kernels[0])[0], Run("CPU"))


def test_an_unrolled_tile_shares_one_reduction_loop():
  # x @ W.T on a CPU: the heuristic's register tile (rules/opt) is several accumulators over one loop, each updated
  # right after the product it adds
  linear = linear_matmul()
  accs = [u for u in linear.src if u.op is Ops.DEFINE_ACC]
  reduce_loops = {u.src[0].src[1] for u in accs}
  assert len(accs) >= 4 and len(reduce_loops) == 1
  k = reduce_loops.pop()
  body = linear.src[linear.src.index(k) + 1:linear.src.index(UOp(Ops.END, src=(k,)))]
  updates = [i for i, u in enumerate(body) if u.op is Ops.ASSIGN]
  assert len(updates) == len(accs) and all(body[i - 1] is body[i].src[0].src[0] for i in updates)


def test_a_sum_of_its_own_loop_counter_is_updated():
  # the value added is the loop counter itself, which is no statement: its update goes at the end of the loop
  assert Tensor.arange(100, device="CPU").sum().item() == 4950
  np.testing.assert_array_equal(Tensor.arange(12, device="CPU").reshape(3, 4).sum(1).numpy(), [6, 22, 38])


def test_rewrite_stats_name_each_linearize_rule_that_fires():
  with stats.collect() as s:
    linear_matmul()
  fired = {r.name for r in s.rules.values() if r.stage == "linearize" and r.matches}
  assert fired == {"start_kernel_block", "open_reduction_loop", "nest_loops_after_statements", "flatten_kernel_block"}


def test_the_contract_check_rejects_work_left_in_a_loop_or_before_its_sources():
  i, j = loop("i", 4, n=0), loop("j", 8, n=1)
  a = load(1, i)
  lin = linearize(store(0, i * 8 + j, a * load(2, j)))
  def moved(to: int) -> UOp:
    out = [u for u in lin if u is not a]
    out.insert(to, a)
    return UOp(Ops.SINK, src=tuple(out), arg="linear")
  with pytest.raises(AssertionError, match="not hoisted"): check_contract(moved(lin.index(j)))  # just inside j
  with pytest.raises(AssertionError, match="before its source"): check_contract(moved(lin.index(a.src[0]) - 1))
