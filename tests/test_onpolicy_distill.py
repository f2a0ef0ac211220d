"""On-policy distillation inside RLVR: config checks, routing samples to teachers, and short runs where one
teacher is the policy itself (no advantage) and another is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from roll.config import ConfigError, load_config
from roll.config.rlvr import OnPolicyDistillConfig, TeacherRoleConfig
from roll.data.batch import Batch
from roll.data.dataset import DatasetError
from roll.pipelines.onpolicy_distill import distill_advantages, row_teachers, unrouted


def teachers(*names: str) -> dict[str, TeacherRoleConfig]:
    return {name: TeacherRoleConfig(model_path=f"/models/{name}") for name in names}


def test_rows_go_to_the_teacher_their_tag_names():
    rows = Batch(non_tensors={"sample": [{"t": "a"}, {"t": "b"}, {"t": "a"}], "domain": ["x", "y", "x"]})
    assert row_teachers(rows, OnPolicyDistillConfig(teachers=teachers("a", "b"), route_by="t")) == [
        "a",
        "b",
        "a",
    ]
    assert row_teachers(rows, OnPolicyDistillConfig(teachers=teachers("x", "y"), route_by="domain")) == [
        "x",
        "y",
        "x",
    ]
    assert row_teachers(rows, OnPolicyDistillConfig(teachers=teachers("only"))) == ["only"] * 3
    routed = OnPolicyDistillConfig(teachers=teachers("a"), route_by="t")
    assert unrouted([{"t": "a"}, {"t": "c"}], ["d", "d"], routed) == (1, "c")


def test_the_advantage_is_the_negated_reverse_kl_per_token_and_its_metric_per_tag():
    student = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    distill = OnPolicyDistillConfig(teachers=teachers("a", "b"), route_by="t", coef=2.0)
    advantages, metrics = distill_advantages(
        distill, student, teacher, mask, ["a", "b"], torch.tensor([True, True])
    )
    assert torch.allclose(advantages, torch.tensor([[-1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["distill/a/teacher_kl"] == pytest.approx(-0.25)  # mean of (0.5, -1.0)
    assert metrics["distill/b/teacher_kl"] == 0.0
    assert metrics["distill/teacher_kl"] == pytest.approx(-0.5 / 5)
    # The same student and teacher: no advantage at all.
    same, _ = distill_advantages(
        distill, student, student.clone(), mask, ["a", "b"], torch.tensor([True, True])
    )
    assert torch.equal(same, torch.zeros_like(same))


def quickstart(tmp_path: Path, *overrides: str):
    return load_config(
        "examples/quickstart.yaml", [f"output_dir={tmp_path / 'run'}", "sft_warm_start=null", *overrides]
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.teachers={}"], "distill.teachers is empty"),
        (["distill.teachers.a.model_path=/nowhere"], "distill.teachers.a.model_path: Cannot load a model"),
        (["distill.mode=both"], "distill.mode"),
    ],
)
def test_bad_distill_sections_are_refused_at_load(tmp_path, at_repo_root, overrides, message):
    with pytest.raises(ConfigError) as error:
        quickstart(tmp_path, *overrides)
    assert message in str(error.value), str(error.value)


def test_several_teachers_need_a_route_and_no_critic(
    tmp_path, at_repo_root, tiny_model_path, other_model_path
):
    two = [
        f"distill.teachers.a.model_path={tiny_model_path}",
        f"distill.teachers.b.model_path={other_model_path}",
    ]
    with pytest.raises(ConfigError, match="2 teachers but no distill.route_by"):
        quickstart(tmp_path, *two)
    with pytest.raises(ConfigError, match="distill with a critic"):
        quickstart(
            tmp_path, *two, "distill.route_by=domain", "algorithm.advantage_estimator=gae", "critic.lr=1e-5"
        )


def test_a_row_whose_tag_names_no_teacher_is_refused_before_the_run(tmp_path, at_repo_root, tiny_model_path):
    from roll.pipelines.preflight import preflight

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1", "answer": "2", "t": "a"})
        + "\n"
        + json.dumps({"prompt": "1+2", "answer": "3", "t": "z"})
        + "\n"
    )
    config = quickstart(
        tmp_path,
        f"data.train_path={data}",
        "rollout.rollout_batch_size=2",
        f"distill.teachers.a.model_path={tiny_model_path}",
        "distill.route_by=t",
    )
    with pytest.raises(DatasetError, match="training row 2 has t 'z', which names no teacher"):
        preflight(config)


@pytest.mark.slow
def test_a_teacher_that_is_the_policy_gives_no_advantage_and_another_teaches(
    tmp_path, at_repo_root, tiny_model_path, other_model_path, ray_session
):
    """Two teachers routed by a row field: ``same`` is the initial policy itself, ``other`` a different
    model. Before any update the policy's samples get no advantage from ``same`` (up to the engine's
    rounding) and a clear one from ``other``; mixed mode adds it to GRPO's."""
    from roll.pipelines import run_pipeline

    rows = [
        json.loads(line) for line in Path("examples/data/addition/train.jsonl").read_text().splitlines()[:64]
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({**row, "teacher": "same" if i % 2 else "other"}) + "\n" for i, row in enumerate(rows)
        )
    )
    config = quickstart(
        tmp_path,
        f"model.path={tiny_model_path}",
        "model.tiny=null",
        f"data.train_path={data}",
        "steps=2",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
        f"distill.teachers.same.model_path={tiny_model_path}",
        f"distill.teachers.other.model_path={other_model_path}",
        "distill.route_by=teacher",
        "distill.mode=mixed",
    )
    run_pipeline(config)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(row for row in steps if row.get("step") == 1 and "distill/teacher_kl" in row)
    assert abs(first["distill/same/teacher_kl"]) < 1e-4, first
    # Two random tiny models are close, yet their KL sits orders of magnitude above the rounding.
    assert first["distill/other/teacher_kl"] > 1e-3, first
    assert first["time/teacher_s"] > 0


def test_a_teacher_with_a_device_mapping_is_a_placed_role(tmp_path, at_repo_root, tiny_model_path):
    from roll.config.devices import role_plan
    from roll.pipelines.worker_specs import device_roles

    config = quickstart(
        tmp_path,
        "ray.num_gpus=4",
        "actor.device_mapping=range(0,2)",
        "rollout.device_mapping=range(0,2)",
        f"distill.teachers.main.model_path={tiny_model_path}",
        "distill.teachers.main.device_mapping=range(2,4)",
    )
    assert config.distill.teachers["main"].world_size == 2  # from its mapping, as every role's
    roles = {role.role: role for role in role_plan(config)}
    assert list(roles["teacher_main"].device_mapping) == [2, 3]
    assert "teacher_main" in {role.role for role in device_roles(config)}
    with pytest.raises(ConfigError, match="teacher_main"):
        quickstart(
            tmp_path,
            "ray.num_gpus=4",
            f"distill.teachers.main.model_path={tiny_model_path}",
            "distill.teachers.main.device_mapping=range(2,6)",
        )
