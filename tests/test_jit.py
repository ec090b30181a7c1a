"""`jit`: the second call captures the host programs, later calls replay them on the new arguments' memory without
calling the function (no graph is built); other shapes, dtypes or Python values capture apart; misuse is a clear error.
Training steps (updates in place, gradients, optimizers) under jit: tests/test_jit_train.py."""
import numpy as np
import pytest
from tensor import Tensor, jit, JitError
import sys
jit_module = sys.modules["tensor.jit"]   # (the package's name `jit` is the function)
import runtime.realize as rt


def rand(*shape, seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def counted(fn):
  """fn, and a list that grows by one on each call of it."""
  calls = []
  def wrapper(*args, **kwargs):
    calls.append(1)
    return fn(*args, **kwargs)
  return wrapper, calls


def test_the_third_call_replays_without_calling_the_function(monkeypatch):
  w = rand(8, 8)
  weights = Tensor(w)
  fn, calls = counted(lambda x: (x @ weights).relu() + 1)
  f = jit(fn)
  for i in range(2): np.testing.assert_allclose(f(Tensor(rand(4, 8, seed=i))).numpy(), np.maximum(rand(4, 8, seed=i) @ w, 0) + 1, rtol=1e-5)
  assert len(calls) == 2
  monkeypatch.setattr(rt, "_lower", lambda *a, **k: pytest.fail("the compiler ran on a replay"))
  for i in range(2, 5):
    x = rand(4, 8, seed=i)
    np.testing.assert_allclose(f(Tensor(x)).numpy(), np.maximum(x @ w, 0) + 1, rtol=1e-5)
  assert len(calls) == 2   # replays: the function was not called, its graph not built


def test_other_shapes_and_dtypes_capture_apart():
  f = jit(lambda x: x * 2 + 1)
  for _ in range(3):
    for shape, dtype in [((4, 8), np.float32), ((2, 3), np.float32), ((4, 8), np.int32)]:
      x = (rand(*shape) * 10).astype(dtype)
      out = f(Tensor(x)).numpy()
      assert out.shape == shape and out.dtype == dtype
      np.testing.assert_allclose(out, x * 2 + 1)
  assert len(f.captures) == 3


def test_python_values_are_part_of_the_signature():
  f = jit(lambda x, scale, shift=0.0: x * scale + shift)
  x = rand(5)
  for _ in range(3):
    np.testing.assert_allclose(f(Tensor(x), 2.0).numpy(), x * 2, rtol=1e-6)
    np.testing.assert_allclose(f(Tensor(x), 3.0, shift=1.0).numpy(), x * 3 + 1, rtol=1e-6)


def test_the_same_tensor_twice_is_not_two_tensors():
  f = jit(lambda a, b: a - b)
  a, b = rand(6, seed=1), rand(6, seed=2)
  for _ in range(3):
    t = Tensor(a)
    np.testing.assert_allclose(f(t, t).numpy(), np.zeros(6))
    np.testing.assert_allclose(f(Tensor(a), Tensor(b)).numpy(), a - b)


def test_several_results_and_lazy_arguments():
  f = jit(lambda x: (x.sum(), [x + 1][0] * 2))
  for i in range(3):
    x = rand(3, 4, seed=i)
    total, doubled = f(Tensor(x) * 1)   # a lazy argument is realized first
    np.testing.assert_allclose(total.numpy(), x.sum(), rtol=1e-5)
    np.testing.assert_allclose(doubled.numpy(), (x + 1) * 2, rtol=1e-6)


def test_weights_are_bound_at_capture_until_reset():
  box = [Tensor(np.ones(4, np.float32))]
  f = jit(lambda x: x * box[0])
  for _ in range(3): f(Tensor(np.full(4, 2, np.float32)))
  box[0] = Tensor(np.full(4, 5, np.float32))
  np.testing.assert_allclose(f(Tensor(np.full(4, 2, np.float32))).numpy(), np.full(4, 2))   # still the captured one
  f.reset()
  np.testing.assert_allclose(f(Tensor(np.full(4, 2, np.float32))).numpy(), np.full(4, 10))


def test_errors_name_the_problem(monkeypatch):
  f = jit(lambda x: x + 1)
  with pytest.raises(JitError, match="argument of type ndarray cannot be compared"): f(np.ones(3))
  g = jit(lambda x: 3)
  with pytest.raises(JitError, match="must return a Tensor or a tuple or list of Tensors, not int"): g(Tensor(np.ones(3, np.float32)))
  peek = jit(lambda x: x * 2 if x.sum().item() > 0 else x)   # a Python decision on values: no replay could make it
  with pytest.raises(JitError, match=r"reads tensor values into Python \(numpy\(\)"): peek(Tensor(np.ones(3, np.float32)))
  monkeypatch.setattr(jit_module, "MAX_CAPTURES", 2)
  h = jit(lambda x: x + 1)
  for _ in range(3): h(Tensor(np.ones(1, np.float32)))   # captured
  h(Tensor(np.ones(2, np.float32)))                      # recorded
  with pytest.raises(JitError, match="3 different signatures.*at most 2"): h(Tensor(np.ones(3, np.float32)))


def test_updates_in_place_are_replayed_on_every_call():
  total = Tensor(np.zeros(3, np.float32))
  def add(x):
    total.assign(total + x)   # state: written in place by every call, replays included
    return total * 2
  f = jit(add)
  for i in range(1, 6):
    np.testing.assert_allclose(f(Tensor(np.full(3, i, np.float32))).numpy(), np.full(3, 2 * sum(range(1, i + 1))))
  assert len(f.captures) == 1
  np.testing.assert_allclose(total.numpy(), np.full(3, 15))


def test_old_contents_kept_for_a_lazy_reader_outside_the_call_are_not_copied_by_a_replay():
  total, kept = Tensor(np.zeros(3, np.float32)), []
  def f(x):
    kept.append(total * 1)   # a lazy reader of the old contents: the update keeps them aside for it
    total.assign(x * 2)      # (which the value does not read)
    return total + 1
  g = jit(f)
  for i in range(4): np.testing.assert_allclose(g(Tensor(np.full(3, i, np.float32))).numpy(), np.full(3, 2 * i + 1))
  np.testing.assert_allclose(kept[0].numpy(), np.zeros(3))   # the first call's reader saw the old contents
  (cap,) = g.captures.values()
  assert [step[0] for step in cap.steps] == ["unread", "realize", "realize"]   # no copy for a reader the replay has not


def test_a_realized_tensor_the_function_keeps_shows_the_latest_call():
  seen = {}
  def f(x):
    seen["doubled"] = (x * 2).realize()   # kept outside: a plain call would leave this call's value there
    return x + 1
  g = jit(f)
  for i in range(4):
    np.testing.assert_allclose(g(Tensor(np.full(3, i, np.float32))).numpy(), np.full(3, i + 1))
    np.testing.assert_allclose(seen["doubled"].numpy(), np.full(3, 2 * i))


def test_on_a_gpu_replays_run_as_cuda_graphs_on_each_calls_memory(monkeypatch):
  from runtime.replay import GraphReplay, replayer
  from runtime.cuda import CUDAUnavailable
  try: Tensor(np.ones(1, np.float32), device="CUDA").realize()
  except CUDAUnavailable: pytest.skip("no CUDA GPU here")
  w = rand(64, 64)
  weights = Tensor(w, device="CUDA")
  f = jit(lambda x: ((x @ weights).relu() + 1).sum(1) * 2)
  outs = []
  for i in range(6):   # inputs and outputs at new addresses each call: the graph's launches follow them
    x = rand(32, 64, seed=i)
    outs.append(f(Tensor(x, device="CUDA")))
    np.testing.assert_allclose(outs[-1].numpy(), (np.maximum(x @ w, 0) + 1).sum(1) * 2, rtol=1e-4)
  (cap,) = f.captures.values()
  (run,) = [step[1] for step in cap.steps if step[0] == "realize"]   # one program: the result's
  assert isinstance(run.runner, GraphReplay)
  monkeypatch.setenv("GRAFT_CUDA_GRAPH", "0")
  assert replayer(run.program) is run.program   # launch by launch: what graphs save is measured against this


def test_a_program_on_the_cpu_is_its_own_replay():
  from runtime.replay import replayer
  f = jit(lambda x: x * 2 + 1)
  for i in range(3): f(Tensor(rand(4, seed=i), device="CPU"))
  (cap,) = f.captures.values()
  (run,) = [step[1] for step in cap.steps if step[0] == "realize"]
  assert replayer(run.program) is run.program and run.runner is run.program
