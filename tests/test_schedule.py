"""How many kernels a program becomes, and why: the realize stage's decisions, seen from the Tensor API."""
import math
import numpy as np
import pytest
from rewrite import UOp, Ops, dtypes
from rules.pipeline import Run, schedule
from rules.strided_view import View
from runtime.buffer import Buffer
from tensor import Tensor
from runtime.realize import build_program
from helpers import unfused_attention


def kernels_of(*tensors: Tensor) -> int:
  return len(build_program([(t.uop, t.device) for t in tensors]).kernels_called())


rng = np.random.default_rng(0)
x = Tensor(rng.standard_normal((32, 48)).astype(np.float32))
y = Tensor(rng.standard_normal((32, 48)).astype(np.float32))
w = Tensor(rng.standard_normal((48, 16)).astype(np.float32))


def test_fused_elementwise_is_one_kernel(): assert kernels_of(((x * y + 1).exp() - x).relu()) == 1
def test_row_sum_is_one_kernel(): assert kernels_of(x.sum(axis=1)) == 1
def test_reduction_fuses_with_elementwise_before_and_after(): assert kernels_of((x * y).sum(axis=1).sqrt() * 2) == 1
def test_matmul_is_one_kernel(): assert kernels_of(x @ w) == 1
# at most 3 (the requirement); exactly one: the gpu_fuse stage keeps the row's reductions with the lanes that write it
# (CUDA, any row length) or with the thread that writes it (CPU, a row that stays in cache: rules/opt/rows.py)
ROW_NORMALIZE_KERNELS_ON = {"CPU": 1, "CUDA": 1}
ROW_NORMALIZE_KERNELS = ROW_NORMALIZE_KERNELS_ON[x.device]
def test_softmax_is_at_most_three_kernels(): assert kernels_of(x.softmax(axis=-1)) == ROW_NORMALIZE_KERNELS
def test_layernorm_is_at_most_three_kernels(): assert kernels_of(x.layernorm()) == ROW_NORMALIZE_KERNELS


def unallocated_tensor(shape, device: str) -> Tensor:
  """A float32 tensor whose memory is never allocated: enough to schedule for a device without running anything."""
  buf = UOp(Ops.BUFFER, dtypes.float32, (), Buffer(device, math.prod(shape), dtypes.float32))
  return Tensor._from_uop(UOp(Ops.VIEW, dtypes.float32, (buf,), View.contiguous(shape)), shape, device)


def unallocated_cuda_tensor(*shape: int) -> Tensor:
  return unallocated_tensor(shape, "CUDA")


def cuda_kernels_of(t: Tensor) -> int:
  kernels, _ = schedule([t.uop], ["CUDA"], Run("CUDA", parallel=False, device_loops=True))
  return len(kernels)


ROW_NORMALIZATIONS = {"softmax": lambda t: t.softmax(axis=-1), "log_softmax": lambda t: t.log_softmax(axis=-1),
                      "layernorm": lambda t: t.layernorm(), "var": lambda t: t.var(axis=1),
                      "centered": lambda t: t - t.mean(axis=1, keepdim=True)}


@pytest.mark.parametrize("name", ROW_NORMALIZATIONS)
@pytest.mark.parametrize("shape", [(32, 48), (300, 7), (64, 2048), (4, 100000)])
def test_row_normalizations_are_one_kernel_on_cuda_for_any_row_length(name, shape):
  assert cuda_kernels_of(ROW_NORMALIZATIONS[name](unallocated_cuda_tensor(*shape))) == ROW_NORMALIZE_KERNELS_ON["CUDA"]


@pytest.mark.parametrize("name", ROW_NORMALIZATIONS)
@pytest.mark.parametrize("shape, one_pass", [((32, 48), True), ((300, 7), True), ((64, 2048), True), ((16, 16384), True),
                                             ((4, 100000), False), ((15, 2048), False), ((16, 65537), False)])
def test_row_normalizations_are_one_kernel_on_the_cpu_where_a_row_stays_in_cache(name, shape, one_pass):
  """16 rows at least (threads take rows), a row of at most 256 KiB read (a core's cache holds it between passes);
  otherwise each row reduction is a kernel of its own."""
  t = ROW_NORMALIZATIONS[name](unallocated_tensor(shape, "CPU"))
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU"))
  assert (len(kernels) == 1) == one_pass


def test_attention_is_one_kernel_on_cuda_and_three_unfused(monkeypatch):
  monkeypatch.setenv("GRAFT_ATTENTION", "1")   # fused whatever the size (by default only where the scores are large)
  # fused (rules/attention.py): an online softmax, no N x N buffer. Unfused: the scores (a realized buffer, read through
  # a reshape of it), the probabilities with the softmax's max and sum in their kernel, the product
  q = unallocated_cuda_tensor(4, 128, 64)
  assert cuda_kernels_of((q @ q.transpose(-1, -2) * 0.125).softmax(-1) @ q) == 1
  with unfused_attention(): assert cuda_kernels_of((q @ q.transpose(-1, -2) * 0.125).softmax(-1) @ q) == 3


def test_column_normalization_stays_three_kernels_on_cuda():
  # a column reduction's reads walk down columns: a row's lanes would not read consecutive addresses
  assert cuda_kernels_of(unallocated_cuda_tensor(32, 48).softmax(axis=0)) == 3


def test_conv2d_is_one_kernel_after_its_padded_input():
  img = Tensor(rng.standard_normal((2, 3, 10, 10)).astype(np.float32))
  k = Tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
  assert kernels_of(img.conv2d(k)) == 1
  assert kernels_of(img.conv2d(k, padding=1)) == 2   # the padded input is stored first: no masks in the convolution


def test_constants_are_never_buffers():
  program = build_program([((x + Tensor.full((32, 48), 2.0)).uop, x.device)])
  assert str(program).splitlines()[2].split()[2:] == ["out0", "<-", "in0"]  # no buffer for the constant


def test_contiguous_forces_a_buffer():
  assert kernels_of((x + 1).contiguous() * 2) == 2


def test_two_outputs_of_one_shape_share_a_kernel_and_are_right():
  from runtime.realize import realize
  a, b = realize([((x + y).uop, x.device), ((x * y).uop, x.device)])
  assert kernels_of(x + y, x * y) == 1
  np.testing.assert_allclose(a.src[0].arg.numpy().reshape(32, 48), x.numpy() + y.numpy(), rtol=1e-6)
  np.testing.assert_allclose(b.src[0].arg.numpy().reshape(32, 48), x.numpy() * y.numpy(), rtol=1e-6)


def test_a_kernel_that_reads_another_is_not_merged_into_it():
  first = (x + 1).contiguous()
  second = first * 2                           # same shape as first, and reads it: merging them would be a cycle
  program = build_program([(first.uop, x.device), (second.uop, x.device)])
  assert len(program.kernels_called()) == 2
  assert any("would make a cycle" in e for e in program.explanations)


def test_independent_kernels_of_one_shape_merge_and_their_reader_runs_after():
  a, b = (x + 1).contiguous(), (y * 2).contiguous()  # need nothing of each other: one kernel with two stores
  out = a + b                                        # reads both: a kernel of its own, after theirs
  program = build_program([(out.uop, x.device)])
  assert len(program.kernels_called()) == 2
  assert any("fused into one kernel" in e for e in program.explanations)
  np.testing.assert_allclose(out.numpy(), (x.numpy() + 1) + y.numpy() * 2, rtol=1e-6)


def on_the_cpu(*tensors: Tensor) -> tuple[Tensor, ...]:
  """The tensors' values on the CPU: tests of the CPU's plans (its `vector` register tiles), whatever DEVICE says."""
  return tuple(Tensor(t.numpy(), device="CPU") for t in tensors)


def test_two_products_of_one_shape_stay_apart_and_each_is_tiled():
  # merged, neither loop nest would be a product the planner tiles (attention's backward: dq and dk)
  a, b, wa, wb = on_the_cpu(x, y, w, Tensor(rng.standard_normal((48, 16)).astype(np.float32)))
  program = build_program([((a @ wa).uop, "CPU"), ((b @ wb).uop, "CPU")])
  assert len(program.kernels_called()) == 2
  assert all("vector" in str(k.plan) for k in program.kernels_called()), [str(k.plan) for k in program.kernels_called()]


def test_a_product_and_a_value_computed_from_it_are_one_tiled_kernel():
  # (a layer's pre-activation and its output, both kept for a backward pass): the product runs once, in a register
  # tile whose registers feed both stores
  a, wa = on_the_cpu(x, w)
  h = a @ wa
  program = build_program([(h.uop, "CPU"), ((h.relu() * 2).uop, "CPU")])
  assert len(program.kernels_called()) == 1 and "vector" in str(program.kernels_called()[0].plan)
  out = h.relu() * 2
  Tensor.realize_all(h, out)
  np.testing.assert_allclose(out.numpy(), np.maximum(x.numpy() @ w.numpy(), 0) * 2, rtol=1e-5, atol=1e-6)


def test_a_value_stored_by_the_gradient_and_by_the_realize_stage_is_one_buffer(monkeypatch):
  # h = gelu(a @ w1) @ w2 is stored by the gradient (its backward reads it) and by the realize stage (the loss's sum
  # reads a reduction); once the gelu operand inside h is stored too, the two are one node: one buffer, filled by a
  # kernel of one store that the product's tile plan takes (two stores of one value were refused: 28% of a GPT step)
  a, w1, w2 = (Tensor(rng.standard_normal(s).astype(np.float32) * 0.1, requires_grad=True, device="CPU")
               for s in ((32, 48), (48, 64), (64, 16)))
  h = (a @ w1).gelu() @ w2
  loss = (h * h).sum()
  loss.backward()
  grads = [a.grad, w1.grad, w2.grad]
  monkeypatch.setenv("GRAFT_EXTERN", "0")   # every product a kernel of ours (no library call)
  program = build_program([(t.uop, "CPU") for t in [loss, *grads]])
  written = {line.split()[1]: line.split(" <- ")[0].split("  ")[-1] for line in program.listing.splitlines()[2:]
             if line.split()[0] == "call"}
  h_kernels = [k for k in program.kernels_called() if k.name.startswith("r_32_16_")]   # h: 32 x 16
  assert len(h_kernels) == 1 and "vector" in h_kernels[0].plan and "," not in written[h_kernels[0].name], program.listing
  Tensor.realize_all(loss, *grads)
  import torch
  ta, tw1, tw2 = (torch.tensor(t.numpy(), requires_grad=True) for t in (a, w1, w2))
  th = torch.nn.functional.gelu(ta @ tw1, approximate="tanh") @ tw2
  (th * th).sum().backward()
  for g, tg in zip(grads, (ta, tw1, tw2)): np.testing.assert_allclose(g.numpy(), tg.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_linear_layers_gelu_backward_is_one_kernel(monkeypatch):
  # the backward stores d(pre-activation) for its two products; the bias gradient reads that buffer too (rule
  # read_from_store), instead of recomputing it, which had the share stage store each step of the GELU's derivative
  # (read at two depths): 8 elementwise kernels of the layer's shape, now 1 (and 1 for the forward's GELU)
  a, w1, b1, w2 = (Tensor(rng.standard_normal(s).astype(np.float32) * 0.1, requires_grad=True, device="CPU")
                   for s in ((64, 32), (32, 48), (48,), (48, 32)))
  h = (a @ w1 + b1).gelu() @ w2
  loss = (h * h).sum()
  loss.backward()
  grads = [a.grad, w1.grad, b1.grad, w2.grad]
  monkeypatch.setenv("GRAFT_EXTERN", "0")
  program = build_program([(t.uop, "CPU") for t in [loss, *grads]])
  assert sum(k.name.startswith("E_64_48_") for k in program.kernels_called()) == 2, program.listing
  # and each gradient is written where it is computed (by its product, its sum), not copied into the output after
  writer = {line.split(" <- ")[0].split()[-1]: line.split()[1] for line in program.listing.splitlines()[2:] if " call " in f" {line} "}
  assert all(writer[f"out{i}"].startswith("r_") for i in range(1, 5)), program.listing
  Tensor.realize_all(loss, *grads)
  import torch
  ta, tw1, tb1, tw2 = (torch.tensor(t.numpy(), requires_grad=True) for t in (a, w1, b1, w2))
  th = torch.nn.functional.gelu(ta @ tw1 + tb1, approximate="tanh") @ tw2
  (th * th).sum().backward()
  for g, tg in zip(grads, (ta, tw1, tb1, tw2)): np.testing.assert_allclose(g.numpy(), tg.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_attention_computes_its_scores_once():
  # the max and the sum read the scores from a buffer, and so do the probabilities: q @ k.T runs in one kernel
  q, k, v = (Tensor(rng.standard_normal((2, 16, 8)).astype(np.float32)) for _ in range(3))
  out = (q @ k.transpose(-1, -2) / math.sqrt(8)).softmax(-1) @ v
  q_buffer = next(n for n in q.uop.toposort if n.op is Ops.BUFFER)
  kernels, _ = schedule([out.uop], [out.device], Run(out.device))
  assert sum(q_buffer in kernel.toposort for kernel in kernels) == 1


# ---- the schedule's index (rules/realize.py ScheduleIndex), on kernels written by hand ----
def _buffer(name: str) -> UOp: return UOp(Ops.BUFFER, dtypes.float32, (), name)


def _kernel(writes: list[UOp], reads: list[UOp]) -> UOp:
  value = UOp(Ops.SINK, src=tuple(reads))   # stands for whatever the kernel computes from what it reads
  return UOp(Ops.KERNEL, dtypes.void, tuple(UOp(Ops.STORE, dtypes.void, (UOp(Ops.VIEW, dtypes.float32, (w,)), value))
                                            for w in writes), "CPU")


def test_the_schedule_index_gives_depths_readers_and_writers():
  from rules.realize import ScheduleIndex, in_dependency_order
  a, b, c, d = map(_buffer, "abcd")
  k0, k1, k2, k3 = _kernel([a], []), _kernel([b], [a]), _kernel([c], [a]), _kernel([d], [b, c])   # a diamond
  index = ScheduleIndex([k3, k1, k0, k2])
  assert [index.depth[k] for k in (k0, k1, k2, k3)] == [0, 1, 1, 2]
  assert index.readers[a] == [1, 3] and index.writers[d] == [0] and index.writer(c) is k2 and index.writer(_buffer("e")) is None
  assert in_dependency_order([k3, k1, k0, k2]) == [k0, k1, k2, k3]   # by depth, ties in the given order


def test_kernels_that_need_one_another_are_an_error_not_a_hang():
  from rules.realize import ScheduleIndex
  a, b, c = map(_buffer, "abc")
  # b has two writers; the last listed, k2, reads what k1 writes, and k1 reads b: no order runs them
  k0, k1, k2 = _kernel([b], []), _kernel([c], [b]), _kernel([b], [c])
  with pytest.raises(ValueError, match="need one another: a buffer has several writers"): ScheduleIndex([k0, k1, k2])


def test_each_buffer_is_explained_by_the_rule_that_decided_it():
  # DEBUG=2's reasons name the realize rule, also where a helper of the rules (`store`) made the decision
  half = Tensor(rng.standard_normal((32, 48)).astype(np.float16))
  scores = half.layernorm(-1) @ Tensor(rng.standard_normal((48, 32)).astype(np.float16))
  program = build_program([((scores - scores.max(-1, keepdim=True)).uop, half.device)])
  reasons = [e for e in program.explanations if "buffer of shape" in e]
  assert any("(rule _realize_product_operands at" in e for e in reasons), reasons
  assert any("(rule _realize_before_expand at" in e for e in reasons), reasons
  assert not any("(rule store at" in e for e in reasons)


def test_values_equal_once_they_read_stores_share_one_store():
  # x is stored, and so is a sum of x computed inline; a second sum reads x's buffer. Once the first reads x's buffer
  # too, the two sums are one value: the stage's second pass reads it from its store (stored_reads, to a fixed point)
  from rules.pipeline import Pipeline, pipeline
  a = Tensor(rng.standard_normal((8, 16)).astype(np.float32), device="CPU")
  v = a.exp()
  stored, inline = v.sum(1).contiguous(), v.contiguous().sum(1)
  passes = []
  stage = pipeline.stages[pipeline.index("stored_reads")]
  counting = type(stage)(**{**stage.__dict__, "prepare": lambda ctx, root: (passes.append(root), stage.prepare(ctx, root))})
  out = Pipeline([counting]).run(UOp(Ops.SINK, src=(stored.uop, (stored + inline).uop), arg=("CPU", "CPU")), "graph", Run("CPU"))
  sums = [n for n in out.toposort if n.op is Ops.REDUCE_AXIS]
  assert len(sums) == 1 and all(n.op is Ops.CONTIGUOUS for n in out.toposort if sums[0] in n.src), out
  assert len(passes) == 3, "a pass redirects x's readers, one the equal sum's, one finds nothing"
  np.testing.assert_allclose((stored + inline).numpy(), 2 * np.exp(a.numpy()).sum(1), rtol=1e-5)
