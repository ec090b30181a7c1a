"""Warm calls: a graph rebuilt over new input data finds its cached host program (the inputs are its parameters) and
runs it with no rewrite at all; the tables behind that cache stay bounded however many calls come."""
import gc
import numpy as np
import pytest
from tensor import Tensor
from rewrite import uop as uop_module
import importlib
engine = importlib.import_module("rewrite.graph_rewrite")   # the module (the package re-exports its function by the same name)
import runtime.realize as rt
from tensor import assign as registry
from rules import strided_view


def layer(x: Tensor, w: Tensor) -> Tensor: return ((x @ w).relu() + x).sum(axis=1)


@pytest.fixture
def no_rewrite(monkeypatch):
  """Within the block, running the pipeline or any graph_rewrite is an error."""
  class Guard:
    def __enter__(self):
      def refuse(*a, **k): raise AssertionError("the compiler ran on a warm call")
      monkeypatch.setattr(rt, "_lower", refuse)
      monkeypatch.setattr(engine, "_rewrite", refuse)
    def __exit__(self, *exc): monkeypatch.undo()
  return Guard()


def test_a_new_input_of_the_same_kind_runs_the_cached_program_without_rewriting(no_rewrite):
  rng = np.random.default_rng(0)
  w = Tensor(rng.standard_normal((16, 16)).astype(np.float32))
  first = rng.standard_normal((8, 16)).astype(np.float32)
  layer(Tensor(first), w).numpy()
  program = rt.last_program()
  for _ in range(3):
    data = rng.standard_normal((8, 16)).astype(np.float32)
    with no_rewrite: out = layer(Tensor(data), w).numpy()
    assert rt.last_program() is program
    np.testing.assert_allclose(out, (np.maximum(data @ w.numpy(), 0) + data).sum(axis=1), rtol=1e-5, atol=1e-5)


def test_another_shape_dtype_or_view_is_another_program():
  x = Tensor(np.ones((4, 6), np.float32))
  (x * 2).numpy()
  program = rt.last_program()
  (Tensor(np.ones((6, 4), np.float32)) * 2).numpy()
  assert rt.last_program() is not program
  (Tensor(np.ones((4, 6), np.int32)) * 2).numpy()
  assert rt.last_program() is not program
  np.testing.assert_allclose((Tensor(np.arange(24, dtype=np.float32).reshape(6, 4)).T * 2).numpy(),
                             np.arange(24).reshape(6, 4).T * 2)   # the same data size, read through another view


def test_aliasing_is_part_of_the_key():
  # a + a and a + b have one shape; only the second reads two buffers
  a, b = np.arange(6, dtype=np.float32), np.full(6, 10, np.float32)
  np.testing.assert_allclose((Tensor(a) + Tensor(b)).numpy(), a + b)
  t = Tensor(a)
  np.testing.assert_allclose((t + t).numpy(), a + a)
  np.testing.assert_allclose((Tensor(b) + Tensor(a)).numpy(), a + b)
  key_two, params_two = rt.graph_key([(Tensor(a) + Tensor(b)).uop])
  key_one, params_one = rt.graph_key([(t + t).uop])
  assert key_one != key_two and len(params_one) == 1 and len(params_two) == 2


def test_an_assignment_target_is_a_parameter_too(no_rewrite):
  ts = [Tensor(np.full(5, float(i), np.float32)) for i in range(3)]
  ts[0].assign(ts[0] * 2 + 1)
  for i, t in enumerate(ts[1:], 1):
    with no_rewrite: t.assign(t * 2 + 1)
    np.testing.assert_allclose(t.numpy(), np.full(5, 2.0 * i + 1))


def test_the_tables_stay_bounded_over_many_calls_with_new_inputs():
  w = Tensor(np.ones((8, 8), np.float32))
  def call(): layer(Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)), w).numpy()
  for _ in range(5): call()
  gc.collect()
  sizes, nodes = (len(rt._plans), len(rt._kernels), len(rt._by_name)), len(uop_module._cache)
  bases, moves = len(registry._by_base), len(strided_view._moves)
  for _ in range(200): call()
  gc.collect()
  assert (len(rt._plans), len(rt._kernels), len(rt._by_name)) == sizes
  assert len(uop_module._cache) <= nodes   # the interning table holds live nodes only
  # every call's input is a new buffer with views of its own: the registry of views forgets those that are gone
  assert len(registry._by_base) <= max(64, 2 * bases + 8)
  assert len(registry._by_base[id(w.uop.src[0].arg)]) <= 17   # w's views: made and dropped on every call
  assert len(strided_view._moves) == moves   # the same movements on every call


def test_the_plan_table_forgets_its_oldest_entry_past_its_bound(monkeypatch):
  monkeypatch.setattr(rt, "MAX_PLANS", 2)
  monkeypatch.setattr(rt, "_plans", {})
  for n in range(2, 7): (Tensor(np.ones(n, np.float32)) + 1).numpy()
  assert len(rt._plans) == 2


def test_remembered_constants_tell_minus_zero_ints_floats_and_bools_apart():
  # the constants a forward asks for are remembered (tensor/tensor.py const_uop): -0.0 is not 0.0, 1 is not 1.0
  x = Tensor(np.array([1.0, 2.0], np.float32))
  for _ in range(2):
    assert not np.signbit((x * 0.0).numpy()).any() and np.signbit((x * -0.0).numpy()).all()
    i = Tensor(np.array([3, 4], np.int32))
    assert (i * 1).dtype.name == "int32" and (i * 1.0).dtype.name == "float32" and (i * True).dtype.name == "int32"
    np.testing.assert_array_equal(Tensor.full((2,), True).numpy(), [True, True])
    np.testing.assert_array_equal(Tensor.full((2,), 1).numpy(), [1, 1])


def test_a_composite_is_keyed_by_its_record_and_the_first_call_shares_the_replays_key(no_rewrite):
  # layernorm's record names its result node: the key holds that and its input, not the nodes between
  rng = np.random.default_rng(1)
  fresh = lambda: Tensor(rng.standard_normal((5, 7)).astype(np.float32))
  x = fresh()
  first = x.layernorm(1, eps=1e-4)   # (an eps no other test records: this call records)
  key, params = rt.graph_key([first.uop])
  assert [p[0] for p in key[0]] == ["param", "composite"] and params == [x.uop.src[0]]
  first.numpy()
  for _ in range(2):
    y = fresh()
    out = y.layernorm(1, eps=1e-4)
    assert rt.graph_key([out.uop])[0] == key   # a replay over a new input: the first call's program
    with no_rewrite: got = out.numpy()
    want = y.numpy() - y.numpy().mean(1, keepdims=True)
    np.testing.assert_allclose(got, want / np.sqrt((want ** 2).mean(1, keepdims=True) + 1e-4), rtol=1e-4, atol=1e-5)


def test_a_composite_over_another_kind_of_input_or_inside_a_graph_is_another_key():
  a = Tensor(np.ones((4, 6), np.float32))
  key = rt.graph_key([a.softmax(1).uop])[0]
  assert rt.graph_key([Tensor(np.ones((6, 4), np.float32)).softmax(1).uop])[0] != key
  assert rt.graph_key([(a * 2).softmax(1).uop])[0] != key            # a lazy input: its own nodes are walked
  assert rt.graph_key([(a.softmax(1) + a).uop])[0] != key
  b = Tensor(np.ones((4, 6), np.float32))
  two, params = rt.graph_key([(a.softmax(1) + b.softmax(1)).uop])
  one, param = rt.graph_key([(a.softmax(1) + a.softmax(1)).uop])
  assert two != one and len(params) == 2 and len(param) == 1       # aliasing counts through composites too
  np.testing.assert_allclose((a.softmax(1) + b.softmax(1)).numpy(), np.full((4, 6), 2 / 6), rtol=1e-6)


def test_a_composite_inside_anothers_first_call_leaves_that_call_the_program_of_the_later_ones():
  # logsumexp's first call calls max and sum, which are composites too; its gradient reads the nodes inside, so they
  # must be the nodes its replays build (unmarked), or the first call would compile a program of its own
  rng = np.random.default_rng(3)
  programs = []
  for _ in range(3):
    x = Tensor(rng.standard_normal((7, 13)).astype(np.float32), requires_grad=True)   # (a shape no other test uses)
    x.logsumexp(1).sum().backward()
    grad = x.grad.numpy()
    programs.append(rt.last_program())
    e = np.exp(x.numpy() - x.numpy().max(1, keepdims=True))
    np.testing.assert_allclose(grad, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
  assert programs[0] is programs[1] is programs[2]
