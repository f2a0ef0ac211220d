"""Run untrusted Python (a model-written program) in a sandbox and collect what it printed.

``run_python`` starts the program as ``sys.executable -I main.py`` through a small trusted launcher
(``_launcher.py``) under one of three isolation modes; see ``roll.sandbox`` for what each guarantees.
"""

from __future__ import annotations

import errno
import logging
import marshal
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The launcher is standard-library code that also runs, compiled from its file, inside the sandbox;
# importing it here has no side effects.
from roll.sandbox._launcher import children_of

logger = logging.getLogger(__name__)

ISOLATIONS = ("auto", "bwrap", "unshare", "none")

# Where the program runs in the namespaced modes: a fresh tmpfs inside an empty, read-only /tmp.
SANDBOX_WORKDIR = "/tmp/sandbox"
MAIN_FILE = "main.py"

_PATH = "/usr/local/bin:/usr/bin:/bin"
# Directories hidden under an empty read-only tmpfs in the namespaced modes: they hold other users' and
# other runs' files and, above all, unix sockets (Ray's, Docker's, D-Bus's): a read-only mount does not
# stop connect() on a socket file, and a network namespace does not cover path-named sockets.
_HIDDEN = ("/tmp", "/var/tmp", "/run")
# A root caller's program runs under a throwaway uid from this range (one per run, chosen at random),
# far above the uids of real and subordinate users.
_SANDBOX_UID_BASE = 1 << 30
_SANDBOX_UID_SPAN = 1 << 24
_WORKSPACE_INODES = 4096
_READ_CHUNK = 1 << 16
_LAUNCHER_GRACE_S = 2.0  # the launcher's own deadline trails ours: it only matters if we died
_KILL_WAIT_S = 5.0

_LAUNCHER_PATH = Path(__file__).with_name("_launcher.py")
# Reads (code, spec) from the spec descriptor and runs the launcher's main(spec, status fd).
_BOOTSTRAP = (
    "import marshal, os, sys\n"
    "with os.fdopen(int(sys.argv[1]), 'rb') as f:\n"
    "    code, spec = marshal.load(f)\n"
    "scope = {'__name__': 'roll_sandbox_launcher'}\n"
    "exec(code, scope)\n"
    "scope['main'](spec, int(sys.argv[2]))\n"
)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        timeout_s: wall-clock seconds from start to kill; the whole process tree is killed after it.
        cpu_s: CPU seconds (``RLIMIT_CPU``): SIGXCPU at the limit, SIGKILL one second later.
        memory_mb: address space in MiB (``RLIMIT_AS``); allocations past it raise ``MemoryError``.
        max_processes: ``RLIMIT_NPROC``. In the namespaced modes it counts only this run's processes
            (its own user namespace, or a throwaway uid when the caller is root); in isolation "none" it
            counts every process of the caller's uid, and the kernel ignores it for root.
        max_file_mb: largest file the program may write, in MiB (``RLIMIT_FSIZE``).
        max_open_files: open file descriptors (``RLIMIT_NOFILE``).
        max_output_bytes: stdout and stderr are each kept up to this many bytes; the program is killed
            as soon as either passes it (``output_truncated`` is then set).
        disk_mb: size in MiB of the work directory (a tmpfs) in the namespaced modes, bounding the total
            the program can write across files; isolation "none" has only ``max_file_mb`` per file.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        stdout: the program's standard output (decoded as UTF-8, undecodable bytes replaced), at most
            ``max_output_bytes`` of it.
        stderr: the same for standard error.
        exit_code: the program's exit status; ``None`` when a signal ended it (see ``signal``), when it
            timed out, or when it never started (see ``error``).
        timed_out: it was still running at ``timeout_s`` and was killed.
        output_truncated: stdout or stderr passed ``max_output_bytes``; it was killed then.
        duration_s: wall-clock seconds from start until every process of the run was gone.
        signal: number of the signal that ended the program, if one did.
        isolation: the isolation mode it ran under.
        error: why the sandbox itself failed (set-up, wrapper), ``None`` when the program ran. Such a run
            says nothing about the program.
        leftover_processes: processes the program left running when it ended (all were killed).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    duration_s: float
    signal: int | None = None
    isolation: str = ""
    error: str | None = None
    leftover_processes: int = 0

    @property
    def ok(self) -> bool:
        """The program ran and exited with status 0 before the timeout."""
        return self.exit_code == 0 and not self.timed_out and self.error is None


class SandboxUnavailable(RuntimeError):
    """No isolation of the requested kind works on this machine."""


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    isolation: str = "auto",
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``python -I main.py`` in a fresh sandbox and wait for it (at most ``timeout_s``).

    Args:
        code: the program's source.
        stdin: text fed to its standard input (then closed).
        limits: resource limits; ``SandboxLimits()`` when ``None``.
        isolation: "auto", "bwrap", "unshare" or "none" (see ``resolve_isolation``).
        files: extra files (name -> text) written next to ``main.py`` in the work directory. Names are
            plain file names. To import one, the program must put "." on ``sys.path`` (``-I`` leaves
            the script's directory out).

    Returns:
        A ``SandboxResult``. A failing, crashing, hanging or hostile program is a normal result (check
        ``ok``); when it returns, no process of the run is left (but see isolation "none").

    Raises:
        ValueError: unknown isolation, or a bad file name.
        SandboxUnavailable: the requested isolation does not work here.
    """
    limits = limits or SandboxLimits()
    mode = resolve_isolation(isolation)
    all_files = {MAIN_FILE: code}
    for name, text in (files or {}).items():
        if not name or name in (".", "..") or "/" in name or "\0" in name or name == MAIN_FILE:
            raise ValueError(f"bad sandbox file name {name!r}: use a plain file name other than {MAIN_FILE}")
        all_files[name] = text
    return _run(all_files, stdin, limits, mode)


def resolve_isolation(isolation: str = "auto") -> str:
    """The isolation mode ``isolation`` stands for on this machine: "bwrap", "unshare" or "none".

    "auto" is bwrap when it is installed and works, else unshare when it works, else an error: running
    without isolation must be asked for by name. Whether a mode works is found out once per process
    (by running a trivial program in it) and remembered.

    Raises:
        ValueError: ``isolation`` is not one of "auto", "bwrap", "unshare", "none".
        SandboxUnavailable: the mode asked for (any, for "auto") does not work here.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"unknown sandbox isolation {isolation!r}; choose one of {', '.join(ISOLATIONS)}")
    if isolation == "none":
        _log_once(
            "none",
            logging.WARNING,
            "sandbox isolation 'none': untrusted programs run without namespaces, only with rlimits, "
            "a private directory, a scrubbed environment and a process-group kill; they can read your "
            "files, use the network and signal your processes",
        )
        return "none"
    candidates = ("bwrap", "unshare") if isolation == "auto" else (isolation,)
    reasons = []
    for mode in candidates:
        works, reason = _probe(mode)
        if works:
            _log_once(mode, logging.INFO, f"sandbox isolation: {mode} ({_DESCRIPTIONS[mode]})")
            return mode
        reasons.append(f"{mode}: {reason}")
    hint = (
        "Install bubblewrap or allow unprivileged user namespaces, or set isolation='none' explicitly to "
        "run untrusted code without namespace isolation (rlimits only)."
    )
    raise SandboxUnavailable(
        f"sandbox isolation '{isolation}' is not available here ({'; '.join(reasons)}). {hint}"
    )


_DESCRIPTIONS = {
    mode: f"{mode}: mount, pid, network, IPC and UTS namespaces (and a user namespace unless root), "
    "read-only filesystem, private tmpfs work dir, no capabilities"
    for mode in ("bwrap", "unshare")
}

_state_lock = threading.Lock()
_probed: dict[str, tuple[bool, str]] = {}
_logged: set[str] = set()


def _log_once(key: str, level: int, message: str) -> None:
    with _state_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, message)


def _probe(mode: str) -> tuple[bool, str]:
    """(works, why not): runs a trivial program under ``mode`` the first time it is asked."""
    with _state_lock:
        if mode in _probed:
            return _probed[mode]
    if shutil.which(mode) is None:
        outcome = (False, f"the {mode} command is not installed")
    else:
        try:
            result = _run({MAIN_FILE: "print('sandbox ok')\n"}, "", SandboxLimits(timeout_s=20.0), mode)
        except OSError as exc:
            outcome = (False, str(exc))
        else:
            if result.ok and result.stdout == "sandbox ok\n":
                outcome = (True, "")
            else:
                detail = result.error or f"exit code {result.exit_code}, stderr: {result.stderr[-500:]!r}"
                outcome = (False, detail)
    if not outcome[0]:
        logger.info("sandbox isolation %s does not work here: %s", mode, outcome[1])
    with _state_lock:
        _probed.setdefault(mode, outcome)
        return _probed[mode]


# ------------------------------------------------------------------------------------------ set-up


@lru_cache(maxsize=1)
def _site_dirs() -> tuple[str, ...]:
    """The interpreter's site-packages, which the program's ``python -S`` would not add itself."""
    import site

    return tuple(p for p in site.getsitepackages() if os.path.isdir(p))


def _interpreter_paths() -> tuple[str, ...]:
    """Directories the sandboxed interpreter needs (prefixes, the executable's directory), outermost
    only; re-exposed read-only when they lie under a hidden directory."""
    candidates = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    paths = sorted({os.path.realpath(p) for p in candidates if p and os.path.isdir(p)})
    return tuple(p for p in paths if not any(_inside(p, q) for q in paths if q != p))


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@lru_cache(maxsize=2)
def _hidden_dirs(other_uid: bool) -> tuple[str, ...]:
    """Directories to hide in the namespaced modes: the fixed list, the caller's home, and (when the
    program runs under another uid) the first non-world-searchable ancestor of each interpreter path,
    which would otherwise stop that uid from reaching the interpreter."""
    hidden = list(_HIDDEN)
    home = os.path.realpath(os.path.expanduser("~"))
    if home != "/" and os.path.isdir(home):
        hidden.append(home)
    if other_uid:
        for path in _interpreter_paths():
            parts = Path(path).parts
            for depth in range(2, len(parts)):
                ancestor = str(Path(*parts[:depth]))
                if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                    hidden.append(ancestor)
                    break
    unique = sorted(set(hidden))
    return tuple(p for p in unique if not any(_inside(p, q) for q in unique if q != p))


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    memory, file_size = int(limits.memory_mb * (1 << 20)), int(limits.max_file_mb * (1 << 20))
    cpu = max(1, int(limits.cpu_s))
    return [
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        ("RLIMIT_NPROC", int(limits.max_processes), int(limits.max_processes)),
        ("RLIMIT_FSIZE", file_size, file_size),
        ("RLIMIT_NOFILE", int(limits.max_open_files), int(limits.max_open_files)),
        ("RLIMIT_CORE", 0, 0),
    ]


def _wrapper_argv(mode: str, root: bool, limits: SandboxLimits) -> list[str]:
    """The namespace tool's command line, up to (not including) the launcher."""
    if mode == "none":
        return []
    tool = shutil.which(mode)
    if tool is None:
        raise OSError(errno.ENOENT, f"the {mode} command is not installed")
    if mode == "unshare":
        # A root caller needs no user namespace to mount; an unprivileged one gets its capabilities in
        # one, as uid 0 there, and the launcher drops them all before the program starts.
        argv = [tool] if root else [tool, "--user", "--map-root-user"]
        argv += ["--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--propagation", "private"]
        return argv + ["--fork", "--kill-child", "--mount-proc", "--"]
    argv = [tool, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net"]
    argv += ["--unshare-uts", "--unshare-cgroup-try"]
    if root:
        # Privileged bwrap keeps uid 0 and every capability unless told. The launcher needs these: two
        # to move the program to a throwaway uid (which leaves it none), one to kill what it leaves.
        argv += ["--cap-drop", "ALL"]
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL"):
            argv += ["--cap-add", cap]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    hidden = _hidden_dirs(root)
    for path in hidden:
        if os.path.isdir(path) and not os.path.islink(path):
            argv += ["--tmpfs", path]
            for keep in _interpreter_paths():
                if _inside(keep, path):
                    # bwrap would create the directories on the way as 0700.
                    parts = Path(keep).relative_to(path).parts
                    for depth in range(1, len(parts)):
                        argv += ["--perms", "0755", "--dir", str(Path(path, *parts[:depth]))]
                    argv += ["--ro-bind", keep, keep]
    size = str(max(1, int(limits.disk_mb)) << 20)
    argv += ["--perms", "1777" if root else "0700", "--size", size, "--tmpfs", SANDBOX_WORKDIR]
    for path in hidden:
        if os.path.isdir(path) and not os.path.islink(path):
            argv += ["--remount-ro", path]
    return argv + ["--remount-ro", "/dev", "--chdir", SANDBOX_WORKDIR, "--"]


# ------------------------------------------------------------------------------------------ running


def _run(files: dict[str, str], stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    root = os.geteuid() == 0
    namespaced = mode != "none"
    private_dir = None if namespaced else tempfile.mkdtemp(prefix="roll-sandbox-")
    workdir = SANDBOX_WORKDIR if namespaced else private_dir
    env = {"PATH": _PATH, "HOME": workdir, "LANG": "C.UTF-8"}
    other_uid = root and namespaced
    spec = {
        "setup_mounts": mode == "unshare",
        "workdir": workdir,
        "workspace_mb": max(1, int(limits.disk_mb)),
        "workspace_inodes": _WORKSPACE_INODES,
        "hide": list(_hidden_dirs(other_uid)),
        "keep": list(_interpreter_paths()),
        "uid": _SANDBOX_UID_BASE + secrets.randbelow(_SANDBOX_UID_SPAN) if other_uid else None,
        "new_session": namespaced,
        "rlimits": _rlimits(limits),
        "python": sys.executable,
        "site_dirs": list(_site_dirs()),
        "main": MAIN_FILE,
        "env": env,
        "files": files,
        "deadline_s": limits.timeout_s + _LAUNCHER_GRACE_S,
    }
    try:
        return _execute(_wrapper_argv(mode, root, limits), spec, stdin, limits, mode)
    finally:
        if private_dir is not None:
            _remove_tree(private_dir)


@lru_cache(maxsize=1)
def _launcher_code() -> types.CodeType:
    return compile(_LAUNCHER_PATH.read_text(encoding="utf-8"), str(_LAUNCHER_PATH), "exec")


class _Capture:
    """One output stream, kept up to ``cap`` bytes; the rest is counted and dropped. Passing the cap
    gets the run killed when ``kills``."""

    def __init__(self, cap: int, kills: bool) -> None:
        self.cap = cap
        self.kills = kills
        self.data = bytearray()
        self.seen = 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    @property
    def truncated(self) -> bool:
        return self.seen > self.cap

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _execute(wrapper: list[str], spec: dict, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """Start wrapper + launcher and supervise them. The program gets pipes of its own (passed by
    number in the spec), so what the wrapper or the launcher print (``unshare: ...``) never mixes with
    the program's output: it goes to a separate ``diag`` pipe, used only to explain a failure."""
    stdin_bytes = stdin.encode()
    parent_ends: list[int] = []
    child_ends: list[int] = []
    try:
        spec_fd = os.memfd_create("roll-sandbox-spec")
        child_ends.append(spec_fd)
        pipes = {}
        for name in ("status", "diag", "stdout", "stderr") + (("stdin",) if stdin_bytes else ()):
            read_end, write_end = os.pipe()
            reader = name != "stdin"
            parent_ends.append(read_end if reader else write_end)
            child_ends.append(write_end if reader else read_end)
            pipes[name] = (parent_ends[-1], child_ends[-1])
        spec = dict(spec, fds={name: pipes[name][1] if name in pipes else None for name in _PROGRAM_FDS})
        os.write(spec_fd, marshal.dumps((_launcher_code(), spec)))
        os.lseek(spec_fd, 0, os.SEEK_SET)
        status_w, diag_w = pipes["status"][1], pipes["diag"][1]
        launcher = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(spec_fd), str(status_w)]
        start = time.monotonic()
        proc = subprocess.Popen(
            wrapper + launcher,
            stdin=subprocess.DEVNULL,
            stdout=diag_w,
            stderr=diag_w,
            env=spec["env"],
            cwd="/" if mode != "none" else spec["workdir"],
            start_new_session=True,
            pass_fds=tuple(fd for fd in child_ends if fd != diag_w),  # diag is its stdout and stderr
        )
    except BaseException:
        for fd in parent_ends:
            os.close(fd)
        raise
    finally:
        for fd in child_ends:
            os.close(fd)
    caps = {"stdout": limits.max_output_bytes, "stderr": limits.max_output_bytes, "diag": _DIAG_CAP}
    streams = {pipes[name][0]: _Capture(cap, name != "diag") for name, cap in caps.items()}
    stdin_w = pipes["stdin"][0] if stdin_bytes else None
    try:
        timed_out, killed, duration = _supervise(
            proc, streams, stdin_w, stdin_bytes, parent_ends, limits, mode != "none", start
        )
        records = _read_all(pipes["status"][0])
    except BaseException:
        # Interrupted (KeyboardInterrupt, a bug): the run must not outlive us.
        _kill(proc, mode != "none")
        _killpg(proc.pid)
        proc.wait()
        raise
    finally:
        for fd in parent_ends:
            os.close(fd)
    out, err, diag = (streams[pipes[name][0]] for name in ("stdout", "stderr", "diag"))
    return _result(proc, records, out, err, diag, timed_out, killed, duration, mode)


_PROGRAM_FDS = ("stdin", "stdout", "stderr")
_DIAG_CAP = 1 << 16


def _supervise(
    proc: subprocess.Popen,
    streams: dict[int, _Capture],
    stdin_w: int | None,
    stdin_bytes: bytes,
    open_fds: list[int],
    limits: SandboxLimits,
    namespaced: bool,
    start: float,
) -> tuple[bool, bool, float]:
    """Feed stdin, read the outputs, kill at the deadline or when the program's output passes its cap,
    and wait until the run's processes are gone. Returns (timed out, killed by us, duration).
    ``open_fds`` are the caller's descriptors to close; stdin's leaves it once closed here."""
    capped = [capture for capture in streams.values() if capture.kills]
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin_bytes)
    if stdin_w is not None:
        os.set_blocking(stdin_w, False)
        selector.register(stdin_w, selectors.EVENT_WRITE)
    try:
        exit_fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        exit_fd = None  # old kernel: poll instead
    if exit_fd is not None:
        selector.register(exit_fd, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    timed_out = killed = exited = False
    hard_deadline = None
    try:
        while not exited:
            now = time.monotonic()
            if not killed and now >= deadline:
                timed_out = True
            if not killed and (timed_out or any(capture.truncated for capture in capped)):
                _kill(proc, namespaced)
                killed = True
                hard_deadline = now + _KILL_WAIT_S
            if hard_deadline is not None and now >= hard_deadline:
                _killpg(proc.pid)
                break
            wait = (hard_deadline if killed else deadline) - now
            if exit_fd is None:
                wait = min(wait, 0.01)
            for key, _ in selector.select(max(wait, 0.0)):
                fd = key.fd
                if fd == exit_fd:
                    exited = True
                elif fd in streams:
                    if not _read_into(fd, streams[fd]):
                        selector.unregister(fd)
                else:
                    pending = _write_stdin(fd, pending)
                    if not pending:
                        selector.unregister(fd)
                        open_fds.remove(fd)
                        os.close(fd)  # end of file for the program
            if exit_fd is None and proc.poll() is not None:
                exited = True
        # The wrapper is gone but not yet reaped, so its pid (our process group id) cannot have been
        # reused: clear out whatever is left in the group (isolation "none"; nothing in the others).
        _killpg(proc.pid)
        proc.wait()
        duration = time.monotonic() - start
        if exit_fd is not None:
            selector.unregister(exit_fd)
        if stdin_w is not None and stdin_w in open_fds:
            selector.unregister(stdin_w)
        _drain(selector, streams, namespaced)
    finally:
        selector.close()
        if exit_fd is not None:
            os.close(exit_fd)
    return timed_out, killed and not timed_out, duration


def _read_into(fd: int, capture: _Capture) -> bool:
    """Read what is there; False at end of file."""
    try:
        chunk = os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return True
    if not chunk:
        return False
    capture.add(chunk)
    return True


def _write_stdin(fd: int, pending: memoryview) -> memoryview:
    try:
        written = os.write(fd, pending[:_READ_CHUNK])
    except BlockingIOError:
        return pending
    except (BrokenPipeError, OSError):
        return memoryview(b"")  # the program stopped reading
    return pending[written:]


def _drain(selector: selectors.BaseSelector, captures: dict[int, _Capture], namespaced: bool) -> None:
    """Read what the program wrote before it ended. In the namespaced modes every writer is dead, so
    the pipes reach end of file; in "none" a process that left the group may hold them, so stop when
    nothing more comes."""
    give_up = time.monotonic() + (1.0 if namespaced else 0.05)
    while selector.get_map() and time.monotonic() < give_up:
        ready = selector.select(max(give_up - time.monotonic(), 0.0))
        if not ready and not namespaced:
            break
        for key, _ in ready:
            if not _read_into(key.fd, captures[key.fd]):
                selector.unregister(key.fd)


def _kill(proc: subprocess.Popen, namespaced: bool) -> None:
    """Kill the run. Namespaced: SIGKILL the namespace's first process (the wrapper's child), which
    takes every process of the pid namespace with it before the wrapper can exit, so waiting for the
    wrapper waits for them all. Otherwise (or before that process exists): the process group."""
    victims = children_of(proc.pid) if namespaced else []
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not victims:
        _killpg(proc.pid)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _result(
    proc: subprocess.Popen,
    records: str,
    out: _Capture,
    err: _Capture,
    diag: _Capture,
    timed_out: bool,
    killed: bool,
    duration: float,
    mode: str,
) -> SandboxResult:
    started = False
    exit_code = sig = None
    error = None
    leftovers = 0
    for line in records.splitlines():
        kind, _, text = line.partition(" ")
        if kind == "R":
            started = True
        elif kind == "E" and error is None:
            error = text
        elif kind == "X":
            exit_code = int(text)
        elif kind == "S":
            sig = int(text)
        elif kind == "L":
            leftovers = int(text)
    if not started and error is None and not timed_out:
        error = f"the {mode} sandbox did not start (exit status {proc.returncode})"
    if error is not None and diag.text().strip():
        error += f"; it printed: {diag.text()[-2000:].strip()}"
    if timed_out or killed:
        exit_code, sig = None, signal.SIGKILL
    elif started and exit_code is None and sig is None and (proc.returncode or 0) < 0:
        sig = -proc.returncode  # the program killed its launcher; the run ended with it
    return SandboxResult(
        stdout=out.text(),
        stderr=err.text(),
        exit_code=exit_code if error is None else None,
        timed_out=timed_out,
        output_truncated=out.truncated or err.truncated,
        duration_s=duration,
        signal=sig,
        isolation=mode,
        error=error,
        leftover_processes=leftovers,
    )


def _remove_tree(path: str) -> None:
    """Remove the private directory, even where the program took away its own permissions."""

    def fix_and_retry(function, failed_path, _exc_info) -> None:  # noqa: ANN001
        parent = os.path.dirname(failed_path)
        try:
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, stat.S_IRWXU)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix_and_retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
