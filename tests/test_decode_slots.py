"""The decode over fixed KV slots (engines/slots.py) samples what the padded DynamicCache samples.

Every scenario runs twice over one loaded model, once per KV cache kind, and the tokens must be
equal and the logprobs equal up to summation order (fp32): rows join mid-generation, leave when
done, a freed slot is taken by a row with a shorter prompt (the old row's columns past it must stay
masked), more rows than a fresh cache has slots, and generations longer than its width (both
grow). On CUDA the slot steps are CUDA graphs (`gpu_run.sh tests`); on the CPU they run eagerly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import RolloutEngine, SamplingParams
from rollmarket.engines.loading import load_model
from rollmarket.engines.slots import MIN_SLOTS, MIN_WIDTH, SlotKV
from test_sampling import MIXED  # every sampling setting, one per row

MODELS = Path(__file__).resolve().parents[1] / "models"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = dict(temperature=0, ignore_eos=True)


def _prompt(engine: RolloutEngine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def _scenario(engine: RolloutEngine) -> tuple[list, SlotKV | None]:
    """Rows joining, leaving and reusing slots; returns every row and the session's store."""
    long_ = _prompt(engine, "Read the file notes/readme.txt and tell me the port, then search the web "
                            "for who founded the town of Velmora and summarise it.")
    short = _prompt(engine, "hi")
    session = engine.session()
    rows = session.add([long_], SamplingParams(max_tokens=MIN_WIDTH + 40, **GREEDY))  # outgrows the width
    for _ in range(3):
        session.step()
    # More rows than a fresh store has slots; one seeded, one with top alternatives.
    prompts = [_prompt(engine, f"Tell me fact number {i} about the sea.") for i in range(MIN_SLOTS + 1)]
    params = [SamplingParams(max_tokens=6 + i, **GREEDY) for i in range(MIN_SLOTS + 1)]
    params[1] = SamplingParams(max_tokens=30, seed=7, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=9, top_logprobs=3, **GREEDY)
    rows += session.add(prompts, params)
    store = session.kv if isinstance(session.kv, SlotKV) else None
    grown = store.cache.slots if store is not None and store.cache is not None else None
    for _ in range(12):
        session.step()
    # The first joiners have finished: a short prompt takes a slot a longer row left.
    rows += session.add([short], SamplingParams(max_tokens=20, **GREEDY))
    while session:
        session.step()
    if store is not None:
        assert grown is not None and grown > MIN_SLOTS
        assert store.cache is not None and store.cache.width > MIN_WIDTH
    return rows, store


def _same(slot_rows, padded_rows, atol: float) -> None:
    for s, p in zip(slot_rows, padded_rows, strict=True):
        assert s.tokens == p.tokens
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=atol)
        assert [[i for i, _ in t] for t in s.top] == [[i for i, _ in t] for t in p.top]
        if p.experts:
            agree = (np.sort(np.stack(s.experts), -1) == np.sort(np.stack(p.experts), -1)).all(-1).mean()
            assert agree >= 0.99, agree


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_slots_decode_what_the_padded_cache_decodes(model, buckets, monkeypatch):
    loaded = load_model(MODELS / model, "fp32")
    shapes = []
    forward = SlotKV.forward

    def spy(self, step_BC, columns_L, flags):
        shapes.append((step_BC.shape[0], columns_L.shape[0]))
        return forward(self, step_BC, columns_L, flags)

    monkeypatch.setattr(SlotKV, "forward", spy)
    slot_rows, store = _scenario(RolloutEngine(loaded, kv="slots", step_buckets=buckets))
    padded_rows, _ = _scenario(RolloutEngine(loaded, kv="padded"))
    _same(slot_rows, padded_rows, atol=3e-5)
    assert store is not None and store.captures == 0  # eager on the CPU
    # Bucketed steps (padding rows and masked columns) run at powers of two, so few shapes repeat;
    # exact ones at the rows' own batch and length.
    powers = all(b & (b - 1) == 0 and l & (l - 1) == 0 and l >= MIN_WIDTH for b, l in shapes)
    assert powers == buckets
    assert (len(set(shapes)) <= 6) == buckets, sorted(set(shapes))
    # The joiners of slots 1, 3, 4 and 5 were done; the short prompt took the lowest free slot.
    assert slot_rows[-1].slot == 1 and slot_rows[2].finish is not None


def test_a_row_decodes_alone_what_it_decodes_in_a_slot_another_row_left():
    """A short prompt in a slot whose columns past it hold a longer row's keys: they stay masked."""
    engine = RolloutEngine(load_model(MODELS / "tiny-dense", "fp32"), kv="slots")
    session = engine.session()
    (first,) = session.add([_prompt(engine, "Write a long story about a lighthouse keeper.")],
                           SamplingParams(max_tokens=40, **GREEDY))
    (keeper,) = session.add([_prompt(engine, "Count to ten.")], SamplingParams(max_tokens=60, **GREEDY))
    while first.finish is None:
        session.step()
    params = SamplingParams(max_tokens=15, **GREEDY)
    (late,) = session.add([_prompt(engine, "hi")], params)
    assert late.slot == first.slot and first.cached > len(late.prompt) + 15
    while session:
        session.step()
    alone = RolloutEngine(engine.loaded, kv="padded").generate([late.prompt.tolist()], params)[0]
    assert late.tokens == alone.token_ids_T.tolist()
    np.testing.assert_allclose(late.logprobs, alone.logprobs_T, atol=1e-5)
    assert keeper.finish == "length"


def test_engine_settings_are_checked():
    loaded = load_model(MODELS / "tiny-dense", "fp32")
    assert RolloutEngine(loaded).kv == "slots" and not RolloutEngine(loaded).graphs
    # Bucketed eager steps: by default only on CUDA; never over the padded cache.
    assert not RolloutEngine(loaded).step_buckets and RolloutEngine(loaded, step_buckets=True).step_buckets
    assert not RolloutEngine(loaded, kv="padded", step_buckets=True).step_buckets
    with pytest.raises(ValueError, match="kv must be"):
        RolloutEngine(loaded, kv="paged")
    with pytest.raises(ValueError, match="CUDA"):
        RolloutEngine(loaded, graphs=True)
    sliding = load_model(MODELS / "tiny-dense", "fp32")
    sliding.model.config.layer_types = ["sliding_attention"] + ["full_attention"] * 3
    with pytest.raises(ValueError, match="sliding_attention"):
        RolloutEngine(sliding, kv="slots")
    assert RolloutEngine(sliding).kv == "padded"


SHARDED = """
import os, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rollmarket.engines import RolloutEngine
from rollmarket.engines.loading import load_model
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
loaded = load_model(os.environ["MODEL"], "fp32")
for layer in loaded.model.model.layers:
    fully_shard(layer)
print("default graphs:", RolloutEngine(loaded).graphs)
try:
    RolloutEngine(loaded, graphs=True)
except ValueError as exc:
    print("refused:", exc)
dist.destroy_process_group()
"""


def test_an_fsdp_sharded_model_gets_no_graphs():
    """The trainer's evaluation samples from its learner's model, which FSDP2 may have sharded: its
    hooks gather weights anew each forward, which a graph would not redo."""
    import os
    import subprocess
    import sys

    from rollmarket.localhost import free_port

    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PORT": str(free_port()), "MODEL": str(MODELS / "tiny-dense")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "default graphs: False" in done.stdout
    assert "refused: no CUDA graphs: the model is FSDP-sharded" in done.stdout


@needs_cuda
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_graphed_slots_decode_what_the_padded_cache_decodes_on_cuda(model):
    loaded = load_model(MODELS / model, "fp32", "cuda")
    graphed = RolloutEngine(loaded)
    assert graphed.graphs  # MoE models too: the router capture is part of the graph
    assert graphed.step_buckets
    slot_rows, store = _scenario(graphed)
    padded_rows, _ = _scenario(RolloutEngine(loaded, kv="padded"))
    _same(slot_rows, padded_rows, atol=1e-4)
    assert store is not None
    if model == "tiny-dense":
        assert store.graphs_error is None and store.captures > 0
    else:
        # torch's grouped matmul has a kernel for bf16 only; in fp32 it reads the experts'
        # offsets on the host, which a capture refuses: the store says why and steps eagerly.
        assert store.graphs_error is not None and "captured" in store.graphs_error


@needs_cuda
def test_graphed_moe_steps_route_each_replay_as_eager_steps_do():
    """bf16 (the served precision, where the grouped expert matmul captures): the graph's experts
    are each replay's own, not the capture's. The same scenario stepped eagerly at the same
    bucketed shapes runs the same kernels, so tokens, logprobs and experts agree exactly."""
    loaded = load_model(MODELS / "tiny-moe", "bf16", "cuda")
    graphed_rows, store = _scenario(RolloutEngine(loaded))
    assert store is not None and store.graphs_error is None, store.graphs_error if store else None
    assert store.captures > 0
    eager = RolloutEngine(loaded, graphs=False)
    assert eager.step_buckets
    eager_rows, eager_store = _scenario(eager)
    assert eager_store is not None and eager_store.captures == 0
    assert sum(len(r.experts) for r in graphed_rows) > 100
    for g, e in zip(graphed_rows, eager_rows, strict=True):
        assert g.tokens == e.tokens
        np.testing.assert_array_equal(g.logprobs, e.logprobs)
        np.testing.assert_array_equal(np.stack(g.experts), np.stack(e.experts))


@needs_cuda
def test_a_later_session_replays_the_graphs_and_drops_them_for_new_weights():
    loaded = load_model(MODELS / "tiny-dense", "fp32", "cuda")
    engine = RolloutEngine(loaded)
    prompts = [_prompt(engine, "Tell me about the sea."), _prompt(engine, "hi")]
    params = SamplingParams(max_tokens=24, **GREEDY)
    first = engine.generate(prompts, params)
    (store,) = engine._idle_slots
    captured = store.captures
    again = engine.generate(prompts, params)
    assert engine._idle_slots == [store] and store.captures == captured  # replayed, none captured
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.token_ids_T, b.token_ids_T)
    # A parameter replaced (not updated in place): the graphs would read the old one.
    head = loaded.model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach() * 1.5 + 0.01)
    changed = engine.generate(prompts, params)
    reference = RolloutEngine(replace(loaded), kv="padded").generate(prompts, params)
    for c, r in zip(changed, reference):
        np.testing.assert_array_equal(c.token_ids_T, r.token_ids_T)
        np.testing.assert_allclose(c.logprobs_T, r.logprobs_T, atol=1e-4)
    assert store.captures > captured


@pytest.mark.parametrize("kv", ["slots", "padded"])
def test_a_session_that_ran_dry_takes_new_rows(kv):
    """The server's batcher keeps one session for its life: rows that join after every earlier
    row left start on a clean cache (the slot store goes back to the engine and comes again)."""
    engine = RolloutEngine(load_model(MODELS / "tiny-dense", "fp32"), kv=kv)
    session = engine.session()
    session.add([_prompt(engine, "Write a long story about a lighthouse keeper.")],
                SamplingParams(max_tokens=30, **GREEDY))
    while session:
        session.step()
    params = SamplingParams(max_tokens=12, **GREEDY)
    (late,) = session.add([_prompt(engine, "hi")], params)
    while session:
        session.step()
    alone = RolloutEngine(engine.loaded, kv="padded").generate([late.prompt.tolist()], params)[0]
    assert late.tokens == alone.token_ids_T.tolist()
    np.testing.assert_allclose(late.logprobs, alone.logprobs_T, atol=1e-5)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_slot_step_draws_what_the_next_step_would_draw(monkeypatch, device):
    """A slot step draws its rows' next tokens itself (on CUDA inside its graph). With every
    sampling setting in one batch, rows ending at different steps (the first slots go empty
    first: holes that sample as the first row), a row joining the step before another ends and a
    row cancelled beside it, the tokens, logprobs and
    alternatives equal those drawn outside the step, and only a prefill's rows draw outside it.
    On CUDA both runs replay graphs: the draw is captured with the forward."""
    from rollmarket.engines.sampling import RowBatch

    loaded = load_model(MODELS / "tiny-dense", "fp32", device)
    params = [replace(p, seed=3, max_tokens=10 + 6 * i, ignore_eos=True) for i, p in enumerate(MIXED)]
    late = SamplingParams(temperature=0.9, top_k=40, seed=4, max_tokens=12, ignore_eos=True, top_logprobs=1)
    draws = []
    original = RowBatch.draw
    monkeypatch.setattr(RowBatch, "draw", lambda self, *a: draws.append(len(self.params)) or original(self, *a))

    def run(fused: bool) -> list:
        engine = RolloutEngine(loaded, kv="slots")
        assert engine.graphs == (device == "cuda")
        engine.fused_draw = fused
        session = engine.session()
        prompts = [_prompt(engine, f"Tell me fact number {i} about the sea.") for i in range(len(params))]
        rows = session.add(prompts, params)
        for _ in range(15):
            session.step()
        # A row joins the step before row 1 ends, and row 3 is cancelled between the two.
        rows += session.add([_prompt(engine, "hi")], late)
        session.remove([rows[3]])
        while session:
            session.step()
        store = engine._idle_slots[0] if engine.graphs else None
        assert store is None or (store.captures > 0 and store.graphs_error is None)
        return rows

    fused = run(True)
    assert draws == [len(params), 1]  # after each prefill, for its rows alone
    draws.clear()
    outside = run(False)
    assert len(draws) == max(p.max_tokens for p in params)  # every step draws
    assert len(fused[3].tokens) == 15
    for a, b in zip(fused, outside, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == (15 if a is fused[3] else a.params.max_tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        assert [[i for i, _ in t] for t in a.top] == [[i for i, _ in t] for t in b.top]
    # The sampled rows did sample (a greedy decode would repeat itself far more).
    assert len({tuple(r.tokens) for r in fused}) == len(fused)
