"""Built-in and generated datasets: scikit-learn's digits and Synthetic(alpha, beta) of FedProx."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedhet.data.datasets.base import DATASETS, DIGITS, NoParams, image_dataset
from fedhet.data.types import ArrayDataset
from fedhet.params import Seed
from fedhet.registry import parse_params


class DigitsParams(NoParams):
    test_fraction: float = Field(0.25, gt=0, lt=1)


class SyntheticParams(NoParams):
    alpha: float = Field(0.5, ge=0)
    beta: float = Field(0.5, ge=0)
    num_users: int = Field(30, ge=1)
    dim: int = Field(60, ge=1)
    num_classes: int = Field(10, ge=2)
    iid: bool = False
    seed: Seed = 0
    # "default": draws in the order of FedProx's generate_synthetic from a seeded numpy Generator, no test split.
    # "fedbc": the FedBC code's partition.py (chenfan95/FedBC, create_partition_synthetic.sh uses seed 1) exactly:
    # numpy's legacy RandomState, multivariate_normal features, then per user Python's random.shuffle and a train /
    # test cut at int(0.8 n), the test parts returned as the test set with their users (partition.local_test =
    # "natural" gives each client its own).
    generator: Literal["default", "fedbc"] = "default"


@DATASETS.register("digits", "scikit-learn digits: 1797 8x8 grey digits, 10 classes", DigitsParams)
def load_digits(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    import sklearn
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    p = parse_params("dataset", "digits", DigitsParams, params)
    bunch = sk_digits()
    x = bunch.images.astype(np.uint8)[:, None]  # values 0..16
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, bunch.target, test_size=p.test_fraction, stratify=bunch.target, random_state=0
    )
    source = f"scikit-learn {sklearn.__version__} load_digits()"  # provenance: the hash of the arrays
    return image_dataset("digits", (x_tr, y_tr), (x_te, y_te), 10, DIGITS, scale=16.0, source=source)


@DATASETS.register("synthetic", "Synthetic(alpha, beta) of FedProx, one natural client per user", SyntheticParams)
def load_synthetic(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "synthetic", SyntheticParams, params)
    if p.generator == "fedbc":
        xs, ys = synthetic_users(p)
        cuts = fedbc_splits([len(y) for y in ys], p.seed)
        train = [(x[order[:cut]], y[order[:cut]]) for x, y, (order, cut) in zip(xs, ys, cuts, strict=True)]
        test = [(x[order[cut:]], y[order[cut:]]) for x, y, (order, cut) in zip(xs, ys, cuts, strict=True)]
    else:
        train, test = list(zip(*synthetic_users(p), strict=True)), []
    return ArrayDataset(
        name="synthetic",
        x_train=np.concatenate([x for x, _ in train]).astype(np.float32),
        y_train=np.concatenate([y for _, y in train]),
        x_test=np.concatenate([x for x, _ in test]).astype(np.float32) if test else np.empty((0, p.dim), np.float32),
        y_test=np.concatenate([y for _, y in test]) if test else np.empty(0, np.int64),
        num_classes=p.num_classes,
        input_shape=(p.dim,),
        task="tabular",
        groups_train=user_ids([len(y) for _, y in train]),
        groups_test=user_ids([len(y) for _, y in test]) if test else None,
        extra={"params": p.model_dump()},
        source_dir="generated (synthetic)",  # content_hash: the hash of the generated arrays
    )


def user_ids(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def synthetic_users(p: SyntheticParams) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """FedProx's generate_synthetic (as FedBC uses it): the draws in its order. ``generator = "default"`` draws from
    a seeded numpy Generator (features as mean + standard normal x sigma, labels the argmax of the logits);
    ``"fedbc"`` is the FedBC code's draw for draw: numpy's legacy RandomState, features from
    ``multivariate_normal``, labels the argmax of the softmax of each row's ``x . W + b`` computed row by row in
    float64 (a vectorised product can round differently and flip a near tie; an overflowing row gives nan, which
    argmax picks, as theirs does)."""
    legacy = p.generator == "fedbc"
    rng = np.random.RandomState(p.seed) if legacy else np.random.default_rng(p.seed)
    n, d, k = p.num_users, p.dim, p.num_classes
    sizes = rng.lognormal(4, 2, n).astype(np.int64) + 50
    mean_w = rng.normal(0, p.alpha, n)  # the bias prior shares this mean
    b_prior = rng.normal(0, p.beta, n)
    mean_x = [np.full(d, b) if p.iid else rng.normal(b, 1, d) for b in b_prior]
    if p.iid:
        w_global, b_global = rng.normal(0, 1, (d, k)), rng.normal(0, 1, k)
    xs, ys = [], []
    for i in range(n):
        w, b = rng.normal(mean_w[i], 1, (d, k)), rng.normal(mean_w[i], 1, k)
        if p.iid:
            w, b = w_global, b_global
        if legacy:
            x = rng.multivariate_normal(
                mean_x[i], np.diag(np.power(np.arange(1, d + 1, dtype=np.float64), -1.2)), sizes[i]
            )
            with np.errstate(over="ignore", invalid="ignore"):
                y = np.array([np.argmax(np.exp(row @ w + b) / np.sum(np.exp(row @ w + b))) for row in x], np.int64)
        else:
            x = mean_x[i] + rng.standard_normal((sizes[i], d)) * np.arange(1, d + 1) ** -0.6  # Sigma = diag(j^-1.2)
            y = np.argmax(x @ w + b, axis=1).astype(np.int64)  # argmax of softmax = argmax of logits
        xs.append(x)
        ys.append(y)
    return xs, ys


def fedbc_splits(sizes: list[int], seed: int) -> list[tuple[np.ndarray, int]]:
    """Per user, the order Python's ``random.shuffle`` (seeded once with ``seed``, users in turn) puts its samples
    in, and the train / test cut ``int(0.8 n)``: the FedBC code's generate_synthetic_datasets."""
    rng = random.Random(seed)
    out = []
    for n in sizes:
        order = list(range(n))
        rng.shuffle(order)  # the permutation depends only on the length: the same as shuffling their (x, y) pairs
        out.append((np.array(order, np.int64), int(0.8 * n)))
    return out
