"""A character-level tokenizer built offline, for the tiny models of :mod:`deepspeed_fused.models`
in the CPU examples and tests (trainers that tokenize text, TRL's included, need one)."""
from __future__ import annotations

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def tiny_tokenizer(model_max_length: int = 512):
    """A ``PreTrainedTokenizerFast``: one token per printable ASCII character (99 ids with the
    specials ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3), within the tiny models' 257."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", model_max_length=model_max_length)
