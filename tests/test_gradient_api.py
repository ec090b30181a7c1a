"""The gradient API of tensors (tensor/autograd.py): requires_grad, backward, .grad, gradient, detach, no_grad."""
import subprocess, sys, os
import numpy as np
import pytest
import rewrite
from tensor import Tensor, no_grad
from tests.helpers import python_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _param(values):
  return Tensor(np.asarray(values, dtype=np.float32), requires_grad=True)


def test_backward_fills_grad_and_accumulates_until_zeroed():
  w = _param([1.0, 2.0, 3.0])
  (w * w).sum().backward()
  assert w.grad.tolist() == [2.0, 4.0, 6.0]
  (w * 3).sum().backward()
  assert w.grad.tolist() == [5.0, 7.0, 9.0]
  w.grad = None
  w.sum().backward()
  assert w.grad.tolist() == [1.0, 1.0, 1.0]


def test_gradients_are_lazy_graphs_until_asked_for():
  w = _param(np.arange(6.0).reshape(2, 3))
  loss = (w.exp() * w.T.reshape(2, 3)).sum()
  loss.backward()
  assert not w.grad.is_realized and not loss.is_realized   # (an optimizer's step realizes both with its updates)
  # d/dw sum(exp(w) * P(w)) = exp(w) * P(w) + P^T(exp(w)), P = transpose-then-reshape (a permutation)
  x = np.arange(6.0)
  perm = x.reshape(2, 3).T.reshape(-1).astype(int)
  want = np.exp(x) * x[perm]
  np.add.at(want, perm, np.exp(x))
  np.testing.assert_allclose(w.grad.numpy().reshape(-1), want, rtol=1e-5)


def test_gradient_returns_gradients_without_touching_grad():
  a, b = _param([1.0, 2.0]), _param([3.0, 4.0])
  h = a * b
  ga, gh = (h * h).sum().gradient(a, h)
  assert ga.tolist() == [18.0, 64.0] and gh.tolist() == [6.0, 16.0]   # an intermediate tensor is a target too
  assert a.grad is None and b.grad is None
  (unused,) = a.sum().gradient(b)
  assert unused.tolist() == [0.0, 0.0]


def test_a_gradient_seeds_a_non_scalar_backward():
  a = _param([1.0, 2.0])
  (a * a).backward(gradient=Tensor(np.array([1.0, 10.0], np.float32)))
  assert a.grad.tolist() == [2.0, 40.0]


def test_detach_stops_the_gradient_and_keeps_the_value():
  a = _param([1.0, 2.0])
  d = a.detach()
  (a * d).sum().backward()
  assert a.grad.tolist() == [1.0, 2.0]
  assert d.tolist() == [1.0, 2.0]


def test_no_grad_detaches_what_is_made_inside_and_refuses_backward():
  a = _param([1.0, 2.0])
  with no_grad():
    b = a * 2
    with pytest.raises(RuntimeError, match="no_grad"): (a * a).sum().backward()
  assert b.tolist() == [2.0, 4.0]
  (a * b).sum().backward()
  assert a.grad.tolist() == [2.0, 4.0]  # b is a constant here: only a's own factor counts

  @no_grad()
  def doubled(x): return x * 2
  assert doubled(a).uop.op is rewrite.Ops.DETACH


def test_a_gradient_through_a_view_of_a_parameter_reaches_the_parameter():
  w = _param(np.arange(12.0).reshape(3, 4))
  (w[1:, ::2] * 10).sum().backward()   # a view of w's memory: the gradient lands in w, zeros elsewhere
  want = np.zeros((3, 4)); want[1:, ::2] = 10
  np.testing.assert_allclose(w.grad.numpy(), want)


def test_clear_errors():
  w = _param([1.0, 2.0])
  with pytest.raises(ValueError, match="only a tensor of one element"): (w * 2).backward()
  with pytest.raises(RuntimeError, match="depends on no tensor with requires_grad"): Tensor(np.ones(2, np.float32)).sum().backward()
  with pytest.raises(TypeError, match="floating-point"): Tensor(np.ones(2, np.int32), requires_grad=True)
  with pytest.raises(TypeError, match="floats only"): w.sum().gradient(Tensor(np.ones(2, np.int32)))
  with pytest.raises(ValueError, match="gradient of shape"): (w * 2).backward(gradient=Tensor(np.ones(3, np.float32)))


def test_the_gradient_stage_is_in_the_pipeline_and_in_the_statistics():
  out = subprocess.run([sys.executable, "-m", "rules"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": python_path(ROOT)}, timeout=120)
  assert any(line.split()[1:3] == ["gradient", "gradient"] for line in out.stdout.splitlines() if line.strip()[:1].isdigit())
  w = _param([1.0, 2.0])
  with rewrite.stats.collect() as s:
    (w.exp() * w).sum().backward()
  assert s.stages["gradient"].calls == 1 and s.stages["gradient"].rewrites >= 4
  assert any(r.stage == "gradient" and r.name == "grad_exp2" and r.matches == 1 for r in s.rules.values())


def test_a_gradient_through_a_chain_deeper_than_pythons_recursion():
  w = Tensor(np.ones(4, np.float32), requires_grad=True)
  x = Tensor(np.ones(4, np.float32))
  for _ in range(3000): x = x * 1.0001 + w.sum()   # every step reads a reduction: the backward keeps what it reads
  (g,) = x.sum().gradient(w)
  assert g.shape == (4,)


def test_two_equal_lazy_leaves_have_gradients_of_their_own():
  # Tensor.full((2, 2), 1.0) made twice is one node (hash-consing): as targets the two shared their gradients (each
  # .grad was the sum of both). A tensor that requires gradients is memory of its own, as torch's leaves
  m = Tensor.full((2, 2), 1.0).requires_grad_()
  (m * 5).sum().backward()
  w = Tensor.full((2, 2), 1.0).requires_grad_()
  (w * 7).sum().backward()
  np.testing.assert_array_equal(m.grad.numpy(), np.full((2, 2), 5.0))
  np.testing.assert_array_equal(w.grad.numpy(), np.full((2, 2), 7.0))
  assert m.is_realized and m.uop is not w.uop
