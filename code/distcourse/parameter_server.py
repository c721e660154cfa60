"""Chapter 12, part 3: a parameter server with ``torch.distributed.rpc``, and collectives beside it.

Rank 0 is the server ("ps"): it owns the model and the optimizer. The other ranks are
trainers ("trainer1", ...): each pulls the weights, computes a gradient on its own batch and
pushes it back, through an ``RRef`` (a remote reference) to the server object.

- ``mode="sync"``: the server waits for every trainer's gradient, averages them and takes one
  step (``@rpc.functions.async_execution``: a push returns a future that completes when the
  round does). That is data parallelism, and it must equal an all-reduce.
- ``mode="async"``: each push is applied at once. A slow trainer never holds the others back,
  but its gradient was computed on weights that have changed since ("staleness").
- Uneven trainers (``delays``): a trainer slower than the fastest starts its extra work only once
  another trainer has pushed since its pull. A sleep alone makes that overlap likely, not certain:
  on a busy machine the operating system may run the slow trainer's whole step before the fast
  one's push, and every push is then fresh. With the wait, the slow trainer provably computes
  while another pushes: its push waits in the synchronous round, its gradient is stale in the
  asynchronous mode. The fast trainers never wait for the slow ones.
- ``remote_autograd``: the other RPC style. The model's forward runs on the server through
  its RRef, distributed autograd records the calls across processes, and
  ``DistributedOptimizer`` steps the server's parameters through RRefs to them.

RPC makes its own connections (TensorPipe), meeting at the address given by ``init_method``.
The launcher's process group serves one purpose here: a barrier after ``rpc.shutdown()``, so
that rank 0, which hosts RPC's rendezvous store, does not exit while the others still talk to
it (a "connection reset by peer" in their shutdown otherwise).
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import rpc

from .common.datasets import digits_batch
from .common.models import mlp
from .common.timing import clock
from .common.training import average_gradients
from .runtime.hardware import rank_device


def _batch(step: int, trainer: int, trainers: int, batch: int):
    """Trainer ``trainer``'s (1-based) share of step ``step``'s global batch of ``trainers * batch`` digits."""
    images, labels = digits_batch(trainers * batch, seed=step)
    part = slice((trainer - 1) * batch, trainer * batch)
    return images[part], labels[part]


def one_process(steps: int, trainers: int, batch: int, width: int, lr: float) -> list[torch.Tensor]:
    """The reference: one process, SGD on the whole global batch each step."""
    model = mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        images, labels = digits_batch(trainers * batch, seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------
# 1. Pull and push through an RRef
# --------------------------------------------------------------------------------------


class ParameterServer:
    """The model, its optimizer and a version number, behind a lock (RPCs arrive on many threads)."""

    def __init__(self, mode: str, trainers: int, width: int, lr: float):
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.mode, self.trainers = mode, trainers
        self.model = mlp(width)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.version = 0  # steps taken so far
        self.staleness = {t: [] for t in range(1, trainers + 1)}  # per push: steps taken since its pull
        self.round, self.waiting = [], []  # sync: the round's (trainer, gradients) and their futures
        self.held, self.finished = [], 0  # slow trainers waiting for another's push; trainers done
        self.bytes = {"in": 0, "out": 0}  # tensor payload through the server: gradients in, weights out

    @staticmethod
    @rpc.functions.async_execution
    def start(server_rref) -> torch.futures.Future:
        """Runs on the server: completes when every trainer has called it (a barrier). Trainers
        call it after their first pull: nobody pushes before everyone holds the first weights."""
        self = server_rref.local_value()
        arrived = torch.futures.Future()
        with self.lock:
            self.waiting.append(arrived)
            if len(self.waiting) < self.trainers:
                return arrived
            waiting, self.waiting = self.waiting, []
        for future in waiting:
            future.set_result(None)
        return arrived

    def pull(self) -> tuple[int, list[torch.Tensor]]:
        with self.lock:
            weights = [p.detach().clone() for p in self.model.parameters()]
            self.bytes["out"] += sum(w.numel() * w.element_size() for w in weights)
            return self.version, weights

    @staticmethod
    @rpc.functions.async_execution
    def push(server_rref, trainer: int, version: int, grads: list[torch.Tensor]) -> torch.futures.Future:
        """Runs on the server. Returns a future: done at once (async), or when the round is (sync)."""
        self = server_rref.local_value()
        done = torch.futures.Future()
        with self.lock:
            self.staleness[trainer].append(self.version - version)
            self.bytes["in"] += sum(g.numel() * g.element_size() for g in grads)
            if self.mode == "async":
                self._step([grads])
                done.set_result(self.version)
                released = self._release()
                return _complete(released, done)
            self.round.append((trainer, grads))
            self.waiting.append(done)
            if len(self.round) < self.trainers:
                released = self._release()
                return _complete(released, done)  # rpc_sync waits until the last trainer has pushed
            self._step([g for _, g in self.round])
            waiting, self.round, self.waiting = self.waiting, [], []
        for future in waiting:
            future.set_result(self.version)
        return done

    @staticmethod
    @rpc.functions.async_execution
    def after_another_push(server_rref, trainer: int, version: int) -> torch.futures.Future:
        """Runs on the server: completes once a trainer other than ``trainer`` has pushed since
        ``trainer`` pulled weights ``version``, or once no other trainer can push any more (each
        is finished, waiting in a round or waiting here): a slow trainer's wait never deadlocks."""
        self = server_rref.local_value()
        ready = torch.futures.Future()
        with self.lock:
            self.held.append((trainer, version, ready))
            released = self._release()
        return _complete(released, ready)

    def finish(self) -> None:
        """A trainer has pushed its last gradient: slow trainers no longer wait for it."""
        with self.lock:
            self.finished += 1
            released = self._release()
        _complete(released, None)

    def _release(self) -> list[torch.futures.Future]:
        """Under the lock: the held trainers whose wait is over, removed from ``held``."""
        stuck = len(self.held) + len(self.round) + self.finished >= self.trainers

        def another_pushed(trainer: int, version: int) -> bool:
            # async: every push takes a step; sync: the round fills before the step is taken
            return self.version > version or any(t != trainer for t, _ in self.round)

        over = [stuck or another_pushed(trainer, version) for trainer, version, _ in self.held]
        released = [future for (_, _, future), done in zip(self.held, over) if done]
        self.held = [entry for entry, done in zip(self.held, over) if not done]
        return released

    def _step(self, gradients: list[list[torch.Tensor]]) -> None:
        for p, *grads in zip(self.model.parameters(), *gradients):
            p.grad = torch.stack(grads).mean(0)  # the average over trainers, as an all-reduce gives
        self.optimizer.step()
        self.version += 1


def _complete(released: list[torch.futures.Future], returned):
    """Complete the released trainers' futures (outside the server's lock); pass ``returned`` on."""
    for future in released:
        future.set_result(None)
    return returned


def train_through_server(
    server_rref, trainer: int, trainers: int, steps: int, batch: int, width: int, delay: float, slower: bool = False
) -> dict:
    """Runs on a trainer: pull, compute a gradient on this trainer's batch, push; ``steps`` times.

    ``slower``: this trainer is slower than another; it starts its extra work (``delay``) only
    once another trainer has pushed since its pull, so that it computes while the other pushes.
    """
    model = mlp(width)
    server = server_rref.rpc_sync()
    first = server.pull()  # before the barrier: no push can come before every trainer's first pull
    rpc.rpc_sync(server_rref.owner(), ParameterServer.start, args=(server_rref,))
    started, losses, waits = clock(), [], []
    for step in range(steps):
        version, weights = server.pull() if step else first  # one round trip: the current weights
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
        images, labels = _batch(step, trainer, trainers, batch)
        model.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        if slower:
            rpc.rpc_sync(server_rref.owner(), ParameterServer.after_another_push, args=(server_rref, trainer, version))
        time.sleep(delay)  # extra work per step: a slower machine, or a bigger batch
        grads = [p.grad for p in model.parameters()]
        pushed = clock()
        rpc.rpc_sync(server_rref.owner(), ParameterServer.push, args=(server_rref, trainer, version, grads))
        waits.append(clock() - pushed)  # the round trip, plus the wait for the round (sync)
        losses.append(loss.item())
    server.finish()
    return {"losses": losses, "seconds": clock() - started, "push seconds": waits}


def _recorded(caught) -> list[str]:
    return sorted({f"{w.category.__name__}: {w.message}" for w in caught})


def _shutdown() -> None:
    rpc.shutdown()  # waits until every process has finished its outstanding RPCs
    if dist.is_initialized():
        dist.barrier()  # nobody exits, taking the rendezvous store with it, before all are done


def _init_rpc(port: int) -> tuple[int, int]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = "ps" if rank == 0 else f"trainer{rank}"
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    return rank, world_size


def parameter_server(port: int, mode: str = "sync", steps: int = 8, batch: int = 32, width: int = 32,
                     lr: float = 0.5, delays: tuple = ()) -> dict | None:  # fmt: skip
    """Rank function: rank 0 serves, the others train. ``delays``: seconds added to every step
    of trainer 1, 2, ... (none by default; a trainer slower than the fastest computes while
    another pushes, see the module's docstring). Returns, on rank 0, the final weights, each
    trainer's losses and time, the staleness of every push and the bytes through the server."""
    _batch(0, 1, 1, batch)  # load the digits first: then init_rpc, which waits for all, starts every clock together
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank, world_size = _init_rpc(port)
        result = _serve_or_train(rank, world_size, mode, steps, batch, width, lr, delays)
        _shutdown()
    return {**(result or {}), "warnings": _recorded(caught)}


def _serve_or_train(rank, world_size, mode, steps, batch, width, lr, delays) -> dict | None:
    result = None
    if rank == 0:
        trainers = world_size - 1
        server = ParameterServer(mode, trainers, width, lr)
        server_rref = rpc.RRef(server)  # owned here; trainers receive a reference to it
        delays = tuple(delays) or (0.0,) * trainers
        futures = [
            rpc.rpc_async(
                f"trainer{t}",
                train_through_server,
                args=(server_rref, t, trainers, steps, batch, width, delays[t - 1], delays[t - 1] > min(delays)),
            )
            for t in range(1, trainers + 1)
        ]
        per_trainer = [f.wait() for f in futures]
        result = {
            "params": [p.detach().clone() for p in server.model.parameters()],
            "trainers": per_trainer,
            "staleness": server.staleness,
            "steps taken": server.version,
            "bytes": server.bytes,
        }
    return result


# --------------------------------------------------------------------------------------
# 2. Remote forward, distributed autograd, DistributedOptimizer
# --------------------------------------------------------------------------------------


class RemoteModel:
    """The server side of the second style: a model whose forward trainers call through an RRef."""

    def __init__(self, width: int):
        self.model = mlp(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.model.parameters()]

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def remote_autograd(port: int, steps: int = 8, batch: int = 32, width: int = 32, lr: float = 0.5) -> dict | None:
    """Rank function on 2 ranks: rank 0 owns the model, rank 1 trains it remotely.

    The forward runs on rank 0; the loss is computed on rank 1; ``dist_autograd.backward``
    follows the RPC back to rank 0, where the gradients stay, kept per autograd context (two
    trainers' backward passes never mix). ``DistributedOptimizer`` then steps the parameters
    where they live. Returns, on rank 1, the final weights; on both, the warnings raised.
    """
    if int(os.environ["WORLD_SIZE"]) != 2:
        raise ValueError(f"remote_autograd runs on 2 ranks, got {os.environ['WORLD_SIZE']}")
    with warnings.catch_warnings(record=True) as caught:  # on both: the optimizer warns where it is created
        warnings.simplefilter("always")
        rank, _ = _init_rpc(port)
        result = _train_remotely(steps, batch, width, lr) if rank == 1 else {}
        _shutdown()
    return {**result, "warnings": _recorded(caught)}


def _train_remotely(steps: int, batch: int, width: int, lr: float) -> dict:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer

    model_rref = rpc.remote("ps", RemoteModel, args=(width,))  # created on the server, owned there
    optimizer = DistributedOptimizer(torch.optim.SGD, model_rref.rpc_sync().parameter_rrefs(), lr=lr)
    losses = []
    for step in range(steps):
        images, labels = _batch(step, 1, 1, batch)
        with dist_autograd.context() as context_id:
            logits = model_rref.rpc_sync().forward(images)  # recorded: a send here, a recv there
            loss = F.cross_entropy(logits, labels)
            dist_autograd.backward(context_id, [loss])  # runs backward on both processes
            optimizer.step(context_id)  # on the server, with this context's gradients
        losses.append(loss.item())
    return {"params": model_rref.rpc_sync().weights(), "losses": losses}


# --------------------------------------------------------------------------------------
# 3. The same synchronous training with a collective
# --------------------------------------------------------------------------------------


def allreduce_training(steps: int = 8, batch: int = 32, width: int = 32, lr: float = 0.5) -> dict:
    """Rank function: every rank a trainer, gradients averaged by ``all_reduce`` (DDP by hand).

    The model and batches live on the rank's device: under nccl a collective takes GPU
    tensors only. To compare with the parameter server, which trains on the CPU, launch
    it with ``backend="gloo"``. Returns the final weights and the seconds of every step.
    """
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    model = mlp(width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    times = []
    for step in range(steps):
        started = clock(device)
        images, labels = (t.to(device) for t in _batch(step, rank + 1, world_size, batch))
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        average_gradients(model)  # one bucket, as DDP would send it
        optimizer.step()
        times.append(clock(device) - started)
    return {"params": [p.detach().cpu().clone() for p in model.parameters()], "step seconds": times}
