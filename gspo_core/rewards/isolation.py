"""How sandboxed user code is isolated on this host: bubblewrap namespaces, or (operator's choice) rlimits only.

``isolation_for(policy)`` probes once per process and interpreter (a real sandboxed child) and says which
mode is in force: ``bubblewrap`` (own user/mount/PID/network/IPC/UTS namespaces, a root holding only
read-only binds of the OS libraries and the grader environment, private size-capped tmpfs), ``weak``
(no bubblewrap here, but the operator allowed running anyway: rlimits, scrubbed environment, and as
root a throw-away uid and an empty network namespace) or ``refused``. ``command``/``preexec`` build
the child process the sandbox runs. See docs/rewards.md.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
BUBBLEWRAP, WEAK, REFUSED = "bubblewrap", "weak", "refused"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
CLONE_NEWNET = 0x40000000
SANDBOX_ID = 65534  # uid/gid inside the sandbox ("nobody")
UID_BASE = 200_000  # host uids of sandbox children when the service is root: far above system and login uids
SLOTS = 16  # throw-away uids per process (unique among live pids), so also children at once per process
SHM_MB = 16  # /dev/shm tmpfs (joblib, multiprocessing locks); counted in a child's memory reservation
#: What of the host's OS a sandbox sees (read-only): the C library, the OS's Python and shared libraries.
OS_DIRS = ("/usr/bin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/usr/share/zoneinfo")
TOP_DIRS = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
#: Environment of sandboxed code (all else is dropped): one BLAS/OpenMP thread keeps within the process cap.
SANDBOX_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call wall time, wall time of the module code (imports), address-space cap, process cap,
    file-size and open-file caps, and the size of the private /tmp (a tmpfs: memory)."""

    timeout_s: float = 2.0
    memory_mb: int = 512
    max_procs: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    tmp_mb: int = 64
    setup_s: float = 20.0
    niceness: int = 0

    @property
    def reserve_mb(self) -> int:
        """What one child holds of the process's sandbox memory budget."""
        return self.memory_mb + self.tmp_mb + SHM_MB


@dataclass(frozen=True)
class Isolation:
    """The mode in force for one interpreter (``reason`` says why not bubblewrap), and how to run it."""

    mode: str
    reason: str
    python: str
    bwrap: str | None = None
    binds: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """The reason without host details (paths, probe output): what tenants and /readyz are told."""
        return self.reason.split(":", 1)[0]


class _UidSlots:
    """Throw-away host uids, one per concurrently running child, unique to this process."""

    def __init__(self) -> None:
        self._free: queue.Queue[int] = queue.Queue()
        for k in range(SLOTS):
            self._free.put(UID_BASE + os.getpid() * SLOTS + k)

    def take(self) -> int:
        return self._free.get()

    def give(self, uid: int) -> None:
        self._free.put(uid)


_SLOTS: _UidSlots | None = None
_SLOTS_PID = 0
_CACHE: dict[tuple, Isolation] = {}
_LOCK = threading.Lock()


def uid_slots() -> _UidSlots:
    global _SLOTS, _SLOTS_PID
    if _SLOTS is None or os.getpid() != _SLOTS_PID:  # a forked worker gets its own range
        _SLOTS, _SLOTS_PID = _UidSlots(), os.getpid()
    return _SLOTS


def _has_uid(pid: int | str, uid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process with real uid ``uid`` (from /proc)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
    except (OSError, ValueError):
        return False
    return status.get("Uid", "").split()[:1] == [str(uid)] and not status.get("State", "").strip().startswith(
        ("Z", "X")
    )


def uid_pids(uid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _has_uid(p, uid)]


def kill_uid(uid: int) -> None:
    """SIGKILL every process of the throw-away ``uid`` (also what left the process group), through a
    pidfd re-checked after opening, so a recycled pid is never hit."""
    for _ in range(200):
        pids = uid_pids(uid)
        if not pids:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _has_uid(pid, uid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.005)


#: Where the sandbox mounts a fresh tmpfs of its own.
_FRESH_MOUNTS = ("/tmp/", "/dev/shm/")


def command(iso: Isolation, tmp_mb: int, argv: list[str]) -> list[str]:
    """The bwrap command line that runs ``argv`` (the interpreter first) in a fresh sandbox."""
    if iso.bwrap is None:
        raise ValueError(f"{iso.mode} isolation has no bubblewrap binary to run a sandbox with")
    cmd = [
        iso.bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        # No --new-session: `preexec` made the child a session of its own (no controlling terminal, so no
        # TIOCSTI), and the niced autogroup of that session must hold the sandboxed process too.
        "--uid",
        str(SANDBOX_ID),
        "--gid",
        str(SANDBOX_ID),
        "--hostname",
        "sandbox",
    ]
    for top in TOP_DIRS:
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    # A grader environment under /tmp or /dev/shm (a checkout in /tmp) is bound after the sandbox's own
    # tmpfs there, which would hide it if bound before.
    late = [p for p in iso.binds if p.startswith(_FRESH_MOUNTS)]
    for path in iso.binds:
        if path not in late:
            cmd += ["--ro-bind", path, path]
    cmd += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(SHM_MB << 20),
        "--tmpfs",
        "/dev/shm",
        "--perms",
        "1777",
        "--size",
        str(tmp_mb << 20),
        "--tmpfs",
        "/tmp",
    ]
    for path in late:
        cmd += ["--ro-bind", path, path]
    cmd += [
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--clearenv",
    ]
    for key, value in SANDBOX_ENV.items():
        cmd += ["--setenv", key, value]
    return [*cmd, "--", *argv]


def lower_priority(niceness: int) -> None:
    """This process below the others by ``niceness``, in a session of its own too: Linux's autogroups
    (`sched_autogroup_enabled`) give each session an equal share of the CPU whatever its processes' nice
    values, so the session's autogroup is niced as well (``/proc/self/autogroup``, man 7 sched). Without
    it, every grader process in a session of its own competed with the API as an equal."""
    if niceness <= 0:
        return
    os.nice(niceness)
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(niceness))
    except OSError:  # no autogroups in this kernel, or a write refused: the nice value is all there is
        pass


def preexec(iso: Isolation, limits, n_tasks: int, uid: int | None):
    """What the child does before exec: its own session (the runner nices it: sandbox.preimports), rlimits,
    and (the service being root) the throw-away host ``uid`` for bwrap, or in weak mode an empty network
    namespace."""

    def setup() -> None:
        os.setsid()  # its own autogroup, which the runner nices once the environment's packages are imported
        cpu = int(limits.setup_s + limits.timeout_s * n_tasks) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = limits.max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if iso.mode == BUBBLEWRAP and uid is not None:
            procs = limits.max_procs + 3  # bwrap's two processes and the interpreter
            resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        elif iso.mode == WEAK and IS_ROOT:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)  # no network (best effort)

    return setup


def isolation_for(policy) -> Isolation:
    """The isolation in force for ``policy``'s interpreter and bwrap, probed once per process."""
    key = (policy.python or sys.executable, policy.bwrap, bool(policy.allow_weak_isolation))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = iso = _probe(*key)
            if iso.mode != BUBBLEWRAP:
                log.warning("python graders of %s: %s isolation (%s)", key[0], iso.mode, iso.reason)
        return _CACHE[key]


def _probe(python: str, bwrap_name: str, allow_weak: bool) -> Isolation:
    # The environment's directory resolved (a `.venv-graders` link to where the install step built it, see
    # scripts/grader-env.sh), the interpreter's own link kept: it is what makes that directory the prefix.
    python = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(python))), os.path.basename(python))
    iso, why = _probe_bwrap(python, bwrap_name)
    if iso is not None:
        return iso
    return Isolation(WEAK if allow_weak else REFUSED, why, python)


def _interpreter_dirs(python: str) -> tuple[list[str] | None, str]:
    """The prefixes of ``python`` (venv and base), asked of the interpreter itself."""
    code = (
        "import sys, json; "
        "print(json.dumps(sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})))"
    )
    try:
        out = subprocess.run(
            [python, "-I", "-c", code], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
        )
        dirs = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return None, f"the grader environment does not run: {python}: {exc}"
    if not dirs:
        return None, f"the grader environment does not run: {python}: {out.stderr.strip()[-300:]}"
    if "/" in dirs:
        return None, f"the grader environment has no directory of its own: {python} has / as its prefix"
    return dirs, ""


def _private_dir(paths: tuple[str, ...]) -> str | None:
    """The first directory on the way to ``paths`` that other users cannot pass through (no o+x): as root
    the sandbox starts bwrap under a throw-away uid, which cannot reach what lies below it."""
    for path in paths:
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            d = "/" + "/".join(parts[:depth])
            try:
                if not os.stat(d).st_mode & 0o001:
                    return d
            except OSError:
                return d
    return None


def _binds(prefixes: list[str]) -> tuple[str, ...]:
    out = [d for d in OS_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    for p in sorted(os.path.realpath(p) for p in prefixes):
        # The OS's own Python (prefix /usr) is inside OS_DIRS; binding /usr would add /usr/local.
        if p != "/usr" and not any(p == d or p.startswith(d + "/") for d in out):
            out.append(p)
    return tuple(out)


PROBE = r"""
import ast, dataclasses, datetime, glob, json, os, socket, sys
print(json.dumps({"uid": os.getuid(), "root": sorted(os.listdir("/")),
                  "pids": [p for p in os.listdir("/proc") if p.isdigit()],
                  "ifaces": [n for _, n in socket.if_nameindex()]}))
"""


def _probe_bwrap(python: str, bwrap_name: str) -> tuple[Isolation | None, str]:
    """A real sandboxed child: it must start, run as an unprivileged uid, see no network interface but
    loopback, only its own processes and only the bound directories."""
    bwrap = shutil.which(bwrap_name)
    if bwrap is None:
        return None, f"bubblewrap is not installed: {bwrap_name!r} not found"
    prefixes, why = _interpreter_dirs(python)
    if prefixes is None:
        return None, why
    iso = Isolation(BUBBLEWRAP, "", python, bwrap, _binds(prefixes))
    private = _private_dir(iso.binds) if IS_ROOT else None
    if private is not None:
        return None, (
            f"the grader environment is in a private directory: {private} (of {python}) does not let the "
            "sandbox's unprivileged uid through; build it where every uid can read it (`make install` does, "
            "see docs/rewards.md)"
        )
    limits = SandboxLimits(timeout_s=30.0, memory_mb=1024)
    uid = uid_slots().take() if IS_ROOT else None
    try:
        out = subprocess.run(
            command(iso, 8, [python, "-I", "-B", "-c", PROBE]),
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=preexec(iso, limits, 1, uid),
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"bubblewrap did not start: {exc}"
    finally:
        if uid is not None:
            kill_uid(uid)
            uid_slots().give(uid)
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip())[-300:]
        return None, (
            f"bubblewrap cannot isolate here: {said} (it needs user namespaces, and the sandbox's "
            "unprivileged uid must be able to read the grader environment)"
        )
    try:
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, f"bubblewrap cannot isolate here: the probe printed no report: {out.stdout[-200:]}"
    visible = {b.strip("/").split("/")[0] for b in (*iso.binds, *TOP_DIRS)} | {"proc", "dev", "tmp"}
    if seen["uid"] == 0 or set(seen["ifaces"]) - {"lo"} or set(seen["root"]) - visible or len(seen["pids"]) > 3:
        return None, f"bubblewrap cannot isolate here: the probe saw {seen}"
    return iso, ""
