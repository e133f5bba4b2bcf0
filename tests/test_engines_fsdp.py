"""The FSDP2 trainer engine (gloo, 2 CPU processes) against the single-process engine.

Gathered FSDP weights are the single-process engine's bit for bit (``apply_precision`` runs
before sharding), so the only differences left are those of batch composition: a rank pads its
share of the pairs to its own longest sequence, which changes matmul shapes. The tolerances say
so: fp32 1e-5; bf16 2e-2 (a half-ulp of a bf16 logit up to 8; measured exactly 0 on CPU).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import ModelLoadError, TrainerEngine
from rollmarket.engines.fsdp import (
    FSDPTrainerEngine,
    assign_to_ranks,
    fingerprint_with_fsdp,
    score_with_fsdp,
)
from rollmarket.localhost import free_port

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


@pytest.fixture(scope="module")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def moe_path(repo_root) -> Path:
    path = repo_root / "models" / "tiny-moe"
    assert (path / "config.json").exists(), f"{path} is missing; build the tiny models first"
    return path


def odd_pairs() -> list[tuple[list[int], list[int]]]:
    """Five pairs of distinct lengths: the longest-first split gives rank 0 pairs 0, 3 and
    rank 1 pairs 1, 2, 4 (not contiguous), so input order has to be restored."""
    rng = np.random.default_rng(0)
    shapes = [(30, 25), (3, 1), (12, 40), (7, 9), (1, 17)]
    return [(rng.integers(3, 1500, p).tolist(), rng.integers(3, 1500, r).tolist()) for p, r in shapes]


def assert_same(fsdp, single, precision: str) -> None:
    atol = TOLERANCE[precision]
    for a, b in zip(fsdp, single, strict=True):
        assert a.logprobs_T.shape == b.logprobs_T.shape
        np.testing.assert_allclose(a.logprobs_T, b.logprobs_T, atol=atol, rtol=0)
        np.testing.assert_allclose(a.entropies_T, b.entropies_T, atol=atol, rtol=0)
        assert a.routed_experts_TLK.shape == b.routed_experts_TLK.shape == (b.logprobs_T.size, 4, 2)
        agree = (a.routed_experts_TLK == b.routed_experts_TLK).all(-1).mean()
        assert agree == 1.0 if precision == "fp32" else agree >= 0.98


def test_split_covers_every_pair_once_and_balances_tokens():
    lengths = [55, 4, 52, 16, 18]
    owners = assign_to_ranks(lengths, 2)
    assert owners == [[0, 3], [1, 2, 4]]
    assert sorted(i for ix in assign_to_ranks(list(range(1, 12)), 3) for i in ix) == list(range(11))
    assert assign_to_ranks([5], 2) == [[0], []]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_launcher_matches_single_process_in_input_order(moe_path, precision):
    pairs = odd_pairs()
    fsdp = score_with_fsdp(moe_path, precision, pairs, world_size=2, backend="gloo")
    assert [tf.logprobs_T.size for tf in fsdp] == [len(r) for _, r in pairs]
    single = TrainerEngine.from_path(moe_path, precision).score_batch(pairs)
    assert_same(fsdp, single, precision)


@pytest.mark.slow
def test_fsdp_fingerprint_equals_single_process(moe_path):
    """Same numerics, same fingerprint: FSDP changes where weights live, not what is computed."""
    single = TrainerEngine.from_path(moe_path, "bf16").fingerprint()
    assert fingerprint_with_fsdp(moe_path, "bf16", world_size=2, backend="gloo") == single


def _group_worker(rank: int, world_size: int, port: int, model: str, pairs: list, out: str) -> None:
    """A trainer's view: the process group exists before the engine does."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # A small token budget makes ranks run different numbers of micro-batches.
        engine = FSDPTrainerEngine.from_path(model, "fp32", max_batch_tokens=64)
        result: dict = {"batch": engine.score_batch(pairs), "fingerprint": engine.fingerprint()}
        # Per-rank inputs of different sizes, one rank with none at all.
        result["local"] = engine.score_local(pairs if rank == 0 else [])
        try:
            engine.score_local([pairs[0]] if rank == 0 else [([], [1, 2])])
        except ValueError as exc:
            result["bad_input"] = str(exc)
        result["after"] = engine.score_batch(pairs[:1])
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()  # no rank tears down gloo while its peer still reads
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # skip gloo's C++ teardown at exit (see engines/fsdp.py::_worker)


@pytest.mark.slow
def test_fsdp_engine_inside_an_existing_process_group(moe_path, tmp_path):
    """score_batch gathers to rank 0 in input order; score_local keeps results on their rank
    while ranks with less (or no) work run idle passes; bad input on one rank makes every rank
    raise instead of hanging, and the engine keeps working; router hooks fire under FSDP2."""
    pairs = odd_pairs()
    torch.multiprocessing.spawn(_group_worker, nprocs=2, join=True,
                                args=(2, free_port(), str(moe_path), pairs, str(tmp_path)))
    rank0 = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    rank1 = pickle.loads((tmp_path / "rank1.pkl").read_bytes())
    single_engine = TrainerEngine.from_path(moe_path, "fp32")
    single = single_engine.score_batch(pairs)

    assert_same(rank0["batch"], single, "fp32")
    assert rank1["batch"] == []
    assert_same(rank0["local"], single, "fp32")
    assert rank1["local"] == []
    assert rank0["fingerprint"] == rank1["fingerprint"] == single_engine.fingerprint()
    assert "another rank rejected" in rank0["bad_input"]
    assert "at least one prompt token" in rank1["bad_input"]
    assert_same(rank0["after"], single[:1], "fp32")


def test_launcher_rejects_bad_input_before_starting_processes(moe_path, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        score_with_fsdp(tmp_path, "fp32", [([1], [2])])
    with pytest.raises(ValueError, match="unknown precision"):
        score_with_fsdp(moe_path, "fp4", [([1], [2])])
    with pytest.raises(ValueError, match="at least one prompt token"):
        score_with_fsdp(moe_path, "fp32", [([], [2])])
    with pytest.raises(ValueError, match="exceeds the context"):
        score_with_fsdp(moe_path, "fp32", [([1] * 5000, [2])])


def test_engine_needs_a_process_group_and_import_starts_nothing(moe_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        FSDPTrainerEngine.from_path(moe_path, "fp32")
