"""Integrations with training frameworks: Ray Train, torchrun, PyTorch Lightning."""
