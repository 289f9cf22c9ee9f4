"""Backends that run in a process of their own declare it in their registry entry; the
interpreter of that process comes from ``rollout.python``, else the entry's default venv when it
exists, else this interpreter."""

from __future__ import annotations

import sys

from postrl.rollout.base import ROLLOUT_BACKENDS, replica_python, runs_in_own_process


def test_vllm_declares_its_own_process_and_the_others_do_not():
    assert runs_in_own_process("vllm")
    assert not any(runs_in_own_process(n) for n in ("native", "hf"))
    assert ROLLOUT_BACKENDS.meta("vllm")["python"] == ".venv-vllm/bin/python"


def test_replica_python_prefers_the_configured_then_the_venv_then_this_one(tmp_path, monkeypatch):
    assert replica_python("vllm", "/opt/py/bin/python") == "/opt/py/bin/python"
    assert replica_python("native") == sys.executable  # no default declared
    monkeypatch.chdir(tmp_path)
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert replica_python("vllm") == str(tmp_path / ".venv-vllm/bin/python")


def test_the_backend_module_registering_itself_keeps_the_declared_facts():
    """Importing ``vllm_backend`` registers the class eagerly; the facts its lazy declaration
    stated (``python``, ``own_process``) survive (in the full suite another test imports it
    first, and the replica then ran this interpreter, which has no vLLM)."""
    import postrl.rollout.vllm_backend  # noqa: F401

    meta = ROLLOUT_BACKENDS.meta("vllm")
    assert meta["python"] == ".venv-vllm/bin/python" and meta["own_process"]
