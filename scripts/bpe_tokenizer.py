"""The byte-level BPE tokenizer every model made here gets (the reference models, the tests'
tiny models, the benchmarks' random ones): trained on the given text, saved for transformers."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOT = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out: Path | None = None,
                        pad: bool = False):
    """A ``PreTrainedTokenizerFast`` of ``vocab_size`` tokens (``EOT`` the end of text, and the
    padding when ``pad``), saved to ``out`` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT,
                                   **({"pad_token": EOT} if pad else {}))
    if out is not None:
        fast.save_pretrained(out)
    return fast
