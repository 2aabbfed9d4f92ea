"""Transformer backbones by name, pretrained weights and a run started from a checkpoint (issue 46, items 1, 2, 6).

The models are built from their configs (no download); pretrained weights are a folder a test writes with
``save_pretrained``; ``model.init`` is a run folder, a torch state dict or a .safetensors file. Bad input is one line.
"""

from __future__ import annotations

import pytest
import torch
from test_integrity import same_run

from fedhet.engine.batched import model_unbatchable
from fedhet.engine.checkpoint import read_checkpoint
from fedhet.engine.initial import INIT_KEY
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.models import MODELS, build_model
from fedhet.models.fit import fits, misfit
from fedhet.naming import run_name
from fedhet.toolkit.flat import FlatModel

transformers = pytest.importorskip("transformers")

TINY_VIT = {"name": "vit_tiny", "patch_size": 4, "hidden": 32, "heads": 2, "mlp": 64}
TINY_GPT = {"name": "gpt_tiny", "hidden": 32, "heads": 2, "mlp": 64}
SHAKESPEARE = {"name": "shakespeare", "max_roles": 3, "seq_len": 16, "train_fraction": 0.03}
SHAKESPEARE_CLIENTS = {"name": "natural", "num_clients": 3, "local_test_fraction": 0.2}
BACKBONES = ["bert_base", "bert_tiny", "distilbert", "gpt2", "gpt_tiny", "vit_base", "vit_tiny"]


def global_model(sim: Simulation) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sim.model.named_parameters()}


# ---------------------------------------------------------------------------------------------- the models
def test_every_backbone_is_registered_and_the_tiny_ones_train_shapes():
    assert set(BACKBONES) <= set(MODELS.names())
    torch.manual_seed(0)
    vit = build_model("vit_tiny", (3, 32, 32), 10)
    logits, features = vit.forward_features(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10) and features["embedding"].shape == (2, 64)
    for name in ("bert_tiny", "gpt_tiny"):
        model = build_model(name, (80,), 80)
        logits, features = model.forward_features(torch.randint(0, 80, (2, 80)))
        assert logits.shape == (2, 80) and features["embedding"].shape == (2, 64)
    # the eager attention (deterministic on the CPU), no dropout in the tiny presets
    assert vit.body.vit.vit.config._attn_implementation == "eager"
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in vit.modules())
    assert model_unbatchable(FlatModel(vit)) is None


def test_the_standard_sizes_build_from_their_configs_offline():
    with torch.device("meta"):
        sizes = {n: sum(p.numel() for p in build_model(n, s, 2).body.parameters()) for n, s in STANDARD.items()}
    assert sizes == {"vit_base": 85_798_656, "bert_base": 109_482_240, "distilbert": 66_953_472, "gpt2": 124_439_808}


STANDARD = {"vit_base": (3, 224, 224), "bert_base": (128,), "distilbert": (128,), "gpt2": (128,)}


def test_which_datasets_each_backbone_takes():
    assert {"mnist", "cifar10"} <= set(fits("vit_tiny")) and "shakespeare" not in fits("vit_tiny")
    assert fits("gpt_tiny") == ["shakespeare"] == fits("bert_tiny")
    wrong = misfit("gpt_tiny", {}, "mnist", {})
    assert "sequences of character indices, not image inputs" in wrong and "vit_tiny" in wrong
    assert "too small for patches of 16" in misfit("vit_tiny", {"patch_size": 16}, "digits", {})


def test_padding_masks_keep_bert_out_of_the_batched_executor_and_gpt_in():
    bert = FlatModel(build_model("bert_tiny", (16,), 2))
    assert "masks padding in attention (model.pad_id)" in model_unbatchable(bert)
    assert model_unbatchable(FlatModel(build_model("bert_tiny", (16,), 2, pad_id=None))) is None
    assert model_unbatchable(FlatModel(build_model("gpt_tiny", (16,), 2, pad_id=0))) is None


def test_gpt_reads_left_padding_as_if_it_were_not_there():
    torch.manual_seed(0)
    model = build_model("gpt_tiny", (12,), 80, pad_id=0).eval()
    text = torch.randint(1, 80, (1, 8))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), text], 1)
    short = build_model("gpt_tiny", (8,), 80, pad_id=0).eval()
    short.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(padded), short(text))


# ---------------------------------------------------------------------------------------------- kill and resume
@pytest.mark.parametrize(
    "dataset, model",
    [({"name": "digits"}, TINY_VIT), (SHAKESPEARE, TINY_GPT)],
    ids=["vit_tiny", "gpt_tiny"],
)
def test_a_killed_and_resumed_backbone_run_is_bit_exact(tiny_config, kill_and_resume, dataset, model):
    extra = {"partition": SHAKESPEARE_CLIENTS} if dataset["name"] == "shakespeare" else {}

    def make(name):
        return tiny_config(run={"name": name, "rounds": 3}, dataset=dataset, model=model, **extra)

    full, resumed = kill_and_resume(make)
    same_run(full, resumed)


def test_vit_tiny_trains_batched_as_it_trains_one_client_at_a_time(tiny_config):
    def make(name, executor):
        return tiny_config(run={"name": name, "rounds": 2, "executor": executor}, model=TINY_VIT)

    batched = Simulation(make("b", "batched"))
    batched.run()
    assert batched.executor_kind == "batched"
    sequential = Simulation(make("s", "sequential"))
    sequential.run()
    torch.testing.assert_close(batched.algo.global_params, sequential.algo.global_params, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- pretrained weights
def save_vit(folder, num_labels: int, with_head: bool = True):
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=num_labels,
    )  # fmt: skip
    torch.manual_seed(123)
    cls = transformers.ViTForImageClassification if with_head else transformers.ViTModel
    model = cls(config)
    model.save_pretrained(folder)
    return model


def test_a_pretrained_folder_gives_the_initial_global_model(tiny_config, tmp_path, capsys):
    saved = save_vit(tmp_path / "vit", 10)
    sim = Simulation(tiny_config(run={"rounds": 1}, model={"name": "vit_tiny", "pretrained": str(tmp_path / "vit")}))
    start = global_model(sim)
    torch.testing.assert_close(start["head.weight"], saved.classifier.weight, rtol=0, atol=0)
    for key, value in saved.vit.state_dict().items():
        torch.testing.assert_close(start.get(f"body.vit.vit.{key}", value), value, rtol=0, atol=0)
    assert start["body.vit.vit.embeddings.cls_token"].equal(saved.vit.embeddings.cls_token)
    sim.run()
    assert "note: the initial global model is model.pretrained" in capsys.readouterr().err


def test_a_pretrained_head_of_other_classes_is_refused_unless_replaced(tiny_config, tmp_path, capsys):
    save_vit(tmp_path / "vit", 5)
    model = {"name": "vit_tiny", "pretrained": str(tmp_path / "vit")}
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model=model))
    message = str(info.value)
    assert "\n" not in message and "head does not fit the dataset's 10 classes" in message
    assert "(5, 32), the model's (10, 32)" in message and "model.replace_head = true" in message
    sim = Simulation(tiny_config(run={"rounds": 1}, model={**model, "replace_head": True}))
    assert sim.model.head.weight.shape == (10, 32)
    sim.run()
    err = capsys.readouterr().err
    assert "a fresh head for 10 classes, drawn from the run seed (model.replace_head)" in err
    info = sim.run_dir / "provenance.json"
    assert "model.replace_head" in info.read_text()


def test_a_pretrained_body_without_a_head_gets_a_fresh_head(tiny_config, tmp_path):
    save_vit(tmp_path / "vit", 2, with_head=False)
    sim = Simulation(tiny_config(model={"name": "vit_tiny", "pretrained": str(tmp_path / "vit")}))
    assert any("it has no trained head" in note for note in sim.weights.notes)


def test_a_hub_id_not_cached_offline_is_one_line(tiny_config, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model={"name": "vit_base", "pretrained": "nobody/no-such-vit"}))
    message = str(info.value)
    assert "\n" not in message and message.startswith("model 'vit_base': model.pretrained 'nobody/no-such-vit'")
    assert str(tmp_path / "hub") in message and "HF_HUB_OFFLINE is set" in message


def test_a_pretrained_model_of_another_family_is_refused(tiny_config, tmp_path):
    save_vit(tmp_path / "vit", 10)
    with pytest.raises(ConfigError, match="is a 'vit' model, not 'gpt2'; choose one of the gpt2 models"):
        model = {**TINY_GPT, "pretrained": str(tmp_path / "vit")}
        Simulation(tiny_config(model=model, dataset=SHAKESPEARE, partition=SHAKESPEARE_CLIENTS))


# ---------------------------------------------------------------------------------------------- model.init
def test_a_run_starts_from_another_runs_final_global_model(tiny_config):
    source = Simulation(tiny_config(run={"name": "source", "rounds": 2}))
    source.run()
    cfg = tiny_config(run={"name": "started"}, model={"init": str(source.run_dir)})
    started = Simulation(cfg)
    torch.testing.assert_close(started.algo.global_params, source.algo.global_params, rtol=0, atol=0)
    assert "(the global model after round 2)" in started.weights.source
    assert run_name(cfg) != run_name(tiny_config(run={"name": None}))
    assert run_name(tiny_config(model={"init": "a.pt"})) != run_name(tiny_config())  # the init is a setting


def test_a_state_dict_and_a_safetensors_file_start_a_run(tiny_config, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(7)
    donor = build_model("mlp", (1, 8, 8), 10, hidden=[32])
    torch.save(donor.state_dict(), tmp_path / "w.pt")
    save_file(donor.state_dict(), str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        sim = Simulation(tiny_config(model={"init": str(tmp_path / name)}))
        torch.testing.assert_close(sim.algo.global_params, FlatModel(donor).get_params(), rtol=0, atol=0)


def test_an_init_of_other_shapes_names_the_first_tensor_that_does_not_fit(tiny_config, tmp_path):
    torch.save(build_model("mlp", (1, 8, 8), 10, hidden=[16]).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model={"init": str(tmp_path / "w.pt")}))
    assert str(info.value) == (
        f"model.init '{tmp_path / 'w.pt'}' does not fit model tensor 'body.fc1.1.weight': its shape is (16, 64), the "
        "model's (32, 64)"
    )


def test_an_init_of_another_architecture_names_a_few_tensors(tiny_config, tmp_path):
    torch.save(build_model("vit_tiny", (1, 8, 8), 10, patch_size=4).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model={"init": str(tmp_path / "w.pt")}))
    message = str(info.value)
    assert "\n" not in message and "is another architecture than this model: it lacks 2 of the model's 4" in message
    assert "body.fc1.1.weight, body.fc1.1.bias" in message and "it has body.vit.vit.embeddings.cls_token" in message


def test_an_init_head_of_other_classes_is_refused_unless_replaced(tiny_config, tmp_path):
    torch.save(build_model("mlp", (1, 8, 8), 3, hidden=[32]).state_dict(), tmp_path / "w.pt")
    model = {"init": str(tmp_path / "w.pt")}
    with pytest.raises(ConfigError, match=r"head does not fit the dataset's 10 classes \(head.weight is \(3, 32\)"):
        Simulation(tiny_config(model=model))
    sim = Simulation(tiny_config(model={**model, "replace_head": True}))
    assert sim.weights.notes[1] == "a fresh head for 10 classes, drawn from the run seed (model.replace_head)"


@pytest.mark.parametrize(
    "model, expected",
    [
        ({"replace_head": True}, "model.replace_head replaces the head of the weights model.init or model.pretrained"),
        ({"init": "/nowhere/w.pt"}, "model.init '/nowhere/w.pt' cannot be read: No such file or directory"),
    ],
)
def test_bad_init_settings_are_one_line(tiny_config, model, expected):
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model=model))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_folder_without_a_run_and_a_file_of_something_else_are_one_line(tiny_config, tmp_path):
    (tmp_path / "x.pt").write_bytes(b"not a torch file")
    for path, expected in [(tmp_path, "is a folder without a fedhet run's checkpoint"), (tmp_path / "x.pt", "is not")]:
        with pytest.raises(ConfigError, match=expected):
            Simulation(tiny_config(model={"init": str(path)}))


def test_a_resume_whose_init_file_changed_is_refused(tiny_config, tmp_path):
    torch.manual_seed(3)
    torch.save(build_model("mlp", (1, 8, 8), 10, hidden=[32]).state_dict(), tmp_path / "w.pt")

    def make(rounds):
        return tiny_config(run={"name": "init", "rounds": rounds}, model={"init": str(tmp_path / "w.pt")})

    first = Simulation(make(2))
    first.run(stop_after=1)
    assert len(read_checkpoint(first.checkpoint_path)[INIT_KEY]) == 64
    assert "sha256" in (first.run_dir / "provenance.json").read_text()
    torch.manual_seed(4)
    torch.save(build_model("mlp", (1, 8, 8), 10, hidden=[32]).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"has changed since the run was checkpointed \(sha256 [0-9a-f]{12}"):
        Simulation(make(2)).run(resume=True)


def test_a_misspelt_backbone_lists_the_valid_ones(tiny_config):
    with pytest.raises(ConfigError) as info:
        Simulation(tiny_config(model={"name": "vit_tin"}))
    assert "vit_tiny" in str(info.value) and "did you mean 'vit_tiny'" in str(info.value)


# ---------------------------------------------------------------------------------------------- tokenisation
WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "the", "a"]


@pytest.fixture
def reviews(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = torch.Generator().manual_seed(0)
    rows, labels = [], []
    for i in range(120):
        mood = i % 2
        words = [WORDS[int(j)] for j in torch.randint(0, 3, (3,), generator=rng) + 3 * mood] + ["the", "movie"]
        rows.append(" ".join(words))
        labels.append(mood)
    path = tmp_path / "reviews.parquet"
    datasets.Dataset.from_dict({"text": rows, "label": labels}).to_parquet(str(path))
    return path


def save_bert(folder) -> transformers.PreTrainedTokenizerBase:
    """A tiny BERT classifier with its own word-piece tokenizer, as save_pretrained writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    pieces = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    pieces.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    pieces.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=pieces, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    tokenizer.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(5)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return tokenizer


def text_config(tiny_config, path, tmp_path, extra=None, **model):
    dataset = {"name": "hf", "path": str(path), "task": "text", "seq_len": 8, "data_dir": str(tmp_path / "data")}
    return tiny_config(
        run={"rounds": 1}, dataset={**dataset, **(extra or {})}, model={"name": "bert_tiny", **model},
        partition={"name": "iid", "num_clients": 3},
    )  # fmt: skip


def test_a_pretrained_folder_with_a_tokenizer_tokenises_the_text(tiny_config, reviews, tmp_path):
    tokenizer = save_bert(tmp_path / "bert")
    cfg = text_config(tiny_config, reviews, tmp_path, pretrained=str(tmp_path / "bert"), pooling="cls")
    assert cfg.dataset.params()["tokenizer"] == str(tmp_path / "bert")  # the model's, without asking
    sim = Simulation(cfg)
    first = sim.fed.x_test[0].tolist()
    assert first[0] == tokenizer.cls_token_id and first[6] == tokenizer.sep_token_id  # [CLS], five words, [SEP]
    assert tokenizer.unk_token_id not in first and tokenizer.decode(first[1:6]).split()[-2:] == ["the", "movie"]
    assert first[7] == tokenizer.pad_token_id  # padded on the right, as BERT is
    sim.run()


def test_a_tokenizer_vocabulary_beyond_the_embedding_is_one_line(tiny_config, reviews, tmp_path):
    save_bert(tmp_path / "bert")
    cfg = text_config(tiny_config, reviews, tmp_path, {"tokenizer": str(tmp_path / "bert")}, vocab_size=8)
    with pytest.raises(ConfigError, match=r"token ids go up to 1\d, and model 'bert_tiny' embeds 8: set model.vocab_"):
        Simulation(cfg)


def test_a_byte_pair_vocabulary_is_learnt_from_the_training_split(reviews, tmp_path):
    from fedhet.data.datasets import load_dataset

    def load(folder):
        return load_dataset("hf", tmp_path / folder, path=str(reviews), tokens="bpe", vocab_size=60, seq_len=6)

    first, second = load("a"), load("b")
    assert first.extra["vocab"][:2] == ["<pad>", "<unk>"] and len(first.extra["vocab"]) <= 60
    # five words, each a piece of its own once learnt: one padding id on the left, nothing unknown
    assert (first.x_train[:, 0] == 0).all() and (first.x_train[:, 1:] > 1).all() and first.x_train.max() < 60
    assert (first.x_train == second.x_train).all() and first.extra["vocab"] == second.extra["vocab"]
