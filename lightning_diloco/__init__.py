"""lightning_diloco: Decoupled DiLoCo for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="decoupled_diloco")`` (and
``"decoupled_diloco_spawn"``) with Lightning.
"""

__version__ = "0.1.0"

from lightning_diloco.learner.monitor import DiLoCoMonitor  # noqa: E402
from lightning_diloco.learner.strategy import DecoupledDiLoCoStrategy, register  # noqa: E402

register()

__all__ = ["DecoupledDiLoCoStrategy", "DiLoCoMonitor", "__version__"]
