"""Sharded loading (``roll.strategies.sharded_load``) on one bf16 rank, in this process: the shard read from
the files is the checkpoint itself, buffers and the generation config are the model's, a tied head stays
tied, and a checkpoint that lacks a weight is refused before anything is read. (Two ranks, each reading
half: ``tests/test_workers.py::test_two_rank_fsdp_training_equals_one_rank``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from in_process_actor import Actor
from safetensors.torch import load_file, save_file

from roll.models.loading import build_causal_lm, load_causal_lm
from roll.strategies.fsdp import local_tensor
from roll.strategies.sharded_load import checkpoint_index, load_sharded


def test_a_sharded_rank_holds_the_checkpoint_its_buffers_and_generation_config(tiny_model_path) -> None:
    reference = load_causal_lm(tiny_model_path)
    with Actor(tiny_model_path, "bfloat16") as actor:
        assert actor.loaded()["how"] == "sharded"
        model = actor.model
        params = {name: local_tensor(p).detach() for name, p in model.named_parameters()}
        assert params.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            assert torch.equal(params[name], p), name
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the config says
        for name, buffer in reference.named_buffers():
            assert torch.equal(dict(model.named_buffers())[name], buffer), name  # rotary tables rebuilt
        assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id


def test_a_checkpoint_lacking_a_weight_is_refused_before_anything_is_read(tiny_model_path, tmp_path) -> None:
    tensors = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(tiny_model_path) / "config.json").read_text())
    index = checkpoint_index(tmp_path)
    assert index is not None and "model.norm.weight" not in index
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\) of the model, e.g. \['model.norm.weight'\]"):
        load_sharded(lambda: build_causal_lm(str(tmp_path)), tmp_path, index, torch.device("cpu"), None)
    assert checkpoint_index(tmp_path / "nothing-here") is None
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
