"""The share stage: a value read by kernels of several depths, which each of them would recompute from two or more
stored values, is stored once (rules/realize.py `choose_shared_values`, the share stage's policy). The residual stream
of a stack of layers is then one buffer per layer, and identical layers compile to identical kernels."""
import numpy as np
from tensor import Tensor
from runtime.realize import build_program

WHY = "a value read by kernels of several depths, stored once"


def stack(x: Tensor, weights: list[Tensor]) -> Tensor:
  for w in weights: x = x + (x.layernorm(-1) @ w).relu()   # pre-norm residual layers
  return x.layernorm(-1)


def stack_numpy(x, weights):
  def ln(v): return (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5)
  for w in weights: x = x + np.maximum(ln(x) @ w, 0)
  return ln(x)


def test_the_residual_stream_is_one_buffer_per_layer_and_layers_share_their_kernels():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 32)).astype(np.float32)
  ws = [rng.standard_normal((32, 32)).astype(np.float32) * 0.2 for _ in range(4)]
  kernels, distinct = [], []
  for layers in (1, 2, 3, 4):
    out = stack(Tensor(x), [Tensor(w) for w in ws[:layers]])
    program = build_program([(out.uop, out.device)])
    assert sum(WHY in line for line in program.explanations) == layers   # one stored residual per layer
    kernels.append(len(program.kernels_called())); distinct.append(len(set(program.kernels_called())))
    np.testing.assert_allclose(out.numpy(), stack_numpy(x, ws[:layers]), rtol=1e-4, atol=1e-4)
  assert kernels[3] - kernels[2] == kernels[2] - kernels[1] == kernels[1] - kernels[0]   # the same kernels per layer
  assert distinct[1] == distinct[2] == distinct[3]                                       # ... and the same code


def test_a_value_recomputed_from_one_buffer_stays_inline():
  # softmax(x * 2): the scaled value is read by the max, the sum and the output, but recomputing it reads x alone
  x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
  out = (Tensor(x) * 2).softmax(-1)
  assert not any(WHY in line for line in build_program([(out.uop, out.device)]).explanations)
  e = np.exp(2 * x - (2 * x).max(-1, keepdims=True))
  np.testing.assert_allclose(out.numpy(), e / e.sum(-1, keepdims=True), rtol=1e-5)


def test_a_value_read_at_one_depth_stays_inline():
  a, b = (np.random.default_rng(2).standard_normal(64).astype(np.float32) for _ in range(2))
  out = ((Tensor(a) - Tensor(b)) ** 2).mean()   # (a - b)^2 is read by the one reduction only
  assert not any(WHY in line for line in build_program([(out.uop, out.device)]).explanations)
  np.testing.assert_allclose(out.numpy(), ((a - b) ** 2).mean(), rtol=1e-5)


def test_debug_2_says_why_the_value_was_stored(capsys, monkeypatch):
  monkeypatch.setenv("DEBUG", "2")
  a, b = (np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32) for _ in range(2))
  (Tensor(a) + Tensor(b)).layernorm(-1).numpy()   # a + b: read by the mean, the variance and the output
  assert f"{WHY} (policy choose_shared_values)" in capsys.readouterr().out
