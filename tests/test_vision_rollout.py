"""A tiny Qwen2-VL served by the hf engine and scored by the trainer's forward: image prompts generate,
and the engine's logprobs of what it sampled are the trainer's, padded and packed (M-RoPE positions,
pixel values and grids travel with the sample; roll.strategies.vision)."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from roll.config import load_config
from roll.config.agentic import AgentConfig
from roll.config.common import TinyModelConfig, TinyVisionConfig
from roll.data.batch import Batch
from roll.data.chat_turns import ChatTurns
from roll.data.images import IMAGES, ImagePrompts, ImageSource, VisionInputs
from roll.data.padding import left_pad
from roll.envs.frozen_lake import FrozenLake
from roll.models.loading import (
    end_of_sequence_ids,
    load_causal_lm,
    load_image_processor,
    load_tokenizer,
    placeholder_token_ids,
)
from roll.models.tiny import save_tiny_model
from roll.pipelines.preflight import (
    check_env_pictures,
    check_vision_pipeline,
    load_run_tokenizer,
    load_run_vision,
)
from roll.rollout.episode import Episode, EpisodeBudget, StopReason
from roll.rollout.episode_batch import trajectory_batch, turn_batch
from roll.strategies.hf_forward import response_logprobs
from roll.strategies.infer.hf import HFEngine
from roll.strategies.infer.vllm import vllm_prompt
from roll.strategies.requests import GenerateRequest, SamplingParams
from roll.strategies.vision import freeze_vision_tower, mrope_positions, placeholder_ids, vision_tower

TINY = TinyModelConfig(
    alphabet="0123456789 abcdefghijklmnopqrstuvwxyz?",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    vision=TinyVisionConfig(),
)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_model(TINY, tmp_path_factory.mktemp("vlm") / "model")


def picture(seed: int, size: tuple[int, int]) -> ImageSource:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand((*size, 3), generator=generator) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return ImageSource(data=out.getvalue())


def image_prompts(tokenizer, vision: ImagePrompts) -> tuple[list[list[int]], list]:
    """Four prompts: one image, two square images, two images of other shapes, and text only. A square
    image's 4 tokens take 2 positions, so the text after it runs 2 positions behind its index."""
    rows = [
        ([picture(0, (56, 56))], "what?"),
        ([picture(3, (56, 56)), picture(4, (56, 56))], "both?"),
        ([picture(1, (40, 56)), picture(2, (56, 28))], "and?"),
        ([], "text only"),
    ]
    ids, inputs = [], []
    for images, text in rows:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        raw = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        ids.append(
            vision.expand(raw, [vision.tokens_per_image(i) for i in images], "test") if images else raw
        )
        inputs.append(vision.inputs(images) if images else None)
    return ids, inputs


def sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its text attention's queries and keys scaled up: a random tiny model attends almost
    uniformly, so a wrong position would change nothing; this one's scores depend on every position."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "language_model" in name and ("q_proj" in name or "k_proj" in name):
                parameter.mul_(12.0)
    return model


def test_the_engine_samples_from_images_with_the_trainers_logprobs(vlm_dir):
    tokenizer = load_tokenizer(vlm_dir)
    vision = ImagePrompts(load_image_processor(vlm_dir), tokenizer)
    model = sharpened(load_causal_lm(vlm_dir))
    ids, inputs = image_prompts(tokenizer, vision)
    prompt_ids, prompt_mask = left_pad(ids, tokenizer.pad_token_id)
    batch = Batch(
        tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}, non_tensors={IMAGES: inputs}
    )
    engine = HFEngine(model, tokenizer)
    try:
        torch.manual_seed(0)
        generated = engine.generate(batch, SamplingParams(max_new_tokens=16, temperature=1.0))
    finally:
        engine.shutdown()
    scored = batch.union(generated)
    mask = scored["response_mask"].bool()
    # Sampled at temperature 1: the two-square-image row decodes many tokens at positions 4 behind its
    # index (a decode that forgot the offset would score them otherwise).
    _, offsets = mrope_positions(model, prompt_ids, prompt_mask, VisionInputs.concat(inputs))
    assert offsets.tolist() == [-2, -4, 0, 0] and mask[1].sum() >= 8, (offsets, mask.sum(dim=1))
    logprobs, _ = response_logprobs(model, scored)
    assert torch.allclose(logprobs[mask], scored["rollout_logprobs"][mask], atol=1e-5)

    packed_model = sharpened(load_causal_lm(vlm_dir, attn_implementation="sdpa_varlen"))
    packed, _ = response_logprobs(packed_model, scored)
    assert torch.allclose(packed[mask], logprobs[mask], atol=1e-5)

    # The pictures are read: the first row scored with another picture of its shape changes, alone.
    swapped = Batch(tensors=dict(scored.tensors), non_tensors=dict(scored.non_tensors))
    swapped[IMAGES] = [vision.inputs([picture(7, (56, 56))]), *inputs[1:]]
    changed, _ = response_logprobs(model, swapped)
    assert (changed[0] - logprobs[0])[mask[0]].abs().max() > 1e-4
    assert torch.allclose(changed[1:][mask[1:]], logprobs[1:][mask[1:]], atol=1e-6)


def test_the_vision_tower_freezes_and_a_text_model_has_none(vlm_dir, tmp_path):
    model = load_causal_lm(vlm_dir)
    tower = vision_tower(model)
    assert tower is not None and freeze_vision_tower(model) == sum(p.numel() for p in tower.parameters())
    assert not any(p.requires_grad for p in tower.parameters())
    text_weights = [p for name, p in model.named_parameters() if "visual" not in name]
    assert text_weights and all(p.requires_grad for p in text_weights)
    text_model = load_causal_lm(save_tiny_model(TinyModelConfig(), tmp_path / "text"))
    assert vision_tower(text_model) is None and freeze_vision_tower(text_model) == 0


def test_vllm_gets_the_expanded_ids_and_the_images_in_placeholder_order(vlm_dir):
    """vLLM is not run with images here (its Qwen2-VL needs torchvision): what it would be given is."""
    tokenizer, vision = (
        load_tokenizer(vlm_dir),
        ImagePrompts(load_image_processor(vlm_dir), load_tokenizer(vlm_dir)),
    )
    ids, inputs = image_prompts(tokenizer, vision)
    request = GenerateRequest("r", ids[2], SamplingParams(max_new_tokens=2), vision=inputs[2])
    prompt = vllm_prompt(request, version=3)
    assert prompt["prompt_token_ids"] == ids[2] and prompt["cache_salt"] == "roll-weights-3"
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(56, 40), (28, 56)]
    text = vllm_prompt(GenerateRequest("t", ids[3], SamplingParams(max_new_tokens=2)), version=0)
    assert "multi_modal_data" not in text
    # Batched, the images stay with their prompts' order.
    both = VisionInputs.concat([inputs[0], None, inputs[2]])
    assert [source.data for source in both.sources] == [
        s.data for s in (*inputs[0].sources, *inputs[2].sources)
    ]
    model = load_causal_lm(vlm_dir)
    assert placeholder_token_ids(vlm_dir) == placeholder_ids(model) and len(placeholder_ids(model)) == 2


def with_vllm(cfg):
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "needs torchvision"),  # rollout.engine: vllm (set below: vLLM is not installed here)
        (["critic.lr=1e-4", "algorithm.advantage_estimator=gae"], "critic: a value model"),
        (
            ["actor.world_size=2", "actor.sequence_parallel_size=2", "model.attn_implementation=sdpa_varlen"],
            "actor.sequence_parallel_size",
        ),
    ],
)
def test_what_images_cannot_go_through_yet_is_refused_before_the_run(at_repo_root, overrides, expected):
    cfg = load_config("examples/vlm_shapes.yaml", overrides)
    vision = load_run_vision(cfg.model, load_run_tokenizer(cfg.model))
    assert vision is not None and check_vision_pipeline(load_config("examples/vlm_shapes.yaml"), vision) == []
    if not overrides:
        cfg = with_vllm(cfg)
    problems = check_vision_pipeline(cfg, vision)
    assert len(problems) == 1 and expected in problems[0], problems


def test_vllm_with_images_is_let_through_where_torchvision_is_installed(at_repo_root, monkeypatch):
    cfg = with_vllm(load_config("examples/vlm_shapes.yaml"))
    vision = load_run_vision(cfg.model, load_run_tokenizer(cfg.model))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "torchvision" else real(name, *a)
    )
    assert check_vision_pipeline(cfg, vision) == []
    dpo = SimpleNamespace(pipeline="dpo", model=cfg.model)
    assert "pipeline: dpo does not take a vision-language model" in check_vision_pipeline(dpo, vision)[0]


def play_pictures(engine: HFEngine, episode: Episode, params: SamplingParams) -> Episode:
    """One episode on the engine, each turn generated with the pictures of its context."""
    episode.start()
    while (request := episode.next_request()) is not None:
        context, _ = request
        vision = episode.vision_inputs(episode.turn_images(len(episode.turns)))
        request_id = f"s{episode.seed}h{episode.history_turns}t{len(episode.turns)}"
        engine.submit(GenerateRequest(request_id, context, params, vision=vision))
        result = engine.await_result(request_id, 60.0)
        episode.add_turn(result.token_ids, result.logprobs, [0] * len(result.token_ids), result.finish_reason)
    return episode


def test_episodes_of_pictures_train_on_the_logprobs_the_engine_sampled_with(tmp_path):
    """FrozenLake as pictures, multi-turn: each observation's picture sits among the response's ids
    (trajectory-wise) or in a turn's window (step-wise), and the trainer scores every sampled token as the
    engine did; the pictures' own positions score 0 and nothing overflows."""
    vlm_dir = save_tiny_model(dataclasses.replace(TINY, max_position_embeddings=512), tmp_path / "model")
    tokenizer = load_tokenizer(vlm_dir)
    vision = ImagePrompts(load_image_processor(vlm_dir), tokenizer)
    # Every character ends a turn (one token a turn, none of them an action: each turn is invalid, and
    # the env answers with the same picture, so the episode runs to max_turns).
    letters = tokenizer.convert_tokens_to_ids(list("0123456789abcdefghijklmnopqrstuvwxyz?"))
    stops = [*end_of_sequence_ids(tokenizer), *letters]
    chat = ChatTurns(tokenizer, stops, vision=vision)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=tuple(letters))
    budget = EpisodeBudget(max_turns=4, max_tokens_per_turn=3, max_context_tokens=400)
    model = sharpened(load_causal_lm(vlm_dir))
    engine = HFEngine(model, tokenizer)
    try:
        torch.manual_seed(0)
        whole = play_pictures(engine, Episode(FrozenLake(render="image"), 3, chat, budget), params)
        windows = play_pictures(engine, Episode(FrozenLake(render="image"), 5, chat, budget, 1), params)
    finally:
        engine.shutdown()
    per_picture = 4  # 112x112 resized to the tiny processor's 56x56: 16 patches, 4 tokens
    assert whole.stop_reason == StopReason.MAX_TURNS and len(whole.turns) == 4
    assert whole.prompt_ids.count(vision.image_token_id) == per_picture
    assert whole.response_ids.count(vision.image_token_id) == 3 * per_picture  # after turns 1-3
    assert [len(whole.turn_images(k)) for k in range(4)] == [1, 2, 3, 4] and len(whole.images()) == 4
    assert [len(windows.turn_images(k)) for k in range(4)] == [1, 2, 2, 2]  # its picture, then the last one

    pad = tokenizer.pad_token_id
    for batch in (
        trajectory_batch([whole], [0], ["w"], {}, pad),
        turn_batch([whole, windows], [0, 1], ["w", "s"], {}, pad),
    ):
        trained = batch["loss_mask"].bool()
        logprobs, _ = response_logprobs(model, batch)
        assert torch.isfinite(logprobs).all() and trained.sum() >= 4
        assert torch.allclose(logprobs[trained], batch["rollout_logprobs"][trained], atol=1e-5)
        pictured = batch["response_ids"] == vision.image_token_id
        assert (logprobs[pictured] == 0).all()
    # The positions matter: trajectory-wise, the text after the first picture runs 2 positions behind.
    _, offsets = mrope_positions(
        model,
        torch.tensor([whole.prompt_ids]),
        torch.ones(1, len(whole.prompt_ids)),
        whole.vision_inputs(whole.prompt_images),
    )
    assert offsets.tolist() == [-2]


def test_an_env_of_pictures_needs_a_vision_language_model_and_agent_programs_take_none_yet(at_repo_root):
    text_run = load_config("examples/agentic_frozenlake.yaml")
    pictured = dataclasses.replace(
        text_run, env=dataclasses.replace(text_run.env, options={"render": "image"})
    )
    (problem,) = check_env_pictures(pictured, None)
    assert "env: frozen_lake shows pictures, and the tiny model is a text-only model" in problem
    assert check_env_pictures(text_run, None) == []
    cfg = load_config("examples/agentic_frozenlake_vlm.yaml")
    vision = load_run_vision(cfg.model, load_run_tokenizer(cfg.model))
    assert check_vision_pipeline(cfg, vision) == [] and check_env_pictures(cfg, vision) == []
    agent = dataclasses.replace(cfg, agent=AgentConfig(entrypoint="agent:run", tasks="tasks.jsonl"))
    assert "agent: agent programs get no pictures" in check_vision_pipeline(agent, vision)[0]


def test_lora_on_the_text_layers_with_bf16_trains_on_image_prompts_and_syncs_to_the_engine(vlm_dir, tmp_path):
    """LoRA and bf16 compute take image prompts as text ones: only the text layers' adapters train (the
    vision tower stays as loaded), bf16 scores the pictures within its rounding of float32, the reference
    is the base with the adapter off, the adapter merged into an engine scores as the actor does, and the
    saved adapter is peft's on the plain transformers model (the sharded load maps the files' names)."""
    from roll.strategies.lora import LoraSpec, outgoing_weights
    from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
    from roll.workers.base import ModelSpec

    tokenizer = load_tokenizer(vlm_dir)
    vision = ImagePrompts(load_image_processor(vlm_dir), tokenizer)
    ids, inputs = image_prompts(tokenizer, vision)
    prompt_ids, prompt_mask = left_pad(ids, tokenizer.pad_token_id)
    batch = Batch(
        tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}, non_tensors={IMAGES: inputs}
    )
    base = sharpened(load_causal_lm(vlm_dir))
    engine = HFEngine(base, tokenizer)
    try:
        torch.manual_seed(0)
        batch = batch.union(engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=1.0)))
    finally:
        engine.shutdown()
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]) * mask
    batch["group_index"] = torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        exact, _ = response_logprobs(load_causal_lm(vlm_dir), batch)

    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    spec = ActorSpec(
        model=ModelSpec(path=str(vlm_dir), dtype="bfloat16"),
        optimizer=OptimizerSpec(lr=5e-2, total_steps=10),
        micro_batch_size=2,
        lora=lora,
    )
    worker = ActorWorker("actor", 0, 1, spec)
    worker.setup()
    try:
        trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n and "language_model" in n for n in trainable), trainable
        tower_before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if "visual" in n}
        trained = batch["response_mask"].bool()
        mixed = worker.compute_logprobs(batch)["logprobs"]
        difference = (mixed - exact)[trained].abs().max().item()
        assert 0 < difference < 0.1, difference
        for _ in range(2):
            worker.train_step(batch)
        after = dict(worker.model.named_parameters())
        assert tower_before and all(torch.equal(after[n], p) for n, p in tower_before.items())
        moved = worker.compute_logprobs(batch)["logprobs"]
        assert (moved - mixed)[trained].abs().max() > 1e-2
        reference = worker.compute_reference_logprobs(batch)["logprobs"]
        assert (reference - exact)[trained].abs().max() < 0.1

        sent = {w.name: w.gather().float() for w in outgoing_weights(worker.model, "adapter")}
        assert sent and all("language_model" in name for name in sent)
        served = HFEngine(load_causal_lm(vlm_dir), tokenizer)
        try:
            with served.weight_update(1):
                served.load_adapter(sent)
            merged, _ = response_logprobs(served._model, batch)
        finally:
            served.shutdown()
        # The engine in float32, the actor in bf16: they agree to bf16's rounding, and both moved.
        assert (merged - moved)[trained].abs().max() < 0.1
        assert (merged - exact)[trained].abs().max() > 1e-2

        # The saved adapter is peft's, on the plain transformers model.
        from peft import PeftModel
        from transformers import AutoModelForImageTextToText

        saved = worker.save_pretrained(str(tmp_path / "adapter"))
        plain = AutoModelForImageTextToText.from_pretrained(str(vlm_dir))
        with torch.no_grad():
            played, _ = response_logprobs(PeftModel.from_pretrained(plain, saved), batch)
        assert (played - merged)[trained].abs().max() < 1e-5
    finally:
        worker.shutdown()
