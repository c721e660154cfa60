"""torchvision imports and works next to this machine's torch (see distcourse/vision_compat.py)."""

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
