"""``trustbatch sft model.path=DIR`` reads the prompts RL will read: ``data.max_prompt_tokens`` skips or cuts them
alike, demonstrations longer than the model's context are dropped with one warning (a learned-position model failed
with an index error mid-SFT), and after a chat template's assistant header an answer starts at once (no space token
before it, as the template renders an assistant turn).

Independent references: the stories260K tokenizer's own ids of each prompt and answer, and transformers'
``apply_chat_template`` of the whole conversation. The SFT itself is replaced by a recorder: what is checked is what
it is given."""

import json

import pytest
from typer.testing import CliRunner

from trustbatch.cli import app
from trustbatch.errors import UserError
from trustbatch.policy.tokenizer import train_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def gsm12(tmp_path, shared_dir):
    rows = (shared_dir / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:12]
    path = tmp_path / "gsm12.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path, [json.loads(r) for r in rows]


def _model_dir(tmp_path, shared_dir, positions: int, template: str | None = None, tok=None):
    """A one-layer GPT-2 (learned positions) with the stories260K tokenizer (or ``tok``), saved as a model
    directory."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = tok or AutoTokenizer.from_pretrained(shared_dir / "models" / "stories260K-hf")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    if template:
        tok.chat_template = template
    out = tmp_path / f"model-{positions}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, tok


def _sft(monkeypatch, model, data, *extra):
    seen = {}

    def record(policy, demos, **kw):
        seen.update(demos=demos, max_prompt_tokens=policy.max_prompt_tokens, prompt_ids=policy.encode_prompt)
        return 0.0

    monkeypatch.setattr("trustbatch.policy.sft.sft", record)
    out = data.parent / f"out-{len(list(data.parent.glob('out-*')))}"
    done = CliRunner().invoke(app, ["sft", f"model.path={model}", f"data.train={data}", "data.heldout_size=2",
                                    *extra, "--out", str(out)])
    return done, seen


def test_demonstrations_past_the_context_are_dropped_and_the_prompt_limit_applies(tmp_path, shared_dir, gsm12,
                                                                                  monkeypatch):
    data, _ = gsm12
    roomy, tok = _model_dir(tmp_path, shared_dir, positions=4096)
    done, seen = _sft(monkeypatch, roomy, data)
    assert done.exit_code == 0 and "skipped" not in done.output, done.output
    every = seen["demos"]
    assert len(every) == 10  # 12 rows, the first two held out
    # by hand: BOS + the prompt's ids, the answer's ids, EOS: those within 256 positions
    fits = [d for d in every
            if len(tok(d[0])["input_ids"]) + len(tok(d[1], add_special_tokens=False)["input_ids"]) + 1 <= 256]
    assert 0 < len(fits) < len(every)  # GSM8K's worked solutions: some fit, most do not
    small, _ = _model_dir(tmp_path, shared_dir, positions=256)
    done, seen = _sft(monkeypatch, small, data)
    assert done.exit_code == 0, done.output
    assert seen["demos"] == fits
    assert f"skipped {len(every) - len(fits)} of 10 SFT demonstrations" in " ".join(done.output.split())

    done, _ = _sft(monkeypatch, roomy, data, "data.max_prompt_tokens=5")
    assert isinstance(done.exception, UserError), done.output  # the command's one line (main turns it into exit 2)
    assert str(done.exception).startswith("data.max_prompt_tokens=5: none of the 10 train prompts fits")
    done, seen = _sft(monkeypatch, roomy, data, "data.max_prompt_tokens=60", "data.long_prompts=truncate")
    assert done.exit_code == 0 and seen["max_prompt_tokens"] == 60, done.output
    assert {len(seen["prompt_ids"](p)) for p, _ in seen["demos"]} == {60}  # every GSM8K prompt is longer


def test_after_a_chat_template_the_answer_starts_at_once(tmp_path, shared_dir, gsm12, monkeypatch):
    data, rows = gsm12
    # a byte-level BPE without a prefix space, as Qwen's: " Natalia" and "Natalia" are other tokens
    tok = train_tokenizer([json.dumps(r) for r in rows] + ["<|user|> <|assistant|>"], vocab_size=400)
    model, tok = _model_dir(tmp_path, shared_dir, positions=4096, template=TEMPLATE, tok=tok)
    done, seen = _sft(monkeypatch, model, data)
    assert done.exit_code == 0, done.output
    prompt, answer = seen["demos"][0]
    assert not answer.startswith(" ") and answer.endswith(rows[2]["answer"].split("####")[-1].strip())
    # the prompt ids then the answer's ids and EOS are the template's rendering of the conversation
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                                       tokenize=True, return_dict=False)
    ours = seen["prompt_ids"](prompt) + tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ours == list(rendered)[:len(ours)]


def test_the_default_base_sfts_only_what_fits_its_context_and_refuses_before_any_step(tmp_path, gsm12, monkeypatch):
    """The default base (no model.path) trained on every demonstration: GSM8K's 90-800 tokens against its 64
    positions, 600 silent SFT steps past its range, and then the run refused every prompt. Now it keeps those that
    fit, as fit_demos does for model.path, and with none refuses before any step, naming model.max_len. Reference:
    the base tokenizer's own ids of each prompt and answer, and EOS."""
    data, _ = gsm12
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    seen = {}

    def record(policy, demos, **kw):
        seen.update(demos=demos, tok=policy.tokenizer)
        return 0.0

    monkeypatch.setattr("trustbatch.policy.base.sft", record)
    small = ["model.hidden=16", "model.layers=1", "model.heads=2", "model.sft_teacher_error=0"]
    done = CliRunner().invoke(app, ["sft", f"data.train={data}", "data.heldout_size=2", *small,
                                    "--out", str(tmp_path / "out")])
    assert isinstance(done.exception, UserError) and not seen, done.output
    assert str(done.exception).startswith("none of the 10 SFT demonstrations of the default base fits its context of "
                                          "model.max_len=64 tokens") and "\n" not in str(done.exception)
    done = CliRunner().invoke(app, ["sft", f"data.train={data}", "data.heldout_size=2", *small, "model.max_len=256",
                                    "--out", str(tmp_path / "out")])
    tok = seen["tok"]
    from trustbatch.data.benchmarks import load_benchmark

    every = [(e.prompt, " " + e.answer) for e in load_benchmark(str(data)).examples[2:]]
    fits = [d for d in every if len(tok(d[0])["input_ids"]) + len(tok(d[1], add_special_tokens=False)["input_ids"])
            + 1 <= 256]
    assert 0 < len(fits) < len(every)
    assert sorted(seen["demos"]) == sorted(fits)
