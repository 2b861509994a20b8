"""A small byte-level BPE tokenizer trained with the ``tokenizers`` library on a task's own text.

Digits are split one per token so that numbers keep a compositional form; frequent words of the
prompt template merge into single tokens, which keeps prompts short for a small model.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def train_tokenizer(texts: list[str], vocab_size: int = 384):
    """Train a BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    The tokenizer adds ``<s>`` in front of every encoded text (``add_special_tokens=True``), pads
    with ``<pad>`` and ends completions with ``</s>``.
    """
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=sorted({c for t in texts for c in pre_tokenizers.ByteLevel.alphabet()}),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
