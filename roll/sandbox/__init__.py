"""A sandbox for untrusted Python, such as the programs a policy writes for a code-execution reward.

    from roll.sandbox import SandboxLimits, run_python

    result = run_python("print(int(input()) * 2)", stdin="21\\n", limits=SandboxLimits(timeout_s=2))
    assert result.ok and result.stdout == "42\\n"

Every run is a fresh interpreter (``python -I -S`` with site-packages on ``sys.path``, running
``main.py`` as ``__main__``) started by a small trusted launcher (``_launcher.py``) with
these limits (``SandboxLimits``): wall-clock timeout (the whole process tree is killed), CPU seconds,
address space, processes, file size, open files, and stdout/stderr each capped (read in chunks; the
program is killed once past the cap). Its environment holds only ``PATH``, ``HOME`` (its work directory)
and ``LANG``. When ``run_python`` returns, no process of the run is left (see "none" for the exception).

Isolation modes (``isolation=``):

``"auto"``
    bwrap if installed and working, else unshare if it works (each tried once per process, by running a
    trivial program), else ``SandboxUnavailable``: running without isolation must be asked for by name.

``"unshare"`` (util-linux ``unshare``) and ``"bwrap"`` (bubblewrap)
    New user (when the caller is not root), mount, pid, network, IPC and UTS namespaces. Guaranteed:

    * the whole filesystem is read-only; the only writable place is the program's work directory
      ``/tmp/sandbox``, a fresh tmpfs of ``disk_mb`` that vanishes with the run;
    * ``/tmp``, ``/var/tmp``, ``/run`` and the caller's home are empty (the interpreter's own
      directories re-appear read-only where they live under them), and ``/dev`` holds only null, zero,
      full, random and urandom;
    * no network: only a loopback interface of its own (down with unshare, up but empty with bwrap); a
      port the caller listens on is unreachable;
    * a fresh ``/proc`` that shows only the run's processes, so neither the caller's environment nor any
      other process can be read or signalled (``kill -9 -1`` reaches only the run's own processes);
    * no capabilities and ``no_new_privs``: setuid binaries and file capabilities grant nothing. A root
      caller's program runs under a throwaway uid chosen per run (the kernel exempts uid 0 from
      ``RLIMIT_NPROC`` and lets it write many files under ``/proc/sys``), so the process limit counts
      this run's processes only, as the per-run user namespace makes it for an unprivileged caller;
    * when the program ends, or at the timeout, the pid namespace dies and every process in it with
      it, daemons included.

    Not guaranteed: secrecy of files that the caller's uid can read (the filesystem is readable outside
    the hidden directories), path-named unix sockets outside them (a read-only mount does not stop
    ``connect()``), CPU and memory bandwidth fairness with other work, and protection from kernel bugs
    (there is no seccomp filter). Memory is bounded per process (``RLIMIT_AS``), so a run holds at most
    about ``max_processes x memory_mb`` plus its ``disk_mb`` work dir.

``"none"``
    An explicit opt-in, logged as a WARNING: the same launcher, rlimits, private directory (a host
    temporary directory, removed afterwards), scrubbed environment and kill of the process group, but
    no namespaces. The program runs under the caller's uid with no capabilities. It can read whatever
    the caller can (including ``/proc/<pid>/environ`` of the caller's processes), write wherever the
    caller can, use the network, and signal the caller's processes. Its processes are killed when it
    ends, by the launcher (a child subreaper, so daemons that called ``setsid`` are caught too) and by
    a kill of its process group; a program that first kills the launcher and then daemonizes with
    ``setsid`` escapes. ``RLIMIT_NPROC`` counts all of the caller's processes, and the kernel ignores
    it for root, whose fork bomb then runs until the timeout. Only ``max_file_mb`` bounds the disk it
    fills, per file.

The mode in use is logged once per process at INFO.
"""

from roll.sandbox.runner import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    resolve_isolation,
    run_python,
)

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "resolve_isolation", "run_python"]
