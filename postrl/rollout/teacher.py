"""A teacher on another machine: scoring given tokens over HTTP (``distill.teacher_url``).

Server side, ``postrl serve`` answers two routes (:mod:`postrl.rollout.server`):

- ``POST /v1/score``  ``{"sequences": [{"prompt_ids": [...], "response_ids": [...]}, ...],
  "temperature": 1.0, "top_k": 0}`` → ``{"log_probs": [[...], ...]}``: ``log softmax(z / T)``
  of each response token given the prompt and the response tokens before it (one padded
  forward for the whole request, :func:`score_sequences`); with ``top_k > 0`` also
  ``"top_logprobs"``: per response token the ``top_k`` ``[token id, log-prob]`` pairs;
- ``GET /v1/tokenizer`` → :func:`tokenizer_fingerprint` of the served model's tokenizer.

Client side, :class:`RemoteTeacher` turns a batch (``input_ids`` = left-padded prompt ++
right-padded response, ``attention_mask``, ``responses``) into one ``/v1/score`` request and
returns ``teacher_log_prob`` (B, R), zero on padding. Every call has a deadline; failures raise
:class:`TeacherError` naming the URL.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from postrl.protocol import DataProto

__all__ = [
    "RemoteTeacher",
    "TeacherError",
    "fingerprint_mismatch",
    "score_sequences",
    "tokenizer_fingerprint",
]


class TeacherError(RuntimeError):
    """The remote teacher failed or answered something unusable (the message names the URL)."""


def tokenizer_fingerprint(tok: Any) -> dict[str, Any]:
    """What must agree between a student's and a teacher's tokenizer: the vocabulary
    (size and a SHA-256 of its sorted ``token → id`` map) and the special tokens (eos, pad,
    bos, unk and the additional ones, with their ids)."""
    vocab = tok.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    special = {
        name: [getattr(tok, name, None), getattr(tok, f"{name}_id", None)]
        for name in ("eos_token", "pad_token", "bos_token", "unk_token")
    }
    extra = sorted(str(t) for t in tok.all_special_tokens)
    return {
        "vocab_size": len(vocab),
        "vocab_sha256": digest,
        "special_tokens": special,
        "all_special_tokens": [[t, tok.convert_tokens_to_ids(t)] for t in extra],
    }


def fingerprint_mismatch(student: dict[str, Any], teacher: dict[str, Any]) -> list[str]:
    """Why two fingerprints (:func:`tokenizer_fingerprint`) differ; empty when they agree."""
    out = []
    if student["vocab_size"] != teacher["vocab_size"]:
        out.append(
            f"vocabulary size {teacher['vocab_size']} (teacher) != {student['vocab_size']} "
            "(student)"
        )
    elif student["vocab_sha256"] != teacher["vocab_sha256"]:
        out.append("same vocabulary size but different token -> id maps")
    for name, want in student["special_tokens"].items():
        got = teacher["special_tokens"].get(name)
        if list(got or []) != list(want):
            out.append(f"{name} {got} (teacher) != {want} (student)")
    s_all = [list(x) for x in student["all_special_tokens"]]
    t_all = [list(x) for x in teacher["all_special_tokens"]]
    if s_all != t_all:
        out.append(f"special tokens {t_all} (teacher) != {s_all} (student)")
    return out


@torch.no_grad()
def score_sequences(
    model: Any,
    sequences: list[tuple[list[int], list[int]]],
    temperature: float = 1.0,
    top_k: int = 0,
) -> Any:
    """Log-probs of each response token given its prompt and the response before it.

    One right-padded forward over the ``S`` sequences (L = longest prompt + response):
    ``ids`` (S, L); logits (S, L, V); the prediction of response token j of row i is at
    position ``len(prompt_i) - 1 + j``.

    Args:
        model: a Hugging Face causal LM (eval mode).
        sequences: ``(prompt_ids, response_ids)`` pairs; each prompt has >= 1 token.
        temperature: logits are divided by it (> 0).
        top_k: also return, per response position, the ``top_k`` most likely next tokens as
            ``[token id, log-prob]`` pairs, most likely first (a distillation teacher's top-k,
            ``distill.loss=gkd``); 0 = no.

    Returns:
        ``log_probs`` (per sequence, per response token), or ``(log_probs, top)`` when
        ``top_k > 0`` with ``top[i][j]`` the ``top_k`` pairs of response token j of row i.
    """
    if any(not p for p, _ in sequences):
        raise ValueError("every sequence needs at least one prompt token")
    if not sequences:
        return ([], []) if top_k else []
    lens = [len(p) + len(r) for p, r in sequences]
    width = max(lens)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)  # (S, L)
    am = torch.zeros(len(sequences), width, dtype=torch.long)  # (S, L)
    for i, (p, r) in enumerate(sequences):
        ids[i, : lens[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        am[i, : lens[i]] = 1
    logits = model(input_ids=ids, attention_mask=am).logits.float() / temperature  # (S, L, V)
    lp = torch.log_softmax(logits[:, :-1], dim=-1)  # (S, L-1, V): position t predicts t+1
    tok_lp = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (S, L-1)
    out, top = [], []
    if top_k:
        top_lp, top_id = lp.topk(min(top_k, lp.shape[-1]), dim=-1)  # (S, L-1, K)
    for i, (p, r) in enumerate(sequences):
        span = slice(len(p) - 1, len(p) - 1 + len(r))
        out.append(tok_lp[i, span].tolist())
        if top_k:
            pairs = torch.stack([top_id[i, span].double(), top_lp[i, span].double()], -1)
            top.append([[[int(v), float(x)] for v, x in row] for row in pairs.tolist()])
    return (out, top) if top_k else out


class RemoteTeacher:
    """Client of a teacher served by ``postrl serve`` (``distill.teacher_url``).

    Args:
        url: the server's base URL.
        api_key: bearer token ('' = none).
        timeout_s: deadline of one request.
        top_k: also ask for the teacher's ``top_k`` most likely tokens at each response position
            (``distill.loss=gkd``; 0 = no).
    """

    def __init__(
        self, url: str, api_key: str = "", timeout_s: float = 120.0, top_k: int = 0
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.top_k = int(top_k)
        self._pool: Any = None  # one thread for submit(): the request waits on the network
        key = api_key or os.environ.get("POSTRL_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise TeacherError(
                f"teacher {self.url}{path} gave no answer within distill.timeout_s="
                f"{self.timeout_s}: raise it or check the server"
            ) from e
        except httpx.HTTPError as e:
            raise TeacherError(f"teacher {self.url}{path} unreachable: {e}") from e
        if r.status_code != 200:
            raise TeacherError(f"teacher {self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def fingerprint(self) -> dict[str, Any]:
        """The served tokenizer's :func:`tokenizer_fingerprint`."""
        return self._call("GET", "/v1/tokenizer")

    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """``teacher_log_prob`` (B, R) of ``responses`` (temperature 1), one request; with
        ``top_k > 0`` also ``teacher_topk_log_probs`` / ``teacher_topk_ids`` (B, R, K)."""
        top_k = self.top_k
        ids, am = data.batch["input_ids"], data.batch["attention_mask"].bool()
        r = data.batch["responses"].shape[1]
        p = ids.shape[1] - r
        seqs = [
            {
                "prompt_ids": ids[i, :p][am[i, :p]].tolist(),
                "response_ids": ids[i, p:][am[i, p:]].tolist(),
            }
            for i in range(ids.shape[0])
        ]
        req: dict[str, Any] = {"sequences": seqs, "temperature": 1.0}
        if top_k:
            req["top_k"] = top_k
        body = self._call("POST", "/v1/score", json=req)
        rows = body.get("log_probs")
        if not isinstance(rows, list) or len(rows) != len(seqs):
            raise TeacherError(
                f"teacher {self.url}/v1/score returned {len(rows or [])} rows for {len(seqs)}"
            )
        tops = body.get("top_logprobs") if top_k else None
        if top_k and (not isinstance(tops, list) or len(tops) != len(seqs)):
            raise TeacherError(
                f"teacher {self.url}/v1/score returned no top_logprobs for top_k={top_k} (a "
                "server without top-k scoring: serve the teacher with this postrl's `postrl "
                "serve`, or use distill.loss=reverse_kl)"
            )
        out = torch.zeros(ids.shape[0], r, dtype=torch.float32)  # (B, R)
        top_lp = torch.zeros(ids.shape[0], r, top_k, dtype=torch.float32)  # (B, R, K)
        top_id = torch.zeros(ids.shape[0], r, top_k, dtype=torch.long)  # (B, R, K)
        for i, (s, lp) in enumerate(zip(seqs, rows)):
            if len(lp) != len(s["response_ids"]):
                raise TeacherError(
                    f"teacher {self.url}/v1/score: row {i} has {len(lp)} log-probs for "
                    f"{len(s['response_ids'])} tokens"
                )
            out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            if top_k:
                t = torch.tensor(tops[i], dtype=torch.float64).view(-1, top_k, 2)  # (r_i, K, 2)
                if t.shape[0] != len(lp):
                    raise TeacherError(
                        f"teacher {self.url}/v1/score: row {i} has {t.shape[0]} top-k rows for "
                        f"{len(lp)} tokens"
                    )
                top_id[i, : len(lp)] = t[..., 0].long()
                top_lp[i, : len(lp)] = t[..., 1].float()
        cols = {"teacher_log_prob": out}
        if top_k:
            cols.update(teacher_topk_log_probs=top_lp, teacher_topk_ids=top_id)
        return DataProto.from_dict(cols)

    def submit(self, method: str, data: DataProto) -> _Pending:
        """``method`` (``compute_teacher_log_prob``) in a background thread, like a worker
        group's ``submit``: the step runs its own passes while the request is in flight.
        ``.result()`` waits at most ``timeout_s`` + 10 s (the request's own deadline is
        ``timeout_s``) and raises :class:`TeacherError` naming the URL past it."""
        from concurrent.futures import ThreadPoolExecutor

        if method != "compute_teacher_log_prob":
            raise TeacherError(f"teacher {self.url}: no method {method!r}")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="postrl-teacher")
        return _Pending(self._pool.submit(self.compute_teacher_log_prob, data), self)

    def shutdown(self) -> None:
        """Close the HTTP connection (and the submit thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._http.close()


class _Pending:
    """A :meth:`RemoteTeacher.submit` in flight."""

    def __init__(self, future: Any, teacher: RemoteTeacher) -> None:
        self.future, self.teacher = future, teacher

    def result(self, timeout_s: float | None = None) -> DataProto:
        """The call's DataProto; :class:`TeacherError` past the deadline."""
        from concurrent.futures import TimeoutError as FutureTimeout

        deadline = timeout_s if timeout_s is not None else self.teacher.timeout_s + 10.0
        try:
            return self.future.result(timeout=deadline)
        except FutureTimeout as e:
            raise TeacherError(
                f"teacher {self.teacher.url}/v1/score: no answer within {deadline:.0f} s "
                "(distill.timeout_s + 10): raise distill.timeout_s or check the server"
            ) from e
