"""A generative reward model over HTTP: ``examples/rewards/llm_judge.py`` as the custom reward
function of a GRPO step, calling a real ``postrl serve`` app on 127.0.0.1 from the reward worker
processes."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.testing.servers import start_server
from postrl.trainer.trainer import RLTrainer

JUDGE = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "llm_judge.py"


@pytest.fixture(scope="module")
def judge_url(tiny_model_dir):
    url, srv, _ = start_server(tiny_model_dir, max_num_seqs=16, max_model_len=512)
    yield f"{url}/v1"
    srv.should_exit = True


def _fit(small_overrides, url: str) -> dict[str, float]:
    cfg = load_config(
        None,
        [
            *small_overrides,
            f"reward.custom_function.path={JUDGE}",
            "reward.max_failure_ratio=1.0",
            f"reward.reward_kwargs={{judge_url: '{url}', judge_timeout_s: 20, max_score: 9}}",
            "reward.timeout_s=40",
            "trainer.total_steps=1",
            "trainer.val_before_train=false",
            "data.val_files=[]",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_judge_scores_every_sample_over_http(small_overrides, judge_url):
    """Every sample got an answer from the judge: scored, or (a reply holding no digit 0-9 — the
    tiny random judge writes arbitrary bytes) a counted ``none`` failure; no HTTP error, no
    timeout."""
    m = _fit(small_overrides, judge_url)
    assert m["reward/generated"] == 16
    assert m["reward/scored"] + m["reward/failed/none"] == 16, m
    assert m["reward/failed/exception"] == m["reward/failed/timeout"] == 0


def test_unreachable_judge_is_a_counted_failure_not_a_score(small_overrides):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = _fit(small_overrides, f"http://127.0.0.1:{port}/v1")
    assert m["reward/failed/exception"] == 16 and m["reward/scored"] == 0


def test_judge_parses_scores_and_rejects_the_rest():
    """The function against a scripted OpenAI-style endpoint (a real HTTP server on 127.0.0.1):
    in-range integers become score/max_score, out-of-range or missing ones None, and the judge
    sees the question, the reference and the response."""
    import importlib.util
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    spec = importlib.util.spec_from_file_location("llm_judge", JUDGE)
    judge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(judge)
    replies, seen = ["7", "Score: 12", "no digits here", "10"], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["messages"][0]["content"])
            out = json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": replies[len(seen) - 1]}}]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        got = [
            judge.compute_score("addition", "17", "17", {"question": "What is 8+9?"}, judge_url=url)
            for _ in replies
        ]
    finally:
        srv.shutdown()
    assert got == [{"score": 0.7, "judge_raw": 7}, None, None, {"score": 1.0, "judge_raw": 10}]
    assert (
        "What is 8+9?" in seen[0]
        and "Reference answer: 17" in seen[0]
        and "Response:\n17" in seen[0]
    )
