"""fedhet on Flower's deployment runtime: a real SuperLink and two SuperNodes on 127.0.0.1, started and stopped here.

Each test starts its own SuperLink and SuperNodes on free loopback ports (insecure, then TLS with certificates made
here plus SuperNode authentication), runs FedAvg and SCAFFOLD with ``flwr run`` on an app folder written by
``fedhet flower app``, and checks that the run folder holds exactly the metrics of the in-process simulation of the
same config and seed (SCAFFOLD's control variates live between rounds in the SuperNodes' state folders in the
insecure test, in their Context.state in the TLS one).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from fedhet.config import build_config  # noqa: E402
from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.flower.bundle import write_app  # noqa: E402

BIN = Path(sys.executable).parent
RUN_TIMEOUT = 300  # seconds: a bound for a hung `flwr run` on a busy machine, not a speed target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s:\n{log.read_text()[-3000:]}")


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, ..., start time at index 19)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the processes below ``pid``: the SuperLink and SuperNodes start App processes."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(int(entry.name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            fields = proc_stat(child)
            if fields:
                out.append((child, fields[19]))
                todo.append(child)
    return out


def signal_if_same(pid: int, started: str, sig: int) -> None:
    """Signal ``pid`` only if it is still the process we saw (same start time), never a reused pid."""
    fields = proc_stat(pid)
    if fields and fields[19] == started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Processes:
    """Processes this test starts; ``stop`` ends each of them and its descendants by pid."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env, self.procs = workdir, env, []

    def start(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc, log

    def stop(self) -> None:
        below = [d for proc in self.procs for d in descendants(proc.pid)]
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for pid, started in below:
            signal_if_same(pid, started, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:  # whatever did not stop in time
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for pid, started in below:
            signal_if_same(pid, started, signal.SIGKILL)


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 / localhost, signed by it (PEM files)."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, key, signer, ca: bool, sans=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("fedhet test CA", "fedhet test CA", ca_key, ca_key, ca=True)
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = cert("127.0.0.1", "fedhet test CA", server_key, ca_key, ca=False, sans=sans)
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (P-384, OpenSSH format, as `ssh-keygen -t ecdsa -b 384` writes)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    openssh = serialization.Encoding.OpenSSH
    public.write_bytes(key.public_key().public_bytes(openssh, serialization.PublicFormat.OpenSSH))
    return private, public


def start_federation(tmp: Path, tls: bool, node_state: bool = False) -> Processes:
    """A SuperLink and two SuperNodes (client ids 0 and 1) on loopback; ``flwr`` connection named "test".

    ``node_state``: each SuperNode keeps its client's state in a state folder ``tmp/node_state/node<cid>``."""
    home = tmp / "flwr_home"
    home.mkdir()
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "OMP_NUM_THREADS": "1",  # the same float reductions as the single-threaded in-process reference
    }
    port = free_port()
    link = ["--insecure"]
    connection = "insecure = true\n"
    node_tls = ["--insecure"]
    if tls:
        certs = make_certificates(tmp)
        link = ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile",
                str(certs["key"]), "--enable-supernode-auth"]  # fmt: skip
        connection = f'root-certificates = "{certs["ca"]}"\n'
        node_tls = ["--root-certificates", str(certs["ca"])]
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\n{connection}'
    )
    procs = Processes(tmp, env)
    try:
        proc, log = procs.start(
            "superlink",
            [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
             "--disable-runtime-dependency-installation", *link],
        )  # fmt: skip
        wait_for_port(port, proc, log)
        for cid in (0, 1):
            auth = []
            if tls:
                private, public = make_node_key(tmp, f"node{cid}")
                flwr(["supernode", "register", str(public), "test"], env, tmp)
                auth = ["--auth-supernode-private-key", str(private)]
            node_port = free_port()
            node_config = f"partition-id={cid} num-partitions=2"
            if node_state:
                node_config += f' state-dir="{tmp / "node_state" / f"node{cid}"}"'
            proc, log = procs.start(
                f"supernode{cid}",
                [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1",
                 "--port", str(node_port), "--node-config", node_config, *node_tls, *auth],
            )  # fmt: skip
            wait_for_port(node_port, proc, log)
    except BaseException:
        procs.stop()
        raise
    return procs


def flwr(args: list[str], env: dict[str, str], cwd: Path) -> str:
    out = subprocess.run(
        [str(BIN / "flwr"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"flwr {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def deploy_config(algorithm: str, out_dir: Path, rounds: int = 2):
    """Two clients (FedProx's Synthetic data, one user each: no scikit-learn import in every ClientApp process)."""
    return build_config(
        {
            "run": {"rounds": rounds, "out_dir": str(out_dir), "progress": False, "seed": 0, "name": algorithm},
            "dataset": {"name": "synthetic", "num_users": 2},
            "partition": {"name": "natural", "num_clients": 2, "local_test_fraction": 0.2},
            "model": {"name": "mlp", "hidden": [32]},
            "train": {"participation": 1.0, "local_epochs": 1, "batch_size": 16, "lr": 0.1},
            "algorithm": {"name": algorithm},
        }
    )


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def run_on_federation(tmp_path: Path, tls: bool, algorithms: tuple[str, ...], node_state: bool = False) -> None:
    """``algorithms`` (at the same time) on a fresh federation; each must match the in-process simulation."""
    procs = start_federation(tmp_path, tls, node_state)
    runs = {}
    try:
        for algorithm in algorithms:
            cfg = deploy_config(algorithm, tmp_path / "flower_runs")
            app = write_app(cfg, tmp_path / f"app-{algorithm}")
            proc, log = procs.start(f"flwr-run-{algorithm}", [str(BIN / "flwr"), "run", str(app), "test", "--stream"])
            runs[algorithm] = (proc, log)
        for algorithm, (proc, log) in runs.items():
            try:
                proc.wait(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"flwr run {algorithm} did not finish in {RUN_TIMEOUT} s:\n{log.read_text()[-4000:]}")
            summary = tmp_path / "flower_runs" / algorithm / "summary.json"
            assert summary.exists(), f"{algorithm}: no summary.json; flwr run said:\n{log.read_text()[-4000:]}"
    finally:
        procs.stop()
    for algorithm in runs:
        ref = Simulation(deploy_config(algorithm, tmp_path / "local_runs")).run()
        assert ref["status"] == "finished"
        got = metrics(tmp_path / "flower_runs" / algorithm)
        want = metrics(tmp_path / "local_runs" / algorithm)
        assert [r["round"] for r in got] == [1, 2]
        assert got == want, f"{algorithm}: Flower deployment and in-process simulation differ"


@pytest.mark.slow  # real processes: a few seconds per message (runs in `make test`; `-m "not slow"` skips it)
def test_superlink_and_two_supernodes_insecure(tmp_path):
    # SuperNodes with state folders: SCAFFOLD's c_i are files there (one per client after the last round)
    run_on_federation(tmp_path, tls=False, algorithms=("fedavg", "scaffold"), node_state=True)
    versions = sorted(p.parent.name for p in (tmp_path / "node_state").rglob("r00000002-p000-*.pt"))
    assert versions == ["client-0", "client-1"]


@pytest.mark.slow
def test_superlink_and_two_supernodes_tls_with_node_authentication(tmp_path):
    # The transport does not depend on the algorithm: SCAFFOLD, the stateful one, covers TLS + authentication.
    run_on_federation(tmp_path, tls=True, algorithms=("scaffold",))


@pytest.mark.slow
def test_secaggplus_on_a_superlink_and_two_supernodes(tmp_path):
    """SecAgg+ (run config secure-aggregation) between real SuperNodes: FedAvg's run up to SecAgg+'s quantisation,
    so the same accuracy and loss to 1e-4 and the model within 1e-4 but not bit-identical (the protocol ran). One
    round: the four SecAgg+ stages start a ClientApp process per node each."""
    from fedhet.engine.checkpoint import read_checkpoint

    procs = start_federation(tmp_path, tls=False)
    try:
        app = write_app(deploy_config("fedavg", tmp_path / "flower_runs", 1), tmp_path / "app-secagg")
        secure = ["--run-config", 'secure-aggregation="secaggplus"']
        proc, log = procs.start("flwr-run-secagg", [str(BIN / "flwr"), "run", str(app), "test", "--stream", *secure])
        try:
            proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flwr run did not finish in {RUN_TIMEOUT} s:\n{log.read_text()[-4000:]}")
    finally:
        procs.stop()
    run_dir = tmp_path / "flower_runs" / "fedavg"
    assert (run_dir / "summary.json").exists(), f"no summary.json; flwr run said:\n{log.read_text()[-4000:]}"
    assert Simulation(deploy_config("fedavg", tmp_path / "local_runs", 1)).run()["status"] == "finished"
    got, want = metrics(run_dir), metrics(tmp_path / "local_runs" / "fedavg")
    assert [r["round"] for r in got] == [r["round"] for r in want] == [1]
    for g, w in zip(got, want, strict=True):
        assert abs(g["test_acc"] - w["test_acc"]) <= 1e-4 and abs(g["test_loss"] - w["test_loss"]) <= 1e-4
    last = [
        read_checkpoint(d / "checkpoints" / "last.pt")["algo"]["global_params"]
        for d in (run_dir, tmp_path / "local_runs" / "fedavg")
    ]
    assert 0 < (last[0] - last[1]).abs().max() <= 1e-4
