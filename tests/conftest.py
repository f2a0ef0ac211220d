"""Shared fixtures: one local Ray per test process for its whole session, the repository root, a tiny model;
under pytest-xdist, the grouping of tests into units and the torch threads of each process."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Where PYTHONDONTWRITEBYTECODE is set (this machine, CI), every process the suite starts (hundreds of Ray
# workers, each `roll train`) would compile the modules of roll/ it imports again, about a second of CPU
# each. The suite lets them write bytecode once (to __pycache__, which git ignores) and reuse it: set here,
# before pytest-xdist starts its processes and they start Ray, so all of them inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the folder holding ``pyproject.toml``)."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for every test that needs it; starting Ray costs seconds, so it is done once.

    Four logical GPUs are declared on the CPU node so that placement (device maps, placement groups)
    is tested without real GPUs. If Ray is already running (e.g. started by an outer harness), it is
    reused and left running.

    Worker classes defined in test modules are pickled by reference (``test_cluster.EchoWorker``), so
    the worker processes get ``tests/`` on their PYTHONPATH to import them. The variable is set only
    while Ray starts (its processes inherit it) and restored for the rest of the session.
    """
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        tests_dir = str(Path(__file__).resolve().parent)
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved) if p)
        try:
            from roll.distributed.ray_utils import local_system_config, worker_runtime_env

            ray.init(
                address="local",  # never a cluster another program recorded on this machine
                num_cpus=2,
                num_gpus=4,
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env=worker_runtime_env(),
                _system_config=local_system_config(),
            )
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    yield
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session: None) -> str:
    """The session Ray's address: a ``roll train`` subprocess given it as RAY_ADDRESS joins that Ray
    (as a job joins an existing cluster) instead of starting its own."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture
def at_repo_root(monkeypatch: pytest.MonkeyPatch, repo_root: Path) -> None:
    """Config paths (examples/data/...) are relative to the working directory: run from the repo root."""
    monkeypatch.chdir(repo_root)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer tiny model (digits and '+') saved in Hugging Face format, shared by worker tests."""
    from roll.config.common import TinyModelConfig
    from roll.models.tiny import save_tiny_model

    cfg = TinyModelConfig(
        alphabet="0123456789+",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return str(save_tiny_model(cfg, tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def quickstart_run(repo_root: Path, tmp_path_factory: pytest.TempPathFactory, ray_address: str):
    """`roll train examples/quickstart.yaml` shortened to 30 RL steps (SFT warm start, then GRPO) on the
    session's Ray, run once per session: test_quickstart_e2e checks its stages and artifacts, and its SFT
    warm start (``<output_dir>/sft/model``) starts the learning tests that need a weak start (LoRA, DPO,
    distillation), which each made that warm start before. Returns the output directory and the finished
    process.

    The warm start's 300 SFT steps end past the steep part of its learning curve, so a change of rounding
    does not move the score the tests start from (docs/quickstart-tuning.md)."""
    from test_pipelines_cli import roll_train

    output_dir = tmp_path_factory.mktemp("quickstart") / "run"
    overrides = [f"output_dir={output_dir}", "steps=30", "eval.every_steps=15", "tracking.backends=[jsonl]"]
    env = {"RAY_ADDRESS": ray_address}
    return output_dir, roll_train(repo_root, "examples/quickstart.yaml", *overrides, env=env)


@pytest.fixture(scope="session")
def quickstart_warm_start(quickstart_run) -> Path:
    """The quickstart's SFT warm start (the model its RL starts from), made once per session."""
    output_dir, _ = quickstart_run
    return output_dir / "sft" / "model"


@pytest.fixture(scope="module")
def sft_batch(tiny_model_path: str):
    """Four addition prompts with their answers as responses: the tiny model's SFT batch (tensors only)."""
    from roll.data.prompts import PromptSet, render_prompt
    from roll.models.loading import load_tokenizer
    from roll.pipelines.common import prompt_batch, response_tensors

    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (30, 4), (55, 45), (9, 9)]]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    prompts = PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    result = prompt_batch(prompts, list(range(4)), tokenizer.pad_token_id)
    for key, value in response_tensors(tokenizer, [r["answer"] for r in rows], length=4).items():
        result[key] = value
    return result.select_keys(result.tensors)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: str):
    """The tiny model's tokenizer, loaded through the real loading code."""
    from roll.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture
def model(tiny_model_path: str):
    """A fresh copy of the tiny model per test (engines move it and tests hook its forward)."""
    from roll.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_path)


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str) -> str:
    """The tiny model's architecture with different random weights."""
    import json

    from roll.config.common import TinyModelConfig
    from roll.models.tiny import TINY_CONFIG_FILE, save_tiny_model

    fields = json.loads((Path(tiny_model_path) / TINY_CONFIG_FILE).read_text())
    cfg = TinyModelConfig(**{**fields, "seed": fields["seed"] + 1})
    return str(save_tiny_model(cfg, tmp_path_factory.mktemp("models") / "other"))


@pytest.fixture
def read_only_parent(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write into; skipped where permission bits do not bind (root)."""
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if _can_create_in(parent):  # root (with CAP_DAC_OVERRIDE) ignores the permission bits
            pytest.skip("permission bits do not bind this process")
        yield parent
    finally:
        parent.chmod(0o700)


def _can_create_in(directory: Path) -> bool:
    try:
        (directory / "probe").mkdir()
    except PermissionError:
        return False
    (directory / "probe").rmdir()
    return True


def pytest_configure(config: pytest.Config) -> None:
    """On each of pytest-xdist's processes, torch (and any ``roll train`` or benchmark it starts) uses its
    share of the cores, and so do the Ray workers of the tests and runs each process starts
    (``ROLL_CPU_THREADS``): with more threads than cores, the processes hand the cores back and forth
    (docs/development.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        # The workers of this process's Ray and of the runs it starts: their share too.
        os.environ["ROLL_CPU_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# The modules whose tests use the quickstart's run (a session fixture of about a minute): under
# pytest-xdist they run on one process, which makes that run once instead of once per process.
QUICKSTART_MODULES = ("test_distill", "test_dpo", "test_lora", "test_quickstart_e2e")


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's scheduler type
    """Under pytest-xdist (``-n 2``, the README's commands), a test module is the unit sent to a process,
    so module-scoped clusters and engines are made once; the quickstart's modules are one unit. Units go
    out in collection order (``LONGEST_MODULES`` first): xdist's default reorders them by their number of
    tests, which sent the many-test, quick modules first and left the long ones for the end."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "quickstart" if Path(module).stem in QUICKSTART_MODULES else module

    return ModuleScheduling(config, log)


# The modules that take longest, longest first: under pytest-xdist the test processes take modules in
# collection order, so these start first and the run does not end waiting on one long module while the
# other process is idle. Keep it to the modules over about 20 s of a CI run (`--durations`).
LONGEST_MODULES = (
    *QUICKSTART_MODULES,
    "test_agentic",
    "test_run_control",
    "test_pipelines_cli",
    "test_recipes_cli",
    "test_resume",
    "test_workers",
    "test_multi_domain_e2e",
    "test_cluster",
    "test_continuous_batching",
    "test_rollout_ray",
    "test_placement",
    "test_trainer_state",
    "test_shm_weight_sync",
    "test_liveness",
    "test_critic",
    "test_onpolicy_distill",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (``LONGEST_MODULES``), each module's tests in their order. A test that
    uses the quickstart's run must be in one of ``QUICKSTART_MODULES``."""
    rank = {module: i for i, module in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
    for item in items:
        if "quickstart_run" in getattr(item, "fixturenames", ()) and item.path.stem not in QUICKSTART_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the quickstart's run: add {item.path.stem} to QUICKSTART_MODULES in "
                "tests/conftest.py, so that run is made once under pytest-xdist"
            )


# A test over this many seconds belongs to the slow tier (docs/development.md): the fast tier must stay
# within 5 minutes. Reported at the end of the run, not failed: a busy machine stretches any test.
SLOW_TEST_S = 60.0


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """List the tests that ran longer than ``SLOW_TEST_S`` without the slow marker."""
    unmarked = []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if report.when == "call" and report.duration > SLOW_TEST_S and "slow" not in report.keywords:
            unmarked.append(f"{report.duration:.0f} s {report.nodeid}")
    if unmarked:
        terminalreporter.section(f"tests over {SLOW_TEST_S:.0f} s not marked slow")
        for line in unmarked:
            terminalreporter.write_line(line)
