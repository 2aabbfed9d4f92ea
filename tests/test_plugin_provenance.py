"""Issue 27: a run records its plug-ins' content hashes and fedhet's version/commit; an edited plug-in is detected
and refused in one line naming the file, unless the change is accepted (fedhet/plugins.py)."""

from __future__ import annotations

import json

import pytest

from fedhet import plugins
from fedhet.errors import ConfigError


def write(path, text):
    path.write_text(text)
    return str(path)


def test_a_file_plugin_is_hashed(tmp_path):
    spec = write(tmp_path / "my_method.py", "X = 1\n")
    info = plugins.fingerprints([spec])[spec]
    assert info["kind"] == "file" and len(info["sha256"]) == 64 and info["path"] == spec


def test_a_package_plugin_hashes_every_py_file(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg_prov"
    pkg.mkdir()
    write(pkg / "__init__.py", "")
    write(pkg / "algo.py", "A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = plugins.fingerprint("mypkg_prov")
    assert before["kind"] == "package"
    write(pkg / "algo.py", "A = 2\n")  # a file other than __init__.py changes the package's hash
    assert plugins.fingerprint("mypkg_prov")["sha256"] != before["sha256"]
    assert plugins.fingerprint("mypkg_prov.algo")["kind"] == "module"


def test_an_edit_is_detected_and_refused_naming_the_file(tmp_path):
    spec = write(tmp_path / "my_method.py", "X = 1\n")
    saved = plugins.fingerprints([spec])
    assert plugins.changed(saved, plugins.fingerprints([spec])) == []
    write(tmp_path / "my_method.py", "X = 2\n")
    now = plugins.fingerprints([spec])
    diffs = plugins.changed(saved, now)
    assert len(diffs) == 1 and spec in diffs[0]
    with pytest.raises(ConfigError) as err:
        plugins.check_unchanged(saved, now, tmp_path / "run", accept=False)
    message = str(err.value)
    assert "\n" not in message and spec in message and plugins.ACCEPT_FLAG in message
    assert plugins.check_unchanged(saved, now, tmp_path / "run", accept=True) == diffs


def test_accept_flag_reaches_the_check_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(plugins.ACCEPT_ENV, raising=False)
    spec = write(tmp_path / "p.py", "X = 1\n")
    saved = plugins.fingerprints([spec])
    write(tmp_path / "p.py", "X = 3\n")
    with pytest.raises(ConfigError):
        plugins.check_unchanged(saved, plugins.fingerprints([spec]), "run")
    plugins.accept_changes(True)
    try:
        assert plugins.check_unchanged(saved, plugins.fingerprints([spec]), "run")
    finally:
        plugins.accept_changes(False)


def test_a_moved_plugin_with_the_same_bytes_is_unchanged(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old = write(tmp_path / "a" / "m.py", "X = 1\n")
    new = write(tmp_path / "b" / "m.py", "X = 1\n")
    assert plugins.changed(plugins.fingerprints([old]), plugins.fingerprints([new])) == []


def test_a_missing_plugin_file_counts_as_changed(tmp_path):
    spec = write(tmp_path / "gone.py", "X = 1\n")
    saved = plugins.fingerprints([spec])
    (tmp_path / "gone.py").unlink()
    diffs = plugins.changed(saved, plugins.fingerprints([spec]))
    assert len(diffs) == 1 and spec in diffs[0]


def test_runs_from_before_hashes_are_not_compared(tmp_path):
    spec = write(tmp_path / "m.py", "X = 1\n")
    assert plugins.changed(None, plugins.fingerprints([spec])) == []
    assert plugins.changed({spec: {"kind": "file"}}, plugins.fingerprints([spec])) == []


def test_saved_fingerprints_reads_provenance(tmp_path):
    spec = write(tmp_path / "m.py", "X = 1\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "provenance.json").write_text(json.dumps(plugins.provenance([spec])))
    assert plugins.saved_fingerprints(tmp_path / "run") == plugins.fingerprints([spec])
    assert plugins.saved_fingerprints(tmp_path / "nowhere") is None


def test_fedhet_version_and_commit():
    from fedhet import __version__

    info = plugins.fedhet_version()
    assert info["version"] == __version__
    if "commit" in info:  # a git checkout (this repository's tests run from one)
        assert len(info["commit"]) == 40 and isinstance(info["dirty"], bool)
    assert plugins.provenance([])["fedhet_code"] == info
