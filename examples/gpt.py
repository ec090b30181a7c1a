"""A GPT-2-style decoder forward: pre-layernorm blocks of causal self-attention and a GELU MLP, with residuals.

  DEVICE=CPU  python examples/gpt.py                 # 12 layers, 128 tokens, width 768 (../shared/WORKLOADS.md `gpt`)
  DEVICE=CUDA python examples/gpt.py --tokens 1024   # the GPU size
  DEVICE=CPU  python examples/gpt.py --small         # 2 layers, 16 tokens, width 64: a quick check against numpy

Start here for a model of your own: `GPT` holds its weights as Tensors (random, seed 0; load real ones into the same
shapes), `forward(x)` takes the (tokens, width) input and builds the graph, which runs when you ask for a result
(`.numpy()`, `.realize()`). A new input every call is what a service sees: the cached program runs again with no
compile. `jit` (`from tensor import jit`) also skips building the graph: the second call captures the program.
"""
from __future__ import annotations
import math
import numpy as np
from tensor import Tensor, dtypes, jit
from timing import first_and_warm, report


def numpy_weights(layers: int, width: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
  """The model's float32 weights as numpy arrays (per block, and the final norm's): products' weights normal * 0.02,
  layer norm gains 1, biases 0. Any framework can load them (bench/models.py gives torch the same ones)."""
  rng = np.random.default_rng(seed)
  def normal(*shape) -> np.ndarray: return rng.standard_normal(shape, np.float32) * np.float32(0.02)
  ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))
  blocks = [dict(ln1_g=ones(width), ln1_b=zeros(width), qkv_w=normal(width, 3 * width), qkv_b=zeros(3 * width),
                 proj_w=normal(width, width), proj_b=zeros(width), ln2_g=ones(width), ln2_b=zeros(width),
                 fc_w=normal(width, 4 * width), fc_b=zeros(4 * width), out_w=normal(4 * width, width), out_b=zeros(width))
            for _ in range(layers)]
  return blocks, dict(lnf_g=ones(width), lnf_b=zeros(width))


class GPT:
  """`layers` blocks of width `width` with `heads` attention heads; weights fp32 normal * 0.02 (layer norm gain 1,
  bias 0), cast to `dtype` (float32 or float16). Linear weights are stored (in, out): x @ w."""

  def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, dtype=dtypes.float32, seed: int = 0):
    assert width % heads == 0, "the width must split evenly into heads"
    self.width, self.heads, self.dtype = width, heads, dtype
    blocks, final = numpy_weights(layers, width, seed)
    def param(a: np.ndarray) -> Tensor: return Tensor(a).cast(dtype).realize()
    self.blocks = [{name: param(a) for name, a in b.items()} for b in blocks]
    self.lnf_g, self.lnf_b = param(final["lnf_g"]), param(final["lnf_b"])

  def attention(self, x: Tensor, b: dict) -> Tensor:
    tokens, width, heads = x.shape[0], self.width, self.heads
    q, k, v = (x @ b["qkv_w"] + b["qkv_b"]).reshape(tokens, 3, heads, width // heads).permute(1, 2, 0, 3)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(width // heads))      # (heads, tokens, tokens)
    later = Tensor.full((tokens, tokens), True, device=x.device).triu(1)     # causal: no position sees a later one
    scores = scores.masked_fill(later, -math.inf)
    out = scores.softmax(-1) @ v                                              # (heads, tokens, head size)
    return out.permute(1, 0, 2).reshape(tokens, width) @ b["proj_w"] + b["proj_b"]

  def mlp(self, x: Tensor, b: dict) -> Tensor:
    return (x @ b["fc_w"] + b["fc_b"]).gelu() @ b["out_w"] + b["out_b"]

  @staticmethod
  def norm(x: Tensor, g: Tensor, bias: Tensor) -> Tensor: return x.layernorm(-1) * g + bias

  def forward(self, x: Tensor) -> Tensor:
    for b in self.blocks:
      x = x + self.attention(self.norm(x, b["ln1_g"], b["ln1_b"]), b)   # the residual stream
      x = x + self.mlp(self.norm(x, b["ln2_g"], b["ln2_b"]), b)
    return self.norm(x, self.lnf_g, self.lnf_b)

  __call__ = forward


def forward_numpy(model: GPT, x: np.ndarray) -> np.ndarray:
  """The same forward in float64 numpy on the model's weights, to check against."""
  def w(t: Tensor) -> np.ndarray: return t.cast(dtypes.float32).numpy()
  blocks = [{name: w(t) for name, t in b.items()} for b in model.blocks]
  return forward_numpy_weights((blocks, {"lnf_g": w(model.lnf_g), "lnf_b": w(model.lnf_b)}), model.heads, x)


def forward_numpy_weights(weights, heads: int, x: np.ndarray) -> np.ndarray:
  """The forward in float64 numpy on `numpy_weights`-shaped weights."""
  blocks, final = weights
  w = lambda a: a.astype(np.float64)
  def norm(x, g, b): return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w(g) + w(b)
  tokens, width = x.shape
  x = x.astype(np.float64)
  for b in blocks:
    h = norm(x, b["ln1_g"], b["ln1_b"]) @ w(b["qkv_w"]) + w(b["qkv_b"])
    q, k, v = h.reshape(tokens, 3, heads, width // heads).transpose(1, 2, 0, 3)
    s = q @ k.transpose(0, 2, 1) / math.sqrt(width // heads)
    s = np.where(np.triu(np.ones((tokens, tokens), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    x = x + (p @ v).transpose(1, 0, 2).reshape(tokens, width) @ w(b["proj_w"]) + w(b["proj_b"])
    h = norm(x, b["ln2_g"], b["ln2_b"]) @ w(b["fc_w"]) + w(b["fc_b"])
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    x = x + h @ w(b["out_w"]) + w(b["out_b"])
  return norm(x, final["lnf_g"], final["lnf_b"])


def main():
  import argparse
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="2 layers, 16 tokens, width 64, 4 heads; checked against numpy")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--width", type=int, default=768)
  ap.add_argument("--half", action="store_true", help="float16 weights and activations")
  args = ap.parse_args()
  layers, tokens, width, heads = (2, 16, 64, 4) if args.small else (args.layers, args.tokens, args.width, 12)
  model = GPT(layers, width, heads, dtypes.float16 if args.half else dtypes.float32)
  rng = np.random.default_rng(1)
  inputs = [rng.standard_normal((tokens, width), np.float32).astype(model.dtype.np) for _ in range(4)]
  def new_input(i: int) -> Tensor: return Tensor(inputs[i % len(inputs)])

  calls = iter(range(1_000_000))
  out, first, warm = first_and_warm(lambda: model(new_input(next(calls))).realize())
  report(f"gpt {layers} layers, {tokens} tokens, width {width}", first, warm)
  fast = jit(model.forward)
  _, jfirst, jwarm = first_and_warm(lambda: fast(new_input(next(calls))).realize())
  report("  the same under jit", jfirst, jwarm)
  if args.small:
    x = inputs[0]
    got = model(Tensor(x)).cast(dtypes.float32).numpy()
    np.testing.assert_allclose(got, forward_numpy(model, x.astype(np.float32)), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(fast(Tensor(x)).cast(dtypes.float32).numpy(), got, rtol=1e-5, atol=1e-5)
    print("ok")


if __name__ == "__main__":
  main()
