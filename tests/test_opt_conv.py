"""The heuristic's plan for a convolution: vector lanes across the output channels, whose weights are read from a
packed panel, a tile of channels x columns, and the input read one scalar per column (strides never make a gather).
conv2d stores a padded input first, so the convolution's own kernel (the one these tests plan) reads no masks."""
import numpy as np
import pytest
from numpy.testing import assert_allclose
from rewrite import Ops
from tensor import Tensor
from rules.opt import OptKind
from rules.opt.heuristic import vector_width
from tests.opt_helpers import lowered, run_with
from tests.test_tensor_nn import _conv2d

pytestmark = pytest.mark.usefixtures("on_cpu")  # the CPU's vocabulary: on the CPU also in a DEVICE=CUDA run

rng = np.random.default_rng(9)
x, w = rng.standard_normal((2, 8, 10, 12), dtype=np.float32), rng.standard_normal((16, 8, 3, 3), dtype=np.float32)


def pair(v): return v if isinstance(v, tuple) else (v, v)


def conv(x, w, stride=1, padding=0):
  """The convolution's kernel alone: its input padded already (conv2d's first kernel)."""
  (ph, pw) = pair(padding)
  return Tensor(np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))).conv2d(Tensor(w), stride=stride)


def test_a_convolution_gets_lanes_across_output_channels_and_a_packed_weight_panel():
  t = conv(x, w, padding=1)
  linear, plan = lowered(t)
  # the kernel's loops: batch 0, output channels 1, output rows 2 and columns 3, then the reduction's (channels, window)
  assert [(o.kind, o.axis) for o in plan.opts if o.kind in (OptKind.VECTOR, OptKind.PACK)] == [(OptKind.VECTOR, 1), (OptKind.PACK, 3)]
  # the weights of the tile's vectors of output channels sit side by side in one packed panel (one stream to read)
  assert sum(u.op is Ops.DEFINE_LOCAL for u in linear.src) == 1
  # the input (buffer 1) is read one scalar at a time, the packed weights as vectors
  inputs = [u for u in linear.src if u.op is Ops.LOAD and u.src[0].src[0].op is Ops.DEFINE_GLOBAL and u.src[0].src[0].arg == 1]
  assert inputs and all(u.dtype.count == 1 for u in inputs)
  assert any(u.op is Ops.LOAD and u.dtype.count == vector_width(4) and u.src[0].src[0].op is Ops.BARRIER for u in linear.src)
  assert_allclose(run_with(t), _conv2d(x, w, padding=(1, 1)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride, padding", [(1, 0), (1, 1), (2, 1), ((1, 2), (2, 0)), (2, 2)])
def test_the_convolution_plan_keeps_the_values_of_every_stride_and_padding(stride, padding):
  t = conv(x, w, stride, padding)
  _, plan = lowered(t)
  assert plan.opts[0].kind is OptKind.VECTOR and plan.opts[0].axis == 1
  assert_allclose(run_with(t), _conv2d(x, w, pair(stride), pair(padding)), rtol=1e-4, atol=1e-4)


def test_too_few_output_channels_for_a_vector_keep_the_other_tiles():
  t = conv(x, w[:4], padding=1)
  _, plan = lowered(t)
  assert not any(o.kind is OptKind.VECTOR and o.axis == 1 for o in plan.opts)
  assert_allclose(run_with(t), _conv2d(x, w[:4], padding=(1, 1)), rtol=1e-4, atol=1e-4)


def test_conv2d_with_padding_reads_the_stored_padded_input_without_masks():
  out = Tensor(x).conv2d(Tensor(w), stride=2, padding=(1, 2))
  kernels = [k for k in out.kernel_sources() if "for (" in k]
  assert len(kernels) == 2   # the padded copy, then the convolution
  conv_kernel = kernels[-1]
  assert "?" not in conv_kernel.split("{", 1)[1]   # no masked load (a select) in the convolution
  assert_allclose(out.numpy(), _conv2d(x, w, (2, 2), (1, 2)), rtol=1e-4, atol=1e-4)


def test_a_bias_and_relu_after_the_convolution_read_the_channels_as_vectors():
  b = rng.standard_normal(16, dtype=np.float32)
  t = (conv(x, w, padding=1) + Tensor(b).reshape(1, 16, 1, 1)).relu()
  _, plan = lowered(t)
  assert plan.opts[0].kind is OptKind.VECTOR and plan.opts[0].axis == 1
  assert_allclose(run_with(t), np.maximum(_conv2d(x, w, padding=(1, 1)) + b.reshape(1, 16, 1, 1), 0), rtol=1e-4, atol=1e-4)
