"""The chapter 01 helpers behave as the chapter says, and its self-check can fail."""

import torch

from distcourse import dataloaders as data
from distcourse.exercises import ch01


def test_batches_go_to_workers_in_turn():
    rows = data.worker_assignment(size=10, batch_size=2, num_workers=2)
    assert [r["worker"] for r in rows] == [[0], [1], [0], [1], [0]]
    assert data.worker_assignment(size=4, batch_size=2, num_workers=0)[0]["worker"] == [-1]


def test_stored_generator_is_duplicated_and_reseeding_fixes_it():
    assert data.duplicated_noise(data.noise_by_sample(num_workers=2))
    assert not data.duplicated_noise(data.noise_by_sample(num_workers=2, worker_init_fn=data.reseed_worker))
    assert not data.duplicated_noise(data.noise_by_sample(num_workers=0))


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    def seeds_everything_the_same(worker_id):  # distinct per worker? no: constant seed
        torch.utils.data.get_worker_info().dataset.rng = __import__("numpy").random.default_rng(7)

    def ignores_the_seed(worker_id):
        info = torch.utils.data.get_worker_info()
        info.dataset.rng = __import__("numpy").random.default_rng(1000 + worker_id)

    assert ch01.check_worker_init_fn(None) is False
    assert ch01.check_worker_init_fn(lambda worker_id: None) is False
    assert ch01.check_worker_init_fn(seeds_everything_the_same) is False
    assert ch01.check_worker_init_fn(ignores_the_seed) is False
    assert "seed is ignored" in capsys.readouterr().out
    assert ch01.check_worker_init_fn(data.reseed_worker) is True


def test_missing_or_bad_dataset_paths_give_clear_errors(tmp_path):
    import os

    import pytest

    with pytest.raises(FileNotFoundError, match="CIFAR-10 is not in .*download=True"):
        data.cifar10(tmp_path / "nowhere")
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="is a file"):
        data.cifar10(a_file)
    (tmp_path / "broken" / "cifar-10-batches-py").mkdir(parents=True)  # present but empty
    with pytest.raises(RuntimeError, match="incomplete or corrupt"):
        data.cifar10(tmp_path / "broken")
    if os.geteuid() != 0:  # root reads everything, so this case needs an ordinary user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        with pytest.raises(PermissionError, match="cannot read"):
            data.cifar10(locked)


def test_ranks_seeded_alike_repeat_worker_seeds_until_the_rank_is_in_the_seed():
    sources = ("torch", "random", "numpy global")
    before = torch.get_rng_state()
    alike = data.first_draws_per_rank(world_size=2, num_workers=2, seed=3)
    assert torch.equal(before, torch.get_rng_state())  # the caller's generator is left alone
    assert sorted(alike) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(alike[(0, w)][s] == alike[(1, w)][s] for w in (0, 1) for s in sources)
    fixed = data.first_draws_per_rank(world_size=3, num_workers=2, seed=3, rank_in_seed=True)
    assert all(len({d[s] for d in fixed.values()}) == 6 for s in sources)
    # A generator stored in the dataset is copied as it is, whatever the seeds.
    assert len({d["numpy Generator in dataset"] for d in fixed.values()}) == 1


def test_torchrun_sets_ranks_but_not_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # even when the parent has it, the probe starts without it
    env = data.torchrun_environment(nproc=2)
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
        ("0", "0", "2", "2"),
        ("1", "1", "2", "2"),
    ]
    assert all(e["CUDA_VISIBLE_DEVICES"] is None and e["MASTER_PORT"] and e["TORCHELASTIC_RUN_ID"] for e in env)
    assert all(e["OMP_NUM_THREADS"] == "1" for e in env)  # unset in the parent: torchrun sets one thread


def test_host_to_device_timing_needs_an_accelerator():
    import pytest

    accelerator = torch.accelerator.current_accelerator(check_available=True)  # a CUDA build without a GPU has none
    if accelerator is None:
        with pytest.raises(ValueError, match="accelerator"):
            data.host_to_device_ms(megabytes=1)
    else:
        ms = data.host_to_device_ms(megabytes=16, repeats=3)
        assert set(ms) == {"pageable", "pinned"} and all(v > 0 for v in ms.values())
        assert ms["pinned"] < ms["pageable"]


def test_source_labels_translate_words_not_module_names(monkeypatch):
    from distcourse.runtime import i18n

    monkeypatch.setattr(i18n, "catalog", lambda code: {"numpy global": "numpy, глобальный"} if code == "ru" else {})
    i18n.use("ru")
    try:
        assert data.source_label("numpy global") == "numpy, глобальный"
        assert data.source_label("torch") == "torch"  # a module's name stays as it is
    finally:
        i18n.use("en")
    assert data.source_label("numpy Generator in dataset") == "numpy Generator in dataset"


def test_without_persistent_workers_every_epoch_replays_the_same_noise():
    first, second = data.noise_by_epoch(epochs=2)
    assert data.same_noise(first, second)  # new workers, each from the dataset's untouched generator
    first, second = data.noise_by_epoch(epochs=2, persistent_workers=True)
    assert not data.same_noise(first, second) and data.duplicated_noise(second)  # epochs differ, workers still alike
    first, second = data.noise_by_epoch(epochs=2, worker_init_fn=data.reseed_worker, seed=0)
    assert not data.same_noise(first, second) and not data.duplicated_noise(second)


def test_workers_are_forked_from_the_kernel_on_linux_only(monkeypatch):
    monkeypatch.setattr(data.sys, "platform", "darwin")  # fork is unsafe on macOS: keep its default, spawn
    assert data._fork_if_possible(2) == {}
    monkeypatch.setattr(data.sys, "platform", "linux")
    assert data._fork_if_possible(2) == {"multiprocessing_context": "fork"}
    assert data._fork_if_possible(0) == {}
