"""Training a small GPT-2-style language model on text the package ships (its own docs, byte by byte).

  DEVICE=CPU python examples/train_gpt.py            # 4 layers, 64 tokens, width 128, batch 8, 100 steps
  DEVICE=CPU python examples/train_gpt.py --small    # 2 layers, 32 tokens, width 64: 30 quick steps (the tests)
  DEVICE=CPU python examples/train_gpt.py --no-jit   # every step builds its graph (the same losses, slower)

The model (`GPTLM`) is examples/gpt.py's decoder with what a language model adds: a token embedding (`wte[ids]`),
learned positions, the output projection tied to the embedding (`x @ wte.T`) and cross-entropy against the next
token. Every step is `zero_grad()`, `backward()`, `step()` (AdamW); the step's one realize runs the forward pass, the
backward pass and the update together. The step is a `jit` function of the token ids: from its third call on, its
recorded programs replay on the new ids, updating the weights and AdamW's state in place, without building the graph.
bench/train.py times one step of it against torch.
"""
from __future__ import annotations
import argparse, math, pathlib, sys, time
import numpy as np
from tensor import Tensor, jit
from tensor.optim import AdamW

TEXT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md"


class GPTLM:
  """A decoder of `layers` pre-layernorm blocks (causal attention with `heads` heads, GELU MLP 4x) over a
  vocabulary of `vocab` tokens and at most `context` positions. Weights: normal * 0.02 (GPT-2's), layer norm gain 1
  and bias 0, linear weights stored (in, out): x @ w."""

  def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int, seed: int = 0):
    assert width % heads == 0, "the width must split evenly into heads"
    self.width, self.heads = width, heads
    rng = np.random.default_rng(seed)
    def param(*shape, value=None) -> Tensor:
      data = np.full(shape, value, np.float32) if value is not None else (rng.standard_normal(shape, np.float32) * 0.02)
      return Tensor(data, requires_grad=True)
    self.wte, self.wpe = param(vocab, width), param(context, width)
    self.blocks = [dict(ln1_g=param(width, value=1.0), ln1_b=param(width, value=0.0),
                        qkv_w=param(width, 3 * width), qkv_b=param(3 * width, value=0.0),
                        proj_w=param(width, width), proj_b=param(width, value=0.0),
                        ln2_g=param(width, value=1.0), ln2_b=param(width, value=0.0),
                        fc_w=param(width, 4 * width), fc_b=param(4 * width, value=0.0),
                        out_w=param(4 * width, width), out_b=param(width, value=0.0)) for _ in range(layers)]
    self.lnf_g, self.lnf_b = param(width, value=1.0), param(width, value=0.0)

  def parameters(self) -> list[Tensor]:
    return [self.wte, self.wpe, *(t for b in self.blocks for t in b.values()), self.lnf_g, self.lnf_b]

  def attention(self, x: Tensor, b: dict) -> Tensor:
    batch, tokens, width, heads = *x.shape[:2], self.width, self.heads
    qkv = (x @ b["qkv_w"] + b["qkv_b"]).reshape(batch, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]                                          # (batch, heads, tokens, head size)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(width // heads))
    later = Tensor.arange(tokens).reshape(1, tokens) > Tensor.arange(tokens).reshape(tokens, 1)
    out = later.where(-math.inf, scores).softmax(-1) @ v                      # causal: no position sees a later one
    return out.permute(0, 2, 1, 3).reshape(batch, tokens, width) @ b["proj_w"] + b["proj_b"]

  def mlp(self, x: Tensor, b: dict) -> Tensor:
    return (x @ b["fc_w"] + b["fc_b"]).gelu() @ b["out_w"] + b["out_b"]

  @staticmethod
  def norm(x: Tensor, g: Tensor, bias: Tensor) -> Tensor: return x.layernorm(-1) * g + bias

  def __call__(self, ids: np.ndarray) -> Tensor:
    """Logits (batch, tokens, vocab) of the next token after each of `ids` (batch, tokens)."""
    tokens = ids.shape[1]
    x = self.wte[ids] + self.wpe[:tokens]
    for b in self.blocks:
      x = x + self.attention(self.norm(x, b["ln1_g"], b["ln1_b"]), b)   # the residual stream
      x = x + self.mlp(self.norm(x, b["ln2_g"], b["ln2_b"]), b)
    return self.norm(x, self.lnf_g, self.lnf_b) @ self.wte.T            # the output projection tied to the embedding

  def loss(self, ids: np.ndarray, targets: np.ndarray) -> Tensor:
    logits = self(ids)
    return logits.reshape(-1, logits.shape[-1]).cross_entropy(targets.reshape(-1))


def batches(data: np.ndarray, batch: int, tokens: int, rng: np.random.Generator):
  """Random windows of the text: (ids, the next token of each)."""
  while True:
    starts = rng.integers(0, len(data) - tokens - 1, batch)
    window = np.stack([data[s:s + tokens + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="2 layers, 32 tokens, width 64, 30 steps (what the tests run)")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--width", type=int, default=128)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--no-jit", action="store_true", help="build every step's graph (no jit)")
  args = ap.parse_args()
  layers, tokens, width, heads, batch = (2, 32, 64, 4, 8) if args.small else (args.layers, args.tokens, args.width, 4, args.batch)
  steps = args.steps or (30 if args.small else 100)

  data = np.frombuffer(TEXT.read_bytes(), np.uint8)   # bytes are tokens: a vocabulary of 256
  model = GPTLM(256, tokens, layers, width, heads)
  opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
  feed = batches(data, batch, tokens, np.random.default_rng(0))
  print(f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(data):,} bytes of {TEXT.name}; "
        f"uniform guessing would score {math.log(256):.3f}")

  def train_step(ids: Tensor, targets: Tensor) -> Tensor:
    loss = model.loss(ids, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  if not args.no_jit: train_step = jit(train_step)

  tty, losses, t0 = sys.stdout.isatty(), [], time.perf_counter()
  for step in range(1, steps + 1):
    ids, targets = next(feed)
    losses.append(train_step(Tensor(ids), Tensor(targets)).item())
    line = f"step {step:4d}/{steps}  loss {losses[-1]:.4f}"
    print(("\r" if tty else "") + line, end="" if tty else "\n", flush=True)
  if tty: print()
  secs = time.perf_counter() - t0
  print(f"{steps} steps in {secs:.1f} s ({secs / steps * 1e3:.0f} ms a step, the first compiles; jit "
        f"{'off' if args.no_jit else 'on'}); "
        f"loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-3:]):.3f}")
  if np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0: print("ok")


if __name__ == "__main__":
  main()
