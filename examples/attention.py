"""Scaled dot-product attention, softmax(q @ k^T / sqrt(d)) @ v over a batch of heads; checked against numpy.

  DEVICE=CPU python examples/attention.py            # 8 heads, sequence 256, head size 64
  DEVICE=CPU python examples/attention.py --small    # tiny sizes

`causal=True` masks each position's view of later ones with `where`, built from two aranges.
"""
import math
import numpy as np
from tensor import Tensor
from timing import parse_args, first_and_warm, report


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
  scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])   # (heads, seq, seq)
  if causal:
    seq = q.shape[-2]
    later = Tensor.arange(seq).reshape(1, seq) > Tensor.arange(seq).reshape(seq, 1)
    scores = later.where(-math.inf, scores)
  return scores.softmax(-1) @ v


def attention_numpy(q, k, v, causal=False):
  s = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(q.shape[-1]))
  if causal: s = np.where(np.triu(np.ones(s.shape[-2:], dtype=bool), 1), -np.inf, s)
  e = np.exp(s - s.max(-1, keepdims=True))
  return (e / e.sum(-1, keepdims=True)) @ v


def main():
  args = parse_args(__doc__.splitlines()[0])
  heads, seq, d = (2, 16, 8) if args.small else (8, 256, 64)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((heads, seq, d), dtype=np.float32) for _ in range(3))

  qt, kt, vt = Tensor(q), Tensor(k), Tensor(v)
  out, first, warm = first_and_warm(lambda: attention(qt, kt, vt).realize())
  np.testing.assert_allclose(out.numpy(), attention_numpy(q, k, v), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(attention(qt, kt, vt, causal=True).numpy(), attention_numpy(q, k, v, causal=True),
                             rtol=1e-4, atol=1e-5)
  report(f"attention {heads} heads x {seq} x {d}", first, warm)
  print("ok")


if __name__ == "__main__":
  main()
