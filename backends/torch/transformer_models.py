"""The Transformers of the PyTorch model zoo: a nanoGPT-shaped decoder-only language model and a small ViT.

Both are written the way people write them, not the way a tracer likes them: the GPT ties its embedding to its LM
head, keeps the position embedding as a bare ``nn.Parameter`` sliced by the input's length, and splits one ``qkv``
Linear into three; the ViT has a class token and a position embedding as bare parameters and uses
``nn.TransformerEncoderLayer`` (so ``nn.MultiheadAttention``). These are the patterns per-layer loss scaling must
handle on real models (issue 16), so the zoo trains them as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "ViT", "CausalSelfAttention", "GPTBlock"]

_INIT_STD = 0.02  # GPT-2's and ViT's initialisation of embeddings and Linear weights


def _init_linear_and_embeddings(model: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) for Linear and Embedding weights, zero biases (LayerNorms keep 1 and 0)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one ``qkv`` Linear split into q, k and v, then PyTorch's fused
    ``scaled_dot_product_attention`` with ``is_causal=True`` (flash or memory-efficient kernels where available)."""

    def __init__(self, embed_dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if embed_dim % heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(self.embed_dim, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, width)
        return self.resid_dropout(self.proj(y))


class GPTBlock(nn.Module):
    """A pre-norm Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

    def __init__(self, embed_dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = CausalSelfAttention(embed_dim, heads, dropout)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only language model in nanoGPT's shape.

    Token ids (B, T) with T <= ``block_size`` go in, next-token logits (B, T, vocab_size) come out. The LM head shares
    its weight with the token embedding (``head.weight is tok.weight``), as GPT-2 does; the learned position
    embedding is a bare parameter of ``block_size`` rows of which the forward uses the first T.
    """

    def __init__(self, vocab_size: int, block_size: int, embed_dim: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, embed_dim)
        self.pos = nn.Parameter(torch.zeros(1, block_size, embed_dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(GPTBlock(embed_dim, heads, dropout) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size, bias=False)
        _init_linear_and_embeddings(self)
        nn.init.normal_(self.pos, mean=0.0, std=_INIT_STD)
        self.head.weight = self.tok.weight  # tied after initialising, so both names hold the one Parameter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos[:, :length])
        return self.head(self.ln_f(self.blocks(x)))


class ViT(nn.Module):
    """A small Vision Transformer (Dosovitskiy et al., 2021) for (C, H, W) images.

    A Conv2d with kernel and stride ``patch_size`` embeds the patches; a class token and a position embedding
    (bare parameters) are added; pre-norm ``nn.TransformerEncoderLayer`` blocks (GELU MLP of 4x width) follow; the
    class token's final LayerNorm feeds a Linear head.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, patch_size: int = 4,
                 embed_dim: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        channels, height, width = input_shape
        if height % patch_size or width % patch_size:
            raise ValueError(f"patch_size {patch_size} does not divide the {height}x{width} image")
        patches = (height // patch_size) * (width // patch_size)
        self.patch = nn.Conv2d(channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos = nn.Parameter(torch.zeros(1, patches + 1, embed_dim))
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Sequential(*(
            nn.TransformerEncoderLayer(embed_dim, heads, dim_feedforward=4 * embed_dim, dropout=dropout,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers)))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        _init_linear_and_embeddings(self)
        for bare in (self.cls, self.pos):
            nn.init.normal_(bare, mean=0.0, std=_INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, patches, embed_dim)
        cls = self.cls.expand(x.shape[0], -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos)
        return self.head(self.norm(self.encoder(x))[:, 0])
