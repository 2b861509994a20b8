"""Drop-in trustbatch objectives for the RL stacks people already run.

- ``trustbatch.adapters.trl``: ``TrustbatchGRPOTrainer``, a TRL ``GRPOTrainer`` whose loss is a
  trustbatch objective (``pip install trustbatch[trl]``).
- ``trustbatch.adapters.verl``: ``register_with_verl()`` puts the objectives in verl's policy-loss
  registry (``pip install trustbatch[verl]``).

Importing this package imports neither TRL nor verl; each submodule imports its own stack, and
nothing else in trustbatch does.
"""
