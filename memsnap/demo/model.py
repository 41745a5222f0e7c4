"""The demo's model (a small causal transformer), its synthetic next-token data, and the
frozen table that gives a rank's state a realistic size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    dropout: float = 0.1

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be a multiple of heads={self.heads}")
        for name in ("vocab", "dim", "heads", "layers", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def sized(cls, size: str) -> ModelConfig:
        """``tiny``, ``small`` (the default) or ``medium``."""
        table = {"tiny": dict(dim=32, layers=1), "small": {}, "medium": dict(dim=256, layers=4)}
        if size not in table:
            raise ValueError(f"model size {size!r} is not one of {sorted(table)}")
        return cls(**table[size])


class TinyTransformer(nn.Module):
    """Token + position embeddings, pre-norm encoder layers with a causal mask, tied output."""

    mask: torch.Tensor  # a registered buffer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        layer = nn.TransformerEncoderLayer(
            cfg.dim, cfg.heads, 4 * cfg.dim, cfg.dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights: stored once, stay tied on restore
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


class FrozenTable(nn.Module):
    """``nbytes`` (rounded down to whole float32s) of frozen state held beside the model, the
    stand-in for what makes real training state large (a frozen embedding table, a teacher, an
    optimizer's moments at scale). Its values are random, so nothing about them compresses,
    and differ by rank, so a restore that hands a rank another rank's bytes shows in the
    digest. It is a persistent buffer: snapshotted, restored and checked like the weights, but
    training never changes it."""

    def __init__(self, nbytes: int, seed: int = 0, rank: int = 0):
        super().__init__()
        if nbytes < 4:
            raise ValueError(f"a frozen table of {nbytes} bytes holds no float32; use at least 4 bytes")
        values = np.random.default_rng([seed, rank]).random(nbytes // 4, dtype=np.float32)
        self.register_buffer("table", torch.from_numpy(values))


class MarkovTokens(Dataset):
    """Sequences from a fixed random Markov chain: learnable, deterministic, no download."""

    def __init__(self, cfg: ModelConfig, n: int = 2048, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(cfg.vocab, cfg.vocab, generator=g) * 3
        cdf = torch.softmax(logits, dim=1).cumsum(dim=1)
        cdf[:, -1] = 1.0
        seqs = torch.empty(n, cfg.seq + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(cfg.vocab, (n,), generator=g)
        u = torch.rand(cfg.seq, n, 1, generator=g)
        for t in range(cfg.seq):  # inverse-CDF sampling of every sequence's next token at once
            rows = cdf[seqs[:, t]]
            seqs[:, t + 1] = torch.searchsorted(rows, u[t]).squeeze(1).clamp_(max=cfg.vocab - 1)
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        s = self.seqs[i]
        return s[:-1], s[1:]
