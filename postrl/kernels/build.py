"""Build a C source of postrl's fused CPU kernels into a cached shared library, load it via ctypes.

One build path for every C kernel library (the native engine's decode kernels,
``rollout/native/kernels.c``, and the training kernels, ``kernels/train.c``):

* **Compiler and flags.** ``$CC``, else ``cc``/``gcc``/``clang``. ``-O3 -fno-math-errno
  -fno-trapping-math -shared -fPIC`` (``-fno-trapping-math`` as in torch's own build: without
  it gcc if-converts the compare-and-select loops around the polynomial
  ``exp`` only with AVX-512's mask registers, so an AVX2 build ran SwiGLU and the sampling
  softmax one float at a time; the AVX-512 build's results are the same bit for bit)
  plus the first variant of :data:`VARIANTS` that compiles: ``-march=native -fopenmp``
  (``-fopenmp`` links libgomp by its soname, which resolves to the copy torch already loaded, so
  the kernels' threads are torch's OpenMP pool), then single-threaded ``-fopenmp-simd`` builds
  (``-mcpu=native`` for arm64 compilers, then plain). ``-I`` this folder, so a source may include
  :file:`simd.h` (the shared vector math). ``POSTRL_KERNELS_MARCH=x86-64-v3`` builds for that
  ISA level instead of the host's (an AVX-512 machine then runs an AVX2-only CPU's code: no
  zmm, ymm16-31 or mask registers; its own cache entry).
* **Cache.** ``$POSTRL_CACHE_DIR`` (default ``~/.cache/postrl``)``/kernels/<prefix>-<hash>.so``,
  keyed by the source, the headers of this folder, the compiler, the flags and the CPU's feature
  flags (so a shared home directory never hands a machine code it cannot run). Only a private
  directory (ours, not group/world-writable) is used: a library is never loaded from a place
  someone else could write to. The write is atomic (concurrent builders race harmlessly); a build
  has a 120 s deadline.
* **Two OpenMP runtimes.** If the OpenMP build maps a runtime other than torch's (two thread pools
  fighting for the cores, measured 10× slower), the single-threaded variant is used instead.
* **Sanitizers.** ``POSTRL_KERNEL_SANITIZE=1`` builds with ``-fsanitize=address,undefined``
  (every finding fatal) into its own cache entry; Python must then start with ``LD_PRELOAD`` =
  :func:`sanitizer_preload` and ``ASAN_OPTIONS=detect_leaks=0``.

Callers decide what a failure means (the engines fall back to their torch paths and say so).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = [
    "MARCH_ENV",
    "Once",
    "VARIANTS",
    "cache_dir",
    "cpu_flags",
    "find_cc",
    "load_library",
    "openmp_runtimes",
    "sanitizer_preload",
    "variants",
]

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
VARIANTS: tuple[tuple[str, ...], ...] = (
    ("-march=native", "-fopenmp"),
    ("-march=native", "-fopenmp-simd"),
    ("-mcpu=native", "-fopenmp-simd"),
    ("-fopenmp-simd",),
)
"""Flag variants tried in order; the first that compiles is used (``-march=native`` becomes
``-march=$POSTRL_KERNELS_MARCH`` when that is set: :func:`variants`)."""
_SERIAL = VARIANTS[1:]  # when the OpenMP build would bring a second runtime
MARCH_ENV = "POSTRL_KERNELS_MARCH"
"""Environment variable: build the kernels for this ``-march`` instead of the host's, e.g.
``x86-64-v3`` (AVX2 and FMA, no AVX-512) on an AVX-512 machine, to reproduce an AVX2-only
CPU's code and rounding (docs/learning.md, "The quickstart on AVX2 code")."""


def variants(base: tuple[tuple[str, ...], ...] = VARIANTS) -> tuple[tuple[str, ...], ...]:
    """``base`` with ``-march=native`` replaced by ``-march=$POSTRL_KERNELS_MARCH`` when that
    is set (a value with anything but letters, digits, ``-``, ``_`` and ``.`` is refused)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return base
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"{MARCH_ENV}={march!r}: expected a -march name such as x86-64-v3")
    return tuple(
        tuple(f"-march={march}" if f == "-march=native" else f for f in v)
        for v in base
        if "-mcpu=native" not in v  # the arm64 fallback does not apply to a named x86 level
    )


_SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
)
BUILD_TIMEOUT_S = 120.0


def find_cc() -> str | None:
    """The C compiler to use: ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on PATH."""
    return (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    )


def cpu_flags() -> str:
    """This CPU's feature-flags line of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on arm64;
    the platform's processor and machine names where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _private_dir(path: Path) -> bool:
    """True when ``path`` exists or was created, belongs to us and no one else can write to it
    (a shared library is only ever loaded from such a directory)."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError:
        return False
    return (
        os.access(path, os.W_OK)
        and (not hasattr(os, "getuid") or st.st_uid == os.getuid())
        and not st.st_mode & 0o022
    )


def cache_dir() -> Path:
    """``$POSTRL_CACHE_DIR/kernels`` (default ``~/.cache/postrl/kernels``); if that is not a private
    writable directory, a per-user one under the temp dir, else a fresh ``mkdtemp``."""
    root = os.environ.get("POSTRL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "postrl"
    )
    for cand in (
        Path(root) / "kernels",
        Path(tempfile.gettempdir())
        / f"postrl-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}",
    ):
        if _private_dir(cand):
            return cand
    return Path(tempfile.mkdtemp(prefix="postrl-kernels-"))


def _sanitize() -> bool:
    return os.environ.get("POSTRL_KERNEL_SANITIZE", "0") == "1"


def _flags() -> list[str]:
    return [*_FLAGS, f"-I{HERE}", *(_SANITIZE_FLAGS if _sanitize() else ())]


def sanitizer_preload(cc: str | None = None) -> str | None:
    """Path of the compiler's ASan runtime (``libasan.so``) to put in ``LD_PRELOAD`` for a
    sanitized build (``POSTRL_KERNEL_SANITIZE=1``); None when the compiler has none."""
    cc = cc or find_cc()
    if cc is None:
        return None
    try:
        res = subprocess.run(
            [cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = res.stdout.strip()
    return path if res.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _asan_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libomp", "libiomp")
    return {ln.split()[-1] for ln in maps.splitlines() if any(n in ln.split()[-1] for n in names)}


def _compile(cc: str, src: Path, out: Path, variants: tuple[tuple[str, ...], ...]) -> None:
    """Build ``out`` from ``src`` with the first flag variant that compiles."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    errors = []
    try:
        for extra in variants:
            res = subprocess.run(
                [cc, *_flags(), *extra, str(src), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if res.returncode == 0:
                os.replace(tmp, out)  # atomic: a concurrent builder's identical file is replaced
                out.with_suffix(".flags").write_text(
                    " ".join([*extra, *(_SANITIZE_FLAGS if _sanitize() else ())])
                )
                return
            err = res.stderr.strip()[-400:]
            errors.append(f"{cc} {' '.join(extra)} failed (exit {res.returncode}): {err}")
        raise RuntimeError("; ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load(
    cc: str, src: Path, prefix: str, variants: tuple[tuple[str, ...], ...]
) -> tuple[ctypes.CDLL, Path, str]:
    headers = "\n".join(p.read_text() for p in sorted(HERE.glob("*.h")))
    key = hashlib.sha256(
        "\n".join(
            [src.read_text(), headers, cc, " ".join(_flags()), repr(variants), cpu_flags()]
        ).encode()
    )
    if _sanitize() and not _asan_loaded():
        raise RuntimeError(
            "POSTRL_KERNEL_SANITIZE=1 needs the ASan runtime loaded first: start Python with "
            f"LD_PRELOAD={sanitizer_preload(cc) or '<libasan.so>'} ASAN_OPTIONS=detect_leaks=0"
        )
    path = cache_dir() / f"{prefix}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        logger.info("compiling fused CPU kernels %s -> %s", src.name, path)
        _compile(cc, src, path, variants)
    flags = path.with_suffix(".flags").read_text() if path.with_suffix(".flags").exists() else "?"
    return ctypes.CDLL(str(path)), path, flags


def load_library(cc: str, src: Path, prefix: str) -> tuple[ctypes.CDLL, Path, str]:
    """Build (once per machine and source) and load ``src``: ``(library, its path, the flag
    variant used)``. Raises ``OSError``, ``RuntimeError`` or ``subprocess.TimeoutExpired`` when it
    cannot; the caller reports that and falls back."""
    before = openmp_runtimes()
    out = _build_and_load(cc, src, prefix, variants())
    if len(openmp_runtimes()) > max(1, len(before)):
        logger.warning(
            "fused CPU kernels %s: their OpenMP runtime is not torch's (%s); using the "
            "single-threaded build",
            src.name,
            sorted(openmp_runtimes() - before),
        )
        out = _build_and_load(cc, src, prefix, variants(_SERIAL))
    return out


class Once(Generic[T]):
    """A kernel library built and loaded at most once per process: :meth:`load` returns
    ``wrap(library, path, flags)``, or None with the reason in :attr:`error` (logged once as a
    warning naming ``what`` and the fallback) — ``POSTRL_KERNELS=0``, no compiler, a failed
    build. Thread-safe."""

    def __init__(self, src: Path, prefix: str, wrap: Callable[..., T], what: str) -> None:
        self.src, self.prefix, self.wrap, self.what = src, prefix, wrap, what
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget the outcome (the next :meth:`load` tries again)."""
        self._tried, self._value, self.error = False, None, None

    def load(self) -> T | None:
        """The loaded library (built on first use), or None when unavailable."""
        with self._lock:
            if self._tried:
                return self._value
            self._tried = True
            if os.environ.get("POSTRL_KERNELS", "1") == "0":
                self.error = "disabled by POSTRL_KERNELS=0"
                return None
            cc = find_cc()
            if cc is None:
                self.error = "no C compiler found (cc, gcc or clang); install one or set CC"
            else:
                try:
                    self._value = self.wrap(*load_library(cc, self.src, self.prefix))
                except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                    self.error = f"{type(e).__name__}: {e}"
            if self._value is None:
                logger.warning("%s unavailable (%s); using torch ops", self.what, self.error)
            return self._value
