"""The data path between engine and learner: training batches, rollout sources, weight sync.

``batch`` (TrainBatch, tagged with policy versions), ``source`` (RolloutSource protocol; SyncSource),
``weight_sync`` (WeightSync protocol; SharedSync, CopySync, LaggedSync).
"""
