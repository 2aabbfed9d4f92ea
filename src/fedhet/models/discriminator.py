"""A client-ID discriminator on a model's embedding (FedUFO's D, Zhang et al. 2021, Sec. 3.2 and 4.1.1).

It maps the feature a body produces to one logit per client of the federation, so that an algorithm can ask "which
client's model made this feature?". It is a plain module, attached by an algorithm's ``prepare_federated_model``
beside the head, so any backbone can take it; ``FedModel.forward`` never reads it.
"""

from __future__ import annotations

from torch import Tensor, nn


class ClientDiscriminator(nn.Module):
    """``layers`` fully connected layers with a ReLU between consecutive ones: ``in_dim`` -> ``hidden`` -> ... ->
    ``num_clients`` logits. FedUFO: two layers with ``hidden = in_dim`` for MNIST and CIFAR-10, three for re-ID."""

    def __init__(self, in_dim: int, num_clients: int, hidden: int | None = None, layers: int = 2) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"a discriminator needs at least one layer, got {layers}")
        hidden = in_dim if hidden is None else hidden
        widths = [in_dim] + [hidden] * (layers - 1) + [num_clients]
        modules: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
            if i:
                modules.append(nn.ReLU())
            modules.append(nn.Linear(a, b))
        self.net = nn.Sequential(*modules)
        self.num_clients = num_clients

    def forward(self, features: Tensor) -> Tensor:
        return self.net(features)
