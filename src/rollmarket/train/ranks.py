"""Learner ranks: ``trainer.learner_ranks = N`` trains one run over N processes (FSDP2, train/sharded.py).

    rank 0: the `rollmarket train` process              ranks 1..N-1: started by rank 0
      the trainer loop: the exchange, the run               wait for rank 0's next learner call and
      directory, metrics, checkpoints; its learner   ──►    make it on their own Learner shard
      calls (score, step, save) go to every rank            (collective: same call, same order)

Rank 0 starts the others (multiprocessing spawn, a rendezvous on a free loopback port): one process
per GPU with NCCL (rank i on cuda:i) when ``model.device`` is CUDA, else gloo on the CPU. Each step's
rows are dealt over the ranks (``deal``); every rank steps on its share and the update is the one a
single process takes on all of them. ``save`` gathers the weights and optimizer state to rank 0,
which alone writes the checkpoint (the single-process layout), so a run resumes with any number of
ranks. Calls travel pickled on a gloo group of their own, so NCCL carries only tensors.

A rank that dies takes the run down, in bounded time: rank 0 watches the others, and when one exits
unasked it kills the rest and stops the loop with a TrainingError that names the rank (or, if the
loop is stuck in a collective that never returns, exits the process after ``GRACE_S``); the others
watch rank 0 and leave when it is gone. ``rollmarket train --resume RUN_DIR`` goes on from the
newest checkpoint.

Importing this module starts nothing.
"""

from __future__ import annotations

import _thread
import dataclasses
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..engines.loading import LoadedModel, load_model
from .batch import Datum
from .config import TrainConfig, TrainConfigError
from .learner import Learner

CALL_TIMEOUT = timedelta(days=1)
"""How long ranks 1..N-1 wait for rank 0's next call: a whole step's fetch and evaluation. A dead
rank 0 is noticed by its parent-watch, not by this."""
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
GRACE_S = 30.0
"""After a rank died: how long rank 0's loop has to stop by itself before the process exits."""
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class EvaluationPolicy:
    """What held-out evaluation serves: a checkpoint loaded whole on rank 0's device."""

    loaded: LoadedModel
    model: torch.nn.Module


def rank_backend(config: TrainConfig) -> tuple[str, str]:
    """(process-group backend, device type) of the ranks: NCCL on CUDA (one GPU per rank), gloo on
    the CPU. A TrainConfigError when CUDA is asked for and there are too few GPUs."""
    ranks = config.trainer.learner_ranks
    if not config.model.device.startswith("cuda"):
        return "gloo", "cpu"
    found = torch.cuda.device_count()
    if found < ranks:
        raise TrainConfigError(f"trainer.learner_ranks={ranks} on {config.model.device} needs {ranks} GPUs; "
                               f"{found} visible", fix=f"set trainer.learner_ranks <= {found} or model.device=cpu")
    return "nccl", "cuda"


def deal(data: list[Datum], ranks: int, updates_per_batch: int) -> list[tuple[list[Datum], list[int]]]:
    """Each rank's rows and its mini-batch sizes (``Learner.step``'s ``minibatches``).

    The single process's mini-batches (``updates_per_batch`` consecutive splits) stay mini-batches:
    rank r takes rows r, r+N, … of each, so every optimizer step sees the same rows, over the ranks,
    as in one process. A rank left without a row of a mini-batch takes one padding row (size 0: a copy
    of the mini-batch's first row without loss tokens), so that it joins the others' collectives."""
    shares: list[tuple[list[Datum], list[int]]] = [([], []) for _ in range(ranks)]
    for rows in np.array_split(np.arange(len(data)), min(updates_per_batch, len(data))):
        for rank, (mine, sizes) in enumerate(shares):
            taken = [data[i] for i in rows[rank::ranks]]
            sizes.append(len(taken))
            mine.extend(taken or [_padding(data[rows[0]])])
    return shares


def _padding(datum: Datum) -> Datum:
    return dataclasses.replace(datum, action_mask_T=np.zeros_like(datum.action_mask_T), advantage=0.0,
                               corrected=False)


def _apply(learner: Learner, rank: int, call: tuple[str, tuple]):
    """Make rank 0's call on this rank's Learner (every rank runs this, rank 0 included)."""
    name, payload = call
    if name == "step":
        shares, temperature, sepa = payload
        learner.sepa = sepa  # rank 0 observes the correct rate; λ must be the same on every rank
        rows, sizes = shares[rank]
        return learner.step(rows, temperature, minibatches=sizes)
    args, kw = payload
    return getattr(learner, name)(*args, **kw)


class DistributedLearner:
    """Rank 0's Learner: ``score``, ``step`` and ``save`` are made on every rank; anything else
    (tokenizer, model info, replay inputs, SEPA) is rank 0's own."""

    def __init__(self, learner: Learner, calls, ranks: int):
        self.learner = learner
        self.calls = calls
        self.ranks = ranks

    def __getattr__(self, name: str):
        return getattr(self.learner, name)

    def _everywhere(self, call: tuple[str, tuple]):
        dist.broadcast_object_list([call], src=0, group=self.calls)
        return _apply(self.learner, 0, call)

    def score(self, *args, **kw):
        """``Learner.score`` on every rank; the results (rank 0's)."""
        return self._everywhere(("score", (args, kw)))

    def step(self, data: list[Datum], temperature: float) -> dict[str, float | None]:
        """``Learner.step`` on every rank, each on its share of `data` (``deal``)."""
        shares = deal(data, self.ranks, self.learner.config.algorithm.updates_per_batch)
        return self._everywhere(("step", (shares, temperature, self.learner.sepa)))

    def save(self, *args, **kw) -> str:
        """``Learner.save`` on every rank; rank 0 writes the checkpoint."""
        return self._everywhere(("save", (args, kw)))

    def evaluation_policy(self, weights: Path) -> EvaluationPolicy:
        """The checkpoint at `weights`, loaded whole on rank 0's device (the shards cannot generate alone)."""
        loaded = load_model(weights, "fp32", self.learner.loaded.device)
        return EvaluationPolicy(loaded, loaded.model)

    def stop(self) -> None:
        """Release the other ranks (they exit)."""
        dist.broadcast_object_list([None], src=0, group=self.calls)
        dist.barrier(group=self.calls)


def _init(rank: int, ranks: int, port: int, backend: str, device_type: str):
    """Join the process group; (device mesh, the calls' gloo group)."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent GPUs
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=COLLECTIVE_TIMEOUT, **extra)
    calls = dist.new_group(backend="gloo", timeout=CALL_TIMEOUT)
    return init_device_mesh(device_type, (ranks,)), calls


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)  # rank 0 is gone: nothing will call again


def _follower(rank: int, ranks: int, port: int, backend: str, device_type: str, config: TrainConfig,
              resume_from: str | None, parent: int) -> None:
    """Ranks 1..N-1: make rank 0's learner calls until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops the ranks
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    mesh, calls = _init(rank, ranks, port, backend, device_type)
    learner = Learner(config, resume_from=None if resume_from is None else Path(resume_from), mesh=mesh)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=calls)
        if box[0] is None:
            break
        _apply(learner, rank, box[0])
    dist.barrier(group=calls)
    # gloo's threads can call std::terminate from C++ destructors at exit (engines/fsdp.py::_worker).
    os._exit(0)


def _exit_words(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class _Watch(threading.Thread):
    """Rank 0's watch over the other ranks: the first that exits unasked fails the run."""

    def __init__(self, processes: list):
        super().__init__(daemon=True, name="learner-ranks-watch")
        self.processes = processes
        self.failure: str | None = None
        self.done = threading.Event()
        """Set when rank 0 stops the ranks itself (their exits are then expected)."""
        self.handling = threading.Event()
        """Set when rank 0's loop is already unwinding."""

    def dead(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"learner rank {rank} (pid {process.pid}) {_exit_words(process.exitcode)}"
        return None

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            if (failure := self.dead()) is None:
                continue
            self.failure = failure
            _kill(self.processes)
            # A collective with the dead rank usually fails by itself (gloo); else interrupt the loop.
            if not self.handling.wait(5.0):
                _thread.interrupt_main()
            if not self.done.wait(GRACE_S):
                sys.stderr.write(f"rollmarket train: {failure}; the trainer did not stop within {GRACE_S:.0f}s, "
                                 f"exiting\n")
                sys.stderr.flush()
                os._exit(1)
            return


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(10)


@contextmanager
def learner_ranks(config: TrainConfig, *, resume_from: Path | None = None):
    """The run's learner: a Learner in this process (``trainer.learner_ranks = 1``), or rank 0's
    DistributedLearner over ``learner_ranks`` processes, which it starts, and stops on exit."""
    from ..localhost import free_port
    from .loop import TrainingError

    ranks = config.trainer.learner_ranks
    if ranks == 1:
        yield Learner(config, resume_from=resume_from)
        return
    backend, device_type = rank_backend(config)
    port = free_port()
    context = torch.multiprocessing.get_context("spawn")
    followers = [context.Process(target=_follower, name=f"learner-rank-{rank}",
                                 args=(rank, ranks, port, backend, device_type, config,
                                       None if resume_from is None else str(resume_from), os.getpid()))
                 for rank in range(1, ranks)]
    for process in followers:
        process.start()
    watch = _Watch(followers)
    watch.start()
    try:
        mesh, calls = _init(0, ranks, port, backend, device_type)
        learner = DistributedLearner(Learner(config, resume_from=resume_from, mesh=mesh), calls, ranks)
        yield learner
        watch.done.set()
        learner.stop()
        for process in followers:
            process.join(60)
    except BaseException as exc:
        watch.handling.set()
        # A collective with a dead rank may fail just before the watch sees the exit.
        peer_failure = isinstance(exc, RuntimeError) and not isinstance(exc, TrainingError)
        deadline = time.monotonic() + (10 if peer_failure else 0)
        while watch.failure is None and watch.dead() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        failure = watch.failure or watch.dead()
        watch.done.set()
        _kill(followers)
        if failure is not None:
            raise TrainingError(f"{failure}; the other learner ranks were stopped. Resume from the newest "
                                f"checkpoint with `rollmarket train --resume RUN_DIR`") from None
        raise
    finally:
        watch.done.set()
        _kill(followers)
        if dist.is_initialized():
            dist.destroy_process_group()
