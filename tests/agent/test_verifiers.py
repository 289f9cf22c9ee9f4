"""The ``verifiers`` agent loop with real verifiers 0.4 environments built by hand
(``vf_envs/``: a single-turn one and one with an MCP tool server), run by the verifiers worker
in the verifiers venv (``make verifiers-venv``) against the gateway's token route on 127.0.0.1.

The rollout side is the scripted client of ``agent_helpers`` (exact, known ids), so every
trajectory is checked id for id against what was "sampled". One worker per environment is
module-scoped (its start-up, importing verifiers and serving the environment, takes ~10 s).
End-to-end training with the tiny model: ``test_verifiers_trains`` (slow).

Skipped only where the verifiers venv is missing; under ``CI=true`` a missing venv fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from agent_helpers import ScriptedClient, make_row

from postrl.agent.verifiers import VerifiersAgentLoop, check_verifiers_config, verifiers_python
from postrl.config.schema import AgentConfig, VerifiersConfig
from postrl.rollout.types import SamplingParams

pytestmark = [pytest.mark.verifiers, pytest.mark.timeout(300)]

ENVS = str(Path(__file__).resolve().parent / "vf_envs")
SP = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'


def vf_python() -> str:
    """The verifiers venv's python; skip (fail under CI=true) where verifiers cannot import."""
    py = verifiers_python()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('verifiers') is None)"
    if py is None or subprocess.run([py, "-c", probe], capture_output=True).returncode != 0:
        why = f"verifiers cannot import with {py} (build it: make verifiers-venv)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run the verifiers tests")
        pytest.skip(why)
    return py


class Harness:
    """A verifiers loop on a scripted client, on an event loop of its own (the worker's pipes
    belong to it), kept for a module."""

    def __init__(self, tokenizer, taskset: str, **vf) -> None:
        self.tokenizer = tokenizer
        self.client = ScriptedClient(tokenizer, [])
        cfg = AgentConfig(
            default_agent_loop="verifiers",
            verifiers=VerifiersConfig(
                taskset=taskset, python=vf_python(), python_path=[ENVS], timeout_s=60, **vf
            ),
        )
        self.loop = VerifiersAgentLoop(self.client, tokenizer, cfg, max_model_len=1024)
        self.ev = asyncio.new_event_loop()

    def run(self, script: list[str], task_idx: int | None, request_id: str = "r0"):
        """One trajectory of task ``task_idx`` with the client answering ``script``."""
        self.client.script = script
        self.client.prompts.clear()
        self.client.generated.clear()
        row = make_row(self.tokenizer, request_id=request_id)
        row["extra_info"] = {} if task_idx is None else {"verifiers_task_idx": task_idx}
        return self.ev.run_until_complete(self.loop.run(SP, **row))

    def close(self) -> None:
        self.ev.run_until_complete(self.loop.aclose())
        self.ev.close()


@pytest.fixture(scope="module")
def model_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (its ``name_or_path`` is the renderer's model directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def echo(model_tokenizer):
    h = Harness(model_tokenizer, "vf_echo")
    yield h
    h.close()


@pytest.fixture(scope="module")
def calc(model_tokenizer):
    h = Harness(model_tokenizer, "vf_calc")
    yield h
    h.close()


@pytest.mark.slow
def test_single_turn_episode_is_the_sampled_trajectory(echo):
    """The branch is exactly what the fleet sampled: prompt = the ids the worker's renderer
    sent (the chat template of the task's prompt), response = the sampled ids, all trained,
    log-probs and reward from the episode; a wrong answer scores 0."""
    tok, client = echo.tokenizer, echo.client
    out = echo.run(["3<|im_end|>"], task_idx=3)
    assert out.metrics["agent/verifiers_failures"] == 0.0
    assert out.metrics["agent/verifiers_unmatched_tokens"] == 0.0
    assert out.metrics["agent/verifiers_requests"] == 1.0
    (p0,), (g0,) = client.prompts, client.generated
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Say 3."}], add_generation_prompt=True, tokenize=False
    )
    assert out.prompt_ids == p0 == tok.encode(text, add_special_tokens=False)
    assert out.response_ids == g0 == tok.encode("3<|im_end|>", add_special_tokens=False)
    assert out.response_mask == [1] * len(g0)
    assert out.response_logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(g0))])
    assert out.response_versions == [(len(g0), -1)]  # the scripted client reports none
    assert out.extra == {"reward": pytest.approx(1.0 + 0.1 / 2)} and out.segments == []
    assert client.samplings[0].max_new_tokens == SP.max_new_tokens
    assert client.samplings[0].seed == SP.seed  # the trajectory's sampling is authoritative

    wrong = echo.run(["5<|im_end|>"], task_idx=3, request_id="r1")
    assert wrong.extra == {"reward": pytest.approx(0.1 / 2)}  # correct 0 + 0.1 x brief
    assert wrong.metrics["agent/verifiers_failures"] == 0.0


@pytest.mark.slow
def test_rows_without_a_task_and_bad_tasks_are_masked_and_counted(echo):
    """A row naming no task never reaches the worker; a task index out of range is an error
    reply: both give a fully masked trajectory with reward 0, counted, the worker serving on.
    A row carrying its task's data runs that task."""
    none = echo.run(["3<|im_end|>"], task_idx=None)
    assert none.extra == {"reward": 0.0, "verifiers_failure": "no_task"}
    assert none.metrics["agent/verifiers_failures"] == 1.0
    assert none.response_mask == [0] * len(none.response_ids)
    assert none.prompt_ids == make_row(echo.tokenizer)["raw_prompt_ids"]
    bad = echo.run(["3<|im_end|>"], task_idx=99)
    assert bad.extra["verifiers_failure"] == "worker_error"
    assert bad.response_mask == [0] * len(bad.response_ids)
    ok = echo.run(["1<|im_end|>"], task_idx=1)
    assert ok.extra == {"reward": pytest.approx(1.05)}
    # a row may carry the task's data itself (extra_info.verifiers_task) instead of an index
    echo.client.script = ["9<|im_end|>"]
    row = dict(
        make_row(echo.tokenizer), extra_info={"verifiers_task": {"prompt": "Say 9.", "answer": "9"}}
    )
    own = echo.ev.run_until_complete(echo.loop.run(SP, **row))
    assert own.extra == {"reward": pytest.approx(1.05)}
    assert "Say 9." in echo.tokenizer.decode(own.prompt_ids)


@pytest.mark.slow
def test_mcp_tool_episode_is_token_faithful(calc):
    """The chat harness calls the environment's MCP ``add`` tool and answers: one trajectory,
    the second prompt is the first prompt + the sampled ids + only the tool turn (mask 0), the
    tools rendered into the prompt by the chat template, the reward from the final reply."""
    tok, client = calc.tokenizer, calc.client
    out = calc.run([CALL, "The answer is 7.<|im_end|>"], task_idx=0)
    assert out.metrics["agent/verifiers_failures"] == 0.0
    assert out.metrics["agent/verifiers_requests"] == 2.0
    assert out.metrics["agent/verifiers_unmatched_tokens"] == 0.0
    p0, p1 = client.prompts
    g0, g1 = client.generated
    assert out.prompt_ids == p0
    assert '"name": "add"' in tok.decode(p0)  # the MCP tool, rendered by the chat template
    assert p1[: len(p0) + len(g0)] == p0 + g0  # reused as sampled, never re-tokenised
    obs = p1[len(p0) + len(g0) :]
    assert tok.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.response_ids == g0 + obs + g1
    assert out.response_mask == [1] * len(g0) + [0] * len(obs) + [1] * len(g1)
    assert out.response_logprobs[len(g0) : len(g0) + len(obs)] == [0.0] * len(obs)
    assert out.response_versions == [(len(g0), -1), (len(obs), -1), (len(g1), -1)]
    assert out.num_turns == 4
    assert out.extra == {"reward": 1.0}


class _Gate(ScriptedClient):
    """A scripted client whose generate waits until the test opens the gate."""

    gate: asyncio.Event | None = None

    async def generate(self, *a, **kw):
        if self.gate is not None:
            await self.gate.wait()
        return await super().generate(*a, **kw)


@pytest.mark.slow
@pytest.mark.fault
def test_deadline_and_a_dead_worker_cost_one_masked_trajectory(echo):
    """An episode past ``timeout_s`` is cancelled (masked, ``timeout``); a worker killed
    mid-episode fails that trajectory at once (``worker_error``) and the next one starts a new
    worker."""
    h = echo
    gated = _Gate(h.tokenizer, [])
    h.loop.client = h.client = gated
    gated.gate = gate = asyncio.Event()
    vf = h.loop.vf
    h.loop.vf = replace(vf, timeout_s=3.0)
    try:
        out = h.run(["3<|im_end|>"], task_idx=3)
        assert out.extra == {"reward": 0.0, "verifiers_failure": "timeout"}
        assert out.finish_reason == "abort" and not any(out.response_mask)

        h.loop.vf = replace(vf, timeout_s=60.0)
        worker = h.loop.worker
        h.ev.call_later(1.0, lambda: os.killpg(worker.proc.pid, signal.SIGKILL))
        out = h.run(["3<|im_end|>"], task_idx=3)
        assert out.extra["verifiers_failure"] == "worker_error"
        assert not worker.alive

        gated.gate = None
        out = h.run(["3<|im_end|>"], task_idx=3)
        assert out.extra == {"reward": pytest.approx(1.05)}
        assert h.loop.worker is not worker and h.loop.worker.alive
    finally:
        h.loop.vf = vf
        gate.set()  # the abandoned calls finish (their trajectories ended: nothing recorded)
        h.ev.run_until_complete(asyncio.sleep(0.2))


@pytest.mark.slow
def test_an_environment_that_cannot_load_stops_the_run(model_tokenizer):
    """A worker that never got ready (here: no such taskset module) is a configuration error:
    the trajectory raises with verifiers' reason and the keys to check, instead of masking
    every trajectory of the run."""
    h = Harness(model_tokenizer, "vf_no_such_env")
    try:
        with pytest.raises(RuntimeError, match="could not start") as e:
            h.run(["3<|im_end|>"], task_idx=0)
        assert "vf_no_such_env" in str(e.value) and "python_path" in str(e.value)
    finally:
        h.close()


def test_config_errors_name_the_field_and_the_fix(tmp_path):
    cfg = AgentConfig(verifiers=VerifiersConfig(python=str(tmp_path / "nope"), timeout_s=0))
    errors = "\n".join(check_verifiers_config(cfg))
    assert "rollout.agent.verifiers.taskset is empty" in errors
    assert "does not exist" in errors and "timeout_s=0" in errors


@pytest.mark.slow
def test_verifiers_trains(tiny_model_dir, tmp_path):
    """``postrl train`` with ``rollout.agent.default_agent_loop=verifiers`` on the tiny model:
    the hand-built environment's episodes reach the update (rewards from its ``@vf.reward``,
    every sampled token trained) and the parameters move."""
    import torch

    from postrl.agent.verifiers import dataset_rows
    from postrl.config import load_config
    from postrl.data import write_parquet
    from postrl.trainer.trainer import RLTrainer

    tasks = [{"idx": i, "prompt": f"Say {i}."} for i in range(8)]
    train = write_parquet(dataset_rows(tasks, "vf_echo"), tmp_path / "train.parquet")
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{train}]",
            "data.val_files=[]",
            "data.train_batch_size=2",
            "data.max_prompt_length=48",
            "actor.ppo_mini_batch_size=2",
            "actor.optim.lr=1e-3",
            "rollout.n=2",
            "rollout.response_length=8",
            "rollout.agent.default_agent_loop=verifiers",
            "rollout.agent.verifiers.taskset=vf_echo",
            f"rollout.agent.verifiers.python={vf_python()}",
            f"rollout.agent.verifiers.python_path=[{ENVS}]",
            "trainer.total_steps=1",
            "trainer.loggers=[jsonl]",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.save_freq=0",
        ],
    )
    trainer = RLTrainer(cfg)
    seen = []
    update = trainer.roles.update_actor

    def spy(batch, *a, **kw):
        seen.append(batch)
        return update(batch, *a, **kw)

    trainer.roles.update_actor = spy
    before = {k: v.detach().clone() for k, v in trainer.roles.actor.get_per_tensor_param()}
    try:
        last = trainer.fit()
        after = dict(trainer.roles.actor.get_per_tensor_param())
    finally:
        trainer.close()
    assert last["agent/verifiers_failures"] == 0.0
    assert any(not torch.equal(before[k], after[k]) for k in before)
    (batch,) = seen
    b, nt = batch.batch, batch.non_tensor_batch
    assert len(nt["uid"]) == 4
    n = b["attention_mask"][:, -b["response_mask"].shape[1] :].sum(-1)
    assert torch.equal(b["response_mask"].sum(-1), n)  # single turn: every token sampled
    scores = b["token_level_scores"].sum(-1).tolist()
    assert scores == pytest.approx([float(e["reward"]) for e in nt["agent_extra"]])
    assert all(0.0 < s <= 1.1 for s in scores)  # correct (0/1) + 0.1 x brief
