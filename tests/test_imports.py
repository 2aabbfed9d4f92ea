"""Every fedhet module imports on its own: no import cycles hidden by the order the package usually loads in."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import importlib, pkgutil, sys
import torch  # loaded once; only fedhet's modules are re-imported from scratch
import fedhet
names = [m.name for m in pkgutil.walk_packages(fedhet.__path__, "fedhet.")]
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "fedhet" or m.startswith("fedhet.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] == "fedhet":  # an optional extra (flwr) that is not installed is fine
            failed.append(f"{name}: {err}")
    except Exception as err:
        failed.append(f"{name}: {type(err).__name__}: {err}")
print(len(names))
print("\\n".join(failed))
"""


def test_every_module_imports_first():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    count, *failed = out.strip().splitlines()
    assert int(count) > 30
    assert failed == [], "\n".join(failed)
