"""Composite operations recorded on their first call and replayed after (tensor/recorded.py): a replay builds the very
graph the operations build, for every kind of input, and a record keeps no user buffer alive."""
import gc, math, weakref
import numpy as np
import pytest
from tensor import Tensor, dtypes, no_grad
from tensor import recorded
from tensor.args import AxisError

CALLS = {
  "softmax": lambda x: x.softmax(-1), "softmax(0)": lambda x: x.softmax(0), "log_softmax": lambda x: x.log_softmax(1),
  "logsumexp": lambda x: x.logsumexp(-1), "logsumexp keepdim": lambda x: x.logsumexp(0, keepdim=True),
  "layernorm": lambda x: x.layernorm(1, eps=1e-3), "relu": lambda x: x.relu(), "gelu": lambda x: x.gelu(),
  "silu": lambda x: x.silu(), "sigmoid": lambda x: x.sigmoid(), "tanh": lambda x: x.tanh(),
  "x @ x.T": lambda x: x @ (x + 1).T, "x.T @ x": lambda x: x.T @ (x * 2), "matmul to float32": lambda x: x.matmul(x.T * 3, dtype=dtypes.float32),
}
DIRECT = {   # the same calls, through the undecorated methods: built by the tensor operations every time
  "softmax": lambda x: Tensor.softmax.__wrapped__(x, -1), "softmax(0)": lambda x: Tensor.softmax.__wrapped__(x, 0),
  "log_softmax": lambda x: Tensor.log_softmax.__wrapped__(x, 1),
  "logsumexp": lambda x: Tensor.logsumexp.__wrapped__(x, -1),
  "logsumexp keepdim": lambda x: Tensor.logsumexp.__wrapped__(x, 0, keepdim=True),
  "layernorm": lambda x: Tensor.layernorm.__wrapped__(x, 1, eps=1e-3), "relu": Tensor.relu.__wrapped__,
  "gelu": Tensor.gelu.__wrapped__, "silu": Tensor.silu.__wrapped__, "sigmoid": Tensor.sigmoid.__wrapped__,
  "tanh": Tensor.tanh.__wrapped__, "x @ x.T": lambda x: Tensor.matmul.__wrapped__(x, (x + 1).T),
  "x.T @ x": lambda x: Tensor.matmul.__wrapped__(x.T, x * 2),
  "matmul to float32": lambda x: Tensor.matmul.__wrapped__(x, x.T * 3, dtype=dtypes.float32),
  "sum": lambda x: Tensor.sum.__wrapped__(x, 1), "sum of all": Tensor.sum.__wrapped__,
  "mean keepdim": lambda x: Tensor.mean.__wrapped__(x, 0, keepdim=True), "max": lambda x: Tensor.max.__wrapped__(x, -1),
  "sum to float32": lambda x: Tensor.sum.__wrapped__(x, (0, 1), dtype=dtypes.float32),
}


def inputs(kind: str, seed: int) -> Tensor:
  a = np.random.default_rng(seed).standard_normal((6, 5)).astype(np.float32)
  if kind == "float32": return Tensor(a)
  if kind == "float16": return Tensor(a.astype(np.float16))
  if kind == "bfloat16": return Tensor(a, dtype=dtypes.bfloat16)
  if kind == "lazy": return Tensor(a) * 2 + 1
  if kind == "view": return Tensor(a.reshape(5, 6)).T
  raise ValueError(kind)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "lazy", "view"])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_replay_builds_the_graph_the_operations_build(name, kind):
  for seed in range(3):   # the first call records, the later ones replay over new inputs
    x = inputs(kind, seed)
    out, direct = CALLS[name](x), DIRECT[name](x)
    assert out.uop is direct.uop   # hash-consed: one node is one graph
    assert (out.shape, out.device) == (direct.shape, direct.device)


def test_no_grad_is_part_of_the_key():
  x = inputs("float32", 0)
  x.softmax(-1)
  with no_grad():
    y = inputs("float32", 1)
    assert y.softmax(-1).uop is Tensor.softmax.__wrapped__(y, -1).uop   # every result detached
  z = inputs("float32", 2)
  assert z.softmax(-1).uop is Tensor.softmax.__wrapped__(z, -1).uop


def test_replayed_values_are_numpys():
  for seed in range(3):
    a = np.random.default_rng(seed).standard_normal((4, 7)).astype(np.float32)
    e = np.exp(a - a.max(1, keepdims=True))
    np.testing.assert_allclose(Tensor(a).softmax(1).numpy(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    c = a - a.mean(1, keepdims=True)
    np.testing.assert_allclose(Tensor(a).layernorm(1).numpy(), c / np.sqrt((c * c).mean(1, keepdims=True) + 1e-5), rtol=1e-4, atol=1e-5)


def test_a_bad_argument_raises_on_every_call_even_when_an_equal_one_was_recorded():
  x = inputs("float32", 0)
  x.softmax(1)
  for _ in range(2):
    with pytest.raises(TypeError, match="axis"): inputs("float32", 1).softmax(True)   # True == 1, but not an axis
    with pytest.raises(AxisError): inputs("float32", 1).softmax(5)


def test_a_record_keeps_no_input_alive():
  x = inputs("float32", 0)
  buf = weakref.ref(x.uop.src[0].arg)
  out = x.gelu()
  del x, out
  gc.collect()
  assert buf() is None


def replayed(t: Tensor) -> bool:
  """Whether t is a replay not built yet (its graph made only when read)."""
  return t._graph().__class__ is recorded.Unbuilt


def test_a_constant_input_is_recorded_by_its_value():
  Tensor.zeros(3, 3).sigmoid()
  assert replayed(Tensor.zeros(3, 3).sigmoid())
  for _ in range(2):   # the first call records, the second replays
    assert Tensor.zeros(3, 3).sigmoid().uop is Tensor.sigmoid.__wrapped__(Tensor.zeros(3, 3)).uop
    np.testing.assert_allclose(Tensor.zeros(3, 3).sigmoid().numpy(), np.full((3, 3), 0.5))
    np.testing.assert_allclose(Tensor.full((3, 3), 2.0).sigmoid().numpy(), np.full((3, 3), 1 / (1 + np.exp(-2.0))), rtol=1e-6)
    assert np.isnan(Tensor.full((2,), math.nan).sigmoid().numpy()).all()
  # -0.0 == 0.0, but not as a record's constant: relu keeps each one's sign
  assert np.signbit(Tensor.full((2,), -0.0).relu().numpy()).all()
  assert not np.signbit(Tensor.full((2,), 0.0).relu().numpy()).any()


def test_a_causal_mask_of_constants_is_one_recorded_node():
  made = [Tensor.full((5, 5), True).triu(1) for _ in range(3)]
  assert replayed(made[2])
  assert made[1].uop is made[0].uop and made[2].uop is made[0].uop
  np.testing.assert_array_equal(made[2].numpy(), np.triu(np.ones((5, 5), bool), 1))
  np.testing.assert_array_equal(Tensor.full((5, 5), True).tril(-1).numpy(), np.tril(np.ones((5, 5), bool), -1))
  np.testing.assert_array_equal(Tensor.full((5, 4), 2.0).triu(2).numpy(), np.triu(np.full((5, 4), 2.0, np.float32), 2))


def test_two_arguments_read_through_one_node_are_one_input():
  # attention's q and k are views of one qkv: their product is recorded (once), and a + a is not a + b
  for seed in range(3):
    a = np.random.default_rng(seed).standard_normal((2, 4, 3)).astype(np.float32)
    qkv = Tensor(a) * 2
    q, k = qkv[0], qkv[1]
    out = q @ k.T
    assert replayed(out) == (seed > 0)
    assert out.uop is Tensor.matmul.__wrapped__(q, k.T).uop
    np.testing.assert_allclose(out.numpy(), (2 * a[0]) @ (2 * a[1]).T, rtol=1e-5)
    same = q @ q.T
    assert same.uop is Tensor.matmul.__wrapped__(q, q.T).uop
    np.testing.assert_allclose(same.numpy(), (2 * a[0]) @ (2 * a[0]).T, rtol=1e-5)
    x, y = Tensor(a[0]), Tensor(a[1])
    np.testing.assert_allclose((x > 0).where(x, y).numpy(), np.where(a[0] > 0, a[0], a[1]))
    np.testing.assert_allclose((x > 0).where(x, x).numpy(), a[0])


def test_a_graph_holding_another_buffer_is_not_recorded():
  # a method whose result reads a buffer besides its input: replaying it would keep that buffer alive
  other = Tensor(np.ones(4, np.float32))
  @recorded.recorded
  def plus_other(self): return self + other
  plus_other(Tensor(np.zeros(4, np.float32)))
  assert not any(k[0].endswith("plus_other") for k in recorded._records)
  np.testing.assert_allclose(plus_other(Tensor(np.full(4, 2, np.float32))).numpy(), np.full(4, 3))


def operand_pairs(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  t = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32))
  big = t(8, 9)
  return {"matrices": (t(3, 4), t(4, 5)), "batched": (t(2, 3, 4), t(4, 5)), "vector @ matrix": (t(4), t(4, 5)),
          "matrix @ vector": (t(3, 4), t(4)), "slices": (big[1:4, :4], big[:4, 2:7]), "lazy": (t(3, 4).exp(), t(4, 5) + 1),
          "a view of a lazy tensor": ((t(4, 3) * 2).T, t(5, 4).T), "one tensor twice": (big[:8, :8],) * 2,
          "float16": (t(3, 4).half(), t(4, 5).half())}


@pytest.mark.parametrize("name", list(operand_pairs(0)))
def test_a_replayed_product_is_the_product_the_operations_build(name):
  for seed in range(3):
    a, b = operand_pairs(seed)[name]
    out = a @ b
    assert out.uop is Tensor.matmul.__wrapped__(a, b).uop
    np.testing.assert_allclose(out.numpy(), a.numpy().astype(np.float32) @ b.numpy().astype(np.float32), rtol=2e-2 if name == "float16" else 1e-5, atol=1e-2 if name == "float16" else 1e-5)


def test_a_float_argument_of_negative_zero_is_not_the_record_of_zero():
  # -0.0 == 0.0 as a dict key, yet the constants differ: each call builds the graph its own argument makes
  x = Tensor(np.ones((4, 8), np.float32))
  build = Tensor.layernorm.__wrapped__
  for eps in (0.0, -0.0, 0.0):
    assert x.layernorm(1, eps=eps).uop is build(x, 1, eps=eps).uop
    assert x.layernorm(1, eps).uop is build(x, 1, eps).uop


def test_a_replayed_result_realized_at_once_finds_its_program_without_building_its_nodes(monkeypatch):
  # a warm call `x.softmax(1).realize()`: the program is found by the record and the input; the nodes between the
  # input and the result are never made (tensor/recorded.py Unbuilt)
  built = []
  replay = recorded._replay
  monkeypatch.setattr(recorded, "_replay", lambda rec, stands: built.append(rec) or replay(rec, stands))
  arrays = [np.random.default_rng(seed).standard_normal((3, 8)).astype(np.float32) for seed in range(4)]
  Tensor(arrays[0]).softmax(1).numpy()   # the first call records (and compiles)
  for a in arrays[1:]:
    x = Tensor(a)
    buf = weakref.ref(x.uop.src[0].arg)
    out = x.softmax(1)
    assert not out.is_realized and out.shape == (3, 8)
    e = np.exp(a - a.max(1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert out.is_realized and built == []
    del x
    gc.collect()
    assert buf() is None   # the realized result no longer holds its input
  # anything that reads the result's graph builds it: the very node the operations make
  x = Tensor(arrays[1])
  out = x.softmax(1)
  assert out.uop is Tensor.softmax.__wrapped__(x, 1).uop and [r.name for r in built].count("NNMixin.softmax") == 1
  np.testing.assert_allclose((x.softmax(1) + 1).numpy(), out.numpy() + 1, rtol=1e-6)
  with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"): out.no_such_thing


def test_threads_reading_one_unbuilt_result_at_once_each_get_its_graph():
  # the first read builds the graph; a thread reading meanwhile finds the record or the built graph, never neither
  import sys, threading
  x = Tensor(np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32))
  want = x.layernorm(1, eps=1e-2).numpy()   # (records)
  errors, interval = [], sys.getswitchinterval()
  sys.setswitchinterval(1e-6)   # (threads switch often: the window, if any, is hit)
  try:
    for _ in range(100):
      y = x.layernorm(1, eps=1e-2)
      barrier = threading.Barrier(4)
      def use(k):
        barrier.wait()
        try: np.testing.assert_allclose((y * k).numpy(), want * k, rtol=1e-5, atol=1e-5)
        except Exception as e: errors.append(repr(e))
      threads = [threading.Thread(target=use, args=(k,)) for k in (1.0, 2.0, 3.0, 4.0)]
      for t in threads: t.start()
      for t in threads: t.join()
  finally: sys.setswitchinterval(interval)
  assert errors == []


def test_a_change_of_the_default_float_is_a_new_record():
  x = Tensor(np.arange(6, dtype=np.int32).reshape(2, 3))
  assert x.mean(1).dtype is dtypes.float32
  try:
    dtypes.default_float = dtypes.float16
    assert x.mean(1).dtype is dtypes.float16
  finally: dtypes.default_float = dtypes.float32
  assert x.mean(1).dtype is dtypes.float32


def test_the_default_int_is_part_of_the_key(monkeypatch):
  # where(1, 2) computes in the default int: a replay after it changed must not give the record's dtype
  c = Tensor(np.array([True, False]))
  assert c.where(1, 2).dtype is dtypes.int32 and c.where(1, 2).dtype is dtypes.int32   # (recorded, replayed)
  monkeypatch.setattr(dtypes, "default_int", dtypes.int64)
  out = c.where(1, 2)
  assert out.dtype is dtypes.int64
  np.testing.assert_array_equal(out.numpy(), [1, 2])


def test_the_dtype_of_a_replay_does_not_build_it():
  inputs("float32", 0).softmax(-1)
  out = inputs("float32", 1).softmax(-1)
  assert out.dtype is dtypes.float32 and replayed(out)


def test_an_attribute_error_inside_a_property_names_what_is_missing():
  # Tensor.__getattr__ (which builds an unbuilt replay's graph) is what Python calls when a property raises
  # AttributeError inside: the error says what is really missing, not that the property is
  class Annotated(Tensor):
    __slots__ = ()
    @property
    def label(self): return self.missing_label
  t = Annotated(np.ones(2, np.float32))
  with pytest.raises(AttributeError, match="missing_label"): t.label
  with pytest.raises(AttributeError, match="no attribute 'nothing'"): t.nothing
