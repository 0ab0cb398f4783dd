"""The embedded text corpus (pydoc_data.topics as bytes) and its next-token windows: NumPy only, offline, seconds."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from adaloss_cli.config.schema import DataConfig
from adaloss_cli.data import LANGUAGE_MODEL, BatchStream, eval_batches, load_dataset
from adaloss_cli.data.text import VOCAB_SIZE, corpus_text, cut_windows, decode, encode, split_corpus
from adaloss.errors import UserError

BLOCK = 32


def _text(**options):
    return load_dataset(DataConfig(name="text", block_size=BLOCK, **options), seed=0)


def test_the_corpus_is_python_s_own_english_help_text_in_sorted_topic_order():
    from pydoc_data.topics import topics

    text = corpus_text()
    assert text.startswith(topics[sorted(topics)[0]])
    assert len(text) > 100_000 and "statement" in text
    assert decode(encode(text)) == text
    assert encode("é").tolist() == [0xC3, 0xA9]  # bytes, so any text fits the vocabulary of 256


def test_needs_no_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the text dataset tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert _text().num_train > 0


def test_windows_are_next_token_examples_as_int64():
    ds = _text()
    assert ds.task == LANGUAGE_MODEL and ds.num_classes == VOCAB_SIZE == 256 and ds.input_shape == (BLOCK,)
    for x, y in ((ds.x_train, ds.y_train), (ds.x_val, ds.y_val)):
        assert x.dtype == y.dtype == np.int64 and x.shape == y.shape and x.shape[1] == BLOCK
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # the target is the input shifted by one
        np.testing.assert_array_equal(x[1:, 0], y[:-1, -1])  # consecutive windows: every token a target once
        assert 0 <= x.min() and x.max() < 256


def test_validation_is_the_end_of_the_corpus_and_the_split_needs_no_seed():
    tokens = encode(corpus_text())
    ds = _text(val_fraction=0.1)
    val_tokens = len(tokens) - int(round(0.9 * len(tokens)))
    start = len(tokens) - val_tokens
    np.testing.assert_array_equal(ds.x_val[0], tokens[start:start + BLOCK])
    np.testing.assert_array_equal(ds.x_train[0], tokens[:BLOCK])
    assert ds.num_val == (val_tokens - 1) // BLOCK
    other_seed = load_dataset(DataConfig(name="text", block_size=BLOCK, val_fraction=0.1), seed=7)
    for name in ("x_train", "y_train", "x_val", "y_val"):
        np.testing.assert_array_equal(getattr(ds, name), getattr(other_seed, name))


def test_deterministic_and_never_normalised_into_floats():
    first, second = _text(normalize=True), _text(normalize=True)
    np.testing.assert_array_equal(first.x_train, second.x_train)
    assert first.x_train.dtype == np.int64 and first.mean is None


def test_limit_train_is_a_seeded_choice_of_windows():
    ds = _text(limit_train=10)
    assert ds.num_train == 10
    np.testing.assert_array_equal(ds.x_train, _text(limit_train=10).x_train)


def test_batches_and_evaluation_batches_keep_the_token_ids():
    ds = _text()
    x, y = BatchStream(ds, 8, seed=0).batch(0, 0)
    assert x.shape == y.shape == (8, BLOCK) and x.dtype == np.int64
    batches = list(eval_batches(ds.x_val, ds.y_val, 1000))
    assert sum(len(bx) for bx, _ in batches) == ds.num_val


def test_cut_windows_drops_a_short_tail_and_split_corpus_takes_the_end():
    x, y = cut_windows(np.arange(10), 3)  # windows 0..3, 3..6, 6..9
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert cut_windows(np.arange(3), 3)[0].shape == (0, 3)
    train, val = split_corpus(np.arange(10), 0.2)
    assert train.tolist() == list(range(8)) and val.tolist() == [8, 9]


def test_a_block_longer_than_the_validation_text_is_a_user_error():
    with pytest.raises(UserError, match=r"data.block_size 100000 leaves no validation example .* lower "
                                        r"data.block_size"):
        load_dataset(DataConfig(name="text", block_size=100_000, val_fraction=0.1), seed=0)
