"""Datasets and helpers of chapter 01 (data loading with worker processes).

They live in the package, not the notebook, because DataLoader workers started
with ``spawn`` (macOS, Windows) import the dataset class by name.
"""

from __future__ import annotations

import os
import random
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from .common.timing import clock
from .runtime.i18n import tr


class WhoLoadsMe(Dataset):
    """Each sample reports its index, the worker that produced it and that worker's PID."""

    def __init__(self, size: int = 12):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        info = get_worker_info()
        worker = info.id if info is not None else -1  # -1: loaded in the main process
        return {"index": index, "worker": worker, "pid": os.getpid()}


def _loader(dataset, **kwargs) -> DataLoader:
    """A DataLoader that does not warn when its workers outnumber the cores.

    That advice is about CPU-bound loading; the datasets here sleep (like I/O),
    where more workers than cores is exactly the point, as the throughput
    measurement in chapter 01 shows. (It warns when built and when iterated.)
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        return DataLoader(dataset, **kwargs)


def _batches(loader):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        yield from loader


def worker_assignment(size=12, batch_size=2, num_workers=3, **loader_kwargs):
    """One row per batch: which worker built it, from which indices."""
    loader = _loader(WhoLoadsMe(size), batch_size=batch_size, num_workers=num_workers, **loader_kwargs)
    rows = []
    for batch_number, batch in enumerate(_batches(loader)):
        rows.append(
            {
                "batch": batch_number,
                "worker": sorted(set(batch["worker"].tolist())),
                "indices": batch["index"].tolist(),
                "pid": sorted(set(batch["pid"].tolist())),
            }
        )
    return rows


class SlowDataset(Dataset):
    """Samples that take ``delay`` seconds each, like reading and decoding a file.

    The delay is a sleep, so it behaves like I/O: it occupies no core, and
    workers overlap it even on a 2-core machine. CPU-heavy decoding would
    scale only up to the number of free cores.
    """

    def __init__(self, size: int = 96, delay: float = 0.01, features: int = 16):
        self.size, self.delay, self.features = size, delay, features

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        time.sleep(self.delay)
        return torch.full((self.features,), float(index))


def epoch_seconds(loader) -> float:
    """Wall time of one pass over ``loader``, including starting its workers."""
    start = clock()  # the batches stay on the CPU: nothing queued to wait for
    for _ in _batches(loader):
        pass
    return clock() - start


def throughput(dataset, num_workers: int, batch_size: int = 8, repeats: int = 1, **loader_kwargs) -> float:
    """Steady-state samples per second: best of ``repeats`` epochs.

    With workers, a first epoch that starts them is run and not counted
    (``persistent_workers`` keeps them for the measured epochs): this measures
    how fast workers load, not how fast the machine forks processes, which
    varies far more with load. Section 4 of chapter 01 measures the start-up.
    """
    persistent = num_workers > 0
    loader = _loader(
        dataset, batch_size=batch_size, num_workers=num_workers, persistent_workers=persistent, **loader_kwargs
    )
    if persistent:
        epoch_seconds(loader)
    best = min(epoch_seconds(loader) for _ in range(repeats))
    return len(dataset) / best


class NoisyDigits(Dataset):
    """scikit-learn's 8x8 digits with random noise added as augmentation.

    The random generator is created once, in ``__init__``. Every worker gets a
    copy of the dataset object, so without reseeding every worker starts from
    the same generator state and draws the same "random" noise.
    """

    def __init__(self, size: int = 16, seed: int = 0, noise: float = 0.5):
        from .common.datasets import digits

        images, labels = digits()
        self.images, self.labels = images[:size].reshape(-1, 8, 8), labels[:size]
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        noise = torch.from_numpy(self.rng.normal(0.0, self.noise, size=(8, 8))).float()
        return self.images[index] + noise, noise, self.labels[index]


def reseed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that gives each worker its own generator.

    ``torch.initial_seed()`` inside a worker is ``base_seed + worker_id``, where
    ``base_seed`` is drawn from the main process each epoch: distinct per
    worker and per epoch, and reproducible when the DataLoader gets a seeded
    ``generator``.
    """
    dataset = get_worker_info().dataset
    dataset.rng = np.random.default_rng(torch.initial_seed() % 2**32)


def noise_by_sample(num_workers: int = 2, worker_init_fn=None, seed: int | None = None, size: int = 16):
    """Load NoisyDigits once; return {sample index: (worker id, noise tensor)}."""
    dataset = NoisyDigits(size=size)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(
        WorkerTagged(dataset),
        batch_size=1,
        num_workers=num_workers,
        worker_init_fn=worker_init_fn,
        generator=generator,
        **_fork_if_possible(num_workers),
    )
    out = {}
    for index, worker, (_, noise, _) in loader:
        out[int(index)] = (int(worker), noise[0])
    return out


def duplicated_noise(samples: dict) -> list[tuple[int, int]]:
    """Pairs of samples that received exactly the same noise."""
    keys = sorted(samples)
    return [(a, b) for i, a in enumerate(keys) for b in keys[i + 1 :] if torch.equal(samples[a][1], samples[b][1])]


def noise_by_epoch(
    epochs: int = 2,
    num_workers: int = 2,
    persistent_workers: bool = False,
    worker_init_fn=None,
    seed: int | None = None,
    size: int = 8,
) -> list[dict]:
    """Load NoisyDigits for several epochs from one DataLoader; one {sample: (worker, noise)} per epoch.

    Without ``persistent_workers`` every epoch starts new workers, each with a fresh copy of the
    dataset as it is in this process, whose generator never drew a number here: so every epoch
    starts from the same generator state (``DataLoader._get_iterator`` in torch/utils/data/dataloader.py).
    """
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(
        WorkerTagged(NoisyDigits(size=size)),
        batch_size=1,
        num_workers=num_workers,
        persistent_workers=persistent_workers,
        worker_init_fn=worker_init_fn,
        generator=generator,
        **_fork_if_possible(num_workers),
    )
    return [{int(i): (int(w), noise[0]) for i, w, (_, noise, _) in loader} for _ in range(epochs)]


def same_noise(a: dict, b: dict) -> bool:
    """Whether two epochs gave every sample exactly the same noise."""
    return a.keys() == b.keys() and all(torch.equal(a[i][1], b[i][1]) for i in a)


class WorkerTagged(Dataset):
    """Wraps a dataset so that each item also says which worker loaded it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        info = get_worker_info()
        return index, (info.id if info else -1), self.dataset[index]

    # reseed_worker looks for .rng on the dataset it is handed
    @property
    def rng(self):
        return self.dataset.rng

    @rng.setter
    def rng(self, value):
        self.dataset.rng = value


def slow_start(worker_id: int, seconds: float = 0.25) -> None:
    """``worker_init_fn`` imitating expensive worker set-up (opening files, a tokenizer...)."""
    time.sleep(seconds)


def worker_pids_per_epoch(epochs: int = 3, persistent_workers: bool = False, num_workers: int = 2):
    """Run ``epochs`` epochs; return the set of worker PIDs and the wall time of each epoch."""
    loader = DataLoader(
        WhoLoadsMe(8),
        batch_size=2,
        num_workers=num_workers,
        persistent_workers=persistent_workers,
        worker_init_fn=slow_start,
    )
    pids, seconds = [], []
    for _ in range(epochs):
        start = clock()
        pids.append(sorted({int(pid) for batch in loader for pid in batch["pid"]}))
        seconds.append(clock() - start)
    return pids, seconds


def _fork_if_possible(num_workers: int) -> dict:
    # A worker_init_fn written in a notebook (exercise 1) cannot be pickled for "spawn" or
    # "forkserver" workers, which import it by name. On Linux these workers are forked from the
    # kernel: they touch no CUDA and take no lock another thread of the kernel could hold. Elsewhere
    # keep the platform's default: on macOS, fork is unsafe (system libraries start threads), which
    # is why "spawn" has been its default since Python 3.8; there the exercise's function must be
    # defined in a module (an importable .py file).
    import multiprocessing

    if num_workers > 0 and sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return {"multiprocessing_context": "fork"}
    return {}


class RandomSources(Dataset):
    """Draws one number from each random source a dataset might use."""

    def __init__(self, size: int = 2):
        self.size = size
        self.rng = np.random.default_rng(0)  # created once, copied into every worker

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        info = get_worker_info()
        return {
            "worker": info.id if info else -1,
            "torch": int(torch.randint(2**31, (1,))),
            "random": random.getrandbits(31),
            "numpy global": int(np.random.randint(2**31)),
            "numpy Generator in dataset": int(self.rng.integers(2**31)),
        }


def source_label(source: str) -> str:
    """A random source as the chapter's tables name it: module names as they are, the rest translated."""
    words = {"numpy global": tr("numpy global"), "numpy Generator in dataset": tr("numpy Generator in dataset")}
    return words.get(source, source)


def first_draw_per_worker(num_workers: int = 2) -> dict[str, list[int]]:
    """For each random source, the first number each worker drew."""
    loader = _loader(RandomSources(num_workers), batch_size=None, num_workers=num_workers)
    draws = sorted(_batches(loader), key=lambda d: d["worker"])
    return {source: [d[source] for d in draws] for source in draws[0] if source != "worker"}


def first_draws_per_rank(world_size: int = 2, num_workers: int = 2, seed: int = 0, rank_in_seed: bool = False):
    """{(rank, worker): first draw of each random source}, for ranks that all call ``torch.manual_seed(seed)``.

    Every rank's script seeds torch, then iterates its DataLoader, which draws the workers'
    ``base_seed`` from torch's global generator: that draw alone decides every worker's
    seeds. So running the ranks one after the other in this process, each from the same
    seed, reproduces what separate rank processes would do, without starting them.
    ``rank_in_seed=True`` applies the fix: the DataLoader gets its own generator, seeded
    with ``seed + rank``, so the workers' seeds differ between ranks while the global seed
    (model initialisation, dropout) stays the same on every rank.
    """
    draws = {}
    with torch.random.fork_rng(devices=[]):  # leave the caller's generator as it was
        for rank in range(world_size):
            torch.manual_seed(seed)  # what every rank's script does first
            generator = torch.Generator().manual_seed(seed + rank) if rank_in_seed else None
            loader = _loader(RandomSources(num_workers), batch_size=None, num_workers=num_workers, generator=generator)
            for sample in _batches(loader):
                draws[(rank, sample["worker"])] = {k: v for k, v in sample.items() if k != "worker"}
    return dict(sorted(draws.items()))


def host_to_device_ms(megabytes: int = 64, repeats: int = 5, device=None) -> dict[str, float]:
    """Milliseconds of one host-to-accelerator copy of ``megabytes`` MiB, from pageable and from pinned memory.

    Fair timing: each kind of memory is copied once before the clock starts, and the best
    of ``repeats`` copies counts. The first copy pays one-off costs (creating the CUDA
    context, the caching allocator's first request for device memory, the driver's staging
    buffers): without the warm-up they land on whichever kind of memory is timed first.
    Both sources are written before timing, so no copy pays the page faults of memory
    that was allocated but never touched.
    """
    from .common.timing import best_of, wait_for_compute

    device = torch.device(device) if device is not None else torch.accelerator.current_accelerator(check_available=True)
    if device is None or device.type == "cpu":
        raise ValueError("pinned memory speeds up copies to an accelerator; this machine has none")
    pageable = torch.ones(megabytes * 2**20, dtype=torch.uint8)  # ones, not empty: every page touched
    pinned = pageable.pin_memory()
    result = {}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        host.to(device, non_blocking=True)  # warm-up, not timed
        wait_for_compute(device)
        result[name] = 1e3 * best_of(lambda: host.to(device, non_blocking=True), repeats, device)
    return result


TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    # Set by torchrun when unset and more than one process per node (torch/distributed/run.py,
    # "Setting OMP_NUM_THREADS ... to be 1"): one intra-op thread per worker unless you choose.
    "OMP_NUM_THREADS",
    # Set to 1 unless set (local_elastic_agent.py): a failed NCCL collective aborts the process.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
)


def torchrun_environment(nproc: int = 2, timeout: float = 60.0) -> list[dict]:
    """The variables in ``TORCHRUN_VARIABLES`` as each of ``nproc`` torchrun workers sees them, by rank.

    The workers are bare ``python -c`` processes (``--no-python``) that write their
    environment to a file each and exit, so this costs about what torchrun needs to start. The variable
    ``CUDA_VISIBLE_DEVICES`` is removed from torchrun's own environment first: if a worker
    has it, torchrun put it there.
    """
    import json
    import tempfile

    from .common import subprocesses as tt

    with tempfile.TemporaryDirectory() as folder:
        # One file per worker: both workers share torchrun's stdout, where two lines can interleave.
        out = os.path.join(folder, "{}.json")
        probe = (
            f"import json, os; json.dump({{k: os.environ.get(k) for k in {TORCHRUN_VARIABLES!r}}}, "
            f"open({out!r}.format(os.environ['RANK']), 'w'))"
        )
        env = tt.child_env()
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("OMP_NUM_THREADS", None)  # unset, as in a fresh shell: torchrun then sets it to 1
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--no-python",
            sys.executable,
            "-c",
            probe,
        ]
        tt.run(command, timeout=timeout, env=env)
        rows = []
        for rank in range(nproc):
            with open(out.format(rank)) as file:
                rows.append(json.load(file))
    return sorted(rows, key=lambda row: int(row["RANK"]))


def cifar10(root, train: bool = True, download: bool = False, transform=None):
    """CIFAR-10 through torchvision, for learners with a network.

    The executed chapters use data that ships with scikit-learn (no downloads); this is
    the loader for running them on real images. Bad paths fail with a message that says
    what to do, before torchvision is asked.
    """
    import pathlib

    root = pathlib.Path(root).expanduser()
    folder = root / "cifar-10-batches-py"
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(
            tr("CIFAR-10 root {root} is a file; give the folder that holds cifar-10-batches-py").format(root=root)
        )
    if root.exists() and not os.access(root, os.R_OK | os.X_OK):
        raise PermissionError(tr("cannot read {root}: check its permissions").format(root=root))
    if not download and not folder.is_dir():
        raise FileNotFoundError(
            tr(
                "CIFAR-10 is not in {root} (expected {folder}). Pass download=True to fetch it "
                "(about 170 MB, needs internet), or point root at a folder that already has it."
            ).format(root=root, folder=folder)
        )
    from torchvision import datasets

    try:
        return datasets.CIFAR10(str(root), train=train, download=download, transform=transform)
    except RuntimeError as exc:
        raise RuntimeError(
            tr(
                "CIFAR-10 in {folder} is incomplete or corrupt ({error}); delete that folder and pass download=True"
            ).format(folder=folder, error=exc)
        ) from None
