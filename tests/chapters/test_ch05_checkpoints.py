"""The chapter 05 helpers behave as the chapter says, and its self-check can fail."""

import os
import pickle
import random
import tempfile

import numpy as np
import pytest
import torch

import distcourse
from distcourse import checkpoints, distributed_checkpoints
from distcourse.common import checkpoint_files
from distcourse.exercises import ch05


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


# --- files: atomic save, clear errors ------------------------------------------------------


def test_atomic_save_round_trip_leaves_only_the_file(tmp):
    path = tmp / "ckpt.pt"
    checkpoint_files.atomic_save({"step": 3, "w": torch.arange(4.0)}, path)
    loaded = checkpoint_files.load_checkpoint(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.arange(4.0))
    assert [p.name for p in tmp.iterdir()] == ["ckpt.pt"]


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("boom while saving")


def test_failed_atomic_save_keeps_the_previous_checkpoint_and_cleans_up(tmp):
    path = tmp / "ckpt.pt"
    checkpoint_files.atomic_save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="boom"):
        checkpoint_files.atomic_save({"step": 2, "bad": _Unpicklable()}, path)
    assert checkpoint_files.load_checkpoint(path)["step"] == 1
    assert checkpoint_files.stale_temp_files(tmp) == []


def test_failed_plain_torch_save_destroys_the_previous_checkpoint(tmp):
    # The contrast the chapter draws: torch.save(obj, path) truncates path first.
    path = tmp / "ckpt.pt"
    torch.save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="boom"):
        torch.save({"step": 2, "bad": _Unpicklable()}, path)
    with pytest.raises(checkpoint_files.CorruptCheckpointError):
        checkpoint_files.load_checkpoint(path)


def test_missing_checkpoint_is_a_clear_file_not_found_error(tmp):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nothing\.pt; the directory holds \[\]"):
        checkpoint_files.load_checkpoint(tmp / "nothing.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_files.load_checkpoint(tmp / "no-such-dir" / "x.pt")


@pytest.mark.parametrize("cut", [0, 10, 1000, "half", -10])
def test_truncated_checkpoint_is_named_corrupt_or_truncated(tmp, cut):
    path = tmp / "ckpt.pt"
    checkpoint_files.atomic_save({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    cut = len(data) // 2 if cut == "half" else cut
    path.write_bytes(data[:cut])
    with pytest.raises(checkpoint_files.CorruptCheckpointError, match="corrupt or truncated") as info:
        checkpoint_files.load_checkpoint(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
    # One message, not a chain of torch/zip internals ("During handling ... another exception").
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)


def test_garbage_and_damaged_archives_are_corrupt(tmp):
    garbage = tmp / "garbage.pt"
    garbage.write_bytes(os.urandom(2000))
    with pytest.raises(checkpoint_files.CorruptCheckpointError, match="garbage.pt"):
        checkpoint_files.load_checkpoint(garbage)
    # A complete zip archive without torch's data.pkl record: corrupt, with torch's reason.
    hollow = tmp / "hollow.pt"
    torch.save({"w": torch.ones(2)}, hollow)
    import zipfile

    with zipfile.ZipFile(hollow) as z:
        kept = [(i, z.read(i)) for i in z.infolist() if not i.filename.endswith("data.pkl")]
    with zipfile.ZipFile(hollow, "w") as z:
        for info, payload in kept:
            z.writestr(info, payload)
    with pytest.raises(checkpoint_files.CorruptCheckpointError, match="corrupt .*data.pkl"):
        checkpoint_files.load_checkpoint(hollow)


def test_weights_only_refuses_code_and_runs_nothing(tmp):
    path, marker = tmp / "evil.pt", tmp / "marker.txt"
    torch.save({"w": torch.ones(2), "extra": checkpoints.RunsCodeWhenLoaded(marker)}, path)
    assert "distcourse.checkpoints.leave_marker" in torch.serialization.get_unsafe_globals_in_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError, match="leave_marker"):
        checkpoint_files.load_checkpoint(path)  # passes the refusal through, not as "corrupt"
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not marker.exists()


def test_rng_state_survives_a_weights_only_round_trip(tmp):
    checkpoint_files.seed_everything(5)
    state = checkpoint_files.rng_state()
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    checkpoint_files.atomic_save({"rng": state}, tmp / "rng.pt")
    checkpoint_files.seed_everything(99)
    checkpoint_files.set_rng_state(checkpoint_files.load_checkpoint(tmp / "rng.pt")["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]


def test_latest_checkpoint_ignores_temporary_files(tmp):
    assert checkpoint_files.latest_checkpoint(tmp) is None
    for step in (5, 10, 100):
        checkpoint_files.atomic_save({"step": step}, checkpoint_files.checkpoint_path(tmp, step))
    (tmp / ".step-0200.pt.123.tmp").write_bytes(b"partial")
    assert checkpoint_files.latest_checkpoint(tmp).name == "step-0100.pt"
    assert [p.name for p in checkpoint_files.stale_temp_files(tmp)] == [".step-0200.pt.123.tmp"]


def test_saved_locations_reads_device_tags_without_moving_anything(tmp):
    torch.save({"w": torch.ones(2)}, tmp / "cpu.pt")
    assert checkpoint_files.saved_locations(tmp / "cpu.pt") == {"cpu"}


def test_dcp_planner_refuses_code_in_non_tensor_entries(tmp):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp / "marker.txt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to ... a single process"
        dcp.save(
            {"w": torch.ones(2), "lr": 0.5, "note": checkpoints.RunsCodeWhenLoaded(marker)},
            checkpoint_id=tmp / "ckpt",
            no_dist=True,
        )
        plain = {"w": torch.zeros(2), "lr": 0.0}
        dcp.load(
            plain, checkpoint_id=tmp / "ckpt", planner=distributed_checkpoints.weights_only_planner(), no_dist=True
        )
        assert plain["lr"] == 0.5 and torch.equal(plain["w"], torch.ones(2))  # plain entries load
        with pytest.raises(CheckpointException, match="leave_marker"):  # (a BaseException)
            dcp.load(
                {"note": None},
                checkpoint_id=tmp / "ckpt",
                planner=distributed_checkpoints.weights_only_planner(),
                no_dist=True,
            )
    assert not marker.exists()


# --- real ranks ------------------------------------------------------------------------------


@pytest.mark.slow
def test_crash_mid_write_atomic_vs_in_place(tmp, no_leftovers):
    atomic, naive = tmp / "atomic.pt", tmp / "naive.pt"
    for path in (atomic, naive):
        checkpoint_files.atomic_save({"step": 1}, path)
    for path, is_atomic in ((atomic, True), (naive, False)):
        with pytest.raises(distcourse.RankFailed, match="SIGKILL"):
            distcourse.launch(
                checkpoints.save_and_die,
                1,
                args=(path, is_atomic),
                kwargs={"megabytes": 2, "die_after": 2**20},
                init_process_group=False,
                quiet=True,
            )
    assert checkpoint_files.load_checkpoint(atomic)["step"] == 1
    assert [p.stat().st_size for p in checkpoint_files.stale_temp_files(tmp)] == [2**20]
    assert naive.stat().st_size == 2**20
    with pytest.raises(checkpoint_files.CorruptCheckpointError, match="truncated"):
        checkpoint_files.load_checkpoint(naive)


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp, no_leftovers):
    data = checkpoints.digits()
    (tmp / "A").mkdir(), (tmp / "B").mkdir()
    kwargs = {"steps": 12, "every": 4}
    a = distcourse.launch(checkpoints.train_run, 2, args=(data, tmp / "A"), kwargs=kwargs, quiet=True)
    with pytest.raises(distcourse.RankFailed) as info:
        distcourse.launch(
            checkpoints.train_run, 2, args=(data, tmp / "B"), kwargs={**kwargs, "crash_at": (1, 6)}, quiet=True
        )
    assert info.value.rank == 1
    b = checkpoints.read_losses(tmp / "B" / "losses.jsonl")
    assert checkpoint_files.latest_checkpoint(tmp / "B").name == "step-0004.pt"
    c = distcourse.launch(
        checkpoints.train_run, 2, args=(data, tmp / "B"), kwargs={**kwargs, "resume": True}, quiet=True
    )
    assert min(c[0]["losses"]) == 4
    resumed = {**{s: v for s, v in b.items() if s < 4}, **c[0]["losses"]}
    # the same kernels on the same data in the same order (CPU, gloo): bit for bit
    assert resumed == a[0]["losses"]
    assert all(torch.equal(a[0]["weights"][k], c[1]["weights"][k]) for k in a[0]["weights"])


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.slow
def test_dcp_checkpoint_of_2_ranks_loads_on_1_and_on_3(tmp, no_leftovers):
    saved = distcourse.launch(distributed_checkpoints.dcp_save_sharded, 2, args=(tmp,), quiet=True)
    assert sorted(p.name for p in tmp.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [r["local_shapes"]["0.weight"] for r in saved] == [(64, 64), (64, 64)]
    model = checkpoints.make_model()
    single = distributed_checkpoints.dcp_load_single_process(model, torch.optim.Adam(model.parameters()), tmp)
    assert _equal(single, {"model": saved[0]["model"], "optimizer": saved[0]["optimizer"]})
    three = distcourse.launch(distributed_checkpoints.dcp_load_resharded, 3, args=(tmp,), quiet=True)
    assert [r["local_shapes"]["0.weight"][0] for r in three] == [43, 43, 42]
    assert all(_equal(r["model"], saved[0]["model"]) and _equal(r["optimizer"], saved[0]["optimizer"]) for r in three)


# --- the exercise's self-check -----------------------------------------------------------------


def naive_save(obj, path):
    torch.save(obj, path)


def no_fsync(obj, path):
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def elsewhere(obj, path):
    fd, tmp = tempfile.mkstemp(suffix=".pt")  # in /tmp, not next to path
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def no_cleanup(obj, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    assert ch05.check_atomic_save(lambda obj, path: None) is False
    assert "Not yet" in capsys.readouterr().out
    assert ch05.check_atomic_save(naive_save) is False
    assert "destroyed the previous checkpoint" in capsys.readouterr().out
    assert ch05.check_atomic_save(no_fsync) is False
    assert "no os.fsync" in capsys.readouterr().out
    assert ch05.check_atomic_save(elsewhere) is False
    assert "same directory" in capsys.readouterr().out
    assert ch05.check_atomic_save(no_cleanup) is False
    assert "left behind" in capsys.readouterr().out
    assert ch05.check_atomic_save(checkpoint_files.atomic_save) is True
    assert "Correct" in capsys.readouterr().out


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_async_save_with_its_own_group_while_training_goes_on(tmp, no_leftovers):
    runs = distcourse.launch(
        distributed_checkpoints.dcp_async_save_while_training,
        world_size=2,
        args=(tmp / "async",),
        kwargs={"steps": 7, "save_at": (2, 4, 6)},
        quiet=True,
    )
    for r in runs:
        assert [s["step"] for s in r["saves"]] == [2, 4, 6]
        assert all(s["written after"] >= s["returned after"] for s in r["saves"])  # the callback saw the end
        assert all(s["still writing on return"] for s in r["saves"])  # the write waits until this was recorded
        for step in (2, 4, 6):
            assert r["loaded"][step]["step"] == step
            assert _equal(r["loaded"][step], r["expected"][step])  # the state of that step, not a later one
        assert not _equal(r["expected"][2]["model"], r["expected"][4]["model"])
        assert not _equal(r["expected"][6]["model"], r["final"]["model"])  # step 7 ran after the last save
    assert sorted(p.name for p in (tmp / "async").iterdir()) == ["step-2", "step-4", "step-6"]


def test_training_state_is_stateful():
    from torch.distributed.checkpoint.stateful import Stateful

    model = checkpoints.make_model()
    state = distributed_checkpoints.TrainingState(model, torch.optim.Adam(model.parameters(), lr=1e-3), step=5)
    assert isinstance(state, Stateful)
    saved = state.state_dict()
    assert saved["step"] == 5 and set(saved) == {"model", "optimizer", "step"}
    other_model = checkpoints.make_model()
    other = distributed_checkpoints.TrainingState(other_model, torch.optim.Adam(other_model.parameters(), lr=1e-3))
    other.load_state_dict(saved)
    assert other.step == 5 and all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))


def test_resume_with_dataloader_workers_is_exact_only_with_the_resumable_recipe():
    images = checkpoints.digits()[0][:32]
    for resumable in (False, True):
        full, _ = checkpoints.augmented_batches(images, 12, resumable=resumable)
        first_part, state = checkpoints.augmented_batches(images, 12, resumable=resumable, stop=6)
        rest, _ = checkpoints.augmented_batches(images, 12, resumable=resumable, resume=state)
        assert (state["epoch"], state["batch"]) == (1, 2)  # 4 batches per epoch: the stop is mid-epoch 1
        assert all(torch.equal(a, b) for a, b in zip(full[:6], first_part))
        equal = [torch.equal(a, b) for a, b in zip(full[6:], rest)]
        assert len(rest) == 6 and (all(equal) if resumable else not any(equal))
    # The resumable sampler starts at the saved position and carries the epoch with every index.
    sampler = checkpoints.ResumableSampler(range(32), num_replicas=1, rank=0, seed=0)
    sampler.set_position(1, 16)
    pairs = list(sampler)
    assert len(pairs) == len(sampler) == 16 and all(epoch == 1 for epoch, _ in pairs)
    sampler.set_position(1, 0)
    assert [index for _, index in list(sampler)[16:]] == [index for _, index in pairs]
