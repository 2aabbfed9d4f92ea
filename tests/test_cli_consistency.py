"""Issue 27, "what a person sees": fedhet --version, singular list kinds, "did you mean", help for every config
shortcut, the generated config reference (docs/config.md), and a shortcut that contradicts an -s override."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import fedhet
from fedhet.cli import app
from fedhet.errors import ConfigError
from fedhet.reference import config_markdown

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def invoke(*args):
    return runner.invoke(app, list(args))


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.startswith(f"fedhet {fedhet.__version__}")


@pytest.mark.parametrize("kind", ["algorithm", "algorithms", "dataset", "model", "partitioner", "server"])
def test_list_takes_singular_and_plural(kind):
    result = invoke("list", kind)
    assert result.exit_code == 0, result.output


def test_list_shows_every_description_and_default_as_written(monkeypatch):
    """fedhet list prints through rich, where "[hf]" in "needs fedhet[hf]" was a style tag and vanished: every
    entry's name, description and parameters are in the output as the registry has them (a wide console, so no
    cell wraps)."""
    import io

    from rich.console import Console

    import fedhet.cli as cli
    from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
    from fedhet.data.datasets import DATASETS
    from fedhet.data.features import FEATURE_SKEWS
    from fedhet.data.partition import PARTITIONERS
    from fedhet.models import MODELS

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=1000))
    assert invoke("list").exit_code == 0
    text = out.getvalue()
    assert "needs fedhet[hf]" in text
    registries = (DATASETS, PARTITIONERS, FEATURE_SKEWS, MODELS, ALGORITHMS, SERVER_OPTIMIZERS)
    lost = [e.summary for r in registries for e in r.entries() if f" {e.summary} " not in text]
    assert not lost, lost


def test_unknown_names_suggest_the_closest():
    with pytest.raises(ConfigError, match=r"did you mean 'fedprox'\?$"):
        fedhet.make_config(None, algorithm="fedprx")
    with pytest.raises(ConfigError, match=r"did you mean 'train.lr'\?$"):
        fedhet.make_config(None, ["train.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean 'partition.alpha'\?$"):
        fedhet.make_config(None, ["partition.alpah=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean 'train'\?$"):
        fedhet.make_config(None, ["trian.lr=0.1"])
    result = invoke("list", "algoritms")
    assert result.exit_code != 0 and "did you mean 'algorithms'?" in str(result.exception)


def test_every_config_shortcut_has_help():
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    lines = {line.split()[1].rstrip(","): line for line in result.output.splitlines() if "│ -" in line}
    for option in ("--dataset", "--model", "--data-dir", "--partition", "--clients", "--rounds", "--seed"):
        line = next((text for key, text in lines.items() if option in text), "")
        described = line.split(option, 1)[1].replace("TEXT", "").replace("INTEGER", "").strip(" │-,")
        assert described and not described.startswith("-"), f"{option} has no help: {line!r}"


def test_config_reference_is_current():
    """docs/config.md is generated from the models: regenerate with `fedhet list config --markdown > docs/config.md`."""
    assert (ROOT / "docs" / "config.md").read_text() == config_markdown()


def test_config_reference_lists_every_key():
    from fedhet.config import Config
    from fedhet.reference import config_rows

    keys = {row[0] for row in config_rows()}
    every = {f"{s}.{k}" for s, f in Config.model_fields.items() for k in f.annotation.model_fields}
    assert keys == every
    assert "`algorithm.mu`" in config_markdown()  # component parameters too
    result = invoke("list", "config")
    assert result.exit_code == 0 and "train.lr" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["-s", "partition.num_clients=4", "-n", "6"],
        ["-a", "fedavg", "-s", "algorithm.name=fedprox"],
        ["--seed", "1", "-s", "run.seed=2"],
    ],
)
def test_a_shortcut_and_an_override_that_disagree_are_refused(args, tmp_path):
    result = invoke("run", "-o", str(tmp_path), *args)
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError) and "conflicting settings" in str(result.exception)
    assert not any(tmp_path.iterdir())


def test_a_shortcut_and_an_equal_override_agree():
    from fedhet.cli_shared import check_shortcut_conflicts

    check_shortcut_conflicts(["partition.num_clients=6"], {"clients": 6})
    check_shortcut_conflicts(["algorithm.name=fedavg"], {"algorithm": "fedavg"})


def test_plugin_paths_in_a_toml_file_are_relative_to_it(tmp_path, monkeypatch):
    """The documented rule (docs/config.md): run.plugins in a TOML file from the file's folder; run.out_dir and
    dataset.data_dir from the working directory."""
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "p_rel.py").write_text("")
    (folder / "c.toml").write_text('[run]\nplugins = ["p_rel.py"]\nout_dir = "out"\n[dataset]\ndata_dir = "data"\n')
    monkeypatch.chdir(tmp_path)
    cfg = fedhet.make_config(folder / "c.toml")
    assert cfg.run.plugins == [str(folder / "p_rel.py")]
    assert cfg.run.out_dir == "out" and cfg.dataset.data_dir == "data"
    assert "`run.plugins`) are taken from the TOML file's folder" in config_markdown()


@pytest.mark.parametrize(("args", "meant"), [(["rn"], "run"), (["flower", "simulte"], "simulate")])
def test_unknown_command_suggests_once(args, meant):
    """click and typer both append "Did you mean ...?" to an unknown command: the user reads it once."""
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.output.count("Did you mean") == 1 and f"'{meant}'" in result.output, result.output


def commands(cmd=None, path="fedhet"):
    """Every command of the app (groups included), with the words that call it."""
    import click
    import typer

    cmd = cmd or typer.main.get_command(app)
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items() if isinstance(cmd, click.Group) else ():
        yield from commands(sub, f"{path} {name}")


def help_texts():
    for path, cmd in commands():
        for where, text in [("", cmd.help or ""), *((p.name, getattr(p, "help", None) or "") for p in cmd.params)]:
            yield f"{path} {where}", text


def test_help_texts_survive_rich_markup():
    """typer renders help through rich, where "[system]" is a style tag and vanishes: every command's and option's
    help reads the same after rendering (brackets escaped as "\\[")."""
    from rich.text import Text

    lost = [
        f"{where}: {text}" for where, text in help_texts() if Text.from_markup(text).plain != text.replace("\\[", "[")
    ]
    assert not lost, "\n".join(lost)


def test_help_texts_have_no_doubled_backticks():
    """The docstrings are also the commands' help: reST's ``literal`` would show its backticks in the terminal."""
    doubled = [f"{where}: {text}" for where, text in help_texts() if "``" in text]
    assert len(list(commands())) > 10 and not doubled, "\n".join(doubled)
