"""The sandbox against hostile programs: each is contained, reported as a failure, leaves no process
behind, and the next run still works.

Programs that must leave nothing running first re-exec themselves with a random marker on their
command line (forked children inherit it), so the test can look for survivors in the host's /proc.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from sandbox_required import skip_without_sandbox

from roll.sandbox import SandboxLimits, SandboxUnavailable, resolve_isolation, run_python, runner

# Programs that must finish get far more time than they need, even on a loaded machine (starting a sandbox
# there can take seconds); a program that must be cut off loops forever, so a short timeout always fires.
ROOMY_S = 120.0
ROOMY = SandboxLimits(timeout_s=ROOMY_S)
SHORT = SandboxLimits(timeout_s=1.0, cpu_s=60)  # the CPU limit is not what must stop it
# Far longer than any test runs: a child sleeping this long is alive until the sandbox kills it.
ENDLESS_S = 600


def _works(mode: str) -> bool:
    try:
        resolve_isolation(mode)
    except SandboxUnavailable:
        return False
    return True


@pytest.fixture(params=["unshare", "bwrap"])
def isolated(request) -> str:
    """Each namespaced isolation mode that works on this machine (one missing mode is skipped while
    another works; none working is a failure where the sandbox is required)."""
    if not _works(request.param):
        if not any(_works(mode) for mode in ("unshare", "bwrap")):
            skip_without_sandbox("no namespaced isolation works here")
        pytest.skip(f"isolation {request.param} does not work here")
    return request.param


@pytest.fixture(params=["namespaced", "none"])
def any_mode(request) -> str:
    """The first working namespaced mode, then "none"."""
    if request.param == "none":
        return "none"
    for mode in ("unshare", "bwrap"):
        if _works(mode):
            return mode
    skip_without_sandbox("no namespaced isolation works here")


def marked(code: str) -> tuple[str, str]:
    """``code`` preceded by a re-exec that puts a fresh marker on the command line."""
    marker = f"roll-sandbox-test-{secrets.token_hex(8)}"
    prefix = textwrap.dedent(
        f"""\
        import os, sys
        if sys.argv[1:] != [{marker!r}]:
            os.execv(sys.executable, [sys.executable, "-I", "main.py", {marker!r}])
        """
    )
    return prefix + textwrap.dedent(code), marker


def processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(name))
    return found


def assert_contained(marker: str, mode: str) -> None:
    """Nothing carrying ``marker`` is alive, and a plain program still runs."""
    assert processes_with(marker) == []
    after = run_python("print('still fine')", isolation=mode, limits=ROOMY)
    assert after.ok and after.stdout == "still fine\n", after


def test_runs_a_program_with_stdin_and_without_privileges(isolated):
    code = textwrap.dedent(
        """\
        import os, sys
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(sys.stdin.read().upper(), end="")
        print(os.getcwd(), status["CapEff"].strip(), status["NoNewPrivs"].strip())
        print(sorted(os.listdir("/proc/self/fd")))  # 3 is the listing itself: nothing leaked
        print("oops", file=sys.stderr)
        sys.exit(3)
        """
    )
    result = run_python(code, stdin="hello\n", isolation=isolated, limits=ROOMY)
    assert result.stdout.splitlines() == [
        "HELLO",
        f"{runner.SANDBOX_WORKDIR} 0000000000000000 1",
        "['0', '1', '2', '3']",
    ]
    assert result.stderr == "oops\n"
    assert result.exit_code == 3 and not result.ok and result.error is None
    assert result.isolation == isolated


def test_infinite_loop_is_killed_at_the_timeout(any_mode):
    code, marker = marked("while True:\n    pass\n")
    start = time.monotonic()
    result = run_python(code, isolation=any_mode, limits=SHORT)
    assert result.timed_out and not result.ok
    assert result.exit_code is None and result.signal == signal.SIGKILL
    # Not before the timeout, and long before the endless loop could end otherwise (its CPU limit, 60 s).
    assert SHORT.timeout_s <= time.monotonic() - start < 60
    assert_contained(marker, any_mode)


def test_fork_bomb_is_stopped_by_the_process_limit(isolated):
    limits = SandboxLimits(timeout_s=ROOMY_S, max_processes=16)
    code, marker = marked(
        f"""\
        import time
        forked = 0
        for _ in range(500):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep({ENDLESS_S})  # alive until the sandbox ends them all
                os._exit(0)
            forked += 1
        print(forked, flush=True)
        while True:
            os.fork()  # fails at once: the limit is reached
        """
    )
    result = run_python(code, isolation=isolated, limits=limits)
    assert not result.ok and not result.timed_out
    assert int(result.stdout) < limits.max_processes
    assert "Resource temporarily unavailable" in result.stderr
    assert result.leftover_processes == int(result.stdout)
    assert_contained(marker, isolated)


def test_memory_bomb_hits_the_address_space_limit(any_mode):
    limits = SandboxLimits(timeout_s=ROOMY_S, memory_mb=128)
    result = run_python("hog = bytearray(1 << 30)\n", isolation=any_mode, limits=limits)
    assert not result.ok and result.exit_code == 1
    assert "MemoryError" in result.stderr


def test_disk_fill_is_bounded_and_the_private_dir_removed(any_mode):
    before = set(os.listdir(tempfile.gettempdir()))
    # Isolation "none" bounds each file only, so there the program stops after a few parts.
    parts = 3 if any_mode == "none" else 100
    code = textwrap.dedent(
        f"""\
        import errno
        try:
            open("big", "wb").write(b"x" * (8 << 20))
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        for i in range({parts}):
            open(f"part{{i}}", "wb").write(b"x" * (3 << 20))
        raise SystemExit("the disk did not fill up")
        """
    )
    limits = SandboxLimits(timeout_s=ROOMY_S, max_file_mb=4, disk_mb=16)
    result = run_python(code, isolation=any_mode, limits=limits)
    assert not result.ok
    assert result.stdout == "EFBIG\n"
    if any_mode != "none":  # the 16 MiB tmpfs work dir is full long before 100 x 3 MiB
        assert "No space left on device" in result.stderr
    leftovers = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("roll-sandbox-")}
    assert leftovers == set()


def test_writes_outside_the_work_dir_fail(isolated, tmp_path, repo_root):
    token = secrets.token_hex(6)
    targets = [
        tmp_path / "escape.txt",
        repo_root / f"escape-{token}.txt",
        Path.home() / f"escape-{token}.txt",
        Path("/tmp") / f"escape-{token}.txt",
        Path("/dev/shm") / f"escape-{token}.txt",
    ]
    code = textwrap.dedent(
        f"""\
        import json
        outcomes = {{}}
        for target in {[str(t) for t in targets]!r}:
            try:
                with open(target, "w") as f:
                    f.write("escaped")
                outcomes[target] = "written"
            except OSError as exc:
                outcomes[target] = type(exc).__name__
        open("inside.txt", "w").write("fine")  # the work dir itself is writable
        print(json.dumps(outcomes))
        open({str(targets[1])!r}, "w")  # the last attempt fails loudly
        """
    )
    try:
        result = run_python(code, isolation=isolated, limits=ROOMY)
        assert not result.ok and result.exit_code == 1
        outcomes = json.loads(result.stdout)
        assert "written" not in outcomes.values(), outcomes
        assert all(not t.exists() for t in targets)
    finally:
        for target in targets:
            if target.is_file():
                target.unlink()


def test_the_callers_environment_stays_secret(isolated, monkeypatch):
    secret = f"s3cret-{secrets.token_hex(8)}"
    monkeypatch.setenv("ROLL_SANDBOX_TEST_SECRET", secret)
    code = textwrap.dedent(
        """\
        import glob, os
        print(sorted(os.environ))
        for path in [f"/proc/{os.getppid()}/environ", *glob.glob("/proc/*/environ")]:
            try:
                print(path, open(path, "rb").read())
            except OSError as exc:
                print(path, type(exc).__name__)
        """
    )
    result = run_python(code, isolation=isolated, limits=ROOMY)
    assert result.ok, result
    assert result.stdout.splitlines()[0] == str(["HOME", "LANG", "PATH"])
    assert secret not in result.stdout + result.stderr


def test_network_is_unreachable(isolated, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    unix_path = tmp_path / "sock"
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(str(unix_path))
    unix_listener.listen()
    port = listener.getsockname()[1]
    code = textwrap.dedent(
        f"""\
        import socket
        try:
            socket.socket(socket.AF_UNIX).connect({str(unix_path)!r})
            print("unix connected")
        except OSError as exc:
            print("unix", type(exc).__name__)
        socket.create_connection(("127.0.0.1", {port}), timeout=60)
        """
    )
    try:
        result = run_python(code, isolation=isolated, limits=ROOMY)
        assert not result.ok and result.exit_code == 1
        assert "unix connected" not in result.stdout
        # unshare leaves the new namespace's loopback down; bwrap brings up an empty one of its own.
        assert "Network is unreachable" in result.stderr or "Connection refused" in result.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        unix_listener.close()


def test_killing_its_parent_and_everyone_does_not_reach_the_caller(isolated):
    sentinel = subprocess.Popen(["sleep", str(ENDLESS_S)])  # alive unless the program reaches it
    code, marker = marked(
        f"""\
        import signal
        for pid in (os.getppid(), {os.getpid()}, {sentinel.pid}):
            try:
                os.kill(pid, 0)
                print(pid, "visible", flush=True)
            except OSError as exc:
                print(pid, type(exc).__name__, flush=True)
        for kill in (lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.kill(-1, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
        os.killpg(0, signal.SIGKILL)
        """
    )
    try:
        result = run_python(code, isolation=isolated, limits=ROOMY)
        assert not result.ok and result.exit_code is None
        lines = result.stdout.splitlines()
        assert f"{os.getpid()} ProcessLookupError" in lines and f"{sentinel.pid} ProcessLookupError" in lines
        assert sentinel.poll() is None  # the caller is alive too: this test is still running
        assert_contained(marker, isolated)
    finally:
        sentinel.kill()
        sentinel.wait()


def test_a_daemon_does_not_outlive_the_call(any_mode):
    code, marker = marked(
        f"""\
        import time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep({ENDLESS_S})  # alive until the sandbox kills it
            os._exit(0)
        print("main done")
        """
    )
    result = run_python(code, isolation=any_mode, limits=ROOMY)
    assert result.ok and result.stdout == "main done\n"  # the program itself succeeded
    assert result.leftover_processes >= 1
    assert_contained(marker, any_mode)


def test_output_flood_is_capped_without_buffering_it(any_mode):
    limits = SandboxLimits(timeout_s=ROOMY_S, max_output_bytes=1 << 20)
    code, marker = marked(
        """\
        chunk = "x" * (1 << 20)
        for _ in range(100):
            sys.stdout.write(chunk)
        """
    )
    tracemalloc.start()
    try:
        result = run_python(code, isolation=any_mode, limits=limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.output_truncated and not result.ok
    assert len(result.stdout) == limits.max_output_bytes
    assert peak < 16 << 20  # the cap plus reading buffers, far below 100 MB
    assert_contained(marker, any_mode)


def test_isolation_none_runs_and_warns(monkeypatch, caplog):
    monkeypatch.setattr(runner, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="roll.sandbox"):
        result = run_python(
            "import os; print(os.environ['HOME'] == os.getcwd())", isolation="none", limits=ROOMY
        )
    assert result.ok and result.stdout == "True\n" and result.isolation == "none"
    assert any(r.levelno == logging.WARNING and "'none'" in r.getMessage() for r in caplog.records)


def test_unknown_isolation_is_a_value_error():
    with pytest.raises(ValueError, match="unknown sandbox isolation 'docker'"):
        run_python("print(1)", isolation="docker")


def test_auto_without_a_working_isolation_says_how_to_opt_out(monkeypatch):
    monkeypatch.setattr(runner, "_probed", {"bwrap": (False, "not installed"), "unshare": (False, "denied")})
    with pytest.raises(SandboxUnavailable, match="isolation='none'"):
        resolve_isolation("auto")
    with pytest.raises(SandboxUnavailable, match="denied"):
        run_python("print(1)", isolation="unshare")


def test_extra_files_and_bad_names(any_mode):
    code = "import sys; sys.path.insert(0, '.'); import helper; print(helper.X)"
    result = run_python(code, files={"helper.py": "X = 5\n"}, isolation=any_mode, limits=ROOMY)
    assert result.ok and result.stdout == "5\n"
    with pytest.raises(ValueError, match="bad sandbox file name"):
        run_python("print(1)", files={"../evil.py": ""}, isolation=any_mode)


def test_a_required_sandbox_turns_the_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_REQUIRE_SANDBOX", "1")
    with pytest.raises(pytest.fail.Exception, match="ROLL_REQUIRE_SANDBOX=1 requires the sandbox"):
        skip_without_sandbox("no namespaced isolation works here")
    monkeypatch.delenv("ROLL_REQUIRE_SANDBOX")
    with pytest.raises(pytest.skip.Exception):
        skip_without_sandbox("no namespaced isolation works here")
