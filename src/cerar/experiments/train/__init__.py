"""The Pythia-style training experiment behind ``cerar train``.

One concern per module:

* :mod:`cerar.experiments.train.config`: :class:`TrainConfig`, the validated settings of one run, and
  their command-line flags.
* :mod:`cerar.experiments.train.data`: the byte-level Shakespeare corpus, its fixed split and batches.
* :mod:`cerar.experiments.train.model`: the GPT-NeoX (Pythia) model and :func:`local_gradient`.
* :mod:`cerar.experiments.train.methods`: :data:`~cerar.experiments.train.methods.HOOKS`, each method's
  DDP hook and its byte accounting (the method names the config accepts).
* :mod:`cerar.experiments.train.schedules`: the communication-avoiding schedules around a method
  (``accum:K``, ``localsgd:H``, ``diloco:H``): their specs, checks and labels;
  :mod:`cerar.experiments.train.periodic` runs them, :mod:`cerar.experiments.train.averaging`
  averages the whole model through a method.
* :mod:`cerar.experiments.train.timeline`: per-step timestamps (compute end, gradients synchronised).
* :mod:`cerar.experiments.train.loop`: the training loop of one rank.
* :mod:`cerar.experiments.train.worker`: the per-rank entry point (``python -m cerar.experiments.train.worker``,
  also under ``torchrun``).
* :mod:`cerar.experiments.train.report`: summary table and JSON; :mod:`cerar.experiments.train.plots`: PNG figures.
* :mod:`cerar.experiments.train.sweep`: the bucket sweep's grid and each method at its best bucket size.
* :mod:`cerar.experiments.train.tuning`: each method family's settings tried and the best of them.
"""
