"""Observation deltas equal the full conversation's chat-template tokens (no tools needed)."""

from __future__ import annotations

import pytest

from postrl.agent.tool_loop import ChatDelta, token_drift

IM_END = "<|im_end|>"


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("n_tools", [1, 2, 3])
def test_delta_splices_into_full_template(tokenizer, n_tools):
    """prompt + turn + delta(tool msgs) + turn2 == tokenised template of the whole conversation."""
    d = ChatDelta(tokenizer)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q?"}]
    ids = _ids(
        tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    turn1 = _ids(tokenizer, 'call <tool_call>{"name": "calculator"}</tool_call>' + IM_END)
    tool_msgs = [{"role": "tool", "content": f"result {i} with\nnewline"} for i in range(n_tools)]
    obs = d.observation(tool_msgs, turn1)
    turn2 = _ids(tokenizer, "The answer is 7." + IM_END)
    ours = ids + turn1 + obs + turn2
    full = msgs + [{"role": "assistant", "content": tokenizer.decode(turn1[:-1])}] + tool_msgs
    full += [{"role": "assistant", "content": "The answer is 7."}]
    expected = _ids(tokenizer, tokenizer.apply_chat_template(full, tokenize=False))
    # the template closes the final assistant turn with "\n", which the model never generates
    assert expected[-1] == _ids(tokenizer, "\n")[0]
    assert ours == expected[:-1]
    # the observation starts with the template's "\n" after <|im_end|> (the model's EOS)
    assert tokenizer.decode(obs[:1]) == "\n"
    assert tokenizer.decode(obs).endswith("<|im_start|>assistant\n")
    assert d.closing(turn2) == _ids(tokenizer, "\n")


def test_delta_without_eos_closes_turn(tokenizer):
    """A turn that stopped on a stop string gets the end-of-turn token as observation."""
    d = ChatDelta(tokenizer)
    obs = d.observation([{"role": "tool", "content": "x"}], _ids(tokenizer, "abc</tool_call>"))
    assert obs[0] == tokenizer.eos_token_id
    assert d.closing(_ids(tokenizer, "abc")) == _ids(tokenizer, IM_END + "\n")


def test_token_drift_counts_mismatches_and_length():
    # positions 1 differs, and expected has 2 extra → 3 mismatches over 6 positions
    assert token_drift([1, 2, 3, 4], [1, 9, 3, 4, 5, 6]) == (0.5, 1)
    assert token_drift([1, 2], [1, 2]) == (0.0, -1)
    assert token_drift([1, 2, 3], [1, 2]) == (1 / 3, 2)
    assert token_drift([], []) == (0.0, -1)


def test_template_that_drops_content_is_rejected(tokenizer):
    """A template that does not render assistant content verbatim cannot give deltas."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        ChatDelta(tok)
