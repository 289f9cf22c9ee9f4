"""The verifiers worker: runs a ``verifiers`` environment's episodes for postrl's ``verifiers``
agent loop, in the verifiers venv (``make verifiers-venv``), as a process of its own.

Started by path (``<venv python> .../postrl/agent/verifiers/worker.py``), it imports nothing of
postrl (the venv need not hold postrl's dependencies). It talks JSON lines: requests on stdin,
replies on the stdout it had at start (file descriptor 1 is pointed at stderr right away, so a
stray ``print`` of an environment cannot corrupt the protocol). Nothing is unpickled.

Requests and replies::

    {"op": "init", "env": {EnvConfig data}, "client": {TrainClientConfig data}, "model": "postrl"}
        -> {"op": "ready", "taskset": id, "num_tasks": n, "verifiers": version}
    {"op": "tasks", "id": id} -> {"op": "tasks", "id": id, "tasks": [{"idx", "prompt",
                                                                        "system_prompt"}, ...]}
    {"op": "run", "id": id, "task_idx": i | null, "task": {TaskData fields} | null,
     "sampling": {Sampling fields}}
        -> {"op": "result", "id": id, "ok": bool, "errors": [text], "traces": [
               {"agent", "ok", "trainable", "reward", "rewards", "metrics", "stop_condition",
                "is_truncated", "errors": [text], "branches": [
                    {"trainable", "token_ids", "sampled_mask", "logprobs"}]}]}
    {"op": "cancel", "id": id}            (the episode is cancelled; no reply)
    {"op": "shutdown"}                    (or end of stdin: serving is torn down, then exit)

``worker.py --prepare`` builds the uv environment of verifiers' chat program and exits.

A failed request answers ``{"op": "error", "id": id | null, "message": text}``. Episodes run
concurrently inside one ``env.serving()``; each gets a ``ModelContext`` whose client is the
gateway's token route and whose sampling carries the trajectory's routing key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import traceback
from typing import Any

_LINE_LIMIT = 1 << 28

logger = logging.getLogger("postrl.verifiers_worker")


def _out_stream() -> Any:
    """The protocol stream: a duplicate of the original stdout; fd 1 becomes stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _trace(tr: Any) -> dict[str, Any]:
    return {
        "agent": tr.agent.name,
        "ok": bool(tr.ok),
        "trainable": bool(tr.agent.trainable),
        "reward": float(tr.reward),
        "rewards": {k: (None if r is None else float(r.value)) for k, r in tr.rewards.items()},
        "metrics": {k: v for k, v in tr.metrics.items() if v is not None},
        "stop_condition": tr.stop_condition,
        "is_truncated": bool(tr.is_truncated),
        "errors": [f"{e.type}: {e.message}" for e in tr.errors],
        "branches": [
            {
                "trainable": bool(b.trainable),
                "token_ids": [int(t) for t in b.token_ids],
                "sampled_mask": [bool(m) for m in b.sampled_mask],
                "logprobs": [float(x) for x in b.logprobs],
            }
            for b in tr.branches
        ],
    }


class Worker:
    """One environment served for many episodes (module docstring)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.env: Any = None
        self.tasks: list[Any] = []
        self.client: Any = None
        self.model = "postrl"
        self.running: dict[str, asyncio.Task[Any]] = {}
        self.ready: dict[str, Any] = {}

    def send(self, msg: dict[str, Any]) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def init(self, msg: dict[str, Any]) -> None:
        import verifiers
        import verifiers.v1 as vf

        self.model = msg.get("model") or "postrl"
        cfg = vf.resolve_env_config(msg["env"])
        self.env = vf.load_environment(cfg)
        if not self.env.taskset.bounded:
            raise ValueError(
                f"taskset {cfg.taskset.id!r} is infinite; postrl needs a finite taskset to map "
                "dataset rows onto (bound it in its load(), or send each row's task data in "
                "extra_info.verifiers_task)"
            )
        self.tasks = list(self.env.taskset)
        self.client = vf.TrainClientConfig.model_validate(msg["client"])
        self.ready = {
            "op": "ready",
            "taskset": cfg.taskset.id,
            "num_tasks": len(self.tasks),
            "verifiers": verifiers.__version__,
        }

    def task_list(self, rid: Any) -> None:
        out = []
        for t in self.tasks:
            d = t.data
            prompt = d.prompt
            if prompt is not None and not isinstance(prompt, str):
                prompt = [m.model_dump(mode="json", exclude_none=True) for m in prompt]
            out.append({"idx": d.idx, "prompt": prompt, "system_prompt": d.system_prompt})
        self.send({"op": "tasks", "id": rid, "tasks": out})

    def _task(self, msg: dict[str, Any]) -> Any:
        if msg.get("task") is not None:
            cls = type(self.env.taskset).task_type()
            data = cls.data_type().model_validate(msg["task"])
            return cls(data, self.env.taskset.config.task)
        idx = msg.get("task_idx")
        if not isinstance(idx, int) or not 0 <= idx < len(self.tasks):
            raise ValueError(
                f"task_idx={idx!r}: the taskset has {len(self.tasks)} tasks "
                f"(0..{len(self.tasks) - 1})"
            )
        return self.tasks[idx]

    async def run(self, msg: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        rid = msg["id"]
        try:
            task = self._task(msg)
            ctx = vf.ModelContext(
                model=self.model, client=self.client, sampling=vf.Sampling(**msg["sampling"])
            )
            slot = self.env.slots(task, 1)[0]
            ep = await self.env.run_slot(slot, ctx)
            self.send(
                {
                    "op": "result",
                    "id": rid,
                    "ok": bool(ep.ok),
                    "errors": [f"{e.type}: {e.message}" for e in ep.errors],
                    "traces": [_trace(t) for t in ep.traces],
                }
            )
        except asyncio.CancelledError:
            pass
        except Exception as e:  # one episode's failure is reported, the worker serves on
            logger.warning("episode %s failed:\n%s", rid, traceback.format_exc())
            self.send({"op": "error", "id": rid, "message": f"{type(e).__name__}: {e}"})
        finally:
            self.running.pop(rid, None)

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                return
            msg = json.loads(line)
            op = msg.get("op")
            if op == "run":
                self.running[msg["id"]] = asyncio.create_task(self.run(msg))
            elif op == "cancel":
                task = self.running.get(msg.get("id"))
                if task is not None:
                    task.cancel()
            elif op == "tasks":
                self.task_list(msg.get("id"))
            elif op == "shutdown":
                return
            else:
                self.send({"op": "error", "id": msg.get("id"), "message": f"unknown op {op!r}"})


async def main() -> None:
    """Read ``init``, then serve requests inside ``env.serving()`` until shutdown or EOF."""
    logging.basicConfig(level=os.environ.get("POSTRL_VERIFIERS_LOG", "WARNING"), stream=sys.stderr)
    worker = Worker(_out_stream())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    line = await reader.readline()
    if not line:
        return
    try:
        worker.init(json.loads(line))
        async with worker.env.serving():
            worker.send(worker.ready)
            try:
                await worker.serve(reader)
            finally:
                for task in list(worker.running.values()):
                    task.cancel()
                await asyncio.gather(*worker.running.values(), return_exceptions=True)
    except (Exception, SystemExit) as e:  # the loop reports it (with the stderr tail)
        logger.error("the environment failed:\n%s", traceback.format_exc())
        worker.send({"op": "error", "id": None, "message": f"{type(e).__name__}: {e}"})


async def prepare() -> None:
    """Build the uv environment of verifiers' chat program (the ``null``/``bash`` harnesses
    run it as a uv script) now, so no episode waits for, or fails on, the download
    (``make verifiers-venv`` runs this)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    runtime = SubprocessRuntime(SubprocessConfig(), name="postrl-prepare")
    await runtime.start()
    try:
        argv = await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, {})
        sys.stderr.write(f"prepared verifiers' chat program: {argv[-2]}\n")
    finally:
        await runtime.teardown()


if __name__ == "__main__":
    asyncio.run(prepare() if sys.argv[1:] == ["--prepare"] else main())
