"""The machinery a learner never needs to read: starting ranks, hardware, language, torchvision."""
