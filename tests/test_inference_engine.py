"""The inference-engine contract on the Hugging Face engine (no Ray), and the request load balancer."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from roll.data.batch import Batch
from roll.data.padding import left_pad
from roll.models.loading import load_causal_lm
from roll.rollout.load_balancer import LoadBalancer
from roll.strategies import hf_generate
from roll.strategies.infer import INFERENCE_ENGINES
from roll.strategies.infer.hf import HFEngine
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutSpec

GREEDY = SamplingParams(max_new_tokens=8, greedy=True)
# Far above any wait's need, even on a loaded machine: only reached when something is broken, and then
# the test fails instead of hanging.
WAIT_S = 120.0


@pytest.fixture
def engine(model, tokenizer) -> Iterator[HFEngine]:
    engine = HFEngine(model, tokenizer, "cpu")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    # Different lengths, so batching has to left-pad.
    return [tokenizer.encode(text) for text in ("12+3", "7+", "99+11", "4")]


def as_batch(prompts: list[list[int]], pad_id: int) -> Batch:
    ids, mask = left_pad(prompts, pad_id)
    return Batch(tensors={"prompt_ids": ids, "prompt_mask": mask})


def row_result(out: Batch, row: int) -> tuple[list[int], list[float], str]:
    """Row ``row`` of a batch-generate output in the shape of a GenerateResult (padding removed)."""
    length = int(out["response_mask"][row].sum())
    return (
        out["response_ids"][row, :length].tolist(),
        out["rollout_logprobs"][row, :length].tolist(),
        out["finish_reason"][row],
    )


class ForwardGate:
    """Pauses the model's forward pass: the ``call``-th forward with ``batch_size`` rows waits until the
    test releases it. Lets a test act (abort, time out) at a known point of a generation."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._calls: dict[int, int] = {}
        self._pauses: dict[tuple[int, int], tuple[threading.Event, threading.Event]] = {}
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def pause(self, batch_size: int, call: int) -> tuple[threading.Event, threading.Event]:
        """(reached, release): ``reached`` is set when that forward starts; it then waits for ``release``."""
        events = (threading.Event(), threading.Event())
        self._pauses[(batch_size, call)] = events
        return events

    def _hook(self, module, args, kwargs):
        size = kwargs["input_ids"].shape[0]
        self._calls[size] = self._calls.get(size, 0) + 1
        events = self._pauses.get((size, self._calls[size]))
        if events is not None:
            events[0].set()
            events[1].wait(WAIT_S)

    def remove(self) -> None:
        self._handle.remove()


# ----- transformers' per-row stopping, which abort relies on ------------------------------------------


class RecordingCriterion(StoppingCriteria):
    """Records the sequences it is called with; stops ``rows`` from call ``stop_from`` on."""

    def __init__(self, rows: list[int], stop_from: int) -> None:
        self.rows, self.stop_from, self.seen = rows, stop_from, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.clone())
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        if len(self.seen) >= self.stop_from:
            stop[self.rows] = True
        return stop


def test_stopping_criterion_runs_once_per_token_on_full_sequences_and_stops_single_rows(
    model, tokenizer, prompts
) -> None:
    batch = as_batch(prompts[:2], tokenizer.pad_token_id)
    prompt_length = batch["prompt_ids"].shape[1]
    plain = hf_generate.generate(model, batch, GREEDY, tokenizer.eos_token_id, tokenizer.pad_token_id)

    criterion = RecordingCriterion(rows=[0], stop_from=2)
    out = hf_generate.generate(
        model,
        batch,
        GREEDY,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        stopping_criteria=StoppingCriteriaList([criterion]),
    )
    # One call per new token, each with the whole batch: prompt columns plus every token so far.
    assert [seq.shape for seq in criterion.seen] == [
        (2, prompt_length + k) for k in range(1, len(criterion.seen) + 1)
    ]
    assert all(torch.equal(seq[:, :prompt_length], batch["prompt_ids"]) for seq in criterion.seen)
    assert torch.equal(criterion.seen[-1][:, prompt_length:], out["response_ids"][:, : len(criterion.seen)])
    # Row 0 keeps the token of the stopping call and is fed pad tokens after it; row 1 runs on untouched.
    assert out["response_ids"][0, :2].tolist() == plain["response_ids"][0, :2].tolist()
    assert set(out["response_ids"][0, 2:].tolist()) <= {tokenizer.pad_token_id}
    assert row_result(out, 1)[0] == row_result(plain, 1)[0]

    # Once every row is stopped, generate returns early.
    criterion = RecordingCriterion(rows=[0, 1], stop_from=3)
    hf_generate.generate(
        model,
        batch,
        GREEDY,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        stopping_criteria=StoppingCriteriaList([criterion]),
    )
    assert len(criterion.seen) == 3


# ----- the request path -------------------------------------------------------------------------------


# transformers renamed the cache argument (``past_key_values`` warns, and goes in 5.40): the engine uses
# whichever the model's forward takes, so no FutureWarning, here an error, reaches a request.
@pytest.mark.filterwarnings("error::FutureWarning")
def test_greedy_requests_match_batch_generate(engine, tokenizer, prompts) -> None:
    expected = engine.generate(as_batch(prompts, tokenizer.pad_token_id), GREEDY)
    for i, prompt in enumerate(prompts):
        engine.submit(GenerateRequest(f"r{i}", prompt, GREEDY))
    for i in range(len(prompts)):
        result = engine.await_result(f"r{i}", timeout_s=WAIT_S)
        tokens, logprobs, reason = row_result(expected, i)
        assert result.request_id == f"r{i}"
        assert result.token_ids == tokens
        assert result.finish_reason == reason
        assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4)


def test_an_sdpa_varlen_model_generates_as_the_sdpa_one(tiny_model_path: str, tokenizer, prompts) -> None:
    """``model.attn_implementation: sdpa_varlen`` reaches rollout workers too: a lone prompt's prefill
    (one row, no padding, no past: the unmasked path) and batched, cached decoding give sdpa's tokens and
    logprobs."""
    results = {}
    for kernel in ("sdpa", "sdpa_varlen"):
        engine = HFEngine(load_causal_lm(tiny_model_path, attn_implementation=kernel), tokenizer, "cpu")
        try:
            lone = [engine.generate(as_batch([p], tokenizer.pad_token_id), GREEDY) for p in prompts]
            together = engine.generate(as_batch(prompts, tokenizer.pad_token_id), GREEDY)
            results[kernel] = [row_result(out, 0) for out in lone] + [
                row_result(together, i) for i in range(len(prompts))
            ]
        finally:
            engine.shutdown()
    for (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) in zip(
        results["sdpa_varlen"], results["sdpa"]
    ):
        assert (tokens, reason) == (want_tokens, want_reason)
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5)


def test_sampled_request_matches_batch_generate_under_the_same_seed(engine, tokenizer, prompts) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9)
    torch.manual_seed(123)
    expected = engine.generate(as_batch(prompts[:1], tokenizer.pad_token_id), params)
    torch.manual_seed(123)  # the engine thread draws from the same global generator
    engine.submit(GenerateRequest("sampled", prompts[0], params))
    result = engine.await_result("sampled", timeout_s=WAIT_S)
    tokens, logprobs, reason = row_result(expected, 0)
    assert (result.token_ids, result.finish_reason) == (tokens, reason)
    assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4)


def test_batch_generate_is_hf_generate(engine, model, tokenizer, prompts) -> None:
    batch = as_batch(prompts, tokenizer.pad_token_id)
    ours = engine.generate(batch, GREEDY)
    theirs = hf_generate.generate(
        model, batch, GREEDY, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer
    )
    assert ours.keys() == theirs.keys()
    for key in ("response_ids", "response_mask"):
        assert torch.equal(ours[key], theirs[key])
    # Same math, different kernels (a decode loop over SlotCache vs generate over DynamicCache).
    assert torch.allclose(ours["rollout_logprobs"], theirs["rollout_logprobs"], atol=1e-5)
    assert ours["finish_reason"] == theirs["finish_reason"]
    assert ours["response_text"] == theirs["response_text"]


def test_requests_with_different_params_and_from_many_threads(engine, prompts) -> None:
    short = SamplingParams(max_new_tokens=3, greedy=True)

    def submit_some(worker: int) -> None:
        for i, prompt in enumerate(prompts):
            engine.submit(GenerateRequest(f"w{worker}-{i}", prompt, short if i % 2 else GREEDY))

    threads = [threading.Thread(target=submit_some, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = {
        (w, i): engine.await_result(f"w{w}-{i}", timeout_s=WAIT_S)
        for w in range(4)
        for i in range(len(prompts))
    }
    for (w, i), result in results.items():
        assert result.request_id == f"w{w}-{i}"
        assert result.token_ids == results[(0, i)].token_ids
        assert len(result.token_ids) == (3 if i % 2 else 8)


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["own-pad", "pad-is-eos"])
def test_abort_queued_and_running_requests(pad_is_eos, model, tokenizer, prompts) -> None:
    # With pad == EOS (many tokenizers) an aborted row, fed pads after its cut, looks like one ending in EOS.
    if pad_is_eos:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.pad_token = tokenizer.eos_token
    engine = HFEngine(model, tokenizer, "cpu")
    reference = engine.generate(as_batch(prompts[1:3], tokenizer.pad_token_id), GREEDY)
    gate = ForwardGate(model)
    blocker_paused, blocker_go = gate.pause(batch_size=1, call=1)
    # The third forward of the two-request batch computes its third token: abort lands right before it.
    pair_paused, pair_go = gate.pause(batch_size=2, call=3)
    try:
        engine.submit(GenerateRequest("blocker", prompts[0], SamplingParams(max_new_tokens=1, greedy=True)))
        assert blocker_paused.wait(WAIT_S)
        # The engine is busy with the blocker, so these queue up and then run as one batch.
        for name, prompt in (("a", prompts[1]), ("b", prompts[2]), ("queued", prompts[3])):
            engine.submit(GenerateRequest(name, prompt, GREEDY))
        assert engine.abort("queued")
        assert engine.await_result("queued", timeout_s=0) == GenerateResult("queued", [], [], "abort")
        blocker_go.set()

        assert pair_paused.wait(WAIT_S)
        assert engine.abort("a")
        pair_go.set()
        aborted = engine.await_result("a", timeout_s=WAIT_S)
        # "a" left the batch at its cut; "b" decodes on alone to its natural end.
        completed = engine.await_result("b", timeout_s=WAIT_S)
        assert not engine.abort("b")  # finished and collected
    finally:
        blocker_go.set()
        pair_go.set()
        gate.remove()
        engine.shutdown()

    full_a, full_a_logprobs, _ = row_result(reference, 0)
    assert aborted.finish_reason == "abort"
    assert len(aborted.token_ids) == 3 < GREEDY.max_new_tokens
    assert aborted.token_ids == full_a[:3]
    assert torch.allclose(torch.tensor(aborted.logprobs), torch.tensor(full_a_logprobs[:3]), atol=1e-4)
    tokens, _, reason = row_result(reference, 1)
    assert (completed.token_ids, completed.finish_reason) == (tokens, reason)
    # Finished, collected or never seen: nothing to abort.
    assert not engine.abort("a")
    assert not engine.abort("never-submitted")


def test_await_timeout_names_the_request_and_the_request_keeps_running(engine, model, prompts) -> None:
    gate = ForwardGate(model)
    paused, go = gate.pause(batch_size=1, call=1)
    try:
        engine.submit(GenerateRequest("slow", prompts[0], GREEDY))
        assert paused.wait(WAIT_S)
        with pytest.raises(TimeoutError, match="'slow'"):
            engine.await_result("slow", timeout_s=0.05)
        go.set()
        assert len(engine.await_result("slow", timeout_s=WAIT_S).token_ids) > 0
    finally:
        go.set()
        gate.remove()
    with pytest.raises(KeyError, match="'slow'"):
        engine.await_result("slow", timeout_s=0)


def test_request_validation(engine, prompts) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        GenerateRequest("empty", [], GREEDY)
    engine.submit(GenerateRequest("twice", prompts[0], GREEDY))
    with pytest.raises(ValueError, match="'twice'"):
        engine.submit(GenerateRequest("twice", prompts[0], GREEDY))
    engine.await_result("twice", timeout_s=WAIT_S)
    engine.submit(GenerateRequest("twice", prompts[0], GREEDY))  # collected, so the id is free again
    engine.await_result("twice", timeout_s=WAIT_S)


def test_failed_generation_reaches_the_caller(engine) -> None:
    engine.submit(GenerateRequest("bad", [10_000], GREEDY))  # past the vocabulary: the embedding fails
    with pytest.raises(RuntimeError, match="'bad' failed") as info:
        engine.await_result("bad", timeout_s=WAIT_S)
    assert isinstance(info.value.__cause__, IndexError)
    engine.submit(GenerateRequest("good", [3], GREEDY))  # and the engine keeps serving
    assert engine.await_result("good", timeout_s=WAIT_S).finish_reason in ("stop", "length")


def test_release_and_reacquire_on_cpu(engine, tokenizer, prompts) -> None:
    batch = as_batch(prompts, tokenizer.pad_token_id)
    before = engine.generate(batch, GREEDY)
    released = engine.release_memory()
    assert released["bytes"] == 0.0 and released["seconds"] >= 0.0
    with pytest.raises(RuntimeError, match="reacquire_memory"):
        engine.generate(batch, GREEDY)
    with pytest.raises(RuntimeError, match="reacquire_memory"):
        engine.submit(GenerateRequest("while-released", prompts[0], GREEDY))
    assert engine.reacquire_memory()["bytes"] == 0.0
    assert torch.equal(engine.generate(batch, GREEDY)["response_ids"], before["response_ids"])
    engine.submit(GenerateRequest("after", prompts[0], GREEDY))
    assert engine.await_result("after", timeout_s=WAIT_S).token_ids == row_result(before, 0)[0]


def test_shutdown_aborts_queued_requests_and_refuses_new_ones(engine, model, prompts) -> None:
    gate = ForwardGate(model)
    paused, go = gate.pause(batch_size=1, call=1)
    shutting_down = threading.Thread(target=engine.shutdown)
    try:
        engine.submit(GenerateRequest("running", prompts[0], GREEDY))
        assert paused.wait(WAIT_S)
        engine.submit(GenerateRequest("queued", prompts[1], SamplingParams(max_new_tokens=4, greedy=True)))
        shutting_down.start()
        # Shutdown aborts the queued request at once, and marks the running one in the same step ...
        queued = engine.await_result("queued", timeout_s=WAIT_S)
        go.set()  # ... then waits for the running batch, which stops after the step in progress.
        shutting_down.join(WAIT_S)
        assert not shutting_down.is_alive(), "shutdown did not return"
    finally:
        go.set()
        gate.remove()
    assert queued == GenerateResult("queued", [], [], "abort")
    running = engine.await_result("running", timeout_s=0)
    assert running.finish_reason == "abort" and 1 <= len(running.token_ids) < GREEDY.max_new_tokens, running
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(GenerateRequest("late", prompts[0], GREEDY))
    engine.shutdown()  # idempotent


# ----- weights ----------------------------------------------------------------------------------------


def test_load_weights_switches_outputs_to_the_other_model(
    engine, tokenizer, prompts, other_model_path
) -> None:
    other = load_causal_lm(other_model_path)
    batch = as_batch(prompts, tokenizer.pad_token_id)
    before = engine.generate(batch, GREEDY)
    expected = hf_generate.generate(other, batch, GREEDY, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert not torch.allclose(before["rollout_logprobs"], expected["rollout_logprobs"])

    # The tied LM head may be left out; here the weights also arrive as a stream of pairs.
    state = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(iter(state.items()))
    after = engine.generate(batch, GREEDY)
    assert torch.equal(after["response_ids"], expected["response_ids"])
    assert torch.allclose(after["rollout_logprobs"], expected["rollout_logprobs"], atol=1e-6)
    engine.submit(GenerateRequest("new-weights", prompts[0], GREEDY))
    assert engine.await_result("new-weights", timeout_s=WAIT_S).token_ids == row_result(expected, 0)[0]


def test_load_weights_rejects_unknown_names_and_shapes_without_copying(
    engine, model, tokenizer, prompts
) -> None:
    batch = as_batch(prompts, tokenizer.pad_token_id)
    before = engine.generate(batch, GREEDY)
    bad = {
        "model.norm.weight": torch.zeros_like(model.model.norm.weight),
        "not.a.weight": torch.zeros(3),
        "model.embed_tokens.weight": torch.zeros(2, 2),
    }
    with pytest.raises(ValueError, match=r"not\.a\.weight") as info:
        engine.load_weights(bad)
    assert "model.embed_tokens.weight (2, 2)" in str(info.value)
    # A Mapping is checked before anything is copied: the valid norm weight was not applied either.
    assert torch.equal(engine.generate(batch, GREEDY)["rollout_logprobs"], before["rollout_logprobs"])


# ----- registry ---------------------------------------------------------------------------------------


def test_registry_builds_the_hf_engine_from_a_rollout_spec(tiny_model_path: str, tokenizer) -> None:
    """The engine loads the model itself, in the spec's dtype, with the spec's options."""
    assert {"hf", "vllm"} <= set(INFERENCE_ENGINES)
    spec = RolloutSpec(ModelSpec(tiny_model_path, dtype="bfloat16"), max_running_requests=3)
    engine = INFERENCE_ENGINES.get("hf")(spec, tokenizer, "cpu")
    try:
        assert isinstance(engine, HFEngine) and engine._capacity == 3  # noqa: SLF001
        assert next(engine.model.parameters()).dtype == torch.bfloat16 and not engine.model.training
    finally:
        engine.shutdown()
    with pytest.raises(KeyError, match="unknown inference engine 'hff'. Did you mean 'hf'"):
        INFERENCE_ENGINES.get("hff")


# ----- load balancer ----------------------------------------------------------------------------------


def test_load_balancer_picks_least_loaded_lowest_index() -> None:
    balancer = LoadBalancer(3)
    assert [balancer.assign(f"r{i}") for i in range(5)] == [0, 1, 2, 0, 1]
    assert balancer.in_flight() == [2, 2, 1]
    assert balancer.finish("r1") == 1
    assert balancer.in_flight() == [2, 1, 1]
    assert balancer.assign("r5") == 1  # ties between 1 and 2 go to the lower index
    assert balancer.worker_of("r5") == 1
    assert balancer.worker_of("r1") is None
    assert balancer.num_workers == 3


def test_load_balancer_rejects_duplicates_and_unknown_ids() -> None:
    balancer = LoadBalancer(2)
    balancer.assign("x")
    with pytest.raises(ValueError, match="'x' is already in flight on worker 0"):
        balancer.assign("x")
    assert balancer.finish("x") == 0
    with pytest.raises(KeyError, match="'x' is not in flight"):
        balancer.finish("x")
    assert balancer.assign("x") == 0  # a finished id may be reused
    with pytest.raises(ValueError, match="at least one worker"):
        LoadBalancer(0)
