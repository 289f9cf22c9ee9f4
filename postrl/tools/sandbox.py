"""Sandboxed execution of model-written programs.

Each call runs in a fresh subprocess tree (see ``_sandbox_init.py`` for the in-sandbox steps):

=====================  =====================================================================
layer                  what it does
=====================  =====================================================================
``process_group``      the launcher gets its own session/process group; killed whole at limit
``pid_namespace``      the program runs under a private PID 1; when the call ends the kernel
                       kills every process left (double-forked daemons included); the trainer
                       and other sandboxes are invisible (fresh ``/proc``)
``uid_drop``           runs as an unprivileged uid claimed for the call alone (a file lock per
                       uid, so processes and Sandbox objects never share one): ``RLIMIT_NPROC``
                       binds per call and a final ``kill(-1)`` as that uid sweeps stragglers
``net_namespace``      empty network namespace: no interface is up, not even loopback
``mount_namespace``    a tmpfs root holding read-only binds of a whitelist only; the project
                       directory, ``/root``, ``/home`` and the host ``/tmp`` do not exist inside
``landlock``           kernel LSM ruleset: read only the whitelist, write only the workdir,
                       no TCP bind/connect, signals/abstract sockets scoped to the sandbox
``no_new_privs``       setuid binaries cannot raise privileges
``rlimits``            CPU seconds, address space, file size, process count, open files, core=0
``env_scrub``          the program sees only a minimal fixed environment
``tmpfs_workdir``      an empty, size-capped tmpfs working dir owned by the sandbox uid
``output_cap``         stdout/stderr read with a byte cap; exceeding it kills the call
=====================  =====================================================================

:meth:`Sandbox.isolation_report` probes which layers this host really applies (once, cached).
With ``untrusted=True`` (the default) a layer listed in ``required_layers`` that is not active
makes every call return ``status="refused"`` naming the missing layers — the sandbox fails
closed instead of running model code with less isolation than configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["IsolationReport", "Sandbox", "SandboxConfig", "SandboxResult"]

_INIT_SCRIPT = str(Path(__file__).with_name("_sandbox_init.py"))
_ALL_LAYERS = (
    "process_group",
    "pid_namespace",
    "uid_drop",
    "net_namespace",
    "mount_namespace",
    "landlock",
    "no_new_privs",
    "rlimits",
    "env_scrub",
    "tmpfs_workdir",
    "output_cap",
)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation settings of a :class:`Sandbox`."""

    wall_time_s: float = 5.0
    """Wall-clock limit per call; the whole process tree is killed when it passes."""
    cpu_time_s: int = 5
    """RLIMIT_CPU (seconds of CPU) for the program."""
    memory_mb: int = 512
    """RLIMIT_AS (virtual address space) in MiB."""
    file_size_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write, MiB."""
    workdir_size_mb: int = 64
    """Size cap of the tmpfs working directory, MiB."""
    max_processes: int = 32
    """RLIMIT_NPROC for the sandbox uid (binds because the program is not root)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout and on stderr (each); exceeding it kills the call."""
    concurrency: int = 4
    """Pool size: at most this many sandboxed programs of this Sandbox run at once (per event
    loop)."""
    uid_base: int = 61000
    """First uid/gid of the range calls run as (unprivileged, not used by anything else)."""
    uid_count: int = 1024
    """Size of the uid range; each running call holds one uid of it exclusively."""
    untrusted: bool = True
    """Refuse to run when a layer in ``required_layers`` is unavailable (fail closed)."""
    required_layers: tuple[str, ...] = (
        "uid_drop",
        "pid_namespace",
        "net_namespace",
        "mount_namespace",
    )
    """Layers that must be active for an untrusted sandbox; see the module docstring."""
    extra_ro_paths: tuple[str, ...] = ()
    """Extra host paths bound read-only inside (e.g. a venv's site-packages)."""
    disabled_layers: tuple[str, ...] = ()
    """Layers not to apply even where available (for testing one layer alone, or debugging)."""
    python: str = ""
    """Interpreter for :meth:`Sandbox.run_python`; default: the real path of sys.executable."""

    def __post_init__(self) -> None:
        unknown = [
            x for x in (*self.required_layers, *self.disabled_layers) if x not in _ALL_LAYERS
        ]
        if unknown:
            raise ValueError(
                f"SandboxConfig.required_layers has unknown layers {unknown}; "
                f"choose from {list(_ALL_LAYERS)}"
            )
        if self.wall_time_s <= 0 or self.concurrency < 1:
            raise ValueError(
                "SandboxConfig: wall_time_s must be > 0 and concurrency >= 1, got "
                f"{self.wall_time_s}, {self.concurrency}"
            )


@dataclass
class SandboxResult:
    """Outcome of one sandboxed call.

    ``status`` is one of ``ok`` (exit 0), ``error`` (non-zero exit), ``timeout`` (wall or CPU
    limit), ``memory`` (address-space limit hit), ``file_size`` (RLIMIT_FSIZE / workdir full),
    ``output_limit`` (output cap exceeded, output truncated), ``killed`` (ended by a signal),
    ``refused`` (required isolation missing; nothing ran) or ``setup_failed``.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    status: str
    duration_s: float
    reason: str = ""
    """Human-readable why, e.g. 'wall time limit of 2.0s exceeded'."""

    def describe(self) -> str:
        """One line for tool observations: status plus reason."""
        return f"[sandbox: {self.status}{': ' + self.reason if self.reason else ''}]"


@dataclass(frozen=True)
class IsolationReport:
    """Which layers the probe found active, and why the others are not."""

    active: dict[str, bool]
    errors: dict[str, str] = field(default_factory=dict)

    def missing(self, required: tuple[str, ...]) -> list[str]:
        """Required layers that are not active."""
        return [x for x in required if not self.active.get(x)]

    def summary(self) -> str:
        """``layer=on/off`` pairs, with reasons for the off ones."""
        parts = [f"{k}={'on' if v else 'off'}" for k, v in self.active.items()]
        why = "; ".join(f"{k}: {v}" for k, v in self.errors.items())
        return ", ".join(parts) + (f" ({why})" if why else "")


class Sandbox:
    """Runs untrusted programs with the layers above; async, with a bounded pool.

    Example::

        sb = Sandbox(SandboxConfig(wall_time_s=2))
        res = await sb.run_python("print(6 * 7)")
        assert res.status == "ok" and res.stdout == "42\\n"
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.python = self.config.python or os.path.realpath(sys.executable)
        self.metrics: Counter[str] = Counter()
        self._report: IsolationReport | None = None
        # one pool per event loop (asyncio primitives are bound to the loop that uses them)
        self._sems: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ isolation
    def _ro_paths(self) -> list[str]:
        prefix = os.path.realpath(sys.base_prefix)
        paths = [
            "/usr",
            "/bin",
            "/sbin",
            "/lib",
            "/lib64",
            "/lib32",
            "/etc",
            prefix,
            os.path.dirname(self.python),
        ]
        return list(dict.fromkeys(paths + list(self.config.extra_ro_paths)))

    def isolation_report(self) -> IsolationReport:
        """Probe (once) which isolation layers this host applies; blocking, ~0.1 s."""
        if self._report is None:
            self._report = self._probe()
            logger.info("sandbox isolation: %s", self._report.summary())
        return self._report

    def _probe(self) -> IsolationReport:
        is_root = os.geteuid() == 0
        uid = _claim_uid(self.config.uid_base, self.config.uid_count)
        try:
            return self._probe_as(uid, is_root)
        finally:
            _release_uid(uid)

    def _probe_as(self, uid: int, is_root: bool) -> IsolationReport:
        cfg = self._launch_config(
            uid, argv=[self.python, "-I", "-S", "-c", "pass"], files={}, stdin="", best_effort=True
        )
        off = set(self.config.disabled_layers)
        cfg.update(
            drop_uid=is_root and "uid_drop" not in off,
            pid_ns="pid_namespace" not in off,
            net_ns="net_namespace" not in off,
            mount_ns="mount_namespace" not in off,
            landlock="landlock" not in off,
        )
        workdir = self._make_workdir(uid, is_root)
        rfd, wfd = os.pipe()
        cfg.update(status_fd=wfd, fallback_workdir=workdir, newroot=workdir)
        try:
            proc = subprocess.run(
                [self.python, "-I", "-S", _INIT_SCRIPT],
                input=json.dumps(cfg).encode(),
                capture_output=True,
                env={},
                pass_fds=(wfd,),
                start_new_session=True,
                timeout=30,
            )
            os.close(wfd)
            wfd = -1
            raw = os.read(rfd, 1 << 16).decode(errors="replace")
        finally:
            if wfd >= 0:
                os.close(wfd)
            os.close(rfd)
            shutil.rmtree(workdir, ignore_errors=True)
        status = json.loads(raw) if raw.strip() else {}
        active = {name: False for name in _ALL_LAYERS}
        active.update({k: bool(v) for k, v in status.get("layers", {}).items() if k in active})
        active.update(process_group=True, rlimits=True, env_scrub=True, output_cap=True)
        active["tmpfs_workdir"] = active["mount_namespace"]
        errors = dict(status.get("errors", {}))
        for layer in off:
            errors[layer] = "disabled by SandboxConfig.disabled_layers"
        if not is_root:
            errors["uid_drop"] = "not running as root: cannot switch to an unprivileged uid"
        if status.get("setup_error") or proc.returncode != 0:
            errors["probe"] = status.get("setup_error") or proc.stderr.decode(errors="replace")
        elif status.get("exit_code") != 0:
            errors["interpreter"] = (
                f"{self.python} cannot run inside the sandbox with these "
                f"layers: {proc.stderr.decode(errors='replace').strip()}"
            )
        return IsolationReport(active=active, errors=errors)

    # ------------------------------------------------------------------ running
    def _launch_config(
        self,
        uid: int,
        argv: list[str],
        files: dict[str, str],
        stdin: str,
        best_effort: bool = False,
    ) -> dict:
        c = self.config
        report = self._report
        use = (lambda layer: True) if report is None else (lambda layer: report.active[layer])
        if stdin:
            files = {**files, ".stdin": stdin}
        return {
            "pid_ns": use("pid_namespace"),
            "net_ns": use("net_namespace"),
            "mount_ns": use("mount_namespace"),
            "landlock": use("landlock"),
            "drop_uid": use("uid_drop"),
            "uid": uid,
            "gid": uid,
            "ro_paths": self._ro_paths(),
            "workdir_size_mb": c.workdir_size_mb,
            "files": files,
            "stdin_path": ".stdin" if stdin else "",
            "argv": argv,
            "wall_s": c.wall_time_s,
            "best_effort": best_effort,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": ".",
                "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8",
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            "rlimits": {
                "RLIMIT_CPU": int(c.cpu_time_s),
                "RLIMIT_AS": c.memory_mb << 20,
                "RLIMIT_FSIZE": c.file_size_mb << 20,
                "RLIMIT_NPROC": c.max_processes,
                "RLIMIT_NOFILE": c.max_open_files,
                "RLIMIT_CORE": 0,
            },
        }

    def _make_workdir(self, uid: int, chown: bool) -> str:
        workdir = tempfile.mkdtemp(prefix="postrl-sandbox-")
        if chown:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        return workdir

    async def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        """Run Python source ``code`` (file ``main.py`` in the workdir) in the sandbox."""
        return await self.run([self.python, "-I", "-S", "main.py"], {"main.py": code}, stdin)

    async def run(
        self, argv: list[str], files: dict[str, str] | None = None, stdin: str = ""
    ) -> SandboxResult:
        """Run ``argv`` (absolute program path) with ``files`` written into the workdir.

        Never raises for anything the program does; returns a :class:`SandboxResult`.
        """
        report = self.isolation_report()
        missing = report.missing(self.config.required_layers) if self.config.untrusted else []
        if missing:
            self.metrics["sandbox/refused"] += 1
            why = "; ".join(f"{m}: {report.errors.get(m, 'unavailable')}" for m in missing)
            return SandboxResult(
                "",
                "",
                None,
                "refused",
                0.0,
                f"untrusted sandbox needs isolation layers {missing} that are "
                f"unavailable here ({why}); set untrusted=False or "
                "required_layers to run with less isolation",
            )
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.config.concurrency)
        async with sem:
            try:
                uid = _claim_uid(self.config.uid_base, self.config.uid_count)
            except RuntimeError as e:
                self.metrics["sandbox/status/setup_failed"] += 1
                return SandboxResult("", "", None, "setup_failed", 0.0, str(e))
            try:
                result = await self._run_as(uid, argv, files or {}, stdin)
            finally:
                _release_uid(uid)
        self.metrics[f"sandbox/status/{result.status}"] += 1
        return result

    async def _run_as(
        self, uid: int, argv: list[str], files: dict[str, str], stdin: str
    ) -> SandboxResult:
        c = self.config
        cfg = self._launch_config(uid, argv, files, stdin)
        workdir = self._make_workdir(uid, cfg["drop_uid"])
        rfd, wfd = os.pipe()
        cfg.update(status_fd=wfd, fallback_workdir=workdir, newroot=workdir)
        t0 = time.monotonic()
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-I",
                "-S",
                _INIT_SCRIPT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={},
                pass_fds=(wfd,),
                start_new_session=True,
            )
            os.close(wfd)
            wfd = -1
            proc.stdin.write(json.dumps(cfg).encode())
            proc.stdin.close()
            out_task = asyncio.ensure_future(_read_capped(proc.stdout, c.max_output_bytes))
            err_task = asyncio.ensure_future(_read_capped(proc.stderr, c.max_output_bytes))
            timed_out = over = False
            try:
                over = await asyncio.wait_for(
                    _first_overflow(out_task, err_task), timeout=c.wall_time_s
                )
            except asyncio.TimeoutError:
                timed_out = True
            if timed_out or over:
                # The launcher kills the sandbox init and reaps it (no zombie left for the
                # host's init); if it does not exit promptly, kill the whole group.
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    _kill_group(proc.pid)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=5.0)
            (out, out_over), (err, err_over) = out_task.result(), err_task.result()
            for stream in (proc.stdout, proc.stderr):  # discard the rest so pipes reach EOF
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(stream), timeout=1.0)
        finally:
            if wfd >= 0:
                os.close(wfd)
            if proc is not None and proc.returncode is None:
                _kill_group(proc.pid)
            if cfg["drop_uid"]:
                leaked = await asyncio.get_running_loop().run_in_executor(None, _sweep_uid, uid)
                if leaked:
                    self.metrics["sandbox/leaked_processes"] += leaked
                    logger.error(
                        "sandbox uid %d still has %d processes after the sweep", uid, leaked
                    )
            raw = _read_all(rfd)
            os.close(rfd)
            shutil.rmtree(workdir, ignore_errors=True)
        status = json.loads(raw) if raw.strip() else {}
        return self._classify(
            status, out, err, timed_out, out_over or err_over, time.monotonic() - t0
        )

    def _classify(
        self, st: dict, out: bytes, err: bytes, timed_out: bool, over: bool, dt: float
    ) -> SandboxResult:
        c = self.config
        so, se = out.decode(errors="replace"), err.decode(errors="replace")
        code = st.get("exit_code")
        sig = st.get("signal")
        if st.get("setup_error"):
            return SandboxResult(so, se, None, "setup_failed", dt, st["setup_error"])
        if over:
            return SandboxResult(
                so,
                se,
                code,
                "output_limit",
                dt,
                f"output exceeded {c.max_output_bytes} bytes; truncated, killed",
            )
        if timed_out or st.get("wall_timeout"):
            return SandboxResult(
                so, se, code, "timeout", dt, f"wall time limit of {c.wall_time_s}s exceeded; killed"
            )
        if sig == signal.SIGXCPU:
            return SandboxResult(
                so, se, None, "timeout", dt, f"CPU time limit of {c.cpu_time_s}s exceeded; killed"
            )
        if sig == signal.SIGXFSZ or "File too large" in se or "No space left" in se:
            return SandboxResult(
                so,
                se,
                code,
                "file_size",
                dt,
                f"file size limit ({c.file_size_mb} MiB file, "
                f"{c.workdir_size_mb} MiB workdir) exceeded",
            )
        if "MemoryError" in se or "Cannot allocate memory" in se:
            return SandboxResult(
                so, se, code, "memory", dt, f"memory limit of {c.memory_mb} MiB exceeded"
            )
        if sig is not None:
            return SandboxResult(
                so, se, None, "killed", dt, f"terminated by signal {signal.Signals(sig).name}"
            )
        if code is None:
            return SandboxResult(so, se, None, "killed", dt, "sandbox ended without a status")
        if code != 0:
            return SandboxResult(so, se, code, "error", dt, f"exit code {code}")
        return SandboxResult(so, se, 0, "ok", dt)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read until EOF or until more than ``cap`` bytes arrived; returns (data[:cap], over)."""
    buf = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(buf), False
        buf += chunk
        if len(buf) > cap:
            return bytes(buf[:cap]), True


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 16):
        pass


async def _first_overflow(*tasks: asyncio.Future) -> bool:
    """Wait until all readers hit EOF (-> False) or one overflows (-> True)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(t.result()[1] for t in done):
            return True
    return False


_UID_LOCK_DIR = "/tmp/postrl-sandbox-uids"
_UID_THREAD_LOCK = threading.Lock()
_UID_HELD: dict[int, int] = {}


def _claim_uid(base: int, count: int) -> int:
    """Claim a uid of ``[base, base + count)`` for one call, exclusive across threads and
    processes (``flock`` on a per-uid file)."""
    os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
    with _UID_THREAD_LOCK:
        for uid in range(base, base + count):
            if uid in _UID_HELD:
                continue
            fd = os.open(f"{_UID_LOCK_DIR}/{uid}", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _UID_HELD[uid] = fd
            return uid
    raise RuntimeError(
        f"no free sandbox uid in [{base}, {base + count}); raise "
        "SandboxConfig.uid_count or lower concurrency"
    )


def _release_uid(uid: int) -> None:
    with _UID_THREAD_LOCK:
        fd = _UID_HELD.pop(uid, None)
    if fd is not None:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _sweep_uid(uid: int, deadline_s: float = 2.0) -> int:
    """Make sure no process of ``uid`` is left; returns how many still exist at the deadline.

    Usually there is none (the PID namespace died with its init). Otherwise ``kill(-1, SIGKILL)``
    is issued *as* that uid (it reaches every process of the uid, even ones forking meanwhile).
    """
    end = time.monotonic() + deadline_s
    while (left := processes_of_uid(uid)) and time.monotonic() < end:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["/bin/kill", "-KILL", "--", "-1"],
                user=uid,
                group=uid,
                extra_groups=[],
                env={},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=deadline_s,
            )
        time.sleep(0.02)
    return len(left)


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def processes_of_uid(uid: int, count: int = 1) -> list[int]:
    """PIDs of live processes whose real uid is in ``[uid, uid + count)`` (tests, health)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if uid <= int(line.split()[1]) < uid + count:
                            pids.append(int(entry))
                        break
        except OSError:
            continue
    return pids
