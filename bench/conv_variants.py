"""A convolution on the GPU under several settings of Graft's switches, in one process, beside cuDNN: for each
setting, the whole call (median over 5 rounds of 10 calls replaying the compiled program) and each of its kernels
alone (the padded copy, the filters' copy, the product: best of 3 runs, each step waited for alone), and torch's
F.conv2d on the same inputs (cuDNN; TF32 off for float32), so the ratios are side by side.

  python bench/conv_variants.py --dtype float32 GRAFT_TC_TILE=128,128,2,2,32,4 ""     # "" = the defaults
  python bench/conv_variants.py --dtype float16 --shape 32,128,56,56,128 ""
"""
from __future__ import annotations
import argparse, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tensor_cores import timed  # noqa: E402  (one way to time a call, beside torch)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
  ap.add_argument("--shape", default="32,128,56,56,128", help="N,C,H,W,O (3x3 filters)")
  ap.add_argument("--stride", type=int, default=1); ap.add_argument("--padding", type=int, default=1)
  ap.add_argument("settings", nargs="*", default=[""], help='each "NAME=VALUE[;NAME=VALUE]" ("" = none)')
  a = ap.parse_args()
  os.environ.setdefault("GRAFT_EXTERN", "0")
  import numpy as np, torch
  from tensor import Tensor
  from runtime import realize as rr
  from runtime.device import get_device
  torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
  n, c, h, w, o = map(int, a.shape.split(","))
  rng = np.random.default_rng(0)
  x, wt = rng.standard_normal((n, c, h, w), dtype=np.float32), rng.standard_normal((o, c, 3, 3), dtype=np.float32) / np.sqrt(9 * c)
  td = getattr(torch, a.dtype)
  tx, tw = torch.from_numpy(x).cuda().to(td), torch.from_numpy(wt).cuda().to(td)
  conv_t = lambda: torch.nn.functional.conv2d(tx, tw, stride=a.stride, padding=a.padding)
  want = conv_t().float().cpu().numpy()
  t_torch = timed(conv_t, torch.cuda.synchronize)
  oh, ow = want.shape[2:]
  flops = 2 * n * o * oh * ow * c * 9
  dev = get_device("CUDA")
  gx, gw = (Tensor(v, dtype=a.dtype, device="CUDA").realize() for v in (x, wt))
  fn = lambda: gx.conv2d(gw, stride=a.stride, padding=a.padding)
  print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__}); conv {a.shape} 3x3 stride {a.stride} "
        f"padding {a.padding} {a.dtype}; cuDNN {t_torch * 1e3:.3f} ms ({flops / t_torch / 1e12:.1f} TFLOP/s)")
  for setting in a.settings:
    env = dict(kv.split("=", 1) for kv in setting.split(";") if kv)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
      got = fn().numpy().astype(np.float32)
      err = float(np.abs(got - want).max() / np.abs(want).max())
      program, inputs = rr.find_program([(fn().uop, "CUDA")])
      g = timed(lambda: program.run(inputs), dev.synchronize)
      best = None
      for _ in range(3):
        seconds: list[float] = []
        program.run(inputs, step_seconds=seconds)
        if best is None or sum(seconds) < sum(best): best = seconds
      steps = " + ".join(f"{s * 1e3:.3f}" for s in best)
      tile = next((ln.strip()[:60] for ck in program.kernels_called() for ln in ck.source.splitlines() if "_tile<" in ln), "-")
      print(f"{setting or 'defaults':<40} {g * 1e3:7.3f} ms {flops / g / 1e12:6.1f} TFLOP/s  {t_torch / g:5.2f}x cuDNN  "
            f"err {err:.0e}  steps {steps} ms  {tile}")
    except Exception as e:
      print(f"{setting or 'defaults':<40} FAILED {repr(e)[:300]}")
    finally:
      for k, v in saved.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v


if __name__ == "__main__":
  main()
