"""Plans as data, the heuristic's choices per kind of kernel, and where a kernel's plan comes from."""
import os, subprocess, sys
import numpy as np
import pytest
import rewrite
from tensor import Tensor
from rules.opt import Opt, OptKind, Plan
from tests.opt_helpers import lowered

pytestmark = pytest.mark.usefixtures("on_cpu")  # the CPU's vocabulary: on the CPU also in a DEVICE=CUDA run

rng = np.random.default_rng(5)


def kinds(plan): return [o.kind for o in plan.opts]


def test_a_plan_is_hashable_printable_data():
  p = Plan((Opt(OptKind.VECTOR, 1, 8), Opt(OptKind.PARALLEL, 0)), "heuristic")
  assert hash(p) == hash(Plan((Opt(OptKind.VECTOR, 1, 8), Opt(OptKind.PARALLEL, 0)), "heuristic"))
  assert str(p) == "vector(1, 8) parallel(0) [heuristic]"


def test_heuristic_elementwise_runs_rows_in_parallel_only():
  _, plan = lowered(Tensor(rng.standard_normal((256, 256), dtype=np.float32)) * 2)
  assert kinds(plan) == [OptKind.PARALLEL] and plan.origin == "heuristic"


def test_heuristic_row_reduction_is_simd_and_parallel():
  _, plan = lowered(Tensor(rng.standard_normal((256, 256), dtype=np.float32)).sum(axis=1))
  assert kinds(plan) == [OptKind.SIMD, OptKind.PARALLEL]


def test_heuristic_matmul_is_a_register_tile_over_a_packed_panel():
  a, b = Tensor(rng.standard_normal((128, 128), dtype=np.float32)), Tensor(rng.standard_normal((128, 512), dtype=np.float32))
  _, plan = lowered(a @ b)   # B (256 KB) is larger than a panel: its column blocks move outermost
  tile = {OptKind.VECTOR, OptKind.UPCAST, OptKind.PACK, OptKind.INTERCHANGE, OptKind.PARALLEL}
  assert tile <= set(kinds(plan)) <= tile | {OptKind.PAD}   # 128 rows padded to tiles of 6 on AVX2, 8 divide them


def test_heuristic_matmul_packs_the_long_panel_of_a_gpt_fc2():
  # k = 3072: a tile's panel of B (3072 x 32 floats, 384 KB) is still packed, so its rows are read in one stream
  # instead of a strided row of W per step (2.4x slower at 128x3072x768)
  an, bn = rng.standard_normal((16, 3072), dtype=np.float32), rng.standard_normal((3072, 64), dtype=np.float32)
  t = Tensor(an) @ Tensor(bn)
  _, plan = lowered(t)
  assert {OptKind.PACK, OptKind.INTERCHANGE} <= set(kinds(plan))
  from tests.opt_helpers import run_with
  np.testing.assert_allclose(run_with(t, *plan.opts), an @ bn, rtol=1e-4, atol=1e-3)


def test_heuristic_matmul_packs_a_small_b_whole_and_keeps_the_rows_outermost():
  a, b = Tensor(rng.standard_normal((8, 256, 256), dtype=np.float32)), Tensor(rng.standard_normal((8, 256, 64), dtype=np.float32))
  _, plan = lowered(a @ b)   # attention's P @ V: each tile of rows sweeps all of B (64 KB) while its rows stay in L1
  assert OptKind.PACK in kinds(plan) and OptKind.INTERCHANGE not in kinds(plan) and Opt(OptKind.PARALLEL, 0) in plan.opts


def test_heuristic_linear_layer_packs_w_transposed_into_panels():
  x, w = Tensor(rng.standard_normal((64, 128), dtype=np.float32)), Tensor(rng.standard_normal((32, 128), dtype=np.float32))
  _, plan = lowered(x @ w.permute(1, 0))
  assert plan.opts[0].kind is OptKind.VECTOR and plan.opts[0].axis == 1   # lanes along the output row, not along k
  assert OptKind.PACK in kinds(plan)


def test_heuristic_long_dot_products_of_unpackable_operands_are_vector_partial_sums():
  x = Tensor(rng.standard_normal((16, 8192), dtype=np.float32))
  _, plan = lowered(x @ x.permute(1, 0))   # a panel over 8192 k is too big to pack
  assert plan.opts[0] == Opt(OptKind.VECTOR, 2, plan.opts[0].amount)   # lanes along k
  assert kinds(plan).count(OptKind.UPCAST) == 2


def test_heuristic_convolution_moves_the_window_loops_outward():
  # a window read through the masks of a padded view (conv2d's own padding is stored first, with no masks)
  x, w = Tensor(rng.standard_normal((2, 8, 16, 16), dtype=np.float32)), Tensor(rng.standard_normal((8, 8, 3, 3), dtype=np.float32))
  _, plan = lowered(x.pad(((0, 0), (0, 0), (1, 1), (1, 1))).conv2d(w))
  assert OptKind.VECTOR in kinds(plan) and kinds(plan).count(OptKind.INTERCHANGE) == 2


def test_rewrite_stats_show_the_named_opt_rules_and_the_plan_of_a_matmul():
  a, b = Tensor(rng.standard_normal((64, 256), dtype=np.float32)), Tensor(rng.standard_normal((256, 192), dtype=np.float32))
  with rewrite.stats.collect() as s: (a @ b).numpy()
  fired = {r.name for r in s.rules.values() if r.stage.startswith("opt") and r.matches}
  assert {"attach_plan", "split_loop", "unroll_store", "vector_load", "vector_alu", "vector_reduce", "vector_store",
          "pack_load", "interchange_loop", "mark_parallel_loop"} <= fired
  assert "[heuristic]" in s.table("kernel")


PROGRAM = """
import numpy as np, rewrite
from tensor import Tensor
a, b = (Tensor(np.ones((32, 32), np.float32)) for _ in range(2))
with rewrite.stats.collect() as s: (a @ b).numpy()
print(list(s.plans.values())[0])
"""


def test_a_searched_plan_is_cached_on_disk_for_the_next_process(cache_env):
  env = {**os.environ, "GRAFT_CACHE_DIR": str(cache_env), "GRAFT_SEARCH": "2", "GRAFT_SEARCH_SECONDS": "3"}
  first = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, env=env)
  assert first.returncode == 0, first.stderr
  assert first.stdout.strip().endswith("[search]")
  again = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, env=env)
  assert again.stdout.strip() == first.stdout.strip().replace("[search]", "[cache]")
  assert list((cache_env / "plans").glob("*.json"))


def test_a_bad_search_width_says_so(monkeypatch):
  from runtime.search import search_width
  monkeypatch.setenv("GRAFT_SEARCH", "wide")
  with pytest.raises(ValueError, match="beam width"): search_width()
