"""User-facing errors: each carries a one-line message that names the problem and, where useful, the valid choices."""

from __future__ import annotations


class FedhetError(Exception):
    """Base class of errors that the CLI prints as one line instead of a traceback."""


class ConfigError(FedhetError, ValueError):
    """A configuration value, key or name is wrong."""


class RunFailed(FedhetError):
    """A run that cannot go on (non-finite model, no client left); summary.json says why, the last checkpoint stays."""


class CorruptFile(FedhetError, ValueError):
    """A run-folder file (JSON document, metrics log) that cannot be read or parsed; the message names it."""


class DiskFull(RunFailed):
    """A file of the run could not be written (no space, quota): the run stops at its last checkpoint, which stays
    complete; the message names the file, the last checkpointed round and that ``fedhet resume`` continues."""


class Interrupted(FedhetError):
    """Ctrl-C: training stopped, the last checkpoints are kept; the message says how to continue."""


def unknown_choice(kind: str, name: str, choices) -> ConfigError:
    """The standard 'unknown X' error, listing the valid names."""
    return ConfigError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(choices))}")
