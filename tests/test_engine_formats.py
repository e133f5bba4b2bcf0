"""Engines' wire formats read into our contracts (`rollmarket.contracts.upstream`).

What these tests protect: vLLM and SGLang send routed experts over every position the model was
fed (prompt and response), packed as base64; our contracts hold the response's rows (row t: the
step that produced response token t) and, apart, the prompt's (positions 0 .. P-2). A split off by
one row trains router replay on the wrong experts without any error, so the layout is checked
against expectations computed here from positions, never against the code's own output.

vLLM's bytes are made by vLLM's own encoder (`vllm.utils.serial_utils.numpy2base64`, run in
`.venv-vllm`): vLLM's CPU build cannot produce routed experts for real (its GPU model runner
does). SGLang's bodies are written from its source, cited where they are built.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import time

import httpx
import numpy as np
import pytest

from fake_upstream import npy_base64
from rollmarket.agents.model import ChatModel, ModelCallError, Sampling, parse_turn
from rollmarket.contracts import upstream
from rollmarket.contracts.capture import CaptureOutcome, ConversationSource
from rollmarket.proxy.capture import CallRecorder, build_capture
from vllm_server import VLLM_PYTHON, VllmUnavailable

P, R, L, K = 4, 4, 2, 2
"""Prompt and response tokens, MoE layers, top-k of the arrays below."""


def position_rows(positions) -> np.ndarray:
    """[len, L, K]: an expert id that names its fed position, layer and slot (position*4 + layer*2 + k)."""
    return np.array([[[j * 4 + layer * 2 + k for k in range(K)] for layer in range(L)] for j in positions])


FED = position_rows(range(P + R - 1))
"""Every fed position 0 .. P+R-2, as vLLM returns them with routed_experts_prompt_start = 0."""

VLLM_ENCODE = """
import json, sys
import numpy as np
from vllm.utils.serial_utils import numpy2base64
specs = json.load(sys.stdin)
print(json.dumps({name: numpy2base64(np.asarray(values, dtype=dtype)) for name, (values, dtype) in specs.items()}))
"""

ARRAYS = {
    "uint8": (FED.tolist(), "uint8"),
    "uint16": ((FED + 1000).tolist(), "uint16"),
    "int32": (FED.tolist(), "int32"),
    "start2": (position_rows(range(2, P + R - 1)).tolist(), "int32"),  # routed_experts_prompt_start=2
    "float": (FED.tolist(), "float32"),
    "rank2": (FED.reshape(len(FED), -1).tolist(), "int32"),
    "too_big": ((FED + 40000).tolist(), "uint16"),
    "negative": ((FED - 1).tolist(), "int32"),
}


@pytest.fixture(scope="module")
def vllm_encoded() -> dict[str, str]:
    """ARRAYS encoded by vLLM's own function, in vLLM's virtualenv."""
    if not VLLM_PYTHON.exists():
        raise VllmUnavailable(f"{VLLM_PYTHON} is missing: run `make vllm`")
    done = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_ENCODE], input=json.dumps(ARRAYS), capture_output=True,
                          text=True, timeout=300, env={"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_chat_answer(experts: str, *, token_ids: bool = True) -> dict:
    """A chat completion as vLLM 0.32 writes it with return_token_ids and return_routed_experts
    (vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionResponse, its choice's
    `token_ids` and `routed_experts`; the response's `prompt_token_ids`)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "abcd"}, "finish_reason": "length",
              "logprobs": {"content": [{"token": c, "logprob": -0.5, "bytes": [ord(c)], "top_logprobs": []}
                                       for c in "abcd"]},
              "stop_reason": None, "routed_experts": experts}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": P, "completion_tokens": R, "total_tokens": P + R}}
    if token_ids:
        choice["token_ids"] = [11, 12, 13, 14]
        body["prompt_token_ids"] = [1, 2, 3, 4]
    return body


def capture_of(answer: dict, request: dict | None = None, experts_shape=None):
    """The capture the proxy builds from one whole answer (the recorder and writer-thread code)."""
    recorder = CallRecorder(endpoint="/v1/chat/completions", stream=False, upstream="http://up", augmented=[],
                            request=request or {"model": "m", "messages": [{"role": "user", "content": "q"}]},
                            header_conversation=None, received_at=time.time())
    recorder.response(answer)
    draft = recorder.draft(status_code=200, outcome=CaptureOutcome.ok,
                           timings={"received_at": time.time(), "total_s": 0.1, "proxy_s": 0.01})
    return build_capture(draft, conversation_id="c", source=ConversationSource.root, parent=None,
                         experts_shape=experts_shape)


# -- vLLM ------------------------------------------------------------------------------------------

def test_vllm_encoded_arrays_decode_to_what_vllm_encoded(vllm_encoded):
    for name, offset in (("uint8", 0), ("uint16", 1000), ("int32", 0)):
        decoded = upstream.decode_vllm(vllm_encoded[name])
        assert decoded.dtype == np.int16
        np.testing.assert_array_equal(decoded, FED + offset)
    # The fake upstream (tests/fake_upstream.py) packs as vLLM does, byte for byte.
    assert npy_base64(FED.astype(np.uint8)) == vllm_encoded["uint8"]


def test_vllm_experts_split_into_our_layout(vllm_encoded):
    """Response token t was produced by the step fed position P-1+t; the prompt keeps 0 .. P-2.
    Read the same way by the worker's model client (with or without token ids: usage counts) and
    by the proxy's capture."""
    response = position_rows(range(P - 1, P + R - 1))
    prompt = position_rows(range(P - 1))
    split = upstream.split(upstream.decode_vllm(vllm_encoded["uint8"]), prompt_tokens=P, response_tokens=R)
    np.testing.assert_array_equal(split.response_RLK, response)
    np.testing.assert_array_equal(split.prompt_PLK, prompt)
    for with_ids in (True, False):
        turn = parse_turn(vllm_chat_answer(vllm_encoded["uint8"], token_ids=with_ids))
        np.testing.assert_array_equal(turn.routed_experts_RLK, response)
        np.testing.assert_array_equal(turn.prompt_routed_experts_PLK, prompt)
    capture = capture_of(vllm_chat_answer(vllm_encoded["int32"]))
    (choice,) = capture.choices
    assert not capture.notes
    np.testing.assert_array_equal(choice.routed_experts, response)
    np.testing.assert_array_equal(choice.prompt_routed_experts, prompt)


def test_vllm_prompt_start_skips_prompt_rows(vllm_encoded):
    """`routed_experts_prompt_start` = 2: vLLM leaves out prompt positions 0 and 1."""
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}], "routed_experts_prompt_start": 2}
    (choice,) = capture_of(vllm_chat_answer(vllm_encoded["start2"]), request).choices
    np.testing.assert_array_equal(choice.routed_experts, position_rows(range(P - 1, P + R - 1)))
    np.testing.assert_array_equal(choice.prompt_routed_experts, position_rows(range(2, P - 1)))
    # Read as if from position 0, the same bytes are two rows short: refused, not shifted.
    with pytest.raises(upstream.RoutedExpertsTokenCount):
        upstream.split(upstream.decode_vllm(vllm_encoded["start2"]), prompt_tokens=P, response_tokens=R)


def _npy(array: np.ndarray, *, allow_pickle: bool = False) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return base64.b64encode(buffer.getvalue()).decode()


def _claims(encoded: str, shape: str) -> str:
    """vLLM's bytes with a header that claims another shape (padding kept so the header still parses)."""
    data = base64.b64decode(encoded)
    old = f"{tuple(FED.shape)}".encode()
    grown = data.replace(old, shape.encode()).replace(b" " * (len(shape) - len(old)) + b"\n", b"\n", 1)
    assert len(grown) == len(data)
    return base64.b64encode(grown).decode()


MALFORMED = [
    ("not base64", lambda e: "@@ not base64 @@", upstream.RoutedExpertsEncoding),
    ("not a string", lambda e: {"rows": 7}, upstream.RoutedExpertsEncoding),
    ("not .npy", lambda e: base64.b64encode(b"\x00\x01 not an npy file").decode(), upstream.RoutedExpertsEncoding),
    ("pickled objects", lambda e: _npy(np.array([{"a": 1}], dtype=object), allow_pickle=True),
     upstream.RoutedExpertsEncoding),
    ("a shape its bytes cannot hold", lambda e: _claims(e["int32"], "(70000000000, 2, 2)"),
     upstream.RoutedExpertsEncoding),
    ("float dtype", lambda e: e["float"], upstream.RoutedExpertsShape),
    ("rank 2", lambda e: e["rank2"], upstream.RoutedExpertsShape),
    ("ids past int16", lambda e: e["too_big"], upstream.RoutedExpertsShape),
    ("negative ids", lambda e: e["negative"], upstream.RoutedExpertsShape),
]


@pytest.mark.parametrize("what,make,error", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_vllm_experts_are_typed_errors(vllm_encoded, what, make, error):
    """Each malformed array is its own typed error in the model client, and a note (the capture
    kept, with no experts) in the proxy."""
    encoded = make(vllm_encoded)
    with pytest.raises(error):
        parse_turn(vllm_chat_answer(encoded))
    capture = capture_of(vllm_chat_answer(encoded))
    assert capture.choices[0].routed_experts is None and capture.choices[0].prompt_routed_experts is None
    assert capture.choices[0].num_response_tokens == R
    assert [n for n in capture.notes if error.__name__ in n], capture.notes


def test_vllm_experts_for_another_token_count_are_refused(vllm_encoded):
    answer = vllm_chat_answer(vllm_encoded["uint8"])
    answer["prompt_token_ids"] = [1, 2, 3, 4, 5]  # one more prompt token than the rows cover
    with pytest.raises(upstream.RoutedExpertsTokenCount):
        parse_turn(answer)
    capture = capture_of(answer)
    assert capture.choices[0].routed_experts is None
    assert any("RoutedExpertsTokenCount" in n for n in capture.notes)
    answer = vllm_chat_answer(vllm_encoded["uint8"], token_ids=False)
    del answer["usage"]  # nothing says how many rows are the prompt's
    with pytest.raises(upstream.RoutedExpertsTokenCount):
        parse_turn(answer)


def test_the_model_client_turns_unreadable_experts_into_a_model_call_error(vllm_encoded):
    """ChatModel.complete: the agent loop sees a ModelCallError naming the typed cause. (An
    in-process transport stands in for a vLLM that returns routed experts: none runs here.)"""
    answer = vllm_chat_answer(vllm_encoded["float"])
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    with ChatModel("http://vllm.test/v1", model="m", transport=transport) as model:
        with pytest.raises(ModelCallError, match="RoutedExpertsShape"):
            model.complete([{"role": "user", "content": "q"}], [], Sampling(max_tokens=4))


# -- SGLang ----------------------------------------------------------------------------------------

SGL_LAYERS = 3
"""Hidden layers of the SGLang model below: layer 0 dense (-1 throughout), 1 and 2 MoE."""


def sglang_experts(rows_NLK: np.ndarray) -> str:
    """SGLang's encoding (python/sglang/srt/managers/tokenizer_manager.py: meta_info["routed_experts"]
    = pybase64.b64encode(tensor.numpy().tobytes()) of int32 [seqlen - 1, num_hidden_layers, top_k])."""
    dense = np.full((len(rows_NLK), 1, K), -1)
    return base64.b64encode(np.concatenate([dense, rows_NLK], axis=1).astype("<i4").tobytes()).decode()


def sglang_chat_answer(experts: str, *, where: str) -> dict:
    """A chat completion as SGLang writes it with logprobs, return_prompt_token_ids, return_meta_info
    and return_routed_experts (python/sglang/srt/entrypoints/openai/serving_chat.py,
    `_build_chat_response`: the choice's `prompt_token_ids` and `meta_info`, the answer's `sglext`;
    before `sglext`, SGLang put it on the choice as `sgl_ext`)."""
    ids = [11, 12, 13, 14]
    meta = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": P, "completion_tokens": R,
            "cached_tokens": 0, "weight_version": "default",
            "output_token_logprobs": [[-0.25 * (i + 1), t, chr(t)] for i, t in enumerate(ids)]}
    choice = {"index": 0, "message": {"role": "assistant", "content": "abcd", "reasoning_content": None,
                                      "tool_calls": None},
              "logprobs": {"content": [{"token": chr(t), "bytes": [t], "logprob": -0.25 * (i + 1), "top_logprobs": []}
                                       for i, t in enumerate(ids)]},
              "finish_reason": "length", "matched_stop": None, "prompt_token_ids": [1, 2, 3, 4], "meta_info": meta}
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": P, "completion_tokens": R, "total_tokens": P + R},
            "metadata": {"weight_version": "default"}}
    if where == "sglext":
        body["sglext"] = {"routed_experts": experts}
    elif where == "sgl_ext":
        choice["sgl_ext"] = {"routed_experts": experts}
    else:
        meta["routed_experts"] = experts
    return body


@pytest.mark.parametrize("where", ["sglext", "sgl_ext", "meta_info"])
def test_sglang_answers_read_like_vllm_ones(where):
    """Token ids from `meta_info.output_token_logprobs`, the prompt's from the choice, routed
    experts wherever SGLang put them: the same layout as vLLM's, the dense layer left out."""
    answer = sglang_chat_answer(sglang_experts(FED), where=where)
    turn = parse_turn(answer, moe_shape=(SGL_LAYERS, K))
    assert turn.token_ids_R.tolist() == [11, 12, 13, 14] and turn.prompt_token_ids_P.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(turn.logprobs_R, [-0.25, -0.5, -0.75, -1.0])
    np.testing.assert_array_equal(turn.routed_experts_RLK, position_rows(range(P - 1, P + R - 1)))
    np.testing.assert_array_equal(turn.prompt_routed_experts_PLK, position_rows(range(P - 1)))
    # Without the model's shape the bytes cannot be cut: nothing is guessed.
    assert parse_turn(answer).routed_experts_RLK is None
    capture = capture_of(answer, experts_shape=(SGL_LAYERS, K))
    (choice,) = capture.choices
    assert choice.response_token_ids.tolist() == [11, 12, 13, 14] and not capture.notes
    np.testing.assert_array_equal(choice.routed_experts, position_rows(range(P - 1, P + R - 1)))
    np.testing.assert_array_equal(choice.prompt_routed_experts, position_rows(range(P - 1)))


def test_malformed_sglang_experts_are_typed_errors():
    whole = sglang_experts(FED)
    cut = base64.b64encode(base64.b64decode(whole)[:-4]).decode()  # not whole rows
    with pytest.raises(upstream.RoutedExpertsEncoding):
        parse_turn(sglang_chat_answer(cut, where="sglext"), moe_shape=(SGL_LAYERS, K))
    with pytest.raises(upstream.RoutedExpertsError):  # the shape of another model: -1 among the ids
        parse_turn(sglang_chat_answer(whole, where="sglext"), moe_shape=(7, K))
    longer = sglang_chat_answer(whole, where="sglext")
    longer["choices"][0]["prompt_token_ids"] = [1, 2, 3, 4, 5]
    with pytest.raises(upstream.RoutedExpertsTokenCount):
        parse_turn(longer, moe_shape=(SGL_LAYERS, K))
    capture = capture_of(sglang_chat_answer(cut, where="sglext"), experts_shape=(SGL_LAYERS, K))
    assert capture.choices[0].routed_experts is None
    assert any("RoutedExpertsEncoding" in n for n in capture.notes)


def test_sglang_start_len_skips_prompt_rows():
    """SGLang's `routed_experts_start_len` = 2 (python/sglang/srt/managers/io_struct.py: the rows
    cover [start_len, seqlen - 1)): the capture's prompt part starts at position 2."""
    answer = sglang_chat_answer(sglang_experts(position_rows(range(2, P + R - 1))), where="sglext")
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}], "routed_experts_start_len": 2}
    capture = capture_of(answer, request, experts_shape=(SGL_LAYERS, K))
    (choice,) = capture.choices
    assert not capture.notes
    np.testing.assert_array_equal(choice.routed_experts, position_rows(range(P - 1, P + R - 1)))
    np.testing.assert_array_equal(choice.prompt_routed_experts, position_rows(range(2, P - 1)))


def test_the_model_client_asks_sglang_by_its_own_names():
    """SGLang has no `return_token_ids`: the model client also asks `return_prompt_token_ids` and
    `return_meta_info`, and reads the ids from what SGLang answers to them. (An in-process
    transport answers as SGLang's serving_chat.py does: no SGLang runs here.)"""
    def sglang(request: httpx.Request) -> httpx.Response:
        asked = json.loads(request.content)
        answer = sglang_chat_answer(sglang_experts(FED), where="sglext")
        choice = answer["choices"][0]
        if not asked.get("return_prompt_token_ids"):
            del choice["prompt_token_ids"]
        if not asked.get("return_meta_info"):
            del choice["meta_info"]
        return httpx.Response(200, json=answer)

    with ChatModel("http://sglang.test/v1", model="m", transport=httpx.MockTransport(sglang),
                   moe_shape=(SGL_LAYERS, K)) as model:
        turn = model.complete([{"role": "user", "content": "q"}], [], Sampling(max_tokens=4))
    assert turn.prompt_token_ids_P.tolist() == [1, 2, 3, 4] and turn.token_ids_R.tolist() == [11, 12, 13, 14]
    np.testing.assert_array_equal(turn.routed_experts_RLK, position_rows(range(P - 1, P + R - 1)))
