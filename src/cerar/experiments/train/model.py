"""Pythia's architecture (``transformers``' GPT-NeoX) at CPU scale, its loss, and the local
gradient of one batch (the hook for gradient capture)."""

from __future__ import annotations

import torch
from torch import nn

from cerar.experiments.train.config import BYTE_VOCAB, ModelConfig

__all__ = ["RANK_IMPORTS", "build_model", "lm_loss", "local_gradient", "parameter_groups"]

#: What a training rank imports before its first step (the loop, FSDP, transformers' GPT-NeoX):
#: about 6 s of CPU per rank. On loopback one process imports them and forks every run's ranks
#: (``launch(preload=)``, :class:`cerar.harness.forked.Zygote`).
RANK_IMPORTS = (
    "cerar.experiments.train.loop",
    "torch.distributed.fsdp",
    "transformers.models.gpt_neox.modeling_gpt_neox",
)


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """A ``GPTNeoXForCausalLM`` with Pythia's choices: rotary on ``rotary_pct`` of each head
    (Pythia: 0.25), parallel residual, untied input/output embeddings, no dropout, 4x MLP,
    GELU, LayerNorm; byte vocabulary. Weights drawn from ``seed`` (the same on every rank)."""
    from cerar.experiments._extras import require

    require("transformers", "train")  # the message names the extra; a rank prints it and fails
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_config = GPTNeoXConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        intermediate_size=4 * config.hidden,
        hidden_act="gelu",
        rotary_pct=config.rotary_pct,
        rotary_emb_base=10000,
        max_position_embeddings=config.seq_len,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        initializer_range=0.02,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(hf_config)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``tokens`` (``(batch, seq_len)`` int64)."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def local_gradient(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's flattened gradient of :func:`lm_loss` on ``tokens``, in ``model.parameters()``
    order, without any communication (pass the bare module, not the DDP wrapper). The model's
    ``.grad`` fields are left as they were; parameters are not changed."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(lm_loss(model, tokens), params, allow_unused=True)
    flat = [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
    return torch.cat(flat)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """AdamW groups: decay on matrices, none on biases and LayerNorm weights (as Pythia)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
