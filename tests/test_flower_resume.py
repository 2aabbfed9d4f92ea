"""Killing and resuming a fedhet run on Flower (loopback grid): client-held state on the nodes.

A node with a state folder keeps each client's state across Flower runs, versioned by the server's history of
attempts, so a resumed run ends bit-identical to an uninterrupted one (and to the in-process simulation) even when
the killed attempt got further than its last checkpoint. A node without one keeps it in Context.state, which a new
Flower run does not have: the resume is refused unless the loss is accepted, and either way the run folder's
notices.jsonl and the console say what was lost.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")

from flwr.app import RecordDict  # noqa: E402

from fedhet.engine.checkpoint import StateFileError, read_checkpoint  # noqa: E402
from fedhet.engine.client import ClientRunner  # noqa: E402
from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.flower.app import RunOptions, run_server  # noqa: E402
from fedhet.flower.client import make_client_app  # noqa: E402
from fedhet.flower.loopback import LoopbackGrid  # noqa: E402
from fedhet.flower.node_state import Attempt, FolderStore, History  # noqa: E402
from fedhet.flower.server import StateLost  # noqa: E402


class Killed(Exception):
    """The server process dies (here: the grid raises out of the round loop)."""


class KillingGrid(LoopbackGrid):
    """Dies after delivering ``n`` training messages of round ``rnd`` (those nodes have stored the new state)."""

    def __init__(self, client_app, node_configs, kill_at: tuple[int, int]) -> None:
        super().__init__(client_app, node_configs)
        self.kill_at, self.delivered = kill_at, 0

    def deliver(self, msg):
        rnd, n = self.kill_at
        if msg.metadata.message_type == "train" and int(msg.content["fedhet.meta"]["round"]) == rnd:
            if self.delivered == n:
                raise Killed(f"killed in round {rnd} after {n} clients")
            self.delivered += 1
        return super().deliver(msg)


def cfg_for(tiny_config, name: str, algorithm: str = "scaffold", rounds: int = 5, every: int = 2):
    return tiny_config(
        run={"rounds": rounds, "name": name, "checkpoint_every": every},
        partition={"num_clients": 4},
        train={"participation": 1.0},  # every client trains every round: any wrong state version shows
        algorithm={"name": algorithm},
    )


def nodes(state_root=None) -> dict[int, dict]:
    out = {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}}
    if state_root is not None:
        for nid, nc in out.items():
            nc["state-dir"] = str(state_root / f"node{nid}")
    return out


def run_flower(cfg, node_configs, kill_at=None, **options):
    app = make_client_app(lambda _: cfg)
    grid = LoopbackGrid(app, node_configs) if kill_at is None else KillingGrid(app, node_configs, kill_at)
    if kill_at is None:
        return run_server(grid, cfg, RunOptions(**options))
    with pytest.raises(Killed):
        run_server(grid, cfg, RunOptions(**options))
    return None


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def notices(run_dir) -> list[dict]:
    path = run_dir / "notices.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_params(run_dir) -> torch.Tensor:
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["algo"]["global_params"]


def reference(tiny_config, tmp_path, **kw):
    """The uninterrupted Flower run (with state folders) and the in-process run of the same config."""
    flower = cfg_for(tiny_config, "full", **kw)
    run_flower(flower, nodes(tmp_path / "full_nodes"))
    local = cfg_for(tiny_config, "local", **kw)
    Simulation(local).run()
    out = tmp_path / "runs"
    assert records(out / "full") == records(out / "local")
    return records(out / "full"), final_params(out / "full")


def version_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- resumes with node state folders
def test_resume_between_checkpoints_continues_client_state_exactly(tiny_config, tmp_path):
    """Killed in round 4 with the last checkpoint at round 2: every client has a newer (round 3) version on its
    node, two even a round 4 one; the resume must read the round-2 versions."""
    want, want_params = reference(tiny_config, tmp_path)
    cfg = cfg_for(tiny_config, "cut")
    state = tmp_path / "cut_nodes"
    run_flower(cfg, nodes(state), kill_at=(4, 2))
    run_dir = tmp_path / "runs" / "cut"
    assert [r["round"] for r in records(run_dir)] == [1, 2, 3]  # round 3 was logged, then lost with the kill
    stale = [f for f in version_files(state) if "/r00000004-" in f]
    assert len(stale) == 2  # two clients stored round 4 before the kill
    summary = run_flower(cfg, nodes(state), resume=True)
    assert summary["status"] == "finished"
    assert records(run_dir) == want
    assert torch.equal(final_params(run_dir), want_params)
    assert notices(run_dir) == []
    # each client keeps three versions: those of last.pt (round 4) and prev.pt (round 2), and its newest (round 5)
    files = version_files(state)
    assert len(files) == 12 and all(any(f"r0000000{r}" in f for r in (2, 4, 5)) for f in files), files


@pytest.mark.parametrize("algorithm", ["feddyn", "moon", "pfedme", "fedbc"])
def test_every_kind_of_client_state_resumes_exactly(tiny_config, tmp_path, algorithm):
    """FedDyn's gradient state, MOON's previous models, pFedMe's personal model, FedBC's local model."""
    want, want_params = reference(tiny_config, tmp_path, algorithm=algorithm, rounds=4)
    cfg = cfg_for(tiny_config, "cut", algorithm=algorithm, rounds=4)
    run_flower(cfg, nodes(tmp_path / "cut_nodes"), kill_at=(3, 2))
    run_flower(cfg, nodes(tmp_path / "cut_nodes"), resume=True)
    assert records(tmp_path / "runs" / "cut") == want
    assert torch.equal(final_params(tmp_path / "runs" / "cut"), want_params)


def test_three_attempts_read_only_the_versions_of_the_checkpoints_history(tiny_config, tmp_path, monkeypatch):
    """Attempt 1 is killed in round 4 (checkpoint 2) after client 3 trained in round 3. Attempt 2 resumes from 2;
    there client 3 fails in rounds 3 and 4, so its state stays at round 2; attempt 2 checkpoints round 4 and is killed
    in round 5 before reaching client 3. Attempt 3 resumes from 4: client 3 must continue from round 2's version, not
    from attempt 1's round-3 one (newer, and at a round <= 4, but attempt 1 counts only up to round 2 in the history
    of this checkpoint)."""
    run = ClientRunner.run
    flaky = {"on": False}

    def maybe_fail(self, cid, rnd, *args):
        if flaky["on"] and cid == 3 and rnd in (3, 4):
            raise RuntimeError("client 3 is offline")
        return run(self, cid, rnd, *args)

    monkeypatch.setattr(ClientRunner, "run", maybe_fail)
    cfg = cfg_for(tiny_config, "cut", rounds=6)
    state = tmp_path / "cut_nodes"
    run_flower(cfg, nodes(state), kill_at=(4, 1))
    flaky["on"] = True
    run_flower(cfg, nodes(state), kill_at=(5, 2), resume=True)
    run_flower(cfg, nodes(state), resume=True)
    want, want_params = reference(tiny_config, tmp_path, rounds=6)  # client 3 fails in rounds 3 and 4 here too
    run_dir = tmp_path / "runs" / "cut"
    assert [r["dropped"] for r in want] == [0, 0, 1, 1, 0, 0]
    assert records(run_dir) == want
    assert torch.equal(final_params(run_dir), want_params)


def test_a_damaged_state_file_on_a_node_stops_the_run_naming_it(tiny_config, tmp_path):
    """A node's client-state version that fails its seal is the run's problem, as in the simulation: the resume stops
    in one message naming the file, instead of dropping that client from every round."""
    cfg = cfg_for(tiny_config, "damaged")
    state = tmp_path / "nodes"
    run_flower(cfg, nodes(state), kill_at=(4, 2))
    [victim] = state.rglob("client-1/r00000002-*.pt")  # the version the resume from round 2 reads
    victim.write_bytes(victim.read_bytes()[:-16])
    with pytest.raises(StateFileError) as stopped:
        run_flower(cfg, nodes(state), resume=True)
    message = str(stopped.value)
    assert str(victim) in message and "client 1" in message and "node 101" in message, message
    assert "Traceback" not in message and "[" not in message.split(str(victim))[1], message
    summary = json.loads((tmp_path / "runs" / "damaged" / "summary.json").read_text())
    assert summary["status"] == "failed" and str(victim) in summary["error"]
    assert (
        not (tmp_path / "runs" / "damaged" / "failures.jsonl").exists()
        or "client 1" not in (tmp_path / "runs" / "damaged" / "failures.jsonl").read_text()
    )


# -------------------------------------------------------------------------- nodes that keep state in Context.state
def test_resume_without_state_folders_is_refused_with_a_notice(tiny_config, tmp_path, caplog):
    cfg = cfg_for(tiny_config, "volatile")
    run_flower(cfg, nodes(), kill_at=(4, 2))
    run_dir = tmp_path / "runs" / "volatile"
    first = notices(run_dir)
    assert [(n["kind"], n["action"]) for n in first] == [("client_state_not_durable", "continued")]
    with caplog.at_level(logging.WARNING, logger="fedhet.flower"), pytest.raises(StateLost, match="accept-state-loss"):
        run_flower(cfg, nodes(), resume=True)
    lost = notices(run_dir)[-1]
    assert (lost["kind"], lost["action"], lost["round"]) == ("client_state_lost", "refused", 2)
    assert lost["clients"] == [0, 1, 2, 3] and lost["state"] == ["c_i"] and lost["nodes"] == [101, 202]
    assert "c_i" in caplog.text and "no state folder" in caplog.text
    assert [r["round"] for r in records(run_dir)] == [1, 2, 3]  # the refused resume changed nothing

    summary = run_flower(cfg, nodes(), resume=True, accept_state_loss=True)
    assert summary["status"] == "finished"
    kinds = [(n["kind"], n["action"]) for n in notices(run_dir)]
    assert kinds[-2:] == [("client_state_lost", "accepted"), ("client_state_not_durable", "continued")]
    assert [r["round"] for r in records(run_dir)] == [1, 2, 3, 4, 5]


def test_a_node_that_restarts_mid_run_is_noticed(tiny_config, tmp_path):
    """A node without a state folder restarts (its Context.state is empty again) between rounds 2 and 3."""

    class RestartingGrid(LoopbackGrid):
        restarted = False

        def deliver(self, msg):
            in_round_3 = msg.metadata.message_type == "train" and msg.content["fedhet.meta"]["round"] == 3
            if in_round_3 and not self.restarted:
                self.restarted = True
                self.contexts[202].state = RecordDict()
            return super().deliver(msg)

    def run(name, **options):
        cfg = cfg_for(tiny_config, name)
        return run_server(RestartingGrid(make_client_app(lambda _: cfg), nodes()), cfg, RunOptions(**options))

    with pytest.raises(StateLost, match=r"clients \[2, 3\] was not on nodes without a state folder in round 3"):
        run("restart")
    assert run("restart-accepted", accept_state_loss=True)["status"] == "finished"
    lost = [n for n in notices(tmp_path / "runs" / "restart-accepted") if n["kind"] == "client_state_lost"]
    assert [(n["round"], n["clients"], n["nodes"], n["action"]) for n in lost] == [(3, [2, 3], [202], "accepted")]


def test_stateless_algorithms_resume_without_state_folders_silently(tiny_config, tmp_path):
    cfg = cfg_for(tiny_config, "fedavg", algorithm="fedavg")
    run_flower(cfg, nodes(), kill_at=(4, 2))
    assert run_flower(cfg, nodes(), resume=True)["status"] == "finished"
    assert notices(tmp_path / "runs" / "fedavg") == []


# ------------------------------------------------------------------------------------------- the pieces
def test_folder_store_reads_the_histories_version_and_prunes_only_its_own_files(tmp_path):
    store = FolderStore(tmp_path / "node")
    a, b, c = "aa", "bb", "cc"

    def history(*attempts, checkpoints):
        return History("run-1", tuple(Attempt(*x) for x in attempts), checkpoints)

    def put(h, rnd, value):
        store.put(7, h, rnd, 0, {"x": torch.tensor([float(value)])})

    h1 = history((a, 0, 3), checkpoints=(2,))
    for rnd in (1, 2, 3):
        put(h1, rnd, rnd)
    folder = store.folder("run-1", 7)
    (folder / "notes.txt").write_text("not ours")
    assert sorted(p.name for p in folder.glob("*.pt")) == ["r00000002-p000-aa.pt", "r00000003-p000-aa.pt"]
    # attempt b resumes from round 2: attempt a's round-3 version is not part of its history
    h2 = history((a, 0, 2), (b, 2, 3), checkpoints=(2,))
    assert store.get(7, h2)["x"].item() == 2.0
    put(h2, 3, 30)
    assert store.get(7, h2)["x"].item() == 30.0
    # attempt c resumes from round 3 (b's checkpoint)
    h3 = history((a, 0, 2), (b, 2, 3), (c, 3, 4), checkpoints=(3,))
    assert store.get(7, h3)["x"].item() == 30.0
    put(h3, 4, 40)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "r00000003-p000-bb.pt", "r00000004-p000-cc.pt"]
    # two kept checkpoints (last.pt at round 4, prev.pt at round 3): each keeps the version it resumes from
    h4 = history((a, 0, 2), (b, 2, 3), (c, 3, 5), checkpoints=(3, 4))
    put(h4, 5, 50)
    assert sorted(p.name for p in folder.glob("*.pt")) == [
        "r00000003-p000-bb.pt",
        "r00000004-p000-cc.pt",
        "r00000005-p000-cc.pt",
    ]
    # an algorithm that clears its state: the empty version shadows the older ones
    store.put(7, h3, 4, 1, {})
    assert store.get(7, h3) == {}
    # a run key from the wire never leaves the state folder
    assert store.folder("../../etc", 1).resolve().is_relative_to((tmp_path / "node").resolve())


def test_executor_state_is_plain_data(tiny_config, tmp_path):
    """The checkpointed executor state loads with torch.load(weights_only=True)."""
    from fedhet.flower.server import FlowerExecutor, Nodes

    captured = {}
    save = Simulation.save_checkpoint

    def capture(self, rnd, wall):
        captured["state"] = self.executor.state_dict()
        return save(self, rnd, wall)

    cfg = cfg_for(tiny_config, "plain", rounds=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulation, "save_checkpoint", capture)
        run_flower(cfg, nodes(tmp_path / "n"))
    state = captured["state"]
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded == state and loaded["with_state"] == [0, 1, 2, 3] and loaded["state_keys"] == ["c_i"]
    assert [a["end"] for a in loaded["attempts"]] == [2]

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str | int) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return isinstance(x, str | int | float | bool | torch.Tensor)

    assert plain(loaded)
    executor = FlowerExecutor(None, Nodes(holder={c: 1 for c in range(4)}, durable={1: True}), None)
    executor.load_state_dict(loaded)
    assert (executor.start, executor.with_state) == (2, {0, 1, 2, 3})
