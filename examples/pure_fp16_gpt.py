"""A plain training loop in pure float16 (every activation and parameter copy in fp16, float32 master weights),
with ``LossScaler`` as the only adaloss call: the loop issue 33 measured, and the test of its fix.

The model is the shipped nanoGPT-shaped GPT (token embedding tied to the LM head, a learned position table), on
the bytes of Python's own help text, batch 32 x 64 tokens (2,048 uses of the embedding per step), Adam lr 3e-3.
Each method's skipped steps are counted; nothing is retried.

    python examples/pure_fp16_gpt.py --steps 200 --methods dynamic adaptive
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from adaloss.torch import LossScaler
from adaloss.torch.precision import MixedPrecisionForward
from adaloss_cli.backends.torch.transformer_models import GPT
from adaloss_cli.data.text import corpus_text, encode


def batches(steps: int, batch: int, block: int, seed: int):
    """``steps`` batches of (tokens, next tokens), windows drawn at random from the corpus."""
    tokens = torch.from_numpy(encode(corpus_text()).astype(np.int64))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - block - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s:s + block + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(method: str, steps: int, seed: int = 0, batch: int = 32, block: int = 64, lr: float = 3e-3) -> dict:
    """Train the GPT for ``steps`` steps in pure float16 with ``method``; the skipped steps and the last loss."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=256, block_size=block, embed_dim=64, layers=2, heads=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = LossScaler(model, method)
    forward = MixedPrecisionForward(model, "float16", "pure", in_graph=method == "adaptive")
    scaler.set_pure_dtype(torch.float16)
    skipped, loss_value = [], math.nan
    for step, (x, y) in enumerate(batches(steps, batch, block, seed)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(model, x).reshape(-1, 256), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if scaler.step_was_skipped:
            skipped.append(step)
        loss_value = loss.item()
    return {"method": method, "skipped": skipped, "loss": loss_value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=["dynamic", "adaptive"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for method in args.methods:
        result = train(method, args.steps, args.seed)
        print(f"{method:>9}: {len(result['skipped'])} skipped steps {result['skipped'][:20]}, "
              f"last loss {result['loss']:.3f}")


if __name__ == "__main__":
    main()
