"""trustbatch: RL post-training of language models with the batch-adaptive objective of arXiv 2605.12380."""

__version__ = "0.1.0"
