"""The capture proxy, end to end: the official `openai` client -> `rollmarket proxy` -> a real upstream.

What these tests protect (issue: the old proxy could not read streamed responses and lost the
prompt token ids; ours must do both):

* **Every generation call is recorded with the engine's own tokens**: prompt token ids, response
  token ids (decoding to the text the client got), logprobs, routed experts, tool calls, finish
  reason, upstream model, timings. Streamed and whole, chat and completions, n > 1. The main
  upstream is our own `rollmarket serve-model` on the tiny shipped models; `fake_upstream.py`
  stands in only where a behaviour must be provoked (a broken or slow stream, refused extras,
  SGLang's flat experts, tool calls on demand).
* **The client sees what it would have seen without the proxy**: the extras the proxy asked for
  are stripped unless the client asked for them or `--keep-extras` is on; errors pass through
  byte for byte (status and body) and are recorded.
* **Turns link**: a turn whose messages continue an earlier turn's messages and reply joins its
  conversation; identical first turns (a group of rollouts of one task) do not merge.
* **An acknowledged response is never lost** (`ack_after_write`, the default): SIGKILL the proxy
  after the answers arrived, restart on the same file, and every capture is there.

Do not "fix" the linking or durability tests without a decision: they state the contract.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from rollmarket.contracts.capture import Capture, CapturedChoice, CaptureOutcome, CaptureTimings, ConversationSource
from helpers import ServiceProcess

from rollmarket.localhost import free_port
from rollmarket.proxy.augment import augment_request, strip_chunk, strip_response
from rollmarket.proxy.capture import CallRecorder
from rollmarket.proxy.linking import messages_hash, prefix_hash, reply_key, reply_message
from rollmarket.proxy.settings import ProxySettings
from rollmarket.proxy.sse import EventSplitter, event_data
from rollmarket.proxy.store import CaptureStore

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).with_name("fake_upstream.py")
MOE, DENSE = ROOT / "models/tiny-moe", ROOT / "models/tiny-dense"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


# -- processes ---------------------------------------------------------------------------------------

Process = ServiceProcess


class ProxyProcess(Process):
    def __init__(self, upstream: str, store: Path, log: Path, *args: str):
        port = free_port()
        super().__init__([sys.executable, "-m", "rollmarket", "proxy", "--upstream", upstream, "--port", str(port),
                          "--store", str(store), "--log-level", "warning", *args], log, port)
        self.store = CaptureStore(store)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def mark(self) -> int:
        """The newest capture's sequence number; captures after it are the test's own."""
        if not self.store.path.exists():
            return 0
        with sqlite3.connect(self.store.path) as conn:
            return conn.execute("SELECT coalesce(max(seq), 0) FROM captures").fetchone()[0]

    def since(self, mark: int) -> list[Capture]:
        return [capture for _, capture in self.store.iter_captures(since_seq=mark)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("proxy")


def _serve_model(path: Path, workdir: Path) -> Process:
    # The models ship in the repository: a missing one is a broken checkout, not a reason to skip.
    assert (path / "config.json").exists(), f"{path} is missing; rebuild with `rollmarket models build`"
    port = free_port()
    server = Process([sys.executable, "-m", "rollmarket", "serve-model", str(path), "--port", str(port),
                      "--precision", "fp32", "--device", "cpu"], workdir / f"{path.name}.log", port)
    return server.start(timeout=120)


@pytest.fixture(scope="module")
def moe_server(workdir):
    server = _serve_model(MOE, workdir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dense_server(workdir):
    server = _serve_model(DENSE, workdir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake(workdir):
    port = free_port()
    upstream = Process([sys.executable, str(FAKE), "--port", str(port)], workdir / "fake.log", port).start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def start_proxy(workdir):
    """Start proxy processes; every one started is stopped after the module."""
    started: list[ProxyProcess] = []

    def start(upstream: str, *args: str, store: Path | None = None) -> ProxyProcess:
        store = store or workdir / f"captures-{len(started)}.db"
        proxy = ProxyProcess(upstream, store, workdir / "proxy.log", *args)
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture(scope="module")
def moe_proxy(moe_server, start_proxy) -> ProxyProcess:
    return start_proxy(moe_server.url)


@pytest.fixture(scope="module")
def fake_proxy(fake, start_proxy) -> ProxyProcess:
    return start_proxy(fake.url + "/v1")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MOE / "tokenizer.json"))


def only(captures: list[Capture]) -> Capture:
    assert len(captures) == 1, [c.endpoint for c in captures]
    return captures[0]


def assert_complete(choice, *, experts_LK: tuple[int, int] | None) -> None:
    """Token ids, one finite logprob per token, and routed experts [T, L, K] when MoE."""
    T = choice.num_response_tokens
    assert T > 0
    assert choice.logprobs is not None and choice.logprobs.shape == (T,)
    assert np.isfinite(choice.logprobs).all() and (choice.logprobs <= 0).all()
    if experts_LK is None:
        assert choice.routed_experts is None
    else:
        assert choice.routed_experts is not None and choice.routed_experts.shape == (T, *experts_LK)


# -- units: SSE, augmentation, linking, recording ---------------------------------------------------

def test_sse_events_split_wherever_the_bytes_break():
    stream = b'data: {"a": 1}\n\ndata: {"a": 2}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        splitter = EventSplitter()
        events = []
        for i in range(0, len(stream), size):
            events += splitter.feed(stream[i:i + size])
        assert b"".join(events) == stream
        assert [event_data(e) for e in events] == [b'{"a": 1}', b'{"a": 2}', None, b"[DONE]"]
        assert splitter.rest() == b""


def test_augmentation_is_stripped_exactly():
    request = {"model": "m", "messages": [], "stream": True}
    upstream, aug = augment_request("/v1/chat/completions", request)
    assert request == {"model": "m", "messages": [], "stream": True}  # the client's body is not touched
    assert upstream["logprobs"] is True and upstream["return_token_ids"] and upstream["return_routed_experts"]
    assert upstream["stream_options"] == {"include_usage": True}
    assert aug.added == ["logprobs", "return_token_ids", "return_routed_experts", "stream_options.include_usage"]
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}, "token_ids": [5],
                          "routed_experts": [[[1, 2]]]}], "prompt_token_ids": [1, 2], "usage": None}
    assert strip_chunk(chunk, aug) == {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None}]}
    assert strip_chunk({"choices": [], "usage": {"total_tokens": 3}}, aug) is None  # the proxy's own usage chunk

    asked = {"model": "m", "prompt": "p", "logprobs": 2, "return_token_ids": True}
    upstream, aug = augment_request("/v1/completions", asked)
    assert upstream["logprobs"] == 2 and aug.added == ["return_routed_experts"]
    body = {"choices": [{"text": "t", "logprobs": {"token_logprobs": [-1.0]}, "token_ids": [9], "prompt_token_ids": [1]}]}
    assert strip_response(body, aug) == {"choices": [{"text": "t", "logprobs": {"token_logprobs": [-1.0]},
                                                      "token_ids": [9], "prompt_token_ids": [1]}]}


def test_a_reply_echoed_by_a_client_links_to_its_turn():
    """The openai client echoes a reply with nulls, ids and extra fields; only meaning counts."""
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Oslo?"}]
    reply = reply_message("Let me look.", [("search", '{"query": "Oslo"}')])
    echoed = {"role": "assistant", "content": "Let me look.\n", "refusal": None, "audio": None, "function_call": None,
              "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "search",
                                                                                "arguments": '{"query":"Oslo"}'}}]}
    turn2 = [*turn1, echoed, {"role": "tool", "tool_call_id": "call_9", "content": "rain"}]
    assert prefix_hash(turn1) is None
    assert prefix_hash(turn2) == reply_key(turn1, reply)
    other = reply_message("Let me look.", [("search", '{"query": "Bergen"}')])
    assert prefix_hash(turn2) != reply_key(turn1, other)
    assert messages_hash(turn1) != messages_hash(turn1[1:])


def test_streamed_tool_calls_are_assembled():
    recorder = CallRecorder(endpoint="/v1/chat/completions", stream=True, upstream="u", request={"messages": []},
                            augmented=[], header_conversation=None, received_at=0.0)
    recorder.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Sure. "}}], "prompt_token_ids": [1]})
    recorder.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"qu'}}]},
        "token_ids": [4, 5], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}]})
    recorder.chunk({"choices": [{"index": 0,
                                 "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ery": 1}'}}]},
                                 "token_ids": [6], "logprobs": {"content": [{"logprob": -1.0}]},
                                 "finish_reason": "tool_calls"}]})
    draft = recorder.draft(status_code=200, outcome=CaptureOutcome.ok, timings={})
    (choice,) = draft.choices
    assert choice.text() == "Sure. " and choice.calls() == [("c1", "search", '{"query": 1}')]
    assert choice.token_ids == [4, 5, 6] and choice.logprobs == [-0.5, -0.25, -1.0]
    assert choice.finish_reason == "tool_calls" and recorder.prompt_token_ids == [1]


def test_settings_take_a_base_url_with_or_without_v1():
    assert ProxySettings(upstream="http://h:8000/v1/").upstream == "http://h:8000"
    assert ProxySettings(upstream="http://h:8000", moe_shape="48x8").experts_shape == (48, 8)
    with pytest.raises(ValueError):
        ProxySettings(upstream="h:8000")


# -- our server: chat, completions, stream, n, extras, errors ---------------------------------------

def test_chat_records_prompt_and_response_tokens(moe_proxy, tokenizer):
    mark = moe_proxy.mark()
    messages = [{"role": "user", "content": "What is two plus two?"}]
    answer = moe_proxy.client().chat.completions.create(model="tiny-moe", messages=messages, max_tokens=12,
                                                       temperature=0)
    assert answer.choices[0].logprobs is None  # the proxy asked; the client did not
    assert "token_ids" not in (answer.choices[0].model_extra or {})
    assert "prompt_token_ids" not in (answer.model_extra or {})
    capture = only(moe_proxy.since(mark))
    (choice,) = capture.choices
    assert capture.outcome is CaptureOutcome.ok and capture.status_code == 200
    assert capture.messages == messages and capture.model == "tiny-moe" and capture.upstream_model == "tiny-moe"
    assert capture.augmented == ["logprobs", "return_token_ids", "return_routed_experts"]
    assert len(capture.prompt_token_ids) == answer.usage.prompt_tokens
    assert "What is two plus two?" in tokenizer.decode(capture.prompt_token_ids.tolist(), skip_special_tokens=False)
    assert choice.num_response_tokens == answer.usage.completion_tokens
    assert tokenizer.decode(choice.response_token_ids.tolist()) == answer.choices[0].message.content
    assert choice.content == answer.choices[0].message.content
    assert choice.finish_reason == answer.choices[0].finish_reason
    assert_complete(choice, experts_LK=(4, 2))
    timings = capture.timings
    assert 0 < timings.upstream_s <= timings.total_s and timings.proxy_s >= 0
    assert capture.params == {"max_tokens": 12, "temperature": 0}


def test_a_stream_records_what_the_whole_answer_records(moe_proxy, tokenizer):
    """The old proxy could not read streams; ours records the same tokens either way."""
    client = moe_proxy.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    mark = moe_proxy.mark()
    whole = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    whole_capture, stream_capture = moe_proxy.since(mark)
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3  # passed through event by event, not as one blob
    assert all(c.usage is None for c in chunks)  # the usage chunk the proxy asked for is not the client's
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert streamed_text == whole.choices[0].message.content
    assert stream_capture.stream and stream_capture.prompt_token_ids is not None
    np.testing.assert_array_equal(stream_capture.prompt_token_ids, whole_capture.prompt_token_ids)
    s, w = stream_capture.choices[0], whole_capture.choices[0]
    np.testing.assert_array_equal(s.response_token_ids, w.response_token_ids)
    np.testing.assert_allclose(s.logprobs, w.logprobs, atol=1e-5)
    np.testing.assert_array_equal(s.routed_experts, w.routed_experts)
    assert s.content == streamed_text and s.finish_reason == w.finish_reason
    assert stream_capture.usage["completion_tokens"] == s.num_response_tokens
    assert stream_capture.timings.first_token_s is not None
    assert stream_capture.timings.first_token_s <= stream_capture.timings.total_s


def test_n_choices_each_get_their_tokens(moe_proxy, tokenizer):
    mark = moe_proxy.mark()
    answer = moe_proxy.client().chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "Say anything."}], max_tokens=8, n=3, seed=7,
        temperature=1.0)
    capture = only(moe_proxy.since(mark))
    assert [c.index for c in capture.choices] == [0, 1, 2]
    for sent, choice in zip(answer.choices, capture.choices):
        assert choice.content == sent.message.content
        assert tokenizer.decode(choice.response_token_ids.tolist()) == sent.message.content
        assert_complete(choice, experts_LK=(4, 2))


def test_completions_whole_and_streamed_on_a_dense_model(dense_server, start_proxy, tokenizer):
    proxy = start_proxy(dense_server.url)
    client = proxy.client()
    mark = proxy.mark()
    whole = client.completions.create(model="tiny-dense", prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
    streamed = list(client.completions.create(model="tiny-dense", prompt="Once upon a time", max_tokens=8,
                                              temperature=0, stream=True))
    whole_capture, stream_capture = proxy.since(mark)
    assert whole_capture.prompt == "Once upon a time" and whole_capture.endpoint == "/v1/completions"
    assert tokenizer.decode(whole_capture.prompt_token_ids.tolist()).endswith("Once upon a time")
    for sent, choice in zip(whole.choices, whole_capture.choices):
        assert choice.content == sent.text and sent.logprobs is None
        assert choice.prompt_token_ids is None  # the same prompt as the call's
        assert_complete(choice, experts_LK=None)  # dense: no routed experts
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole.choices[0].text == stream_capture.choices[0].content
    np.testing.assert_array_equal(stream_capture.choices[0].response_token_ids,
                                  whole_capture.choices[0].response_token_ids)
    np.testing.assert_array_equal(stream_capture.prompt_token_ids, whole_capture.prompt_token_ids)


def test_extras_the_client_asked_for_reach_it(moe_proxy):
    mark = moe_proxy.mark()
    answer = moe_proxy.client().chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True})  # unseeded: an early EOS would end it short
    capture = only(moe_proxy.since(mark))
    assert capture.augmented == ["return_routed_experts"]
    assert len(answer.choices[0].logprobs.content) == 5
    assert all(len(entry.top_logprobs) == 2 for entry in answer.choices[0].logprobs.content)
    assert answer.choices[0].model_extra["token_ids"] == capture.choices[0].response_token_ids.tolist()
    assert answer.model_extra["prompt_token_ids"] == capture.prompt_token_ids.tolist()
    assert "routed_experts" not in answer.choices[0].model_extra


def test_keep_extras_passes_everything_on(moe_server, start_proxy):
    proxy = start_proxy(moe_server.url, "--keep-extras")
    # ignore_eos: unseeded sampling may draw the end-of-sequence token before the fourth (it did once in CI).
    body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["content"]) == 4
    assert np.asarray(choice["routed_experts"]).shape == (4, 4, 2) and answer["prompt_token_ids"]
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e[6:]) for e in events]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c["choices"]) == 4


def test_upstream_errors_pass_through_unchanged_and_are_recorded(moe_server, moe_proxy):
    mark = moe_proxy.mark()
    cases = [{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
             {"model": "tiny-moe", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 7},
             {"model": "tiny-moe", "messages": [{"role": "user", "content": "x"}], "n": 1000, "stream": True},
             {"model": "tiny-moe", "messages": []}]
    for body in cases:
        direct = httpx.post(moe_server.url + "/v1/chat/completions", json=body)
        proxied = httpx.post(moe_proxy.url + "/v1/chat/completions", json=body)
        assert direct.status_code >= 400
        assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content), body
        assert proxied.headers["content-type"] == direct.headers["content-type"]
    captures = moe_proxy.since(mark)
    assert len(captures) == len(cases)
    for capture, body in zip(captures, cases):
        assert capture.outcome is CaptureOutcome.upstream_error and capture.status_code >= 400
        assert capture.error == httpx.post(moe_server.url + "/v1/chat/completions", json=body).json()
        assert capture.choices == []
    with pytest.raises(openai.NotFoundError):
        moe_proxy.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_an_unreachable_upstream_is_a_502_and_recorded(start_proxy):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proxy = start_proxy(dead)
    response = httpx.post(proxy.url + "/v1/chat/completions",
                          json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    capture = only(proxy.since(0))
    assert capture.outcome is CaptureOutcome.upstream_unreachable and capture.status_code == 502
    assert capture.error == response.json()
    assert httpx.get(proxy.url + "/v1/models").status_code == 502


def test_other_v1_paths_pass_through(moe_server, moe_proxy):
    mark = moe_proxy.mark()
    direct = httpx.get(moe_server.url + "/v1/models").json()
    proxied = httpx.get(moe_proxy.url + "/v1/models").json()
    assert [m["id"] for m in proxied["data"]] == [m["id"] for m in direct["data"]] == ["tiny-moe"]
    assert moe_proxy.since(mark) == []  # only generation calls are recorded


# -- conversations ----------------------------------------------------------------------------------

def test_turns_link_by_prefix_and_identical_first_turns_do_not_merge(moe_proxy):
    client = moe_proxy.client()
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Pick a number."}]
    mark = moe_proxy.mark()
    a1 = client.chat.completions.create(model="tiny-moe", messages=first, max_tokens=6, seed=1)
    client.chat.completions.create(model="tiny-moe", messages=first, max_tokens=6, seed=2)
    a2 = client.chat.completions.create(model="tiny-moe", max_tokens=6, messages=[
        *first, a1.choices[0].message, {"role": "user", "content": "Another."}])
    client.chat.completions.create(model="tiny-moe", max_tokens=6, messages=[
        *first, a1.choices[0].message, {"role": "user", "content": "Another."}, a2.choices[0].message,
        {"role": "user", "content": "Once more."}])
    cap_a1, cap_b1, cap_a2, cap_a3 = moe_proxy.since(mark)
    assert cap_a1.conversation_source is ConversationSource.root and cap_a1.turn_index == 0
    assert cap_b1.conversation_id != cap_a1.conversation_id  # same prompt, another rollout
    assert (cap_a2.conversation_id, cap_a2.parent_capture_id, cap_a2.parent_choice) == (
        cap_a1.conversation_id, cap_a1.capture_id, 0)
    assert cap_a2.conversation_source is ConversationSource.prefix and cap_a2.turn_index == 1
    assert (cap_a3.conversation_id, cap_a3.parent_capture_id, cap_a3.turn_index) == (
        cap_a1.conversation_id, cap_a2.capture_id, 2)
    exported = [c.capture_id for _, c in moe_proxy.store.iter_captures(conversation=cap_a1.conversation_id)]
    assert exported == [cap_a1.capture_id, cap_a2.capture_id, cap_a3.capture_id]


def test_the_conversation_header_names_the_conversation(moe_proxy):
    client = moe_proxy.client(default_headers={"X-Rollmarket-Conversation": "episode-42"})
    mark = moe_proxy.mark()
    client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "a"}], max_tokens=3)
    client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "b"}], max_tokens=3)
    captures = moe_proxy.since(mark)
    assert [(c.conversation_id, c.conversation_source) for c in captures] == [("episode-42", ConversationSource.header)] * 2


def test_tool_calls_are_recorded_and_the_tool_turn_links(fake_proxy):
    client = fake_proxy.client()
    messages = [{"role": "user", "content": "Find the capital of Peru."}]
    mark = fake_proxy.mark()
    whole = client.chat.completions.create(model="fake-moe", messages=messages, tools=TOOLS)
    # another seed, another reply: identical replies to identical messages would share one key
    streamed = list(client.chat.completions.create(model="fake-moe", messages=messages, tools=TOOLS, stream=True,
                                                   seed=1))
    call = whole.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model="fake-moe", tools=TOOLS, messages=[
        *messages, whole.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "Lima"}])
    cap_whole, cap_stream, cap_follow = fake_proxy.since(mark)
    for capture, query in ((cap_whole, "q0"), (cap_stream, "q1")):
        (choice,) = capture.choices
        assert choice.finish_reason == "tool_calls" and capture.tools == TOOLS
        assert [(t.name, json.loads(t.arguments)) for t in choice.tool_calls] == [("search", {"query": query})]
        assert choice.tool_calls[0].id == "call_0"
        assert_complete(choice, experts_LK=(2, 2))
    streamed_args = "".join(tc.function.arguments for c in streamed if c.choices
                            for tc in (c.choices[0].delta.tool_calls or []))
    assert streamed_args == cap_stream.choices[0].tool_calls[0].arguments
    assert cap_follow.parent_capture_id == cap_whole.capture_id
    assert cap_follow.conversation_id == cap_whole.conversation_id and cap_follow.turn_index == 1
    assert follow.choices[0].finish_reason == "stop"


def test_tool_calls_on_our_server_are_recorded_as_the_client_got_them(moe_proxy):
    """Whatever the model does with the tools offered (a trained model calls them, the
    random-init placeholder rarely does), the capture holds exactly the calls the client got."""
    client = moe_proxy.client()
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Search for the capital of Peru."}]
    mark = moe_proxy.mark()
    whole = client.chat.completions.create(model="tiny-moe", messages=messages, tools=TOOLS, max_tokens=48,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=messages, tools=TOOLS, max_tokens=48,
                                                 temperature=0, stream=True))
    cap_whole, cap_stream = moe_proxy.since(mark)
    got = [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    assert [(t.id, t.name, t.arguments) for t in cap_whole.choices[0].tool_calls] == got
    assert cap_whole.choices[0].finish_reason == whole.choices[0].finish_reason
    assert cap_whole.tools == TOOLS and cap_stream.tools == TOOLS
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = streamed.setdefault(call.index, ["", ""])
            slot[0] = slot[0] or (call.function.name or "")
            slot[1] += call.function.arguments or ""
    assert [(t.name, t.arguments) for t in cap_stream.choices[0].tool_calls] == [
        tuple(v) for _, v in sorted(streamed.items())]
    np.testing.assert_array_equal(cap_stream.choices[0].response_token_ids, cap_whole.choices[0].response_token_ids)
    assert_complete(cap_whole.choices[0], experts_LK=(4, 2))


# -- failures as data -------------------------------------------------------------------------------

def test_a_client_that_leaves_mid_stream_is_recorded(fake_proxy):
    mark = fake_proxy.mark()
    body = {"model": "slow", "messages": [{"role": "user", "content": "long"}], "stream": True, "max_tokens": 40}
    with httpx.stream("POST", fake_proxy.url + "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    deadline = time.monotonic() + 10
    while not fake_proxy.since(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    capture = only(fake_proxy.since(mark))
    assert capture.outcome is CaptureOutcome.client_disconnected
    assert 0 < capture.choices[0].num_response_tokens < 20


def test_an_upstream_that_breaks_mid_stream_is_recorded(fake_proxy):
    mark = fake_proxy.mark()
    body = {"model": "break", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.stream("POST", fake_proxy.url + "/v1/chat/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_broken"
    capture = only(fake_proxy.since(mark))
    assert capture.outcome is CaptureOutcome.upstream_broken
    assert capture.choices[0].num_response_tokens == 3  # the tokens before the break are kept


def test_extras_an_upstream_refuses_are_dropped_once(workdir, start_proxy):
    port = free_port()
    upstream = Process([sys.executable, str(FAKE), "--port", str(port), "--refuse-experts"],
                       workdir / "fake-refuse.log", port).start()
    try:
        proxy = start_proxy(upstream.url)
        for _ in range(2):
            answer = proxy.client().chat.completions.create(model="fake-moe", messages=[{"role": "user", "content": "x"}])
            assert answer.choices[0].finish_reason == "stop"
        captures = proxy.since(0)
        assert [c.augmented for c in captures] == [["logprobs", "return_token_ids"]] * 2
        assert all(c.choices[0].routed_experts is None and c.choices[0].num_response_tokens for c in captures)
        assert httpx.get(proxy.url + "/proxy/status").json()["refused_extras"] == ["return_routed_experts"]
    finally:
        upstream.stop()


def fed_rows(prompt_ids, response_ids) -> np.ndarray:
    """The fake's experts for every fed position, computed here from its documented rule: the step
    fed token j produced token j + 1, and token t routes to (t + layer + k) % 4."""
    sequence = [*prompt_ids.tolist(), *response_ids.tolist()]
    return np.array([[[(t + layer + k) % 4 for k in range(2)] for layer in range(2)] for t in sequence[1:]])


def assert_split(capture: Capture) -> None:
    """Prompt positions 0 .. P-2 as prompt_routed_experts, the last R rows as routed_experts."""
    (choice,) = capture.choices
    rows = fed_rows(capture.prompt_token_ids, choice.response_token_ids)
    P = len(capture.prompt_token_ids)
    assert len(rows) == P + choice.num_response_tokens - 1
    np.testing.assert_array_equal(choice.prompt_routed_experts, rows[:P - 1])
    np.testing.assert_array_equal(choice.routed_experts, rows[P - 1:])


def test_sglang_routed_experts_are_unpacked_whole_and_streamed(workdir, start_proxy):
    """SGLang's routed experts (raw int32 over every fed position and every hidden layer, in
    `sglext`): split into prompt and response parts, the dense layer left out, and kept from the
    client, whose stream does not get SGLang's last chunk."""
    port = free_port()
    upstream = Process([sys.executable, str(FAKE), "--port", str(port), "--sglang"], workdir / "fake-sgl.log", port).start()
    try:
        proxy = start_proxy(upstream.url, "--moe-shape", "3x2")
        messages = [{"role": "user", "content": "x"}]
        whole = proxy.client().chat.completions.create(model="fake-moe", messages=messages)
        chunks = list(proxy.client().chat.completions.create(model="fake-moe", messages=messages, stream=True))
        assert "sglext" not in (whole.model_extra or {})
        assert not any("sglext" in (c.model_extra or {}) for c in chunks)
        captures = proxy.since(0)
        assert len(captures) == 2
        for capture in captures:
            assert_complete(capture.choices[0], experts_LK=(2, 2))
            assert_split(capture)
            assert not capture.notes
    finally:
        upstream.stop()


def test_vllm_packed_routed_experts_are_split(fake_proxy):
    """vLLM's routed experts (a base64 `.npy` over every fed position, on the choice): the capture
    holds the response's rows and the prompt's, the client gets neither."""
    mark = fake_proxy.mark()
    answer = fake_proxy.client().chat.completions.create(model="packed", messages=[{"role": "user", "content": "y"}])
    assert "routed_experts" not in (answer.choices[0].model_extra or {})
    capture = only(fake_proxy.since(mark))
    assert_complete(capture.choices[0], experts_LK=(2, 2))
    assert_split(capture)


# -- durability and export --------------------------------------------------------------------------

def test_acknowledged_captures_survive_kill_9(moe_server, workdir, start_proxy):
    """With ack_after_write a response's last bytes leave only after its capture is committed.

    Each round ends with a call whose answer is followed at once by SIGKILL. `FULL` synchronous
    mode makes each commit wait for an fsync, which widens the window a proxy that answered before
    committing would lose its last capture in (checked by hand: with --no-ack-after-write this
    test fails on most runs)."""
    store = workdir / "kill9.db"
    received = []
    for round_ in range(3):
        proxy = start_proxy(moe_server.url, "--sqlite-synchronous", "FULL", store=store)
        client = proxy.client()
        for i in range(3):
            messages = [{"role": "user", "content": f"round {round_} count to {i}"}]
            if i % 2:
                chunks = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=4, stream=True)
                received.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            else:
                received.append(client.chat.completions.create(model="tiny-moe", messages=messages,
                                                               max_tokens=4).choices[0].message.content)
        body = {"model": "tiny-moe", "messages": [{"role": "user", "content": f"round {round_} last"}], "max_tokens": 4}
        answer = httpx.post(proxy.url + "/v1/chat/completions", json=body)
        proxy.kill()
        received.append(answer.json()["choices"][0]["message"]["content"])
    restarted = start_proxy(moe_server.url, store=store)
    captures = restarted.since(0)
    assert [c.choices[0].content for c in captures] == received
    assert all(c.outcome is CaptureOutcome.ok and c.prompt_token_ids is not None for c in captures)
    with sqlite3.connect(store) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_captures_export_writes_one_capture_per_line(moe_proxy, tmp_path):
    moe_proxy.client().chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=3)
    out = tmp_path / "captures.jsonl"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "captures", "export", "--store",
                           str(moe_proxy.store.path), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == moe_proxy.store.count() and f"wrote {len(lines)} captures" in done.stdout
    for line in lines:
        record = json.loads(line)
        capture = Capture.model_validate_json(line)
        assert record["capture_id"] == capture.capture_id
    ok = [json.loads(line) for line in lines if json.loads(line)["outcome"] == "ok"]
    assert ok and all(isinstance(r["prompt_token_ids"], list) and isinstance(r["choices"][0]["response_token_ids"], list)
                      for r in ok)
    listed = subprocess.run([sys.executable, "-m", "rollmarket", "captures", "ls", "--store",
                             str(moe_proxy.store.path)], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and f"{len(lines)} captures in" in listed.stdout


# -- docs kept honest -------------------------------------------------------------------------------

def test_every_setting_field_and_outcome_is_documented():
    doc = (ROOT / "docs/proxy.md").read_text()
    flags = [f"--{name.replace('_', '-')}" for name in ProxySettings.model_fields]
    missing = [f for f in flags if f"`{f}`" not in doc]
    missing += [o.value for o in CaptureOutcome if f"`{o.value}`" not in doc]
    missing += [s.value for s in ConversationSource if f"`{s.value}`" not in doc]
    for model in (Capture, CapturedChoice, CaptureTimings):
        missing += [name for name in model.model_fields if f"`{name}`" not in doc]
    missing += [route for route in ("/healthz", "/proxy/status") if f"`{route}`" not in doc]
    assert not missing, f"missing from docs/proxy.md: {missing}"
