"""Preflight pieces on their own: machine facts (GPUs, the Ray address), the tokenizer it loads before
any model exists, and the per-pipeline data needs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from roll.config import RayConfig, load_config
from roll.config.loader import ConfigError
from roll.data.prompts import PromptSet, unknown_pieces
from roll.models.loading import load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.pipelines.common import evaluate
from roll.pipelines.preflight import (
    DATA_NEEDS,
    check_output_dir,
    check_ray_address,
    load_run_tokenizer,
    local_gpu_count,
    preflight,
)


@pytest.fixture(autouse=True)
def _at_repo_root(at_repo_root: None) -> None:
    """Config data paths are relative to the repository root."""


@pytest.mark.parametrize(
    ("visible", "count"), [("", 0), ("0", 1), ("0,1,3", 3), ("-1", 0), ("GPU-ab12,GPU-cd34", 2)]
)
def test_local_gpu_count_follows_cuda_visible_devices(monkeypatch, visible: str, count: int) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpu_count() == count


def test_local_gpu_count_of_this_machine_without_nvidia(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if Path("/proc/driver/nvidia/gpus").is_dir():
        assert local_gpu_count() == len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    else:
        assert local_gpu_count() in (0, None)  # None only on an AMD ROCm machine


def test_a_listening_ray_address_passes_and_auto_is_left_to_ray(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert check_ray_address(RayConfig(address=f"127.0.0.1:{port}")) == []
        assert check_ray_address(RayConfig(address=f"ray://127.0.0.1:{port}")) == []
    assert check_ray_address(RayConfig(address="auto")) == []
    assert check_ray_address(RayConfig()) == []


def test_output_dir_check_writes_nothing(tmp_path: Path) -> None:
    assert check_output_dir(str(tmp_path / "a" / "b")) == []
    assert list(tmp_path.iterdir()) == []


def test_the_in_memory_tiny_tokenizer_equals_the_saved_one(tmp_path: Path) -> None:
    # Preflight tokenises the data before the tiny model (and its tokenizer files) exist.
    cfg = load_config("examples/quickstart.yaml")
    in_memory = load_run_tokenizer(cfg.model)
    saved = load_tokenizer(save_tiny_model(cfg.model.tiny, tmp_path / "tiny"))
    text = in_memory.apply_chat_template(
        [{"role": "user", "content": "12+34"}], add_generation_prompt=True, tokenize=False
    )
    assert text == saved.apply_chat_template(
        [{"role": "user", "content": "12+34"}], add_generation_prompt=True, tokenize=False
    )
    assert in_memory(text + "46")["input_ids"] == saved(text + "46")["input_ids"]
    special = ("pad_token_id", "eos_token_id", "unk_token_id", "padding_side")
    assert [getattr(in_memory, a) for a in special] == [getattr(saved, a) for a in special]


def test_unknown_pieces_names_each_unknown_character_once() -> None:
    tokenizer = load_run_tokenizer(load_config("examples/quickstart.yaml").model)
    assert unknown_pieces(tokenizer, ["1+2", "1 + 2 = ?", "x"]) == [[], [" ", "=", "?"], ["x"]]


def test_data_needs_follow_the_config() -> None:
    rlvr = load_config("examples/quickstart.yaml")
    needs = DATA_NEEDS.get("rlvr")(rlvr)
    assert needs.sft_targets and "answer" in needs.train_fields
    assert needs.batches == {"rollout.rollout_batch_size": 8, "sft_warm_start.batch_size": 64}
    no_warm_start = DATA_NEEDS.get("rlvr")(load_config("examples/quickstart.yaml", ["sft_warm_start=null"]))
    assert not no_warm_start.sft_targets and list(no_warm_start.batches) == ["rollout.rollout_batch_size"]


def test_preflight_returns_the_tokenised_datasets(tmp_path: Path) -> None:
    cfg = load_config("examples/quickstart.yaml", [f"output_dir={tmp_path / 'run'}"])
    inputs = preflight(cfg)
    assert len(inputs.train) == 4000 and len(inputs.eval) == 200
    assert (
        inputs.train.token_ids[0]
        == inputs.tokenizer(inputs.train.texts[0], add_special_tokens=False)["input_ids"]
    )
    assert not (tmp_path / "run").exists()


def test_stop_token_ids_outside_the_vocabulary_are_rejected_before_anything_starts(tmp_path: Path) -> None:
    cfg = load_config(
        "examples/quickstart.yaml", [f"output_dir={tmp_path / 'run'}", "rollout.stop_token_ids=[3,999]"]
    )
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids: \[999\] are not token ids"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()


def test_evaluation_scores_padding_rows_on_every_worker_then_drops_them() -> None:
    # 5 prompts over 3 reward workers: the batch is padded to 6 for generation AND scoring.
    prompts = PromptSet([{"i": i} for i in range(5)], ["p"] * 5, [[7, 8]] * 5)
    seen = []

    def generate(batch, params):
        return type(batch)(tensors={"response_mask": torch.ones(len(batch), 2)})

    def score(batch):
        seen.append(len(batch))
        return torch.tensor([float(row["i"]) for row in batch["sample"]])

    result = evaluate(prompts, generate, score, params=None, batch_size=8, pad_id=0, divisor=3)
    assert seen == [6]
    assert result["eval/score"] == pytest.approx(sum(range(5)) / 5)  # the padding row (i=0) is not counted


def test_the_vllm_defaults_start_a_real_models_shape_and_a_cache_too_small_is_named(tmp_path: Path) -> None:
    """vLLM's context and KV cache against Qwen2.5-0.5B's shape (its config.json alone): the defaults
    (max_model_len: what the run needs; 0.25 GiB of cache on a CPU) fit a run with 1k-token prompts and
    4k-token responses; the model's own 32k context does not fit that cache, and more than its positions
    is refused; on CUDA an unset cache is vLLM's to size from gpu_memory_utilization."""
    from transformers import Qwen2Config

    from roll.config.rlvr import VLLMConfig
    from roll.pipelines.engine_preflight import check_vllm_fits

    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2)
    Qwen2Config(**shape, intermediate_size=4864, max_position_embeddings=32768).save_pretrained(tmp_path)
    cfg = load_config("examples/quickstart.yaml")  # a real run's lengths, set past the tiny model's check
    cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = 1024, 4096
    cfg.model.path, cfg.rollout.engine = str(tmp_path), "vllm"
    assert check_vllm_fits(cfg, gpus_here=0) == []
    cfg.rollout.vllm = VLLMConfig(max_model_len=32768)
    (problem,) = check_vllm_fits(cfg, gpus_here=0)
    assert problem.startswith("rollout.vllm.kv_cache_gb=0.25 (unset: 0.25 GiB on a CPU) holds 10922 tokens")
    assert "fewer than one sequence of max_model_len 32768 (rollout.vllm.max_model_len)" in problem
    assert "raise rollout.vllm.kv_cache_gb to at least 0.75" in problem
    cfg.rollout.vllm = VLLMConfig(max_model_len=32768, kv_cache_gb=1.0)
    assert check_vllm_fits(cfg, gpus_here=0) == []
    cfg.rollout.vllm = VLLMConfig(max_model_len=40000)
    cfg.actor.device_mapping = [0]
    cfg.rollout.device_mapping = [1]  # on this machine's GPUs: the cache is sized by vLLM at its start
    (problem,) = check_vllm_fits(cfg, gpus_here=2)
    assert "rollout.vllm.max_model_len = 40000 exceeds the model's max_position_embeddings (32768)" in problem


def test_on_a_gpu_machine_a_real_models_role_without_devices_is_refused(monkeypatch, tmp_path: Path) -> None:
    """A 7B run whose actor has no device_mapping would train on the CPU for days without a word: refused,
    naming each key and the opt-out; a tiny model, ray.num_gpus=0 and the hybrid engine's rollout pass."""
    from roll.pipelines.preflight import check_local_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config("examples/quickstart.yaml")
    assert check_local_devices(cfg) == []  # the tiny model: a demo on the CPU
    cfg.model.path = str(tmp_path)
    problems = check_local_devices(cfg)
    assert [p.split(".device_mapping")[0] for p in problems] == ["actor", "rollout"]
    assert problems[0] == (
        "actor.device_mapping is unset on a machine with 2 GPU(s): its model would run on the CPU; set "
        "actor.device_mapping (e.g. [0]) or, to run on the CPU on purpose, ray.num_gpus=0"
    )
    cfg.actor.device_mapping = [0]
    cfg.rollout.hybrid_engine = True
    assert check_local_devices(cfg) == []
    cfg.actor.device_mapping, cfg.ray.num_gpus = None, 0
    assert check_local_devices(cfg) == []
