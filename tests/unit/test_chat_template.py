"""Chat models get their chat template (data.chat_template, data.system_prompt): prompt ids against the template
rendered by hand and tokenized, and against transformers' own ``apply_chat_template`` on the same messages."""

import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.policy import Policy
from trustbatch.policy.tokenizer import train_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPT, SYSTEM = "What is 2 + 3?", "Answer with a number."


def _policy(template: bool) -> Policy:
    tok = train_tokenizer([PROMPT, SYSTEM, "<|user|> <|system|> <|assistant|>"], vocab_size=300)
    if template:
        tok.chat_template = TEMPLATE
    return Policy(model=None, tokenizer=tok, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_with_a_template_frames_the_prompt_with_it_and_the_system_prompt():
    p = _policy(template=True)
    tok = p.tokenizer
    user = f"<s><|user|>\n{PROMPT}</s>\n<|assistant|>\n"  # TEMPLATE rendered by hand
    assert p.encode_prompt(PROMPT) == _ids(tok, user)  # auto: the tokenizer has one
    p.set_prompt_format("auto", SYSTEM)
    by_hand = _ids(tok, f"<s><|system|>\n{SYSTEM}</s>\n<|user|>\n{PROMPT}</s>\n<|assistant|>\n")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    real = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert p.encode_prompt(PROMPT) == by_hand == list(real)
    assert by_hand.count(tok.bos_token_id) == 1  # the template's BOS, no second one from the tokenizer
    p.set_prompt_format("off")
    assert p.encode_prompt(PROMPT) == tok(PROMPT)["input_ids"] == [tok.bos_token_id] + _ids(tok, PROMPT)


def test_without_a_template_prompts_are_plain_text_and_asking_for_one_is_refused():
    p = _policy(template=False)
    plain = [p.tokenizer.bos_token_id] + _ids(p.tokenizer, PROMPT)
    assert p.encode_prompt(PROMPT) == plain  # the default base's case: default numbers do not move
    p.set_prompt_format("auto")
    assert p.encode_prompt(PROMPT) == plain
    for mode, system, says in (("on", None, "data.chat_template=on but the model's tokenizer has no chat template"),
                               ("auto", SYSTEM, "data.system_prompt is sent as a system message through the chat "
                                                "template, and the model's tokenizer has none")):
        with pytest.raises(UserError, match=says):
            p.set_prompt_format(mode, system)
    with pytest.raises(UserError, match="data.chat_template=off; drop data.system_prompt"):
        _policy(template=True).set_prompt_format("off", SYSTEM)


def test_config_keys_default_to_auto_without_a_system_prompt():
    d = load_config(None, ["data.system_prompt=Be brief."]).data
    assert (d.chat_template, d.system_prompt) == ("auto", "Be brief.")
    assert (load_config().data.chat_template, load_config().data.system_prompt) == ("auto", None)
    with pytest.raises(UserError, match="data.chat_template"):
        load_config(None, ["data.chat_template=yes"])


def test_a_template_that_refuses_a_system_message_is_one_line_at_set_up():
    """Gemma's and Mistral-Instruct's templates raise on a system role; that is said when the format is set (the
    command's start), not as jinja2's traceback at the first prompt encoded."""
    p = _policy(template=True)
    p.tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                 "supported') }}{% endif %}" + TEMPLATE)
    with pytest.raises(UserError, match=r"^the model's chat template refuses a system message \(TemplateError: System "
                                        r"role not supported\); drop --system-prompt"):
        p.set_prompt_format("auto", SYSTEM, keys=("--chat-template", "--system-prompt"))
    assert p.system_prompt is None and p.encode_prompt(PROMPT)  # left usable without it


def test_messages_frames_chat_messages_alone_as_trl_does():
    """data.chat_template=messages is TRL's rule: a prompt given as chat messages through the template, a text prompt
    as TRL's GRPOTrainer tokenizes a standard-format prompt (``processing_class(text=prompts)``: the tokenizer's
    special prefix, no template)."""
    from trustbatch.chat import conversation

    p = _policy(template=True)
    tok = p.tokenizer
    p.set_prompt_format("messages")
    assert p.encode_prompt(PROMPT) == tok(PROMPT)["input_ids"] == [tok.bos_token_id] + _ids(tok, PROMPT)
    assert not p.uses_chat_template  # SFT demonstrations of text prompts: as plain text
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    real = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert p.encode_prompt(conversation(messages, "row 1")) == list(real)
    with pytest.raises(UserError, match="data.system_prompt with data.chat_template=messages"):
        p.set_prompt_format("messages", SYSTEM)
    assert load_config(None, ["data.chat_template=messages"]).data.chat_template == "messages"
    plain = _policy(template=False)  # no template: text as it is, chat messages refused as with auto
    plain.set_prompt_format("messages")
    assert plain.encode_prompt(PROMPT) == plain.tokenizer(PROMPT)["input_ids"]
    with pytest.raises(UserError, match="needs the tokenizer's chat template"):
        plain.encode_prompt(conversation(messages, "row 1"))


def test_an_sft_demonstration_starts_at_once_after_the_assistant_header():
    """Under data.chat_template=messages a chat-message prompt still goes through the template, so its answer
    starts at once; a text prompt goes as it is, so its answer starts with a space (the messages prompts got the
    space too: a leading-space token taught after the assistant header)."""
    from trustbatch.chat import conversation
    from trustbatch.data import Example, TaskSplit
    from trustbatch.policy.base import sft_demos

    p = _policy(template=True)
    messages = conversation([{"role": "user", "content": PROMPT}], "row 1")
    task = TaskSplit("t", "math", train=[Example(messages, "5", "5"), Example(PROMPT, "5", "5")])
    cfg = {"sft_examples": 2, "seed": 0}
    for mode, leads in (("messages", ["5", " 5"]), ("auto", ["5", "5"]), ("off", None)):
        p.set_prompt_format(mode)
        if leads is not None:
            assert [c for _, c in sft_demos(task, cfg, chat=p.frames)] == leads, mode
    assert [c for _, c in sft_demos(task, cfg)] == [" 5", " 5"]  # no policy: plain text (the default base)
