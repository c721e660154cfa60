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
