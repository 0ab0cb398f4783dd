"""The embedded text corpus and how it is cut into next-token examples.

The corpus is the English help text that ships inside CPython's standard library (``pydoc_data.topics``: the
language reference's topics behind ``help("assert")`` and friends, about 465,000 characters on Python 3.11), so it
needs no download and no extra package. Its topics are joined in sorted key order, which makes the text a function
of the Python version alone.

Tokens are the text's UTF-8 bytes (vocabulary 256). A character vocabulary would be a little smaller (the 3.11 text
uses 103 characters, so the model's head would be 103 wide rather than 256, about 8% less compute for the shipped
GPT), but it would be read off the corpus, so it and the model's shape would change whenever a Python release edits
the text; bytes are a fixed vocabulary with no unknown symbol and decode with ``bytes(ids).decode()``.
"""

from __future__ import annotations

import numpy as np

#: Token ids are bytes.
VOCAB_SIZE = 256


def corpus_text() -> str:
    """The topics of ``pydoc_data.topics`` joined in sorted key order."""
    from pydoc_data.topics import topics  # a 500 kB module: imported only when text data is asked for

    return "".join(topics[key] for key in sorted(topics))


def encode(text: str) -> np.ndarray:
    """Token ids (int64) of ``text``: its UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode(tokens: np.ndarray) -> str:
    """The text of token ids (invalid UTF-8, e.g. a cut multi-byte character, shows as U+FFFD)."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def split_corpus(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the validation part is the last ``val_fraction`` of the tokens, so no window of one
    part overlaps the other and the split needs no seed."""
    cut = len(tokens) - int(round(val_fraction * len(tokens)))
    return tokens[:cut], tokens[cut:]


def cut_windows(tokens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets (each int64, windows x ``block_size``) of consecutive windows of ``block_size + 1``
    tokens: x = window[:-1], y = window[1:].

    Windows start every ``block_size`` tokens, so neighbours share one token and every token after the first is a
    target exactly once. A tail shorter than a window is dropped.
    """
    count = max((len(tokens) - 1) // block_size, 0)
    if count == 0:
        return np.empty((0, block_size), dtype=np.int64), np.empty((0, block_size), dtype=np.int64)
    windows = tokens[np.arange(count)[:, None] * block_size + np.arange(block_size + 1)]
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
