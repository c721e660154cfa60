"""Make ``import torchvision`` work when its compiled operators cannot load.

PyPI's torchvision wheels are built against CUDA torch. Next to a CPU-only
torch (this course's CI, some laptops) their ``_C`` extension fails to load,
and ``import torchvision`` then dies with
``RuntimeError: operator torchvision::nms does not exist``, because
torchvision registers shape functions for ``nms``/``qnms`` unconditionally.

:func:`install` runs on ``import distcourse``, before anything imports
torchvision. If torchvision's extension loads, it does nothing. Otherwise it
defines ``torchvision::nms`` and ``torchvision::qnms`` with a small pure-PyTorch
CPU implementation, so that the import succeeds and models (``resnet18()``),
``transforms.v2`` and datasets work. ``torchvision.ops`` and ``torchvision.io``
still report that the C++ operators are missing (the course uses neither);
``torch.ops.torchvision.nms`` itself works.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

_LIB = None  # the torch.library.Library must stay alive for the ops to exist
STATUS = "not checked"


def _nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of kept boxes, highest score first."""
    order = scores.argsort(descending=True)
    x1, y1, x2, y2 = boxes.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    keep = []
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    for i, idx in enumerate(order.tolist()):
        if suppressed[i]:
            continue
        keep.append(idx)
        rest = order[i + 1 :]
        w = (torch.minimum(x2[idx], x2[rest]) - torch.maximum(x1[idx], x1[rest])).clamp(min=0)
        h = (torch.minimum(y2[idx], y2[rest]) - torch.maximum(y1[idx], y1[rest])).clamp(min=0)
        inter = w * h
        iou = inter / (areas[idx] + areas[rest] - inter)
        suppressed[i + 1 :] |= iou > iou_threshold
    return torch.tensor(keep, dtype=torch.long)


def _qnms(boxes, scores, iou_threshold):
    return _nms(boxes.dequantize(), scores.dequantize(), iou_threshold)


def _extension_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return True  # torchvision not installed: nothing to fix
    for lib in pathlib.Path(spec.origin).parent.glob("_C.*"):
        if lib.suffix in (".so", ".pyd", ".dylib"):
            try:
                torch.ops.load_library(str(lib))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def install() -> str:
    """Define the missing operators if needed; returns what was done (also in ``STATUS``)."""
    global _LIB, STATUS
    if _LIB is not None or "torchvision" in sys.modules:
        return STATUS
    if _extension_loads():
        STATUS = "torchvision's own operators loaded"
        return STATUS
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.impl("nms", _nms, "CPU")
    _LIB.impl("qnms", _qnms, "QuantizedCPU")
    STATUS = "torchvision's compiled operators do not match this torch; using CPU nms from distcourse"
    return STATUS
