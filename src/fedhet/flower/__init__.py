"""fedhet on Flower (flwr 1.41, message API): the same algorithm objects on Flower's deployment runtime
(SuperLink + SuperNodes) and on Flower's Ray simulation.

* ``app``: ``make_server_app`` / ``make_client_app`` for any fedhet config; run options from Flower's run config
* ``server``: ``FlowerExecutor`` (the engine's round loop over a Flower Grid) and node discovery
* ``client``: the ClientApp handlers (a node's clients, their data, ``Context.state`` for client-held state)
* ``codec``: fedhet Message / Reply / client state <-> ArrayRecord, ConfigRecord, MetricRecord
* ``bundle``: an app folder for ``flwr run`` (``fedhet flower app``)
* ``raysim``: Flower's Ray simulation (``fedhet flower simulate``)
* ``data``: per-client ``.npz`` files for SuperNodes with their own data (``fedhet flower export``)
* ``loopback``: an in-process Grid for tests and debugging

Nothing here is algorithm-specific. Importing this package does not import flwr; its modules do.
"""
