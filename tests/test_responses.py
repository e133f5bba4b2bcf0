"""`POST /v1/responses` on `rollmarket serve-model` and through `rollmarket proxy`, with the official client.

One real model server (tiny-dense, fp32) and one proxy in front of it, on loopback. What the
tests protect: the Responses input renders to the same prompt as the equivalent chat messages
(checked against the tokenizer's own chat template); NeMo Gym's token fields line up one to one
with the text and agree with what chat completions generates; tool calls become
``function_call`` items (driven by the echo engine, since random weights write none); bad bodies
are OpenAI-shaped 400s; the proxy records a Responses call with its tokens and strips what it
added; a multi-turn conversation, continued by `previous_response_id` or by repeating the output
items, is captured as one conversation whose prompts are the served ones; a stream's deltas carry
the tokens and logprobs the final response carries, and its capture equals the whole call's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest
import transformers
from helpers import ServiceProcess, wait_until
from test_proxy import ProxyProcess
from test_serve import CALCULATOR, CALL_TEXT, chat_ids, echo  # noqa: F401  (echo is a fixture)

from rollmarket.localhost import free_port

DENSE = Path(__file__).resolve().parents[1] / "models" / "tiny-dense"
RL = {"return_token_ids": True}
TOOL = {"type": "function", **CALCULATOR["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def server(workdir):
    assert (DENSE / "config.json").exists(), f"{DENSE} is missing; rebuild with `rollmarket models build`"
    port = free_port()
    process = ServiceProcess([sys.executable, "-m", "rollmarket", "serve-model", str(DENSE), "--port", str(port),
                              "--precision", "fp32", "--device", "cpu"], workdir / "serve.log", port,
                             env={"OMP_NUM_THREADS": "1"})
    process.start(timeout=180)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def proxy(server, workdir):
    process = ProxyProcess(server.url, workdir / "captures.db", workdir / "proxy.log")
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DENSE, local_files_only=True)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def training_fields(item) -> dict:
    extra = item.model_extra or {}
    return {k: extra.get(k) for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}


def test_tokens_logprobs_and_text_line_up_and_match_chat(server, tokenizer):
    c = client(server.url)
    resp = c.responses.create(model=DENSE.name, input="What is 17 * 23?", instructions="Answer with a number.",
                              max_output_tokens=10, temperature=0, include=["message.output_text.logprobs"],
                              top_logprobs=2, extra_body=RL)
    assert resp.object == "response" and resp.model == DENSE.name
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    fields = training_fields(message)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 17 * 23?"}]
    assert fields["prompt_token_ids"] == chat_ids(tokenizer, messages)
    ids = fields["generation_token_ids"]
    assert len(ids) == len(fields["generation_log_probs"]) == resp.usage.output_tokens > 0
    assert resp.usage.input_tokens == len(fields["prompt_token_ids"])
    assert message.content[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert resp.output_text == message.content[0].text
    entries = message.content[0].logprobs
    assert [e.logprob for e in entries] == fields["generation_log_probs"]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    ended_by_length = len(ids) == 10
    assert resp.status == ("incomplete" if ended_by_length else "completed")
    assert (resp.incomplete_details is not None) == ended_by_length

    # Greedy decoding through chat completions yields the same tokens from the same prompt.
    chat = c.chat.completions.create(model=DENSE.name, messages=messages, max_tokens=10, temperature=0,
                                     extra_body=RL)
    assert chat.choices[0].model_extra["token_ids"] == ids


def test_input_items_render_like_the_chat_messages(server, tokenizer):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 17 * 23?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "calculator",
         "arguments": json.dumps({"expression": "17 * 23"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "391"},
    ]
    resp = client(server.url).responses.create(model=DENSE.name, input=items, tools=[TOOL], max_output_tokens=2,
                                               extra_body=RL)
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 17 * 23?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "391"}]
    assert training_fields(resp.output[-1])["prompt_token_ids"] == chat_ids(tokenizer, messages, [CALCULATOR])


def test_tool_calls_become_function_call_items(echo, tokenizer):  # noqa: F811
    said = "I will use the calculator.\n" + CALL_TEXT
    resp = echo.responses.create(model=DENSE.name, input=said, tools=[TOOL], extra_body=RL)
    message, call = resp.output
    assert message.type == "message" and message.content[0].text == "I will use the calculator."
    assert call.type == "function_call" and call.name == "calculator" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"expression": "17 * 23"}
    assert "generation_token_ids" not in (message.model_extra or {})  # one generation: on the last item
    ids = training_fields(call)["generation_token_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == said  # the whole generation, call text included
    plain = echo.responses.create(model=DENSE.name, input=said, tools=[TOOL], tool_choice="none")
    assert [item.type for item in plain.output] == ["message"] and plain.output_text == said


def test_a_stream_carries_what_the_whole_response_carries(server):
    c = client(server.url)
    kwargs = dict(model=DENSE.name, input="What is 17 * 23?", max_output_tokens=8, temperature=0,
                  include=["message.output_text.logprobs"], extra_body=RL)
    whole = c.responses.create(**kwargs)
    deltas, kinds, final = [], [], None
    for event in c.responses.create(stream=True, **kwargs):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
        < kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert "".join(deltas) == final.output_text == whole.output_text
    assert training_fields(final.output[-1]) == training_fields(whole.output[-1])
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens


def test_a_streamed_tool_call_is_a_function_call_item(echo):  # noqa: F811
    said = "I will use the calculator.\n" + CALL_TEXT
    added, done, final = [], [], None
    for event in echo.responses.create(model=DENSE.name, input=said, tools=[TOOL], stream=True):
        if event.type == "response.output_item.added":
            added.append(event.item.type)
        elif event.type == "response.function_call_arguments.done":
            done.append(json.loads(event.arguments))
        elif event.type == "response.completed":
            final = event.response
    assert added == ["message", "function_call"] and done == [{"expression": "17 * 23"}]
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "I will use the calculator."


def test_a_streamed_tool_calls_tokens_ride_on_its_arguments_delta(echo, tokenizer):  # noqa: F811
    """Text then a call: the text deltas carry the text's tokens, the call's arguments delta the
    call's, and the end-of-turn token a last empty delta of the call, so every delta's tokens
    together are the generation the final item carries."""
    said = "I will use the calculator.\n" + CALL_TEXT
    parts: dict[str, list[int]] = {"text": [], "call": [], "after": []}
    logprobs, kinds, final = [], [], None
    for event in echo.responses.create(model=DENSE.name, input=said, tools=[TOOL], stream=True, extra_body=RL):
        kinds.append(event.type)
        if event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            part = "text" if event.type == "response.output_text.delta" else "call" if event.delta else "after"
            parts[part] += event.model_extra["generation_token_ids"]
            logprobs += event.model_extra["generation_log_probs"]
        elif event.type == "response.completed":
            final = event.response
    fields = training_fields(final.output[-1])
    assert parts["text"] + parts["call"] + parts["after"] == fields["generation_token_ids"]
    assert logprobs == fields["generation_log_probs"]
    assert tokenizer.decode(parts["text"]) == "I will use the calculator.\n"
    assert tokenizer.decode(parts["call"]) == CALL_TEXT
    # The call item closes after its last delta, before the response completes.
    last_delta = max(i for i, k in enumerate(kinds) if k == "response.function_call_arguments.delta")
    assert last_delta < kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": ""}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
])
def test_bad_bodies_are_typed_400s(server, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server.url).responses.create(model=DENSE.name, **body)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.create(model="no-such-model", input="hi")


def test_the_proxy_records_a_responses_call_and_strips_what_it_added(proxy, tokenizer):
    mark = proxy.mark()
    resp = client(proxy.url).responses.create(model=DENSE.name, input="Say hello.", max_output_tokens=6,
                                              temperature=0)
    (message,) = resp.output
    assert all(v is None for v in training_fields(message).values())  # the proxy asked; the client did not
    (capture,) = proxy.since(mark)
    assert capture.endpoint == "/v1/responses" and capture.augmented == ["return_token_ids", "return_routed_experts"]
    (choice,) = capture.choices
    assert capture.prompt_token_ids.tolist() == chat_ids(tokenizer, [{"role": "user", "content": "Say hello."}])
    assert choice.num_response_tokens == resp.usage.output_tokens
    assert tokenizer.decode(choice.response_token_ids.tolist(), skip_special_tokens=True) == resp.output_text
    assert choice.logprobs is not None and choice.logprobs.shape == (resp.usage.output_tokens,)
    assert choice.finish_reason == ("length" if resp.status == "incomplete" else "stop")

    # A client that asks for the token fields gets them, and the capture holds the same ones.
    mark = proxy.mark()
    asked = client(proxy.url).responses.create(model=DENSE.name, input="Say hello.", max_output_tokens=6,
                                               temperature=0, extra_body=RL)
    fields = training_fields(asked.output[-1])
    (capture,) = proxy.since(mark)
    assert capture.choices[0].response_token_ids.tolist() == fields["generation_token_ids"]
    assert capture.choices[0].logprobs.tolist() == pytest.approx(fields["generation_log_probs"], abs=1e-6)


def test_the_proxy_records_a_streamed_response(proxy, tokenizer):
    kwargs = dict(model=DENSE.name, input="Say hello.", max_output_tokens=6, temperature=0)
    mark = proxy.mark()
    whole = client(proxy.url).responses.create(**kwargs)
    events = list(client(proxy.url).responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert all(v is None for v in training_fields(final.output[-1]).values())  # stripped on the way
    first, streamed = proxy.since(mark)
    assert streamed.stream and streamed.endpoint == "/v1/responses"
    assert streamed.prompt_token_ids.tolist() == first.prompt_token_ids.tolist()
    assert streamed.choices[0].response_token_ids.tolist() == first.choices[0].response_token_ids.tolist()
    assert tokenizer.decode(streamed.choices[0].response_token_ids.tolist(), skip_special_tokens=True) \
        == final.output_text
    assert streamed.timings.first_token_s is not None


def test_our_response_is_a_gym_rollout_our_verifier_scores(echo, tmp_path):  # noqa: F811
    """The model server's Response, as a Gym agent would hand it on, scored by the resources server."""
    from test_resources_server import post, start_server

    from rollmarket.contracts import TaskSpec

    task = TaskSpec(task_id="calc", prompt="17 * 23?", tools=["calculator"], verifier="tool_use",
                    verifier_args={"required": ["calculator"]})
    params = {"input": "I will use the calculator.\n" + CALL_TEXT, "tools": [TOOL]}
    resp = echo.responses.create(model=DENSE.name, **params, extra_body=RL)
    resources = start_server(tmp_path / "tmp")
    try:
        # The agent's part: run the call on the resources server and append its output, as Gym's agents do.
        response = resp.model_dump(mode="json")
        call = resp.output[-1]
        session = post(resources.url, "/seed_session", {"task": task.model_dump(mode="json")}).json()["session_id"]
        result = post(resources.url, f"/{call.name}", json.loads(call.arguments), session=session).json()
        assert result["content"] == "391"
        response["output"].append({"type": "function_call_output", "call_id": call.call_id, "output": result["content"]})
        body = {"responses_create_params": params, "response": response, "task": task.model_dump(mode="json")}
        answered = post(resources.url, "/verify", body)
        assert answered.status_code == 200, answered.text
        assert answered.json()["reward"] == 1.0 and answered.headers["x-rollmarket-tool-calls"] == "response"
        plain = echo.responses.create(model=DENSE.name, input="I will answer directly.")
        body["response"] = plain.model_dump(mode="json")
        assert not post(resources.url, "/verify", body).json()["verification"]["passed"]
    finally:
        resources.stop()


def test_a_responses_output_goes_back_as_the_next_input(echo, server, tokenizer):  # noqa: F811
    """The usual agent loop: the next request's input is the last input, the output items (token
    fields and all) and the tool's output; it renders like the chat conversation it stands for,
    the message and the call of one generation as one assistant turn."""
    said = "I will use the calculator.\n" + CALL_TEXT
    first = echo.responses.create(model=DENSE.name, input=[{"role": "user", "content": said}], tools=[TOOL],
                                  extra_body=RL)
    message, call = first.output
    items = [{"role": "user", "content": said}, *(item.model_dump(mode="json") for item in first.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": "391"}]
    second = client(server.url).responses.create(model=DENSE.name, input=items, tools=[TOOL], max_output_tokens=2,
                                                 extra_body=RL)
    messages = [{"role": "user", "content": said},
                {"role": "assistant", "content": "I will use the calculator.", "tool_calls": [{
                    "id": call.call_id, "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "391"}]
    assert training_fields(second.output[-1])["prompt_token_ids"] == chat_ids(tokenizer, messages, [CALCULATOR])


LINKED = dict(model=DENSE.name, instructions="Be brief.", max_output_tokens=4, temperature=0, extra_body=RL)
QUESTIONS = ("Say hello.", "And again?", "Once more.")


def _conversation(c: openai.OpenAI, *, by_id: bool) -> list:
    """Three turns, continued by previous_response_id or by sending the output items back."""
    answers, items = [], []
    for question in QUESTIONS:
        if by_id:
            previous = {"previous_response_id": answers[-1].id} if answers else {}
            answers.append(c.responses.create(input=question, **previous, **LINKED))
        else:
            items.append({"role": "user", "content": question})
            answers.append(c.responses.create(input=items, **LINKED))
            items += [item.model_dump(mode="json") for item in answers[-1].output]
    return answers


def _said(answers, turn: int) -> list[dict]:
    """The chat messages the model is shown at `turn`, from what the client received."""
    messages = [{"role": "system", "content": "Be brief."}]
    for k in range(turn):
        messages += [{"role": "user", "content": QUESTIONS[k]}, {"role": "assistant", "content": answers[k].output_text}]
    return messages + [{"role": "user", "content": QUESTIONS[turn]}]


@pytest.mark.parametrize("by_id", [True, False], ids=["previous_response_id", "repeated_items"])
def test_a_three_turn_responses_conversation_is_one_captured_conversation(proxy, tokenizer, by_id):
    mark = proxy.mark()
    answers = _conversation(client(proxy.url), by_id=by_id)
    captures = proxy.since(mark)
    assert len(captures) == 3 and len({c.conversation_id for c in captures}) == 1
    assert [c.turn_index for c in captures] == [0, 1, 2]
    assert [c.parent_capture_id for c in captures] == [None, captures[0].capture_id, captures[1].capture_id]
    linked = "previous_response" if by_id else "prefix"
    assert [c.conversation_source.value for c in captures] == ["root", linked, linked]
    for turn, (capture, answer) in enumerate(zip(captures, answers)):
        served = training_fields(answer.output[-1])
        # The served prompt is the whole conversation so far, under the chat template.
        assert served["prompt_token_ids"] == chat_ids(tokenizer, _said(answers, turn))
        assert capture.prompt_token_ids.tolist() == served["prompt_token_ids"]
        assert capture.choices[0].response_token_ids.tolist() == served["generation_token_ids"]
        assert capture.choices[0].logprobs.tolist() == pytest.approx(served["generation_log_probs"], abs=1e-6)
        assert [(m["role"], m["content"].strip()) for m in capture.messages] == \
            [(m["role"], m["content"].strip()) for m in _said(answers, turn)]


def test_both_ways_of_continuing_serve_the_same_prompts(server):
    by_id = _conversation(client(server.url), by_id=True)
    repeated = _conversation(client(server.url), by_id=False)
    assert [training_fields(a.output[-1]) for a in by_id] == [training_fields(a.output[-1]) for a in repeated]
    assert [a.previous_response_id for a in by_id] == [None, by_id[0].id, by_id[1].id]


@pytest.mark.parametrize("in_file", [False, True], ids=["memory", "sqlite"])
def test_the_oldest_stored_responses_go_first(tmp_path, in_file):
    from rollmarket.serve.protocol import OpenAIError
    from rollmarket.serve.responses import StoredResponses

    stored = StoredResponses(2, tmp_path / "responses.db" if in_file else None)
    for k in range(3):
        stored.put(f"resp_{k}", [{"role": "user", "content": str(k)}], {"id": f"resp_{k}"})
    assert stored.get("resp_2") == [{"role": "user", "content": "2"}] and stored.get("resp_1")
    with pytest.raises(OpenAIError) as caught:
        stored.get("resp_0")
    assert (caught.value.status, caught.value.code) == (404, "previous_response_not_found")
    nothing = StoredResponses(0)
    nothing.put("resp_0", [], {})
    with pytest.raises(OpenAIError):
        nothing.get("resp_0")


def test_a_stored_response_is_retrieved_as_answered_and_deleted(server):
    """OpenAI's client: `responses.retrieve` gives back the Response object as it was answered (token
    fields included); `responses.delete` forgets it, after which retrieving or continuing it is a
    404 and deleting it again is one too."""
    c = client(server.url)
    answer = c.responses.create(input=QUESTIONS[0], **LINKED)
    assert c.responses.retrieve(answer.id).model_dump() == answer.model_dump()
    c.responses.delete(answer.id)
    for again in (lambda: c.responses.retrieve(answer.id), lambda: c.responses.delete(answer.id),
                  lambda: c.responses.create(input=QUESTIONS[1], previous_response_id=answer.id, **LINKED)):
        with pytest.raises(openai.NotFoundError):
            again()
    unstored = c.responses.create(input=QUESTIONS[0], store=False, **LINKED)
    with pytest.raises(openai.NotFoundError) as caught:
        c.responses.retrieve(unstored.id)
    assert caught.value.body["message"] == f"Response with id '{unstored.id}' not found."
    # The deletion's own answer, in OpenAI's shape (the client returns nothing of it).
    other = c.responses.create(input=QUESTIONS[0], **LINKED)
    gone = httpx.delete(f"{server.url}/v1/responses/{other.id}", timeout=30)
    assert (gone.status_code, gone.json()) == (200, {"id": other.id, "object": "response", "deleted": True})


def test_a_conversation_continues_across_a_kill_9_with_responses_db(workdir, tokenizer):
    """With --responses-db, a response answered before the server was killed -9 is found by the
    restarted server, whose next turn is served the whole conversation (the same prompt as a
    conversation that never restarted)."""
    port = free_port()
    process = ServiceProcess([sys.executable, "-m", "rollmarket", "serve-model", str(DENSE), "--port", str(port),
                              "--precision", "fp32", "--device", "cpu", "--responses-db",
                              str(workdir / "responses.db")], workdir / "restarted.log", port,
                             env={"OMP_NUM_THREADS": "1"})
    try:
        first = client(process.start(timeout=180).url).responses.create(input=QUESTIONS[0], **LINKED)
        process.kill()
        process.start(timeout=180)
        second = client(process.url).responses.create(input=QUESTIONS[1], previous_response_id=first.id, **LINKED)
        assert client(process.url).responses.retrieve(first.id).model_dump() == first.model_dump()
    finally:
        process.stop()
    assert training_fields(second.output[-1])["prompt_token_ids"] == chat_ids(tokenizer, _said([first], 1))


def test_an_unknown_or_unstored_previous_response_is_a_404_that_changes_nothing(proxy, server):
    c = client(proxy.url)
    first = c.responses.create(input=QUESTIONS[0], **LINKED)
    unstored = c.responses.create(input=QUESTIONS[0], store=False, **LINKED)
    mark = proxy.mark()
    for rid in ("resp_no_such_response", unstored.id):
        with pytest.raises(openai.NotFoundError) as caught:
            c.responses.create(input=QUESTIONS[1], previous_response_id=rid, **LINKED)
        assert caught.value.body == {"message": f"Previous response with id '{rid}' not found.",
                                     "type": "invalid_request_error", "param": "previous_response_id",
                                     "code": "previous_response_not_found"}
    refused = proxy.since(mark)
    assert [(c.status_code, c.outcome.value, c.conversation_source.value) for c in refused] == \
        [(404, "upstream_error", "root")] * 2
    assert all("was not captured here" in " ".join(c.notes) for c in refused)
    # The refusals neither stored a response nor dropped one: the first still goes on, and its
    # continuation links to it and to nothing else.
    mark = proxy.mark()
    second = c.responses.create(input=QUESTIONS[1], previous_response_id=first.id, **LINKED)
    (capture,) = proxy.since(mark)
    assert capture.turn_index == 1 and capture.conversation_source.value == "previous_response"
    assert capture.prompt_token_ids.tolist() == training_fields(second.output[-1])["prompt_token_ids"]
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.create(input=QUESTIONS[1], previous_response_id="resp_" + "0" * 24, **LINKED)


def _streamed(c: openai.OpenAI, **kwargs) -> tuple[list, object]:
    deltas, final = [], None
    for event in c.responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            deltas.append(event)
        elif event.type == "response.completed":
            final = event.response
    return deltas, final


def test_stream_deltas_carry_the_logprobs_and_tokens_of_the_final_response(server):
    kwargs = dict(model=DENSE.name, input="What is 17 * 23?", max_output_tokens=8, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2, extra_body=RL)
    deltas, final = _streamed(client(server.url), **kwargs)
    part, fields = final.output[0].content[0], training_fields(final.output[-1])
    entries = [entry for delta in deltas for entry in delta.logprobs]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in part.logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in entries] == \
        [[t.logprob for t in e.top_logprobs] for e in part.logprobs]
    ids = [t for delta in deltas for t in delta.model_extra["generation_token_ids"]]
    logprobs = [lp for delta in deltas for lp in delta.model_extra["generation_log_probs"]]
    assert ids == fields["generation_token_ids"] and logprobs == fields["generation_log_probs"]
    assert "".join(delta.delta for delta in deltas) == final.output_text
    # Without `include` or top_logprobs a delta's logprobs stay empty, as OpenAI sends them.
    plain, _ = _streamed(client(server.url), model=DENSE.name, input="What is 17 * 23?", max_output_tokens=8)
    assert all(delta.logprobs == [] and "generation_token_ids" not in (delta.model_extra or {}) for delta in plain)


def test_a_streamed_responses_capture_equals_the_whole_one(proxy):
    kwargs = dict(model=DENSE.name, input="Say hello.", instructions="Be brief.", max_output_tokens=6,
                  temperature=0)
    c = client(proxy.url)
    mark = proxy.mark()
    whole = c.responses.create(**kwargs)
    deltas, final = _streamed(c, **kwargs)
    assert final.output_text == whole.output_text
    assert all("generation_token_ids" not in (delta.model_extra or {}) for delta in deltas)  # stripped
    whole_capture, streamed = proxy.since(mark)
    assert streamed.stream and not whole_capture.stream
    same = ("prompt_token_ids", "messages", "turn_index", "augmented")
    assert {k: getattr(streamed, k) for k in same if k != "prompt_token_ids"} == \
        {k: getattr(whole_capture, k) for k in same if k != "prompt_token_ids"}
    assert streamed.prompt_token_ids.tolist() == whole_capture.prompt_token_ids.tolist()
    a, b = streamed.choices[0], whole_capture.choices[0]
    assert (a.content, a.finish_reason, a.response_token_ids.tolist()) == \
        (b.content, b.finish_reason, b.response_token_ids.tolist())
    assert a.logprobs.tolist() == pytest.approx(b.logprobs.tolist(), abs=1e-6)


def test_a_tool_loop_links_by_previous_response_id_and_by_repeated_items(echo, workdir, tokenizer):  # noqa: F811
    """The agent's loop through the proxy: a message and a function call, then the tool's output,
    sent alone after `previous_response_id` or after the repeated items; both continue turn 1."""
    proxy = ProxyProcess(str(echo.base_url).rstrip("/").removesuffix("/v1"), workdir / "tools.db",
                         workdir / "tools-proxy.log")
    proxy.start()
    try:
        c = client(proxy.url)
        said = "I will use the calculator.\n" + CALL_TEXT
        first = c.responses.create(model=DENSE.name, input=[{"role": "user", "content": said}], tools=[TOOL],
                                   extra_body=RL)
        message, call = first.output
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "391"}
        by_id = c.responses.create(model=DENSE.name, input=[result], previous_response_id=first.id, tools=[TOOL],
                                   extra_body=RL)
        repeated = c.responses.create(model=DENSE.name, tools=[TOOL], extra_body=RL, input=[
            {"role": "user", "content": said}, *(item.model_dump(mode="json") for item in first.output), result])
        root, *continued = proxy.since(0)
    finally:
        proxy.stop()
    assert root.choices[0].finish_reason == "tool_calls" and root.choices[0].tool_calls[0].name == "calculator"
    messages = [{"role": "user", "content": said},
                {"role": "assistant", "content": "I will use the calculator.", "tool_calls": [{
                    "id": call.call_id, "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "391"}]
    expected = chat_ids(tokenizer, messages, [CALCULATOR])
    assert training_fields(by_id.output[-1])["prompt_token_ids"] == expected
    assert training_fields(repeated.output[-1])["prompt_token_ids"] == expected
    assert [c.conversation_source.value for c in continued] == ["previous_response", "prefix"]
    for capture in continued:
        assert (capture.conversation_id, capture.parent_capture_id, capture.turn_index) == \
            (root.conversation_id, root.capture_id, 1)
        assert capture.prompt_token_ids.tolist() == expected
        assert [(m["role"], [t["function"]["name"] for t in m.get("tool_calls") or ()]) for m in capture.messages] \
            == [("user", []), ("assistant", ["calculator"]), ("tool", [])]


def test_a_streamed_tool_call_through_the_proxy_is_captured_whole_and_stripped(echo, workdir, tokenizer):  # noqa: F811
    """The proxy asks for the token fields the client did not: it strips them from the call's
    arguments delta as from the text deltas, and records the whole generation, call included."""
    proxy = ProxyProcess(str(echo.base_url).rstrip("/").removesuffix("/v1"), workdir / "stream-tools.db",
                         workdir / "stream-tools-proxy.log")
    proxy.start()
    try:
        said = "I will use the calculator.\n" + CALL_TEXT
        events = list(client(proxy.url).responses.create(model=DENSE.name, input=said, tools=[TOOL], stream=True))
        (capture,) = proxy.since(0)
    finally:
        proxy.stop()
    deltas = [e for e in events if e.type in ("response.output_text.delta", "response.function_call_arguments.delta")]
    assert {e.type for e in deltas} == {"response.output_text.delta", "response.function_call_arguments.delta"}
    assert all("generation_token_ids" not in (e.model_extra or {}) for e in deltas)
    (choice,) = capture.choices
    assert choice.finish_reason == "tool_calls" and choice.tool_calls[0].name == "calculator"
    assert tokenizer.decode(choice.response_token_ids.tolist(), skip_special_tokens=True) == said


def test_a_stream_cut_short_keeps_the_tokens_its_deltas_carried(proxy):
    """The client goes away after the first delta: the capture holds what the deltas carried, the
    beginning of what the whole call generates from the same prompt."""
    kwargs = dict(model=DENSE.name, input="Count to a thousand.", max_output_tokens=600, temperature=0,
                  extra_body={**RL, "ignore_eos": True})
    c = client(proxy.url)
    mark = proxy.mark()
    seen = []
    with c.responses.create(stream=True, **kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                seen += event.model_extra["generation_token_ids"]
                break
    wait_until("the cut stream's capture", lambda: proxy.since(mark))
    (cut,) = proxy.since(mark)
    assert cut.outcome.value == "client_disconnected"
    ids = cut.choices[0].response_token_ids.tolist()
    assert len(seen) >= 1 and ids[:len(seen)] == seen and len(cut.choices[0].logprobs) == len(ids) < 600
    whole = training_fields(c.responses.create(**kwargs).output[-1])["generation_token_ids"]
    assert whole[:len(ids)] == ids
