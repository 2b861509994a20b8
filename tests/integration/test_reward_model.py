"""Issue 45 item 1: ``reward.model=DIR`` scores completions with a local sequence-classification model, one more term of
the training reward beside ``reward.functions``.

The reward model here is a tiny random ``LlamaForSequenceClassification`` (num_labels=1) with the stories260K
tokenizer. Every value is recomputed here from a second load of the model, one text at a time (no padding), with
transformers alone: the text is ``prompt + completion`` tokenized without special tokens (TRL's way)."""

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from trustbatch.api import Trainer
from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.policy.reward_model import load_reward_model
from trustbatch.recipes.build import preflight

from runproc import one_line, records, run, train_args  # noqa: F401

ROWS = [{"question": f"Lily has {i} apples and finds {i % 7 + 1} more. How many apples does she have?",
         "answer": str(i + i % 7 + 1)} for i in range(40)]
P, G = 4, 4
RUN = ["reward.workers=0", f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", "rollout.max_new_tokens=6",
       "train.steps=2", "train.lr=1e-2", "eval.every=2", "eval.samples_per_prompt=2", "checkpoint_every=2",
       "data.heldout_size=8", "threads=1", "data.prompt_field=question", "data.answer_field=answer"]


def _save_classifier(shared_dir, out, num_labels: int = 1):
    tok = AutoTokenizer.from_pretrained(shared_dir / "models" / "stories260K-hf")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      num_labels=num_labels, pad_token_id=tok.eos_token_id)
    model = LlamaForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # rewards of order 1, apart from each other
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reward_dir(shared_dir, tmp_path_factory):
    return _save_classifier(shared_dir, tmp_path_factory.mktemp("rm") / "rm")


def _by_hand(reward_dir, texts: list[str]) -> list[float]:
    tok = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    with torch.no_grad():
        return [model(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item() for t in texts]


def test_batched_padded_scores_are_the_models_own_logits(reward_dir):
    prompts = ["Lily has 3 apples.", "Tom", "Once upon a time there was a big dog. "]
    completions = ["She has 5", " ran away fast and far", "", "7", "The dog was happy all day long.", "x", " 12"]
    contexts = [{"prompt": prompts[i % 3]} for i in range(len(completions))]
    rm = load_reward_model(reward_dir, batch_size=3)  # batches of unequal lengths: right padding is exercised
    res = rm.score(completions, [""] * len(completions), contexts=contexts)
    want = _by_hand(reward_dir, [c["prompt"] + x for c, x in zip(contexts, completions)])
    assert res.rewards == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert res.errors == res.timeouts == res.clamped == 0
    assert max(want) - min(want) > 0.5 and any(not 0 <= v <= 1 for v in want)  # apart, and unclamped


def test_a_run_trains_on_the_weighted_reward_model_beside_a_function(tmp_path, shared_dir, reward_dir):
    seen: list[tuple[list[str], list[str]]] = []

    def prompts_seen(prompts, completions, reference, **columns):  # what the model scored, recorded; reward 0
        seen.append((list(prompts), list(completions)))
        return [0.0] * len(completions)

    run_dir = tmp_path / "run"
    Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=[prompts_seen], train_dataset=ROWS[8:],
            eval_dataset=ROWS[:8], overrides=RUN + [f"reward.model={reward_dir}", "reward.model_weight=0.5",
                                                    f"run_dir={run_dir}"]).train()
    rounds = [r for r in records(run_dir) if r["step"] > 0]
    assert len(rounds) == 2 and len(seen) == 2 * P
    for k, rec in enumerate(rounds):
        groups = seen[k * P:(k + 1) * P]
        logits = _by_hand(reward_dir, [p + c for ps, cs in groups for p, c in zip(ps, cs)])
        mean = sum(logits) / len(logits)
        assert rec["rewards/reward_model"] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        assert rec["rewards/prompts_seen"] == 0.0
        assert rec["reward_mean"] == pytest.approx(0.5 * mean, rel=1e-5, abs=1e-6)
        assert rec["reward_std"] == pytest.approx(0.5 * torch.tensor(logits, dtype=torch.float64).std().item(),
                                                  rel=1e-4)
    held = [r for r in records(run_dir) if "heldout_accuracy" in r]
    assert all(0 <= r["heldout_accuracy"] <= 1 for r in held)  # held-out evaluation keeps the data's scorer
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["reward"]
    assert saved["model"] == str(reward_dir) and saved["model_weight"] == 0.5


def test_a_causal_lm_is_refused_in_one_line_by_the_command(tmp_path, shared_dir):
    lm = shared_dir / "models" / "stories260K-hf"
    p = run(train_args(tmp_path / "run", f"reward.model={lm}"))
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert "LlamaForCausalLM, not a sequence-classification model" in line, line
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_what_cannot_work_is_refused_before_any_model_loads(tmp_path, shared_dir, reward_dir):
    two = _save_classifier(shared_dir, tmp_path / "two", num_labels=2)
    with pytest.raises(UserError, match="has num_labels=2; the reward is a model's single logit"):
        preflight(load_config(None, [f"reward.model={two}"]))
    with pytest.raises(UserError, match="cannot reach; use rollout.mode=sync"):
        preflight(load_config(None, [f"reward.model={reward_dir}", "rollout.mode=async"]))
    with pytest.raises(UserError, match="does not exist"):
        preflight(load_config(None, [f"reward.model={tmp_path / 'nowhere'}"]))
    with pytest.raises(UserError, match="reward.name and reward.model are both set"):
        load_config(None, [f"reward.model={reward_dir}", "reward.name=gsm8k"])
    with pytest.raises(UserError, match="reward.model_weight is set but reward.model is not"):
        load_config(None, ["reward.model_weight=2"])
    with pytest.raises(UserError, match="is a reward model"):  # a worker that would get it by name
        from trustbatch.rewards import RewardPool

        RewardPool(f"rm:{reward_dir}", workers=0)
