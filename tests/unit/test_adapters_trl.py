"""The TRL adapter against TRL 1.16's real GRPOTrainer (make test-adapters).

References are independent of the adapter: the model's own forward (log_softmax, gather) on the whole
batch, ``objectives.get(name)`` called directly with the whole window's token count, and plain
``trl.GRPOTrainer`` runs.
"""

import math
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl not installed; run `make test-adapters`")
pytestmark = pytest.mark.adapters

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trustbatch import objectives  # noqa: E402
from trustbatch.adapters.trl import TrustbatchGRPOTrainer, trl_objective_loss  # noqa: E402
from trustbatch.errors import UserError  # noqa: E402

NAMES = ("p3o", "grpo", "cispo")
OPTIONS = {"p3o": {}, "grpo": {"eps_low": 0.2, "eps_high": 0.28}, "cispo": {"eps_high": 2.0}}
PROMPTS = ["Once upon a time", "The little dog", "Lily saw a bird", "Tom ran to the park"]


@pytest.fixture(scope="module")
def model_dir(shared_dir) -> Path:
    p = shared_dir / "models" / "stories260K-hf"
    if not p.is_dir():
        pytest.skip(f"{p} not found")
    return p


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                gradient_accumulation_steps=2, max_completion_length=8, learning_rate=1e-3, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, beta=0.0, seed=0, bf16=False)
    return trl.GRPOConfig(**{**base, **kw})


def _trainer(model_dir, tmp_path, cls=TrustbatchGRPOTrainer, reward=None, dtype=torch.float32, **kw):
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tb = {k: kw.pop(k) for k in ("objective", "objective_options", "ess_scope") if k in kw}
    return cls(model=model, processing_class=tok, reward_funcs=reward or _reward, args=_config(tmp_path, **kw),
               train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), **tb)


def _reward(completions, **_):
    return [float(len(c)) / 40.0 for c in completions]


def _generation_batch(model, seed=0, B=4, P=5, T=7):
    """A hand-made generation batch in TRL's format (equal-length prompts, right-padded completions)
    whose behaviour log-probs are the model's own, moved by noise, so ratios differ from 1."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    completion_ids = torch.randint(3, vocab, (B, T), generator=g)
    cmask = torch.ones(B, T, dtype=torch.long)
    for i, n in enumerate([7, 3, 5, 6][:B]):
        cmask[i, n:] = 0
    lp = _reference_logprobs(model, prompt_ids, completion_ids, cmask).detach()
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    return {"prompt_ids": prompt_ids, "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": completion_ids, "completion_mask": cmask,
            "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2][:B], dtype=lp.dtype),
            "num_items_in_batch": cmask.sum(), "old_per_token_logps": old}


def _reference_logprobs(model, prompt_ids, completion_ids, cmask):
    """log π_θ of the completion tokens from the model's plain forward (log_softmax, gather)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    att = torch.cat([torch.ones_like(prompt_ids), cmask], 1)
    logits = model(input_ids=ids, attention_mask=att).logits[:, prompt_ids.shape[1] - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]


def _trl_logprobs(trainer, gen):
    """TRL's own log-probs of the whole batch in one call. TRL scores tokens with a chunked head that
    runs in float32, ~1e-6 from the plain forward; the adapter is exact relative to these."""
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], 1)
    att = torch.cat([gen["prompt_mask"], gen["completion_mask"]], 1)
    lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, gen["completion_ids"].shape[1])
    plain = _reference_logprobs(trainer.model, gen["prompt_ids"], gen["completion_ids"], gen["completion_mask"])
    m = gen["completion_mask"].bool()
    torch.testing.assert_close(lp[m].double(), plain[m].double(), rtol=0, atol=1e-5)
    return lp


def _accumulate_two_micro_steps(trainer, gen):
    """TRL's own path: training_step → _prepare_inputs (buffer, shuffle, split) → compute_loss → backward."""
    trainer._generate_and_score_completions = lambda _batch: {k: v.clone() for k, v in gen.items()}
    trainer.current_gradient_accumulation_steps = 2
    model = trainer.model
    model.train()
    model.zero_grad()
    for _ in range(2):
        trainer.training_step(model, {}, None)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", NAMES)
def test_two_micro_steps_give_the_whole_batch_gradient(model_dir, tmp_path, name):
    # float64 weights keep the backbone's rounding (micro-batch vs whole batch) far below 1e-6
    trainer = _trainer(model_dir, tmp_path, objective=name, objective_options=OPTIONS[name], ess_scope="batch",
                       dtype=torch.float64)
    gen = _generation_batch(trainer.model)
    got = _accumulate_two_micro_steps(trainer, gen)

    model = trainer.model
    model.zero_grad()
    lp = _trl_logprobs(trainer, gen)
    ref = objectives.get(name)(lp, gen["old_per_token_logps"], gen["advantages"], gen["completion_mask"].bool(),
                               num_tokens=int(gen["num_items_in_batch"]), **OPTIONS[name])
    ref.loss.backward()
    assert set(got) == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")
    if name == "p3o":
        assert ref.metrics["ess"] < 0.99  # the test means something: the cap and the KL are active
        logged = trainer._metrics["train"]["trustbatch/ess"]
        assert logged == pytest.approx([ref.metrics["ess"]] * 2, abs=1e-6)


def test_p3o_micro_batch_scope_uses_each_micro_batchs_own_ess(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, objective="p3o", ess_scope="micro_batch", dtype=torch.float64)
    gen = _generation_batch(trainer.model, seed=1)
    got = _accumulate_two_micro_steps(trainer, gen)
    model = trainer.model
    model.zero_grad()
    total, ess = 0.0, []
    for mb in trainer._buffered_inputs:  # the split TRL made (after its shuffle)
        lp = _trl_logprobs(trainer, mb)
        out = objectives.get("p3o")(lp, mb["old_per_token_logps"], mb["advantages"], mb["completion_mask"].bool(),
                                    num_tokens=int(gen["num_items_in_batch"]), ess_scope="micro_batch")
        total = total + out.loss
        ess.append(out.metrics["ess"])
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-6)
    assert abs(ess[0] - ess[1]) > 1e-4  # two different caps, so the scope was really per micro-batch
    assert trainer._metrics["train"]["trustbatch/ess"] == pytest.approx(ess, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_loss_function_on_tiny_tensors(name):
    """vLLM's sampling log-probs are the behaviour policy (NaN tokens take the trainer's value), the
    normaliser is the window's token count over processes, and sequence aggregation the window's rows."""
    g = torch.Generator().manual_seed(2)
    B, T = 4, 5
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.1).requires_grad_(True)
    sampled = lp.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampled[0, 1] = float("nan")
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # the generation batch spans 2 processes × 2 accumulation windows; this process's window is these 4 rows
    inputs = {"completion_mask": mask, "advantages": adv, "num_items_in_batch": torch.tensor(40.0),
              "old_per_token_logps": lp.detach() - 0.05, "sampling_per_token_logps": sampled}
    opts = OPTIONS[name]
    out = trl_objective_loss(name, lp, inputs, opts, grad_accum_steps=1, steps_per_generation=2, num_processes=2)
    (g_got,) = torch.autograd.grad(out.loss, lp)
    behaviour = torch.where(torch.isnan(sampled), inputs["old_per_token_logps"], sampled)
    x = lp.detach().clone().requires_grad_(True)
    # the window holds 40 · 1/2 = 20 tokens over both processes; DDP averages, so each process's loss is 2 · Σℓ / 20
    ref = objectives.get(name)(x, behaviour, adv, mask.bool(), num_tokens=40.0 / 2, **opts)
    (g_ref,) = torch.autograd.grad(ref.loss * 2, x)
    torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach() * 2, rtol=0, atol=1e-9)

    seq = {**opts, "aggregation": "seq_mean_token_mean"}
    out = trl_objective_loss(name, lp, inputs, seq, grad_accum_steps=2, steps_per_generation=2, num_processes=2)
    # 4 non-empty rows of a window of B · 2 = 8 rows per process
    whole = objectives.get(name)(lp.detach(), behaviour, adv, mask.bool(), **seq).loss
    assert float(out.loss.detach()) == pytest.approx(float(whole) * 4 / (B * 2), abs=1e-9)


def test_real_grpo_trainer_three_steps_with_the_adapter_and_without(model_dir, tmp_path):
    """3 optimizer steps of TRL's generation + P3O (each generation reused for 2 iterations, so the second
    is off-policy), then the same run with TRL's own loss."""
    runs = {}
    for label, cls, kw in (("p3o", TrustbatchGRPOTrainer, {"objective": "p3o"}), ("trl", trl.GRPOTrainer, {})):
        trainer = _trainer(model_dir, tmp_path / label, cls=cls, max_steps=3, num_iterations=2, **kw)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        changed = any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
        runs[label] = (trainer.state, changed)
    state, changed = runs["p3o"]
    assert state.global_step == 3 and changed
    ess = [r["trustbatch/ess"] for r in state.log_history if "trustbatch/ess" in r]
    assert len(ess) == 3 and all(math.isfinite(e) and 0 < e <= 1 for e in ess)
    assert min(ess) < 1.0  # the reused generation is off-policy after the first optimizer step
    assert all("trustbatch/kl_weight" in r and math.isfinite(r["loss"]) for r in state.log_history if "trustbatch/ess" in r)
    state, changed = runs["trl"]
    assert state.global_step == 3 and changed
    logged = [r for r in state.log_history if "loss" in r and "train_runtime" not in r]
    assert len(logged) == 3 and all(math.isfinite(r["loss"]) for r in logged)
    assert not any(k.startswith("trustbatch/") for r in logged for k in r)


def test_bad_settings_are_one_line_errors(model_dir, tmp_path):
    with pytest.raises(UserError, match="needs a proximal"):
        _trainer(model_dir, tmp_path, objective="decoupled_ppo")
    with pytest.raises(UserError, match="did you mean 'eps_high'"):
        _trainer(model_dir, tmp_path, objective="grpo", objective_options={"eps_hihg": 0.3})
    with pytest.raises(UserError, match="kl='exact'.*does not supply"):
        _trainer(model_dir, tmp_path, objective="p3o", objective_options={"kl": "exact"})
    # TRL's reference KL is beta with k3: the objective's ref_kl was accepted and replaced by k3 without a word
    with pytest.raises(UserError, match=r"option 'ref_kl' is decided by TRL \(.*GRPOConfig.beta"):
        _trainer(model_dir, tmp_path, objective="p3o", objective_options={"ref_kl": "k2"}, beta=0.1)
    with pytest.raises(UserError, match="top_entropy_quantile"):
        _trainer(model_dir, tmp_path, objective="p3o", top_entropy_quantile=0.5)
    # TRL's clip widths would be silently replaced by the objective's (0.2, 0.2)
    with pytest.raises(UserError, match=r"GRPOConfig.epsilon_high=0.28 .*objective_options eps_high"):
        _trainer(model_dir, tmp_path, objective="grpo", epsilon_high=0.28)
    with pytest.raises(UserError, match=r"GRPOConfig.epsilon=0.1 .*objective_options eps_low"):
        _trainer(model_dir, tmp_path, objective="grpo", epsilon=0.1)
    with pytest.raises(UserError, match="multiple of gradient_accumulation_steps"):
        _trainer(model_dir, tmp_path, objective="p3o", gradient_accumulation_steps=3, steps_per_generation=2,
                 per_device_train_batch_size=2)
    t = _trainer(model_dir, tmp_path, objective="p3o", use_vllm=False)
    assert t.vllm_importance_sampling_correction is False


def test_dr_grpo_matches_trls_own_dr_grpo(model_dir, tmp_path):
    """aggregation seq_mean_token_sum is TRL's loss_type="dr_grpo": the masked sums over rows × max_completion_length
    (8 here; the hand-made batch is 7 tokens wide, which the adapter divided by before), gradients equal."""
    ours = _trainer(model_dir, tmp_path / "ours", objective="grpo", dtype=torch.float64,
                    objective_options={"aggregation": "seq_mean_token_sum"})
    theirs = _trainer(model_dir, tmp_path / "trl", cls=trl.GRPOTrainer, loss_type="dr_grpo", dtype=torch.float64)
    gen = _generation_batch(ours.model)
    assert gen["completion_ids"].shape[1] != ours.args.max_completion_length
    got, want = _accumulate_two_micro_steps(ours, gen), _accumulate_two_micro_steps(theirs, gen)
    assert got.keys() == want.keys()
    # TRL's own loss goes through its float32 token scoring (~1e-6, _trl_logprobs); the old divisor was 8/7 off
    worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert worst < 1e-4, worst


def test_logged_entropy_leaves_out_tool_output_tokens(model_dir, tmp_path):
    """TRL's entropy metric averages over completion_mask · tool_mask; the adapter's did over completion_mask."""
    trainer = _trainer(model_dir, tmp_path, objective="p3o")
    entropies = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    inputs = {"completion_mask": torch.ones(2, 3), "tool_mask": torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])}
    trainer._log_tb_metrics("train", {"loss": 0.0}, inputs, entropies)
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx((1 + 4 + 3 + 5) / 4)


def test_logged_kl_over_processes_is_tokens_weighted_as_trls(model_dir, tmp_path):
    """TRL logs kl as its global_masked_mean (token sums and counts summed over processes); the adapter averaged
    each process's mean, wrong where processes hold different token counts. Two processes are emulated by an
    accelerator whose reduce adds another process's values: 3 tokens of KL 0.2 here, 1 token of KL 1.0 there, so
    TRL's kl is (0.6 + 1.0) / 4 = 0.4, not the mean of means 0.6 (by hand)."""
    trainer = _trainer(model_dir, tmp_path, objective="p3o", beta=0.1, use_bias_correction_kl=False)
    there = {"mean": torch.tensor([1.0], dtype=torch.float64), "sum": torch.tensor([5.0, 1.0, 1.0])}

    def reduce(t, reduction):
        other = there[reduction].to(t.dtype)
        return (t + other) / 2 if reduction == "mean" else t + other

    trainer.accelerator.reduce = reduce
    inputs = {"completion_mask": torch.tensor([[1.0, 1.0, 1.0]])}
    trainer._log_tb_metrics("train", {"loss": 0.0, "kl_ref": 0.2}, inputs, torch.tensor([[1.0, 2.0, 3.0]]))
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(0.4)
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx((6.0 + 5.0) / 4)


def test_trls_own_reward_functions_run_as_trustbatch_reward_functions():
    """TRL's get_soft_overlong_punishment (reads completion_ids alone) and think_format_reward (completions), as
    trustbatch calls a batch-form reward: DAPO's Eq. 13 worked by hand for the first, TRL's pattern for the second."""
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    from trustbatch.chat import Conversation
    from trustbatch.rewards import COMPLETION_IDS_KEY, GROUP_KEY
    from trustbatch.rewards.scorers import BatchForm, takes_batch

    overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    assert takes_batch(overlong) and takes_batch(think_format_reward)
    lengths = [3, 6, 8, 10, 12]
    ctx = [{"prompt": "p", GROUP_KEY: 0, COMPLETION_IDS_KEY: [1] * n} for n in lengths]
    got, _ = BatchForm(overlong).score_group(["x"] * 5, [""] * 5, ctx)
    by_hand = [0.0 if n <= 6 else ((10 - 4) - n) / 4 if n <= 10 else -1.0 for n in lengths]
    assert [v for v, _, _ in got] == by_hand and {s for _, s, _ in got} <= {"ok", "outside"}
    # TRL's format rewards read completion[0]["content"]: conversational prompts (trustbatch.chat.Conversation)
    chat = [{**c, "prompt": Conversation([{"role": "user", "content": "p"}])} for c in ctx]
    texts = ["<think>\nhm\n</think>\n42", "42", "<think>a</think>", "<think>\nx\n</think>y", "x</think>"]
    got, _ = BatchForm(think_format_reward).score_group(texts, [""] * 5, chat)
    assert [v for v, _, _ in got] == [1.0, 0.0, 1.0, 1.0, 0.0]  # TRL's ^<think>(?!.*<think>)(.*?)</think>.*$


def test_the_trl_names_the_config_errors_explain_are_grpoconfig_arguments():
    """``config.load.TRL_NAMES``: each is an argument of TRL's own GRPOConfig (or the trainer's reward_weights)."""
    import dataclasses

    from trustbatch.config.load import TRL_NAMES, TRL_UNSUPPORTED

    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(TRL_NAMES) - fields == {"max_prompt_length"}, set(TRL_NAMES) - fields  # dropped by TRL 1.x, still met
    assert set(TRL_UNSUPPORTED) <= fields and not set(TRL_UNSUPPORTED) & set(TRL_NAMES)


def test_trls_reward_objects_and_partials_are_logged_under_trls_names():
    """TRL's get_callable_name: a partial's function's ``__name__``, an instance's own ``__name__`` (TRL's reward
    classes set it to keep their metric keys); they were logged as rewards/partial and rewards/_SoftOverlongPunishment."""
    import functools

    from trl.rewards import get_soft_overlong_punishment
    from trl.trainer.utils import get_callable_name

    from trustbatch.rewards.functions import labels
    from trustbatch.rewards.objects import reward_name

    def length_target(completions, target, **kwargs):
        return [-abs(target - len(c)) for c in completions]

    funcs = [get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4),
             functools.partial(length_target, target=5)]
    assert labels([reward_name(f) for f in funcs]) == [get_callable_name(f) for f in funcs]
