"""The agent loop against the served tiny model, and the training view stitched from its ids.

The stitching tests lock what the trainer will see: every assistant token in the stitched
sequence must be scored by teacher forcing exactly as the engine scored it when it sampled it.
Do not loosen the tolerance without a decision: a larger gap means the context changed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollmarket.agents import (
    Agent,
    AgentSettings,
    ChatModel,
    LocalToolbox,
    Sampling,
    StitchError,
    stitch,
    to_trajectory,
)
from rollmarket.contracts import AgentStep, FinishReason, TaskSpec, TerminalReason, ToolOutcome
from helpers import served_model
from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"
SYSTEM = "You are a helpful assistant. Use a tool when you need one. Reply with the bare answer."
TOOLS = ["calculator", "web_search", "read_file"]


def step(index, prompt, response, logprobs=None, experts=None, calls=()):
    return AgentStep(index=index, prompt_token_ids=np.array(prompt, np.int32),
                     response_token_ids=np.array(response, np.int32),
                     logprobs=None if logprobs is None else np.array(logprobs, np.float32),
                     routed_experts=experts, finish_reason="stop")


# ---- stitching on hand-made turns --------------------------------------------------------------

def test_stitch_splices_the_template_glue_between_turns():
    # turn 0: prompt [1 2 3], response [4 5]; turn 1's prompt extends it with glue [6 7].
    steps = [step(0, [1, 2, 3], [4, 5], [-0.1, -0.2]), step(1, [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4])]
    view = stitch(steps)
    assert view.prompt_token_ids_P.tolist() == [1, 2, 3]
    assert view.response_token_ids_T.tolist() == [4, 5, 6, 7, 8, 9]
    assert view.action_mask_T.tolist() == [1, 1, 0, 0, 1, 1]
    assert view.tool_output_mask_T.tolist() == [0, 0, 1, 1, 0, 0]
    assert view.logprobs_T.tolist() == pytest.approx([-0.1, -0.2, 0, 0, -0.3, -0.4])
    assert view.turn_boundaries == [0, 4]
    assert view.breaks == [] and view.first_step == 0


def test_stitch_restarts_after_a_context_that_does_not_extend():
    # Turn 2's prompt rewrites turn 1's response (7 -> 70): the view starts again at turn 2.
    steps = [step(0, [1, 2], [3], [-1.0]), step(1, [1, 2, 3, 4], [7], [-2.0]),
             step(2, [1, 2, 3, 4, 70, 5], [9, 2], [-3.0, -0.5])]
    view = stitch(steps)
    assert view.breaks == [2] and view.first_step == 2
    assert view.prompt_token_ids_P.tolist() == [1, 2, 3, 4, 70, 5]
    assert view.response_token_ids_T.tolist() == [9, 2]
    assert view.action_mask_T.tolist() == [1, 1]


def test_stitch_carries_routed_experts_and_zeroes_glue_rows():
    e0 = np.full((2, 4, 2), 3, np.int16)
    e1 = np.full((1, 4, 2), 5, np.int16)
    view = stitch([step(0, [1], [2, 3], [-1, -1], e0), step(1, [1, 2, 3, 4], [5], [-1], e1)])
    assert view.routed_experts_TLK.shape == (4, 4, 2)
    assert (view.routed_experts_TLK[:2] == 3).all() and (view.routed_experts_TLK[2] == 0).all()
    assert (view.routed_experts_TLK[3] == 5).all()


def test_stitch_without_ids_is_a_typed_error():
    with pytest.raises(StitchError):
        stitch([])
    with pytest.raises(StitchError):
        stitch([AgentStep(index=0, finish_reason="stop")])


# ---- against the served tiny model -------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`rollmarket serve-model` on the tiny MoE at fp32, so teacher forcing at fp32 must agree."""
    assert (MOE / "config.json").exists(), "the shipped tiny-moe model is missing"
    with served_model(MOE, tmp_path_factory.mktemp("agents") / "serve.log", precision="fp32") as url:
        yield url


def tool_tasks() -> list[TaskSpec]:
    from rollmarket.tasks.families import generate

    tasks = []
    for family in ("calculator", "chain", "lookup"):
        for t in generate(family, 4, 2):
            tasks.append(TaskSpec(task_id=t.id, messages=t.messages, tools=TOOLS, verifier=t.verifier,
                                  answer=t.expected, files=t.files))
    return tasks


@pytest.fixture(scope="module")
def runs(served):
    agent = Agent(ChatModel(served), LocalToolbox(), AgentSettings(max_steps=5))
    out = []
    for task in tool_tasks():
        out += [(task, run) for run in agent.run_group(task, 2, Sampling(temperature=1.0, max_tokens=96, seed=11))]
    return out


def test_agent_runs_multi_turn_with_real_tools(runs):
    reasons = {run.terminal_reason for _, run in runs}
    assert TerminalReason.final_answer in reasons
    multi = [run for _, run in runs if len(run.steps) >= 2 and run.tool_calls]
    assert len(multi) >= len(runs) // 2, "the tiny model calls tools on most of these tasks"
    for run in multi:
        # Each tool call's result is fed back as a tool message right after its assistant turn.
        tool_messages = [m for m in run.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool_messages] == [c.result.content for c in run.tool_calls]
        assert all(c.result.outcome in set(ToolOutcome) for c in run.tool_calls)
    calc = [c for _, run in runs for c in run.tool_calls if c.name == "calculator" and c.result.ok]
    assert calc, "some calculator call succeeded"
    for call in calc:
        from rollmarket.tasks.tools_ref import calculator

        assert call.result.content == calculator(call.arguments["expression"])


def test_every_turn_keeps_the_engines_ids_logprobs_and_experts(runs):
    for _, run in runs:
        for s in run.steps:
            n = s.num_response_tokens
            assert n > 0 and s.prompt_token_ids.shape[0] > 0
            assert s.logprobs.shape == (n,) and (s.logprobs <= 0).all()
            assert s.routed_experts.shape == (n, 4, 2)


def test_teacher_forcing_the_stitched_sequence_reproduces_per_turn_logprobs(runs):
    from rollmarket.engines import TrainerEngine

    trainer = TrainerEngine.from_path(MOE, "fp32")
    checked = 0
    for _, run in runs:
        view = stitch(run.steps)
        assert view.breaks == [], "the tiny model's template must extend the context turn by turn"
        scored = trainer.score(view.prompt_token_ids_P, view.response_token_ids_T)
        actions = view.action_mask_T.astype(bool)
        # The view's action logprobs are the engine's per-turn logprobs, in order.
        per_turn = np.concatenate([s.logprobs for s in run.steps])
        np.testing.assert_array_equal(view.logprobs_T[actions], per_turn)
        np.testing.assert_allclose(scored.logprobs_T[actions], per_turn, atol=2e-3)
        agree = (np.sort(scored.routed_experts_TLK[actions], -1) == np.sort(view.routed_experts_TLK[actions], -1))
        assert agree.mean() > 0.97
        checked += int(actions.sum())
    assert checked > 200


def test_training_view_becomes_an_exchange_trajectory(runs):
    task, run = next((t, r) for t, r in runs if len(r.steps) >= 2)
    traj = to_trajectory(run)
    view = stitch(run.steps)
    assert traj.response_token_ids.tolist() == view.response_token_ids_T.tolist()
    assert traj.turn_boundaries == view.turn_boundaries and len(traj.turn_boundaries) == len(run.steps)
    assert traj.finish_reason is (FinishReason.stop if run.terminal_reason is TerminalReason.final_answer
                                  else traj.finish_reason)


def test_max_steps_ends_a_run_that_keeps_calling_tools(served):
    task = next(t for t in tool_tasks() if t.task_id.startswith("chain"))
    agent = Agent(ChatModel(served), LocalToolbox(), AgentSettings(max_steps=1))
    run = agent.run(task, Sampling(temperature=0.0, max_tokens=96, seed=1))
    assert len(run.steps) == 1
    assert run.terminal_reason in (TerminalReason.max_steps, TerminalReason.final_answer)
    if run.steps[0].tool_calls:
        assert run.terminal_reason is TerminalReason.max_steps and run.final_answer is None


def test_a_turn_cut_by_max_tokens_ends_with_length(served):
    task = tool_tasks()[0]
    run = Agent(ChatModel(served), LocalToolbox()).run(task, Sampling(temperature=1.0, max_tokens=2, seed=1))
    assert run.terminal_reason is TerminalReason.length
    assert to_trajectory(run).finish_reason is FinishReason.length


def test_a_dead_model_server_is_a_model_error_not_a_crash():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    run = Agent(ChatModel(dead, "tiny-moe", timeout=2)).run(tool_tasks()[0], Sampling())
    assert run.terminal_reason is TerminalReason.model_error and "ConnectError" in run.error
    assert run.steps == []


def test_a_server_without_token_ids_is_refused_for_training(served):
    model = ChatModel(served, extensions=False)
    run = Agent(model, LocalToolbox()).run(tool_tasks()[0], Sampling(max_tokens=32, seed=2))
    assert run.terminal_reason is TerminalReason.model_error and "token ids" in run.error
    # Collection for profiling only may go on without them.
    run = Agent(model, LocalToolbox(), AgentSettings(require_token_ids=False)).run(
        tool_tasks()[0], Sampling(max_tokens=32, seed=2))
    assert run.terminal_reason is not TerminalReason.model_error
    assert run.steps[0].response_token_ids is None


def test_a_tool_the_task_does_not_offer_is_a_tool_message():
    task = TaskSpec(task_id="t", prompt="hi", tools=["calculator"], verifier="exact", answer="x")
    with LocalToolbox().session(task) as session:
        result = session.call("python_eval", '{"code": "print(1)"}')
        assert result.outcome is ToolOutcome.unknown_tool and result.content.startswith("error:")
        result = session.call("calculator", "{not json")
        assert result.outcome is ToolOutcome.bad_arguments
        assert session.call("calculator", '{"expression": "17 * 23"}').content == "391"


def test_the_same_loop_runs_through_the_capture_proxy(served, tmp_path):
    """Agent → proxy → server: the proxy records each turn, linked into one conversation, with the
    same ids the agent kept."""
    import subprocess
    import sys

    from rollmarket.localhost import wait_healthy
    from rollmarket.proxy.store import CaptureStore

    port = free_port()
    store = tmp_path / "captures.db"
    upstream = served.removesuffix("/v1")
    with open(tmp_path / "proxy.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollmarket", "proxy", "--upstream", upstream, "--port",
                                 str(port), "--store", str(store)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=tmp_path / "proxy.log", timeout=60)
        task = next(t for t in tool_tasks() if t.task_id.startswith("chain"))
        run = Agent(ChatModel(f"http://127.0.0.1:{port}/v1"), LocalToolbox()).run(
            task, Sampling(temperature=1.0, max_tokens=96, seed=5))
    finally:
        proc.terminate()
        proc.wait(20)
    assert len(run.steps) >= 2, "a chain task takes several turns"
    captures = [capture for _, capture in CaptureStore(store).iter_captures()]
    assert len(captures) == len(run.steps)
    assert len({c.conversation_id for c in captures}) == 1
    for capture, s in zip(sorted(captures, key=lambda c: c.turn_index), run.steps):
        assert capture.prompt_token_ids.tolist() == s.prompt_token_ids.tolist()
        assert capture.choices[0].response_token_ids.tolist() == s.response_token_ids.tolist()


def test_captured_conversations_become_runs_the_observatory_can_score(served, tmp_path):
    """What the proxy recorded in front of any engine is enough to rebuild the run, ids and all,
    and the observatory teacher-forces it (`rollmarket observe --from-captures ENGINE=STORE`)."""
    import subprocess
    import sys

    from rollmarket.contracts import ObservatoryMatrix
    from rollmarket.localhost import wait_healthy
    from rollmarket.observatory.runner import ObserveSettings, run_observatory
    from rollmarket.observatory.sources import runs_from_captures

    port = free_port()
    store = tmp_path / "captures.db"
    with open(tmp_path / "proxy.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollmarket", "proxy", "--upstream", served.removesuffix("/v1"),
                                 "--port", str(port), "--store", str(store)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=tmp_path / "proxy.log", timeout=60)
        agent = Agent(ChatModel(f"http://127.0.0.1:{port}/v1"), LocalToolbox())
        tasks = [t for t in tool_tasks() if t.task_id.startswith(("chain", "calculator"))][:3]
        runs = [agent.run(t, Sampling(temperature=1.0, max_tokens=96, seed=9)) for t in tasks]
    finally:
        proc.terminate()
        proc.wait(20)
    rebuilt = runs_from_captures(store)
    assert len(rebuilt) == len(runs)
    by_answer = sorted(rebuilt, key=lambda r: len(r.steps))
    for original, again in zip(sorted(runs, key=lambda r: len(r.steps)), by_answer):
        assert len(again.steps) == len(original.steps)
        for a, b in zip(original.steps, again.steps):
            assert a.prompt_token_ids.tolist() == b.prompt_token_ids.tolist()
            assert a.response_token_ids.tolist() == b.response_token_ids.tolist()
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            assert [c.name for c in a.tool_calls] == [c.name for c in b.tool_calls]
            assert [c.result.content for c in a.tool_calls] == [c.result.content for c in b.tool_calls]
        assert again.final_answer == original.final_answer
    settings = ObserveSettings(model=str(MOE), rollout_engines=["proxied"], trainer_engines=["fp32"], lengths=[],
                               from_captures={"proxied": str(store)})
    matrix = run_observatory(settings, tmp_path / "run")
    [cell] = matrix.cells
    assert cell.n == len(runs) and cell.token_ess.mean > 0.999  # the fp32 server scored at fp32
    assert ObservatoryMatrix.model_validate_json((tmp_path / "run" / "matrix.json").read_text()) == matrix


def test_a_chat_model_keeps_its_calls_within_its_connection_pool():
    """More threads than connections wait for a slot (an evaluation once ran 512 runs on one
    instance: the pool slowed and some calls died with a transport error)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from rollmarket.agents.model import MAX_CONNECTIONS, ModelCallError

    lock, in_flight, most = threading.Lock(), [0], [0]

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.4)  # long enough for every thread to have started its call
        with lock:
            in_flight[0] -= 1
        return httpx.Response(503, json={"error": {"message": "busy"}})

    model = ChatModel("http://model.test/v1", "m", transport=httpx.MockTransport(handler))
    sampling = Sampling(temperature=1.0, max_tokens=4)

    def call(_):
        with pytest.raises(ModelCallError, match="HTTP 503"):
            model.complete([{"role": "user", "content": "hi"}], [], sampling)
        return True

    calls = MAX_CONNECTIONS + 64
    with ThreadPoolExecutor(calls) as pool:
        assert all(pool.map(call, range(calls)))
    assert 1 < most[0] <= MAX_CONNECTIONS
