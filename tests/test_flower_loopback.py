"""fedhet's ServerApp and ClientApp through Flower's message types, in one process (``LoopbackGrid``).

Every message, reply and node state crosses Flower's wire encoding, so these tests check the whole Flower path for
every registered algorithm in seconds: the metrics must equal the in-process simulation's exactly.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, MetricRecord, RecordDict  # noqa: E402

from fedhet.algorithms import ALGORITHMS, Message, Reply  # noqa: E402
from fedhet.config import tomllib  # noqa: E402
from fedhet.engine.checkpoint import read_checkpoint  # noqa: E402
from fedhet.engine.client import ClientRunner  # noqa: E402
from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.flower import codec  # noqa: E402
from fedhet.flower.app import RunOptions, folder_client_app, folder_server_app, run_server  # noqa: E402
from fedhet.flower.bundle import write_app  # noqa: E402
from fedhet.flower.client import make_client_app  # noqa: E402
from fedhet.flower.data import export_clients  # noqa: E402
from fedhet.flower.loopback import LoopbackGrid, over_the_wire  # noqa: E402
from fedhet.flower.server import NodeError  # noqa: E402

TWO_NODES = {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}}  # two clients on each node


def make_cfg(tiny_config, name: str, algorithm: str = "fedavg", train: dict | None = None, **run):
    return tiny_config(
        run={"rounds": 2, "name": name, **run},
        partition={"num_clients": 4, "local_test_fraction": 0.2},  # local splits: personalised metrics too
        algorithm={"name": algorithm},
        train=train or {},
    )


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def final_params(run_dir) -> torch.Tensor:
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["algo"]["global_params"]


def run_flower(cfg, node_configs=TWO_NODES, **options):
    grid = LoopbackGrid(make_client_app(lambda _: cfg), node_configs)
    return run_server(grid, cfg, RunOptions(**options))


def in_process(cfg):
    sim = Simulation(cfg)
    return sim.run(), sim.run_dir


# --------------------------------------------------------------------------------------------------- codec
def test_message_reply_and_state_survive_the_wire_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    msg = Message(
        tensors={"params": torch.randn(50, generator=g), "counts": torch.arange(4), "empty": torch.zeros(0)},
        scalars={"round": 3, "lr": 0.1 / 3, "name": "x", "flag": True},
    )
    content = over_the_wire(codec.encode_message(msg, {"cid": 7, "phase": "train"}))
    back, meta = codec.decode_message(content)
    assert meta == {"cid": 7, "phase": "train"}
    assert back.scalars == msg.scalars
    assert [type(v) for v in back.scalars.values()] == [int, float, str, bool]
    for name, t in msg.tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t)

    reply = Reply(tensors={"delta": torch.randn(5, generator=g)}, scalars={"k": 2}, num_examples=31, metrics={"a": 1.5})
    got = codec.decode_reply(over_the_wire(codec.encode_reply(reply)))
    assert got.num_examples == 31 and got.metrics == {"a": 1.5} and got.scalars == {"k": 2}
    assert torch.equal(got.tensors["delta"], reply.tensors["delta"])

    store = RecordDict()
    codec.save_state(store, 3, {"c_i": torch.randn(6, generator=g)})
    store = over_the_wire(store)
    assert set(codec.load_state(store, 3)) == {"c_i"} and codec.load_state(store, 4) == {}
    codec.save_state(store, 3, {})  # an algorithm that clears its state leaves nothing behind
    assert codec.load_state(store, 3) == {}


# ---------------------------------------------------------------------------- every algorithm, exactly as in-process
@pytest.mark.parametrize("algorithm", [e.name for e in ALGORITHMS.entries()])
def test_every_algorithm_on_flower_matches_the_simulation(tiny_config, algorithm):
    if ALGORITHMS.get(algorithm).obj.pools_clients:
        pytest.skip(f"{algorithm} pools every client's data in one process: simulation only (test_centralized.py)")
    try:
        _, local_dir = in_process(make_cfg(tiny_config, "local", algorithm))
    except Exception as err:  # equivalence cannot be checked for an algorithm that fails on its own
        pytest.skip(f"{algorithm} fails in the in-process simulation: {type(err).__name__}: {err}")
    summary = run_flower(make_cfg(tiny_config, "flower", algorithm))
    flower_dir = local_dir.parent / "flower"
    assert summary["status"] == "finished"
    assert records(flower_dir) == records(local_dir)
    assert torch.equal(final_params(flower_dir), final_params(local_dir))


def test_personalised_validation_scores_cross_the_wire_like_the_simulations(tiny_config):
    def cfg(name):
        return tiny_config(
            run={"rounds": 2, "name": name},
            partition={"num_clients": 4, "local_test_fraction": 0.2, "validation_fraction": 0.2},
            algorithm={"name": "fedrod"},
        )

    _, local_dir = in_process(cfg("local"))
    run_flower(cfg("flower"))
    got, want = records(local_dir.parent / "flower"), records(local_dir)
    assert got == want and "val_personal_acc_micro" in want[-1] and "personal_acc_micro" in want[-1]


def test_nodes_with_their_own_data_files_train_like_the_simulation(tiny_config, tmp_path):
    """data-path nodes: the same training (same global model and test accuracy); per-client metrics are the
    distribution-weighted ones since the server never sees a client's local test split. With augmentation, so the
    files must also carry the border fill (a black pixel in normalised space)."""
    augment = {"augment": "crop_flip_rotate"}
    cfg = make_cfg(tiny_config, "files", "scaffold", augment)
    paths = export_clients(cfg, tmp_path / "clients")
    nodes = {10 + cid: {"partition-id": cid, "data-path": str(p)} for cid, p in enumerate(paths)}
    run_flower(cfg, nodes)
    _, local_dir = in_process(make_cfg(tiny_config, "local", "scaffold", augment))
    got, want = records(local_dir.parent / "files"), records(local_dir)
    for g, w in zip(got, want, strict=True):
        assert (g["test_acc"], g["test_loss"], g["train_loss"], g["c_norm"]) == (
            w["test_acc"],
            w["test_loss"],
            w["train_loss"],
            w["c_norm"],
        )
        assert g["client_dist_acc"] == pytest.approx(w["client_dist_acc"])  # label counts reported by the nodes
    assert torch.equal(final_params(local_dir.parent / "files"), final_params(local_dir))


def test_nodes_with_their_own_files_score_feature_skew_domains_like_the_simulation(tiny_config, tmp_path):
    """Rotated domains: the exported files hold each client's rotated data, and the server, which reads only the
    dataset's test set, scores one rotated copy per domain, as the simulation does."""

    def cfg(name):
        return tiny_config(
            run={"rounds": 2, "name": name},
            partition={"num_clients": 4, "local_test_fraction": 0.2},
            features={"name": "rotation", "domains": 2},
        )

    paths = export_clients(cfg("files"), tmp_path / "clients")
    run_flower(cfg("files"), {10 + cid: {"partition-id": cid, "data-path": str(p)} for cid, p in enumerate(paths)})
    _, local_dir = in_process(cfg("local"))
    got, want = records(local_dir.parent / "files"), records(local_dir)
    keys = ("test_acc", "test_loss", "test_acc/domain/0", "test_acc/domain/1", "test_acc/domain/worst")
    assert [tuple(g[k] for k in keys) for g in got] == [tuple(w[k] for k in keys) for w in want]
    assert torch.equal(final_params(local_dir.parent / "files"), final_params(local_dir))


def test_a_failing_client_is_dropped_and_keeps_its_state_as_in_the_simulation(tiny_config, monkeypatch):
    run = ClientRunner.run

    def flaky(self, cid, rnd, *args):
        if (cid, rnd) in {(0, 1), (1, 2)}:
            raise RuntimeError("disk full")
        return run(self, cid, rnd, *args)

    monkeypatch.setattr(ClientRunner, "run", flaky)

    def cfg(name):
        return tiny_config(
            run={"rounds": 2, "name": name},
            partition={"num_clients": 4},
            train={"participation": 1.0},
            algorithm={"name": "scaffold"},
        )

    _, local_dir = in_process(cfg("local"))
    run_flower(cfg("flower"))
    flower_dir = local_dir.parent / "flower"
    assert [r["dropped"] for r in records(flower_dir)] == [1, 1]
    assert records(flower_dir) == records(local_dir)
    failures = [json.loads(line) for line in (flower_dir / "failures.jsonl").read_text().splitlines()]
    assert [(f["round"], f["client"]) for f in failures] == [(1, 0), (2, 1)]
    assert "RuntimeError: disk full" in failures[0]["error"]


def test_missing_partitions_fail_with_a_clear_message(tiny_config):
    cfg = make_cfg(tiny_config, "missing")
    with pytest.raises(NodeError, match=r"no connected SuperNode holds clients \[2, 3\]"):
        run_flower(cfg, {1: {"partition-ids": "0,1"}}, node_wait=0.2)


def test_a_node_with_a_wrong_config_is_reported(tiny_config):
    cfg = make_cfg(tiny_config, "wrong")
    with pytest.raises(NodeError, match="num-partitions=5 but the run's config has partition.num_clients=4"):
        run_flower(cfg, {1: {"partition-id": 0, "num-partitions": 5}}, node_wait=0.2)


# ------------------------------------------------------------------------------------ app folder for `flwr run`
def test_app_folder_is_a_valid_flower_app_and_runs_with_run_config_overrides(tiny_config, tmp_path):
    from flwr.common.config import validate_config

    cfg = make_cfg(tiny_config, "bundle", "moon")
    app = write_app(cfg, tmp_path / "my-app")
    project = tomllib.loads((app / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(project, check_module=True, project_dir=app)
    assert ok, errors
    assert project["project"]["name"] == "my-app"

    overrides = {"overrides": "run.rounds=1 run.name='bundle-1' algorithm.mu=0.5", "overwrite": True}
    grid = LoopbackGrid(folder_client_app(app), TWO_NODES, run_config=overrides)
    folder_server_app(app)(grid=grid, context=Context(1, 0, {}, RecordDict(), overrides))
    run_dir = tmp_path / "runs" / "bundle-1"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algorithm"]["mu"] == 0.5 and config["run"]["rounds"] == 1
    assert [r["round"] for r in records(run_dir)] == [1]


def test_records_have_flower_conventions():
    content = codec.encode_reply(Reply(num_examples=12, metrics={"train_loss": 0.5}))
    assert isinstance(content[codec.METRICS], MetricRecord) and content[codec.METRICS]["num-examples"] == 12
    assert isinstance(codec.encode_message(Message(), {"cid": 1})[codec.META], ConfigRecord)


def test_under_flwr_run_a_run_folder_in_use_is_one_logged_line_in_run_config_terms(tiny_config, tmp_path, caplog):
    from fedhet.flower.app import AppFailed

    app = write_app(make_cfg(tiny_config, "taken"), tmp_path / "app")
    grid = LoopbackGrid(folder_client_app(app), TWO_NODES)
    folder_server_app(app)(grid=grid, context=Context(1, 0, {}, RecordDict(), {}))
    grid = LoopbackGrid(folder_client_app(app), TWO_NODES)
    with pytest.raises(AppFailed) as caught:
        folder_server_app(app)(grid=grid, context=Context(2, 0, {}, RecordDict(), {}))
    assert caught.value.__cause__ is None and caught.value.__context__ is None or caught.value.__suppress_context__
    message = str(caught.value)
    assert "already holds a run; pass --run-config 'resume=true' to continue it" in message
    assert "--run-config 'overwrite=true' to replace it" in message and "--resume " not in message
    assert any(r.getMessage() == f"fedhet: {message}" for r in caplog.records)


# -------------------------------------------------------------------------------------------- stopped by the caller
def test_a_stopped_run_ends_its_server_thread_while_the_nodes_are_silent(tiny_config):
    """Flower's simulation runs the ServerApp in a thread that is not a daemon; after Ctrl-C its nodes are gone.
    Setting ``RunOptions.stop`` ends that thread at once (it polled for replies forever, so the process never
    exited)."""
    import threading

    from fedhet.flower.server import Stopped

    class GoneQuiet(LoopbackGrid):
        """Answers the server's node query, then never replies again (the runtime has shut down)."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.training = threading.Event()

        def push_messages(self, messages):
            messages = list(messages)
            if messages[0].metadata.message_type == "query":
                return super().push_messages(messages)
            for msg in messages:
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.training.set()
            return [msg.metadata.message_id for msg in messages]

    cfg = make_cfg(tiny_config, "stopped")
    grid, stop, raised = GoneQuiet(make_client_app(lambda _: cfg), TWO_NODES), threading.Event(), []

    def server() -> None:
        try:
            run_server(grid, cfg, RunOptions(stop=stop))
        except Exception as err:  # noqa: BLE001  (what ends the thread is the assertion)
            raised.append(err)

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    assert grid.training.wait(60), raised
    time.sleep(0.3)  # the server is polling for replies
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Stopped), raised
