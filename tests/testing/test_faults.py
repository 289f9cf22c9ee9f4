"""Fault hooks: the trainer's ``fire(point)`` runs installed callbacks; the test-side kill hook
really SIGKILLs, and ``faults_run`` fails loudly when its kill point is never reached."""

from __future__ import annotations

import subprocess
import sys

import pytest

from postrl.testing import faults_run
from postrl.testing.faults import KillAt, install_kill_at
from postrl.trainer import hooks


@pytest.fixture(autouse=True)
def _no_hooks_left():
    before = list(hooks.FAULT_HOOKS)
    yield
    hooks.FAULT_HOOKS[:] = before


def test_fire_runs_installed_hooks_in_order_until_uninstalled():
    calls: list[tuple[str, str]] = []
    hooks.fire("step1:end")  # nothing installed: a no-op
    a = hooks.install(lambda p: calls.append(("a", p)))
    b = hooks.install(lambda p: calls.append(("b", p)))
    hooks.fire("step1:after_gen")
    hooks.uninstall(a)
    hooks.fire("step2:end")
    hooks.uninstall(b)
    hooks.fire("step3:end")
    assert calls == [("a", "step1:after_gen"), ("b", "step1:after_gen"), ("b", "step2:end")]
    with pytest.raises(ValueError, match="not installed"):
        hooks.uninstall(a)
    with pytest.raises(TypeError, match="callable"):
        hooks.install("step1:end")  # type: ignore[arg-type]


def test_a_hook_exception_propagates_out_of_fire():
    def boom(point: str) -> None:
        raise RuntimeError(f"injected at {point}")

    hooks.install(boom)
    with pytest.raises(RuntimeError, match="injected at step2:end"):
        hooks.fire("step2:end")


def test_kill_hook_records_points_and_rejects_an_empty_point():
    hook = KillAt("step9:end")
    hook("step1:after_gen")
    hook("step1:end")
    assert hook.seen == ["step1:after_gen", "step1:end"]
    with pytest.raises(ValueError, match="non-empty string"):
        KillAt("")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_installed_kill_hook_sigkills_at_its_point_only():
    proc = _python(
        "from postrl.testing.faults import install_kill_at\n"
        "from postrl.trainer.hooks import fire\n"
        "install_kill_at('step3:after_gen')\n"
        "fire('step2:after_gen'); fire('step3:end'); print('alive', flush=True)\n"
        "fire('step3:after_gen'); print('survived', flush=True)\n"
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert proc.stdout.split() == ["alive"]


def test_an_installed_kill_hook_ignores_other_points():
    install_kill_at("step7:end")  # in this process: must not fire for another point
    hooks.fire("step1:end")
    hooks.fire("step7:after_gen")


def test_faults_run_fails_when_the_kill_point_is_never_reached(tmp_path, capsys):
    out = tmp_path / "add.parquet"
    cmd = ["--kill-at", "step1:after_gen", "data", "addition", str(out), "--n", "4"]
    assert faults_run.main(cmd) == faults_run.NOT_REACHED  # in-process: nothing fires, no kill
    assert out.exists(), "the wrapped postrl command must still run"
    err = capsys.readouterr().err
    assert "without reaching kill point 'step1:after_gen'" in err
    assert "points reached: none" in err
