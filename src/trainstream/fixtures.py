"""Small models (and a random-token data set) shared by the tests, the benchmarks, the examples
and `python -m trainstream demo`.

They live in the package so that each of those imports them the same way, with no path set-up.

`TinyLM` is a Llama-flavoured decoder (RMSNorm, bias-free attention, SwiGLU) with tied input and
output embeddings. Bias-free attention matters for parity tests: a key bias has a gradient that is
zero in exact arithmetic, so its computed gradient is rounding noise that Adam's normalisation
turns into full-size updates, and two correct runs then drift apart at the learning rate's scale.
`llama()` builds a Hugging Face Llama from a config when transformers is installed, else a TinyLM
of the same width and depth.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 3, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Decay for matrices, none for norms and the positional table (a common recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "pos" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def llama(*, vocab: int, hidden: int, layers: int, heads: int, seq: int, intermediate: int | None = None,
          kv_heads: int | None = None, arch: str = "llama") -> nn.Module:
    """A Llama-style decoder for training: transformers' LlamaForCausalLM (or, with arch="qwen2",
    Qwen2ForCausalLM, whose query, key and value projections carry biases) built from a config (no
    download, no KV cache: in training a cache keeps every layer's keys and values in VRAM), or
    a TinyLM of that width and depth when transformers is not installed. `kv_heads`: grouped-query
    attention's key and value heads (default: one a query head)."""
    families = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    if arch not in families:
        raise ValueError(f"arch must be one of {sorted(families)}, got {arch!r}")
    try:
        import transformers
    except ImportError:
        return TinyLM(vocab=vocab, dim=hidden, layers=layers, heads=heads, seq=seq)
    config_class, model_class = (getattr(transformers, name) for name in families[arch])
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or int(2.6875 * hidden),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return model_class(config)


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a TinyLM or of a transformers causal LM (bare, or inside an engine that
    keeps it as `.module`)."""
    if hasattr(getattr(model, "module", model), "config"):
        return model(input_ids=tokens, labels=tokens).loss
    return model.loss(tokens)


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of `seq` random token ids in Hugging Face's shape (input_ids, labels): a data
    set that needs no download, for runs that compare trainers rather than teach a model."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
