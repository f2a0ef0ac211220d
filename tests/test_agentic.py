"""`pipeline: agentic`: its config checks, the expert's episodes in the layout RL samples, and runs on Ray
(a short run that resumes; environment workers killed or frozen mid-run, replaced without losing a
step)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from roll.config.loader import ConfigError, load_config
from roll.data.chat_turns import ChatTurns
from roll.models.tokenizer import build_char_tokenizer
from roll.pipelines.agentic import expert_rows
from roll.rollout.episode import EpisodeBudget

EXAMPLE = "examples/agentic_frozenlake.yaml"
# A run of seconds: a smaller model, few episodes, a short warm start.
QUICK = [
    "steps=2",
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64",
    "env.max_turns=4",
    "sft_warm_start.episodes=32",
    "sft_warm_start.steps=2",
    "sft_warm_start.batch_size=16",
    "sft_warm_start.micro_batch_size=16",
    "rollout.rollout_batch_size=2",
    "rollout.num_return_sequences=2",
    "eval.seeds=4",
    "eval.every_steps=1",
    "checkpoint.every_steps=1",
    "tracking.backends=[jsonl]",
]


@pytest.fixture
def at_repo_root(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo_root)


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(EXAMPLE, overrides)
    return str(error.value)


@pytest.mark.usefixtures("at_repo_root")
def test_the_example_loads_and_bad_agentic_settings_are_named_at_load() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.pipeline == "agentic" and cfg.env.stop_policy()["max_turns"] == "train"
    assert "environment 'frozen_lake' has no option 'sise'" in problems("env.options={sise: 4}")
    assert "env.stop_reasons.env_error: not a stop reason with a policy" in problems(
        "env.stop_reasons={env_error: train}"
    )
    assert "env.stop_reasons.max_turns=drop: choose one of train, mask, zero" in problems(
        "env.stop_reasons={max_turns: drop}"
    )
    assert (
        "sft_warm_start.expert_options.nois: FrozenLakeExpert has no such option. Did you mean 'noise'?"
        in (problems("sft_warm_start.expert_options={nois: 0.3}"))
    )
    assert "sft_warm_start.expert: " in problems("sft_warm_start.expert=oracle")
    assert "rollout.group_filters is not supported by pipeline: agentic" in problems(
        "rollout.group_filters=[equal_rewards]"
    )
    assert load_config(EXAMPLE, ["rollout.async_generation_ratio=1"]).rollout.async_generation_ratio == 1
    assert "with rollout.hybrid_engine the actor itself generates" in problems(
        "rollout.async_generation_ratio=1", "rollout.hybrid_engine=true"
    )
    assert "exceeds model.tiny.max_position_embeddings (256)" in problems("env.max_context_tokens=300")
    assert "reaches ray.call_timeout_s (900)" in problems("env.step_timeout_s=100")
    # FrozenLake 2x2 has a handful of maps: 200 held-out seeds leave none to train on.
    assert "eval.seeds: 10000 seeds in a row" in problems("env.options={size: 2}")


@pytest.mark.parametrize(
    "example", ["agentic_frozenlake_gigpo", "agentic_sokoban", "agentic_tool", "agent_calculator"]
)
@pytest.mark.usefixtures("at_repo_root")
def test_the_other_agentic_examples_load(example: str) -> None:
    cfg = load_config(f"examples/{example}.yaml")
    assert cfg.pipeline == "agentic" and cfg.eval.seeds == 200
    if example == "agentic_frozenlake_gigpo":
        # GiGPO against the trajectory-wise example: the same model, maps, held-out seeds and RL budget.
        base = load_config(EXAMPLE)
        assert (cfg.model, cfg.env.name, cfg.env.options, cfg.steps) == (
            base.model,
            base.env.name,
            base.env.options,
            base.steps,
        )
        assert (cfg.rollout, cfg.actor) == (base.rollout, base.actor)
        assert cfg.env.sample_layout == "step_wise" and cfg.algorithm.advantage_estimator == "gigpo"


@pytest.mark.usefixtures("at_repo_root")
def test_step_wise_settings_are_checked_at_load() -> None:
    step_wise = ["env.sample_layout=step_wise", "algorithm.advantage_estimator=gigpo"]
    assert load_config(EXAMPLE, step_wise).env.sample_layout == "step_wise"
    assert "algorithm.advantage_estimator=gigpo credits each turn" in problems(
        "algorithm.advantage_estimator=gigpo"
    )
    assert "use gigpo or step_reinforce, or env.sample_layout=trajectory" in problems(
        "env.sample_layout=step_wise"
    )
    assert "env.history_turns (2) is read only with env.sample_layout=step_wise" in problems(
        "env.history_turns=2"
    )
    assert "algorithm.step_advantage_weight is read only by advantage_estimator=gigpo" in problems(
        "algorithm.step_advantage_weight=0.5"
    )
    assert "algorithm.step_norm is read only by gigpo and step_reinforce" in problems(
        "algorithm.step_norm=mean_std_norm"
    )
    assert "use algorithm.kl_penalty=loss" in problems(
        *step_wise, "algorithm.kl_coef=0.01", "algorithm.kl_penalty=reward"
    )
    assert "reward_shaping.normalize/clip" in problems(*step_wise, "algorithm.reward_shaping.normalize=true")


@pytest.mark.usefixtures("at_repo_root")
def test_the_experts_step_wise_rows_are_one_turn_each() -> None:
    cfg = load_config(EXAMPLE, ["sft_warm_start.episodes=10", "sft_warm_start.expert_options={noise: 0.0}"])
    tokenizer = build_char_tokenizer(cfg.model.tiny.alphabet)
    chat = ChatTurns(tokenizer, [tokenizer.eos_token_id])
    rows = expert_rows(cfg, chat, EpisodeBudget(8, 3, 256), history_turns=0)
    assert len(rows) > 10  # several turns per episode
    for prompt, row in zip(rows.token_ids, rows.rows):
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        assert text.count("<|user|>") == 1  # the current observation only
        turn = tokenizer.decode(row["response_ids"], skip_special_tokens=False)
        assert turn[0] in "LDRU" and turn[1:] == "<|eos|>" and all(row["loss_mask"])


@pytest.mark.usefixtures("at_repo_root")
def test_the_experts_episodes_are_in_the_layout_rl_samples() -> None:
    cfg = load_config(EXAMPLE, ["sft_warm_start.episodes=20", "sft_warm_start.expert_options={noise: 0.0}"])
    tokenizer = build_char_tokenizer(cfg.model.tiny.alphabet)
    chat = ChatTurns(tokenizer, [tokenizer.eos_token_id])
    rows = expert_rows(cfg, chat, EpisodeBudget(8, 3, 256))
    assert len(rows) == 20 and min(row["seed"] for row in rows.rows) >= cfg.eval.seeds
    for prompt, row in zip(rows.token_ids, rows.rows):
        assert tokenizer.decode(prompt, skip_special_tokens=False).startswith("<|user|>")
        trained = [i for i, m in zip(row["response_ids"], row["loss_mask"]) if m]
        turns = tokenizer.decode(trained, skip_special_tokens=False).split("<|eos|>")
        assert turns[-1] == "" and set(turns[:-1]) <= set("LDRU")  # a letter then EOS, per turn
        # The observations between the turns are attended, not trained.
        assert len(trained) < len(row["response_ids"])


def process_state(pid: int) -> str:
    """The process's state letter (R, S, T: stopped, Z: dead, not reaped yet), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def metrics(out: Path) -> list[dict]:
    """The training steps' rows (step 0 is the evaluation before training)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["step"] > 0]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_an_agentic_run_trains_on_episodes_evaluates_held_out_seeds_and_resumes(tmp_path: Path) -> None:
    """Two agentic steps with a warm start, held-out evaluation and a checkpoint, then a resume: the
    episode metrics, the evaluation and the seed cursor carried by a checkpoint exist only in a whole
    run."""
    from roll.pipelines.agentic import AgenticPipeline

    out = tmp_path / "run"
    results = AgenticPipeline(load_config(EXAMPLE, [*QUICK, f"output_dir={out}"])).run()
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    for key in ("episode/success", "episode/turns", "episode/stop/env_done", "env/step_s", "actor/loss"):
        assert key in rows[-1], key
    assert any(key.startswith("actions/") for key in rows[-1])
    assert {"eval/greedy/success", "eval/sampled/success", "eval/score"} <= set(rows[-1])
    assert "eval/score_before" in results and (out / "model" / "config.json").is_file()

    resumed = AgenticPipeline(load_config(EXAMPLE, [*QUICK, f"output_dir={out}", "steps=3"]), resume="latest")
    seeds = resumed.seed_order
    resumed.run()
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert seeds.drawn == 3 * 2  # the seed cursor went on from step 2's: no map was played twice
    # The saved policy, played as a user would (plain transformers, its own tokenizer and chat template,
    # Gymnasium's maps through our env), does on the held-out maps what the run's greedy evaluation of
    # the same weights logged.
    played = play_greedily_with_transformers(out / "model", seeds=range(4), max_turns=4, max_new_tokens=3)
    for key, value in played.items():
        assert rows[-1][f"eval/greedy/{key}"] == pytest.approx(value), (key, played, rows[-1])


def play_greedily_with_transformers(model_dir: Path, seeds, max_turns: int, max_new_tokens: int) -> dict:
    """Greedy FrozenLake episodes of the model saved in ``model_dir``, loaded with plain transformers; each
    turn's prompt is the whole conversation rendered by the saved chat template. The means of what the
    run's evaluation logs: success, turns, invalid actions and tokens after the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll.envs.base import make_env

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    eos = model.generation_config.eos_token_id
    env = make_env("frozen_lake", {"size": 4})
    success = turns = invalid = response_tokens = 0
    for seed in seeds:
        observation, _ = env.reset(seed)
        messages = [{"role": "user", "content": observation}]
        prompt_len = None
        for _ in range(max_turns):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            prompt_len = prompt_len or len(ids)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos
                )
            new = out[0, len(ids) :].tolist()
            turns += 1
            if new[-1] != eos:  # no end of turn within the budget: not an action, the episode ends
                invalid += 1
                break
            action = tokenizer.decode(new[:-1], skip_special_tokens=True)
            observation, _, terminated, truncated, info = env.step(action)
            invalid += not info["action_is_valid"]
            success += info.get("metrics", {}).get("success", 0.0)
            if terminated or truncated:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        response_tokens += len(ids) + len(new) - prompt_len  # every id after the first prompt
    n = len(seeds)
    return {
        "success": success / n,
        "turns": turns / n,
        "invalid_action_frac": invalid / turns,
        "response_tokens": response_tokens / n,
    }


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_asynchronous_step_wise_episodes_recover_killed_and_frozen_workers_without_losing_a_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step-wise GiGPO with episodes playing on while the actor trains (rollout.async_generation_ratio=1)
    and two mini-batches per step. The environment worker is killed before step 1, its replacement frozen
    (SIGSTOP) before step 2 and the rollout worker frozen before step 3, while the background thread plays
    ahead: the killed one is found dead, each frozen one at the liveness bound and killed without being
    waited for; each is replaced, no step is lost, samples stay within the staleness bound, the off-policy
    correction is on, and the LR schedule (linear over 3 steps x 2 mini-batches) runs on as if nothing
    happened, whatever the turns per step. Losses exist only in a running pipeline with real workers; one
    run holds all three (each run costs its workers' start-up)."""
    import logging

    from roll.pipelines.agentic import AgenticPipeline

    out = tmp_path / "run"
    overrides = [*QUICK, f"output_dir={out}", "sft_warm_start=null", "eval.every_steps=0", "steps=3"]
    overrides += ["rollout.async_generation_ratio=1", "env.sample_layout=step_wise"]
    overrides += ["algorithm.advantage_estimator=gigpo", "algorithm.gamma=0.95"]
    overrides += ["actor.mini_batch_size=2", "actor.lr_scheduler=linear"]
    # A frozen worker is found only by the liveness bound; the default 30 s would only make this slower.
    # 10 s is still far above how long a busy worker of this run leaves a heartbeat waiting (heartbeats
    # are answered beside the work), and the calls' own timeout stays far above anything they wait for.
    overrides += ["ray.liveness_timeout_s=10", "ray.call_timeout_s=900"]
    pipeline = AgenticPipeline(load_config(EXAMPLE, overrides))
    killed, rollout = pipeline.role_set.live["environment"], pipeline.role_set.live["rollout"]
    frozen = {3: rollout.ping()[0]["pid"]}
    lost = {1: killed, 3: rollout}
    step = pipeline.step

    def freeze_before(number: int) -> dict[str, float]:
        # The background thread is playing this step's episodes ahead by now.
        if number == 2:  # the replacement of the killed environment worker (env steps run beside a ping)
            lost[2] = pipeline.role_set.live["environment"]
            frozen[2] = lost[2].ping()[0]["pid"]
        if number in frozen:
            os.kill(frozen[number], signal.SIGSTOP)
        return step(number)

    pipeline.step = freeze_before
    try:
        os.kill(killed.ping()[0]["pid"], signal.SIGKILL)
        with caplog.at_level(logging.WARNING):
            pipeline._train()
        live_env = pipeline.role_set.live["environment"]
        assert live_env is not lost[1] and live_env is not lost[2]
        assert pipeline.role_set.live["rollout"] is not lost[3]
        assert pipeline.budget.restarts == 3
        assert "lost environment rank 0" in caplog.text and "lost rollout rank 0" in caplog.text
        assert caplog.text.count("replaced the environment workers") == 2
        assert "replaced the rollout workers" in caplog.text
        # Ended by Ray, never woken to be asked: gone (or dead, waiting to be reaped) while still stopped.
        deadline = time.monotonic() + 300  # only a failure waits this long
        while any(process_state(pid) not in ("gone", "Z") for pid in frozen.values()):
            assert time.monotonic() < deadline, "a frozen worker was never ended"
            time.sleep(0.5)
    finally:
        for pid in frozen.values():
            if process_state(pid) not in ("gone", "Z"):  # the test failed: leave nothing stopped behind
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    os.kill(pid, sig)
        pipeline.shutdown()
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/staleness_max"] <= 1
        assert "actor/tis_weight_mean" in row  # truncated importance sampling, on by default here
        # Rows are turns, padded to the 2 mini-batches.
        assert row["rollout/turn_samples"] == pytest.approx(row["episode/turns"] * 4)
        assert (row["rollout/turn_samples"] + row["rollout/padding_samples"]) % 2 == 0
        assert row["rollout/samples"] == row["rollout/turn_samples"]  # trained rows, padding left out
    # 2 optimizer steps per RL step of a linear schedule over 6: the mean LR of step k's two.
    expected = [1e-4 * (1 - (4 * k - 3) / 12) for k in (1, 2, 3)]  # mean of 1 - s/6, s = 2k-2, 2k-1
    assert [row["actor/lr"] for row in rows] == pytest.approx(expected)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_ppo_with_a_critic_trains_on_episodes(tmp_path: Path) -> None:
    """GAE over the trained tokens only: the critic's values and the advantages skip the observations."""
    from roll.pipelines.agentic import AgenticPipeline

    out = tmp_path / "run"
    overrides = [*QUICK, f"output_dir={out}", "sft_warm_start=null", "eval.every_steps=0", "steps=1"]
    overrides += ["algorithm.advantage_estimator=gae", "critic={lr: 1.0e-4}"]
    AgenticPipeline(load_config(EXAMPLE, overrides)).run()
    (row,) = metrics(out)
    assert "critic/value_loss" in row or any(key.startswith("critic/") for key in row)
    assert (out / "critic" / "config.json").is_file()


@pytest.mark.slow
def test_frozenlake_held_out_success_rises_with_rl(repo_root: Path, tmp_path: Path, ray_address: str) -> None:
    """The step-wise GiGPO example through `roll train`, shortened: 100 SFT steps imitating the noisy
    expert, then 20 GiGPO steps; the sampled success on the 200 held-out maps must rise by at least 0.15.
    Only a whole SFT-then-RL run shows that the example learns. The shortened start is as good as the
    example's in half the time, and the bar sits well below the gains measured from it and far above the
    noise of one sampled evaluation (docs/agentic.md). (The trajectory-wise GRPO example needs more RL
    steps from a weaker start for the same margin, and more time: its learning is shown by the run in
    docs/agentic.md, "The FrozenLake demonstration".)"""
    import subprocess
    import sys

    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "steps=20", "sft_warm_start.steps=100"]
    overrides += [
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "roll.cli", "train", "examples/agentic_frozenlake_gigpo.yaml", *overrides],
        cwd=repo_root,
        env={**os.environ, "RAY_ADDRESS": ray_address},  # the session's Ray: none to start and stop
        capture_output=True,
        text=True,
        # Only a guard against a hang: a busy machine stretches this run many times over.
        timeout=3 * 3600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = rows[0]["eval/sampled/success"], rows[-1]["eval/sampled/success"]
    assert after - before >= 0.15, (before, after)
    # Over the last five steps: one step's share (some 100 turns) is noisy, and the episode schedule (hence
    # what is sampled) varies run to run with the machine's timing.
    last = [row["episode/invalid_action_frac"] for row in rows if "episode/invalid_action_frac" in row][-5:]
    assert sum(last) / len(last) < 0.05, last
    assert rows[-1]["rollout/turn_samples"] > 64  # one sample per turn, several turns per episode
