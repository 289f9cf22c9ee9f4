"""Model-based rewards: a sequence-classification reward model scores (prompt, response) pairs.

The reward model (RM) is any Hugging Face ``*ForSequenceClassification`` checkpoint with one
label (Bradley–Terry reward models such as Skywork-Reward, or ``postrl make-model --head reward``
/ ``postrl rm`` for tiny local ones). It may use a different tokenizer and chat template than the
policy, so each trajectory is rendered as a conversation in the RM's own template: the prompt's
chat messages (the dataset row's ``prompt``) followed by one assistant message holding the
decoded response, and tokenized by the RM's tokenizer — as verl's reward-model worker does.
The score is the model's logit at the last token (HF's pooling for sequence classification).

Conversations longer than ``max_length`` tokens keep their last ``max_length`` tokens, where
the response ends; how many were cut is returned (the trainer reports it as
``reward_model/truncated``), never silent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["RewardModel", "render_conversations", "sequence_scores"]

logger = logging.getLogger(__name__)


def render_conversations(
    tokenizer: Any, messages: list[list[dict[str, str]]], responses: list[str]
) -> list[str]:
    """Each prompt's messages + ``{"role": "assistant", "content": response}`` as text in the
    tokenizer's chat template (``role: content`` lines when it has none)."""
    out = []
    for msgs, resp in zip(messages, responses, strict=True):
        conv = [*(dict(m) for m in msgs), {"role": "assistant", "content": resp}]
        if getattr(tokenizer, "chat_template", None):
            out.append(tokenizer.apply_chat_template(conv, tokenize=False))
        else:
            out.append("\n".join(f"{m['role']}: {m['content']}" for m in conv))
    return out


def sequence_scores(
    model: torch.nn.Module, ids: list[list[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """(B,) float32 scores of a sequence classifier over right-padded ``ids`` (differentiable).

    For decoder RMs (a linear ``score`` head) the hidden state of each sequence's last real token
    is pooled here: HF's own pooling looks for the first pad id, which a conversation may contain
    (tokenizers whose pad token is their EOS). Other heads use the model's own pooling.
    """
    width = max(len(x) for x in ids)
    inp = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(inp)
    for i, x in enumerate(ids):
        inp[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    inp, mask = inp.to(device), mask.to(device)
    head = getattr(model, "score", None)
    if isinstance(head, torch.nn.Linear):
        hidden = model.base_model(input_ids=inp, attention_mask=mask).last_hidden_state
        h = hidden[torch.arange(len(ids), device=inp.device), mask.sum(1) - 1]
        return head(h).squeeze(-1).float()
    return model(input_ids=inp, attention_mask=mask).logits[:, 0].float()


class RewardModel:
    """A frozen sequence-classification reward model on one device.

    Args:
        path: HF model directory (model + tokenizer).
        device: where it runs.
        dtype: parameter/compute dtype.
        max_length: tokens kept per conversation (the last ones).
        micro_batch_size: conversations per forward.

    Raises:
        ValueError: the checkpoint is not a one-label sequence classifier, or its tokenizer has
            neither a pad nor an EOS token to pad with.
    """

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_length: int = 1024,
        micro_batch_size: int = 16,
    ) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from postrl.engine.varlen import ATTN_NAME

        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"reward.model.path={str(path)!r} is not a Hugging Face model directory "
                "(no config.json)"
            )
        hf_cfg = AutoConfig.from_pretrained(str(path))
        if getattr(hf_cfg, "num_labels", None) != 1:
            raise ValueError(
                f"reward model {path} has num_labels={getattr(hf_cfg, 'num_labels', None)}; "
                "a reward model outputs one score (a *ForSequenceClassification checkpoint "
                f"with num_labels=1, e.g. from `postrl make-model --head "
                f"reward` or `postrl rm`)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(
                    f"reward model tokenizer at {path} has no pad or eos token to pad batches with"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        from postrl.engine.model import CriticModel, _from_pretrained, _use_varlen

        self.model = _from_pretrained(
            AutoModelForSequenceClassification,
            path,
            {"dtype": dtype, "attn_implementation": ATTN_NAME},
        )
        self.model = self.model.to(device).eval()
        self.model.requires_grad_(False)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # decoder RMs (a linear `score` head) run padding-free with the prompt shared by its samples
        self.shared = isinstance(getattr(self.model, "score", None), torch.nn.Linear)
        self.root: CriticModel | None = None
        if self.shared:
            self.packed = _use_varlen(self.model, self.model.base_model)
            # the scoring module (and FSDP2 root, see shard()): backbone + score head as value head
            self.root = CriticModel(self.model.base_model, self.model.config.hidden_size)
            self.root.value_head = self.model.score
            self.root.packed = self.packed
            self.root.eval()
        else:  # other heads: the model's own forward and pooling
            self.packed = False
            if getattr(self.model.config, "_attn_implementation", None) == ATTN_NAME:
                self.model.set_attn_implementation("sdpa")
        self.device = torch.device(device)
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size

    def encode(self, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each conversation (its last ``max_length`` kept) and whether it was cut."""
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [x[-self.max_length :] for x in ids], [len(x) > self.max_length for x in ids]

    @torch.inference_mode()
    def score_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores of whole token-id sequences (no prompt sharing)."""
        if self.shared:
            return self.score_split([x[:1] for x in ids], [x[1:] for x in ids])
        out = [
            sequence_scores(
                self.model,
                ids[s : s + self.micro_batch_size],
                self.tokenizer.pad_token_id,
                self.device,
            ).cpu()
            for s in range(0, len(ids), self.micro_batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0)

    def split_encode(
        self, messages: list[list[dict[str, str]]], responses: list[str]
    ) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """``(prompt ids, response ids, cut)`` per conversation.

        The prompt part is the rendering of the messages with the generation prompt — the same for
        every sample of a prompt, so :meth:`score_split` computes it once per group — and the
        response part is the rest of the full rendering (the answer and the end-of-turn). If the
        template does not render the prompt as a token prefix of the conversation, that row is
        scored as one unshared sequence. Over ``max_length``, tokens are dropped from the left.
        """
        tok = self.tokenizer
        ids = tok(render_conversations(tok, messages, responses), add_special_tokens=False)[
            "input_ids"
        ]
        cache: dict[str, list[int]] = {}
        prompts, resps, cut = [], [], []
        for msgs, x in zip(messages, ids, strict=True):
            key = json.dumps(msgs, sort_keys=True)
            if key not in cache:
                if getattr(tok, "chat_template", None):
                    text = tok.apply_chat_template(
                        [dict(m) for m in msgs], add_generation_prompt=True, tokenize=False
                    )
                else:
                    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
                cache[key] = tok(text, add_special_tokens=False)["input_ids"]
            p = cache[key]
            if not (0 < len(p) < len(x) and x[: len(p)] == p):
                p = x[:1]  # not prefix-consistent: one sequence, no sharing
            r = x[len(p) :]
            cut.append(len(x) > self.max_length)
            if len(x) > self.max_length:
                excess = len(x) - self.max_length
                if excess < len(p):
                    p = p[excess:]
                else:
                    keep = x[-self.max_length :]
                    p, r = keep[:1], keep[1:]
            prompts.append(p)
            resps.append(r)
        return prompts, resps, cut

    def shard(self, group, device: torch.device | str) -> None:
        """FSDP2-shard the scoring module over ``group`` (large RMs on several ranks): each rank
        keeps ``1/dp`` of the weights; every rank must then score in the same collective steps
        (:meth:`score_split` aligns its micro-batch count over the group)."""
        if self.root is None:
            raise ValueError(
                "only decoder reward models (a linear `score` head) can be FSDP2-sharded"
            )
        self.root.shard(group, device)

    @torch.inference_mode()
    def score_split(self, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores of prompt + response id sequences, padding-free, each distinct
        prompt of a micro-batch computed once (:func:`postrl.engine.logprob.critic_values` with
        prefix sharing). The score is read at the last response token: one extra column after it
        turns "the state that predicts the next token" into "the state at the last token"."""
        n, pad = len(prompts), self.tokenizer.pad_token_id
        micro = [
            list(range(s, min(s + self.micro_batch_size, n)))
            for s in range(0, n, self.micro_batch_size)
        ]
        lens = torch.tensor(
            [len(p) + len(r) + 1 for p, r in zip(prompts, responses, strict=True)], dtype=torch.long
        )
        micro = self.root.align_micro_batches(
            micro, lens
        )  # sharded: the same number of passes on every rank
        out = torch.zeros(n)
        for rows in micro:
            ps, rs = [prompts[i] for i in rows], [responses[i] for i in rows]
            P, R = max(len(p) for p in ps), max(len(r) for r in rs) + 1
            ids = torch.full((len(ps), P + R), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
                ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
                ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
                mask[i, P - len(p) : P + len(r) + 1] = 1  # + the extra column
            v = self.root(ids.to(self.device), mask.to(self.device), R, share_prefix=True)
            last = torch.tensor([len(r) for r in rs], device=v.device)
            out[rows] = v[torch.arange(len(ps), device=v.device), last].float().cpu()
        return out

    def score_rows(
        self, messages: list[list[dict[str, str]]], responses: list[str]
    ) -> tuple[torch.Tensor, list[bool]]:
        """Scores of ``responses`` to the prompts ``messages`` and, per row, whether it was
        truncated."""
        if self.shared:
            p, r, cut = self.split_encode(messages, responses)
            return self.score_split(p, r), cut
        ids, cut = self.encode(render_conversations(self.tokenizer, messages, responses))
        return self.score_ids(ids), cut

    def score(
        self, messages: list[list[dict[str, str]]], responses: list[str]
    ) -> tuple[torch.Tensor, int]:
        """Scores of ``responses`` to the prompts ``messages`` and the number of truncated ones."""
        scores, cut = self.score_rows(messages, responses)
        return scores, sum(cut)
