"""Next-character LSTM for Shakespeare (LEAF), as in FedBC's code."""

from __future__ import annotations

from pydantic import PositiveInt
from torch import Tensor, nn

from fedhet.models.base import MODELS, FedModel, ModelParams, check_rank


class CharLSTM(nn.Module):
    """Embedding -> stacked LSTM -> output of the last time step, (B, L) int64 -> (B, hidden)."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(x))
        return out[:, -1]


class LSTMParams(ModelParams):
    # All defaults from chenfan95/FedBC (Shakespeare): 80-character vocabulary, 2 layers of 256, no dropout.
    vocab_size: PositiveInt = 80
    embed_dim: PositiveInt = 8
    hidden: PositiveInt = 256
    layers: PositiveInt = 2


@MODELS.register(
    "lstm", "Shakespeare next-char LSTM (embed 8, 2x256, last step); chenfan95/FedBC, LEAF", params=LSTMParams
)
def build_lstm(input_shape: tuple[int, ...], num_classes: int, p: LSTMParams) -> FedModel:
    check_rank("lstm", input_shape, 1, "(80,)")
    body = CharLSTM(p.vocab_size, p.embed_dim, p.hidden, p.layers)
    return FedModel({"lstm": body}, p.hidden, num_classes)
