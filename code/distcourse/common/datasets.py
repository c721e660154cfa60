"""Real data without a download: scikit-learn's handwritten digits, as tensors.

1797 grey-scale images of 8x8 pixels ship inside scikit-learn, so every chapter runs
offline. Pixels are scaled from 0..16 to 0..1; labels are the digits 0-9.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _load() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # imported on first use: ranks that get tensors never need it

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All the digits: images flattened to 64 values, and labels. The caller may change them."""
    images, labels = _load()
    return images.clone(), labels.clone()


def digits_batch(size: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` digits drawn at random without replacement; the same ``seed``, the same batch."""
    images, labels = _load()
    pick = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:size]
    return images[pick], labels[pick]
