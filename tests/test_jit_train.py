"""A whole training step under `jit`: forward, loss.backward() and optimizer.step() are recorded once and replayed on
new data, writing the parameters and the optimizer's state in place; the losses, parameters and gradients are those
of the same loop without jit (and torch's); what cannot be replayed is a clear JitError."""
import sys
import numpy as np
import pytest
from tensor import Tensor, jit, JitError
from tensor.optim import SGD, Adam, AdamW
import runtime.realize as rt

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPTLM  # noqa: E402


def _data(step: int):
  rng = np.random.default_rng(step)
  return rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)


def _weights():
  rng = np.random.default_rng(100)
  return [(rng.standard_normal((16, 8)) * 0.4).astype(np.float32), np.zeros(16, np.float32),
          (rng.standard_normal((3, 16)) * 0.4).astype(np.float32), np.full(3, 0.1, np.float32)]


def _train(opt_cls, steps: int, use_jit: bool, **kw):
  """An MLP trained `steps` steps on new data each step: (losses, parameters after each step, gradients at the end,
  how many times the step function ran)."""
  ps = [Tensor(w, requires_grad=True) for w in _weights()]
  opt, calls = opt_cls(ps, **kw), []
  def train_step(x, y):
    calls.append(1)
    loss = ((x.linear(ps[0], ps[1]).relu().linear(ps[2], ps[3]) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  step = jit(train_step) if use_jit else train_step
  losses, params = [], []
  for i in range(steps):
    x, y = _data(i)
    losses.append(step(Tensor(x), Tensor(y)).item())
    params.append([p.numpy() for p in ps])
  return losses, params, [p.grad.numpy() for p in ps], len(calls)


def _train_torch(opt_cls, steps: int, **kw):
  torch = pytest.importorskip("torch")
  import torch.nn.functional as F
  ps = [torch.tensor(w, requires_grad=True) for w in _weights()]
  opt, losses, params = getattr(torch.optim, opt_cls.__name__)(ps, **kw), [], []
  for i in range(steps):
    x, y = map(torch.tensor, _data(i))
    loss = ((F.linear(F.linear(x, ps[0], ps[1]).relu(), ps[2], ps[3]) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    params.append([p.detach().numpy().copy() for p in ps])
  return losses, params


@pytest.mark.parametrize("opt_cls, kw", [
  (SGD, dict(lr=0.05)),
  (SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2)),   # its first step differs from the others
  (Adam, dict(lr=1e-2, weight_decay=1e-2)),
  (AdamW, dict(lr=1e-2)),
])
def test_a_jitted_30_step_loop_follows_the_plain_loop_and_torch(opt_cls, kw):
  losses, params, grads, calls = _train(opt_cls, 30, True, **kw)
  plain_losses, plain_params, plain_grads, _ = _train(opt_cls, 30, False, **kw)
  assert calls <= 3   # recorded until two calls in a row ran the same work; every later step is a replay
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  for ours, plain in zip(params[-1] + grads, plain_params[-1] + plain_grads): np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-7)
  torch_losses, torch_params = _train_torch(opt_cls, 30, **kw)
  np.testing.assert_allclose(losses, torch_losses, rtol=1e-3)
  for step in (1, 29):   # steps 2 and 30: Adam's bias corrections are state the replay updates, not constants
    for ours, theirs in zip(params[step], torch_params[step]): np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


def test_a_replay_builds_no_graph_and_sets_this_steps_gradients(monkeypatch):
  w = Tensor(np.ones((4, 2), np.float32), requires_grad=True)
  opt = SGD([w], lr=0.1)
  @jit
  def train_step(x):
    loss = (x @ w).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  for i in range(2): train_step(Tensor(np.full((3, 4), i, np.float32)))
  monkeypatch.setattr(rt, "_lower", lambda *a, **k: pytest.fail("the compiler ran on a replay"))
  expected = np.ones((4, 2), np.float32) - 0.1 * 3 * (0 + 1)
  for i in range(2, 5):
    x = np.full((3, 4), i, np.float32)
    np.testing.assert_allclose(train_step(Tensor(x)).numpy(), (x @ expected).sum(), rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), x.T @ np.ones((3, 2)), rtol=1e-6)   # this step's gradient
    expected = expected - 0.1 * x.T @ np.ones((3, 2))
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)
    opt.zero_grad()   # between calls too: the replay sets .grad again
    assert w.grad is None


def test_gradients_accumulate_across_calls_as_without_jit():
  """Micro-batches: a jitted backward() adds to .grad on each call; the optimizer steps outside every 3 calls."""
  def run(use_jit: bool):
    w = Tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), requires_grad=True)
    opt = SGD([w], lr=0.1)
    def micro(x):
      loss = (x @ w).square().mean()
      loss.backward()   # no zero_grad(): the .grad of the calls before is added to
      return loss
    f, rng, seen = jit(micro) if use_jit else micro, np.random.default_rng(0), []
    for _ in range(4):
      for _ in range(3): seen.append(f(Tensor(rng.standard_normal((5, 4)).astype(np.float32))).item())
      seen.append(w.grad.numpy().copy())
      opt.step()
      opt.zero_grad()
    return seen, w.numpy()
  (ours, w_ours), (plain, w_plain) = run(True), run(False)
  for a, b in zip(ours, plain): np.testing.assert_allclose(a, b, rtol=1e-6)
  np.testing.assert_allclose(w_ours, w_plain, rtol=1e-6)


def _gpt_run(use_jit: bool, steps: int = 5):
  model = GPTLM(vocab=64, context=16, layers=2, width=32, heads=2)
  opt = AdamW(model.parameters(), lr=1e-2)
  calls = []
  def train_step(ids, targets):
    calls.append(1)
    loss = model.loss(ids, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  step, rng, losses = jit(train_step) if use_jit else train_step, np.random.default_rng(0), []
  for _ in range(steps):
    ids = rng.integers(0, 64, (2, 17)).astype(np.int32)
    losses.append(step(Tensor(ids[:, :-1]), Tensor(ids[:, 1:])).item())
  return losses, [p.numpy() for p in model.parameters()], len(calls), step, model


def test_a_jitted_gpt_step_equals_the_plain_one():
  losses, params, calls, _, _ = _gpt_run(True)
  plain_losses, plain_params, _, _, _ = _gpt_run(False)
  assert calls == 2
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  for ours, plain in zip(params, plain_params): np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-7)


def test_an_index_out_of_range_is_caught_on_a_replay_before_anything_is_written():
  _, _, _, step, model = _gpt_run(True, steps=3)
  before = [p.numpy() for p in model.parameters()]
  ids = np.zeros((2, 16), np.int32)
  ids[1, 3] = 64   # the vocabulary has 64 tokens
  with pytest.raises(IndexError, match="index 64 is out of bounds for an axis of size 64"): step(Tensor(ids), Tensor(np.zeros((2, 16), np.int32)))
  for a, b in zip(before, model.parameters()): np.testing.assert_array_equal(a, b.numpy())


def test_what_cannot_be_replayed_is_an_error_naming_it():
  w = Tensor(np.ones(3, np.float32), requires_grad=True)
  lr = [0.1]
  def decaying(x):   # a learning rate as a Python float: a new constant, a new program, every call
    lr[0] *= 0.5
    loss = (x * w).sum()
    loss.backward()
    return w.grad * lr[0]
  f = jit(decaying)
  with pytest.raises(JitError, match=r"each ran other work than the call before \(the last two: a program with CONST 0\.0125 "
                                     r"against one with CONST 0\.00625\).*keep it in a tensor"):
    for _ in range(5): f(Tensor(np.ones(3, np.float32)))

  g = jit(lambda x: x + Tensor(np.arange(3, dtype=np.float32)))   # numpy data made into a tensor on every call
  with pytest.raises(JitError, match="the later read another .a tensor made anew on each call"):
    for _ in range(5): g(Tensor(np.ones(3, np.float32)))

  box = [Tensor(np.zeros(3, np.float32))]
  def replaces(x):   # state replaced, not updated in place: each call reads what the call before made
    box[0] = (box[0] + x).realize()
    return box[0] * 1
  h = jit(replaces)
  with pytest.raises(JitError, match="the later read the float32.3. tensor that the earlier call computed.*use assign"):
    for _ in range(5): h(Tensor(np.ones(3, np.float32)))

  def logs(x):
    loss = (x * w).sum()
    print(loss.item())   # a value read into Python: no replay could print it
    return loss
  with pytest.raises(JitError, match=r"reads tensor values into Python \(numpy\(\) \(or \.item\(\)"): jit(logs)(Tensor(np.ones(3, np.float32)))


def test_a_replay_whose_index_check_fails_keeps_the_gradients():
  # the gradients a replay replaces are let go before it runs, but not before its index checks passed: a call that
  # raises IndexError changes nothing, .grad included
  _, _, _, step, model = _gpt_run(True, steps=3)
  grads = [p.grad.numpy() for p in model.parameters()]
  ids = np.zeros((2, 16), np.int32)
  ids[0, 0] = -65
  with pytest.raises(IndexError, match="index -65 is out of bounds"): step(Tensor(ids), Tensor(np.zeros((2, 16), np.int32)))
  for g, p in zip(grads, model.parameters()): np.testing.assert_array_equal(g, p.grad.numpy())


class _Schedule:
  lr = 0.1


def test_a_python_float_changed_after_capture_is_not_replayed_as_the_old_value():
  # a learning rate kept as a plain float attribute (not opt.lr, which is a tensor) is a constant of the captured
  # programs: when it changes, the call records again instead of replaying the old value
  sched = _Schedule()
  sched.lr = 0.5
  def run(use_jit: bool) -> list:
    w, calls = Tensor(np.ones(3, np.float32), requires_grad=True), []
    def sgd_step(x):
      calls.append(1)
      loss = (x * w * w).sum()
      w.grad = None
      loss.backward()
      w.assign(w - w.grad * sched.lr)
      return loss
    step, out = jit(sgd_step) if use_jit else sgd_step, []
    for i in range(8):
      sched.lr = 0.5 if i < 4 else 0.25   # a step schedule: four calls (captured after two), then another rate
      step(Tensor(np.full(3, 0.1, np.float32)))
      out.append(w.numpy())
    assert len(calls) == (4 if use_jit else 8)   # recorded twice at each rate, replayed twice at each
    return out
  for ours, plain in zip(run(True), run(False)): np.testing.assert_allclose(ours, plain, rtol=1e-6)
