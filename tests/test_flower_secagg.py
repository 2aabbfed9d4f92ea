"""SecAgg+ over Flower (fedhet.flower.secagg), in one process through Flower's wire encoding (``LoopbackGrid``).

The server must get the same model as the plain FedAvg run up to SecAgg+'s quantisation, and must never receive a
client's model: every reply a node sends during the protocol holds no array at all (the masked vector travels as
bytes that are uniform modulo 2**32 without the other nodes' masks).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")

from fedhet.engine.checkpoint import read_checkpoint  # noqa: E402
from fedhet.engine.training import build_federation  # noqa: E402
from fedhet.errors import ConfigError  # noqa: E402
from fedhet.flower.app import RUN_CONFIG, RunOptions, run_server, secure_settings  # noqa: E402
from fedhet.flower.client import make_client_app  # noqa: E402
from fedhet.flower.loopback import LoopbackGrid  # noqa: E402
from fedhet.flower.secagg import SecAggSettings  # noqa: E402

ONE_EACH = {10 + c: {"partition-id": c} for c in range(3)}  # SecAgg+'s participants are nodes: one client each


def make_cfg(tiny_config, name: str, rounds: int = 1, **sections):
    return tiny_config(
        run={"rounds": rounds, "name": name, "eval_every": 1},
        partition={"num_clients": 3},
        train={"participation": 1.0},
        **sections,
    )


class Watched(LoopbackGrid):
    """A LoopbackGrid that keeps every reply the server pulls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pulled = []

    def pull_messages(self, message_ids):
        out = super().pull_messages(message_ids)
        self.pulled.extend(out)
        return out


def run(cfg, secure: SecAggSettings | None, nodes=ONE_EACH):
    grid = Watched(make_client_app(lambda _: cfg), nodes)
    summary = run_server(grid, cfg, RunOptions(secure_aggregation=secure))
    last = Path(cfg.run.out_dir) / cfg.run.name / "checkpoints" / "last.pt"
    return summary, grid, read_checkpoint(last)["algo"]["global_params"]


def test_fedavg_with_secaggplus_is_fedavg_up_to_quantisation_and_the_server_sees_no_model(tiny_config):
    settings = SecAggSettings()
    _, plain_grid, plain = run(make_cfg(tiny_config, "plain"), None)
    summary, grid, secure = run(make_cfg(tiny_config, "secure"), settings)
    assert summary["status"] == "finished"

    # One round, so both runs start from the same model and the clients train identically: the only difference
    # is SecAgg+'s quantisation. Its bound: 3 nodes, weights n_k / max n_k.
    train_replies = [r for r in plain_grid.pulled if r.metadata.message_type == "train"]
    sizes = [int(r.content["fedhet.metrics"]["num-examples"]) for r in train_replies]
    largest = max(float(abs(r.content["fedhet.tensors"]["params"].numpy()).max()) for r in train_replies)
    bound = settings.error_bound(3, sum(sizes) / max(sizes), largest)  # about 6e-6 here
    assert 0 < (secure - plain).abs().max() <= bound < 1e-4

    # The server never held a client's model: no reply during the protocol carries an array, while the plain
    # run's replies carried each client's whole model.
    secure_replies = [r for r in grid.pulled if r.metadata.message_type == "train"]
    assert len(secure_replies) == 4 * 3  # four stages, three nodes, no errors
    assert all(not r.has_error() for r in secure_replies)
    assert all(len(a) == 0 for r in secure_replies for a in r.content.array_records.values())
    assert all(r.content["fedhet.tensors"]["params"].numpy().size == plain.numel() for r in train_replies)


def test_secaggplus_runs_round_after_round(tiny_config):
    summary, _, params = run(make_cfg(tiny_config, "rounds", rounds=3), SecAggSettings())
    assert summary["status"] == "finished" and torch.isfinite(params).all()


@pytest.mark.parametrize(
    ("sections", "nodes", "why"),
    [
        ({"algorithm": {"name": "scaffold"}}, ONE_EACH, "not a plain weighted sum"),
        ({"algorithm": {"name": "fedavg", "weighting": "uniform"}}, ONE_EACH, "sample counts"),
        ({"server": {"name": "sgd", "aggregation": "gne"}}, ONE_EACH, "needs each client's update"),
        ({"algorithm": {"name": "fedrane_wo_lra"}}, ONE_EACH, "aggregates with GNE"),  # GNE wired in by the method
        (
            {"model": {"name": "mlp", "hidden": [32], "lora_rank": 2}, "server": {"lora_aggregation": "flexlora"}},
            ONE_EACH,
            "multiplies each client's adapters",
        ),
        ({}, {1: {"partition-ids": "0-1"}, 2: {"partition-id": 2}}, "each SuperNode must hold one client"),
    ],
)
def test_runs_that_need_more_than_the_sum_are_refused(tiny_config, sections, nodes, why):
    with pytest.raises(ConfigError, match=why):
        run(make_cfg(tiny_config, "refused", **sections), SecAggSettings(), nodes)


def test_run_config_keys_and_flowers_own_parameter_checks(tiny_config):
    assert secure_settings(RUN_CONFIG) is None
    got = secure_settings({**RUN_CONFIG, "secure-aggregation": "secaggplus", "secagg-num-shares": 5})
    assert got == SecAggSettings(num_shares=5.0)
    with pytest.raises(ConfigError, match="choose 'secaggplus'"):
        secure_settings({**RUN_CONFIG, "secure-aggregation": "secagg"})
    with pytest.raises(ConfigError, match="reconstruction_threshold"):  # Flower: threshold below num_shares
        run(make_cfg(tiny_config, "bad"), SecAggSettings(num_shares=3, threshold=3))


def test_a_client_that_fails_mid_protocol_is_unmasked_by_the_others(tiny_config, monkeypatch):
    """Client 2 raises while training (after the key exchange): SecAgg+ removes its masks with the other nodes'
    shares, and the model is FedAvg of clients 0 and 1, as in the plain run that drops client 2 too."""
    from fedhet.engine.client import ClientRunner

    honest = ClientRunner.run

    def flaky(self, cid, *args, **kwargs):
        if cid == 2:
            raise RuntimeError("client 2 lost its disk")
        return honest(self, cid, *args, **kwargs)

    monkeypatch.setattr(ClientRunner, "run", flaky)
    settings = SecAggSettings()
    _, plain_grid, plain = run(make_cfg(tiny_config, "plain"), None)
    _, grid, secure = run(make_cfg(tiny_config, "secure"), settings)
    train_replies = [r for r in plain_grid.pulled if r.metadata.message_type == "train" and not r.has_error()]
    sizes = [int(r.content["fedhet.metrics"]["num-examples"]) for r in train_replies]
    assert len(sizes) == 2
    largest = max(float(abs(r.content["fedhet.tensors"]["params"].numpy()).max()) for r in train_replies)
    max_weight = max(len(c.y) for c in build_federation(make_cfg(tiny_config, "x")).clients)
    bound = settings.error_bound(2, sum(sizes) / max_weight, largest)
    assert 0 < (secure - plain).abs().max() <= bound
    failures = (Path(tiny_config().run.out_dir) / "secure" / "failures.jsonl").read_text()
    assert "client 2 lost its disk" in failures
