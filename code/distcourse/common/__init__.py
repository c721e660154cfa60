"""Building blocks that several chapters share: models, datasets, the training step, timing."""
