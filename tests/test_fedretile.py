"""FedRetile (Hartmann et al. 2019, FedUFO's baseline [5]): FedAvg with the server's Rprop on the pseudo-gradient,
i.e. ``fedhet run -a fedavg --server rprop`` (variant ``fedavg+rprop``). Steps by hand, then a run that learns and
resumes bit for bit (the per-weight steps and the previous update are server state)."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.server_opt import build_server_optimizer
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics


def test_three_rprop_steps_by_hand():
    opt = build_server_optimizer("rprop", {"lr": 0.01, "max_step": 0.013})
    x = torch.zeros(3, dtype=torch.float64)
    opt.init(x)
    # round 1: every weight moves by the first step in the direction of its update
    x = opt.step(x, x + torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(x, torch.tensor([0.01, -0.01, 0.0], dtype=torch.float64))
    # round 2: same sign -> x1.2 (0.012); flipped -> x0.5 (0.005); previous update 0 -> unchanged (0.01)
    x = opt.step(x, x + torch.tensor([0.5, 3.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(x, torch.tensor([0.022, -0.005, -0.01], dtype=torch.float64))
    # round 3: all signs held -> 0.0144 capped at 0.013, 0.006, 0.012; the magnitude of the update never matters
    x = opt.step(x, x + torch.tensor([100.0, 1e-9, -7.0], dtype=torch.float64))
    torch.testing.assert_close(x, torch.tensor([0.035, 0.001, -0.022], dtype=torch.float64))
    torch.testing.assert_close(opt.state["steps"], torch.tensor([0.013, 0.006, 0.012], dtype=torch.float64))


def test_rprop_refuses_a_first_step_outside_its_bounds():
    with pytest.raises(ConfigError, match=r"min_step <= lr <= max_step"):
        build_server_optimizer("rprop", {"lr": 1.0, "max_step": 0.5})


def test_fedretile_learns_and_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 12},
            partition={"name": "shards", "num_clients": 10, "shards_per_client": 2, "local_test": "matched"},
            train={"clients_per_round": 4, "local_epochs": 2, "batch_size": 10, "lr": 0.01, "momentum": 0.9},
            algorithm={"name": "fedavg"},
            server={"name": "rprop"},
        )

    full, resumed = kill_and_resume(make, stop_after=6)
    records = read_metrics(full.run_dir / "metrics.jsonl")
    accs = [r["test_acc"] for r in records]
    assert accs[-1] > 0.6 > accs[0], accs  # 10 classes on 2-class clients
    assert [r["test_acc"] for r in records] == [r["test_acc"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
