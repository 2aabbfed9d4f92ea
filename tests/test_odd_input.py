"""Odd input is one `error:` line and exit 2, with nothing written (issue 26, "Tracebacks on odd input").

Every path-valued setting is tried with a name longer than the file system allows, a FIFO, a device file, the wrong
kind (a folder where a file belongs, a file where a folder does), no permission and a dangling symbolic link; then
the long run name, config files that hang or fill the memory, a model too large for the machine, and --overwrite of
a run folder that is a symbolic link. The commands run in this process through ``fedhet.cli.main``, as the
``fedhet`` script does (argv in, message on stderr, exit status out).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhet.cli import main
from fedhet.errors import ConfigError

TINY = ["-d", "digits", "-m", "mlp", "-n", "4", "-r", "1", "-s", "run.progress=false", "-s", "partition.min_size=20"]


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``fedhet ARGS``, run by the console script's ``main``; a command that hangs (a FIFO
    opened for reading) fails the test after two minutes instead of hanging it."""
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])

    def hung(signum, frame):
        raise TimeoutError(f"fedhet {' '.join(map(str, args))[:200]} hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with pytest.raises(SystemExit) as info:
            main()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return info.value.code, capsys.readouterr().err


def one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def listing(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed), to see that a refused command wrote nothing."""
    out = set()
    for folder, dirs, files in os.walk(root):
        out.update(os.path.join(folder, name) for name in dirs + files)
    return out


# ---------------------------------------------------------------------------------------------- the path matrix
KINDS = ["too long", "fifo", "device", "wrong kind", "no permission", "dangling link"]


def bad_path(kind: str, tmp_path: Path, want: str, monkeypatch) -> tuple[Path, str]:
    """A path of ``kind`` for a setting that wants ``want`` (input-file, output-file, input-folder, output-folder);
    returns it and a pattern of the problem its error must name."""
    odd = tmp_path / "odd"
    odd.mkdir(exist_ok=True)
    if kind == "too long":
        return odd / ("x" * 300), r"has a name of 300 bytes .*at most \d+ bytes per file or folder name"
    if kind == "fifo":
        os.mkfifo(odd / "fifo")
        return odd / "fifo", r"is a FIFO \(named pipe\), not a"
    if kind == "device":
        # /dev/zero where a config is read (a MemoryError before), /dev/null elsewhere
        return Path("/dev/zero" if want == "input-file" else "/dev/null"), "is a character device, not a"
    if kind == "wrong kind":
        if want.endswith("file"):
            (odd / "folder").mkdir()
            return odd / "folder", "is a folder, not a"
        (odd / "file").write_text("x")
        return odd / "file", "is a file, not a folder"
    if kind == "dangling link":
        (odd / "link").symlink_to(odd / "gone")
        return odd / "link", r"is a symbolic link to .*gone', which does not exist"
    assert kind == "no permission"
    if want.endswith("file"):
        target = odd / "locked.toml"
        target.write_text("[run]\n")
    else:
        target = odd / "locked"
        target.mkdir()
    reading = want.startswith("input")
    target.chmod(0o000 if reading else 0o555 if want.endswith("folder") else 0o444)
    if os.geteuid() == 0:  # root passes every permission check: emulate the refusal of os.access
        real = os.access

        def access(path, mode, *args, **kwargs):
            if Path(path) == target and mode & (os.R_OK if reading else os.W_OK):
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    return target, r"cannot be (read|written) \(permission denied\)"


# setting -> (what the path must be, the command with {} for the path, the words the error names the setting by)
SETTINGS = {
    "-c": ("input-file", ["run", "-c", "{}", *TINY, "-o", "{out}"], "config file"),
    "--data-dir": ("input-folder", ["run", *TINY, "--data-dir", "{}", "-o", "{out}"], "dataset.data_dir"),
    "--plugin": ("input-file", ["run", *TINY, "--plugin", "{}", "-o", "{out}"], "plug-in file"),
    "run.plugins": ("input-file", ["run", *TINY, "-s", "run.plugins=['{}']", "-o", "{out}"], "plug-in file"),
    "--out": ("output-folder", ["run", *TINY, "-o", "{}"], "run.out_dir"),
    "run.out_dir": ("output-folder", ["run", *TINY, "-s", "run.out_dir={}"], "run.out_dir"),
    "report --html": ("output-file", ["report", "{out}", "--html", "{}"], "--html"),
    "report --plot": ("output-file", ["report", "{out}", "--plot", "{}"], "--plot"),
    "report --markdown": ("output-file", ["report", "{out}", "--markdown", "{}"], "--markdown"),
    "report RUNS": ("input-folder", ["report", "{}"], "run folder"),
    "resume RUN_DIR": ("input-folder", ["resume", "{}"], "run folder"),
    "partition --plot": ("output-file", ["partition", "-d", "digits", "-n", "4", "--plot", "{}"], "--plot"),
    "tracking.wandb_dir": (
        "output-folder",
        ["run", *TINY, "-o", "{out}", "-s", "tracking.wandb=true", "-s", "tracking.wandb_dir={}"],
        "tracking.wandb_dir",
    ),
    "tracking.mlflow_uri": (
        "output-folder",
        ["run", *TINY, "-o", "{out}", "-s", "tracking.mlflow=true", "-s", "tracking.mlflow_uri={}"],
        "tracking.mlflow_uri",
    ),
    "flower app APP_DIR": ("output-folder", ["flower", "app", "{}", *TINY], "app folder"),
    "flower export --out": ("output-folder", ["flower", "export", "-d", "digits", "-n", "4", "-o", "{}"], "--out"),
    "flower simulate --node-state-dir": (
        "output-folder",
        ["flower", "simulate", *TINY, "-o", "{out}", "--node-state-dir", "{}"],
        "--node-state-dir",
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_path_setting_refuses_an_odd_path_in_one_line(tmp_path, monkeypatch, capsys, setting, kind):
    want, command, label = SETTINGS[setting]
    path, problem = bad_path(kind, tmp_path, want, monkeypatch)
    out = tmp_path / "out"
    if command[0] == "report" and "{out}" in command:
        out.mkdir()  # an (empty) folder to report on: the output files are checked before any run is read
    monkeypatch.chdir(tmp_path)  # `fedhet partition` and `report` write next to the working directory by default
    before = listing(tmp_path)
    args = [arg.replace("{}", str(path)).replace("{out}", str(out)) for arg in command]
    line = one_error_line(*fedhet(monkeypatch, capsys, *args))
    assert label in line, line
    assert str(path)[:60] in line, line  # the path, cut short in the message where it is huge
    assert re.search(problem, line), line
    assert listing(tmp_path) == before  # nothing written: no run folder, no report, no app files
    if kind == "dangling link":
        assert not path.exists()  # a dangling link is not followed into making its target


def test_the_output_files_of_a_report_are_checked_before_any_is_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "html").mkdir()
    code, err = fedhet(
        monkeypatch, capsys, "report", tmp_path / "runs", "--markdown", tmp_path / "t.md", "--html", tmp_path / "html"
    )
    assert "--html" in one_error_line(code, err)
    assert not (tmp_path / "t.md").exists()
    same = tmp_path / "t.md"
    line = one_error_line(*fedhet(monkeypatch, capsys, "report", tmp_path / "runs", "--markdown", same, "--plot", same))
    assert "must name different files" in line


def test_an_output_folder_under_a_file_names_the_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "blocker").write_text("")
    line = one_error_line(*fedhet(monkeypatch, capsys, "run", *TINY, "-o", tmp_path / "blocker" / "runs"))
    assert f"lies under '{tmp_path / 'blocker'}', which is a file, not a folder" in line


# ---------------------------------------------------------------------------------------------- the cases
def test_a_run_name_longer_than_the_file_system_allows_is_refused_at_config_time(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    line = one_error_line(*fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "a" * 300))
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert line.startswith("error: run.name 'aaaa") and "is 300 bytes long" in line, line
    assert f"allows at most {limit} bytes per folder name (PC_NAME_MAX)" in line
    assert not out.exists()  # refused before the output folder was made


def test_a_long_name_is_refused_by_the_python_api_too(tmp_path):
    import fedhet

    with pytest.raises(ConfigError, match=r"run.name .* is 256 bytes long"):
        fedhet.make_config({"run": {"out_dir": str(tmp_path), "name": "é" * 128}})  # 128 characters, 256 bytes


@pytest.mark.slow
@pytest.mark.parametrize("source", ["fifo", "/dev/zero"])
def test_a_config_that_is_no_regular_file_is_refused_before_it_is_read(tmp_path, source):
    """The issue's cases as a user meets them: `-c FIFO` hung forever, `-c /dev/zero` ended in a MemoryError."""
    path = Path(source)
    if source == "fifo":
        path = tmp_path / "config.toml"
        os.mkfifo(path)
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-c", str(path), "-o", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error_line(proc.returncode, proc.stderr)
    assert line.startswith(f"error: config file '{path}' is a ") and line.endswith(", not a regular file"), line
    assert not (tmp_path / "runs").exists()


def test_a_config_file_over_a_megabyte_is_refused(tmp_path, monkeypatch, capsys):
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid TOML, but no config is that large
    line = one_error_line(*fedhet(monkeypatch, capsys, "run", "-c", big, *TINY, "-o", tmp_path / "runs"))
    assert line == f"error: config file '{big}' is 2 MB; a TOML file may be at most 1 MB"


def test_a_model_too_large_for_memory_is_one_line_naming_its_size(tmp_path, monkeypatch, capsys):
    from fedhet.engine.memory import available_memory

    def params(hidden: int) -> int:
        return 64 * hidden + hidden + hidden * 10 + 10  # digits: 64 inputs, 10 classes

    free = available_memory(torch.device("cpu"))
    assert free is not None
    hidden = 100_000_000  # the 25 GB of weights; more where the machine could hold three copies of them
    if 3 * 4 * params(hidden) <= free[0]:
        hidden = free[0] // (4 * 75) + 1
    out = tmp_path / "runs"
    line = one_error_line(*fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "-s", f"model.hidden=[{hidden}]"))
    assert line.startswith(f"error: model 'mlp' has {params(hidden):,} parameters"), line
    assert re.search(r"but cpu has [\d.]+ [GMk]B available", line), line
    assert not out.exists()


def test_the_memory_check_refuses_only_what_cannot_fit(monkeypatch):
    """Three copies of the weights (weights, gradients, the server's copy) against what the device has free."""
    from fedhet.engine import memory

    def build():
        return torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, 4,004,000 bytes

    counted = memory.count_model(build)
    assert counted == (1_001_000, 4_004_000)
    state = torch.get_rng_state()
    assert memory.count_model(lambda: torch.nn.Linear(10**6, 10**6)) == (10**12 + 10**6, 4 * (10**12 + 10**6))
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn, nothing allocated
    monkeypatch.setattr(memory, "available_memory", lambda device: (3 * 4_004_000, "free (test)"))
    memory.check_fits("m", counted, torch.device("cpu"))  # exactly fits: allowed
    monkeypatch.setattr(memory, "available_memory", lambda device: (3 * 4_004_000 - 1, "free (test)"))
    with pytest.raises(ConfigError, match=r"model 'm' has 1,001,000 parameters \(4 MB\).* but cpu has 12 MB free"):
        memory.check_fits("m", counted, torch.device("cpu"))
    memory.check_fits("m", None, torch.device("cpu"))  # a model that cannot be built on meta is not judged


def test_the_memory_check_asks_cuda_for_its_free_memory(monkeypatch):
    from fedhet.engine import memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 10**9, 80 * 10**9))
    free, where = memory.available_memory(torch.device("cuda:0"))
    assert free == 5 * 10**9 and "mem_get_info" in where
    with pytest.raises(ConfigError, match=r"but cuda:0 has 5 GB free \(torch.cuda.mem_get_info\)"):
        memory.check_fits("big", (10**9, 4 * 10**9), torch.device("cuda:0"))
    assert memory.available_memory(torch.device("mps")) is None  # not judged where the free memory is unknown


def test_overwrite_refuses_a_run_folder_that_is_a_symbolic_link(tmp_path, monkeypatch, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    out = tmp_path / "runs"
    out.mkdir()
    (out / "linked").symlink_to(target)
    line = one_error_line(*fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "linked", "--overwrite"))
    assert f"run folder '{out / 'linked'}' is a symbolic link (to '{target}'); not deleting it" in line
    assert (out / "linked").is_symlink() and (target / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in target.iterdir()) == ["thesis.tex"]


def test_a_run_folder_that_is_a_dangling_link_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    (out / "dl").symlink_to(tmp_path / "gone")
    for extra in ([], ["--overwrite"], ["--resume"]):
        line = one_error_line(*fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "dl", *extra))
        assert "run folder" in line and "which does not exist (a dangling link)" in line, line
    assert not (tmp_path / "gone").exists()


def test_ordinary_paths_still_run(tmp_path, monkeypatch, capsys):
    """The checks refuse nothing ordinary: a relative output folder that does not exist yet, a symlinked one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "via-link").symlink_to(tmp_path / "real")
    code, err = fedhet(monkeypatch, capsys, "run", *TINY, "-o", "new/runs", "--name", "a")
    assert code in (0, None), err
    code, err = fedhet(monkeypatch, capsys, "run", *TINY, "-o", "via-link", "--name", "b")
    assert code in (0, None), err
    assert (tmp_path / "new" / "runs" / "a" / "summary.json").exists()
    assert (tmp_path / "real" / "b" / "summary.json").exists()
