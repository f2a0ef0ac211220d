"""The trusted first process of a sandbox: it prepares the sandbox, then starts the untrusted program.

``roll.sandbox.runner`` compiles this file once and starts it as ``python -I -S -c BOOTSTRAP SPEC_FD
STATUS_FD`` inside the namespaces that ``unshare`` or ``bwrap`` created (or with no namespaces in
isolation "none"); the bootstrap reads ``(code, spec)`` in ``marshal`` format from ``SPEC_FD`` (no
source to compile, no ``json`` to import: both would add to every run's start-up) and calls
``main(spec, STATUS_FD)``. This file must therefore stay standard-library only and import nothing from
``roll``. The spec is a dict that also names the descriptors of the program's stdin, stdout and stderr
pipes (the launcher's own output, and the namespace tool's, go elsewhere). The launcher reports on
``STATUS_FD``, one record a line:

    R            set-up done, the program is about to start
    E <message>  set-up failed; the program did not run
    X <code>     the program exited with <code>
    S <signal>   the program was killed by <signal>
    L <count>    processes still running when the program ended (all killed)

In isolation "unshare" the launcher is pid 1 of a new pid namespace and holds every capability of a new
mount namespace (of a new user namespace too when the caller is not root). With those it hides directories
that hold secrets or sockets (``/tmp``, ``/run``, the caller's home, ...) under empty tmpfs, gives the
program a fresh size-limited tmpfs as its only writable directory and a minimal ``/dev``, and remounts
everything else read-only. Only then does it fork the program, which before ``execve`` starts a new
session, gives up every capability (or switches to a throwaway uid when the caller is root), sets the
rlimits, and writes its files into the work directory.

The launcher stays as the program's parent and a child subreaper: when the program ends, every process
it left behind is killed, and it gives up waiting at ``deadline_s`` (a backstop for a caller that died).
"""

import _signal as signal  # the C module: "signal" would import enum and re, a third of our start-up
import ctypes
import errno
import os
import resource
import time

# mount(2) flags (linux/mount.h).
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

# prctl(2) options and securebits (linux/prctl.h, linux/securebits.h).
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECBIT_NOROOT = 1 << 0
SECBIT_NOROOT_LOCKED = 1 << 1
SECBIT_KEEP_CAPS_LOCKED = 1 << 5
SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 1 << 7
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Mount flags that a remount inside a user namespace must repeat (the kernel locks them), read back
# with statvfs.
PRESERVED_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be prepared as the spec asks; the program must not run."""

    def __init__(self, message, code=0):
        super().__init__(message)
        self.errno = code


def report(fd, kind, text=""):
    line = f"{kind} {text}".rstrip().replace("\n", " ") + "\n"
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    except OSError:
        pass


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}", err)


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    fn = _libc.prctl
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return fn(option, arg2, arg3, arg4, arg5)


def mount(source, target, fstype, flags, data=None):
    fn = _libc.mount
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def enc(value):
        return None if value is None else os.fsencode(value)

    check(fn(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def mount_points():
    """Mount points listed in /proc/self/mountinfo, decoded (the kernel escapes blanks as octal)."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            field = line.split(b" ")[4]
            points.append(os.fsdecode(field.decode("unicode_escape").encode("latin-1")))
    return points


def bind_fd(fd, target):
    # /proc/self/fd/N names the object the descriptor holds, even once its path is hidden by a mount.
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def setup_mounts(spec):
    """Hide, re-expose, mount the work dir and /dev, then make every other mount read-only."""
    # Never let a mount made here propagate back to the caller's namespace.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    workdir = spec["workdir"]
    keep_fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in spec["keep"]}
    dev_fds = {}
    for name in DEVICES:
        dev_fds[name] = os.open(f"/dev/{name}", os.O_PATH)

    for hidden in spec["hide"]:
        if os.path.islink(hidden) or not os.path.isdir(hidden):
            continue
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
        for path, fd in keep_fds.items():
            if path == hidden or path.startswith(hidden.rstrip("/") + "/"):
                os.makedirs(path, mode=0o755, exist_ok=True)
                bind_fd(fd, path)

    uid_opts = f",uid={spec['uid']},gid={spec['uid']}" if spec["uid"] is not None else ""
    os.makedirs(workdir, mode=0o755, exist_ok=True)
    size = f"size={spec['workspace_mb']}m,nr_inodes={spec['workspace_inodes']},mode=0700{uid_opts}"
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, size)

    # A fresh /dev with a few harmless devices: the host's /dev has disks and other nodes that are
    # open to whoever owns them, and a read-only mount does not stop writes to a device.
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name, fd in dev_fds.items():
        open(f"/dev/{name}", "wb").close()
        bind_fd(fd, f"/dev/{name}")
        os.close(fd)
    os.mkdir("/dev/shm", 0o755)
    os.symlink("/proc/self/fd", "/dev/fd")
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{number}", f"/dev/{name}")
    for fd in keep_fds.values():
        os.close(fd)

    for point in dict.fromkeys(mount_points()):
        if point == workdir or not os.path.lexists(point):
            continue
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue  # not reachable from here (hidden under another mount): not from the program either
        if flags & os.ST_RDONLY:
            continue
        extra = 0
        for st_flag, ms_flag in PRESERVED_FLAGS:
            if flags & st_flag:
                extra |= ms_flag
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
        except SetupError as exc:
            # EINVAL: the path no longer names that mount (a mount made here covers it); the check
            # below looks at what the path does name now.
            if exc.errno != errno.EINVAL:
                raise

    # Fail closed: every mount the program can reach, other than its work dir, must be read-only now.
    for point in dict.fromkeys(mount_points()):
        if point == workdir or not os.path.lexists(point):
            continue
        try:
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:
            continue
        if writable:
            raise SetupError(f"{point} is still writable after remounting read-only")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def capability_masks():
    masks = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "CapInh:")):
                key, value = line.split(":")
                masks[key] = int(value, 16)
    return masks


def drop_capabilities():
    """Leave the process no capability now and none to regain at execve, even as uid 0 of a user
    namespace (the bounding set is emptied and the securebits stop root from regaining them)."""
    if capability_masks()["CapEff"]:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            prctl(PR_CAPBSET_DROP, cap)
        bits = (
            SECBIT_NOROOT
            | SECBIT_NOROOT_LOCKED
            | SECBIT_KEEP_CAPS_LOCKED
            | SECBIT_NO_CAP_AMBIENT_RAISE
            | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED
        )
        check(prctl(PR_SET_SECUREBITS, bits), "set securebits")
    clear_capabilities()


def clear_capabilities():
    """Empty the effective, permitted, inheritable and ambient sets (lowering needs no privilege)."""
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    check(_libc.capset(ctypes.byref(header), data), "capset")
    masks = capability_masks()
    if masks["CapEff"] or masks["CapPrm"] or masks["CapAmb"] or masks["CapInh"]:
        raise SetupError(f"capabilities left after dropping them: {masks}")
    if os.getuid() == 0 and masks["CapBnd"]:
        raise SetupError("uid 0 with a non-empty capability bounding set would regain capabilities")


def set_limits(limits):
    for name, soft, hard in limits:
        resource.setrlimit(getattr(resource, name), (soft, hard))


# How the program starts: ``python -I -S`` (no ``site``: its .pth processing costs a fresh interpreter
# more than everything else does) with the site-packages directories put on sys.path by hand, then the
# program's file run as ``__main__``. A syntax error is reported the way ``python main.py`` reports it,
# without a traceback header (the code reward reads that as "does not compile").
PROGRAM_BOOT = """\
import sys
sys.path.extend({site_dirs!r})
sys.argv = [{main!r}]
with open({main!r}, encoding="utf-8") as _f:
    _source = _f.read()
try:
    _code = compile(_source, {main!r}, "exec")
except SyntaxError as _e:
    import traceback
    sys.stderr.write("".join(traceback.format_exception_only(type(_e), _e)))
    raise SystemExit(1) from None
__file__ = {main!r}
del _f, _source
exec(_code)
"""


def start_program(spec, status_fd):
    """In the forked child: drop privileges, apply limits, write the files, become the program."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        stdin_fd = spec["fds"]["stdin"]
        if stdin_fd is None:
            stdin_fd = os.open("/dev/null", os.O_RDONLY)
        for target, fd in enumerate((stdin_fd, spec["fds"]["stdout"], spec["fds"]["stderr"])):
            os.dup2(fd, target)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if spec["new_session"]:
            os.setsid()
        if spec["uid"] is not None:
            # Root caller: a throwaway uid of its own has no privileges, and RLIMIT_NPROC counts only
            # this sandbox's processes (the kernel ignores that limit for uid 0).
            set_limits(spec["rlimits"])
            os.setgroups([])
            os.setresgid(spec["uid"], spec["uid"], spec["uid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
            clear_capabilities()
        else:
            drop_capabilities()
            set_limits(spec["rlimits"])
        check(prctl(PR_SET_NO_NEW_PRIVS, 1), "set no_new_privs")
        os.chdir(spec["workdir"])
        for name, text in spec["files"].items():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        python = spec["python"]
        boot = PROGRAM_BOOT.format(site_dirs=spec["site_dirs"], main=spec["main"])
        os.execve(python, [python, "-I", "-S", "-c", boot], spec["env"])
    except BaseException as exc:  # noqa: BLE001  (any failure here is a set-up failure)
        report(status_fd, "E", f"could not start the program: {type(exc).__name__}: {exc}")
    os._exit(127)


def children_of(pid):
    """Pids whose parent is ``pid`` (scans /proc: not every kernel has /proc/PID/task/TID/children)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            found.append(int(name))
    return found


def kill_leftovers():
    """Kill every remaining descendant: as a subreaper, orphans are re-parented to us, so repeating
    "kill the children, reap" until none is left catches grandchildren that forked meanwhile."""
    killed = set()
    me = os.getpid()
    give_up = time.monotonic() + 5.0
    while time.monotonic() < give_up:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return len(killed)
        if pid:
            continue
        for child in children_of(me):
            killed.add(child)
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # gone already; or not ours to kill, which the namespace's end takes care of
        time.sleep(0.001)
    return len(killed)


def supervise(child, spec, status_fd):
    deadline = time.monotonic() + spec["deadline_s"]
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == 0:
                break
            if pid == child:
                if os.WIFSIGNALED(status):
                    report(status_fd, "S", str(os.WTERMSIG(status)))
                else:
                    report(status_fd, "X", str(os.WEXITSTATUS(status)))
                leftovers = kill_leftovers()
                if leftovers:
                    report(status_fd, "L", str(leftovers))
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                os._exit(code)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.kill(child, signal.SIGKILL)
            kill_leftovers()
            os._exit(137)
        signal.sigtimedwait([signal.SIGCHLD], min(remaining, 1.0))


def main(spec, status_fd):
    os.set_inheritable(status_fd, False)
    program_fds = [fd for fd in spec["fds"].values() if fd is not None]
    for fd in program_fds:
        os.set_inheritable(fd, False)
    try:
        check(prctl(PR_SET_CHILD_SUBREAPER, 1), "become a child subreaper")
        if spec["setup_mounts"]:
            setup_mounts(spec)
    except (OSError, SetupError) as exc:
        report(status_fd, "E", f"sandbox set-up failed: {exc}")
        os._exit(125)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    report(status_fd, "R")
    child = os.fork()
    if child == 0:
        start_program(spec, status_fd)
    # Only the program holds its output pipes, so they reach end of file when its processes are gone.
    for fd in program_fds:
        os.close(fd)
    supervise(child, spec, status_fd)
