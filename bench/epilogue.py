"""A product with its prologue and epilogue on the CPU (issue 21, part 3), in one process, side by side:

  python3 bench/epilogue.py [--repeats 20]

Rows: a linear layer with bias and ReLU (the mlp workload's layer, 256x1024x1024), with bias and GELU (a GPT block's
fc, 128x3072x768), and a layer norm before the qkv product (a GPT block, 128x2304x768, the norm's scale and shift
and the product's bias included). Columns, each the median of `--repeats` warm calls (the graph rebuilt every call):
- graft: the whole expression, generated code (GRAFT_EXTERN=0): the epilogue fused into the product's kernel, the
  prologue's operand stored once by its own kernel (rules/realize.py, `_realize_product_operands`);
- lib+pass: OpenBLAS's sgemm through Graft (GRAFT_EXTERN=1, the bare product realized alone), then the rest as a
  separate Graft kernel: the "library plus a separate elementwise pass" the generated code must match;
- bare: the bare product alone, generated code; sgemm: the bare product, OpenBLAS through Graft;
- torch: torch eager (F.linear, relu/gelu, layer_norm), when installed.
"""
from __future__ import annotations
import argparse, math, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np


def median_ms(fn, repeats: int) -> float:
  for _ in range(3): fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def gelu_np(x): return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def cases(rng):
  def inputs(m, n, k):
    return (rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32) / np.float32(math.sqrt(k)),
            rng.standard_normal((n,), dtype=np.float32))
  ln = lambda t, g, b: t.layernorm() * g + b
  yield ("linear+relu 256x1024x1024", inputs(256, 1024, 1024), lambda x, w, b: x @ w, lambda p, x, w, b: (p + b).relu(),
         lambda x, w, b: np.maximum(x @ w + b, 0), "relu")
  yield ("linear+gelu 128x3072x768", inputs(128, 3072, 768), lambda x, w, b: x @ w, lambda p, x, w, b: (p + b).gelu(),
         lambda x, w, b: gelu_np(x @ w + b), "gelu")
  x, w, b = inputs(128, 2304, 768)
  g, s = rng.standard_normal((768,), dtype=np.float32), rng.standard_normal((768,), dtype=np.float32)
  def ln_np(x): return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + s
  yield ("layernorm+qkv 128x2304x768", (x, w, b, g, s), None, None, lambda x, w, b, g, s: ln_np(x) @ w + b, "ln")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=20)
  args = ap.parse_args()
  from tensor import Tensor
  try: import torch
  except ImportError: torch = None
  rows = []
  for name, arrays, _, _, ref, kind in cases(np.random.default_rng(0)):
    ts = [Tensor(a).realize() for a in arrays]
    # (a product's result is a view of its reduction, which realize() leaves lazy: contiguous() stores it)
    if kind == "ln":
      x, w, b, g, s = ts
      whole = lambda: ((x.layernorm() * g + s) @ w + b).realize()
      lib = lambda: ((x.layernorm() * g + s).realize() @ w).contiguous().realize() + b
      bare = lambda: (x @ w).contiguous().realize()
    else:
      x, w, b = ts
      act = (lambda t: t.relu()) if kind == "relu" else (lambda t: t.gelu())
      whole = lambda: act(x @ w + b).realize()
      lib = lambda: act((x @ w).contiguous().realize() + b)
      bare = lambda: (x @ w).contiguous().realize()
    os.environ["GRAFT_EXTERN"] = "0"
    err = float(np.abs(whole().numpy() - ref(*arrays)).max() / np.abs(ref(*arrays)).max())
    t_whole, t_bare = median_ms(whole, args.repeats), median_ms(bare, args.repeats)
    os.environ["GRAFT_EXTERN"] = "1"
    t_lib, t_sgemm = median_ms(lambda: lib().realize(), args.repeats), median_ms(bare, args.repeats)
    del os.environ["GRAFT_EXTERN"]
    t_torch = None
    if torch is not None:
      tt = [torch.tensor(a) for a in arrays]
      if kind == "ln":
        tx, tw, tb, tg, tsh = tt
        fn = lambda: torch.nn.functional.layer_norm(tx, (768,), tg, tsh) @ tw + tb
      else:
        tx, tw, tb = tt
        f = torch.relu if kind == "relu" else (lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
        wt = tw.T.contiguous()
        fn = lambda: f(torch.nn.functional.linear(tx, wt, tb))
      with torch.no_grad(): t_torch = median_ms(fn, args.repeats)
    rows.append((name, t_whole, t_lib, t_bare, t_sgemm, t_torch, err))
  print(f"{'':28s} {'graft ms':>9s} {'lib+pass':>9s} {'bare':>8s} {'sgemm':>8s} {'torch':>8s}  graft/lib+pass  graft/torch  rel.err")
  for name, tw_, tl, tb_, ts_, tt, err in rows:
    torch_cols = f"{tt:8.2f}" if tt is not None else f"{'-':>8s}"
    ratio_t = f"{tt / tw_:11.2f}x" if tt is not None else f"{'-':>12s}"
    print(f"{name:28s} {tw_:9.2f} {tl:9.2f} {tb_:8.2f} {ts_:8.2f} {torch_cols}  {tl / tw_:13.2f}x {ratio_t}  {err:.1e}")
  print("(ratios: the other's time over graft's; above 1: graft faster)")


if __name__ == "__main__":
  main()
