"""How many kernels a program becomes, and why: the realize stage's decisions, seen from the Tensor API."""
import numpy as np
from tensor import Tensor
from runtime.realize import build_schedule


def kernels_of(*tensors: Tensor) -> int:
  sched = build_schedule([(t.uop, t.device) for t in tensors])
  return sum(step.kernel is not None for step in sched.steps)


rng = np.random.default_rng(0)
x = Tensor(rng.standard_normal((32, 48)).astype(np.float32))
y = Tensor(rng.standard_normal((32, 48)).astype(np.float32))
w = Tensor(rng.standard_normal((48, 16)).astype(np.float32))


def test_fused_elementwise_is_one_kernel(): assert kernels_of(((x * y + 1).exp() - x).relu()) == 1
def test_row_sum_is_one_kernel(): assert kernels_of(x.sum(axis=1)) == 1
def test_reduction_fuses_with_elementwise_before_and_after(): assert kernels_of((x * y).sum(axis=1).sqrt() * 2) == 1
def test_matmul_is_one_kernel(): assert kernels_of(x @ w) == 1
# at most 3 (the requirement); exactly: on the CPU two row reductions (max, sum / mean, variance) and the output, on
# CUDA one kernel (the gpu_fuse stage keeps the row's reductions in the block that writes it)
ROW_NORMALIZE_KERNELS = 1 if x.device == "CUDA" else 3
def test_softmax_is_at_most_three_kernels(): assert kernels_of(x.softmax(axis=-1)) == ROW_NORMALIZE_KERNELS
def test_layernorm_is_at_most_three_kernels(): assert kernels_of(x.layernorm()) == ROW_NORMALIZE_KERNELS


def test_conv2d_is_one_kernel():
  img = Tensor(rng.standard_normal((2, 3, 10, 10)).astype(np.float32))
  k = Tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
  assert kernels_of(img.conv2d(k, padding=1)) == 1


def test_constants_are_never_buffers():
  sched = build_schedule([((x + Tensor.full((32, 48), 2.0)).uop, x.device)])
  assert len(sched.steps) == 1 and len(sched.steps[0].buffers) == 2  # the output and x; no buffer for the constant


def test_contiguous_forces_a_buffer():
  assert kernels_of((x + 1).contiguous() * 2) == 2


def test_two_outputs_of_one_shape_share_a_kernel_and_are_right():
  from runtime.realize import realize
  a, b = realize([((x + y).uop, x.device), ((x * y).uop, x.device)])
  sched = build_schedule([((x + y).uop, x.device), ((x * y).uop, x.device)])
  assert sum(s.kernel is not None for s in sched.steps) == 1
  np.testing.assert_allclose(a.src[0].arg.numpy().reshape(32, 48), x.numpy() + y.numpy(), rtol=1e-6)
  np.testing.assert_allclose(b.src[0].arg.numpy().reshape(32, 48), x.numpy() * y.numpy(), rtol=1e-6)


def test_a_kernel_that_reads_another_is_not_merged_into_it():
  first = (x + 1).contiguous()
  second = first * 2                           # same shape as first, and reads it: merging them would be a cycle
  sched = build_schedule([(first.uop, x.device), (second.uop, x.device)])
  assert sum(s.kernel is not None for s in sched.steps) == 2
  assert any("would make a cycle" in e for e in sched.explanations)


def test_independent_kernels_of_one_shape_merge_and_their_reader_runs_after():
  a, b = (x + 1).contiguous(), (y * 2).contiguous()  # need nothing of each other: one kernel with two stores
  out = a + b                                        # reads both: a kernel of its own, after theirs
  sched = build_schedule([(out.uop, x.device)])
  assert sum(s.kernel is not None for s in sched.steps) == 2
  assert any("fused into one kernel" in e for e in sched.explanations)
  np.testing.assert_allclose(out.numpy(), (x.numpy() + 1) + y.numpy() * 2, rtol=1e-6)
