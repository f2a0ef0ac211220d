"""Offline distillation (pipeline: distill): config and preflight checks, the teacher's cache, a teacher
equal to the student, and a short run towards another teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.config import ConfigError, load_config


def run_overrides(out: Path, student: str, teacher: str, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        f"model.path={student}",
        f"teacher.model_path={teacher}",
        "train.steps=3",
        "train.batch_size=16",
        "train.micro_batch_size=8",
        "eval.every_steps=0",
        "eval.max_prompts=8",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
        *extra,
    ]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.objective=kl"], "distill.objective: unknown distillation objective 'kl'"),
        (["distill.beta=0.2"], "distill.beta is read by objective jsd only"),
        (["distill.tail=dense"], "distill.tail"),
        (["teacher.model_path=/nowhere"], "teacher.model_path: Cannot load a model from '/nowhere'"),
        (["distill.beta=1.5", "distill.objective=jsd"], "distill.beta"),
    ],
)
def test_bad_distill_configs_are_refused_at_load(tmp_path, tiny_model_path, at_repo_root, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(
            "examples/distill.yaml", run_overrides(tmp_path, tiny_model_path, tiny_model_path, *overrides)
        )
    assert message in str(error.value), str(error.value)


def test_the_teacher_scores_on_the_students_device_mapped_ranks(tmp_path, tiny_model_path, at_repo_root):
    mapped = run_overrides(tmp_path, tiny_model_path, tiny_model_path, "train.device_mapping=[0,1]")
    cfg = load_config("examples/distill.yaml", mapped)
    assert cfg.train.world_size == 2 and cfg.teacher.world_size == 2
    unmapped = load_config("examples/distill.yaml", run_overrides(tmp_path, tiny_model_path, tiny_model_path))
    assert unmapped.train.world_size == unmapped.teacher.world_size == 1
    with pytest.raises(ConfigError, match=r"teacher.world_size is 1, but the teacher scores on the student"):
        load_config("examples/distill.yaml", [*mapped, "teacher.world_size=1"])


def test_preflight_refuses_a_teacher_with_another_tokenizer_and_k_beyond_the_vocabulary(
    tmp_path, tiny_model_path, at_repo_root
):
    from roll.config.common import TinyModelConfig
    from roll.models.tiny import save_tiny_model
    from roll.pipelines.preflight import preflight

    other = save_tiny_model(TinyModelConfig(alphabet="0123456789+-", hidden_size=16), tmp_path / "other")
    config = load_config(
        "examples/distill.yaml",
        run_overrides(tmp_path / "run", tiny_model_path, str(other), "distill.top_k=99"),
    )
    with pytest.raises(ConfigError) as error:
        preflight(config)
    assert "distill.top_k (99) is more than the 17 tokens" in str(error.value)
    assert "the teacher's tokenizer (18 tokens) differs from the student's (17 tokens)" in str(error.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # teacher and student workers of a whole run
def test_a_teacher_equal_to_the_student_gives_zero_divergence_and_no_gradient(
    tmp_path, tiny_model_path, at_repo_root, ray_session, capsys
):
    """A whole distillation step through teacher and student workers: with the teacher the student itself,
    the dense divergence and its gradient are zero. Only a run joins the cached teacher pass and the loss.
    On two device-mapped ranks (logical devices) the teacher is sharded and takes its turn on the
    student's devices, the student offloaded meanwhile (no bytes move on a CPU)."""
    from roll.pipelines import run_pipeline

    out = tmp_path / "same"
    # k = the whole vocabulary: the divergence is the dense one, exactly 0 for a teacher equal to the student.
    mapped = ("train.device_mapping=[0,1]", "ray.num_gpus=4")
    run = run_overrides(out, tiny_model_path, tiny_model_path, "distill.top_k=17", "train.steps=1", *mapped)
    run_pipeline(load_config("examples/distill.yaml", run))
    assert (
        "the teacher took its turn on the student's devices: the student was offloaded"
        in capsys.readouterr().out
    )
    rows = [row for row in metrics(out) if "distill/divergence" in row]
    assert len(rows) == 1
    # Zero up to float rounding (teacher and student batch the rows differently). AdamW normalises even a
    # rounding-sized gradient into a step of about lr, so the gradient, not the weights, is what is checked.
    assert all(abs(row["distill/divergence"]) < 1e-6 and row["distill/grad_norm"] < 1e-4 for row in rows), (
        rows
    )


@pytest.mark.slow
def test_a_student_moves_towards_another_teacher_and_a_second_run_reads_the_cache(
    tmp_path, tiny_model_path, other_model_path, at_repo_root, ray_session, monkeypatch
):
    """Two whole distillation runs: the first scores with temporary teacher workers and caches, the second
    must replay it from the cache alone with the teacher's start forbidden. Only a pipeline run has both
    halves."""
    from roll.pipelines import run_pipeline
    from roll.pipelines.distill import DistillPipeline

    cache = tmp_path / "cache"
    run = run_overrides(
        tmp_path / "a",
        tiny_model_path,
        other_model_path,
        "train.steps=8",
        "train.lr=1e-2",
        f"distill.cache_dir={cache}",
    )
    run_pipeline(load_config("examples/distill.yaml", run))
    rows = metrics(tmp_path / "a")
    divergences = [row["distill/divergence"] for row in rows if "distill/divergence" in row]
    assert divergences[-1] < 0.5 * divergences[0], divergences
    held_out = [row["eval/teacher_kl"] for row in rows if "eval/teacher_kl" in row]
    assert len(held_out) == 2 and held_out[1] < held_out[0], held_out
    assert len(list(cache.iterdir())) == 2  # the training and the held-out rows

    def no_teacher(*args: object) -> None:
        raise AssertionError("the teacher was started although its outputs are cached")

    monkeypatch.setattr(DistillPipeline, "_score_with_teacher", no_teacher)
    again = run_overrides(
        tmp_path / "b",
        tiny_model_path,
        other_model_path,
        "train.steps=8",
        "train.lr=1e-2",
        f"distill.cache_dir={cache}",
    )
    run_pipeline(load_config("examples/distill.yaml", again))
    replayed = [r["distill/divergence"] for r in metrics(tmp_path / "b") if "distill/divergence" in r]
    assert replayed == pytest.approx(divergences, abs=1e-6)


@pytest.mark.slow
def test_distillation_teaches_a_new_student_the_task(
    tmp_path, quickstart_warm_start, repo_root, at_repo_root, ray_session
):
    """A student built from scratch (held-out 0) learns addition from the distributions of the tests'
    quickstart warm start on the reference answers: its held-out score rises and its KL to the teacher
    falls. How far the score rises moves with the teacher, so the score asks only for 5 of the 200
    answers right (a model that learned nothing gets none), below every student measured; the KL fell by
    far more than half from every teacher tried, so the halved KL is the steady measure
    (docs/distill.md)."""
    from roll.pipelines import run_pipeline

    out = tmp_path / "student"
    run = [
        f"output_dir={out}",
        "model.path=null",
        "model.tiny.alphabet=0123456789+",
        "model.tiny.max_position_embeddings=32",
        f"teacher.model_path={quickstart_warm_start}",
        "train.steps=200",
        "eval.every_steps=100",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
    ]
    run_pipeline(load_config("examples/distill.yaml", run))
    evals = [row for row in metrics(out) if "eval/score" in row]
    assert [row["step"] for row in evals] == [0, 100, 200]
    assert evals[0]["eval/score"] == 0.0 and evals[-1]["eval/score"] >= 0.025, evals
    assert evals[-1]["eval/teacher_kl"] < 0.5 * evals[0]["eval/teacher_kl"], evals
