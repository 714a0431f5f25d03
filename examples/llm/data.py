"""Token sources and the batch sampler.

A corpus is one 1-D token array: the default is Python's bundled documentation text
(`pydoc_data.topics`, no download) read as bytes (vocab 256); a user's text file or folder is
read the same way; a pre-tokenised `.bin` (uint16) or `.npy` file is memory-mapped. The last
`eval_fraction` of the tokens is the held-out split.

Batches are a pure function of (seed, step): batch `step` takes `batch` windows of `seq_len + 1`
tokens at offsets drawn from `numpy.random.default_rng([seed, step])`. The data iterator's
position is therefore the step number, which the checkpoint stores, so a resumed run reads the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray
    eval: np.ndarray
    vocab: int
    name: str


def default_text() -> bytes:
    import pydoc_data.topics as topics  # noqa: PLC0415 - stdlib, loaded on demand

    return "".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def _read_text_files(path: Path) -> bytes:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    chunks = []
    for f in files:
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # not a text file
        chunks.append(raw)
    if not chunks:
        raise ValueError(f"data: no UTF-8 text files under {path}")
    return b"\n".join(chunks)


def load_tokens(data: str | None) -> tuple[np.ndarray, int, str]:
    """(tokens, vocab, name) of `data`: None (the default corpus), a text file or folder, or a
    `.bin`/`.npy` token file (memory-mapped; vocab = max token + 1)."""
    if data is None:
        return np.frombuffer(default_text(), dtype=np.uint8), 256, "pydoc_data.topics"
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data: {path} does not exist")
    if path.is_file() and path.suffix in (".bin", ".npy"):
        tokens = np.memmap(path, dtype=np.uint16, mode="r") if path.suffix == ".bin" else np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"data: expected a 1-D integer token array in {path}, got {tokens.dtype}{tokens.shape}")
        return tokens, int(tokens.max()) + 1, str(path)
    return np.frombuffer(_read_text_files(path), dtype=np.uint8), 256, str(path)


def load_corpus(data: str | None, eval_fraction: float = 0.1) -> Corpus:
    tokens, vocab, name = load_tokens(data)
    split = int(len(tokens) * (1.0 - eval_fraction))
    return Corpus(train=tokens[:split], eval=tokens[split:], vocab=vocab, name=name)


def get_batch(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), both int32 `[batch, seq_len]`, for step `step` of the stream `seed`."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"data: {len(tokens)} tokens are too few for seq_len={seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int32) for s in starts])
    return windows[:, :-1], windows[:, 1:]


def eval_batches(tokens: np.ndarray, n: int, batch: int, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed set of held-out batches (the same every evaluation)."""
    return [get_batch(tokens, i, batch, seq_len, seed=1 << 20) for i in range(n)]
