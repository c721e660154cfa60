"""torchvision imports and works next to this machine's torch (see distcourse/runtime/vision_compat.py)."""

import os
import subprocess
import sys


def test_torchvision_models_and_transforms_work():
    code = """
import distcourse, torch, torchvision
from torchvision.transforms import v2
model = torchvision.models.resnet18(num_classes=10)
assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
out = v2.Compose([v2.RandomCrop(32), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)])(image)
assert out.shape == (3, 32, 32) and out.max() <= 1
boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30.0]])
keep = torch.ops.torchvision.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
assert keep.tolist() == [0, 2], keep
print(distcourse.runtime.vision_compat.STATUS)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def _plain_import_works() -> bool:
    """Whether torchvision imports on its own here (its compiled operators match this torch)."""
    return subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0


def test_no_fallback_when_torch_already_has_the_operators():
    """torchvision 0.29 loads its own operators: a second definition would abort the interpreter.

    Where torchvision's own operators load, that is checked as it is; elsewhere it is simulated
    by registering ``torchvision::nms``/``qnms`` before the import, as torchvision's library does.
    Either way the import must succeed and the fallback stay unused.
    """
    simulate = """
import torch
lib = torch.library.Library("torchvision", "DEF")
for op in ("nms", "qnms"):
    lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
lib.impl("nms", lambda b, s, t: torch.arange(len(s)), "CPU")
"""
    code = (
        ("" if _plain_import_works() else simulate)
        + """
import distcourse, torchvision
from distcourse.runtime import vision_compat
assert not vision_compat.fallback_defined(), "the fallback was defined beside existing operators"
print(vision_compat.STATUS)
"""
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "torchvision's own operators loaded"


def test_an_unrelated_import_error_is_not_hidden(tmp_path):
    """Only the missing-operator error triggers the fallback; any other failure propagates."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('something else is broken')\n")
    code = """
import distcourse
try:
    import torchvision
except RuntimeError as exc:
    assert "something else" in str(exc)
    from distcourse.runtime import vision_compat
    assert not vision_compat.fallback_defined()
    print("raised")
"""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "raised"
