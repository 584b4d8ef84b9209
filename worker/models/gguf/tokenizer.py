"""A GGUF vocabulary as a Hugging Face tokenizer: byte-level BPE rebuilt with `tokenizers` for the
pre-tokenizers known here, transformers' own GGUF conversion for the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# llama.cpp's pre-tokenizer names for byte-level BPE vocabularies (llama-vocab.cpp), by the split they
# mean. "digits": every numeric character is split off on its own, then GPT-2's regex splits the rest; the
# Hugging Face tokenizer.json of these models says Sequence[Digits(individual_digits), ByteLevel]
# (SmolLM2's does). "gpt2": GPT-2's regex alone, which is what ByteLevel(use_regex=True) applies.
_DIGITS_PRE_TOKENIZERS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_GPT2_PRE_TOKENIZERS = frozenset({"gpt-2", "gpt2", "mpt", "olmo", "jais"})
# Names whose split is one regex, applied before a byte-level mapping that splits no further (the Hugging
# Face tokenizer.json of these models says Sequence[Split(regex, isolated), ByteLevel(use_regex=False)]).
# "qwen2" (Qwen2, Qwen2.5, Qwen3): a letter run with at most one leading non-letter, each digit alone,
# punctuation runs with their line breaks, then whitespace as GPT-2 splits it. "qwen35" (Qwen3.5's
# vocabulary): the same, with combining marks (\p{M}) counted as letters, so an accent stays in its word.
_REGEX_PRE_TOKENIZERS = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


def _pre_tokenizer(pre: str) -> Any | None:
    """The pre-tokenizer llama.cpp applies for the file's tokenizer.ggml.pre, or None for one not known."""
    from tokenizers import Regex, pre_tokenizers

    if pre in _REGEX_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE_TOKENIZERS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level if pre in _GPT2_PRE_TOKENIZERS else None


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int]
) -> tuple[Any, dict[str, int]]:
    """The BPE model, byte-level decoder and added tokens of a GGUF vocabulary, and the vocabulary itself."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Tokens are spelled in the byte-level alphabet; one that is not (a user-defined token stored as
    # plain text) is respelled, as transformers does.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            # each merge "a b": a pair
            merges=cast("list[tuple[str, str]]", [tuple(merge.split(" ", 1)) for merge in merges]),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>, ...) are matched whole and are special; one spelled
    # outside the byte alphabet is a llama.cpp mislabel and is skipped, as transformers does.
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_CONTROL and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_USER_DEFINED and token in vocab
        ]
    )
    return backend, vocab


def build_tokenizer(metadata: dict[str, Any], model_max_length: int) -> Any | None:
    """A transformers fast tokenizer built directly from the GGUF vocabulary, or None when the file's
    tokenizer is not a byte-level BPE with a pre-tokenizer this module knows.

    The vocabulary, merges, special tokens and decoder are what transformers' GGUF conversion produces
    (integrations/gguf/gguf_tokenizer_mapping.py: byte_level_tokenizer, add_gguf_special_tokens). The
    pre-tokenizer follows the name the file gives (tokenizer.ggml.pre) as llama.cpp interprets it; for
    "smollm" that is the digit split of SmolLM2's own tokenizer.json, which transformers' GGUF conversion
    leaves out (it falls back to plain GPT-2 splitting for names it does not list).
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return None
    pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", ""))
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
    if pre_tokenizer is None or not tokens or not merges:
        return None
    backend, vocab = _byte_level_bpe(tokens, merges, token_types)
    backend.pre_tokenizer = pre_tokenizer

    def special(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and int(token_id) < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        prefix = [bos] if add_bos and bos is not None else []
        suffix = [eos] if add_eos and eos is not None else []
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A", *suffix]),
            pair=" ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(prefix + suffix)],
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def transformers_tokenizer(gguf_path: Path) -> Any:
    """transformers' own tokenizer for a GGUF file: covers every tokenizer type it supports, but parses
    the vocabulary slowly (seconds)."""
    from transformers import AutoTokenizer

    gguf_path = gguf_path.resolve()
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
