"""Multi-domain RLVR without Ray: batch mixing, reward specs, per-domain routing and metrics, and the
`domains:` config (every option changes what a worker or the scheduler does)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from roll.config.rl_checks import validate_rlvr
from roll.config.rlvr import DomainConfig, RLVRConfig, run_domains
from roll.data.batch import Batch
from roll.data.dataset import DatasetError
from roll.data.domains import DEFAULT_DOMAIN
from roll.data.mixing import DomainMixer, apportion
from roll.pipelines.domains import mix_domain_evals, reward_metrics
from roll.rewards import REWARD_FUNCTIONS, RewardOutput
from roll.rewards.scoring import DomainRewards, scored_in_controller
from roll.rewards.spec import RewardSpec, check_spec, domain_specs, score_with
from roll.rollout.backend import RewardDispatch, ScoreJob, domain_ranks
from roll.workers.reward import RewardWorker

SIZES = {"math": 50, "countdown": 30, "code": 7}


def domain_of(index: int) -> str:
    first = 0
    for name, size in SIZES.items():
        if index < first + size:
            return name
        first += size
    raise AssertionError(index)


# ------------------------------------------------------------------------------------------- mixing


@pytest.mark.parametrize(
    ("ratios", "batch_size"),
    [
        ({"math": 1, "countdown": 1, "code": 1}, 12),
        ({"math": 2, "countdown": 1, "code": 1}, 8),
        ({"math": 0.5, "countdown": 0.3, "code": 0.2}, 10),
        ({"math": 1, "countdown": 1, "code": 1}, 8),
    ],
)
def test_sampled_batches_honour_the_domain_ratios(ratios: dict[str, float], batch_size: int) -> None:
    mixer = DomainMixer(SIZES, ratios, batch_size, seed=3)
    totals: collections.Counter[str] = collections.Counter()
    share = {name: r / sum(ratios.values()) for name, r in ratios.items()}
    for step in range(1, 61):
        batch = mixer.next_indices()
        assert len(batch) == batch_size
        counts = collections.Counter(map(domain_of, batch))
        totals += counts
        for name in SIZES:
            # Every batch holds its share to within one prompt, and the running totals stay within one.
            assert abs(counts[name] - share[name] * batch_size) < 1 + 1e-9, (step, counts)
            assert abs(totals[name] - share[name] * batch_size * step) < 1 + 1e-9, (step, totals)


def test_a_small_domain_cycles_through_all_its_rows_each_epoch() -> None:
    mixer = DomainMixer(SIZES, {"math": 1, "countdown": 1, "code": 1}, 9, seed=0)
    code_rows = [i for _ in range(7) for i in mixer.next_indices() if domain_of(i) == "code"]
    first = sum(list(SIZES.values())[:2])
    assert sorted(code_rows[:7]) == list(range(first, first + 7))  # one epoch of 7 rows, each once
    assert sorted(code_rows[7:14]) == list(range(first, first + 7))


def test_the_mix_resumes_exactly_and_refuses_changed_domains() -> None:
    ratios = {"math": 2, "countdown": 1, "code": 1}
    mixer = DomainMixer(SIZES, ratios, 8, seed=1)
    for _ in range(5):
        mixer.next_indices()
    state = json.loads(json.dumps(mixer.state_dict()))  # what a checkpoint stores
    expected = [mixer.next_indices() for _ in range(10)]
    resumed = DomainMixer(SIZES, ratios, 8, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(10)] == expected
    with pytest.raises(DatasetError, match="domains changed"):
        DomainMixer(SIZES, {**ratios, "code": 3}, 8, seed=1).load_state_dict(state)


def test_apportion_gives_a_lagging_domain_its_debt_first() -> None:
    assert apportion([1, 1], [0, 0], 3) == [2, 1]
    assert apportion([1, 1], [2, 1], 3) == [1, 2]
    assert apportion([1, 1, 1], [0, 0, 0], 2) == [1, 1, 0]
    assert sum(apportion([5, 1], [100, 0], 4)) == 4  # far behind: everything it can get


# -------------------------------------------------------------------------------------- reward specs


@pytest.fixture
def toy_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    def length(prompt: str, response: str, sample: dict, *, scale: float = 1.0) -> RewardOutput:
        return RewardOutput(len(response) * scale, info={"calls": 1.0})

    def has_x(prompt: str, response: str, sample: dict) -> float:
        return 1.0 if "x" in response else 0.0

    def tokens(prompt: str, response: str, sample: dict) -> RewardOutput:
        return RewardOutput(1.0, token_rewards=[0.5, 0.5])

    for name, fn in (("t_length", length), ("t_has_x", has_x), ("t_tokens", tokens)):
        monkeypatch.setitem(REWARD_FUNCTIONS._entries, name, fn)
        monkeypatch.setitem(REWARD_FUNCTIONS._traits, name, {})


def test_weighted_rewards_multipliers_and_options(toy_rewards: None) -> None:
    spec = RewardSpec({"t_length": 0.5, "t_has_x": 2.0}, options={"t_length": {"scale": 10.0}})
    out = score_with(spec, "p", "abx", {})
    assert out.score == pytest.approx(0.5 * 30 + 2.0)
    assert out.info == {"calls": 1.0, "t_length": 30.0, "t_has_x": 1.0}
    gated = RewardSpec({"t_length": 1.0}, multipliers=("t_has_x",))
    assert score_with(gated, "p", "abc", {}).score == 0.0  # the gate zeroes a response without x
    assert score_with(gated, "p", "abx", {}).score == 3.0
    assert score_with(RewardSpec.single("t_tokens"), "p", "r", {}).token_rewards == [0.5, 0.5]
    with pytest.raises(ValueError, match="per-token rewards"):
        score_with(RewardSpec({"t_tokens": 1.0, "t_has_x": 1.0}), "p", "r", {})


def test_unknown_rewards_and_options_are_named_with_a_suggestion(toy_rewards: None) -> None:
    spec = RewardSpec({"t_lenght": 1.0, "t_length": 1.0}, options={"t_length": {"scael": 2.0}})
    problems = check_spec("domains.x", spec)
    assert any("unknown reward function 't_lenght'" in p and "t_length" in p for p in problems), problems
    assert any("has no option 'scael'. Did you mean 'scale'?" in p for p in problems), problems
    unused = check_spec("domains.x", RewardSpec({"t_length": 1.0}, options={"t_has_x": {}}))
    assert unused and "does not use" in unused[0]


# ------------------------------------------------------------------------------- reward workers


def reward_worker(config: object) -> RewardWorker:
    worker = RewardWorker.__new__(RewardWorker)
    worker.config = config
    return worker


def test_the_reward_worker_scores_each_row_with_its_domains_reward(toy_rewards: None) -> None:
    worker = reward_worker(
        {
            "a": DomainRewards(RewardSpec.single("t_length"), RewardSpec.single("t_has_x")),
            "b": DomainRewards(RewardSpec.single("t_has_x"), RewardSpec.single("t_has_x")),
        }
    )
    batch = Batch(
        non_tensors={
            "prompt_text": ["p"] * 3,
            "response_text": ["xyz", "xy", "ab"],
            "sample": [{}] * 3,
            "domain": ["a", "b", "a"],
        }
    )
    out = worker.compute_rewards(batch)
    assert out["scores"].tolist() == [3.0, 1.0, 2.0]
    assert out["reward_info"] == [{"calls": 1.0}, {}, {"calls": 1.0}]
    assert worker.compute_rewards(batch, evaluation=True)["scores"].tolist() == [1.0, 1.0, 0.0]
    batch["domain"] = ["a", "c", "a"]
    with pytest.raises(KeyError, match="no reward is configured for domain 'c'"):
        worker.compute_rewards(batch)


class FakeRewardCluster:
    """Records which rank each call went to; scores every response 1.0."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls: list[tuple[int, list[str]]] = []

    def call_rank(self, rank: int, method: str, batch: Batch, blocking: bool, **kwargs: object):
        self.calls.append((rank, list(batch["domain"])))
        out = Batch(
            tensors={"scores": torch.ones(len(batch))}, non_tensors={"reward_info": [{}] * len(batch)}
        )
        return FakeFuture(out)


class FakeFuture:
    def __init__(self, out: Batch):
        self.out = out

    def get(self) -> Batch:
        return self.out


def test_each_domains_responses_go_to_its_own_reward_ranks() -> None:
    ranks = domain_ranks({"math": 1, "code": 2})
    assert ranks == {"math": [0], "code": [1, 2]}
    cluster = FakeRewardCluster(3)
    dispatch = RewardDispatch(cluster, pad_id=0, ranks=ranks)
    jobs = [ScoreJob(str(i), "p", "r", {}, [1], "code" if i % 2 else "math") for i in range(6)]
    scored = dispatch.score(jobs)
    assert [s.request_id for s in scored] == [str(i) for i in range(6)]
    for rank, domains in cluster.calls:
        assert set(domains) == ({"math"} if rank == 0 else {"code"})
    assert {rank for rank, _ in cluster.calls} == {0, 1, 2}  # code's jobs are spread over both ranks
    with pytest.raises(KeyError, match="no reward workers for domain 'judge'"):
        dispatch.send([ScoreJob("x", "p", "r", {}, [1], "judge")])


def test_cheap_pure_rewards_are_scored_in_the_controller_and_others_on_workers() -> None:
    exact, verify = RewardSpec.single("exact_match"), RewardSpec.single("math_verify")
    assert scored_in_controller(DomainRewards(exact, exact))
    assert scored_in_controller(
        DomainRewards(RewardSpec({"char_match": 1.0, "think_answer_format": 0.5}), exact)
    )
    assert not scored_in_controller(DomainRewards(verify, verify))
    assert not scored_in_controller(DomainRewards(exact, verify))  # held-out rows need a worker
    assert not scored_in_controller(DomainRewards(RewardSpec({"exact_match": 1.0}, ("regex_match",)), exact))


def test_the_controller_scores_its_domains_at_once_and_sends_the_others_to_workers() -> None:
    exact = RewardSpec.single("exact_match")
    cluster = FakeRewardCluster(1)
    dispatch = RewardDispatch(
        cluster, pad_id=0, ranks={"code": [0]}, inline={"math": DomainRewards(exact, exact)}
    )
    jobs = [
        ScoreJob("m0", "1+2", " 3 ", {"answer": 3}, [1], "math"),
        ScoreJob("c0", "p", "r", {}, [1], "code"),
    ]
    jobs.append(ScoreJob("m1", "1+2", "4", {"answer": 3}, [1], "math"))
    futures = dispatch.send(jobs)
    assert len(futures) == 1 and cluster.calls == [(0, ["code"])]  # no call carried a math response
    assert [(s.request_id, s.score) for s in dispatch.take_ready()] == [("m0", 1.0), ("m1", 0.0)]
    assert dispatch.take_ready() == []  # handed over once
    assert [s.request_id for s in dispatch.score(jobs)] == ["m0", "c0", "m1"]  # in the order of the jobs
    # A run with only controller-scored domains has no reward cluster.
    alone = RewardDispatch(None, pad_id=0, ranks={}, inline={"math": DomainRewards(exact, exact)})
    assert [s.score for s in alone.score(jobs[::2], evaluation=True)] == [1.0, 0.0]
    with pytest.raises(KeyError, match="no reward workers for domain 'code'"):
        alone.send(jobs[1:2])


def test_a_reward_that_fails_in_the_controller_names_its_domain_and_reward() -> None:
    from roll.rewards.base import RewardError

    numeric = RewardSpec.single("numeric_match")
    dispatch = RewardDispatch(None, pad_id=0, ranks={}, inline={"math": DomainRewards(numeric, numeric)})
    with pytest.raises(
        RewardError, match=r"domain 'math' \(numeric_match\) failed in the controller: ValueError"
    ):
        dispatch.send([ScoreJob("m0", "1+2", "3", {"answer": "many"}, [1], "math")])


# -------------------------------------------------------------------------------------- metrics


def test_reward_metrics_per_domain_and_counters() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    metrics = reward_metrics(
        scores, ["math", "code", "code", "math"], [{"timeout": 1.0}, {}, {"sandbox_error": 1.0}, {}], True
    )
    assert metrics["reward/math/mean"] == 0.75 and metrics["reward/code/mean"] == 0.25
    assert metrics["rollout/math/frac"] == 0.5
    assert metrics["reward/math/timeout"] == 0.5 and metrics["reward/timeout"] == 0.25
    assert metrics["reward/code/sandbox_error"] == 0.5
    assert "reward/math/mean" not in reward_metrics(scores, ["d"] * 4, [{}] * 4, False)


def test_the_eval_mix_is_weighted_by_the_ratios() -> None:
    per_domain = {
        "math": {"eval/score": 0.9, "eval/response_length": 10.0, "eval/time_s": 1.0},
        "code": {"eval/score": 0.3, "eval/response_length": 4.0, "eval/time_s": 2.0},
    }
    metrics = mix_domain_evals(per_domain, {"math": 2.0, "code": 1.0, "countdown": 5.0})
    assert metrics["eval/math/score"] == 0.9 and metrics["eval/code/response_length"] == 4.0
    assert metrics["eval/score"] == pytest.approx((2 * 0.9 + 0.3) / 3)  # countdown has no eval set
    assert metrics["eval/time_s"] == 3.0


# --------------------------------------------------------------------------------------- config


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def multi_domain_config(tmp_path: Path, **math: object) -> RLVRConfig:
    cfg = RLVRConfig()
    cfg.model.tiny = None
    cfg.model.path = None
    rows = [{"prompt": "1+1", "answer": "2"}] * 4
    cfg.domains = {
        "math": DomainConfig(train_path=write(tmp_path / "m.jsonl", rows), reward="exact_match", **math),
        "chars": DomainConfig(train_path=write(tmp_path / "c.jsonl", rows), reward="char_match"),
    }
    cfg.eval.every_steps = 0
    return cfg


def domain_problems(cfg: RLVRConfig) -> list[str]:
    return [p for p in validate_rlvr(cfg) if "domain" in p or "reward" in p or "data." in p]


def test_reward_workers_asked_for_a_domain_the_controller_scores_are_rejected(tmp_path: Path) -> None:
    workers = multi_domain_config(tmp_path, reward_world_size=2)
    (problem,) = domain_problems(workers)
    assert problem.startswith("domains.math.reward_world_size is 2, but this domain's rewards are scored in")
    on_workers = multi_domain_config(tmp_path, reward_world_size=2)
    on_workers.domains["math"].reward = "math_verify"
    assert domain_problems(on_workers) == []
    single = RLVRConfig()
    single.reward_world_size = 3
    assert any(p.startswith("reward_world_size is 3, but") for p in validate_rlvr(single))
    single.reward = "math_verify"
    assert not any("reward_world_size" in p for p in validate_rlvr(single))


def test_domain_config_problems_are_caught_at_load(tmp_path: Path) -> None:
    assert domain_problems(multi_domain_config(tmp_path)) == []
    both = multi_domain_config(tmp_path, rewards={"char_match": 1.0})
    assert "domains.math: set exactly one of `reward`" in domain_problems(both)[0]
    cfg = multi_domain_config(tmp_path)
    cfg.reward, cfg.data.train_path = "char_match", "x.jsonl"
    problems = domain_problems(cfg)
    assert any(p.startswith("reward is set, but with `domains`") for p in problems), problems
    assert any(p.startswith("data.train_path is set, but with `domains`") for p in problems), problems
    typo = multi_domain_config(tmp_path, reward_options={"exact_match": {"timeout": 1}})
    assert "reward 'exact_match' has no option 'timeout'" in domain_problems(typo)[0]
    typo.reward = "char_match"  # another problem, reported beside the option typo, not instead of it
    assert len(domain_problems(typo)) == 2 and "has no option 'timeout'" in domain_problems(typo)[1]
    missing = multi_domain_config(tmp_path, eval_path=str(tmp_path / "nope.jsonl"))
    assert "domains.math.eval_path" in domain_problems(missing)[0]
    slash = multi_domain_config(tmp_path)
    slash.domains["a/b"] = slash.domains.pop("chars")
    assert "'a/b' cannot name a domain" in domain_problems(slash)[0]
    evals = multi_domain_config(tmp_path)
    evals.eval.every_steps = 5
    assert "needs an eval_path in at least one domain" in domain_problems(evals)[0]


def test_every_domain_option_reaches_the_reward_workers_or_the_mix(tmp_path: Path) -> None:
    """Each DomainConfig option changes what a worker or the scheduler is given."""
    base = DomainConfig(train_path="t.jsonl", reward="exact_match")
    train, held_out = domain_specs(base)
    assert train == held_out == RewardSpec({"exact_match": 1.0})
    assert domain_specs(DomainConfig(train_path="t", rewards={"a": 0.3, "b": 0.7}))[0].weights == {
        "a": 0.3,
        "b": 0.7,
    }
    gated = DomainConfig(train_path="t", reward="a", reward_multipliers=["rule"])
    assert domain_specs(gated)[0].multipliers == ("rule",)
    options = DomainConfig(train_path="t", reward="a", reward_options={"a": {"k": 1}})
    assert domain_specs(options)[0].options == {"a": {"k": 1}}
    evaluated = DomainConfig(train_path="t", reward="a", eval_reward="b", reward_options={"b": {"k": 2}})
    assert domain_specs(evaluated)[1] == RewardSpec({"b": 1.0}, options={"b": {"k": 2}})
    assert domain_ranks({"x": 2, "y": 3})["y"] == [2, 3, 4]  # reward_world_size
    # ratio: the mixer's batches (test_sampled_batches_honour_the_domain_ratios); train/eval_path: below.


def test_a_single_dataset_run_is_one_default_domain() -> None:
    cfg = RLVRConfig()
    cfg.data.train_path, cfg.data.eval_path, cfg.reward, cfg.reward_world_size = "t", "e", "char_match", 2
    ((name, domain),) = run_domains(cfg).items()
    assert name == DEFAULT_DOMAIN
    assert (domain.train_path, domain.eval_path, domain.reward, domain.reward_world_size) == (
        "t",
        "e",
        "char_match",
        2,
    )


def test_preflight_loads_and_tags_every_domains_rows(tmp_path: Path) -> None:
    from roll.config.common import TinyModelConfig
    from roll.pipelines.preflight import preflight

    cfg = multi_domain_config(tmp_path)
    cfg.model.tiny = TinyModelConfig(alphabet="0123456789+")
    cfg.domains["math"].eval_path = write(tmp_path / "me.jsonl", [{"prompt": "2+2", "answer": "4"}])
    cfg.output_dir = str(tmp_path / "run")
    cfg.rollout.rollout_batch_size = 8
    inputs = preflight(cfg)
    assert inputs.train.domains == ["math"] * 4 + ["chars"] * 4
    assert list(inputs.eval.by_domain()) == ["math"]
    write(tmp_path / "c.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "1+2"}])
    with pytest.raises(DatasetError, match=r"c.jsonl:2: row is missing required key\(s\) \['answer'\]"):
        preflight(cfg)


def test_option_values_a_reward_rejects_are_caught_at_load() -> None:
    bad_regex = RewardSpec({"regex_match": 1.0}, options={"regex_match": {"pattern": "(unclosed"}})
    assert "invalid pattern '(unclosed'" in check_spec("domains.fmt", bad_regex)[0]
    bad_timeout = RewardSpec({"math_verify": 1.0}, options={"math_verify": {"timeout_s": 0}})
    assert "timeout_s must be positive" in check_spec("domains.math", bad_timeout)[0]
    assert (
        check_spec("domains.fmt", RewardSpec({"regex_match": 1.0}, options={"regex_match": {"pattern": "x"}}))
        == []
    )


def test_the_example_config_loads_and_documents_its_domains(repo_root: Path, monkeypatch) -> None:
    from roll.config import load_config, to_yaml

    monkeypatch.chdir(repo_root)
    cfg = load_config("examples/rlvr_multi_domain.yaml")
    assert list(cfg.domains) == ["math", "countdown", "code"]
    assert [d.ratio for d in cfg.domains.values()] == [1.0, 1.0, 0.5]
    text = to_yaml(cfg, with_docs=True)
    assert "train_path: examples/data/multi_domain/code/train.jsonl  # This domain's training rows" in text
