"""The models the chapters train: one small multilayer perceptron, in a few sizes.

Every chapter needs *a* model, not a particular one: what it demonstrates (gradients
averaged, states sharded, checkpoints resumed) holds for any. One factory keeps them
alike, so a learner who has read it once recognises the model in every chapter.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(
    width: int = 32,
    depth: int = 1,
    *,
    inputs: int = 64,
    outputs: int = 10,
    batchnorm: bool = False,
    dropout: float = 0.0,
    seed: int | None = 0,
) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units (Linear, [BatchNorm1d], ReLU, [Dropout]), then a Linear.

    The defaults classify 8x8 digits: 64 inputs, 10 classes. The same ``seed`` gives the
    same initial weights in any process, and the caller's random state is left alone;
    ``seed=None`` draws the weights from the caller's generator instead (e.g. after a
    ``torch.manual_seed(rank)`` that wants different weights on every rank).
    """
    if seed is None:
        return _layers(width, depth, inputs, outputs, batchnorm, dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _layers(width, depth, inputs, outputs, batchnorm, dropout)


def _layers(width, depth, inputs, outputs, batchnorm, dropout) -> nn.Sequential:
    layers, size = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width)] + ([nn.BatchNorm1d(width)] if batchnorm else []) + [nn.ReLU()]
        layers += [nn.Dropout(dropout)] if dropout else []
        size = width
    return nn.Sequential(*layers, nn.Linear(size, outputs))
