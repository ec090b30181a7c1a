"""Tensor cores (rules/opt/tensor_core.py): a 16-bit product summed in float32 becomes one block tile of mma.sync per
block, its epilogue applied to each accumulator. Without a GPU: the plan, the CUDA text, nvcc for sm_90, and the
graph around MMA run in the numpy model of a grid (tests/test_gpu_stages.py) with MMA modelled by mma.sync's documented
accumulator layout; on a GPU (DEVICE=CUDA runs): the numbers against numpy with 16-bit tolerances."""
import os, re
import numpy as np
import pytest
from numpy.testing import assert_allclose

from rewrite import Ops, dtypes
from rewrite.dtypes import bf16_to_float32, bf16_bits
from rules.opt.plan import OptKind
from rules.opt.tensor_core import TileSpec
from tensor import Tensor


def normal(*shape, dtype=np.float16, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def cuda_text(t) -> str:
  (src,) = t.kernel_sources(device="CUDA")
  return src


def test_a_translation_unit_has_the_half_headers_only_where_a_kernel_needs_them():
  # parsing cuda_fp16.h and cuda_bf16.h is about half of nvcc's time for a small float32 kernel (a first call)
  from renderers.cuda import renderer
  x = Tensor(normal(64, 64, dtype=np.float32))
  single = renderer.source([cuda_text((x * 2).relu())])
  assert "cuda_fp16.h" not in single and "g_block_reduce" in single   # the reductions' prelude is always there
  assert "cuda_fp16.h" in renderer.source([cuda_text((x * 2).relu()), cuda_text(x.half() + 1)])   # one of them
  assert "cuda_bf16.h" in renderer.source([cuda_text(x.bfloat16() * 2)])


def test_a_half_product_is_a_block_tile_of_mma_from_shared_memory():
  from renderers.cuda import renderer
  a, w = Tensor(normal(256, 128)), Tensor(normal(128, 256))
  src = cuda_text(a @ w)
  assert "g_mma_tile<half, 64, 64, 32, 2, 2, 3, false, 128, 128LL, 256LL>" in src   # B stored along j: ldmatrix.trans
  prelude = renderer.source([src])   # (the prelude comes with a kernel that uses it)
  for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4", "__shared__",
                 "cp.async.cg.shared.global", "__syncthreads()"):
    assert needle in prelude, needle
  # its tiles live in dynamic shared memory, whose size the kernel declares for the runtime to launch it with
  from runtime.cuda import dynamic_shared_bytes
  name = src.split(" void ")[1].split("(")[0]
  assert dynamic_shared_bytes(src, name) == (64 + 64) * 32 * 2 * 3
  assert dynamic_shared_bytes(cuda_text(a + 1), name) == 0
  # x @ W.T reads W's rows along k: plain ldmatrix; bfloat16 takes the bf16 mma
  assert ", true, 128, 128LL, 128LL>" in cuda_text(a @ Tensor(normal(256, 128)).T)
  ab, wb = (Tensor(normal(*s, dtype=np.float32), dtype="bfloat16") for s in ((256, 128), (128, 256)))
  assert "g_mma_tile<__nv_bfloat16," in cuda_text(ab @ wb)
  assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in prelude


def test_the_epilogue_is_applied_to_each_accumulator_before_its_store():
  x, w, b = Tensor(normal(128, 64)), Tensor(normal(64, 128)), Tensor(normal(128))
  src = cuda_text((x @ w + b).gelu())
  regs = TileSpec("float16", 64, 64, 2, 2, 32, 3, False, 64, 64, 128).regs
  assert src.count("exp2f(") == regs   # one activation per accumulator
  # a lane's two neighbouring columns stored together (4 bytes), and the sigmoid's reciprocal approximate: the value is
  # rounded to 16 bits before it is stored
  assert src.count("*(half2*)(data0+") == regs // 2 and src.count("*(data0+") == 0
  assert src.count("g_rcp_approx(") == regs and "(1.0f/" not in src


def test_a_float32_epilogue_keeps_its_stores_and_an_ieee_reciprocal():
  x, w = Tensor(normal(128, 64)), Tensor(normal(64, 128))
  src = cuda_text((x @ w).float().sigmoid())   # stored as float32: nothing rounds the reciprocal's error away
  regs = TileSpec("float16", 64, 64, 2, 2, 32, 3, False, 64, 64, 128).regs
  assert "g_mma_tile<" in src and src.count("*(data0+") == regs and src.count("(1.0f/") == regs
  assert "g_rcp_approx" not in src and "half2" not in src
  xb, wb = (Tensor(normal(*s, dtype=np.float32), dtype="bfloat16") for s in ((128, 64), (64, 128)))
  assert cuda_text((xb @ wb).relu()).count("__halves2bfloat162(") == regs // 2


def test_the_plan_is_recorded_as_tensor_core_records():
  from rules.pipeline import Run, lower_kernel, schedule
  from rules.realize import normalize
  a, w = Tensor(normal(3, 64, 32)), Tensor(normal(3, 32, 128))
  (k,) = [k for k in schedule([(a @ w).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if k.op is Ops.KERNEL]
  linear = lower_kernel(normalize(k)[0], Run("CUDA", parallel=False, device_loops=True))
  (mma,) = [u for u in linear.src if u.op is Ops.MMA]
  assert mma.dtype is dtypes.float32.vec(mma.arg.regs) and mma.arg.k == 32
  specials = {u.arg for u in linear.src if u.op is Ops.SPECIAL}
  assert specials == {("gidx0", 3 * (64 // mma.arg.bm) * (128 // mma.arg.bn)), ("lidx0", mma.arg.threads)}


@pytest.mark.parametrize("make", [
  lambda: Tensor(normal(100, 64)) @ Tensor(normal(64, 128)),        # rows do not divide a tile
  lambda: Tensor(normal(128, 40)) @ Tensor(normal(40, 128)),        # k does not divide a slice
  lambda: Tensor(normal(128, 64, dtype=np.float32)) @ Tensor(normal(64, 128, dtype=np.float32)),  # float32: no TF32 by default
  lambda: Tensor(normal(128, 64)).float() @ Tensor(normal(64, 128, dtype=np.float32)),
], ids=["odd-rows", "odd-k", "float32", "mixed"])
def test_what_does_not_fit_stays_on_the_other_gpu_plans(make):
  assert "g_mma_tile" not in "".join(make().kernel_sources(device="CUDA"))


def kernels_of(t) -> list[tuple[str, bool]]:
  """(name, on tensor cores?) of each kernel realizing t would compile for a GPU."""
  return [(src.split(" void ")[1].split("(")[0], "g_mma_tile" in src) for src in t.kernel_sources(device="CUDA")]


@pytest.mark.parametrize("make", [
  lambda x, g: (x.layernorm(-1) * g) @ Tensor(normal(256, 384)),                       # a layer norm before the product
  lambda x, g: (x.float() * 2).half() @ Tensor(normal(256, 384)),                        # any computed half operand
  lambda x, g: Tensor(normal(4, 128, 64)).permute(1, 0, 2).reshape(128, 256) @ Tensor(normal(256, 256)),  # heads merged
], ids=["layernorm", "computed", "heads-merged"])
def test_a_computed_or_rearranged_half_operand_is_stored_as_halves_and_the_product_stays_on_tensor_cores(make):
  x, g = Tensor(normal(128, 256)), Tensor(normal(256))
  stored, product = kernels_of(make(x, g))
  assert not stored[1] and product[1]
  (src, _) = make(x, g).kernel_sources(device="CUDA")
  assert src.split(" void ")[1].split("(")[1].startswith("half* __restrict__ data0")   # the operand's buffer holds halves, not floats


def half_attention_layer(device: str = "CPU", T: int = 256, D: int = 256, H: int = 4) -> Tensor:
  import math
  x, w_qkv, w_proj = (Tensor(normal(*s, seed=i) * 0.1, device=device) for i, s in enumerate([(T, D), (D, 3 * D), (D, D)]))
  q, k, v = (x.layernorm(-1) @ w_qkv).reshape(T, 3, H, D // H).permute(1, 2, 0, 3)   # one product for q, k and v
  causal = Tensor.full((T, T), True, device=device).triu(1)
  p = (q @ k.transpose(-1, -2) * (1 / math.sqrt(D // H))).masked_fill(causal, -math.inf).softmax(-1)
  return (p @ v).permute(1, 0, 2).reshape(T, D) @ w_proj


def test_every_product_of_a_float16_transformer_layer_runs_on_tensor_cores():
  kernels = kernels_of(half_attention_layer())
  assert sum(on for _, on in kernels) == 4, kernels   # qkv, q @ k.T, p @ v, the projection


def test_graft_tc_0_turns_the_stage_off(monkeypatch):
  monkeypatch.setenv("GRAFT_TC", "0")
  assert "g_mma_tile" not in cuda_text(Tensor(normal(128, 64)) @ Tensor(normal(64, 192)))


def test_graft_tc_tile_imposes_a_tile_and_refuses_one_that_cannot_be(monkeypatch):
  monkeypatch.setenv("GRAFT_TC_TILE", "128,256,2,4,32,4")
  src = cuda_text(Tensor(normal(256, 64)) @ Tensor(normal(64, 512)))
  assert "g_mma_tile<half, 128, 256, 32, 2, 4, 4," in src and "__launch_bounds__(256) G_SHARED(98304)" in src
  for bad in ("128,128,2,2,32", "128,128,3,2,32,3", "256,256,2,2,64,4", "a,b"):
    monkeypatch.setenv("GRAFT_TC_TILE", bad)
    with pytest.raises(ValueError, match="GRAFT_TC_TILE"): cuda_text(Tensor(normal(256, 64)) @ Tensor(normal(64, 512)))


def wgmma_programs() -> list[Tensor]:
  """Products large enough for a WGMMA tile to give each of an H100's 132 multiprocessors a block."""
  x, w, b = Tensor(normal(2048, 512)), Tensor(normal(512, 4096)), Tensor(normal(4096))
  xb, wb = (Tensor(normal(*s, dtype=np.float32), dtype="bfloat16") for s in ((1024, 256), (256, 2304)))
  return [x @ w, (x @ w + b).gelu(), x @ Tensor(normal(4096, 512)).T, xb @ wb,
          Tensor(normal(4, 1024, 128)) @ Tensor(normal(4, 128, 1024))]


def test_on_hopper_a_large_half_product_is_a_tile_of_warpgroup_mma():
  from renderers.cuda import renderer
  from runtime.cuda import NO_RUNTIME_HEADER, dynamic_shared_bytes, target_flags
  nn, gelu, nt, bf16, batched = (cuda_text(p) for p in wgmma_programs())
  # a batch keeps the tiles copied by cp.async (renderers/cuda_wgmma.py); matrices are copied by TMA (below)
  assert "g_wgmma_tile<half, 128, 128, 4, false, 128, 128LL, 1024LL>" in batched and "g_mma_tile" not in batched
  name = batched.split(" void ")[1].split("(")[0]
  assert "__launch_bounds__(256)" in batched and dynamic_shared_bytes(batched, name) == 4 * (128 + 128) * 64 * 2 + 1024
  regs = TileSpec("float16", 128, 256, 8, 1, 64, 4, False, 512, 512, 4096, True).regs
  # the epilogue per accumulator, a pair of columns written at a time into the staging tile (stored by TMA: below)
  assert regs == 128 and gelu.count("exp2f(") == regs and len(re.findall(r"\*\(half2\*\)\(local\d+\+", gelu)) == regs // 2
  source = renderer.source([batched, bf16])
  for needle in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                 "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned",
                 "fence.proxy.async.shared::cta", "cp.async.cg.shared.global"):
    assert needle in source, needle
  assert "wgmma" not in renderer.source([cuda_text(Tensor(normal(256, 128)) @ Tensor(normal(128, 256)))])  # mma.sync: no prelude
  assert target_flags(source, "sm_90") == ["-gencode=arch=compute_90a,code=sm_90a"] and target_flags(source, "sm_80") == ["-arch=sm_80"]
  # (a source of no kernel needs no header: it is self-contained, compiled with the empty cuda_runtime.h's directory)
  assert target_flags(renderer.source([]), "sm_90") == ["-arch=sm_90", "-I", str(NO_RUNTIME_HEADER)]


def test_a_matrix_product_on_hopper_takes_its_tiles_by_tma_from_a_producer_warpgroup():
  from renderers.cuda import renderer
  from runtime.cuda import TensorMapDecl, cluster_blocks, dynamic_shared_bytes, kernel_params, persistent, tensor_maps
  nn, gelu, nt, bf16, batched = (cuda_text(p) for p in wgmma_programs())
  # 2 consumer warpgroups and the producer's; 4 slices of 128x256 (6 of 128x128) and their two mbarriers each; clusters
  # of 2 blocks (consecutive rows of tiles, the same columns) sharing B's tile by multicast
  # (the output stored by TMA from a staging tile in 2 parts: below)
  assert "g_tma_pipeline<half, 128, 256, 4, false, 512, 2, 2>" in nn and "__launch_bounds__(384, 1)" in nn   # B along j
  assert "g_tma_pipeline<half, 128, 256, 4, true, 512, 2, 2>" in nt                                        # B along k
  assert "g_tma_pipeline<__nv_bfloat16, 128, 128, 6, false, 256, 2, 2>" in bf16   # 128x256 gives 72 blocks: 128x128
  assert "__cluster_dims__(2, 1, 1)" in nn and cluster_blocks(nn, nn.split(" void ")[1].split("(")[0]) == 2
  # each block waits for the other at its end (neither ends while the other may still arrive on its barriers)
  assert nn.count("g_pipe.finish();") == 2
  assert "g_tma_pipeline<" in gelu and "g_tma_pipeline<" not in batched   # (a batch: cp.async)
  name = nn.split(" void ")[1].split("(")[0]
  assert dynamic_shared_bytes(nn, name) == 4 * (128 + 256) * 64 * 2 + 1024 + 4 * 16 + 128 * 128 * 2   # (+ half a tile staged)
  # persistent: the producer's thread and the consumers each loop over the block's tiles (2048/128 x 4096/256 of them;
  # the host launches at most a block a multiprocessor), the producer copying on into the next tile during the stores
  assert persistent(nn, name) and not persistent(batched, batched.split(" void ")[1].split("(")[0])
  # a long k (65 slices of 64) keeps a block per tile, the hardware handing them out as multiprocessors free up
  long = cuda_text(Tensor(np.zeros((2048, 4160), np.float16)) @ Tensor(np.zeros((4160, 4096), np.float16)))
  # (and takes no cluster: a cluster's blocks start and end together, which a block per tile measured slower)
  assert "g_tma_pipeline<half, 128, 256, 4, false, 4160, 1, 2>" in long and "__cluster_dims__" not in long and not persistent(long, long.split(" void ")[1].split("(")[0])
  assert nn.count("for (int g_tile = blockIdx.x; g_tile < 256; g_tile += gridDim.x) {") == 2
  assert nn.index("g_pipe.produce(") < nn.index("g_pipe.consume(") < nn.index("g_pipe.store_tile(")
  # the maps, made by the host from the buffers' pointers: A 2048 rows of 512 k in boxes of 64 x 128 rows; B (along j)
  # 512 rows of 4096 columns in boxes of 64 x 64; B along k, 4096 rows of 512 k in boxes of 64 x 128 (a block's half)
  # the output (below) 2048 rows of 4096 columns in boxes of 64 x 64
  assert tensor_maps(nn, name) == [TensorMapDecl(1, 2, 512, 2048, 512, 64, 128, 0), TensorMapDecl(2, 2, 4096, 512, 4096, 64, 64, 0),
                                   TensorMapDecl(0, 2, 4096, 2048, 4096, 64, 64, 0)]
  assert tensor_maps(nt, nt.split(" void ")[1].split("(")[0])[1] == TensorMapDecl(2, 2, 512, 4096, 512, 64, 128, 0)
  assert kernel_params(nn, name) == ["CUdeviceptr"] * 3 + ["CUtensorMap"] * 3
  source = renderer.source([nn])
  for needle in ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.try_wait.parity",
                 "mbarrier.arrive.expect_tx", "setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32",
                 ".multicast::cluster", "mapa.shared::cluster", "barrier.cluster.wait",
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16"):
    assert needle in source, needle
  assert "cp.async.cg" not in source.split("g_tma_pipeline")[1]   # (the TMA template copies nothing itself)
  # an offset view keeps TMA where its start is a whole number of 16 bytes, its offset in the map
  x, w = Tensor(normal(2056, 512)), Tensor(normal(512, 4096))
  shifted = cuda_text(x[8:] @ w)
  assert tensor_maps(shifted, shifted.split(" void ")[1].split("(")[0])[0].offset == 8 * 512


def test_a_tma_tiles_half_output_is_stored_by_tma_from_a_staging_tile(monkeypatch):
  import rules.opt.tensor_core as tc
  from renderers.cuda import renderer
  x, w, b = Tensor(normal(2048, 512)), Tensor(normal(512, 4096)), Tensor(normal(4096))
  gelu = cuda_text((x @ w + b).gelu())
  body = gelu.split("g_pipe.consume(")[1]
  # each consumer warpgroup writes its rows of a part (128 of the 256 columns) into the staging tile, then its first
  # thread stores them by TMA; the next part waits until the copy engine has read the part before; the block waits for
  # its stores before it ends. No lane stores the output itself.
  assert "(data0+" not in body and body.count("g_pipe.store_wait();") == 2 and body.count("g_pipe.store_tile(g_map_c,") == 2
  first, second = (re.search(rf"\* (local\d+) = \(half\*\)\(g_dynamic_shared \+ g_pipe.staged\);   /\* G_STAGE {p} \*/", gelu).group(1) for p in (0, 1))
  assert body.index("g_pipe.store_wait();") < body.index(f"({first}+") < body.rindex(f"({first}+") < body.index("store_tile(g_map_c, v34, v32, 0);") \
    < body.rindex("g_pipe.store_wait();") < body.index(f"({second}+") < body.rindex(f"({second}+") < body.index("store_tile(g_map_c, v34, v32, 1);") \
    < body.index("g_pipe.store_drain();")
  assert "half* __restrict__ data0" in gelu and "const half* __restrict__ data0" not in gelu   # (written, by TMA)
  source = renderer.source([gelu])
  for needle in ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group", "cp.async.bulk.commit_group", "fence.proxy.async.shared::cta",
                 "cp.async.bulk.wait_group.read 0", "cp.async.bulk.wait_group 0", "bar.sync %0, 128"):
    assert needle in source, needle
  # a float32 output keeps its lanes' stores (and the stages the staging tile would take)
  wide = cuda_text(x.matmul(w, dtype=dtypes.float32))
  assert "g_tma_pipeline<half, 128, 256, 4, false, 512, 2> g_pipe;" in wide and "*(data0+" in wide and "store_tile" not in wide
  # the whole tile staged (one part: 64 KiB, a slice fewer in flight), or none (TMA_STORE_PARTS = 0: the lanes store)
  monkeypatch.setattr(tc, "TMA_STORE_PARTS", 1)
  assert "g_tma_pipeline<half, 128, 256, 3, false, 512, 2, 1> g_pipe;" in cuda_text(x @ w)
  monkeypatch.setattr(tc, "TMA_STORE_PARTS", 0)
  assert "*(half2*)(data0+" in cuda_text(x @ w)


def test_wgmma_only_on_sm_90_and_graft_wgmma_0_turns_it_off(monkeypatch):
  from rules.pipeline import Run, schedule, lower_kernel
  from rules.realize import normalize
  x, w = Tensor(normal(2048, 512)), Tensor(normal(512, 4096))
  (k,) = [k for k in schedule([(x @ w).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if k.op is Ops.KERNEL]
  def spec(arch):
    (mma,) = [u for u in lower_kernel(normalize(k)[0], Run("CUDA", parallel=False, device_loops=True, arch=arch)).src if u.op is Ops.MMA]
    return mma.arg
  assert spec("sm_90").wgmma and not spec("sm_89").wgmma and not spec("sm_100").wgmma   # sm_90a's wgmma is Hopper's alone
  monkeypatch.setenv("GRAFT_WGMMA", "0")
  assert not spec("sm_90").wgmma
  assert "g_wgmma_tile" not in cuda_text(x @ w)


def test_changing_a_tensor_core_switch_between_calls_never_reuses_the_kernel_of_the_other_setting(monkeypatch):
  from runtime import realize as rr
  lowered, lower = [], rr._lower
  monkeypatch.setattr(rr, "_lower", lambda *a, **kw: lowered.append(lower(*a, **kw)) or lowered[-1])
  product = lambda: Tensor(normal(2048, 512)) @ Tensor(normal(512, 4096))
  assert "g_tma_pipeline<" in cuda_text(product())
  monkeypatch.setattr(rr, "_kernels", dict(lowered[-1].new))   # published, as a build on a GPU publishes them
  assert "g_tma_pipeline<" in cuda_text(product()) and not lowered[-1].new   # the same switches: the kernel reused
  monkeypatch.setenv("GRAFT_TC_TILE", "128,256,2,4,32,4")
  assert "g_mma_tile<half, 128, 256, 32, 2, 4, 4," in cuda_text(product())
  monkeypatch.delenv("GRAFT_TC_TILE")
  monkeypatch.setenv("GRAFT_WGMMA", "0")
  assert "g_mma_tile<half, 128, 128," in cuda_text(product())
  monkeypatch.setenv("GRAFT_TC", "0")
  assert "mma_tile" not in cuda_text(product())


def test_before_ampere_a_half_product_stays_on_the_other_gpu_plans(tmp_path):
  from rules.pipeline import Run, schedule, lower_kernel
  from rules.realize import normalize
  from renderers.cuda import renderer
  from runtime import cuda
  from runtime.device import CompileError
  x, w = Tensor(normal(256, 128)), Tensor(normal(128, 256))
  (k,) = [k for k in schedule([(x @ w).uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if k.op is Ops.KERNEL]
  lower = lambda arch: lower_kernel(normalize(k)[0], Run("CUDA", parallel=False, device_loops=True, arch=arch))
  assert any(u.op is Ops.MMA for u in lower("sm_80").src)
  turing = lower("sm_75")   # a T4: no cp.async, no mma.sync m16n8k16
  assert not any(u.op is Ops.MMA for u in turing.src)
  try: nvcc = cuda.find_nvcc()
  except CompileError: pytest.skip("nvcc not found: CUDA kernels not compiled")
  src, out = tmp_path / "t4.cu", tmp_path / "t4.cubin"
  src.write_text(renderer.source([renderer.render("product", turing)]))
  cuda._run_nvcc(nvcc, "sm_75", src, out)
  assert out.stat().st_size > 0


def test_every_tensor_core_kernel_compiles_for_sm_90(tmp_path, monkeypatch):
  from runtime import cuda
  from runtime.device import CompileError
  from renderers.cuda import renderer
  try: nvcc = cuda.find_nvcc()
  except CompileError: pytest.skip("nvcc not found: CUDA kernels not compiled")
  x, w, b = Tensor(normal(512, 256)), Tensor(normal(256, 512)), Tensor(normal(512))
  programs = [x @ w, (x @ w + b).gelu(), (x @ w).relu() + x[:, :1], x @ Tensor(normal(512, 256)).T,
              Tensor(normal(4, 128, 64)) @ Tensor(normal(4, 64, 128)),
              Tensor(normal(512, 256, dtype=np.float32), dtype="bfloat16") @ Tensor(normal(256, 512, dtype=np.float32), dtype="bfloat16"),
              Tensor(normal(2048, 32)) @ Tensor(normal(32, 2048)), x.matmul(w, dtype=dtypes.float32),   # k 32: mma.sync
              *wgmma_programs(), conv_case(np.float16, n=8, c=64, o=128, hw=(48, 48), bias=True)[0],   # (a conv on wgmma)
              Tensor(normal(16896, 576)) @ Tensor(normal(576, 128)),   # one column of blocks, 9 slices (C7514 below)
              Tensor(normal(1152, 512)) @ Tensor(normal(512, 4096)),   # 9 rows of tiles: TMA without a cluster
              Tensor(normal(2048, 512)).matmul(Tensor(normal(512, 4096)), dtype=dtypes.float32)]   # TMA, stored by the lanes
  monkeypatch.delenv("GRAFT_TF32", raising=False)   # a strict float32 convolution: the FMA tile
  strict = conv_case(np.float32, o=128, hw=(16, 16), stride=2, bias=True)[0].kernel_sources(device="CUDA")
  monkeypatch.setenv("GRAFT_TF32", "1")   # TF32 products and convolutions (their input gathered) too: mma.sync
  x32, w32 = Tensor(normal(512, 256, dtype=np.float32)), Tensor(normal(256, 512, dtype=np.float32))
  xl, wl = Tensor(normal(2048, 512, dtype=np.float32)), Tensor(normal(4096, 512, dtype=np.float32))   # TF32 on wgmma
  programs += [xl @ wl.T, (xl @ wl.T + Tensor(normal(4096, dtype=np.float32))).relu(), xl @ Tensor(normal(512, 4096, dtype=np.float32))]
  programs += [x32 @ w32, (x32 @ Tensor(normal(512, 256, dtype=np.float32)).T).relu(), conv_case(np.float16, bias=True)[0],
               conv_case(np.float32, stride=2, padding=0, hw=(17, 17))[0], conv_case(np.float16, stride=2, hw=(15, 15))[0]]
  sources = [p.kernel_sources(device="CUDA") for p in programs] + [strict]
  # (a float32 product: also its split reduction's kernels)
  assert all(any(t in k for t in ("g_mma_tile<", "g_wgmma_tile<", "g_tma_pipeline<", "g_fma_tile<") for k in ks) for ks in sources)
  kernels = list(dict.fromkeys(k for ks in sources for k in ks))
  assert any("g_mma_tile<half, 128, 128," in k for k in kernels) and sum("g_wgmma_tile<" in k for k in kernels) == 5
  assert sum("g_tma_pipeline<" in k for k in kernels) == 7 and any("false, 512, 1, 2> g_pipe;" in k for k in kernels)
  assert sum("g_pipe.store_tile(" in k for k in kernels) == 6 and any("false, 512, 2> g_pipe;" in k for k in kernels)
  assert sum("g_wgmma_tile<float," in k for k in kernels) == 3   # (x @ W: the transposed product, B in registers)
  assert sum("g_gather<" in k for k in kernels) == 5 and sum("g_mma_tile<float," in k for k in kernels) == 5
  assert sum("g_fma_tile<" in k for k in kernels) == 1
  src, out = tmp_path / "tc.cu", tmp_path / "tc.cubin"
  src.write_text(renderer.source(kernels))
  printed = cuda._run_nvcc(nvcc, "sm_90", src, out)   # built for sm_90a: the source holds wgmma
  # ptxas keeps a wgmma group in flight across steps only where nothing else touches the accumulators meanwhile;
  # otherwise it serializes every wgmma of the kernel and says so (C7514): the plain, epilogue and batched ones alike,
  # and one column of blocks (where threadIdx.x, read again after the product, had made it serialize)
  assert "C7514" not in printed and "serialized" not in printed, printed
  assert out.stat().st_size > 0


# ---------------------------------------------------------------- the graph around MMA, in the numpy model of a grid

def flat_offsets(flat, dims):
  """The offsets of flat indices running through loops `dims` ((size, stride), outermost first): a Gather's rows or ks."""
  out, inner = np.zeros_like(flat), 1
  for size, stride in reversed(dims):
    out, inner = out + (flat // inner) % size * stride, inner * size
  return out


def model_mma(spec: TileSpec):
  """What `MMA(A, B[, row0], arg=spec)` gives each thread of each block, by mma's documented accumulator layout (the
  same for m16n8k16 and TF32's m16n8k8): accumulator e = (mt * NT + nt) * 4 + c of lane l in warp w is the block
  tile's output at row (w // WN) * BM/WM + mt*16 + l//4 + 8*(c//2) and column (w % WN) * BN/WN + nt*8 + 2*(l%4) + c%2.
  A gathered A's element (row, k) is at its base + the gather's offsets of row0 + row and of k. A swapped tile (TF32,
  B along j, on wgmma) holds the transposed product: the same layout with rows and columns (and BM and BN) exchanged."""
  e = np.arange(spec.regs)
  mt, nt, c = e // (spec.nt * 4), e // 4 % spec.nt, e % 4
  # (a tile fed by TMA: its producer's threads, after the tile's, hold the accumulators of thread t % the tile's)
  t = np.arange(spec.threads)[:, None] % (spec.wm * spec.wn * 32 if spec.tma else spec.threads)
  warp, lane = t // 32, t % 32
  m, n = (spec.bn, spec.bm) if spec.swapped else (spec.bm, spec.bn)
  rows = (warp // spec.wn) * (m // spec.wm) + mt * 16 + lane // 4 + (c // 2) * 8
  cols = (warp % spec.wn) * (n // spec.wn) + nt * 8 + (lane % 4) * 2 + c % 2
  if spec.swapped: rows, cols = cols, rows
  if spec.fma:   # strict float32 on the FMA units: lane (x, y) holds rows 4x.. and BM/2 + 4x.., columns 4y.. and BN/2 + 4y..
    x, y, i, j = t % (spec.bm // 8), t // (spec.bm // 8), e // 8, e % 8
    rows, cols = x * 4 + i // 4 * (spec.bm // 2) + i % 4, y * 4 + j // 4 * (spec.bn // 2) + j % 4
  r, kk, col = np.arange(spec.bm)[:, None], np.arange(spec.k), np.arange(spec.bn)
  def mma(a, b, row0=None, col0=None):   # (TMA: the tile's first row and column, which A's and B's bases give too)
    (abuf, aidx), (bbuf, bidx) = a, b
    out = []
    for blk in range(aidx.shape[0]):   # one base per block: every thread of it passes the same
      if spec.gather:
        rows0 = np.broadcast_to(row0, aidx.shape)[blk, 0]
        at = aidx[blk, 0] + flat_offsets(rows0 + r, spec.gather.rows) + flat_offsets(kk, spec.gather.ks)[None, :]
      else: at = aidx[blk, 0] + r * spec.lda + kk[None, :]
      tile_a = abuf[at].astype(np.float32)
      tile_b = (bbuf[bidx[blk, 0] + col[None, :] * spec.ldb + kk[:, None]] if spec.b_along_k else
                bbuf[bidx[blk, 0] + kk[:, None] * spec.ldb + col[None, :]]).astype(np.float32)
      out.append((tile_a @ tile_b)[rows, cols])
    return np.stack(out)   # (blocks, threads, regs)
  return mma


def on_model_grid(out, monkeypatch, multiprocessors=16) -> tuple[np.ndarray, list[TileSpec]]:
  """out computed in the numpy model of a CUDA grid (tests/test_gpu_stages.py), MMA by `model_mma`; and the tiles of
  the kernels that ran on tensor cores."""
  import test_gpu_stages as model
  from rules.pipeline import lower_kernel
  specs = []
  real_lower = lower_kernel
  def lower_and_model(kernel, run):
    linear = real_lower(kernel, run)
    for u in linear.src:
      if u.op is Ops.MMA: specs.append(u.arg); monkeypatch.setitem(model.ALU, Ops.MMA, model_mma(u.arg))
    return linear
  monkeypatch.setattr(model, "lower_kernel", lower_and_model)
  monkeypatch.setitem(model.ALU, Ops.GEP, lambda vec, e: vec[..., int(e)])
  (got,) = model.run_on_model_gpu(out, multiprocessors=multiprocessors)
  return got, specs


@pytest.mark.parametrize("make", [
  lambda T: T(128, 64) @ T(64, 192),                         # 2 x 3 blocks of 64x64 (B along j: ldmatrix.trans)
  lambda T: T(192, 96) @ T(128, 96).T,                       # B along k (x @ W.T)
  lambda T: (T(128, 64) @ T(64, 128) + T(128)).gelu(),       # an epilogue reading the column's bias
  lambda T: T(3, 64, 32) @ T(3, 32, 64) * 2 - T(3, 64, 1),   # a batch, and an epilogue reading the row's value
  lambda T: T(1024, 32) @ T(32, 256),                        # (4 multiprocessors:) 128x128 tiles, in groups of 8 rows
  lambda T: (T(256, 64) @ T(64, 512) + T(512)).relu(),       # (4 multiprocessors:) 2 x 2 blocks of 128x256 on wgmma
  lambda T: T(2, 128, 64) @ T(2, 256, 64).transpose(-1, -2), # (4 multiprocessors:) wgmma 128x128, B along k, a batch
], ids=["nn", "nt", "bias-gelu", "batch-epilogue", "grouped-blocks", "wgmma", "wgmma-nt-batch"])
def test_each_accumulator_goes_to_its_output_in_the_model_grid(make, monkeypatch):
  def inputs():   # the same inputs each time: one graph for the model grid, one for the CPU's answer
    rng = np.random.default_rng(4)
    return lambda *s: Tensor(rng.standard_normal(s).astype(np.float16), device="CPU")
  out = make(inputs())
  want = make(inputs()).numpy().astype(np.float32)   # the CPU's generated code: float32 sums, as the tensor cores do
  got, specs = on_model_grid(out, monkeypatch, multiprocessors=4 if out.shape in ((1024, 256), (256, 512), (2, 128, 256)) else 16)
  assert specs, "no kernel ran on tensor cores"
  if out.shape == (1024, 256): assert (specs[0].bm, specs[0].bn) == (128, 128)
  assert specs[0].wgmma == (out.shape in ((256, 512), (2, 128, 256)))
  # (TMA: no batch; its producer's threads repeat no store; its output stored by TMA: the model's `tma_store`)
  assert (specs[0].tma is not None and specs[0].tma.store is not None) == (out.shape == (256, 512))
  assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- TF32: only when asked

class RecordingCublas:
  """Stands for libcublas: records the compute type of each gemm call."""
  def __init__(self): self.computes = []
  def cublasGemmEx(self, *args): self.computes.append(args[-2]); return 0


def gemm_compute(dtype: str, monkeypatch, tf32: str | None) -> int:
  from types import SimpleNamespace
  from runtime import extern
  if tf32 is None: monkeypatch.delenv("GRAFT_TF32", raising=False)
  else: monkeypatch.setenv("GRAFT_TF32", tf32)
  lib = RecordingCublas()
  params = dict(dtype=dtype, c_dtype=dtype, offset_a=0, offset_b=0, offset_c=0, trans_a="N", trans_b="N", m=8, n=8, k=8,
                lda=8, ldb=8, ldc=8, batch=1)
  extern.cublas_gemm(lib, "handle", [1.0], [0.0])([0, 256, 512], SimpleNamespace(params=tuple(params.items()), operands=(0, 1, 2), name="gemm"))
  return lib.computes[0]


def test_float32_products_are_strict_unless_graft_tf32_is_1(monkeypatch):
  from runtime import extern
  assert gemm_compute("float32", monkeypatch, None) == extern.CUBLAS_COMPUTE_32F   # the default: strict float32
  assert gemm_compute("float32", monkeypatch, "0") == extern.CUBLAS_COMPUTE_32F
  assert gemm_compute("float32", monkeypatch, "1") == extern.CUBLAS_COMPUTE_32F_FAST_TF32
  assert gemm_compute("float16", monkeypatch, "1") == extern.CUBLAS_COMPUTE_32F   # half products: float32 sums anyway
  monkeypatch.setenv("GRAFT_TF32", "yes")
  with pytest.raises(ValueError, match="GRAFT_TF32"): extern.tf32()


def test_the_tf32_compute_type_is_the_headers(tmp_path):
  import glob, subprocess
  from runtime import extern
  inc = [d for d in glob.glob("/usr/local/cuda*/include") if os.path.exists(os.path.join(d, "cublas_api.h"))]
  if not inc: pytest.skip("no cublas_api.h here")
  check = tmp_path / "check.c"
  check.write_text(f"#include <cublas_api.h>\nint t[CUBLAS_COMPUTE_32F_FAST_TF32 == {extern.CUBLAS_COMPUTE_32F_FAST_TF32} ? 1 : -1];\n")
  r = subprocess.run(["gcc", "-fsyntax-only", *(f"-I{d}" for d in inc), str(check)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]


def test_graft_tf32_1_puts_float32_products_on_tf32_tensor_cores(monkeypatch):
  from renderers.cuda import renderer
  make = lambda: Tensor(normal(256, 128, dtype=np.float32)) @ Tensor(normal(128, 256, dtype=np.float32))
  monkeypatch.delenv("GRAFT_TF32", raising=False)
  assert "g_mma_tile" not in cuda_text(make()) and "tf32" not in cuda_text(make())   # the default: strict float32
  monkeypatch.setenv("GRAFT_TF32", "1")
  src = cuda_text(make())
  assert "g_mma_tile<float, 64, 64, 32, 2, 2, 3, false, 128, 128LL, 256LL>" in src
  from runtime.cuda import dynamic_shared_bytes
  assert dynamic_shared_bytes(src, src.split(" void ")[1].split("(")[0]) == (64 + 64) * 32 * 4 * 3
  assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in renderer.source([src])   # (with the kernel that uses it)
  # a product that gives every multiprocessor a 128x256 block, its B stored along k (x @ W.T): wgmma (k8 each); along
  # j (x @ W) wgmma too, on the transposed product (a block of 256 rows and 128 columns): TF32's wgmma reads only
  # K-major operands from shared memory, so B's tile, as stored, is its A read into registers
  x, w = Tensor(normal(2048, 512, dtype=np.float32)), Tensor(normal(4096, 512, dtype=np.float32))
  big = cuda_text(x @ w.T)
  assert "g_wgmma_tile<float, 128, 256, 4, true, 512, 512LL, 512LL>" in big
  assert dynamic_shared_bytes(big, big.split(" void ")[1].split("(")[0]) == 4 * (128 + 256) * 32 * 4 + 1024
  assert "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32" in renderer.source([big])
  nn = cuda_text(x @ Tensor(normal(512, 4096, dtype=np.float32)))
  assert "g_wgmma_tile<float, 256, 128, 4, false, 512, 512LL, 4096LL>" in nn and "__launch_bounds__(256)" in nn
  assert dynamic_shared_bytes(nn, nn.split(" void ")[1].split("(")[0]) == 4 * (256 + 128) * 32 * 4 + 1024
  assert "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {%0, %1" in renderer.source([nn])
  assert "}, {%128, %129, %130, %131}, %132, p, 1, 1;" in renderer.source([nn])   # A: 4 registers a lane
  # the switch off again: strict float32 (that no cached kernel of the other setting is reused: the test of switches)
  monkeypatch.setenv("GRAFT_TF32", "0")
  assert "g_mma_tile" not in cuda_text(make())
  assert "mma_tile" not in cuda_text(Tensor(normal(2048, 512, dtype=np.float32)) @ Tensor(normal(512, 4096, dtype=np.float32)))


def test_tf32_products_in_the_model_grid(monkeypatch):
  monkeypatch.setenv("GRAFT_TF32", "1")
  rng = np.random.default_rng(5)
  a, w, v, b = (rng.standard_normal(s).astype(np.float32) for s in ((128, 64), (64, 192), (192, 64), (192,)))
  got, specs = on_model_grid((Tensor(a) @ Tensor(w) + Tensor(b)).relu(), monkeypatch)
  assert [s.dtype for s in specs] == ["float32"] and not specs[0].b_along_k
  assert_allclose(got, np.maximum(a @ w + b, 0), rtol=1e-4, atol=1e-4)   # the model's sums are float32's
  got, specs = on_model_grid(Tensor(a) @ Tensor(v).T, monkeypatch)
  assert specs[0].b_along_k
  assert_allclose(got, a @ v.T, rtol=1e-4, atol=1e-4)
  x, y = (rng.standard_normal(s).astype(np.float32) for s in ((256, 64), (512, 64)))
  got, specs = on_model_grid(Tensor(x) @ Tensor(y).T, monkeypatch, multiprocessors=4)   # 2 x 2 blocks of 128x256
  assert specs[0].wgmma and (specs[0].bm, specs[0].bn, specs[0].bk) == (128, 256, 32)
  assert_allclose(got, x @ y.T, rtol=1e-4, atol=1e-4)
  # B along j (x @ W): the transposed product on wgmma, 2 x 2 blocks of 128x256 (256 rows of A a block, 128 columns)
  got, specs = on_model_grid(Tensor(x) @ Tensor(y.T.copy()), monkeypatch, multiprocessors=4)
  assert specs[0].swapped and (specs[0].bm, specs[0].bn, specs[0].threads, specs[0].regs) == (256, 128, 256, 128)
  assert_allclose(got, x @ y.T, rtol=1e-4, atol=1e-4)
  got, specs = on_model_grid((Tensor(x) @ Tensor(y.T.copy()) + Tensor(y[:, 0])).relu(), monkeypatch, multiprocessors=5)
  assert specs[0].swapped and (specs[0].bm, specs[0].bn) == (128, 128)   # 2 x 4 blocks of 128x128, an epilogue
  assert_allclose(got, np.maximum(x @ y.T + y[:, 0], 0), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- convolutions: implicit products

def conv_case(dtype, n=2, c=32, o=64, hw=(8, 8), stride=1, padding=1, seed=0, bias=False, device="CPU"):
  """A convolution and numpy's answer (float64, from the operands as stored)."""
  from tests.test_tensor_nn import _conv2d
  rng = np.random.default_rng(seed)
  x, w, b = rng.standard_normal((n, c, *hw)).astype(dtype), rng.standard_normal((o, c, 3, 3)).astype(dtype), rng.standard_normal(o).astype(dtype)
  pair = lambda v: v if isinstance(v, tuple) else (v, v)
  want = _conv2d(x.astype(np.float64), w.astype(np.float64), pair(stride), pair(padding))
  t = Tensor(x, device=device).conv2d(Tensor(w, device=device), Tensor(b, device=device) if bias else None, stride, padding)
  if bias: t, want = t.relu(), np.maximum(want + b.astype(np.float64).reshape(1, o, 1, 1), 0)
  return t, want


def test_a_half_convolution_is_a_product_whose_input_tile_is_gathered_from_its_windows():
  t, _ = conv_case(np.float16, bias=True)
  sources = t.kernel_sources(device="CUDA")
  assert len(sources) == 3   # the padded input channels-last (2 x 10 x 10 x 32), the filters (64, 3, 3, 32), the product
  src = sources[-1]
  # rows: (image, output row, output column); k: (kernel row, kernel column, channel) of the padded 10x10 input
  assert "return ((r) % 8) * 32LL + ((r / 8) % 8) * 320LL + (r / 64) * 3200LL;" in src
  assert "return ((k) % 32) * 1LL + ((k / 32) % 3) * 32LL + (k / 96) * 320LL;" in src
  # the weights: B along k (kh, kw, c); A's tile copied in 16-byte chunks of 8 channels (g_gather<..., true>)
  assert "g_mma_tile<half, 64, 64, 32, 2, 2, 3, true, 288, 0LL, 288LL>" in src and "decltype(mma24_ks), true>" in src
  from runtime.cuda import dynamic_shared_bytes
  assert dynamic_shared_bytes(src, src.split(" void ")[1].split("(")[0]) == (64 + 64) * 32 * 2 * 3 + 4 * 288   # + k's offsets
  assert "im2col" not in src and src.count("__global__") == 1
  # the epilogue (bias, ReLU) on each of a lane's 32 accumulators before its store, in the product's kernel (the
  # bias of each of its 8 columns read once)
  assert src.count("*(data0+") == src.count("<((half)0.0f)") == 32 and src.count("*(data3+") == 8


def test_a_strict_float32_convolution_is_a_tile_on_the_fma_units_its_input_gathered_as_staged(monkeypatch):
  monkeypatch.delenv("GRAFT_TF32", raising=False)
  t, _ = conv_case(np.float32, o=128, hw=(16, 16), bias=True)
  src = t.kernel_sources(device="CUDA")[-1]   # (the padded copy first)
  # NCHW: rows (image, output row, output column), k (channel, kernel row, kernel column) of the padded 18x18 input
  assert "return ((r) % 16) * 1LL + ((r / 16) % 16) * 18LL + (r / 256) * 10368LL;" in src
  assert "return ((k) % 3) * 1LL + ((k / 3) % 3) * 18LL + (k / 9) * 324LL;" in src
  # 512 rows: tiles of 64 x 64 (8 blocks; 128 x 128 would leave more multiprocessors idle), 64 lanes of 8 x 8 outputs
  assert "g_fma_tile<64, 64, 8, 4, true, 288, 288LL>" in src and "g_mma_tile" not in src
  assert "__launch_bounds__(64)" in src and src.count("*(data0+") == src.count("<0.0f)") == 64   # bias, ReLU: each output
  from runtime.cuda import dynamic_shared_bytes
  assert dynamic_shared_bytes(src, src.split(" void ")[1].split("(")[0]) == (64 + 64 + 4) * 8 * 4 * 4 + 4 * 288


def test_tf32_transposed_wgmma_with_a_batch_and_an_epilogue_on_the_gpu_matches_numpy(gpu, monkeypatch):
  monkeypatch.setenv("GRAFT_TF32", "1")
  x, w, b = (normal(*s, dtype=np.float32, seed=i) for i, s in enumerate(((4, 1024, 256), (4, 256, 1024), (1024,))))
  out = (Tensor(x, device="CUDA") @ Tensor(w, device="CUDA") + Tensor(b, device="CUDA")).relu()
  assert ("g_wgmma_tile<float, 128, 128, 4, false," in cuda_text(out)) == gpu.arch.startswith("sm_90")   # 256 blocks
  assert rel_err(out.numpy(), np.maximum(x @ w + b, 0)) < 5e-3


@pytest.mark.parametrize("dtype, stride, padding, hw, o", [
  (np.float16, 1, 1, (8, 8), 64), (np.float16, 2, 1, (15, 15), 64), (np.float16, (1, 2), (2, 0), (6, 33), 64),
  (np.float32, 1, 1, (8, 8), 128), (np.float32, 2, 0, (17, 17), 64),
], ids=["f16-pad1", "f16-stride2-odd", "f16-mixed", "tf32-pad1", "tf32-stride2-odd"])
def test_convolutions_on_tensor_cores_in_the_model_grid(dtype, stride, padding, hw, o, monkeypatch):
  monkeypatch.setenv("GRAFT_TF32", "1")
  t, want = conv_case(dtype, o=o, hw=hw, stride=stride, padding=padding, bias=True)
  got, specs = on_model_grid(t, monkeypatch)
  assert [s.gather is not None for s in specs] == [True]
  tol = 2e-2 if dtype == np.float16 else 1e-4
  assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol * 10)


def test_a_half_convolution_with_a_block_for_every_multiprocessor_takes_warpgroup_mma_its_tile_gathered_in_chunks(monkeypatch):
  # 4 multiprocessors: 512 rows x 128 filters are 4 blocks of 128 x 128; k = 9 x 64 channels, slices of 64
  t, want = conv_case(np.float16, c=64, o=128, hw=(16, 16), bias=True)
  got, specs = on_model_grid(t, monkeypatch, multiprocessors=4)
  assert [(s.wgmma, s.gather.chunked, s.stages) for s in specs] == [(True, True, 3)]   # (each step waits for its group)
  assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("stride, padding, hw, o", [(1, 1, (8, 8), 128), (2, 1, (15, 15), 64), ((1, 2), (2, 0), (6, 33), 64)],
                         ids=["pad1", "stride2-odd", "mixed"])
def test_strict_float32_convolutions_on_the_fma_tile_in_the_model_grid(stride, padding, hw, o, monkeypatch):
  monkeypatch.delenv("GRAFT_TF32", raising=False)
  t, want = conv_case(np.float32, o=o, hw=hw, stride=stride, padding=padding, bias=True)
  got, specs = on_model_grid(t, monkeypatch)
  assert [(s.fma, s.gather is not None) for s in specs] == [(True, True)]
  assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def planned(t: Tensor, arch: str, multiprocessors: int = 4) -> list[TileSpec]:
  """The tiles of t's kernels planned for a GPU of `arch` (none needed here)."""
  from rules.pipeline import Run, schedule, lower_kernel
  from rules.realize import normalize
  kernels = [k for k in schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if k.op is Ops.KERNEL]
  lowered = [lower_kernel(normalize(k)[0], Run("CUDA", parallel=False, device_loops=True, arch=arch, multiprocessors=multiprocessors)) for k in kernels]
  return [u.arg for linear in lowered for u in linear.src if u.op is Ops.MMA]


def test_a_tile_fits_the_shared_memory_of_the_gpu_it_is_planned_for(monkeypatch):
  from rules.opt.tensor_core import max_shared
  assert (max_shared("sm_90"), max_shared("sm_80"), max_shared("sm_89"), max_shared("sm_120")) == (227 << 10, 163 << 10, 99 << 10, 99 << 10)
  monkeypatch.setenv("GRAFT_TF32", "1")
  conv = lambda: conv_case(np.float32, c=256, o=128, hw=(16, 16))[0]   # k = 2304: a 9 KiB table of its offsets
  (hopper,), (ada,) = planned(conv(), "sm_90"), planned(conv(), "sm_89")
  assert (hopper.bm, hopper.bn) == (128, 128) and hopper.shared_bytes == 96 * 1024 + 4 * 2304 > max_shared("sm_89")
  assert (ada.bm, ada.bn) == (64, 128) and ada.shared_bytes <= max_shared("sm_89")   # the next tile down
  monkeypatch.setenv("GRAFT_TC_TILE", "128,128,2,2,32,4")   # 128 KiB of float32 tiles: on an A100, not on an RTX 4090
  assert planned(Tensor(normal(256, 64, dtype=np.float32)) @ Tensor(normal(64, 256, dtype=np.float32)), "sm_80")
  with pytest.raises(ValueError, match="GRAFT_TC_TILE.*sm_89"):
    planned(Tensor(normal(256, 64, dtype=np.float32)) @ Tensor(normal(64, 256, dtype=np.float32)), "sm_89")


def test_what_a_tile_does_not_divide_stays_on_the_other_plans(monkeypatch):
  monkeypatch.delenv("GRAFT_TF32", raising=False)
  assert "g_mma_tile" not in "".join(conv_case(np.float32)[0].kernel_sources(device="CUDA"))   # strict float32: FMA
  assert "g_fma_tile" not in "".join(conv_case(np.float32, hw=(7, 7))[0].kernel_sources(device="CUDA"))   # 98 rows
  assert "g_mma_tile" not in "".join(conv_case(np.float16, hw=(7, 7))[0].kernel_sources(device="CUDA"))   # 98 rows
  assert "g_mma_tile" not in "".join(conv_case(np.float16, c=3)[0].kernel_sources(device="CUDA"))   # k = 27


# ---------------------------------------------------------------- on a GPU

@pytest.fixture(scope="module")
def gpu():
  from runtime.device import get_device
  from runtime.cuda import CUDAUnavailable
  try: return get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")


def rel_err(got, want) -> float: return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("m, k, n, transposed", [(128, 64, 128, False), (256, 96, 384, False), (512, 512, 1024, False),
                                                 (256, 128, 256, True), (1024, 256, 1024, True)])
def test_half_products_on_the_gpu_match_numpy(gpu, m, k, n, transposed):
  a = normal(m, k, seed=1)
  w = normal(n, k, seed=2) if transposed else normal(k, n, seed=2)
  tw = Tensor(w, device="CUDA")
  out = Tensor(a, device="CUDA") @ (tw.T if transposed else tw)
  assert "g_mma_tile" in cuda_text(out)
  want = a.astype(np.float32) @ (w.T if transposed else w).astype(np.float32)
  assert rel_err(out.numpy().astype(np.float32), want) < 2e-3   # one float16 rounding of a float32 sum


def test_bf16_and_batched_products_with_an_epilogue_on_the_gpu(gpu):
  a, w, b = normal(4, 128, 256, dtype=np.float32, seed=3), normal(4, 256, 128, dtype=np.float32, seed=4), normal(128, dtype=np.float32, seed=5)
  ab, wb, bb = (bf16_to_float32(bf16_bits(v)) for v in (a, w, b))
  out = (Tensor(a, dtype="bfloat16", device="CUDA") @ Tensor(w, dtype="bfloat16", device="CUDA") + Tensor(b, dtype="bfloat16", device="CUDA")).relu()
  assert "g_mma_tile<__nv_bfloat16" in cuda_text(out)
  want = np.maximum(bf16_to_float32(bf16_bits(ab @ wb)) + bb, 0)
  assert rel_err(out.numpy(), want) < 2e-2   # bfloat16: 8 significant bits, two roundings
  x, w16, b16 = normal(256, 128, seed=6), normal(128, 256, seed=7), normal(256, seed=8)
  got = (Tensor(x, device="CUDA") @ Tensor(w16, device="CUDA") + Tensor(b16, device="CUDA")).gelu().numpy().astype(np.float32)
  z = (x.astype(np.float32) @ w16.astype(np.float32)).astype(np.float16).astype(np.float32) + b16.astype(np.float32)
  want = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_float16_transformer_layer_on_tensor_cores_matches_the_cpus_answer(gpu):
  on_gpu, on_cpu = half_attention_layer("CUDA"), half_attention_layer("CPU")
  assert sum("g_mma_tile" in src for src in on_gpu.kernel_sources()) == 4
  want = on_cpu.numpy().astype(np.float32)
  assert rel_err(on_gpu.numpy().astype(np.float32), want) < 1e-2   # float16 roundings of the same float32 sums


@pytest.mark.parametrize("m, k, n, transposed, dtype", [
  (2048, 512, 4096, False, "float16"), (2048, 64, 4096, False, "float16"),   # one slice of k: fewer than the stages
  (2048, 1024, 4096, True, "float16"), (1024, 192, 2304, False, "float16"), (1024, 256, 2304, True, "bfloat16"),
  (2048, 320, 4096, False, "bfloat16"), (16896, 576, 128, False, "float16"),   # (one column of blocks)
  (1152, 512, 4096, False, "float16"), (1152, 256, 4096, True, "float16"),   # 9 rows of tiles: no cluster
  (1024, 4160, 4096, False, "float16")])   # 65 slices of k: a block per tile (no cluster)
def test_wgmma_products_on_the_gpu_match_numpy(gpu, m, k, n, transposed, dtype):
  a = normal(m, k, dtype=np.float32, seed=1)
  w = normal(n, k, dtype=np.float32, seed=2) if transposed else normal(k, n, dtype=np.float32, seed=2)
  ta, tw = Tensor(a, dtype=dtype, device="CUDA"), Tensor(w, dtype=dtype, device="CUDA")
  out = ta @ (tw.T if transposed else tw)
  assert "g_tma_pipeline" in cuda_text(out)   # (a matrix product: its tiles copied by TMA)
  a, w = ta.numpy().astype(np.float32), tw.numpy().astype(np.float32)   # the rounded operands
  want = a @ (w.T if transposed else w)
  assert rel_err(out.numpy().astype(np.float32), want) < (2e-3 if dtype == "float16" else 1e-2)   # one rounding of a float32 sum


def test_tma_tiles_follow_new_inputs_on_a_warm_call_and_an_offset_view_on_the_gpu(gpu):
  # the tensor maps hold the buffers' addresses: the host makes them per launch from the pointers it is given, so a
  # second call of the same program on new tensors reads those (not the first call's)
  from runtime.realize import last_program
  def product(seed):
    x, w, b = normal(2048, 512, seed=seed), normal(512, 4096, seed=seed + 1), normal(4096, seed=seed + 2)
    out = (Tensor(x, device="CUDA") @ Tensor(w, device="CUDA") + Tensor(b, device="CUDA")).relu()
    want = np.maximum((x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16).astype(np.float32) + b.astype(np.float32), 0)
    return out, want
  (first, want1), (second, want2) = product(1), product(11)
  got1 = first.numpy().astype(np.float32)
  program = last_program()
  got2 = second.numpy().astype(np.float32)
  (ck,) = [ck for ck in program.kernels_called() if "g_tma_pipeline" in ck.source]
  # persistent, in clusters of 2: a block a multiprocessor, in as many whole clusters as the GPU holds at once
  grid = ck.program.grid(ck.global_size, ck.local_size)
  assert last_program() is program and ck.program.cluster == 2 and grid[0] % 2 == 0
  assert gpu.multiprocessor_count - 2 * 8 <= grid[0] <= gpu.multiprocessor_count and grid[1:] == (1, 1)
  assert_allclose(got1, want1, rtol=2e-2, atol=2e-2)
  assert_allclose(got2, want2, rtol=2e-2, atol=2e-2)
  assert rel_err(got2, want1) > 0.1   # (the answers differ: the second is not the first's)
  x, w = normal(2056, 512, seed=5), normal(512, 4096, seed=6)
  out = Tensor(x, device="CUDA")[8:] @ Tensor(w, device="CUDA")   # A's map starts 8 rows into its buffer
  assert "g_tma_pipeline" in cuda_text(out)
  assert rel_err(out.numpy().astype(np.float32), x[8:].astype(np.float32) @ w.astype(np.float32)) < 2e-3


@pytest.mark.parametrize("epilogue", ["residual", "bias-gelu", "bf16-128x128"])
def test_outputs_stored_by_tma_from_shared_memory_on_the_gpu(gpu, epilogue):
  # the lanes write the output tile into a swizzled staging tile, the copy engine stores it (in halves of its columns)
  x, w, r = normal(2048, 512, seed=7), normal(512, 4096, seed=8), normal(2048, 4096, seed=9)
  tx, tw, tr = Tensor(x, device="CUDA"), Tensor(w, device="CUDA"), Tensor(r, device="CUDA")
  z = (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16).astype(np.float32)
  if epilogue == "residual": out, want = tx @ tw + tr, z + r.astype(np.float32)
  elif epilogue == "bias-gelu":
    out, u = (tx @ tw + tr[0]).gelu(), z + r[0].astype(np.float32)
    want = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
  else:   # 128x128 tiles (128x256 would give fewer blocks than multiprocessors), 6 slices in flight beside a staging tile
    xb, wb = Tensor(x, dtype="bfloat16", device="CUDA"), Tensor(w[:, :2048], dtype="bfloat16", device="CUDA")
    out, want = xb @ wb, xb.numpy().astype(np.float32) @ wb.numpy().astype(np.float32)
  text = cuda_text(out)
  assert "g_pipe.store_tile(g_map_c" in text and "(data0+" not in text.split("g_pipe.consume(")[1]
  assert_allclose(out.numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("into", ["rows 8..", "columns 128..", "rows reversed", "columns reversed"])
def test_a_product_assigned_into_part_of_a_buffer_on_the_gpu(gpu, into):
  # the output map starts where the target view does (a TMA store), or the lanes store a target TMA cannot say
  x, w, b = normal(2048, 512, seed=10), normal(512, 4096, seed=11), normal(4096, seed=12)
  y0 = normal(2064, 4224, seed=13)
  y = Tensor(y0, device="CUDA")
  where = {"rows 8..": np.s_[8:2056, :4096], "columns 128..": np.s_[:2048, 128:],
           "rows reversed": np.s_[2047::-1, :4096], "columns reversed": np.s_[:2048, 4223:127:-1]}[into]
  y[where] = (Tensor(x, device="CUDA") @ Tensor(w, device="CUDA") + Tensor(b, device="CUDA")).relu()
  from runtime.realize import last_program
  (src,) = [ck.source for ck in last_program().kernels_called() if "g_tma_pipeline" in ck.source]   # written in place
  assert ("g_pipe.store_tile(g_map_c" in src) == ("reversed" not in into)
  want = y0.astype(np.float32)
  want[where] = np.maximum((x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16).astype(np.float32) + b.astype(np.float32), 0)
  assert_allclose(y.numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)   # and nothing outside the view written


def test_wgmma_with_a_batch_and_an_epilogue_on_the_gpu(gpu):
  a, w, b = normal(4, 1024, 128, seed=3), normal(4, 128, 1024, seed=4), normal(1024, seed=5)
  out = (Tensor(a, device="CUDA") @ Tensor(w, device="CUDA") + Tensor(b, device="CUDA")).gelu()
  assert "g_wgmma_tile" in cuda_text(out)
  z = (a.astype(np.float32) @ w.astype(np.float32)).astype(np.float16).astype(np.float32) + b.astype(np.float32)
  want = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  assert_allclose(out.numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_tf32_products_on_the_gpu_match_numpy_and_the_switch_changes_a_warm_calls_program(gpu, monkeypatch):
  from runtime.realize import last_program
  a, w = normal(512, 384, dtype=np.float32, seed=1), normal(384, 256, dtype=np.float32, seed=2)
  run = lambda: (Tensor(a, device="CUDA") @ Tensor(w, device="CUDA")).numpy()
  tf32_kernels = lambda: [ck for ck in last_program().kernels_called() if "g_mma_tile<float," in ck.source]
  monkeypatch.setenv("GRAFT_TF32", "1")
  got = run()
  assert tf32_kernels()
  assert rel_err(got, a @ w) < 5e-3   # operands with 10 bits of mantissa, sums in float32
  monkeypatch.setenv("GRAFT_TF32", "0")   # the same graph again: not the TF32 program of the call before
  strict = run()
  assert not tf32_kernels() and rel_err(strict, a @ w) < 1e-5


@pytest.mark.parametrize("stride, hw", [(1, (48, 48)), (2, (95, 95))], ids=["pad1", "stride2-odd"])
def test_half_convolutions_on_warpgroup_mma_on_the_gpu_match_numpy(gpu, stride, hw):
  t, want = conv_case(np.float16, n=8, c=64, o=128, hw=hw, stride=stride, bias=True, device="CUDA")
  src = t.kernel_sources()[-1]
  assert ("g_wgmma_tile<" in src) == (gpu.arch.startswith("sm_90")) and "decltype(mma" in src   # 144 blocks, gathered
  assert rel_err(t.numpy().astype(np.float64), want) < 2e-3


@pytest.mark.parametrize("m, k, n, transposed", [(2048, 512, 4096, False), (2048, 512, 4096, True),
                                                 (1024, 32, 2304, False), (1024, 96, 2304, True),   # one slice; 128x128
                                                 (1024, 1024, 2304, False)])
def test_tf32_wgmma_products_on_the_gpu_match_numpy(gpu, m, k, n, transposed, monkeypatch):
  """TF32 on wgmma: a B stored along k (x @ W.T), and one along j (x @ W) through the transposed product."""
  monkeypatch.setenv("GRAFT_TF32", "1")
  a = normal(m, k, dtype=np.float32, seed=1)
  w = normal(n, k, dtype=np.float32, seed=2) if transposed else normal(k, n, dtype=np.float32, seed=2)
  tw = Tensor(w, device="CUDA")
  out = Tensor(a, device="CUDA") @ (tw.T if transposed else tw)
  assert ("g_wgmma_tile<float," in cuda_text(out)) == gpu.arch.startswith("sm_90")
  assert rel_err(out.numpy(), a @ (w.T if transposed else w)) < 5e-3   # operands with 10 bits of mantissa


@pytest.mark.parametrize("dtype, stride, padding, hw, o", [
  (np.float16, 1, 1, (8, 8), 64), (np.float16, 2, 1, (15, 15), 128), (np.float16, (1, 2), (2, 0), (6, 33), 64),
  (np.float16, 1, 1, (7, 7), 64), (np.float32, 1, 1, (8, 8), 128), (np.float32, 2, 0, (17, 17), 64),
], ids=["f16-pad1", "f16-stride2-odd", "f16-mixed", "f16-untiled", "tf32-pad1", "tf32-stride2-odd"])
def test_convolutions_on_the_gpu_match_numpy(gpu, dtype, stride, padding, hw, o, monkeypatch):
  monkeypatch.setenv("GRAFT_TF32", "1")
  t, want = conv_case(dtype, c=64, o=o, hw=hw, stride=stride, padding=padding, bias=True, device="CUDA")
  assert ("g_gather<" in t.kernel_sources()[-1]) == (hw != (7, 7))
  assert rel_err(t.numpy().astype(np.float64), want) < (2e-3 if dtype == np.float16 else 5e-3)
  monkeypatch.setenv("GRAFT_TF32", "0")   # strict float32 (and float16 unchanged)
  t, want = conv_case(dtype, c=64, o=o, hw=hw, stride=stride, padding=padding, bias=True, device="CUDA")
  assert rel_err(t.numpy().astype(np.float64), want) < (2e-3 if dtype == np.float16 else 1e-5)
