"""Sandbox launcher: the process the trainer starts for each sandboxed call.

Runs as a standalone script (``python -I -S _sandbox_init.py``), stdlib only, never imported
by postrl. It reads one JSON config from stdin, then:

1. ``unshare`` new PID / network / mount / IPC / UTS namespaces (those requested);
2. forks; the child is PID 1 of the new PID namespace (the *sandbox init*). When it exits the
   kernel kills every process left in the namespace, so double-forked daemons cannot outlive
   the call. It asks for SIGKILL if the launcher dies (``PR_SET_PDEATHSIG``);
3. the init builds a fresh root on a tmpfs holding only read-only bind mounts of a whitelist
   (``/usr``, ``/etc``, the interpreter's prefix, a few ``/dev`` nodes), a fresh ``/proc`` and a
   size-capped tmpfs ``/sandbox`` working dir owned by the sandbox uid, then ``chroot``s into it
   — the project directory, ``/root`` and the host ``/tmp`` simply do not exist inside;
4. drops to the unprivileged uid/gid (no supplementary groups), sets ``no_new_privs`` and
   applies a Landlock ruleset (filesystem whitelist, TCP bind/connect denied, signals and
   abstract unix sockets scoped to the sandbox);
5. forks the user program with rlimits (CPU, AS, FSIZE, NPROC, NOFILE, CORE=0), a scrubbed
   environment and stdin from a file, waits for it (wall-time backstop via ``alarm``), writes a
   JSON status line to the status fd and exits.

With ``best_effort`` set (the isolation probe) a failing layer is recorded and skipped;
otherwise any failure aborts before user code runs (fail closed).
"""

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
DEV_NODES = ("null", "zero", "urandom", "random", "full")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """A requested isolation layer could not be applied."""


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return ret


def _mount(src, target, fstype, flags, data=None):
    def enc(s):
        return s.encode() if s is not None else None

    _check(
        _libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)),
        f"mount {src} -> {target}",
    )


# ------------------------------------------------------------------------------ filesystem
def build_root(cfg, newroot):
    """Assemble the whitelist root under ``newroot`` (a fresh tmpfs) and chroot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("sandbox-root", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in cfg["ro_paths"]:
        if not os.path.lexists(path):
            continue
        target = newroot + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.islink(path):
            if not os.path.lexists(target):
                os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            open(target, "a").close()
        _mount(path, target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(newroot + "/dev", mode=0o755)
    for node in DEV_NODES:
        open(newroot + "/dev/" + node, "a").close()
        _mount("/dev/" + node, newroot + "/dev/" + node, None, MS_BIND)
    os.makedirs(newroot + "/proc", mode=0o555)
    if cfg["pid_ns"]:
        _mount("proc", newroot + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(newroot + "/sandbox", mode=0o700)
    _mount(
        "sandbox-work",
        newroot + "/sandbox",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"mode=0700,size={cfg['workdir_size_mb']}m,uid={cfg['uid']},gid={cfg['gid']}",
    )
    os.symlink("/sandbox", newroot + "/tmp")
    _mount(None, newroot, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(newroot)
    os.chroot(".")
    os.chdir("/sandbox")


# ------------------------------------------------------------------------------ landlock
def _landlock_rights(abi):
    """(fs read rights, all fs rights, net rights, scope flags) handled at this ABI."""
    read = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
    all_fs = (1 << 13) - 1  # ABI 1: bits 0..12
    if abi >= 2:
        all_fs |= 1 << 13  # REFER
    if abi >= 3:
        all_fs |= 1 << 14  # TRUNCATE
    if abi >= 5:
        all_fs |= 1 << 15  # IOCTL_DEV
    net = 1 | 2 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP
    scope = 1 | 2 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    return read, all_fs, net, scope


def apply_landlock(ro_paths, rw_paths):
    """Restrict this process (and its children) to read ``ro_paths`` and write ``rw_paths``."""
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        raise SetupError(f"landlock unavailable (errno {ctypes.get_errno()})")
    read, all_fs, net, scope = _landlock_rights(abi)
    attr = (ctypes.c_uint64 * 3)(all_fs, net, scope)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    fd = _check(
        _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0),
        "landlock_create_ruleset",
    )

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    file_rights = 1 | 2 | 4 | (1 << 14 if abi >= 3 else 0)  # exec, write, read, truncate
    try:
        for paths, rights in ((ro_paths, read), (rw_paths, all_fs)):
            for path in paths:
                if not os.path.exists(path):
                    continue
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    allowed = rights if os.path.isdir(path) else rights & file_rights
                    rule = PathBeneath(allowed, pfd)
                    _check(
                        _libc.syscall(SYS_LANDLOCK_ADD_RULE, fd, 1, ctypes.byref(rule), 0),
                        f"landlock_add_rule {path}",
                    )
                finally:
                    os.close(pfd)
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0), "landlock_restrict_self")
    finally:
        os.close(fd)
    return abi


# ------------------------------------------------------------------------------ user program
def _exec_user(cfg):
    """In the forked child: rlimits, stdio, scrubbed env, exec. Never returns."""
    import resource

    try:
        lim = cfg["rlimits"]
        for name, value in lim.items():
            res = getattr(resource, name)
            hard = value + 1 if name == "RLIMIT_CPU" else value
            resource.setrlimit(res, (value, hard))
        fd = (
            os.open(cfg["stdin_path"], os.O_RDONLY)
            if cfg.get("stdin_path")
            else os.open("/dev/null", os.O_RDONLY)
        )
        os.dup2(fd, 0)
        os.closerange(3, 65536)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGALRM, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - report and exit, never return into init
        os.write(2, f"sandbox: cannot start program: {e}\n".encode())
    os._exit(127)


def _drop_privileges(cfg, layers):
    if cfg["drop_uid"]:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        try:
            os.setuid(0)
        except PermissionError:
            layers["uid_drop"] = True
        else:
            raise SetupError("privileges could be regained after setuid")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    layers["no_new_privs"] = True
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid; set again


def _layer(cfg, layers, errors, name, fn):
    """Run one setup step; record failures (best effort) or raise (fail closed)."""
    try:
        fn()
    except (OSError, SetupError) as e:
        errors[name] = str(e)
        if not cfg["best_effort"]:
            raise SetupError(f"isolation layer {name!r} failed: {e}") from e
        return False
    layers[name] = True
    return True


def sandbox_init(cfg, status_fd, layers, errors):
    """PID 1 of the sandbox (or plain child without a PID namespace). Never returns."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    status = {"layers": layers, "errors": errors}
    try:
        if cfg["mount_ns"]:
            _layer(cfg, layers, errors, "mount_namespace", lambda: build_root(cfg, cfg["newroot"]))
        if not layers.get("mount_namespace"):
            os.chdir(cfg["fallback_workdir"])
        for name, content in cfg["files"].items():
            with open(name, "w") as f:
                f.write(content)
            os.chown(name, cfg["uid"], cfg["gid"]) if cfg["drop_uid"] else None
        _drop_privileges(cfg, layers)
        if cfg["landlock"]:
            rw = [os.getcwd()] + ["/dev/null", "/dev/zero", "/dev/full"]
            ro = list(cfg["ro_paths"]) + ["/dev", "/proc"]
            _layer(cfg, layers, errors, "landlock", lambda: apply_landlock(ro, rw))
    except BaseException as e:  # noqa: BLE001
        status["setup_error"] = f"{type(e).__name__}: {e}"
        os.write(status_fd, (json.dumps(status) + "\n").encode())
        os._exit(125)
    if cfg.get("probe_only"):
        os.write(status_fd, (json.dumps(status) + "\n").encode())
        os._exit(0)
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        _exec_user(cfg)

    def on_alarm(signum, frame):
        status["wall_timeout"] = True
        os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(cfg["wall_s"]) + 1))
    while True:  # reap everything; stop when the user program itself exits
        pid, wstatus = os.waitpid(-1, 0)
        if pid == child:
            break
    if os.WIFSIGNALED(wstatus):
        status["signal"] = os.WTERMSIG(wstatus)
    else:
        status["exit_code"] = os.WEXITSTATUS(wstatus)
    os.write(status_fd, (json.dumps(status) + "\n").encode())
    os._exit(0)  # as PID 1 this tears down the namespace: every leftover process is killed


def main():
    """Launcher entry: read config, unshare, fork the sandbox init, forward its exit."""
    cfg = json.loads(sys.stdin.buffer.read().decode())
    status_fd = cfg["status_fd"]
    layers, errors = {}, {}
    flags_by_layer = [
        ("pid_namespace", "pid_ns", CLONE_NEWPID),
        ("net_namespace", "net_ns", CLONE_NEWNET),
        ("mount_ns_unshare", "mount_ns", CLONE_NEWNS),
        ("ipc_uts_namespace", "pid_ns", CLONE_NEWIPC | CLONE_NEWUTS),
    ]
    try:
        for layer, key, flag in flags_by_layer:
            if cfg[key]:
                ok = _layer(
                    cfg,
                    layers,
                    errors,
                    layer,
                    lambda flag=flag, layer=layer: _check(_libc.unshare(flag), layer),
                )
                if not ok:
                    cfg[key] = False
        layers.pop("mount_ns_unshare", None)
    except SetupError as e:
        os.write(status_fd, (json.dumps({"setup_error": str(e), "errors": errors}) + "\n").encode())
        os._exit(125)
    # SIGTERM from the trainer means "kill the sandbox init and reap it"; block it across the
    # fork so it can neither hit the default action nor run in the child.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        sandbox_init(cfg, status_fd, layers, errors)
    os.close(status_fd)
    signal.signal(signal.SIGTERM, lambda s, f: os.kill(pid, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _, wstatus = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(wstatus) & 0xFF)


if __name__ == "__main__":
    main()
