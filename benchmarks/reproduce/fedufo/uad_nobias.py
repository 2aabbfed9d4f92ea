"""Diagnostic plug-in for diagnose.sh (not part of fedhet): FedUAD whose server resets the averaged discriminator's
output bias to zero after every round, to test whether the drift of that bias (only the round's 10 ids are trained
up) is what makes the UAD loss hurt. It is not (docs/reproductions/fedufo.md)."""

from __future__ import annotations

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.fedufo import FedUADConfig, FedUFO


@ALGORITHMS.register("feduad_nobias", "FedUAD, output bias of D reset every round (diagnostic)", FedUADConfig)
class FedUADNoBias(FedUFO):
    name = "feduad_nobias"
    Config = FedUADConfig

    def aggregate(self, rnd, replies, phase):
        out = super().aggregate(rnd, replies, phase)
        if phase == "posterior":
            k = self.setup.num_clients
            d = self.disc_slice()
            self.global_params[d.stop - k : d.stop] = 0.0  # the last layer's bias is the slice's tail
        return out
