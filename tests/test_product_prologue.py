"""An operand of a product that elementwise ops compute (a layer norm before the qkv product) is computed once into a
buffer (rules/realize.py, `_realize_product_operands`), not once per output column inside the product's loops; a cast
or a view of a buffer, or an operand read only a few times over, stays inline."""
import numpy as np
from rewrite import Ops
from rules.pipeline import Run, schedule
from helpers import realize_and_check
from tensor import Tensor

rng = np.random.default_rng(3)


def randn(*shape): return rng.standard_normal(shape).astype(np.float32)


def kernels(t: Tensor) -> list:
  return schedule([t.uop], [t.device], Run(t.device))[0]


def products(ks) -> list:
  return [r for k in ks for r in k.toposort if r.op is Ops.REDUCE_AXIS and r.src[0].op is Ops.MUL]


def under_views(u):
  while u.op is Ops.VIEW: u = u.src[0]
  return u


def test_a_layernormed_operand_is_stored_once_then_the_product_reads_buffers():
  x, g, b, w, bias = randn(32, 48), randn(48), randn(48), randn(48, 40), randn(40)
  out = (Tensor(x).layernorm() * Tensor(g) + Tensor(b)) @ Tensor(w) + Tensor(bias)
  ks = kernels(out)
  assert len(ks) == 2   # the normalized operand (one pass over each row), then the product with its bias
  (prod,) = products(ks[-1:])
  assert all(under_views(s).op is Ops.BUFFER for s in prod.src[0].src)
  xn = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
  realize_and_check([(out, xn @ w + bias)], rtol=1e-4, atol=1e-4)


def test_casts_views_and_operands_read_few_times_stay_inline():
  a16, b16 = randn(16, 32).astype(np.float16), randn(32, 24).astype(np.float16)
  x, v, w = randn(16, 32), randn(32, 4), randn(24, 32)
  for t in (Tensor(a16) @ Tensor(b16), Tensor(x) @ Tensor(w).T, (Tensor(x) * 2) @ Tensor(v)):
    assert len(kernels(t)) == 1
  realize_and_check([((Tensor(x) * 2) @ Tensor(v), (x * 2) @ v), (Tensor(x).relu() @ Tensor(w).T, np.maximum(x, 0) @ w.T)],
                    rtol=1e-4, atol=1e-4)
