"""The learner under FSDP2 (train/sharded.py): two gloo ranks, each with half the rows, take the
update one process takes on all of them."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.localhost import free_port
from rollmarket.train.batch import Datum
from rollmarket.train.config import resolve

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-dense"
RESPONSES = ["wait let me check: 3 + 4 = 7", "the answer is 12", "let me think about 5 and 6, notice that",
             "12 + 30 is 42", "on second thought it is 9", "done: 77"]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
ARGS = [f"model.path={json.dumps(str(MODEL))}", "optim.lr=1e-3", "algorithm.updates_per_batch=1",
        "algorithm.kl_coef=0.5", "algorithm.kl_kind=low_var_kl"]


def _rank(rank: int, world_size: int, port: int, data_path: str, out: str, keep: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollmarket.train.learner import Learner
    from rollmarket.train.sharded import full_value

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        learner = Learner(resolve(None, [*ARGS, f"trainer.fsdp_keep_gathered={str(keep).lower()}"]),
                          mesh=init_device_mesh("cpu", (world_size,)))
        data = pickle.loads(Path(data_path).read_bytes())
        share = len(data) // world_size
        mine = data[rank * share:(rank + 1) * share]
        metrics = [learner.step(mine, temperature=0.8),  # π_old given, then scored in the step
                   learner.step([replace(d, old_logprobs_T=None) for d in mine], temperature=0.8)]
        weights = {name: full_value(p.detach()).clone() for name, p in learner.model.named_parameters()}
        published = learner.weights()  # collective: every rank gathers the whole checkpoint
        if rank == 0:
            Path(out).write_bytes(pickle.dumps({"metrics": metrics, "weights": weights, "published": published}))
        dist.barrier()  # no rank tears down gloo while its peer still reads
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # skip gloo's C++ teardown at exit (see engines/fsdp.py::_worker)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [True, False], ids=["kept-gathered", "resharded"])
def test_two_ranks_take_the_single_process_update(tmp_path, keep):
    """Ranks hold different token counts (token-mean weights them), the KL reference is sharded
    too, temperature ≠ 1, a second step scores its own π_old: the updated weights, the global
    gradient norms and the published weights match one process's, whether the policy keeps its
    gathered weights from forward to backward (the default) or frees them after each forward."""
    from rollmarket.train.learner import Learner

    single = Learner(resolve(None, ARGS))
    tok = single.loaded.tokenizer
    prompt = np.asarray(tok("Q: add the numbers.", add_special_tokens=False)["input_ids"])
    pairs = [(prompt, np.asarray(tok(r, add_special_tokens=False)["input_ids"])) for r in RESPONSES]
    rng = np.random.default_rng(0)
    data = []
    for (p, r), s, adv in zip(pairs, single.score(pairs, temperature=0.8), ADVANTAGES):
        action_T = np.ones(len(r), dtype=np.float32)
        action_T[-1] = 0.0
        old_T = s.logprobs_T + rng.normal(0, 0.3, len(r)).astype(np.float32)
        data.append(Datum(p, r, s.logprobs_T.copy(), action_T, advantage=adv, old_logprobs_T=old_T))
    (tmp_path / "data.pkl").write_bytes(pickle.dumps(data))
    before = {name: p.detach().clone() for name, p in single.model.named_parameters()}
    torch.multiprocessing.spawn(_rank, nprocs=2, join=True,
                                args=(2, free_port(), str(tmp_path / "data.pkl"), str(tmp_path / "rank0.pkl"), keep))
    sharded = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    expected = [single.step(data, temperature=0.8),
                single.step([replace(d, old_logprobs_T=None) for d in data], temperature=0.8)]

    for got, want in zip(sharded["metrics"], expected):
        torch.testing.assert_close(got["actor/grad_norm"], want["actor/grad_norm"], atol=0, rtol=1e-4)
    moved = 0
    for name, p in single.model.named_parameters():
        got, want = sharded["weights"][name], p.detach()
        # Adam moves a weight by about lr·sign(g): where g is ~0 summation order can flip the sign.
        torch.testing.assert_close(got, want, atol=4.1e-3, rtol=0)
        assert float((got - want).abs().le(1e-6).double().mean()) > 0.99, name
        moved += int((want != before[name]).sum())
    assert moved > 0.5 * sum(p.numel() for p in before.values())  # the step did update the weights
    # What a checkpoint would publish: the same names, the whole tensors, the same values.
    published = single.weights()
    assert sharded["published"].keys() == published.keys()
    for name, tensor in published.items():
        assert sharded["published"][name].shape == tensor.shape and not hasattr(sharded["published"][name], "device_mesh")
        torch.testing.assert_close(sharded["published"][name], tensor, atol=4.1e-3, rtol=0)
