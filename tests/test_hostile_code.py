"""Hostile model-written programs scored by a real reward worker (Ray) with the ``code_tests`` reward.

Each program earns full marks only if the sandbox failed to contain it (it found the secret, wrote
outside its directory, reached the network, ...), so a score of 0 shows the containment. After each,
nothing it started is still running and the same worker scores a correct program 1.
"""

from __future__ import annotations

import os
import socket
import textwrap
import uuid
from pathlib import Path

import pytest
from sandbox_required import skip_without_sandbox

from roll.data.batch import Batch
from roll.distributed.cluster import Cluster
from roll.rewards.scoring import DomainRewards
from roll.rewards.spec import RewardSpec
from roll.sandbox import SandboxUnavailable, resolve_isolation
from roll.workers.reward import RewardWorker

SECRET_VAR = "ROLL_TEST_SECRET"
# Programs that must end on their own get far more time than they need, even on a loaded machine (a
# program that ran out of time would score 0 without showing that its attack failed). The endless loop
# is scored in a domain of its own with a short timeout, which it always reaches.
ROOMY_S = 120.0
ENDLESS_TIMEOUT_S = 1.5  # not a whole number: the CPU limit (ceil, 2 s) trails the wall clock
ENDLESS = "infinite loop"
# Far longer than the test runs: a daemon sleeping this long is alive unless the sandbox killed it.
ENDLESS_S = 600
SQUARE_TESTS = [{"call": f"square({x})", "expected": x * x} for x in (1, 2, 3)]
GOOD = "def square(x):\n    return x * x\n"


def hostile_programs(marker: str, outside: Path, port: int) -> dict[str, str]:
    """name -> a program whose ``square`` is right only if the attack worked."""
    win = "def square(x):\n    return x * x if WON else -1\n"
    programs = {
        ENDLESS: "while True:\n    pass\n" + GOOD,
        "fork bomb": "import os\nwhile True:\n    os.fork()\n" + GOOD,
        "memory bomb": "hog = bytearray(1 << 34)\n" + GOOD,
        "disk fill": """\
            WON = False
            try:
                with open("fill", "wb") as f:
                    for _ in range(4096):
                        f.write(b"x" * (1 << 20))
                WON = True
            except OSError:
                pass
            """,
        "write outside its directory": f"""\
            WON = False
            try:
                open({str(outside)!r}, "w").write("escaped")
                WON = True
            except OSError:
                pass
            """,
        "read the parent's environment": f"""\
            import glob, os
            WON = {SECRET_VAR!r} in os.environ
            for path in glob.glob("/proc/*/environ"):
                try:
                    WON = WON or b{SECRET_VAR!r} in open(path, "rb").read()
                except OSError:
                    pass
            """,
        "open a socket": f"""\
            import socket
            WON = False
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=60).close()
                WON = True
            except OSError:
                pass
            """,
        "kill its parent": """\
            import os, signal
            for pid in (os.getppid(), -1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            WON = True
            """,
        "leave a daemon behind": f"""\
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv("/bin/sh", ["/bin/sh", "-c", "sleep {ENDLESS_S}", {marker!r}])
                os._exit(0)
            WON = True
            """,
        "100 MB of output": """\
            import sys
            chunk = "x" * (1 << 20)
            for _ in range(100):
                sys.stdout.write(chunk)
            WON = True
            """,
    }
    return {name: textwrap.dedent(body) + (win if "WON" in body else "") for name, body in programs.items()}


def still_running(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def score(reward: Cluster, program: str, domain: str = "code") -> tuple[float, dict]:
    batch = Batch(
        non_tensors={
            "prompt_text": ["square"],
            "response_text": [f"```python\n{program}```"],
            "sample": [{"tests": SQUARE_TESTS}],
            "domain": [domain],
        }
    )
    out = reward.compute_rewards(batch)
    return out["scores"].item(), out["reward_info"][0]


@pytest.mark.usefixtures("ray_session")
def test_hostile_programs_score_zero_and_the_reward_worker_serves_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        resolve_isolation("auto")
    except SandboxUnavailable as e:
        skip_without_sandbox(f"no sandbox isolation here: {e}")
    # The reward worker's environment holds the secret too: its processes are the sandbox's parents.
    monkeypatch.setenv(SECRET_VAR, "s3cret")
    spec = RewardSpec.single("code_tests", {"timeout_s": ROOMY_S, "memory_mb": 256})
    endless = RewardSpec.single("code_tests", {"timeout_s": ENDLESS_TIMEOUT_S, "memory_mb": 256})
    domains = {"code": DomainRewards(spec, spec), "endless": DomainRewards(endless, endless)}
    reward = Cluster("reward", RewardWorker, 1, domains, timeout_s=10 * ROOMY_S)
    listener = socket.create_server(("127.0.0.1", 0))
    marker = f"roll-daemon-{uuid.uuid4().hex}"
    outside = tmp_path / "escaped.txt"
    try:
        assert score(reward, GOOD)[0] == 1.0
        worker_pid = os.getpid()
        for name, program in hostile_programs(marker, outside, listener.getsockname()[1]).items():
            value, info = score(reward, program, "endless" if name == ENDLESS else "code")
            assert value == 0.0, (name, info)
            # The loop was stopped by its timeout; every other program ended on its own.
            assert info["timeout"] == float(name == ENDLESS), (name, info)
            assert still_running(marker) == [], name
            assert not outside.exists(), name
            assert score(reward, GOOD)[0] == 1.0, f"the worker did not serve the next sample after: {name}"
        assert os.getpid() == worker_pid
    finally:
        listener.close()
        reward.kill()
