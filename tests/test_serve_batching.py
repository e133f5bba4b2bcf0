"""Continuous batching on the tiny MoE model at fp32: sequences join a running batch between
decode steps and leave when done, and each one's greedy tokens equal its tokens decoded alone.

References are ``RolloutEngine.generate`` of one prompt at a time (its own batch of one, no
padding); at fp32 padding changes only matmul summation order, so logprobs agree to 1e-5.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import RolloutEngine, SamplingParams
from rollmarket.serve.batcher import DONE, GROUP_STEPS, Batcher, join_now

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine() -> RolloutEngine:
    return RolloutEngine.from_path(ROOT / "models" / "tiny-moe", "fp32")


def _prompt(engine: RolloutEngine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def _alone(engine: RolloutEngine, prompt: list[int], params: SamplingParams):
    return engine.generate([prompt], params)[0]


def _same(row_tokens, row_logprobs, row_experts, ref) -> None:
    np.testing.assert_array_equal(np.asarray(row_tokens), ref.token_ids_T)
    np.testing.assert_allclose(np.asarray(row_logprobs, np.float32), ref.logprobs_T, atol=1e-5)
    experts = np.stack(row_experts)
    agree = (np.sort(experts, -1) == np.sort(ref.routed_experts_TLK, -1)).all(-1).mean()
    assert agree >= 0.99, agree


def test_rows_join_mid_generation_and_leave_when_done(engine):
    """A runs alone for 5 steps; B (shorter prompt) and C (a prompt longer than A's whole cache,
    so the running cache is left-padded) join; B finishes while A and C still run and leaves."""
    _join_and_leave(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: runs where a GPU exists")
def test_rows_join_and_leave_on_cuda():
    """The same cache surgery and batched sampling on the GPU, against the GPU decoding alone."""
    _join_and_leave(RolloutEngine.from_path(ROOT / "models" / "tiny-moe", "fp32", "cuda"))


def _join_and_leave(engine: RolloutEngine) -> None:
    greedy = dict(temperature=0, ignore_eos=True)
    a_prompt = _prompt(engine, "Tell me about the sea.")
    b_prompt = _prompt(engine, "hi")
    c_prompt = _prompt(engine, "Read the file notes/readme.txt and tell me the port, then search the "
                               "web for who founded the town of Velmora and summarise it.")
    params = {"a": SamplingParams(max_tokens=20, **greedy), "b": SamplingParams(max_tokens=4, **greedy),
              "c": SamplingParams(max_tokens=12, top_logprobs=3, **greedy)}
    session = engine.session()
    (a,) = session.add([a_prompt], params["a"])
    for _ in range(5):
        session.step()
    assert len(c_prompt) > len(a_prompt) + 5
    b, c = session.add([b_prompt, c_prompt], [params["b"], params["c"]])
    widths = []
    while session:
        session.step()
        widths.append(len(session))
        if b.finish is not None and len(widths) == 4:
            assert a.finish is None and c.finish is None  # B left first, the others go on
    assert widths[3] == 2 and widths[-1] == 0
    for row, prompt, key in ((a, a_prompt, "a"), (b, b_prompt, "b"), (c, c_prompt, "c")):
        ref = _alone(engine, prompt, params[key])
        _same(row.tokens, row.logprobs, row.experts, ref)
        assert row.finish == "length"
    ref_c = _alone(engine, c_prompt, params["c"])
    assert [[i for i, _ in top] for top in c.top] == [[i for i, _ in top] for top in ref_c.top_logprobs]


def test_seeded_sampling_does_not_depend_on_when_a_sequence_joins(engine):
    """Seeded (temperature 1) draws key on the sequence's own step: joining late, beside
    another sequence, gives the tokens it draws alone."""
    p = _prompt(engine, "Write a poem.")
    params = SamplingParams(max_tokens=10, seed=5, ignore_eos=True)
    session = engine.session()
    session.add([_prompt(engine, "Count to ten.")], SamplingParams(max_tokens=16, seed=1, ignore_eos=True))
    for _ in range(3):
        session.step()
    (late,) = session.add([p], params)
    while session:
        session.step()
    _same(late.tokens, late.logprobs, late.experts, _alone(engine, p, params))


def test_batcher_admits_a_request_while_another_is_decoding(engine):
    """Through the server's batcher: request 2 arrives after request 1 has produced tokens,
    joins its batch (one step decodes both), and finishes first; a cancelled request 3 leaves
    the batch without disturbing the others. Results equal the sequences decoded alone."""
    long_p, short_p = _prompt(engine, "Tell me a long story."), _prompt(engine, "hello")
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    batcher = Batcher(engine, max_seqs=8, window_s=0)
    batcher.start()

    async def run():
        first = batcher.submit(long_p, long_params, 1)
        order, got = [], {"first": [], "second": []}
        steps = await first.events.get()
        got["first"] += [ev for _, ev in steps]
        second = batcher.submit(short_p, short_params, 1, stream=False)
        doomed = batcher.submit(short_p, long_params, 1)
        await doomed.events.get()
        doomed.cancelled = True

        async def drain(name, pending):
            while (item := await pending.events.get()) is not DONE:
                assert not isinstance(item, Exception), item
                got[name] += [ev for _, ev in item]
            order.append(name)

        await asyncio.gather(drain("first", first), drain("second", second))
        return order, got, doomed

    try:
        order, got, doomed = asyncio.run(run())
    finally:
        batcher.stop()
    assert order == ["second", "first"]
    # 1 joins alone; 2 and 3 arrive together (one prefill) unless the decode thread ran between them.
    assert batcher.batches in (2, 3) and batcher.largest_batch == 3
    for name, prompt, params in (("first", long_p, long_params), ("second", short_p, short_params)):
        events = got[name]
        _same([e.token_id for e in events], [e.logprob for e in events], [e.experts_LK for e in events],
              _alone(engine, prompt, params))
        assert events[-1].finish_reason == "length"
    assert doomed.events.qsize() < long_params.max_tokens  # it stopped being decoded


def test_a_burst_arriving_over_longer_than_the_window_is_prefilled_once(engine):
    """Eight requests 0.1 s apart span 0.7 s, longer than the 0.5 s window: an idle batcher keeps
    the window open while they keep coming, so one prefill admits all eight (a window fixed from
    the first arrival split this burst in two). A request after a quiet window gets a prefill of
    its own."""
    prompt = _prompt(engine, "hi")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    batcher = Batcher(engine, max_seqs=32, window_s=0.5)
    batcher.start()

    async def finish(pendings) -> None:
        for pending in pendings:
            while (item := await pending.events.get()) is not DONE:
                assert not isinstance(item, Exception), item

    async def run() -> None:
        pendings = []
        for _ in range(8):
            pendings.append(batcher.submit(prompt, params, 1))
            await asyncio.sleep(0.1)
        await finish(pendings)
        await finish([batcher.submit(prompt, params, 1)])

    try:
        asyncio.run(run())
    finally:
        batcher.stop()
    assert batcher.batches == 2 and batcher.largest_batch == 8 and batcher.sequences == 9


@pytest.mark.parametrize("waiting, running, waited, joins", [
    (1, 3, 0, True),    # a batch under half of 32 takes anyone at once
    (3, 20, 0, False),  # a busy one waits for a group of 32 // 8 = 4 ...
    (4, 20, 0, True),
    (2, 30, 0, False),  # a nearly full one too: as many as fit join then
    (5, 30, 0, True),
    (1, 20, GROUP_STEPS - 1, False),
    (1, 20, GROUP_STEPS, True),  # ... or until the first has waited GROUP_STEPS steps
    (0, 20, 99, False),
    (3, 32, 99, False),  # no room
])
def test_a_busy_batch_takes_joiners_in_groups(waiting, running, waited, joins):
    assert join_now(waiting, 32 - running, running, 32, waited) is joins


def test_requests_arriving_beside_a_busy_batch_join_it_in_one_prefill(engine):
    """Twenty rows decode (more than half of 32); three requests sent one by one beside them
    wait (fewer than a group of four) and join together after GROUP_STEPS steps: two prefills in
    all, and the three finish with their whole length."""
    prompt = _prompt(engine, "hi")
    batcher = Batcher(engine, max_seqs=32, window_s=0.5)
    batcher.start()

    async def drain(pending) -> int:
        tokens = 0
        while (item := await pending.events.get()) is not DONE:
            assert not isinstance(item, Exception), item
            tokens += len(item)
        return tokens

    async def run() -> list[int]:
        busy = [batcher.submit(prompt, SamplingParams(max_tokens=40, seed=s, ignore_eos=True), 1)
                for s in range(20)]
        await busy[0].events.get()  # the twenty are decoding
        late = []
        for s in range(3):
            late.append(batcher.submit(prompt, SamplingParams(max_tokens=5, seed=s, ignore_eos=True), 1,
                                       stream=False))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*(drain(p) for p in late + busy[1:]))

    try:
        tokens = asyncio.run(run())
    finally:
        batcher.stop()
    assert tokens[:3] == [5, 5, 5]
    assert batcher.batches == 2 and batcher.largest_batch == 23


def _profiled_steps(engine, out, after: int) -> tuple[int, int]:
    """Decode a 6-token request through a batcher that profiles from its ``after``-th step: (steps it
    ran, calls of ``_decode`` in the profile)."""
    import pstats

    batcher = Batcher(engine, max_seqs=4, window_s=0, profile_path=str(out), profile_after_steps=after)
    batcher.start()

    async def run():
        pending = batcher.submit(_prompt(engine, "hello"), SamplingParams(max_tokens=6, seed=1, ignore_eos=True), 2,
                                 stream=False)
        while (item := await pending.events.get()) is not DONE:
            assert not isinstance(item, Exception), item

    try:
        asyncio.run(run())
    finally:
        batcher.stop()
    assert not batcher._thread.is_alive()
    stats = pstats.Stats(str(out)).stats
    functions = {name for (_, _, name) in stats}
    assert {"_decode", "step"} <= functions, sorted(functions)[:20]
    [decode] = [value for (_, _, name), value in stats.items() if name == "_decode"]
    return batcher.steps, decode[1]


def test_the_decode_thread_can_write_its_profile(engine, tmp_path):
    """``profile_path`` (serve-model --profile-decode): when the batcher stops, the decode thread's
    cProfile statistics are on disk, and they are the decode loop's (its step and the engine's);
    ``profile_after_steps`` leaves that many steps (a warm-up) out."""
    steps, profiled = _profiled_steps(engine, tmp_path / "all.prof", 0)
    assert steps >= 4 and profiled == steps
    later_steps, later = _profiled_steps(engine, tmp_path / "later.prof", 3)
    assert later_steps == steps and later == steps - 3
