"""``trustbatch train`` with LoRA and the chunked LM head: the frozen head's gradient formed in the forward.

LoRA freezes the head (and the tied embeddings), so the chunked head forms the hidden states' gradient in its
forward (``policy.chunked_logprobs._logp_slope``) and its backward recomputes no logits. Two rounds of the tiny job
with ``train.logprob_chunk_size=2`` (several chunks per micro-batch) against ``train.logprob_chunk_size=null`` (the
full [B, C, V] logits through autograd): equal losses, gradient norms, ESS and entropies to float32 round-off in
both rounds (the second samples from the first update, so it checks that update), and a spy shows the chunked run
took the forward-formed gradient. With the gradient's sign flipped the losses differ at round 2 (0.116 against
0.037).
"""

import json

import pytest

from trustbatch.config import load_config
from trustbatch.policy import chunked_logprobs as cl
from trustbatch.recipes import train

from tiny import TINY


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _rounds(run, chunk: str) -> list[dict]:
    train(load_config(None, TINY + ["train.steps=2", f"run_dir={run}", "model.lora.r=4", "model.lora.alpha=8",
                                    "train.lr=1e-2", f"train.logprob_chunk_size={chunk}", "eval.every=100",
                                    "checkpoint_every=100"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_a_lora_run_with_the_chunked_head_equals_the_full_head(tmp_path, cache, monkeypatch):
    slopes = []
    slope = cl._logp_slope
    monkeypatch.setattr(cl, "_logp_slope", lambda *a: slopes.append(1) or slope(*a))
    want = _rounds(tmp_path / "full", "null")
    assert not slopes  # the full path: no chunked head
    got = _rounds(tmp_path / "chunked", "2")
    assert slopes and len(got) == len(want) == 2
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "ess", "entropy"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    assert want[0]["grad_norm"] > 1e-4 and want[1]["loss"] != want[0]["loss"]
