"""Issue 27, "Reproducibility of one's own code", end to end: a run records its plug-in's hash and fedhet's
version/commit in provenance.json; after the plug-in file is edited, `fedhet resume` and a rerun of the same
`fedhet compare` refuse in one line naming the file (exit 2), and continue with --accept-changed-plugins.

The commands run in this process through ``fedhet.cli.main``, as the ``fedhet`` script does (argv in, message on
stderr, exit status out); what the plug-in registers is forgotten afterwards."""

from __future__ import annotations

import json
import sys

import pytest

from fedhet import __version__, plugins
from fedhet.algorithms import ALGORITHMS
from fedhet.cli import main

PLUGIN = (
    "from fedhet.algorithms import ALGORITHMS\n"
    "from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig\n\n\n"
    '@ALGORITHMS.register("edit_probe", "FedAvg under another name", FedAvgConfig)\n'
    "class EditProbe(FedAvg):\n"
    "    pass\n"
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    entries, loaded = dict(ALGORITHMS._entries), dict(plugins._loaded)
    monkeypatch.delenv(plugins.ACCEPT_ENV, raising=False)
    yield
    sys.modules.pop("edit_probe_plugin", None)
    ALGORITHMS._entries.clear()
    ALGORITHMS._entries.update(entries)
    plugins._loaded.clear()
    plugins._loaded.update(loaded)
    plugins.accept_changes(False)


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``fedhet ARGS``; the accept flag of one command does not reach the next."""
    plugins.accept_changes(False)
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code or 0, capsys.readouterr().err


def test_an_edited_plugin_stops_resume_and_compare_until_accepted(tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "edit_probe_plugin.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "runs"
    compare = [
        "compare", "-a", "edit_probe", "--plugin", plugin, "-d", "digits", "-m", "mlp", "-n", "4", "-r", "2",
        "--seed", "0", "-o", out, "-s", "run.progress=false", "-s", "model.hidden=[16]",
        "-s", "partition.min_size=20",
    ]  # fmt: skip
    code, err = fedhet(monkeypatch, capsys, *compare)
    assert code == 0, err
    [run_dir] = [p.parent for p in out.rglob("config.json")]
    first = plugins.fingerprint(str(plugin))["sha256"]
    info = json.loads((run_dir / "provenance.json").read_text())
    assert info["plugins"][str(plugin)]["sha256"] == first
    assert info["fedhet_code"]["version"] == __version__
    assert len(info["fedhet_code"].get("commit", "x" * 40)) == 40  # a git checkout also records its commit

    plugin.write_text(PLUGIN + "\nEDITED = True\n")
    for args in (["resume", run_dir, "-r", "3"], compare):
        code, err = fedhet(monkeypatch, capsys, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert str(plugin) in lines[0] and "--accept-changed-plugins" in lines[0], err
    assert [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    code, err = fedhet(monkeypatch, capsys, "resume", run_dir, "-r", "3", "--accept-changed-plugins")
    assert code == 0, err
    assert "changed plug-in code" in err  # accepted, with a warning
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    info = json.loads((run_dir / "provenance.json").read_text())
    assert info["plugins"][str(plugin)]["sha256"] == first  # what the run started with stays
    second = plugins.fingerprint(str(plugin))["sha256"]
    assert info["resumes"][-1]["plugins"][str(plugin)]["sha256"] == second != first
    assert info["resumes"][-1]["fedhet_code"]["version"] == __version__

    # the accepted code is what the run records now: the next resume (or compare) under it needs no flag
    code, err = fedhet(monkeypatch, capsys, "resume", run_dir, "-r", "4")
    assert code == 0, err
    code, err = fedhet(monkeypatch, capsys, *compare)
    assert code == 0, err  # the finished cell is skipped


def one_round_settings(tmp_path, algorithm: str) -> dict:
    """A one-round run named "p" on digits under ``tmp_path / "runs"``."""
    return {
        "run": {"rounds": 1, "out_dir": str(tmp_path / "runs"), "name": "p", "progress": False},
        "dataset": {"name": "digits"},
        "partition": {"num_clients": 4, "min_size": 20},
        "model": {"name": "mlp", "hidden": [16]},
        "algorithm": {"name": algorithm},
    }


def test_the_python_api_accepts_a_changed_plugin_for_one_call(tmp_path, capsys):
    import fedhet as api
    from fedhet.errors import ConfigError

    plugin = tmp_path / "edit_probe_plugin.py"
    plugin.write_text(PLUGIN)
    settings = one_round_settings(tmp_path, "edit_probe")
    api.run(settings, plugins=[plugin])
    plugin.write_text(PLUGIN + "\nEDITED = True\n")
    with pytest.raises(ConfigError, match="plug-in code changed"):
        api.resume(tmp_path / "runs" / "p", rounds=2)
    api.resume(tmp_path / "runs" / "p", rounds=2, accept_changed_plugins=True)
    assert not plugins.accepting_changes()  # for that call only


def test_compare_refuses_only_the_cells_that_use_an_edited_plugin_and_remembers_an_accepted_edit(
    tmp_path, monkeypatch, capsys
):
    """A built-in FedAvg cell beside the plug-in's cell never runs the plug-in: its edit does not stop it. The
    refusal names the one cause (not 'a different config'), and an accepted edit is recorded in the skipped cell's
    folder, so the next plain rerun goes through."""
    plugin = tmp_path / "edit_probe_plugin.py"
    plugin.write_text(PLUGIN)
    compare = [
        "compare", "-v", "edit_probe,fedavg", "--plugin", plugin, "-d", "digits", "-m", "mlp", "-n", "4", "-r", "2",
        "--seed", "0", "-o", tmp_path / "runs", "-s", "run.progress=false", "-s", "model.hidden=[16]",
        "-s", "partition.min_size=20",
    ]  # fmt: skip
    code, err = fedhet(monkeypatch, capsys, *compare)
    assert code == 0, err
    plugin.write_text(PLUGIN + "\nEDITED = True\n")
    code, err = fedhet(monkeypatch, capsys, *compare)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "edit_probe-s0" in lines[0] and "fedavg-s0" not in lines[0] and "different config" not in lines[0], err
    assert lines[0].startswith("error: 1 cell(s) ran plug-in code that changed since:") and str(plugin) in lines[0]
    assert "--accept-changed-plugins" in lines[0] and "--overwrite" in lines[0]
    code, err = fedhet(monkeypatch, capsys, *compare, "--accept-changed-plugins")
    assert code == 0, err  # both cells had finished: skipped
    code, err = fedhet(monkeypatch, capsys, *compare)
    assert code == 0, err  # the accepted code is what the skipped cell records now


def test_a_run_that_uses_no_component_of_an_edited_plugin_resumes(tmp_path):
    import fedhet as api

    plugin = tmp_path / "edit_probe_plugin.py"
    plugin.write_text(PLUGIN)
    settings = one_round_settings(tmp_path, "fedavg")
    api.run(settings, plugins=[plugin])
    plugin.write_text(PLUGIN + "\nEDITED = True\n")
    assert api.resume(tmp_path / "runs" / "p", rounds=2).summary["rounds_done"] == 2
