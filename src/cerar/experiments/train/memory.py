"""An upper estimate of one training rank's memory, from the settings alone (no torch), so that
``cerar train`` and ``cerar study --gradients`` refuse a model no rank can hold before they
start the ranks (:func:`cerar.harness.resources.check_memory`).

The model is :mod:`cerar.experiments.train.model`'s GPT-NeoX: per layer ``12 H^2 + 13 H``
parameters (attention ``4 H^2``, the 4x MLP ``8 H^2``, biases and norms), untied input and
output embeddings of the 256 byte tokens. A rank holds every parameter about ten times (the
weights, their gradient, AdamW's two moments, DDP's buckets, a schedule's anchor and outer
momentum, a coded method's packets) and a step's activations: per layer ``34 B T H + 5 a B
T^2`` bytes at 16 bits (Korthikanti et al., 2022), doubled here for float32, plus the logits.
"""

from __future__ import annotations

from cerar.experiments.train.config import BYTE_VOCAB, ModelConfig

__all__ = ["parameters", "rank_bytes"]

#: Bytes per parameter a rank holds: ten float32 copies (see the module doc).
STATE_BYTES_PER_PARAMETER = 40
#: The evaluation scores this many sequences at a time (``loop._evaluate``), forward only.
EVAL_BATCH = 8


def parameters(model: ModelConfig) -> int:
    """The model's parameter count (0.86 M for the default :class:`ModelConfig`)."""
    h = model.hidden
    return model.layers * (12 * h * h + 13 * h) + 2 * BYTE_VOCAB * h + 2 * h


def rank_bytes(model: ModelConfig, batch_size: int) -> int:
    """One rank's working memory in bytes, beyond its process (an upper estimate)."""
    b, t, h = max(batch_size, EVAL_BATCH), model.seq_len, model.hidden
    activations = model.layers * 2 * (34 * b * t * h + 5 * model.heads * b * t * t)
    logits = 3 * b * t * BYTE_VOCAB * 4  # the logits, their softmax and its gradient
    return STATE_BYTES_PER_PARAMETER * parameters(model) + activations + logits
