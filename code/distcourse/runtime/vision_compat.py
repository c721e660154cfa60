"""Make ``import torchvision`` work when its compiled operators cannot load.

PyPI's torchvision wheels are built against CUDA torch. Next to a CPU-only
torch (this course's CI, some laptops) their compiled extension fails to load,
and ``import torchvision`` then dies with
``RuntimeError: operator torchvision::nms does not exist``, because
torchvision registers shape functions for ``nms``/``qnms`` unconditionally.

The fallback is defined only when that error has actually happened: guessing
from file names is not safe, because a second definition of an operator that
torchvision's own library registers aborts the interpreter (torchvision 0.29
renamed its extension to ``_C_stable``). So :func:`install`, run on
``import distcourse``, only puts a finder in front of ``import torchvision``.
The import runs unchanged; if it fails with a missing ``torchvision::`` operator,
the finder asks torch which operators exist, defines the missing
``torchvision::nms`` and ``torchvision::qnms`` with a small pure-PyTorch CPU
implementation and runs the import once more. Models (``resnet18()``),
``transforms.v2`` and datasets then work; ``torchvision.ops`` and
``torchvision.io`` still report that the C++ operators are missing (the course
uses neither); ``torch.ops.torchvision.nms`` itself works.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import torch

_LIB = None  # the torch.library.Library must stay alive for the ops to exist
STATUS = "not checked"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


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


def operator_exists(name: str) -> bool:
    """Whether torch knows ``torchvision::<name>`` (registered by torchvision's library or by us)."""
    return torch._C._dispatch_has_kernel(f"torchvision::{name}") or _has_schema(name)


def _has_schema(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def define_missing() -> list[str]:
    """Define the fallback operators torch does not know yet; returns their names."""
    global _LIB
    missing = [name for name in _SCHEMAS if not operator_exists(name)]
    if not missing:
        return []
    _LIB = torch.library.Library("torchvision", "FRAGMENT")  # FRAGMENT: other ops may exist already
    impls = {"nms": (_nms, "CPU"), "qnms": (_qnms, "QuantizedCPU")}
    for name in missing:
        _LIB.define(_SCHEMAS[name])
        _LIB.impl(name, *impls[name])
    return missing


def fallback_defined() -> bool:
    """Whether this process runs torchvision with the CPU operators defined here."""
    return _LIB is not None


def _missing_operator(exc: BaseException) -> bool:
    text = str(exc)
    return "torchvision::" in text and "does not exist" in text


class _RetryingLoader(importlib.abc.Loader):
    """torchvision's own loader; after a missing-operator error, defines the fallback and retries once."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        global STATUS
        try:
            self.loader.exec_module(module)
            STATUS = "torchvision's own operators loaded"
        except RuntimeError as exc:
            if not _missing_operator(exc) or not define_missing():
                raise
            STATUS = "torchvision's compiled operators do not match this torch; using CPU nms from distcourse"
            self.loader.exec_module(module)  # submodules that failed were removed; they import again

    def __getattr__(self, name):  # resource readers and the like: the real loader's
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RetryingLoader(spec.loader)
        return spec


def install() -> str:
    """Put the finder in front of ``import torchvision`` (once); returns ``STATUS``."""
    if "torchvision" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return STATUS
    sys.meta_path.insert(0, _Finder())
    return STATUS
