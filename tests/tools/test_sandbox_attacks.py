"""Sandbox attack suite (issue 8): each attack is blocked or bounded, nothing survives the call,
project files stay unchanged, the trainer's event loop keeps running, and the result says why.

Needs root + namespaces + Landlock; on hosts without them the fail-closed tests still run and
the attack tests skip (the sandbox would refuse, which is itself tested).
"""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import time
from pathlib import Path
from unittest import mock

import pytest

import postrl.tools.sandbox as sandbox_mod
from postrl.tools.sandbox import Sandbox, SandboxConfig, processes_of_uid

PROJECT = Path(__file__).resolve().parents[2]
SECRET = "postrl-attack-secret-8c1f"
FAST = dict(
    wall_time_s=2.0,
    cpu_time_s=1,
    memory_mb=256,
    file_size_mb=8,
    workdir_size_mb=32,
    max_processes=16,
    max_output_bytes=64 * 1024,
    concurrency=2,
)


def _full_isolation() -> bool:
    rep = Sandbox(SandboxConfig(**FAST)).isolation_report()
    return not rep.missing(SandboxConfig().required_layers) and rep.active["landlock"]


pytestmark = pytest.mark.skipif(
    not _full_isolation(), reason="host lacks root/namespaces/landlock for the attack suite"
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(**FAST))


@pytest.fixture()
def canary():
    """A world-writable directory + file inside the project tree that attacks try to change."""
    d = PROJECT / "tests" / "tools" / f".canary_{os.getpid()}"
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o777)
    f = d / "canary.txt"
    f.write_text(SECRET)
    os.chmod(f, 0o666)
    yield f
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def run(sandbox: Sandbox, code: str, **kw):
    """Run ``code`` while a heartbeat task proves the trainer's loop is not blocked."""

    async def go():
        ticks = 0
        stop = asyncio.Event()

        async def heartbeat():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        hb = asyncio.ensure_future(heartbeat())
        t0 = time.monotonic()
        res = await sandbox.run_python(textwrap.dedent(code), **kw)
        elapsed = time.monotonic() - t0
        stop.set()
        await hb
        return res, ticks, elapsed

    # the uids this call ran as: the suite's other worker may run sandboxed code in the same
    # uid range at the same moment (another call's uid, held by its flock), so only ours count
    claimed: list[int] = []
    real_claim = sandbox_mod._claim_uid

    def claim(base: int, count: int) -> int:
        claimed.append(real_claim(base, count))
        return claimed[-1]

    with mock.patch.object(sandbox_mod, "_claim_uid", claim):
        res, ticks, elapsed = asyncio.run(go())
    assert claimed, "the call claimed no sandbox uid"
    survivors = [pid for uid in claimed for pid in processes_of_uid(uid)]
    assert survivors == [], f"sandbox processes of uid(s) {claimed} survived the call: {survivors}"
    assert elapsed < sandbox.config.wall_time_s + 3.0, elapsed
    # the loop ticked at least every ~100 ms on average while the sandbox ran (a blocked loop
    # ticks once; a busy 2-core box gave one tick per ~58 ms)
    assert ticks >= min(5, elapsed / 0.1), (ticks, elapsed)
    return res


def test_read_shadow_project_ssh_and_world_readable_host_files(sandbox, canary):
    res = run(
        sandbox,
        f"""
        import os
        found = []
        for p in ["/etc/shadow", "{PROJECT}/pyproject.toml", "{canary}", "/root/.ssh/id_rsa",
                  os.path.expanduser("~root/.ssh"), "/work", "/root", "/home"]:
            try:
                if os.path.isdir(p):
                    found.append((p, os.listdir(p)))
                else:
                    found.append((p, open(p).read()[:80]))
            except Exception as e:
                print("blocked", p, type(e).__name__)
        print("FOUND", found)
    """,
    )
    assert res.status == "ok", res
    assert "FOUND []" in res.stdout, res.stdout
    assert SECRET not in res.stdout and "[project]" not in res.stdout
    assert "blocked /etc/shadow PermissionError" in res.stdout


@pytest.mark.parametrize("disabled", [("landlock",), ("mount_namespace",)])
def test_each_filesystem_layer_alone_hides_the_project(disabled, canary):
    """Mount namespace alone and Landlock alone each keep a world-readable project file away."""
    required = tuple(x for x in SandboxConfig().required_layers if x not in disabled)
    sb = Sandbox(SandboxConfig(**FAST, disabled_layers=disabled, required_layers=required))
    assert not sb.isolation_report().active[disabled[0]]
    res = run(sb, f"print(open('{canary}').read())")
    assert res.status == "error" and SECRET not in res.stdout, res
    assert ("FileNotFoundError" in res.stderr) == (disabled == ("landlock",))


def test_write_outside_workdir_is_blocked_and_project_unchanged(sandbox, canary):
    before = canary.read_text()
    res = run(
        sandbox,
        f"""
        import os
        ok = []
        for p in ["{canary}", "{canary.parent}/new.txt", "/usr/evil", "/etc/evil", "/evil",
                  "/sandbox/../evil", "/proc/evil"]:
            try:
                with open(p, "w") as f:
                    f.write("pwned")
                ok.append(p)
            except Exception as e:
                print("blocked", p, type(e).__name__)
        try:
            os.remove("{canary}"); ok.append("rm")
        except Exception:
            pass
        open("inside.txt", "w").write("fine")   # the workdir itself is writable
        print("WROTE", ok)
    """,
    )
    assert res.status == "ok", res
    assert "WROTE []" in res.stdout
    assert canary.read_text() == before
    assert sorted(p.name for p in canary.parent.iterdir()) == ["canary.txt"]


def test_env_and_proc_environ_secrets_are_invisible(sandbox, monkeypatch):
    monkeypatch.setenv("POSTRL_TEST_SECRET", SECRET)
    res = run(
        sandbox,
        """
        import os
        print(dict(os.environ))
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("ppid", os.getppid(), "pids", pids)
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    print(p, open(f"/proc/{p}/environ").read())
                except Exception as e:
                    print(p, type(e).__name__)
    """,
    )
    assert res.status == "ok", res
    assert SECRET not in res.stdout
    assert "POSTRL" not in res.stdout
    assert "ppid 1 pids [1, 2]" in res.stdout  # only the sandbox init and itself are visible


def test_fork_bomb_is_bounded(sandbox):
    res = run(
        sandbox,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    )
    assert res.status in ("timeout", "killed"), res
    assert "limit" in res.reason or "signal" in res.reason


def test_allocate_4gb_hits_memory_limit(sandbox):
    res = run(sandbox, "x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert res.status == "memory", res
    assert "allocated" not in res.stdout and "256 MiB" in res.reason


def test_infinite_loop_hits_cpu_limit(sandbox):
    res = run(sandbox, "while True:\n    pass")
    # CPU limit (1 s) normally fires first; on a busy 2-core host the wall limit may win.
    assert res.status == "timeout" and ("CPU" in res.reason or "wall" in res.reason), res


def test_sleep_forever_hits_wall_limit(sandbox):
    t0 = time.monotonic()
    res = run(sandbox, "import time\ntime.sleep(10**6)")
    assert res.status == "timeout" and "wall" in res.reason, res
    assert time.monotonic() - t0 < 3.5


def test_print_1gb_is_truncated_and_killed(sandbox):
    res = run(sandbox, "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)")
    assert res.status == "output_limit", res
    assert len(res.stdout) <= sandbox.config.max_output_bytes


def test_write_2gb_file_hits_file_size_limit(sandbox):
    res = run(
        sandbox,
        """
        with open("big.bin", "wb") as f:
            for _ in range(2048):
                f.write(b"x" * 2**20)
        print("wrote 2GB")
    """,
    )
    assert res.status == "file_size", res
    assert "wrote" not in res.stdout


@pytest.mark.parametrize("disabled", [(), ("net_namespace",), ("landlock",)])
def test_network_loopback_and_outside_are_unreachable(disabled):
    """The network namespace alone and Landlock's TCP rules alone each block connections."""
    required = tuple(x for x in SandboxConfig().required_layers if x not in disabled)
    sb = Sandbox(SandboxConfig(**FAST, disabled_layers=disabled, required_layers=required))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        res = run(
            sb,
            f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.255.255.1", 80)]:
                s = socket.socket()
                s.settimeout(0.5)
                try:
                    s.connect(addr)
                    print("CONNECTED", addr)
                except OSError as e:
                    print("blocked", addr, type(e).__name__)
        """,
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the trainer's port
    finally:
        server.close()
    assert res.status == "ok", res
    assert "CONNECTED" not in res.stdout and res.stdout.count("blocked") == 3


def test_double_fork_daemon_does_not_outlive_the_call(sandbox):
    res = run(
        sandbox,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.closerange(0, 3)
                time.sleep(60)
            os._exit(0)
        time.sleep(0.1)
        print("parent done")
    """,
    )
    assert res.status == "ok" and "parent done" in res.stdout, res
    # run() asserted that no process of the sandbox uids is left


def test_killing_its_parent_does_not_hurt_the_trainer(sandbox):
    res = run(
        sandbox,
        f"""
        import os, signal
        for pid in [os.getppid(), 1, {os.getpid()}, {os.getppid()}]:
            try:
                os.kill(pid, signal.SIGKILL)
                print("sent", pid)
            except OSError as e:
                print("blocked", pid, type(e).__name__)
        os.killpg(0, signal.SIGKILL)
    """,
    )
    assert res.status in ("killed", "ok"), res
    assert res.describe().startswith("[sandbox: ")
    # the trainer (this test process) is alive and the sandbox works afterwards
    ok = asyncio.run(sandbox.run_python("print('still fine')"))
    assert ok.status == "ok" and ok.stdout == "still fine\n"


def test_concurrent_calls_are_bounded_by_the_pool(sandbox):
    async def go():
        t0 = time.monotonic()
        res = await asyncio.gather(
            *[sandbox.run_python("import time; time.sleep(0.3)") for _ in range(4)]
        )
        return res, time.monotonic() - t0

    res, dt = asyncio.run(go())
    assert all(r.status == "ok" for r in res)
    assert dt >= 0.6  # 4 calls, pool of 2, 0.3 s each -> at least two waves


def test_concurrent_calls_never_share_a_uid(sandbox):
    """Calls from two Sandbox objects at once run as distinct uids (the sweep of one call can
    never kill another call's program)."""
    other = Sandbox(SandboxConfig(**FAST))

    async def go():
        code = "import os, time; time.sleep(0.2); print(os.getuid())"
        return await asyncio.gather(
            sandbox.run_python(code),
            sandbox.run_python(code),
            other.run_python(code),
            other.run_python(code),
        )

    uids = [int(r.stdout) for r in asyncio.run(go())]
    assert len(set(uids)) == 4 and all(u >= sandbox.config.uid_base for u in uids)
