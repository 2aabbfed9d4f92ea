"""fedhet: federated learning on non-IID data.

The Python API (``fedhet/api.py``; the CLI is built on it)::

    import fedhet

    result = fedhet.run({"dataset": {"name": "digits"}, "model": {"name": "mlp"}}, algorithm="scaffold", rounds=5)
    print(result.final["test_acc"])

``make_config``, ``run``, ``resume``, ``compare``, ``tune`` (hyper-parameters chosen on validation data),
``report``, ``load_run`` / ``load_runs``, ``RunResult`` and ``records_dataframe`` (several runs' records as one pandas
DataFrame), ``save_partition`` / ``load_partition`` (a config's client index sets to and from a file) are here;
``load_plugins`` loads plug-ins (algorithms, models, datasets, partitioners defined outside fedhet). They are
imported on first use, so ``import fedhet`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fedhet.api import (
        RunResult,
        compare,
        load_partition,
        load_run,
        load_runs,
        make_config,
        records_dataframe,
        report,
        resume,
        run,
        save_partition,
        tune,
    )
    from fedhet.config import Config
    from fedhet.plugins import load as load_plugins

# public name -> (module, attribute)
_API = {
    "Config": ("fedhet.config", "Config"),
    "RunResult": ("fedhet.api", "RunResult"),
    "make_config": ("fedhet.api", "make_config"),
    "run": ("fedhet.api", "run"),
    "resume": ("fedhet.api", "resume"),
    "compare": ("fedhet.api", "compare"),
    "tune": ("fedhet.api", "tune"),
    "report": ("fedhet.api", "report"),
    "load_run": ("fedhet.api", "load_run"),
    "load_runs": ("fedhet.api", "load_runs"),
    "records_dataframe": ("fedhet.api", "records_dataframe"),
    "load_plugins": ("fedhet.plugins", "load"),
    "save_partition": ("fedhet.api", "save_partition"),
    "load_partition": ("fedhet.api", "load_partition"),
}

__all__ = [
    "Config",
    "RunResult",
    "__version__",
    "compare",
    "load_partition",
    "load_plugins",
    "load_run",
    "load_runs",
    "make_config",
    "records_dataframe",
    "report",
    "resume",
    "run",
    "save_partition",
    "tune",
]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'fedhet' has no attribute {name!r}")
    module, attr = _API[name]
    return getattr(importlib.import_module(module), attr)


def __dir__() -> list[str]:
    return sorted(__all__)
