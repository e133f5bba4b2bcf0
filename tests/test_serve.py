"""`rollmarket serve-model` end to end: the official `openai` client against real server processes.

Three servers start once for the module, on loopback: tiny-moe at bf16, tiny-dense at fp32 and
tiny-dense at bf16 (the last only for the precision-profile test). The RL extensions are what
these tests protect: token ids, logprobs and text line up one to one; routed experts have one
row per token; streaming carries exactly what a non-streaming response carries; seeds reproduce.

Tool calls cannot be left to a small model's whims, so the parser is also driven end to end by
an echo engine (the real tokenizer and chat template; the reply is the user's message) served
in-process, and the streaming state machines are unit-tested with synthetic engine events.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import httpx
import numpy as np
import openai
import pytest
import transformers

from helpers import ServiceProcess, rollmarket_command

from rollmarket.engines import RolloutEngine, SamplingParams, StepEvent, TrainerEngine
from rollmarket.localhost import free_port
from rollmarket.serve import ServeSettings, create_serve_app
from rollmarket.serve.choice import ChoiceState
from rollmarket.serve.detok import Detokenizer
from rollmarket.serve.toolcalls import split_tool_calls

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"
DENSE = REPO / "models" / "tiny-dense"
MOE_LAYERS, TOP_K, NUM_EXPERTS = 4, 2, 8
PROMPT = [{"role": "user", "content": "What is 17 * 23? Answer with a number."}]
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
RL = {"return_token_ids": True}
RL_MOE = {"return_token_ids": True, "return_routed_experts": True}


# ---- servers ---------------------------------------------------------------------------------

class ModelServer(ServiceProcess):
    """`rollmarket serve-model` as a child process on a free loopback port."""

    def __init__(self, model: Path, precision: str, log: Path):
        port = free_port()
        # One torch thread: on shared CPUs a 2-thread pool collapses under contention (~30x).
        super().__init__(rollmarket_command("serve-model", str(model), "--precision", precision, "--device", "cpu",
                                            "--port", str(port)), log, port, env={"OMP_NUM_THREADS": "1"})
        self.model, self.precision = model, precision

    @property
    def name(self) -> str:
        return self.model.name

    def wait(self, timeout: float = 90.0) -> ModelServer:
        super().wait(timeout)
        return self

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60, **kwargs)

    def engine_stats(self) -> dict:
        return httpx.get(self.url + "/v1/engine", timeout=30).json()


def _wait_for_models(timeout: float = 600.0) -> None:
    """The shipped tiny models may still be being built by `rollmarket models build`."""
    needed = [d / n for d in (MOE, DENSE) for n in ("config.json", "model.safetensors", "tokenizer.json")]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in needed):
        if time.monotonic() > deadline:
            raise RuntimeError(f"shipped models missing: {[str(p) for p in needed if not p.exists()]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    _wait_for_models()
    logs = tmp_path_factory.mktemp("serve")
    started = {
        "moe": ModelServer(MOE, "bf16", logs / "moe.log").spawn(),
        "dense": ModelServer(DENSE, "fp32", logs / "dense.log").spawn(),
        "dense_bf16": ModelServer(DENSE, "bf16", logs / "dense-bf16.log").spawn(),
    }
    try:
        for server in started.values():
            server.wait()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def moe(servers) -> ModelServer:
    return servers["moe"]


@pytest.fixture(scope="module")
def dense(servers) -> ModelServer:
    return servers["dense"]


@pytest.fixture(scope="module")
def tokenizer():
    _wait_for_models()
    return transformers.AutoTokenizer.from_pretrained(MOE, local_files_only=True)


# ---- reference computations, independent of serve/detok.py ----------------------------------

def _byte_table() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTES = _byte_table()


def token_bytes(tok, token_id: int) -> bytes:
    """A token's exact bytes: byte-level BPE pieces map back through GPT-2's byte table."""
    added = {int(i): t.content for i, t in tok.added_tokens_decoder.items()}
    if token_id in added:
        return added[token_id].encode()
    return bytes(BYTES[ch] for ch in tok.convert_ids_to_tokens(token_id))


def chat_ids(tok, messages, tools=None) -> list[int]:
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def extra(obj, name):
    """A vLLM extension field on an openai response object."""
    return (obj.model_extra or {}).get(name)


def assert_lined_up(tok, token_ids, entries, content: str) -> None:
    """token_ids, logprob entries and text describe the same tokens, one to one."""
    assert len(token_ids) == len(entries) > 0
    special = set(tok.all_special_ids)
    for tid, entry in zip(token_ids, entries):
        assert bytes(entry.bytes) == token_bytes(tok, tid)
        assert entry.token == token_bytes(tok, tid).decode("utf-8", errors="replace")
        assert entry.logprob <= 0
    spelled = b"".join(bytes(e.bytes) for t, e in zip(token_ids, entries) if t not in special)
    assert spelled.decode("utf-8", errors="replace") == (content or "")


def assert_experts(experts, n_tokens: int) -> None:
    arr = np.asarray(experts)
    assert arr.shape == (n_tokens, MOE_LAYERS, TOP_K)
    assert arr.min() >= 0 and arr.max() < NUM_EXPERTS
    assert all(len(set(row)) == TOP_K for row in arr.reshape(-1, TOP_K).tolist())


def collect_stream(stream) -> dict[int, dict]:
    """Concatenate a chat stream's chunks per choice index."""
    out: dict[int, dict] = {}
    prompt_ids = None
    for chunk in stream:
        prompt_ids = extra(chunk, "prompt_token_ids") or prompt_ids
        for ch in chunk.choices:
            acc = out.setdefault(ch.index, {"content": "", "token_ids": [], "entries": [], "experts": [],
                                            "finish_reason": None, "tool_calls": {}})
            acc["content"] += ch.delta.content or ""
            acc["token_ids"] += extra(ch, "token_ids") or []
            acc["experts"] += extra(ch, "routed_experts") or []
            if ch.logprobs and ch.logprobs.content:
                acc["entries"] += ch.logprobs.content
            for call in ch.delta.tool_calls or []:
                acc["tool_calls"][call.index] = call
            acc["finish_reason"] = ch.finish_reason or acc["finish_reason"]
    for acc in out.values():
        acc["prompt_token_ids"] = prompt_ids
    return out


# ---- basics ----------------------------------------------------------------------------------

def test_models_lists_the_served_model(moe, dense):
    for server in (moe, dense):
        models = server.client().models.list().data
        assert [m.id for m in models] == [server.name]
        assert extra(models[0], "max_model_len") == 4096


def test_engine_route_reports_numerics(moe, dense):
    m, d = moe.engine_stats(), dense.engine_stats()
    assert (m["precision"], m["moe_layers"], m["num_experts"], m["top_k"]) == ("bf16", MOE_LAYERS, NUM_EXPERTS, TOP_K)
    assert (d["precision"], d["moe_layers"]) == ("fp32", 0)
    assert m["engine_fingerprint"].startswith("fp1:") and m["engine_fingerprint"] != d["engine_fingerprint"]


def test_chat_tokens_logprobs_text_and_experts_line_up(moe, tokenizer):
    resp = moe.client().chat.completions.create(
        model=moe.name, messages=PROMPT, max_tokens=24, seed=3, logprobs=True, top_logprobs=3,
        extra_body=RL_MOE)
    choice = resp.choices[0]
    token_ids = extra(choice, "token_ids")
    assert extra(resp, "prompt_token_ids") == chat_ids(tokenizer, PROMPT)
    tokenized = httpx.post(moe.url + "/tokenize", json={"messages": PROMPT}, timeout=30).json()
    assert tokenized["tokens"] == extra(resp, "prompt_token_ids")
    assert_lined_up(tokenizer, token_ids, choice.logprobs.content, choice.message.content)
    assert_experts(extra(choice, "routed_experts"), len(token_ids))
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-5
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert resp.usage.completion_tokens == len(token_ids)
    assert resp.usage.prompt_tokens == len(extra(resp, "prompt_token_ids"))
    if choice.finish_reason == "stop":  # ended on <|im_end|>: an id and a logprob, no text
        assert token_ids[-1] in tokenizer.all_special_ids


def test_dense_has_no_routed_experts(dense, tokenizer):
    resp = dense.client().chat.completions.create(
        model=dense.name, messages=PROMPT, max_tokens=8, seed=1, logprobs=True, extra_body=RL_MOE)
    choice = resp.choices[0]
    assert extra(choice, "routed_experts") is None
    assert_lined_up(tokenizer, extra(choice, "token_ids"), choice.logprobs.content, choice.message.content)


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_stream_carries_what_non_streaming_carries(servers, which, tokenizer):
    server = servers[which]
    kwargs = dict(model=server.name, messages=PROMPT, max_tokens=20, seed=11, logprobs=True,
                  top_logprobs=2, extra_body=RL_MOE)
    client = server.client()
    whole = client.chat.completions.create(**kwargs).choices[0]
    acc = collect_stream(client.chat.completions.create(stream=True, **kwargs))[0]
    assert acc["token_ids"] == extra(whole, "token_ids")
    assert acc["content"] == whole.message.content
    assert acc["finish_reason"] == whole.finish_reason
    assert [e.model_dump() for e in acc["entries"]] == [e.model_dump() for e in whole.logprobs.content]
    assert acc["prompt_token_ids"] == chat_ids(tokenizer, PROMPT)
    assert_lined_up(tokenizer, acc["token_ids"], acc["entries"], acc["content"])
    if which == "moe":
        assert acc["experts"] == extra(whole, "routed_experts")
    else:
        assert acc["experts"] == [] and extra(whole, "routed_experts") is None


def test_n_choices_seeded_reproducible_and_distinct(moe, tokenizer):
    kwargs = dict(model=moe.name, messages=[{"role": "user", "content": "Tell me a story."}], n=3,
                  max_tokens=16, seed=5, temperature=1.0, logprobs=True,
                  extra_body={**RL_MOE, "ignore_eos": True})
    first = moe.client().chat.completions.create(**kwargs)
    again = moe.client().chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [extra(c, "token_ids") for c in first.choices]
    assert ids == [extra(c, "token_ids") for c in again.choices]
    assert [[e.logprob for e in c.logprobs.content] for c in first.choices] == \
           [[e.logprob for e in c.logprobs.content] for c in again.choices]
    assert [extra(c, "routed_experts") for c in first.choices] == [extra(c, "routed_experts") for c in again.choices]
    assert len({tuple(i) for i in ids}) == 3
    for c in first.choices:
        assert len(extra(c, "token_ids")) == 16 and c.finish_reason == "length"
        assert_lined_up(tokenizer, extra(c, "token_ids"), c.logprobs.content, c.message.content)
        assert_experts(extra(c, "routed_experts"), 16)
    streamed = collect_stream(moe.client().chat.completions.create(stream=True, **kwargs))
    assert [streamed[i]["token_ids"] for i in range(3)] == ids


def _ascii_stop(text: str) -> tuple[str, int]:
    """A short printable-ASCII substring of ``text`` past its start, and where it first occurs."""
    for start in range(3, len(text) - 2):
        s = text[start:start + 2]
        if s.isascii() and s.strip() and s.isprintable() and "\ufffd" not in s:
            return s, text.find(s)
    raise AssertionError(f"no ASCII stop candidate in {text!r}")


def test_stop_strings_cut_the_text(dense):
    client = dense.client()
    kwargs = dict(model=dense.name, messages=PROMPT, max_tokens=40, seed=21,
                  extra_body={**RL, "ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    stop, cut = _ascii_stop(full.message.content)
    cut_choice = client.chat.completions.create(stop=[stop, "never-matches"], **kwargs).choices[0]
    assert cut_choice.finish_reason == "stop"
    assert cut_choice.message.content == full.message.content[:cut]
    ids = extra(cut_choice, "token_ids")
    assert ids == extra(full, "token_ids")[:len(ids)] and len(ids) < 40
    acc = collect_stream(client.chat.completions.create(stream=True, stop=stop, **kwargs))[0]
    assert (acc["content"], acc["finish_reason"], acc["token_ids"]) == (full.message.content[:cut], "stop", ids)


def test_max_tokens_means_length(moe):
    for stream in (False, True):
        kwargs = dict(model=moe.name, messages=PROMPT, max_tokens=7, seed=2,
                      extra_body={**RL_MOE, "ignore_eos": True})
        if stream:
            acc = collect_stream(moe.client().chat.completions.create(stream=True, **kwargs))[0]
            reason, ids = acc["finish_reason"], acc["token_ids"]
        else:
            choice = moe.client().chat.completions.create(**kwargs).choices[0]
            reason, ids = choice.finish_reason, extra(choice, "token_ids")
        assert reason == "length" and len(ids) == 7


# ---- completions -----------------------------------------------------------------------------

def test_completions_logprobs_and_token_prompts(moe, tokenizer):
    text = "The answer to 17 * 23 is"
    prompt_ids = tokenizer.encode(text)
    client = moe.client()
    kwargs = dict(model=moe.name, max_tokens=10, seed=8, logprobs=3, extra_body={**RL_MOE, "ignore_eos": True})
    by_text = client.completions.create(prompt=text, **kwargs).choices[0]
    by_ids = client.completions.create(prompt=prompt_ids, **kwargs).choices[0]
    ids = extra(by_text, "token_ids")
    assert extra(by_text, "prompt_token_ids") == extra(by_ids, "prompt_token_ids") == prompt_ids
    assert ids == extra(by_ids, "token_ids") and by_text.text == by_ids.text
    assert by_text.logprobs.token_logprobs == by_ids.logprobs.token_logprobs
    lp = by_text.logprobs
    assert len(ids) == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.tokens == [token_bytes(tokenizer, t).decode("utf-8", errors="replace") for t in ids]
    assert lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= max(top.values()) + 1e-5
    special = set(tokenizer.all_special_ids)
    spelled = b"".join(token_bytes(tokenizer, t) for t in ids if t not in special)
    assert spelled.decode("utf-8", errors="replace") == by_text.text
    assert_experts(extra(by_text, "routed_experts"), 10)
    batch = client.completions.create(prompt=[prompt_ids, prompt_ids[:3]], n=2, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [extra(c, "prompt_token_ids") for c in batch.choices] == [prompt_ids] * 2 + [prompt_ids[:3]] * 2


def test_completions_stream(dense):
    """Each chunk's logprobs belong to that chunk's token, for every prompt and choice."""
    kwargs = dict(model=dense.name, prompt=["Once upon a time", "The port is", "Hello", "Seven"], n=2,
                  max_tokens=32, seed=4,
                  logprobs=2, extra_body={**RL, "ignore_eos": True})
    client = dense.client()
    whole = client.completions.create(**kwargs).choices
    got = {c.index: {"text": "", "ids": [], "lps": []} for c in whole}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert len(extra(c, "token_ids")) == len(c.logprobs.token_logprobs) == len(c.logprobs.tokens)
            got[c.index]["text"] += c.text
            got[c.index]["ids"] += extra(c, "token_ids")
            got[c.index]["lps"] += c.logprobs.token_logprobs
    for c in whole:
        assert got[c.index] == {"text": c.text, "ids": extra(c, "token_ids"), "lps": c.logprobs.token_logprobs}


def test_completion_stream_chunks_keep_their_own_tokens_when_the_reader_lags(tokenizer):
    """Every step is already queued when the stream is read (a slow client): each chunk must
    still carry its own token's logprob and text, not a later step's."""
    import asyncio

    from rollmarket.serve.app import ModelServer, _completion_stream
    from rollmarket.serve.batcher import DONE, Pending
    from rollmarket.serve.protocol import CompletionRequest

    info = SimpleNamespace(name="tiny", eos_token_ids=(2,), vocab_size=tokenizer.vocab_size)
    server = ModelServer(SimpleNamespace(tokenizer=tokenizer, info=info), ServeSettings(model_path="tiny"))
    words = list(dict.fromkeys(tokenizer.encode(" one two three four five six")))  # distinct ids
    req = CompletionRequest(model="tiny", prompt="x", logprobs=1, return_token_ids=True)

    async def read() -> list[dict]:
        loop = asyncio.get_running_loop()
        runs = []
        for k in range(2):
            pending = Pending([1], SamplingParams(), 1, loop, asyncio.Queue())
            for step, token in enumerate(words):
                finish = "length" if step == len(words) - 1 else None
                pending.events.put_nowait([(0, StepEvent(0, token, -float(step + k), [], None, finish))])
            pending.events.put_nowait(DONE)
            runs.append(([1], server.new_choices(1, k, (), False), pending))
        chunks = [json.loads(line[6:]) async for line in _lines(_completion_stream(server, req, "c", 0, runs, False))]
        return [c for chunk in chunks for c in chunk.get("choices", [])]

    for entry in asyncio.run(read()):
        step = words.index(entry["token_ids"][0])
        assert entry["logprobs"]["token_logprobs"] == [-float(step + entry["index"])]
        assert entry["text"] == tokenizer.decode([words[step]])


async def _lines(stream):
    async for raw in stream:
        for line in raw.decode().split("\n"):
            if line.startswith("data: {"):
                yield line


# ---- tool calls ------------------------------------------------------------------------------

CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'


def test_split_tool_calls_parses_hermes_blocks():
    content, calls = split_tool_calls("Let me compute.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("17 * 23", "2+2"))
    assert content == "Let me compute."
    assert [c["function"]["name"] for c in calls] == ["calculator", "calculator"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "17 * 23"}, {"expression": "2+2"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # arguments given as a JSON string are decoded; a bare call has no content
    content, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    # anything malformed stays visible as content
    for bad in ("<tool_call>\n{not json}\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                "no call here", "<tool_call>\n{\"name\": \"f\"}"):
        assert split_tool_calls(bad) == (bad, [])


class _ByteDetok:
    """One token per character: exercises partial tags and partial UTF-8 in streaming deltas."""

    special_ids: ClassVar[set[int]] = {0}

    def token_bytes(self, token_id: int) -> bytes:
        return b"<|end|>" if token_id == 0 else bytes([token_id])


def _events(data: bytes, finish: str = "stop") -> list[StepEvent]:
    return [StepEvent(0, b, -1.0, [], None, None) for b in data] + [StepEvent(0, 0, -0.1, [], None, finish)]


def _drive(state: ChoiceState, events) -> tuple[list[str], list[dict]]:
    texts, calls = [], []
    for ev in events:
        state.add(ev)
        text, new_calls = state.stream_delta()
        texts.append(text)
        calls += new_calls
    return texts, calls


def test_choice_state_streams_tool_calls_and_holds_partial_text():
    data = ("Let me compute: é\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("17 * 23", "1+1")).encode()
    state = ChoiceState(0, _ByteDetok(), frozenset({0}), (), parse_tools=True)
    texts, calls = _drive(state, _events(data))
    content, final_calls, reason = state.final()
    assert reason == "tool_calls" and content == "Let me compute: é"
    assert "".join(texts).strip() == content
    assert all("<" not in t and "\ufffd" not in t for t in texts)  # no half tag, no half character
    assert [c["function"] for c in calls] == [c["function"] for c in final_calls]
    # the first call is sent as soon as its closing tag is in, before the sequence ends
    first_call_step = len("Let me compute: é\n".encode() + CALL_TEXT.encode())
    state2 = ChoiceState(0, _ByteDetok(), frozenset({0}), (), parse_tools=True)
    _, early = _drive(state2, _events(data)[:first_call_step])
    assert [json.loads(c["function"]["arguments"]) for c in early] == [{"expression": "17 * 23"}]


def test_choice_state_stop_strings_and_special_tokens():
    data = b"abc<|x|>def STOP ghi"
    state = ChoiceState(0, _ByteDetok(), frozenset({0}), ("STOP",))
    events = _events(data[:data.index(b"STOP") + 4])[:-1]
    events[-1].finish_reason = "stop"  # the engine ends on the token that completes "STOP"
    texts, _ = _drive(state, events)
    assert "".join(texts) == state.final()[0] == "abc<|x|>def "
    # a special token mid-sequence (ignore_eos) is an id and a logprob, not text
    state = ChoiceState(0, _ByteDetok(), frozenset({0}))
    texts, _ = _drive(state, [StepEvent(0, 0x61, -1.0, [], None, None), StepEvent(0, 0, -1.0, [], None, None),
                              StepEvent(0, 0x62, -1.0, [], None, "length")])
    assert state.final() == ("ab", [], "length") and "".join(texts) == "ab" and state.token_ids == [0x61, 0, 0x62]


def test_special_tokens_never_reach_content(tokenizer):
    detok = Detokenizer(tokenizer)
    hello = tokenizer.encode("hello world")
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    state = ChoiceState(0, detok, frozenset({im_end}))
    for t in [*hello, im_start, *hello, im_end]:
        state.add(StepEvent(0, t, -1.0, [], None, None))
    state.add(StepEvent(0, im_end, -1.0, [], None, "length"))
    assert state.final()[0] == "hello worldhello world"


class EchoEngine(RolloutEngine):
    """The real tiny model's tokenizer and chat template; the reply is the last user message.

    Only sampling is replaced (a forced reply, since random weights write no tool calls);
    stop handling is the engine's own, and everything downstream (batcher, choice state, the
    tool-call parser, response and chunk shapes, the openai client's parsing) is production code.
    """

    def reply(self, prompt_ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        user = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return [*self.tokenizer.encode(user), self.info.eos_token_ids[0]]

    def session(self) -> "EchoSession":
        return EchoSession(self)


class EchoSession:
    """The decode session's interface (rows join, step, leave) over EchoEngine's scripts."""

    def __init__(self, engine: EchoEngine):
        self.engine, self.rows, self._count = engine, [], 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompts, params, seeds_index=None):
        new = [SimpleNamespace(index=self._count + i, params=p, script=self.engine.reply(q), tokens=[],
                               stop_hit=None, finish=None) for i, (q, p) in enumerate(zip(prompts, params))]
        self._count += len(new)
        self.rows += new
        return new

    def remove(self, rows) -> None:
        self.rows = [r for r in self.rows if all(r is not gone for gone in rows)]

    def step(self) -> list[StepEvent]:
        eos, events = set(self.engine.info.eos_token_ids), []
        for r in self.rows:
            r.tokens.append(r.script[len(r.tokens)])
            r.finish = self.engine._finish_reason(r, r.tokens[-1], eos)
            events.append(StepEvent(r.index, r.tokens[-1], -0.5, [], None, r.finish))
        self.rows = [r for r in self.rows if r.finish is None]
        return events


@pytest.fixture(scope="module")
def echo():
    """An in-process server over EchoEngine; yields an openai client for it."""
    import uvicorn

    _wait_for_models()
    engine = EchoEngine.from_path(DENSE, "fp32", "cpu")
    port = free_port()
    app = create_serve_app(engine, ServeSettings(model_path=str(DENSE), port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "echo server did not start"
        time.sleep(0.02)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    server.should_exit = True
    thread.join(10)


def test_tool_calls_end_to_end(echo, tokenizer):
    said = "I will use the calculator.\n" + CALL_TEXT
    kwargs = dict(model=DENSE.name, messages=[{"role": "user", "content": said}], tools=[CALCULATOR],
                  extra_body=RL)
    resp = echo.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will use the calculator."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "17 * 23"}
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in extra(choice, "token_ids")

    acc = collect_stream(echo.chat.completions.create(stream=True, **kwargs))[0]
    assert acc["finish_reason"] == "tool_calls"
    assert acc["content"].strip() == "I will use the calculator."
    (streamed,) = acc["tool_calls"].values()
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.function.name == "calculator"
    assert json.loads(streamed.function.arguments) == {"expression": "17 * 23"}
    assert acc["token_ids"] == extra(choice, "token_ids")

    two = echo.chat.completions.create(**{**kwargs, "messages": [
        {"role": "user", "content": CALL_TEXT + "\n" + CALL_TEXT.replace("17 * 23", "1+1")}]}).choices[0]
    assert two.message.content is None and two.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["expression"] for c in two.message.tool_calls] == ["17 * 23", "1+1"]

    # without tools (or with tool_choice none) the same reply is plain text
    for extra_kwargs in ({"tools": None}, {"tool_choice": "none"}):
        plain = echo.chat.completions.create(**{**kwargs, **extra_kwargs}).choices[0]
        assert plain.message.tool_calls is None and plain.finish_reason == "stop"
        assert plain.message.content == said


def test_stop_strings_skip_special_tokens(echo, tokenizer):
    """A stop string matches the returned text, where special tokens are not text (as vLLM)."""
    said = "The answer is 39<|im_start|>1. And then some more words."
    choice = echo.chat.completions.create(model=DENSE.name, messages=[{"role": "user", "content": said}],
                                          stop=["391"], extra_body=RL).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "The answer is "
    assert extra(choice, "token_ids") == tokenizer.encode("The answer is 39<|im_start|>1")


def test_real_model_tool_call_when_it_makes_one(moe, tokenizer):
    """Whatever the model writes with a calculator on offer: a well-formed call is parsed,
    anything else stays as content. (A trained tiny-moe makes the call; random weights do not.)"""
    resp = moe.client().chat.completions.create(
        model=moe.name, messages=[{"role": "user", "content": "Use the calculator: what is 17 * 23?"}],
        tools=[CALCULATOR], temperature=0, max_tokens=64, extra_body=RL)
    choice = resp.choices[0]
    assert extra(resp, "prompt_token_ids") == chat_ids(tokenizer, [
        {"role": "user", "content": "Use the calculator: what is 17 * 23?"}], tools=[CALCULATOR])
    special = set(tokenizer.all_special_ids)
    raw = b"".join(token_bytes(tokenizer, t) for t in extra(choice, "token_ids") if t not in special)
    content, expected = split_tool_calls(raw.decode("utf-8", errors="replace"))
    if expected:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == [c["function"]["name"] for c in expected]
        for call in choice.message.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict)
        assert choice.message.content == content
    else:
        assert choice.message.tool_calls is None
        assert choice.message.content == raw.decode("utf-8", errors="replace")


def test_tool_history_renders_through_the_template(moe, tokenizer):
    messages = [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "17 * 23"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "391"},
    ]
    resp = moe.client().chat.completions.create(model=moe.name, messages=messages, tools=[CALCULATOR],
                                                max_tokens=4, extra_body=RL)
    prompt = extra(resp, "prompt_token_ids")
    ids = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    assert all(i in prompt for i in ids)
    rendered = [dict(m) for m in messages]
    rendered[1]["tool_calls"] = [{**messages[1]["tool_calls"][0], "function": {
        "name": "calculator", "arguments": {"expression": "17 * 23"}}}]
    assert prompt == chat_ids(tokenizer, rendered, tools=[CALCULATOR])
    assert '{"name": "calculator", "arguments": {"expression": "17 * 23"}}' in tokenizer.decode(prompt)


# ---- bad input -------------------------------------------------------------------------------

def _assert_openai_error(body: dict, *, code=None, param=None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    if code:
        assert body["error"]["code"] == code
    if param:
        assert body["error"]["param"] == param


def test_bad_input_is_a_400_in_openai_shape(moe):
    url, client = moe.url, moe.client()
    raw = [(b"{not json", "/v1/chat/completions"), (b"[1, 2]", "/v1/chat/completions"),
           (json.dumps({"model": moe.name}).encode(), "/v1/chat/completions"),
           (json.dumps({"model": moe.name, "messages": []}).encode(), "/v1/chat/completions"),
           (b"{not json", "/v1/completions"), (b"{not json", "/tokenize"),
           (json.dumps({"messages": "hi"}).encode(), "/tokenize"),
           (json.dumps({"tokens": [10 ** 6]}).encode(), "/detokenize")]
    for body, route in raw:
        r = httpx.post(url + route, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (route, body, r.text)
        _assert_openai_error(r.json())

    chat = dict(model=moe.name, messages=PROMPT, max_tokens=4)
    for override, param in [({"n": 0}, "n"), ({"temperature": -1}, "temperature"),
                            ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
                            ({"stop": [""]}, "stop"), ({"top_p": 0}, "top_p")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**{**chat, **override})
        assert err.value.status_code == 400 and err.value.param == param
        _assert_openai_error(err.value.response.json())

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(**{**chat, "model": "no-such-model"})
    assert err.value.code == "model_not_found"
    _assert_openai_error(err.value.response.json())

    long = [{"role": "user", "content": "hello " * 5000}]
    for kwargs in ({**chat, "messages": long}, {**chat, "max_tokens": 5000}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kwargs)
        assert err.value.code == "context_length_exceeded"
    for prompt in ("", [], [[]], [10 ** 6]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=moe.name, prompt=prompt, max_tokens=2)
        assert err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**chat, "n": 0}, stream=True)

    # ... and the server still serves
    ok = client.chat.completions.create(**chat, extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4


def test_a_body_without_model_is_served_by_the_one_model(moe):
    """vLLM's rule, which NeMo Gym's agents rely on (they send no `model`): an absent model is the
    one served, and the answer names it; a wrong name is still a 404."""
    body = {"messages": PROMPT, "max_tokens": 3, "ignore_eos": True, "seed": 3}
    r = httpx.post(moe.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == moe.name and r.json()["usage"]["completion_tokens"] == 3
    named = httpx.post(moe.url + "/v1/chat/completions", json={**body, "model": moe.name}, timeout=60).json()
    assert [c["message"]["content"] for c in named["choices"]] == [c["message"]["content"] for c in r.json()["choices"]]
    r = httpx.post(moe.url + "/v1/responses", json={"input": "hello", "max_output_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == moe.name
    assert httpx.post(moe.url + "/v1/chat/completions", json={**body, "model": "other"}, timeout=60).status_code == 404


# ---- batching --------------------------------------------------------------------------------

def test_concurrent_requests_are_batched(moe):
    before = moe.engine_stats()
    client = moe.client()
    started = time.perf_counter()

    def one(i: int):
        return client.chat.completions.create(
            model=moe.name, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=24,
            seed=i, extra_body={**RL_MOE, "ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    after = moe.engine_stats()
    for resp in results:
        choice = resp.choices[0]
        assert choice.finish_reason == "length" and len(extra(choice, "token_ids")) == 24
        assert_experts(extra(choice, "routed_experts"), 24)
    assert after["sequences"] - before["sequences"] == 16
    assert after["batches"] - before["batches"] < 16, "requests ran one by one"
    assert after["largest_batch"] > 1
    # The decode thread's account: every token came from a step (24 tokens per request, at most
    # largest_batch rows a step), and its timers cover no more than the requests' own wall time.
    steps = after["decode_steps"] - before["decode_steps"]
    assert 24 <= steps and 16 * 24 <= steps * after["largest_batch"]
    busy = (after["decode_seconds"] - before["decode_seconds"]) + (after["prefill_seconds"] - before["prefill_seconds"])
    assert 0 < busy <= time.perf_counter() - started
    assert after["queue_seconds"] - before["queue_seconds"] >= 0


# ---- precision profiles ----------------------------------------------------------------------

def test_precision_profiles_differ_measurably_and_each_reproduces(servers, tokenizer):
    fp32, bf16 = servers["dense"], servers["dense_bf16"]
    assert bf16.engine_stats()["engine_fingerprint"] != fp32.engine_stats()["engine_fingerprint"]
    kwargs = dict(messages=PROMPT, max_tokens=16, seed=99, logprobs=True, extra_body={**RL, "ignore_eos": True})

    def run(server):
        choice = server.client().chat.completions.create(model=server.name, **kwargs).choices[0]
        return extra(choice, "token_ids"), np.array([e.logprob for e in choice.logprobs.content])

    ids32, lp32 = run(fp32)
    ids16, lp16 = run(bf16)
    assert run(fp32)[0] == ids32 and np.array_equal(run(fp32)[1], lp32)
    assert run(bf16)[0] == ids16 and np.array_equal(run(bf16)[1], lp16)

    # Teacher-forced at fp32 on the bf16 server's own tokens: the sampled tokens may diverge,
    # so compare the two profiles on the same tokens. fp32 scoring matches the fp32 sampler.
    prompt = chat_ids(tokenizer, PROMPT)
    teacher = TrainerEngine.from_path(DENSE, "fp32", "cpu")
    np.testing.assert_allclose(teacher.score(prompt, ids32).logprobs_T, lp32, atol=1e-4)
    on_bf16_tokens = teacher.score(prompt, ids16).logprobs_T
    assert np.abs(on_bf16_tokens - lp16).max() > 1e-3, "bf16 and fp32 logprobs are indistinguishable"
    if ids16 == ids32:
        assert np.abs(lp16 - lp32).max() > 1e-3
