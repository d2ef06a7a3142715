"""The contract between the cache and its token stores: a store answers for itself, the cache never asks its class.

A store defined here, outside ``kveval/``, that implements only :class:`~kveval.stores.base.TokenStore`'s abstract
methods runs through the cache (selection at the prefill, decode budgets, per-head budgets, a sliding layer) with
no edit under ``kveval/``, and gives the bits of the dense store it copies; and no module of ``kveval/cache`` switches
on a concrete store class.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import kveval.stores
from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate
from kveval.stores.base import BatchFamily, DenseStore, TokenStore

from cache_runs import fingerprint
from tiny_models import Tok, tiny_gemma3, tiny_llama

CACHE_DIR = Path(kveval.stores.__file__).parent.parent / "cache"


class PlainStore(TokenStore):
    """Tokens held as they came, in ``kv_dtype`` (the numbers a :class:`DenseStore` holds), with nothing but the
    abstract methods: every question the cache asks gets :class:`TokenStore`'s default answer."""

    def __init__(self, kv_dtype: torch.dtype, compute_dtype: torch.dtype):
        self.kv_dtype, self.compute_dtype = kv_dtype, compute_dtype
        self.keys = self.values = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=1)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=1)

    def select(self, index: torch.Tensor) -> None:
        def gather(x):
            return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))

        self.keys, self.values = gather(self.keys), gather(self.values)

    def seal(self) -> None:
        pass

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


def _prompts(n=4, seed=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 60, (n,), generator=g).tolist()
    return [Prompt(torch.randint(3, 128, (k,), generator=g).tolist(), torch.randint(3, 128, (4,), generator=g).tolist())
            for k in lengths]


def _generate(model, spec, monkeypatch, plain: bool):
    """Fingerprints of a batched generation of ``spec``, and how many steps the batch decoded on its buffer."""
    steps = []
    original = BufferedDecode.append
    with monkeypatch.context() as patch:
        patch.setattr(BufferedDecode, "append", lambda self, *a, **k: (steps.append(1), original(self, *a, **k))[1])
        if plain:  # the cache's only store factory, as a representation's make_store would supply one
            patch.setattr(CompressedCache, "new_store", lambda self, layer_idx, dtype: PlainStore(self.kv_dtype, dtype))
        results = generate(model, Tok(), _prompts(), parse_policy(spec), max_new_tokens=12, batch_size=4,
                           kv_dtype=torch.float16)
    return [fingerprint(r) for r in results], len(steps)


@pytest.mark.parametrize("make, spec", [
    (tiny_llama, "none"), (tiny_llama, "snapkv(ratio=0.5)"), (tiny_llama, "h2o(ratio=0.5,decode_budget=30,recent=4)"),
    (tiny_llama, "snapkv(ratio=0.5,adaptive=true)"), (tiny_llama, "h2o(ratio=0.5,adaptive=true,decode_budget=30)"),
    (tiny_gemma3, "none")])  # Gemma 3: sliding layers trim the store's tokens
def test_a_store_defined_outside_kveval_runs_through_the_cache_with_the_dense_stores_bits(make, spec, monkeypatch):
    """The plain store decodes row by row (its batch family is the default), and every answer, byte count and kept
    token equals the dense store's, which decodes in batch (where the policy allows): nothing in the cache needed
    to know the new class."""
    model = make()
    with torch.no_grad():
        dense, _ = _generate(model, spec, monkeypatch, plain=False)
        plain, batched_steps = _generate(model, spec, monkeypatch, plain=True)
    assert batched_steps == 0
    assert plain == dense


def test_a_store_gets_the_defaults_of_every_question_the_cache_asks():
    store = PlainStore(torch.float16, torch.float32)
    store.append(torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert store.batch_family is BatchFamily.NONE
    assert (store.copies_on_append, store.ragged_heads, store.head_groups, store.kept_tokens()) == (False, False, 1, 3)
    assert not store.holds_dense() and not store.encodes_on_arrival() and not store.same_code(store)
    assert store.every_slot_alive() and store.residual_intact()
    with pytest.raises(TypeError, match="PlainStore holds the same tokens count in every head"):
        store.select_heads([torch.tensor([0]), torch.tensor([1, 2])])
    with pytest.raises(TypeError, match="cannot load a buffer's row"):
        store.load_buffer_row(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))


def _store_classes() -> dict[str, type]:
    """Every concrete store class of ``kveval.stores``, by name."""
    for info in pkgutil.iter_modules(kveval.stores.__path__):
        importlib.import_module(f"kveval.stores.{info.name}")
    found, pending = {}, [TokenStore]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith("kveval.stores."):
            found[cls.__name__] = cls
    return found


def _class_switches(path: Path, names: set[str]) -> list[str]:
    """``isinstance(x, S)``, ``issubclass(x, S)`` and ``type(x) is/in/== S`` in ``path`` where ``S`` names a store
    class: ``file:line`` of each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        named = set()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Compare) and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                                                   and n.func.id == "type" for n in [node.left, *node.comparators]):
            named = {n.id for part in node.comparators + [node.left] for n in ast.walk(part) if isinstance(n, ast.Name)}
        if named & names:
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_cache_never_switches_on_a_store_class():
    """Whatever the cache needs to know of a store, the store answers (:class:`TokenStore`'s methods): no module of
    ``kveval/cache`` tests a store's class (a new store is one file)."""
    names = set(_store_classes())
    assert {"DenseStore", "QuantizedStore", "HeadwiseStore", "KVQuantStore", "LowRankStore", "LatentStore",
            "EngineStore"} <= names
    switches = [hit for path in sorted(CACHE_DIR.glob("*.py")) for hit in _class_switches(path, names)]
    assert switches == []


def test_the_switch_finder_finds_switches(tmp_path):
    """The scan above finds each form of switch (else it could not fail)."""
    sample = tmp_path / "sample.py"
    sample.write_text("a = isinstance(s, (DenseStore, int))\nb = type(s) is KVQuantStore\nc = type(s) in (QuantizedStore,)\n"
                      "d = type(s) is type(t)\ne = DenseStore(None)\n")
    assert _class_switches(sample, {"DenseStore", "KVQuantStore", "QuantizedStore"}) == ["sample.py:1", "sample.py:2",
                                                                                         "sample.py:3"]


def test_every_store_answers_with_its_declared_family():
    """Each concrete store declares the batched decode it may join (a :class:`BatchFamily`), and the families the
    batched decode knows each have a store; a dense store's answers are those of tokens held as they came."""
    classes = _store_classes()
    families = {cls.batch_family for cls in classes.values()}
    assert all(isinstance(f, BatchFamily) for f in families)
    assert families == set(BatchFamily)
    dense = DenseStore(torch.float16, torch.float32)
    dense.append(torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert dense.holds_dense() and dense.copies_on_append and not dense.ragged_heads
