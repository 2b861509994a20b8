"""Policies: Hugging Face causal LMs and their tokenizers; the small default base model; SFT."""

from .model import Policy, load_policy

__all__ = ["Policy", "load_policy"]
