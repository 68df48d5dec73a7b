"""lightning_diloco: Decoupled DiLoCo for PyTorch Lightning."""

__version__ = "0.1.0"
