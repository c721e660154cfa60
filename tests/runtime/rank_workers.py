"""Rank functions used by test_launcher.py (rank processes import them by name)."""

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def chatty(lines=3):
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(0.2)  # rank 1 prints first; the cell must still show rank 0 first
    for i in range(lines):
        print(f"line {i} of rank {rank}")
    os.write(2, f"raw fd-2 write of rank {rank}\n".encode())
    return rank


def threads_and_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return torch.get_num_threads(), {k: os.environ[k] for k in keys}, os.getpid()


def environment_seen(names):
    """The variables ``names`` as this rank sees them (None when unset), and c10d's debug level."""
    return {name: os.environ.get(name) for name in names}, str(dist.get_debug_level())


def raise_on(rank_to_fail=1):
    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    dist.barrier()  # the healthy rank waits for the failed one: the launcher must stop it
    time.sleep(60)


def exit_with(code=3):
    if dist.get_rank() == 1:
        os._exit(code)
    time.sleep(60)


def kill_self():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep_forever(pid_dir=None):
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(600)


def uneven_barrier():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(30)


def unpicklable_result():
    return lambda: None


def wait_for_release(folder):
    """Say so (folder/rank<N>.ready) once inside the rank function, process group up; return when
    folder/release exists. The test looks at the ranks while they provably run, whatever the load."""
    folder = Path(folder)
    (folder / f"rank{dist.get_rank()}.ready").touch()
    deadline = time.monotonic() + 120
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return dist.get_rank()


def no_process_group():
    return dist.is_initialized(), int(os.environ["RANK"])


class Payload:
    """A class that lives in a module, so ranks can unpickle it."""

    def __init__(self, value):
        self.value = value


def echo(payload):
    return payload.value * (dist.get_rank() + 1)


def killed_mid_collective():
    """Rank 1 dies (SIGKILL) while rank 0 waits for it in all_reduce."""
    t = torch.ones(1)
    for step in range(1000):
        if dist.get_rank() == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    return t.item()


# --- ranks with children of their own -----------------------------------------------------


class _PidTagged(torch.utils.data.Dataset):
    """A small regression dataset whose samples say which process loaded them."""

    def __init__(self, size=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], os.getpid()


def _record(pid_dir, name, pids):
    if pid_dir:
        with open(os.path.join(pid_dir, f"{name}.pids"), "w") as f:
            f.write(" ".join(map(str, sorted(pids))))


def ddp_with_loader_workers(steps=4, num_workers=2, pid_dir=None, then=None):
    """The standard DDP loop: DistributedSampler + DataLoader with worker processes in each rank.

    then: what to do after the first batch, while the workers are alive
    ("raise" on rank 1, "hang" on every rank, "orphan" leaves a grandchild that ignores SIGTERM).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = _PidTagged()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=num_workers, persistent_workers=True)
    worker_pids, done = set(), 0
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y, pids in loader:
            worker_pids.update(pids.tolist())
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
            if done == 1 and then:
                _record(pid_dir, f"workers{rank}", worker_pids | set(_live_workers(loader)))
                _misbehave(then, rank, pid_dir)
            if done == steps:
                params = torch.cat([p.detach().flatten() for p in model.parameters()])
                return {"pid": os.getpid(), "workers": sorted(worker_pids), "params": params}
    raise AssertionError("not enough batches")


def _live_workers(loader):
    iterator = loader._iterator  # persistent workers keep their iterator, and its processes
    return [w.pid for w in getattr(iterator, "_workers", [])]


def _misbehave(then, rank, pid_dir):
    if then == "raise" and rank == 1:
        raise ValueError("deliberate failure while DataLoader workers are alive")
    if then == "orphan":
        # A grandchild that ignores SIGTERM and outlives the process that started it:
        # `sh` starts it in the background and exits at once, so it is re-parented to init.
        import subprocess
        import sys

        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        out = subprocess.run(
            ["sh", "-c", f'"{sys.executable}" -c "{code}" >/dev/null 2>&1 & echo $!'],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        _record(pid_dir, f"orphan{rank}", [int(out)])
        raise ValueError("deliberate failure after starting an orphan")
    if then in ("hang", "orphan", "raise"):
        time.sleep(600)


def uses_subprocess_and_pool():
    """A rank may run programs and start a multiprocessing pool."""
    import multiprocessing
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True).stdout
    with multiprocessing.get_context("fork").Pool(2) as pool:
        squares = pool.map(abs, [-1, -2, -3])
    return int(out), squares


def big_tensor(megabytes=200):
    """A large result: rank r returns a tensor filled with r."""
    return torch.full((megabytes * 2**20 // 4,), float(dist.get_rank()))


def progress_bar(steps=30):
    from tqdm.auto import tqdm

    for _ in tqdm(range(steps), desc="train", disable=dist.get_rank() != 0, mininterval=0):
        time.sleep(0.01)
    print("done")
    return dist.get_rank()


def start_method():
    import multiprocessing

    return multiprocessing.get_start_method()


def says_in_the_notebooks_language():
    """One line through tr() and number(), as the chapters' rank functions print."""
    from distcourse.runtime import i18n

    print(i18n.tr("Not yet:"), i18n.number(1234.5))
    return i18n.language()


def resume_point_seen(roots):
    """Each rank looks for the newest complete checkpoint in its own folder (``roots[rank]``),
    as ranks of different nodes can see a shared folder differently; returns what
    ``agreed_checkpoint`` tells this rank."""
    from distcourse.capstone.checkpointing import agreed_checkpoint

    step, path, incomplete = agreed_checkpoint(Path(roots[dist.get_rank()]))
    return step, None if path is None else str(path), incomplete
