import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.protocol import DataProto, DataProtoError


def make(n: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        {"x": torch.randn(n, 3, generator=g), "ids": torch.arange(n)},
        {"uid": [f"u{i}" for i in range(n)], "gt": [{"a": i} for i in range(n)]},
        {"temperature": 1.0},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert a.batch.keys() == b.batch.keys()
    for k in a.batch:
        assert torch.equal(a.batch[k], b.batch[k]), k
    for k in a.non_tensor_batch:
        assert a.non_tensor_batch[k].tolist() == b.non_tensor_batch[k].tolist(), k


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 8))
def test_chunk_concat_identity(n, k):
    d = make(n)
    padded, pad = d.pad_to_divisor(k)
    assert len(padded) % k == 0
    back = DataProto.concat(padded.chunk(k)).unpad(pad)
    assert_same(back, d)


@settings(max_examples=30, deadline=None)
@given(perm=st.permutations(list(range(12))))
def test_reorder_inverse_identity(perm):
    d = make(12)
    p = torch.tensor(perm)
    inv = torch.empty_like(p)
    inv[p] = torch.arange(len(p))
    assert_same(d.reorder(p).reorder(inv), d)
    assert d.reorder(p).batch["ids"].tolist() == list(perm)


def test_split_select_pop_union_repeat():
    d = make(5)
    assert [len(x) for x in d.split(2)] == [2, 2, 1]
    s = d.select(["x"], ["uid"])
    assert set(s.batch) == {"x"} and set(s.non_tensor_batch) == {"uid"}
    with pytest.raises(DataProtoError, match="no key"):
        d.select(["nope"])
    popped = d.pop(["ids"])
    assert "ids" not in d.batch and torch.equal(popped.batch["ids"], torch.arange(5))
    u = d.union(popped)
    assert torch.equal(u.batch["ids"], torch.arange(5))
    bad = DataProto.from_dict({"ids": torch.arange(5) + 1})
    with pytest.raises(DataProtoError, match="conflict"):
        u.union(bad)
    r = d.repeat(2, interleave=True)
    assert r.non_tensor_batch["uid"].tolist()[:4] == ["u0", "u0", "u1", "u1"]
    r2 = d.repeat(2, interleave=False)
    assert r2.non_tensor_batch["uid"].tolist()[:6] == ["u0", "u1", "u2", "u3", "u4", "u0"]


def test_indexing_and_errors():
    d = make(6)
    assert len(d[2]) == 1 and d[2].batch["ids"].item() == 2
    assert d[1:4].batch["ids"].tolist() == [1, 2, 3]
    assert d[[5, 0]].non_tensor_batch["uid"].tolist() == ["u5", "u0"]
    assert d[torch.tensor([True, False] * 3)].batch["ids"].tolist() == [0, 2, 4]
    with pytest.raises(DataProtoError, match="batch sizes differ"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"b": [1, 2]})
    with pytest.raises(DataProtoError, match="not divisible"):
        d.chunk(4)
    with pytest.raises(DataProtoError, match="keys"):
        DataProto.concat([d, d.select(["x"])])


def test_pickle_and_save_load(tmp_path):
    import pickle

    d = make(4)
    assert_same(pickle.loads(pickle.dumps(d)), d)
    d.save(tmp_path / "b")
    back = DataProto.load(tmp_path / "b")
    assert_same(back, d)
    assert back.meta_info == {"temperature": 1.0}
    assert isinstance(back.non_tensor_batch["uid"], np.ndarray)
