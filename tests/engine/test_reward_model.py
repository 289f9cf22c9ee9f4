"""Learned reward models (``reward.model``): scoring, truncation, errors, the worker."""

from __future__ import annotations

import pytest
import torch

from postrl.engine.reward_model import RewardModel, render_conversations
from postrl.testing import make_model

MSGS = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rm") / "rm", head="reward", seed=3)


def _hf_scores(path, rm: RewardModel, texts: list[str]) -> torch.Tensor:
    """HF's own forward, one unpadded sequence at a time."""
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = rm.tokenizer(t, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out.append(m(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def test_scores_equal_hf_forward_in_any_batching(rm_dir):
    responses = ["19", "20", "nineteen, because 12 plus 7 is 19", "", "19<|im_end|>"]
    texts = render_conversations(RewardModel(rm_dir).tokenizer, [MSGS] * len(responses), responses)
    assert texts[0].endswith("<|im_start|>assistant\n19<|im_end|>\n")  # the RM's own chat template
    for mb in (1, 2, 16):  # padding and micro-batching do not change a score
        rm = RewardModel(rm_dir, micro_batch_size=mb)
        scores, cut = rm.score([MSGS] * len(responses), responses)
        assert cut == 0 and scores.dtype == torch.float32
        torch.testing.assert_close(scores, _hf_scores(rm_dir, rm, texts), atol=1e-5, rtol=1e-5)
    assert len(set(scores.tolist())) == len(responses)  # different conversations, different scores


def test_long_conversations_keep_their_end_and_are_counted(rm_dir):
    rm = RewardModel(rm_dir, max_length=12)
    long, short = "1" * 40, "7"
    ids, cut = rm.encode(render_conversations(rm.tokenizer, [MSGS, MSGS], [long, short]))
    assert cut == [True, True]  # the template alone is longer than 12 tokens
    full = rm.tokenizer(
        render_conversations(rm.tokenizer, [MSGS], [long])[0], add_special_tokens=False
    )["input_ids"]
    assert ids[0] == full[-12:]
    scores, n_cut = rm.score([MSGS, MSGS], [long, short])
    assert n_cut == 2
    torch.testing.assert_close(scores, rm.score_ids(ids))


def test_not_a_reward_model_is_rejected(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="num_labels"):
        RewardModel(tiny_model_dir)  # a causal LM
    with pytest.raises(FileNotFoundError, match="reward.model.path"):
        RewardModel(tmp_path / "nothing")


def test_plain_role_lines_without_a_chat_template():
    class Tok:
        chat_template = None

    assert render_conversations(Tok(), [MSGS], ["19"]) == ["user: What is 12+7?\nassistant: 19"]


def test_worker_scores_decoded_responses(rm_dir, tiny_model_dir, make_batch):
    """RewardModelWorker decodes each response with the policy tokenizer, renders it after the
    row's prompt messages in the RM's template and scores it: the same as RewardModel.score."""
    from postrl.config import load_config
    from postrl.controller import create_worker_group
    from postrl.protocol import DataProto
    from postrl.workers import RewardModelWorker

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "reward.model.enable=true",
            f"reward.model.path={rm_dir}",
            "reward.model.max_length=40",
        ],
    )
    b = make_batch(num_prompts=2, n=3, seed=8, vocab=120)
    msgs = [[{"role": "user", "content": f"question {i // 3}"}] for i in range(len(b))]
    b = b.union(DataProto.from_dict(non_tensors={"messages": msgs}))
    wg = create_worker_group("local", RewardModelWorker, kwargs={"cfg": cfg}, name="rm")
    try:
        out = wg.compute_rm_score(b)
    finally:
        wg.shutdown()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    R = b.batch["responses"].shape[1]
    lens = b.batch["attention_mask"][:, -R:].sum(1).tolist()
    texts = tok.batch_decode(
        [r[:n] for r, n in zip(b.batch["responses"].tolist(), lens)], skip_special_tokens=True
    )
    rm = RewardModel(rm_dir, max_length=40)
    ref, n_cut = rm.score(msgs, texts)
    torch.testing.assert_close(out.batch["rm_scores"], ref)
    assert int(out.batch["rm_truncated"].sum()) == n_cut


def test_shared_prompt_scoring_equals_whole_sequences(rm_dir):
    """The worker's path (each prompt computed once for its samples, padding-free) gives the
    scores of scoring every conversation whole — also when max_length cuts into the prompt."""
    msgs = [
        [{"role": "user", "content": f"What is {i}+{i + 5}? Reply with the number."}]
        for i in range(3)
        for _ in range(4)
    ]
    resps = [str(2 * (j // 4) + 5 + j % 4) * (1 + j % 3) for j in range(12)]
    for max_length in (1024, 30):
        rm = RewardModel(rm_dir, max_length=max_length, micro_batch_size=8)
        prompts, rest, cut = rm.split_encode(msgs, resps)
        ids, cut_whole = rm.encode(render_conversations(rm.tokenizer, msgs, resps))
        assert cut == cut_whole and [p + r for p, r in zip(prompts, rest)] == ids
        if max_length == 1024:
            assert (
                len({tuple(p) for p in prompts}) == 3
            )  # one prompt per group: shared in the forward
        torch.testing.assert_close(
            rm.score_split(prompts, rest),
            _hf_scores(rm_dir, rm, rm.tokenizer.batch_decode(ids)),
            atol=1e-5,
            rtol=1e-5,
        )
