"""The Pythia-style training experiment behind ``cerar train``.

One concern per module:

* :mod:`cerar.train.config`: :class:`TrainConfig`, the validated settings of one run, and the
  method names.
* :mod:`cerar.train.data`: the byte-level Shakespeare corpus, its fixed split and batches.
* :mod:`cerar.train.model`: the GPT-NeoX (Pythia) model and :func:`local_gradient`.
* :mod:`cerar.train.methods`: each method's DDP hook and its byte accounting.
* :mod:`cerar.train.timeline`: per-step timestamps (compute end, gradients synchronised).
* :mod:`cerar.train.loop`: the training loop of one rank.
* :mod:`cerar.train.worker`: the per-rank entry point (``python -m cerar.train.worker``,
  also under ``torchrun``).
* :mod:`cerar.train.report`: summary table and JSON; :mod:`cerar.train.plots`: PNG figures.
"""
