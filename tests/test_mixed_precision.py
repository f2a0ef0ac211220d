"""The precision contract (``model.dtype``, ``model.inference_dtype``): trained models keep float32 weights
and optimizer state and compute in bfloat16 through FSDP2's mixed precision, on one rank too; inference
roles hold their own dtype; checkpoints keep float32 and the saved model is in the compute dtype; float16
training is refused. bfloat16 runs on CPU, so all of it is tested here on the real actor worker (one rank,
in this process, as test_lora does)."""

from __future__ import annotations

import json

import pytest
import torch
from in_process_actor import Actor, weights

from roll.config.common import ModelConfig
from roll.config.loader import ConfigError, load_config
from roll.data.batch import Batch
from roll.pipelines.worker_specs import plan_workers, probe_spec
from roll.strategies.fsdp import is_sharded, local_tensor


@pytest.fixture
def batch(sft_batch: Batch) -> Batch:
    return sft_batch


def test_bf16_compute_keeps_float32_weights_and_a_tiny_step_moves_them(tiny_model_path, batch) -> None:
    """One step at lr 1e-6: a bfloat16 weight cannot move by less than 1/256 of itself, so pure bf16
    training changed almost none of them (docs/gpu.md); the float32 masters all move."""
    with Actor(tiny_model_path, "bfloat16") as actor:
        params = list(actor.model.parameters())
        assert all(is_sharded(p) and local_tensor(p).dtype == torch.float32 for p in params)
        before = weights(actor)
        actor.train_step(batch)
        after = weights(actor)
        state_dtypes = {v.dtype for s in actor.optimizer.state.values() for v in s.values() if v.dim() > 0}
    assert state_dtypes == {torch.float32}  # AdamW's moments
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    total = sum(t.numel() for t in before.values())
    assert changed / total > 0.99, f"{changed} of {total} weights changed"
    # Held in bfloat16, the same weights would show a change only where it crosses a rounding boundary
    # (a small share of them): the float32 copy is what keeps the rest.
    rounded = sum(int((after[n].bfloat16() != before[n].bfloat16()).sum()) for n in before)
    assert rounded / total < 0.1


def test_bf16_logprobs_agree_with_float32_within_bf16_rounding(tiny_model_path, batch) -> None:
    """The same weights scored in float32 and with bfloat16 compute: close (bf16 keeps 8 bits of
    mantissa), but not equal (the compute really is bf16)."""
    with Actor(tiny_model_path, "float32") as actor:
        exact = actor.compute_logprobs(batch)["logprobs"]
    with Actor(tiny_model_path, "bfloat16") as actor:
        mixed = actor.compute_logprobs(batch)["logprobs"]
    assert mixed.dtype == torch.float32
    mask = batch["response_mask"].bool()
    difference = (mixed - exact)[mask].abs().max().item()
    assert 0 < difference < 0.05, difference


def test_bf16_state_resumes_exactly_and_the_saved_model_is_bf16(tiny_model_path, batch, tmp_path) -> None:
    """A checkpoint holds the float32 weights and AdamW state: the steps after a load give the losses the
    run went on to give. The saved model is bfloat16 (config included), as transformers loads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    with Actor(tiny_model_path, "bfloat16", lr=1e-2) as actor:
        for _ in range(2):
            actor.train_step(batch)
        actor.save_state(str(tmp_path / "state"))
        expected = [actor.train_step(batch)["loss"] for _ in range(2)]
        actor.save_pretrained(str(tmp_path / "model"))
        actor.save_pretrained(str(tmp_path / "masters"), "float32")  # what a warm start hands RL
        masters = {name: local_tensor(p).detach().clone() for name, p in actor.model.named_parameters()}
    with Actor(tiny_model_path, "bfloat16", lr=1e-2) as actor:
        actor.load_state(str(tmp_path / "state"))
        got = [actor.train_step(batch)["loss"] for _ in range(2)]
    assert got == expected

    saved = FileSystemReader(str(tmp_path / "state" / "dcp")).read_metadata().state_dict_metadata
    dtypes = {meta.properties.dtype for key, meta in saved.items() if key.startswith("model.")}
    assert dtypes == {torch.float32}
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "masters", dtype="auto")
    assert json.loads((tmp_path / "masters" / "config.json").read_text())["dtype"] == "float32"
    assert all(torch.equal(p, masters[name]) for name, p in kept.named_parameters())  # not rounded


def test_a_bf16_lora_base_is_held_in_bf16_and_only_the_adapter_has_float32_masters(
    tiny_model_path, batch
) -> None:
    """A frozen base needs no master copy: held in the compute dtype it costs 2 bytes a weight, not 4
    (a 7B base: 14 GB, not 28), and computes exactly what a float32 base cast to bf16 at each gather
    did. The adapter's weights and Adam state stay float32, so small updates still land."""
    from roll.strategies.lora import LoraSpec

    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    with Actor(tiny_model_path, "bfloat16", lr=1e-2, lora=lora) as actor:
        assert actor.loaded()["how"] == "sharded"  # read by shards, the adapter drawn as peft draws it
        params = dict(actor.model.named_parameters())
        frozen = {local_tensor(p).dtype for p in params.values() if not p.requires_grad}
        trainable = {local_tensor(p).dtype for p in params.values() if p.requires_grad}
        base_before = actor.compute_reference_logprobs(batch)["logprobs"]
        before = weights(actor)
        actor.train_step(batch)
        after = weights(actor)
        state_dtypes = {v.dtype for s in actor.optimizer.state.values() for v in s.values() if v.dim() > 0}
        base_after = actor.compute_reference_logprobs(batch)["logprobs"]
    assert frozen == {torch.bfloat16} and trainable == {torch.float32} and state_dtypes == {torch.float32}
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved and all(".lora_" in n for n in moved), moved
    assert torch.equal(base_before, base_after)  # the base never trains
    with Actor(tiny_model_path, "bfloat16") as full:  # float32 masters, cast to bf16 for compute
        expected = full.compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(base_before, expected, atol=0, rtol=0)


def test_a_sync_sends_the_engines_dtype_except_an_adapter(tiny_model_path) -> None:
    """Weights travel in the inference dtype (rounded once, at the sender; half the bytes)."""
    with Actor(tiny_model_path, "float32", sync_dtype="bfloat16") as actor:
        plan = actor.weight_plan(1 << 20)
    assert {meta.dtype for bucket in plan for meta in bucket.tensors} == {torch.bfloat16}


@pytest.mark.usefixtures("at_repo_root")
@pytest.mark.parametrize(
    ("dtype", "inference_dtype", "tolerance"),
    [("float32", None, 1e-3), ("float32", "bfloat16", 0.1), ("bfloat16", "float32", 0.1)],
)
def test_the_probe_tolerance_follows_the_coarser_dtype(dtype, inference_dtype, tolerance) -> None:
    cfg = load_config("examples/quickstart.yaml", [f"model.dtype={dtype}"])
    model = ModelConfig(dtype=dtype, inference_dtype=inference_dtype)
    assert probe_spec(cfg.rollout, model).tolerance == tolerance


@pytest.mark.usefixtures("at_repo_root")
def test_each_role_gets_its_dtype() -> None:
    cfg = load_config("examples/quickstart.yaml", ["model.dtype=bfloat16", "model.inference_dtype=float32"])
    plan = plan_workers(cfg, "/model")
    assert plan.actor.model.dtype == "bfloat16" and plan.rollout.model.dtype == "float32"
    assert plan.actor.sync_dtype == "float32"


@pytest.mark.usefixtures("at_repo_root")
@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        ("examples/quickstart.yaml", ["model.dtype=float16"], "model.dtype: float16 training needs loss"),
        ("examples/sft.yaml", ["model.inference_dtype=bfloat16"], "model.inference_dtype: pipeline: sft"),
        (
            "examples/quickstart.yaml",
            ["rollout.hybrid_engine=true", "model.inference_dtype=bfloat16"],
            "model.inference_dtype: the hybrid engine",
        ),
    ],
)
def test_dtypes_that_would_not_do_what_they_say_are_refused_at_load(config, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(config, overrides)


@pytest.mark.usefixtures("at_repo_root")
def test_float16_inference_is_allowed() -> None:
    cfg = load_config("examples/quickstart.yaml", ["model.inference_dtype=float16"])
    assert cfg.model.inference() == "float16"
