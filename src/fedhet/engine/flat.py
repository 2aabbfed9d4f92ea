"""Moved to ``fedhet.toolkit.flat`` (the toolkit layer under the algorithms); kept so that plug-ins importing
it still work."""

from fedhet.toolkit.flat import (  # noqa: F401
    FlatModel,
    FlatVectors,
    _flatten_into,
)
