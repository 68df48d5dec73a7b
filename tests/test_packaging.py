"""What a synchronizer host and a Lightning user each import (fresh interpreters)."""

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_synchronizer_and_the_core_import_neither_lightning_nor_transformers():
    out = _python("import sys, lightning_diloco.synchronizer.main, lightning_diloco.cli, lightning_diloco.core.codecs, "
                  "lightning_diloco.launch.run; print(sorted(m for m in ('lightning', 'transformers') if m in sys.modules))")
    assert out == "[]"


ORDERS = {
    "lightning_diloco first": ["import lightning_diloco", "import lightning.pytorch as pl"],
    "lightning first": ["import lightning.pytorch as pl", "import lightning_diloco"],
    # the strategy class's own import is what loads Lightning: the registration hook fires inside it
    "the strategy class first": ["from lightning_diloco import DecoupledDiLoCoStrategy", "import lightning.pytorch as pl"],
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_importing_the_package_registers_the_strategy_in_any_order(order):
    imports = ORDERS[order]
    out = _python("; ".join(imports) + "; from lightning.pytorch.strategies import StrategyRegistry; "
                  "print('decoupled_diloco' in StrategyRegistry, 'decoupled_diloco_spawn' in StrategyRegistry)")
    assert out == "True True"


def test_the_package_ships_its_type_marker_and_exports_the_callbacks():
    out = _python("import lightning_diloco, pathlib; "
                  "print((pathlib.Path(lightning_diloco.__file__).parent / 'py.typed').exists(), "
                  "lightning_diloco.ProgressFile.__name__, lightning_diloco.DiLoCoMonitor.__name__)")
    assert out == "True ProgressFile DiLoCoMonitor"
