"""balance_for_dp wired in front of a DP_COMPUTE_PROTO dispatch."""

from __future__ import annotations

import pytest
import torch
from controller_toys import ToyWorker

from postrl.controller import balance_for_dp, create_worker_group
from postrl.protocol import DataProto, DataProtoError


def test_balance_for_dp_equalises_rank_tokens():
    lens = torch.arange(1, 17)  # sorted lengths: the naive split is maximally unbalanced
    mask = (torch.arange(16)[None, :] < lens[:, None]).long()  # (16, 16)
    data = DataProto.from_dict(
        {"attention_mask": mask, "x": lens.float()}, {"uid": [str(i) for i in range(16)]}
    )
    balanced, m = balance_for_dp(data, 4)
    assert m["balance/imbalance_after"] < m["balance/imbalance_before"]
    loads = [int(c.batch["attention_mask"].sum()) for c in balanced.chunk(4)]
    assert max(loads) - min(loads) <= 1  # sum 136 over 4 ranks: 34 each is reachable
    # rows move intact
    assert [int(u) + 1 for u in balanced.non_tensor_batch["uid"]] == balanced.batch[
        "x"
    ].long().tolist()
    wg = create_worker_group("local", ToyWorker, world_size=4)
    out = wg.add_offset(balanced)
    assert torch.equal(out.batch["y"], balanced.batch["x"])


def test_balance_for_dp_lengths_key_and_errors():
    data = DataProto.from_dict({"len": torch.tensor([5, 1, 1, 5, 3])})
    balanced, m = balance_for_dp(data, 2, length_key="len")  # 5 rows: pad layout 3 + 2
    assert sorted(balanced.batch["len"].tolist()) == [1, 1, 3, 5, 5]
    assert m["balance/imbalance_after"] <= m["balance/imbalance_before"]
    with pytest.raises(DataProtoError, match="length_key"):
        balance_for_dp(data, 2)
