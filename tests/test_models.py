import pytest
import torch

from fedhet.errors import ConfigError
from fedhet.models import MODELS, FedModel, build_model

BATCH = 3

# (model, input shape, params): every input shape each model claims to support.
CASES = [
    ("cnn", (1, 28, 28), {}),
    ("cnn", (3, 32, 32), {}),
    ("cnn", (3, 32, 32), {"head_bias": False}),
    ("lenet5", (1, 28, 28), {}),
    ("lenet5", (3, 32, 32), {}),
    ("convnet", (1, 28, 28), {}),
    ("convnet", (3, 32, 32), {"channels": [8, 16], "hidden": 32}),
    ("convnet", (1, 8, 8), {}),
    ("mlp", (1, 28, 28), {"hidden": [128], "dropout": 0.5}),
    ("mlp", (3, 32, 32), {}),
    ("mlp", (1, 8, 8), {"hidden": []}),
    ("mlp", (60,), {}),
    ("logreg", (60,), {}),
    ("logreg", (1, 8, 8), {}),
    ("logreg", (1, 28, 28), {}),
    ("lstm", (80,), {}),
    ("lstm", (20,), {"vocab_size": 30, "embed_dim": 4, "hidden": 16, "layers": 1}),
]


def make_input(name: str, shape: tuple[int, ...], params: dict) -> torch.Tensor:
    if name == "lstm":
        return torch.randint(0, params.get("vocab_size", 80), (BATCH, *shape))
    return torch.randn(BATCH, *shape)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,shape,params", CASES)
def test_logits_and_features(name, shape, params):
    torch.manual_seed(0)
    model = build_model(name, shape, 7, **params).eval()
    x = make_input(name, shape, params)
    with torch.no_grad():
        logits = model(x)
        logits_f, features = model.forward_features(x)
        from_embedding = model.head(features["embedding"])
    assert isinstance(model, FedModel)
    assert logits.shape == (BATCH, 7)
    assert torch.equal(logits, logits_f)
    assert torch.allclose(from_embedding, logits)
    assert features["embedding"].shape == (BATCH, model.embedding_dim)
    assert tuple(features) == model.feature_names
    assert model.feature_names[-1] == "embedding"


def test_cnn_taps_are_named_stages():
    model = build_model("cnn", (3, 32, 32), 10)
    _, features = model.forward_features(torch.randn(2, 3, 32, 32))
    assert {k: tuple(v.shape) for k, v in features.items()} == {
        "conv1": (2, 64, 14, 14),
        "conv2": (2, 64, 5, 5),
        "fc1": (2, 384),
        "embedding": (2, 192),
    }


def test_cnn_parameter_count():
    conv1 = 3 * 64 * 5 * 5 + 64
    conv2 = 64 * 64 * 5 * 5 + 64
    fc1 = 64 * 5 * 5 * 384 + 384
    fc2 = 384 * 192 + 192
    head = 192 * 10 + 10
    assert n_params(build_model("cnn", (3, 32, 32), 10)) == conv1 + conv2 + fc1 + fc2 + head == 797_962
    no_bias = build_model("cnn", (3, 32, 32), 10, head_bias=False)
    assert no_bias.head.bias is None
    assert n_params(no_bias) == 797_962 - 10


def test_lenet5_parameter_count():
    conv1 = 3 * 6 * 5 * 5 + 6
    conv2 = 6 * 16 * 5 * 5 + 16
    fc1 = 16 * 5 * 5 * 120 + 120
    fc2 = 120 * 84 + 84
    head = 84 * 10 + 10
    assert n_params(build_model("lenet5", (3, 32, 32), 10)) == conv1 + conv2 + fc1 + fc2 + head == 62_006
    # 28x28 inputs are padded to LeNet's 32x32 geometry, so only the first conv's input channels change.
    assert n_params(build_model("lenet5", (1, 28, 28), 10)) == 62_006 - 2 * 6 * 5 * 5


def test_fedbc_mnist_mlp_and_logreg_sizes():
    assert n_params(build_model("mlp", (1, 28, 28), 10, hidden=[128], dropout=0.5)) == 784 * 128 + 128 + 1290
    logreg = build_model("logreg", (60,), 10)
    assert n_params(logreg) == 60 * 10 + 10
    assert logreg.feature_names == ("embedding",)


def test_lstm_matches_fedbc_shakespeare_model():
    model = build_model("lstm", (80,), 80)
    body = model.body.lstm
    assert body.embed.num_embeddings == 80 and body.embed.embedding_dim == 8
    assert body.lstm.hidden_size == 256 and body.lstm.num_layers == 2
    assert model.head.in_features == 256 and model.head.out_features == 80


@pytest.mark.parametrize("name", ["cnn", "lenet5", "convnet", "mlp", "logreg"])
def test_construction_is_deterministic(name):
    shape = (1, 28, 28)
    torch.manual_seed(123)
    first = build_model(name, shape, 10).state_dict()
    torch.manual_seed(123)
    second = build_model(name, shape, 10).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_every_model_has_a_summary_and_params():
    for entry in MODELS.entries():
        assert entry.summary and entry.params is not None


@pytest.mark.parametrize(
    "name,shape,params,message",
    [
        ("mlp", (60,), {"hiden": [10]}, "lora_ranks_by, hidden, dropout; did you mean 'model.hidden'?"),
        ("lenet5", (3, 32, 32), {"head_bias": False}, "unknown key 'model.head_bias' for model 'lenet5'"),
        ("mlp", (60,), {"dropout": 1.5}, "dropout: must be less than 1 (got 1.5)"),
        ("convnet", (1, 28, 28), {"channels": [8]}, "channels.1:"),
        ("cnn", (3, 32, 32), {"head_bias": "maybe"}, "head_bias:"),
        ("cnn", (1, 8, 8), {}, "too small"),
        ("cnn", (60,), {}, "(3, 32, 32)"),
        ("lstm", (1, 28, 28), {}, "(80,)"),
        ("resnet99", (3, 32, 32), {}, "choose one of"),
    ],
)
def test_bad_configuration_raises_config_error(name, shape, params, message):
    with pytest.raises(ConfigError) as info:
        build_model(name, shape, 10, **params)
    assert message in str(info.value)


def test_convnet_without_hidden_layer_is_fedrane_cnnmodel():
    """FedRANE's official CNNModel: conv5x5 1->16 pad 2, pool, conv5x5 16->32 pad 2, pool, FC 1568 -> C."""
    model = build_model("convnet", (1, 28, 28), 10, channels=(16, 32), hidden=0)
    assert model.embedding_dim == 32 * 7 * 7
    expected = (16 * 25 + 16) + (32 * 16 * 25 + 32) + (1568 * 10 + 10)
    assert sum(p.numel() for p in model.parameters()) == expected
    logits, feats = model.forward_features(torch.randn(3, 1, 28, 28))
    torch.testing.assert_close(model.head(feats["embedding"]), logits)
