"""fedhet: federated learning on non-IID data."""

__version__ = "0.1.0"
