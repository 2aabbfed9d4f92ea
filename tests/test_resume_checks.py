"""A resume continues on the data and the trace its checkpoint trained on, and only advises prev.pt when it would pass
(issue 44, items 2 and 3).

Each checkpoint records the data's fingerprint (``data_sha256``: the SHA-256 of the files read, or of the loaded
arrays for generated data): a resume on other data is refused in one line before the run folder changes. When
``last.pt`` is refused, ``prev.pt`` is named as the way on only if every check (config, rounds, trace, data, its client
states) passes on it too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
from test_break_it import fedhet, one_line, snapshot
from test_datasets import write_mnist_like
from test_integrity import damage, disk_scaffold, same_run, snapshot_files

from fedhet.data.federated import FederatedDataset
from fedhet.data.types import ClientData
from fedhet.engine.checkpoint import LAST, MAGIC, PREV, read_checkpoint, write_sealed
from fedhet.engine.simulation import DATA_KEY, Simulation
from fedhet.errors import ConfigError

CHANGED = r"has changed since the run was checkpointed \(sha256 [0-9a-f]{12}\.\.\., now [0-9a-f]{12}\.\.\.\)"


def refused_leaving_it_as_it_was(make, change) -> str:
    """Train 2 rounds of ``make(rounds)``, ``change()`` the data, resume to 3: the refusal, the folder unchanged."""
    first = Simulation(make(2))
    first.run()
    assert read_checkpoint(first.checkpoint_path)[DATA_KEY] == first.eval_fed.fingerprint()
    before = snapshot(first.run_dir)
    change()
    with pytest.raises(ConfigError, match=CHANGED) as info:
        Simulation(make(3)).run(resume=True)
    assert snapshot(first.run_dir) == before  # every file, hidden ones too, byte for byte
    message = str(info.value)
    assert "\n" not in message and str(first.checkpoint_path) in message and "prev.pt" not in message
    return message


# ------------------------------------------------------------------ item 2: the data cannot change under a run
def write_table(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rows = [f"{rng.normal():.4f},{rng.normal():.4f},{i % 2}" for i in range(80)]
    path.write_text("a,b,y\n" + "\n".join(rows) + "\n")


def test_a_resume_on_an_edited_hf_csv_is_one_line_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch, capsys):
    pytest.importorskip("datasets")
    table = tmp_path / "table.csv"
    write_table(table)
    args = ["-d", "hf", "-s", f"dataset.path={table}", "-s", "dataset.task=tabular", "-m", "mlp", "-p", "iid"]
    args += ["-n", "4", "-s", "run.progress=false", "-s", f"dataset.data_dir={tmp_path / 'cache'}"]
    code, err = fedhet(monkeypatch, capsys, "run", *args, "-r", "2", "-o", tmp_path / "out", "--name", "x")
    assert code == 0, err
    folder = tmp_path / "out" / "x"
    before = snapshot(folder)
    write_table(table, seed=1)  # the same shape and columns, other values

    code, err = fedhet(monkeypatch, capsys, "resume", folder, "-r", "3")
    line = one_line(err)
    assert code == 2 and f"dataset 'hf' ({table})" in line and "put the original data back" in line, line
    assert snapshot(folder) == before
    assert (folder / "provenance.json").read_text() == before["provenance.json"].decode()  # the old hash, truly


def test_a_resume_on_changed_idx_files_is_refused(tiny_config, tmp_path):
    data = tmp_path / "data"
    write_mnist_like(data / "fmnist", n=(60, 20))

    def make(rounds):
        return tiny_config(
            run={"rounds": rounds, "name": "fmnist"},
            dataset={"name": "fmnist", "data_dir": str(data)},
            partition={"name": "iid", "num_clients": 4},
            train={"batch_size": 8},
        )

    message = refused_leaving_it_as_it_was(make, lambda: write_mnist_like(data / "fmnist", seed=5, n=(60, 20)))
    assert f"dataset 'fmnist' ({data / 'fmnist'})" in message


def test_a_resume_on_generated_data_that_changed_is_refused(tiny_config, monkeypatch):
    """digits are generated (by scikit-learn): the arrays' hash is the fingerprint; another version's digits refused."""
    real = sklearn.datasets.load_digits

    def other_digits():
        bunch = real()
        bunch.images = bunch.images.copy()
        bunch.images[0, 3, 3] = 16 - bunch.images[0, 3, 3]
        return bunch

    make = lambda rounds: tiny_config(run={"rounds": rounds, "name": "digits"})  # noqa: E731
    message = refused_leaving_it_as_it_was(
        make, lambda: monkeypatch.setattr(sklearn.datasets, "load_digits", other_digits)
    )
    assert "dataset 'digits' (scikit-learn" in message


def test_hand_built_clients_are_fingerprinted_by_their_tensors():
    import torch

    def fed(scale):
        clients = [ClientData(x=torch.ones(3, 2) * scale, y=torch.tensor([0, 1, 0]), num_classes=2) for _ in range(2)]
        return FederatedDataset("mine", clients, torch.zeros(2, 2), torch.tensor([0, 1]), 2, (2,), np.ones((2, 2)), "x")

    assert fed(1.0).fingerprint() == fed(1.0).fingerprint() != fed(2.0).fingerprint()
    assert len(fed(1.0).fingerprint()) == 64 and fed(1.0).describe_source() == "dataset 'mine'"


def test_an_unchanged_resume_is_bit_exact_and_an_old_checkpoint_resumes_with_one_warning(tiny_config, capsys):
    make = lambda name: tiny_config(run={"name": name, "rounds": 4})  # noqa: E731
    reference = Simulation(make("ref"))
    reference.run()
    Simulation(make("cut")).run(stop_after=2)
    sim = Simulation(make("cut"))
    for name in (LAST, PREV):  # as a fedhet from before data fingerprints wrote them
        state = read_checkpoint(sim.checkpoint_dir / name)
        del state[DATA_KEY]
        write_sealed(sim.checkpoint_dir / name, state, MAGIC)
    sim.run(resume=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "fingerprint" in line]
    assert len(lines) == 1 and "records no fingerprint of its data" in lines[0], lines
    same_run(reference, sim)
    assert read_checkpoint(sim.checkpoint_path)[DATA_KEY] == reference.eval_fed.fingerprint()


# ------------------------------------------------------------------ item 3: advice that does not cost a checkpoint
def test_an_edited_trace_is_refused_without_advising_prev_pt(tiny_config, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth,availability\n" + "".join(f"{c},{10 + c},1000,1\n" for c in range(6)))

    def make(rounds):
        return tiny_config(run={"rounds": rounds, "name": "traced"}, system={"profiles": "trace", "trace": str(trace)})

    def edit():
        trace.write_text(trace.read_text().replace("0,10,1000", "0,99,1000"))

    message = refused_leaving_it_as_it_was(make, edit)
    assert message.startswith(f"{tmp_path / 'runs' / 'traced' / 'checkpoints' / LAST}: system.trace")


def test_prev_pt_is_advised_only_when_its_client_states_would_pass(tiny_config):
    """last.pt from another run: prev.pt is named while its states are intact, not once one of them is damaged."""
    other = disk_scaffold(tiny_config, "other").model_copy(deep=True)
    other.train.lr = 0.05
    Simulation(other).run(stop_after=3)
    Simulation(disk_scaffold(tiny_config, "cut")).run(stop_after=3)
    sim = Simulation(disk_scaffold(tiny_config, "cut"))
    shutil.copy(sim.run_dir.parent / "other" / "checkpoints" / LAST, sim.checkpoint_path)
    with pytest.raises(ConfigError, match=f"{PREV} \\(round 2\\) can be resumed"):
        Simulation(disk_scaffold(tiny_config, "cut")).run(resume=True)

    damage(snapshot_files(sim, PREV)[0], "flipped")
    before = snapshot(sim.run_dir)
    with pytest.raises(ConfigError, match="config differs") as info:
        Simulation(disk_scaffold(tiny_config, "cut")).run(resume=True)
    assert PREV not in str(info.value) and snapshot(sim.run_dir) == before


def test_the_fingerprint_costs_nothing_per_round(tiny_config, monkeypatch):
    """Computed once per run start, whatever the number of checkpoints."""
    calls = []
    fingerprint = FederatedDataset.fingerprint
    monkeypatch.setattr(FederatedDataset, "fingerprint", lambda self: calls.append(1) or fingerprint(self))
    Simulation(tiny_config(run={"rounds": 4, "name": "count"})).run()
    assert len(calls) == 1


def test_the_fingerprint_is_the_provenance_hash(tiny_config):
    sim = Simulation(tiny_config())
    assert (
        sim.eval_fed.fingerprint() == sim.eval_fed.provenance["sha256"]
        and sim.eval_fed.provenance["sha256_of"] == "arrays"
    )


def test_a_resume_on_an_edited_partition_file_is_refused(tiny_config, tmp_path):
    """A saved partition's indices are part of the data a run trains on: moving a sample between clients in the file
    is refused like changed data, naming the file."""
    import json

    import fedhet

    path = tmp_path / "clients.json"
    fedhet.save_partition({"dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4}}, path)

    def make(rounds):
        return tiny_config(
            run={"rounds": rounds, "name": "saved"}, partition={"name": "file", "path": str(path), "num_clients": 4}
        )

    def move_a_sample():
        obj = json.loads(path.read_text())
        obj["clients"][1]["train"].append(obj["clients"][0]["train"].pop())
        path.write_text(json.dumps(obj))

    message = refused_leaving_it_as_it_was(make, move_a_sample)
    assert f"or partition file {path}" in message
