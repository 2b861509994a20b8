"""A prompt given as chat messages: TRL's conversational format, ``{"prompt": [{"role": ..., "content": ...}, ...]}``.

A ``Conversation`` is a ``str`` (its text, one ``role: content`` line per message, is what is deduplicated, logged and
shown) that keeps its messages: the policy renders them with the tokenizer's chat template
(``policy.model.Policy.encode_prompt``), and a batch-form reward function receives them as TRL passes them, with each
completion as ``[{"role": "assistant", "content": text}]`` (``rewards.scorers.BatchForm``). Being a ``str``, it goes
wherever a prompt goes (records, worker processes) unchanged.
"""

from __future__ import annotations

from .errors import UserError

ROLES = ("system", "user", "assistant")


class Conversation(str):
    """A prompt as chat messages (``messages``: a tuple of ``{"role", "content"}`` dicts, the last one the user's)."""

    messages: tuple[dict, ...]

    def __new__(cls, messages):
        msgs = tuple({"role": m["role"], "content": m["content"]} for m in messages)
        self = super().__new__(cls, "\n".join(f"{m['role']}: {m['content']}" for m in msgs))
        self.messages = msgs
        return self

    def __reduce__(self):  # pickled with its messages (to reward and rollout workers), not as its text alone
        return Conversation, (self.as_list(),)

    def as_list(self) -> list[dict]:
        """The messages as TRL passes a conversational prompt to a reward function: a new list of new dicts."""
        return [dict(m) for m in self.messages]


def is_messages(value: object) -> bool:
    """Whether ``value`` is a non-empty list of dicts that each have a ``role`` (TRL's conversational rows)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def conversation(value: list, where: str) -> Conversation:
    """``value``, a data row's list of chat messages, as a ``Conversation``.

    Raises:
        UserError: a message without a string ``content`` or with a role other than system, user or assistant, or a
            last message that is not the user's (the model answers it); ``where`` names the row and field.
    """
    for k, m in enumerate(value):
        if m.get("role") not in ROLES:
            raise UserError(f"{where}: message {k + 1} has role {m.get('role')!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {k + 1} ({m['role']}) has content {m.get('content')!r}, not text; "
                            "give each message its text as content")
    if value[-1]["role"] != "user":
        raise UserError(f"{where}: the last message is the {value[-1]['role']}'s; a prompt ends with the user's "
                        "message, which the model answers")
    return Conversation(value)
