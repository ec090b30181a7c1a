"""TF32 x @ W (B stored along j) at 4096^3 on Hopper, variants of its generated kernel side by side with cuBLAS (torch,
allow_tf32): the transposed product on wgmma (rules/opt/tensor_core.py TF32_SWAPPED_TILES, renderers/cuda_wgmma.py
SWAP) with each tile, with each step waiting for its own wgmma group, mma.sync (GRAFT_WGMMA=0), and x @ W.T for scale.

  python3 bench/tf32_variants.py

Each variant runs in a process of its own (the warm-call programs are cached by graph, not by these module
settings); each figure is bench/tensor_cores.py's: the compiled program replayed, median of 5 rounds of 10 calls.
Needs a CUDA GPU and torch with CUDA."""
from __future__ import annotations
import os, subprocess, sys

VARIANTS = {   # label -> (the transposed product's one tile, or None for the committed tiles; wait for each own group)
  "swapped 256x128 (committed: fragments held)": (None, False),
  "swapped 256x128, wait_group 0": (None, True),
  "swapped 128x128": ((128, 128, 8, 1, 32, 4), False),
  "swapped 128x256 (4 warpgroups)": ((128, 256, 16, 1, 32, 4), False),
  "swapped 256x128, 3 slices": ((256, 128, 8, 1, 32, 3), False),
}
N = 4096


def one(label: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import numpy as np, torch
  import rules.opt.tensor_core as tc, renderers.cuda as rc
  from bench.tensor_cores import timed
  from tensor import Tensor
  from runtime import realize as rr
  from runtime.device import get_device
  os.environ.update(GRAFT_TF32="1", GRAFT_EXTERN="0")
  transposed = label == "x @ W.T"
  if label in VARIANTS:
    tile, wait0 = VARIANTS[label]
    if tile: tc.TF32_SWAPPED_TILES = (tile,)
    if wait0:
      old = "if constexpr (MATRIX) g_wgmma_wait<1>();"
      assert old in rc.WGMMA_PRELUDE
      rc.WGMMA_PRELUDE = rc.WGMMA_PRELUDE.replace(old, "if constexpr (MATRIX && !SWAP) g_wgmma_wait<1>();")
  if label == "mma.sync (GRAFT_WGMMA=0)": os.environ["GRAFT_WGMMA"] = "0"
  dev = get_device("CUDA")
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, N), dtype=np.float32)
  w = (rng.standard_normal((N, N), dtype=np.float32) / np.sqrt(N)).astype(np.float32)
  gx, gw = Tensor(x, device="CUDA").realize(), Tensor(w, device="CUDA").realize()
  f = (lambda a, b: a @ b.T) if transposed else (lambda a, b: a @ b)
  got = f(gx, gw).realize()
  program, inputs = rr.find_program([(f(gx, gw).uop, "CUDA")])
  source = " ".join(ck.source for ck in program.kernels_called())
  kind = next((k for k in ("g_wgmma_tile<", "g_mma_tile<") if k in source), "?")
  tile = source.split(kind)[1].split(">")[0] if kind != "?" else ""
  g = timed(lambda: program.run(inputs), dev.synchronize)
  torch.backends.cuda.matmul.allow_tf32 = True
  tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
  t = timed(lambda: tx @ tw, torch.cuda.synchronize)
  want = (tx @ (tw.T if transposed else tw)).cpu().numpy()
  err = float(np.abs(got.numpy() - want).max() / np.abs(want).max())
  print(f"{label:<44}{g * 1e3:9.3f}{2 * N ** 3 / g / 1e12:9.1f}{t * 1e3:10.3f}{t / g:7.2f}  {err:.1e}  {kind}{tile}>", flush=True)


def main() -> None:
  if len(sys.argv) > 1: return one(sys.argv[1])
  import torch
  print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp32 {N}^3, GRAFT_TF32=1, GRAFT_EXTERN=0; "
        f"cuBLAS: torch x @ W with allow_tf32")
  print(f"{'variant':<44}{'graft ms':>9}{'TFLOP/s':>9}{'cuBLAS ms':>10}{'ratio':>7}  err      kernel")
  for label in (*VARIANTS, "mma.sync (GRAFT_WGMMA=0)", "x @ W.T"):
    r = subprocess.run([sys.executable, __file__, label], capture_output=True, text=True)
    print(r.stdout.strip() if r.returncode == 0 else f"{label:<44} FAILED {r.stderr.strip()[-600:]}", flush=True)


if __name__ == "__main__":
  main()
