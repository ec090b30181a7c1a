"""Fused attention (rules/attention.py): softmax(q @ k.T * s + mask) @ v, as a user writes it, is one kernel with an
online softmax: checked against numpy (and torch where installed) for masks, odd lengths, batch and head shapes, on
the CPU and in the numpy model of a GPU grid; the fallback says why; no Tq x Tk buffer exists; CUDA compiles."""
import math, re, shutil, subprocess
import numpy as np
import pytest
from tensor import Tensor
from rewrite import dtypes
from runtime.realize import last_program, plan
from rules.attention import MAX_HEAD, BLOCK, LANES
from rewrite import Ops
from rules.pipeline import Run, lower_kernel
from rules.realize import NewBuffer
from test_gpu_stages import run_on_model_gpu, host_steps, run_grid
from cuda_threads import launch
from helpers import unfused_attention

rng = np.random.default_rng(21)


@pytest.fixture(autouse=True)
def fused(monkeypatch):
  """These tests are of the fused kernel (by default on a GPU it is used only where the scores would be large)."""
  monkeypatch.setenv("GRAFT_ATTENTION", "1")


def randn(*shape): return rng.standard_normal(shape).astype(np.float32)


def attention(q, k, v, mask=None, scale=None):
  """What a user writes; works on Tensors and numpy arrays alike (the reference)."""
  scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
  kt = k.transpose(-1, -2) if isinstance(k, Tensor) else np.swapaxes(k, -1, -2)
  s = (q @ kt) * scale
  if mask is not None: s = s + mask
  if isinstance(s, Tensor): return s.softmax(-1) @ v
  with np.errstate(invalid="ignore"):
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def causal(tq, tk):
  return np.triu(np.full((tq, tk), -np.inf, np.float32), 1 + tk - tq)


def kernel_calls(program) -> int: return sum(1 for s in program.steps if s[0] in ("call", "extern", "pick"))


def tiled(program) -> bool:
  """Whether the program's attention kernel is its device's tiled one (renderers/attention_c.py, attention_cuda.py)."""
  return any("tiled attention" in ck.plan for ck in program.kernels_called())


ON_CPU = Tensor(np.zeros(1, np.float32)).device == "CPU"   # (the default device: DEVICE=CUDA runs these on a GPU)


def run_fused(q, k, v, mask=None, scale=None):
  ts = [Tensor(x) for x in (q, k, v)] + ([Tensor(mask)] if mask is not None else [])
  out = attention(*ts[:3], ts[3] if mask is not None else None, scale).numpy()
  program = last_program()
  assert kernel_calls(program) == 1 and program.unplanned_bytes == 0, str(program)   # one kernel, no intermediate
  # the device's tiled kernel: the CPU's where the values' head dimension is a multiple of 4 (vector lanes), else the
  # generic one; the GPU's for any head dimension
  assert tiled(program) == (v.shape[-1] % 4 == 0 or not ON_CPU), program.explanations
  return out


CASES = [  # (q shape, k/v length, head dimension of v, mask)
  ((2, 37, 16), 37, 16, None),               # an odd length: the last block of keys is partly past the end
  ((8, 64, 64), 64, 64, "causal"),
  ((2, 3, 50, 24), 50, 24, "causal"),        # batch and heads; D = 24: vectors of 8
  ((1, 1, 9), 20, 9, "additive"),            # one query row, Tq != Tk, a head dimension of 9 (no vector width)
  ((3, 10, 8), 23, 32, "additive"),          # cross attention, values wider than queries
  ((2, 5, 4), 5, 4, None),                   # fewer keys than a block
  ((2, 33, 16), 33, 16, "first_block_masked"),  # rows whose first blocks are masked whole: no NaN from -inf - -inf
]


def make_case(qshape, tk, dv, mask):
  *batch, tq, d = qshape
  q, k, v = randn(*qshape), randn(*batch, tk, d), randn(*batch, tk, dv)
  if mask == "causal": m = causal(tq, tk)
  elif mask == "additive": m = randn(tq, tk)
  elif mask == "first_block_masked":
    m = np.zeros((tq, tk), np.float32)
    m[: tq // 2, :20] = -np.inf   # rows 0..tq/2 see only keys 20.. (the first two blocks of 8 entirely masked)
  else: m = None
  return q, k, v, m


@pytest.mark.parametrize("qshape,tk,dv,mask", CASES)
def test_fused_attention_matches_numpy(qshape, tk, dv, mask):
  q, k, v, m = make_case(qshape, tk, dv, mask)
  np.testing.assert_allclose(run_fused(q, k, v, m), attention(q, k, v, m), rtol=2e-5, atol=2e-5)


def test_fused_attention_matches_torch():
  torch = pytest.importorskip("torch")
  q, k, v = randn(2, 4, 70, 32), randn(2, 4, 70, 32), randn(2, 4, 70, 32)
  m = causal(70, 70)
  want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(m))
  np.testing.assert_allclose(run_fused(q, k, v, m), want.numpy(), rtol=2e-5, atol=2e-5)


def test_tiled_kernel_masks_read_through_batch_and_head_indices():
  # a bool mask per batch, shared by the heads (masked_fill), plus an additive bias per head: the scores' expression
  # reads both buffers at (batch, head, row, key) inside the tile; 45 keys: the last block of keys partly past the end
  b, h, tq, tk, d = 2, 3, 13, 45, 16
  q, k, v = randn(b, h, tq, d), randn(b, h, tk, d), randn(b, h, tk, d)
  keep, bias = rng.random((b, 1, tq, tk)) < 0.8, randn(1, h, 1, tk)
  keep[..., 0] = True   # no row masked whole
  T = lambda x: Tensor(x, device="CPU")   # (the CPU's kernel, whatever the default device)
  s = (T(q) @ T(k).transpose(-1, -2)) * 0.25 + T(bias)
  got = s.masked_fill(T(~keep), -math.inf).softmax(-1) @ T(v)
  want = attention(q, k, v, np.where(keep, bias, -np.inf).astype(np.float32), 0.25)
  np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5)
  assert kernel_calls(last_program()) == 1 and tiled(last_program())


def test_tiled_kernel_source_holds_register_tiles_and_no_scores_buffer():
  q, k, v = (Tensor(randn(8, 512, 64)) for _ in range(3))
  program = plan([(attention(q, k, v).uop, "CPU")])
  assert kernel_calls(program) == 1 and tiled(program) and program.unplanned_bytes == 0
  source = "\n".join(ck.source for ck in program.kernels_called())
  assert "g_exp2f_x" in source and "a3_0" in source   # exponents in vector lanes; a tile of 4 query rows
  assert "262144" not in source and "512*512" not in source   # no 512 x 512 scores anywhere


def test_a_head_dimension_without_vector_lanes_keeps_the_generic_kernel_and_says_why(monkeypatch, capsys):
  q, k, v = randn(2, 20, 8), randn(2, 20, 8), randn(2, 20, 6)
  t = attention(Tensor(q, device="CPU"), Tensor(k, device="CPU"), Tensor(v, device="CPU"))
  out = debug2_lines(monkeypatch, capsys, t)
  assert "attention not tiled: head dimension 6 is not a multiple of 4; the row-at-a-time kernel instead" in out
  np.testing.assert_allclose(t.numpy(), attention(q, k, v), rtol=2e-5, atol=2e-5)


def softmax_np(s):
  e = np.exp(s - s.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_scale_and_mask_in_any_form_a_user_writes():
  q, k, v = randn(2, 40, 16), randn(2, 40, 16), randn(2, 40, 16)
  mask = np.where(np.tril(np.ones((40, 40), bool)), 0, -1e9).astype(np.float32)
  got = ((Tensor(q) @ Tensor(k).transpose(-1, -2) + Tensor(mask)) / 4).softmax(-1) @ Tensor(v)   # masked, then divided
  assert kernel_calls(plan([(got.uop, "CPU")])) == 1
  np.testing.assert_allclose(got.numpy(), softmax_np((q @ k.transpose(0, 2, 1) + mask) / 4) @ v, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("t,d", [(64, 32), (29, 8)])
def test_causal_attention_through_tril_and_masked_fill(t, d):
  # the causal mask a GPT writes: a lower triangle of ones, masked_fill where it is 0; the mask is computed in the kernel
  q, k, v = randn(2, 2, t, d), randn(2, 2, t, d), randn(2, 2, t, d)
  qt, kt, vt = Tensor(q), Tensor(k), Tensor(v)
  keep = Tensor.ones(t, t).tril()
  s = (qt @ kt.transpose(-1, -2)) * (1 / math.sqrt(d))
  got = s.masked_fill(keep == 0, -math.inf).softmax(-1) @ vt
  assert kernel_calls(plan([(got.uop, "CPU")])) == 1
  np.testing.assert_allclose(got.numpy(), attention(q, k, v, causal(t, t)), rtol=2e-5, atol=2e-5)
  model = run_on_model_gpu(s.masked_fill(keep == 0, -math.inf).softmax(-1) @ vt)[0]
  np.testing.assert_allclose(model, attention(q, k, v, causal(t, t)), rtol=2e-5, atol=2e-5)


def test_heads_stored_side_by_side_get_the_head_dimension_unrolled():
  # (B, H, T, D) attention written back as (B, T, H*D): the kernel's head loop is H*D long; its inner D is unrolled
  b, h, t, d = 2, 3, 24, 16
  q, k, v = randn(b, h, t, d), randn(b, h, t, d), randn(b, h, t, d)
  out = attention(Tensor(q), Tensor(k), Tensor(v), Tensor(causal(t, t))).permute(0, 2, 1, 3).reshape(b, t, h * d)
  np.testing.assert_allclose(out.numpy(), attention(q, k, v, causal(t, t)).transpose(0, 2, 1, 3).reshape(b, t, h * d),
                             rtol=2e-5, atol=2e-5)
  assert kernel_calls(last_program()) == 1


def test_a_gpt_attention_block_runs_its_attention_fused():
  # one qkv product split into heads, a causal mask computed in the kernel (tril, masked_fill), heads merged back and
  # projected: the attention is one kernel between the two products, and nothing of T x T exists
  b, t, c, h = 2, 19, 32, 4
  d = c // h
  x, w, wo = randn(b, t, c), randn(c, 3 * c) / 6, randn(c, c) / 6
  qkv = Tensor(x) @ Tensor(w)
  q, k, v = (qkv[:, :, i * c:(i + 1) * c].reshape(b, t, h, d).permute(0, 2, 1, 3) for i in range(3))
  s = ((q @ k.transpose(-1, -2)) / math.sqrt(d)).masked_fill(Tensor.ones(t, t).tril() == 0, -math.inf)
  got = (s.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, t, c) @ Tensor(wo)
  qn, kn, vn = (a.reshape(b, t, h, d).transpose(0, 2, 1, 3) for a in np.split(x @ w, 3, -1))
  want = attention(qn, kn, vn, causal(t, t)).transpose(0, 2, 1, 3).reshape(b, t, c) @ wo
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
  program = last_program()
  assert kernel_calls(program) == 3 and program.unplanned_bytes == b * t * (3 * c + c) * 4   # qkv, attention output


def test_a_fully_masked_row_is_nan_as_in_numpy():
  q, k, v = randn(1, 4, 8), randn(1, 4, 8), randn(1, 4, 8)
  m = np.zeros((4, 4), np.float32)
  m[2] = -np.inf
  got = run_fused(q, k, v, m)
  assert np.isnan(got[0, 2]).all() and np.isfinite(np.delete(got[0], 2, 0)).all()
  np.testing.assert_allclose(np.delete(got[0], 2, 0), np.delete(attention(q, k, v, m)[0], 2, 0), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dv", [17, 16])   # (16: the CPU's tiled kernel, 17: the generic one)
def test_scores_a_mask_fills_whole_are_the_same_for_every_row(dv):
  # a mask over every score leaves scores that depend on no query row: the running max and sum are still each row's
  # (found by bench/fuzz.py --patterns: they were computed once, outside the rows' loops, and the kernel did not build)
  q, k, v = randn(2, 3, 5, 1), randn(3, 130, 1), randn(3, 130, dv)
  for model in (False, True):   # the default device (a GPU's under DEVICE=CUDA), then the numpy model of a GPU grid
    dev = "CPU" if model else None
    everywhere = Tensor.full((5, 130), True, dtype="bool", device=dev)
    t = (Tensor(q, device=dev) @ Tensor(k, device=dev).transpose(-1, -2) * 0.125).masked_fill(everywhere, 0.0).softmax(-1)
    t = t @ Tensor(v, device=dev)
    got = run_on_model_gpu(t)[0] if model else t.numpy()
    np.testing.assert_allclose(got, np.broadcast_to(v.mean(-2, keepdims=True), (2, 3, 5, dv)), rtol=2e-5, atol=2e-5)


def test_one_query_row_read_with_other_values_in_one_loop():
  # one query row whose output is concatenated: the kernel's one loop runs over the head and what follows it, and the
  # running max and sum, the same for all of it, share their loop with the weighted sums (bench/fuzz.py --patterns)
  q, k, v = randn(1, 3), randn(3, 3), randn(3, 17)
  want = np.concatenate([attention(q, k, v, scale=0.125)[0], [2.0, 2.0]])
  for model in (False, True):   # (on a GPU the scores are the same for all the kernel's outputs: a thread each)
    dev = "CPU" if model else None
    t = attention(Tensor(q, device=dev), Tensor(k, device=dev), Tensor(v, device=dev), scale=0.125).reshape((17,))
    t = t.cat(Tensor.full((2,), 2.0, device=dev), axis=0)
    np.testing.assert_allclose(run_on_model_gpu(t)[0] if model else t.numpy(), want, rtol=2e-5, atol=2e-5)


def test_no_tq_by_tk_buffer_at_4096():
  q, k, v = (Tensor(np.zeros((1, 4096, 64), np.float32)) for _ in range(3))
  program = plan([(attention(q, k, v, Tensor(causal(4096, 4096))).uop, "CPU")])
  assert kernel_calls(program) == 1 and program.unplanned_bytes == 0, str(program)
  assert "4096x4096" not in str(program) and all(s[0] != "alloc" for s in program.steps)


def test_the_unfused_form_without_the_rule_gives_the_same_values():
  # the three kernels the graph makes without the rule (scores, probabilities, product) as the reference of the rule
  q, k, v, m = make_case((2, 30, 16), 30, 16, "causal")
  fused = run_fused(q, k, v, m)
  with unfused_attention():
    unfused = attention(Tensor(q), Tensor(k), Tensor(v), Tensor(m)).numpy()
    assert kernel_calls(last_program()) >= 3
  np.testing.assert_allclose(fused, unfused, rtol=2e-5, atol=2e-5)


def debug2_lines(monkeypatch, capsys, t: Tensor) -> str:
  monkeypatch.setenv("DEBUG", "2")
  t.numpy()
  return capsys.readouterr().out


def test_debug2_says_what_was_fused(monkeypatch, capsys):
  q, k, v = (Tensor(randn(2, 20, 8)) for _ in range(3))
  out = debug2_lines(monkeypatch, capsys, attention(q, k, v))
  assert "attention fused: softmax(scores (2, 20, 20)) @ values (head dimension 8) is one kernel" in out
  assert "no 20x20 buffer" in out


def test_graft_attention_changes_a_warm_calls_program_too(monkeypatch):
  q, k, v = (Tensor(randn(2, 20, 8)) for _ in range(3))
  attention(q, k, v).realize()
  assert kernel_calls(last_program()) == 1
  monkeypatch.setenv("GRAFT_ATTENTION", "0")   # the same graph again: not the fused program of the call before
  out = attention(q, k, v).realize()
  assert kernel_calls(last_program()) >= 3
  np.testing.assert_allclose(out.numpy(), attention(q.numpy(), k.numpy(), v.numpy()), rtol=1e-5, atol=1e-6)


def test_by_default_the_cpu_fuses_every_attention_and_a_gpu_those_whose_rows_fill_it(monkeypatch, capsys):
  monkeypatch.delenv("GRAFT_ATTENTION")
  q, k, v = (Tensor(randn(2, 21, 8), device="CPU") for _ in range(3))
  out = debug2_lines(monkeypatch, capsys, attention(q, k, v))
  assert "attention fused: softmax(scores (2, 21, 21))" in out and "attention tiled" in out
  assert kernel_calls(last_program()) == 1
  gpu = plan([(attention(q, k, v).uop, "CPU")], "CUDA")
  assert any("its 42 query rows give the GPU's fused kernel 84 threads, under the 33792" in line for line in gpu.explanations), gpu.explanations
  assert kernel_calls(gpu) >= 3
  q, k, v = (Tensor(np.zeros((32, 1024, 64), np.float32), device="CPU") for _ in range(3))   # 65536 threads: fused
  gpu = plan([(attention(q, k, v).uop, "CPU")], "CUDA")
  assert kernel_calls(gpu) == 1 and tiled(gpu)
  monkeypatch.setenv("GRAFT_ATTENTION", "0")
  assert kernel_calls(plan([(attention(q, k, v).uop, "CPU")])) >= 3
  assert kernel_calls(plan([(attention(q, k, v).uop, "CPU")], "CUDA")) >= 3


def test_half_precision_is_not_fused_and_still_right():
  # float16 softmax and products widen to float32 inside (tensor/nn.py): a graph of its own, not recognized yet
  q, k, v = randn(2, 20, 8), randn(2, 20, 8), randn(2, 20, 8)
  t = attention(*(Tensor(x).cast(dtypes.float16) for x in (q, k, v)))
  np.testing.assert_allclose(t.numpy().astype(np.float32), attention(q, k, v), rtol=2e-2, atol=2e-2)
  assert kernel_calls(last_program()) >= 3


def test_a_head_dimension_too_wide_for_registers_falls_back_and_says_why(monkeypatch, capsys):
  d = MAX_HEAD[False] + 8
  q, k, v = randn(1, 6, 4), randn(1, 6, 4), randn(1, 6, d)
  t = attention(Tensor(q), Tensor(k), Tensor(v))
  out = debug2_lines(monkeypatch, capsys, t)
  assert f"a row of {d} accumulators does not fit" in out
  assert kernel_calls(last_program()) >= 2
  np.testing.assert_allclose(t.numpy(), attention(q, k, v), rtol=2e-5, atol=2e-5)


def test_a_softmax_not_over_the_keys_is_not_attention():
  # softmax over the query axis, then a product: not an online softmax over the product's reduced axis
  q, k, v = randn(2, 12, 8), randn(2, 12, 8), randn(2, 12, 8)
  qt, kt, vt = Tensor(q), Tensor(k), Tensor(v)
  got = (qt @ kt.transpose(-1, -2)).softmax(1) @ vt
  np.testing.assert_allclose(got.numpy(), softmax_np((q @ k.transpose(0, 2, 1)).swapaxes(1, 2)).swapaxes(1, 2) @ v, rtol=2e-5, atol=2e-5)
  assert kernel_calls(last_program()) >= 2


# ---- the GPU: the same kernel in the numpy model of a CUDA grid, and its source through nvcc ----
@pytest.mark.parametrize("qshape,tk,dv,mask", CASES)
def test_fused_attention_in_the_model_gpu_grid(qshape, tk, dv, mask):
  q, k, v, m = make_case(qshape, tk, dv, mask)
  got = run_on_model_gpu(attention(*(Tensor(x, device="CPU") for x in (q, k, v)), None if m is None else Tensor(m, device="CPU")))
  np.testing.assert_allclose(got[0], attention(q, k, v, m), rtol=2e-5, atol=2e-5)


def cuda_sources(t: Tensor) -> list[str]: return t.kernel_sources(device="CUDA")


def generic_cuda_source(t: Tensor) -> str:
  """The CUDA source of t's one kernel as the generic GPU stages render it (the tiled kernel's fallback)."""
  from renderers.cuda import renderer
  (step,) = [s for s in host_steps([t])[0] if s.op is Ops.CALL]
  return renderer.render("k", lower_kernel(step.arg, Run("CPU", parallel=False, device_loops=True)))


def run_tiled_on_cpu_threads(*tensors: Tensor) -> list[np.ndarray]:
  """The tensors through the GPU's host program, the fused attention kernels as renderers/attention_cuda.py writes
  them, run on CPU threads (tests/cuda_threads.py), the other kernels in the numpy model of a grid."""
  from renderers.cuda import renderer as cuda_renderer
  from runtime.realize import tiled_attention
  steps, realized = host_steps(tensors)
  arrays: dict = {}
  def array_of(b):
    if b not in arrays: arrays[b] = np.zeros(b.arg.size, b.dtype.np) if isinstance(b.arg, NewBuffer) else b.arg.numpy().copy()
    return arrays[b]
  for step in (s for s in steps if s.op is Ops.CALL):
    tiled, _ = tiled_attention(step.arg, cuda_renderer, 132, "sm_90")   # as runtime/realize.py asks it, on an H100
    if tiled is None:
      run_grid(lower_kernel(step.arg, Run("CPU", parallel=False, device_loops=True)), {i: array_of(b) for i, b in enumerate(step.src)})
      continue
    src, ((blocks, _, _), (threads, _, _)), _, args = tiled
    launch(src, "KERNEL_NAME", [array_of(step.src[n]) for n in args], blocks, threads)
  return [array_of(u.src[0]).reshape(t.shape) for u, t in zip(realized, tensors)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.parametrize("qshape,tk,dv,mask", CASES + [((2, 150, 64), 150, 64, "causal"), ((1, 200, 128), 131, 128, None)])
def test_the_gpus_tiled_kernel_on_cpu_threads(qshape, tk, dv, mask):
  # the CUDA source itself (its tiles, swizzles, barriers and shuffles), one CPU thread per CUDA thread: several tiles
  # of keys and of rows, lengths past them, a head of 128
  q, k, v, m = make_case(qshape, tk, dv, mask)
  got = run_tiled_on_cpu_threads(attention(*(Tensor(x, device="CPU") for x in (q, k, v)), None if m is None else Tensor(m, device="CPU")))
  np.testing.assert_allclose(got[0], attention(q, k, v, m), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_the_gpus_tiled_kernel_reads_heads_of_one_product_and_a_filled_causal_mask():
  # a GPT's attention: q, k and v are heads of one qkv product (strided views), tril's mask through masked_fill, the
  # heads merged back as the output is stored
  b, t, h, d = 2, 77, 3, 32
  x = randn(b, t, 3 * h * d)
  def heads(a, n, permute):
    a = a[:, :, n * h * d:(n + 1) * h * d].reshape(b, t, h, d)
    return a.permute(0, 2, 1, 3) if permute else a.transpose(0, 2, 1, 3)
  X = Tensor(x, device="CPU")
  s = (heads(X, 0, True) @ heads(X, 1, True).transpose(-1, -2)) * (1 / math.sqrt(d))
  s = s.masked_fill(Tensor(np.tril(np.ones((t, t), np.float32)), device="CPU") == 0, -math.inf)
  out = (s.softmax(-1) @ heads(X, 2, True)).permute(0, 2, 1, 3).reshape(b, t, h * d)
  want = attention(heads(x, 0, False), heads(x, 1, False), heads(x, 2, False), causal(t, t)).transpose(0, 2, 1, 3).reshape(b, t, h * d)
  np.testing.assert_allclose(run_tiled_on_cpu_threads(out)[0], want, rtol=2e-5, atol=2e-5)


def test_on_a_gpu_the_kernel_stages_tiles_in_shared_memory_and_holds_register_tiles():
  q, k, v = (Tensor(np.zeros((32, 1024, 64), np.float32), device="CPU") for _ in range(3))
  gpu = plan([(attention(q, k, v).uop, "CPU")], "CUDA")
  (ck,) = gpu.kernels_called()
  src = ck.source
  assert tiled(gpu) and gpu.peak_bytes < 32 * 1024 * 1024 * 4   # (the inputs copied to the GPU, no scores)
  # blocks of 128 query rows, 256 threads (two blocks a multiprocessor: one wave of 256 blocks on an H100); q, k, v
  # and the probabilities in dynamic shared memory; a thread's 4 x 8 scores and 4 x 8 accumulators in registers,
  # read with 16-byte loads from the tiles
  assert ck.global_size == (32 * 1024 // 128, 1, 1) and ck.local_size == (256, 1, 1)
  assert "__launch_bounds__(256, 2)" in src and "G_SHARED(" in src and "g_dynamic_shared" in src
  assert "float s[4][8];" in src and "acc[4][8]" in src and src.count("*(const floatx4*)(") >= 5
  # k and v tiles of 64 keys, refilled each step (barriers); a row's max over its 8 threads by shuffles; a tile
  # masked for the whole block skipped
  assert "j0 += 64" in src and src.count("__shfl_xor_sync") == 6 and "__syncthreads_or(live)" in src
  assert "1048576" not in src and "1024*1024" not in src   # no 1024 x 1024 scores anywhere


def test_on_a_gpu_the_blocks_are_those_whose_tiles_fit_the_architectures_shared_memory():
  # a head of 128: blocks of 128 rows take 161 KiB of shared tiles, past the 99 KiB a block may have on sm_86 (consumer
  # Ampere; Ada, sm_120 too): there the kernel takes blocks that fit, not a launch that fails
  from renderers.cuda import renderer as cuda_renderer
  from runtime.realize import tiled_attention
  from rules.opt.tensor_core import max_shared
  q, k, v = (Tensor(np.zeros((32, 1024, 128), np.float32), device="CPU") for _ in range(3))
  (step,) = [s for s in host_steps([attention(q, k, v)])[0] if s.op is Ops.CALL]
  shared = {}
  for arch in ("sm_90", "sm_86"):
    (src, *_), note = tiled_attention(step.arg, cuda_renderer, 108, arch)
    shared[arch] = int(re.search(r"G_SHARED\((\d+)\)", src).group(1))
    assert shared[arch] <= max_shared(arch) and note.startswith("attention tiled")
  assert shared["sm_86"] < 99 << 10 < shared["sm_90"]


def test_the_generic_gpu_kernel_with_few_rows_splits_their_keys_over_lanes():
  q, k, v = (Tensor(np.zeros((1, 1024, 64), np.float32), device="CPU") for _ in range(3))
  src = generic_cuda_source(attention(q, k, v))
  # 1024 rows cannot fill a GPU: a row's keys in LANES chunks, one a thread, each with 64 weighted sums, the running max
  # and sum in registers, one loop over its 1024/8/LANES blocks of keys (the dot products unrolled: the query row's
  # loads stay out of the loop)
  assert src.count("float acc") == 64 + 2 and "__shared__" not in src
  assert src.count("for (int ridx") == 1 and f"< {1024 // BLOCK // LANES}; " in src
  # the chunks combined: the largest running max, then the rescaled sums and the 64 weighted sums
  assert src.count(f"g_row_reduce<{LANES}, float>(") == 1 + 1 + 64


def test_the_generic_gpu_kernel_with_many_rows_takes_a_thread_a_row():
  q, k, v = (Tensor(np.zeros((64, 1024, 64), np.float32), device="CPU") for _ in range(3))
  src = generic_cuda_source(attention(q, k, v))
  assert "g_row_reduce" not in src and src.count("float acc") == 64 + 2 and f"< {1024 // BLOCK}; " in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_generated_cuda_compiles_for_sm90_without_spills(tmp_path):
  # the tiled kernel (a causal mask, heads, odd lengths; the benchmark's shape; a head of 128) and the generic one:
  # nvcc compiles them, and the register tiles stay in registers (ptxas spills none)
  from renderers.cuda import renderer
  T = lambda *shape: Tensor(randn(*shape), device="CPU")
  q, k, v = T(2, 4, 37, 64), T(2, 4, 37, 64), T(2, 4, 37, 64)
  masked = attention(q, k, v, Tensor(causal(37, 37), device="CPU"))
  kernels = [*cuda_sources(masked), *cuda_sources(attention(*(T(32, 1024, 64) for _ in range(3)))),
             *cuda_sources(attention(*(T(2, 300, 128) for _ in range(3)))), generic_cuda_source(masked).replace(" k(", " generic(")]
  (tmp_path / "attn.cu").write_text(renderer.source(kernels))
  done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "attn.cubin"), str(tmp_path / "attn.cu")],
                        check=True, capture_output=True, text=True)
  spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
  assert len(spills) == 4 and set(spills) == {"0"}, done.stderr


def test_whether_the_gpu_fuses_attention_follows_its_multiprocessor_count(monkeypatch):
  # 4 x 1024 query rows give the fused kernel 8192 threads: under what keeps an H100's 132 multiprocessors busy (the
  # unfused kernels), enough for a GPU of 16 (one kernel). The runtime asks the driver for the count (Run.multiprocessors)
  from rules.pipeline import Run, schedule
  monkeypatch.delenv("GRAFT_ATTENTION")   # (the module's tests fuse at every size)
  q, k, v = (Tensor(randn(4, 1024, 64)) for _ in range(3))
  out = attention(q, k, v)
  kernels = lambda sms: schedule([out.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True, multiprocessors=sms))[0]
  assert len(kernels(132)) > 1 and len(kernels(16)) == 1
