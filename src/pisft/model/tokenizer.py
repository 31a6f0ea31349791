"""Tokenizers: the small one the tiny preset builds locally, and loading any saved one.

The real pi0.5 uses the PaliGemma sentencepiece tokenizer (`google/paligemma-3b-pt-224`), which
cannot be downloaded here. The tiny preset gets a WordPiece tokenizer with a fixed vocabulary:
special tokens, the 256 state bins pi0.5 writes into its prompt (`Task: ..., State: 12 200 ...;
Action:`), the words of the LIBERO instructions and RECAP's advantage labels, and every printable
ASCII character (also as a `##` continuation) so that any text still encodes (never `[UNK]` for
ASCII). The vocabulary is listed here, not learned, so the tokenizer is identical on every
machine and its size is fixed (the tiny model's embedding is sized to it).
"""

from __future__ import annotations

import string
from pathlib import Path

from pisft.errors import ModelLoadError

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)

# Words of pi0.5's prompt template and RECAP's advantage-conditioned prompt suffix.
_PROMPT_WORDS = "task state action advantage positive negative".split()
# Words of the LIBERO suites' instructions (LIBERO-10 in particular) and common robot verbs.
_INSTRUCTION_WORDS = """
a and alphabet back basket black book bottle bottom bowl box butter cabinet caddy cheese chocolate
close compartment cream drawer front in it ketchup left microwave moka mug of on open place plate
pick pot pots pudding put right sauce soup stove the to tomato top turn up white wine yellow both
between next rack shelf tray cookie frying pan orange juice milk salad dressing bbq middle box
""".split()


def _vocabulary() -> list[str]:
    words: list[str] = list(SPECIAL_TOKENS)
    seen = set(words)

    def add(token: str) -> None:
        if token not in seen:
            seen.add(token)
            words.append(token)

    for bin_index in range(256):
        add(str(bin_index))
    for word in _PROMPT_WORDS + _INSTRUCTION_WORDS:
        add(word)
    printable = [c for c in string.printable if not c.isspace()]
    for char in printable:
        add(char)
    for char in printable:
        add("##" + char)
    return words


def build_tiny_tokenizer():
    """The tiny preset's tokenizer as a `transformers` fast tokenizer (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(_vocabulary())}
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token=UNK, max_input_chars_per_word=100))
    core.normalizer = normalizers.Sequence(
        [normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()]
    )
    # Split on whitespace and punctuation ("State:" -> "state", ":"), digits stay whole numbers.
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # Like PaliGemma: a BOS token first, no EOS (the prompt continues with the action).
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        padding_side="right",
        model_max_length=4096,
    )


def save_tiny_tokenizer(out_dir: str | Path) -> int:
    """Write the tiny tokenizer to `out_dir`; return its vocabulary size."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    return len(tokenizer)


def tiny_vocab_size() -> int:
    return len(_vocabulary())


def load_tokenizer(tokenizer_dir: str | Path):
    """Load a saved tokenizer (any `transformers` tokenizer directory); clear error if unusable."""
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise ModelLoadError(
            f"{tokenizer_dir}: tokenizer directory not found; the model directory must contain "
            f"tokenizer/ (written by fetch_base). Re-run fetch_base, or set model.tokenizer."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(
            f"{tokenizer_dir}: not a loadable tokenizer ({type(exc).__name__}: {exc}); it must hold "
            f"the files written by a transformers tokenizer's save_pretrained (e.g. tokenizer.json)"
        ) from None
    if tokenizer.pad_token_id is None:
        raise ModelLoadError(f"{tokenizer_dir}: the tokenizer has no padding token; pi0.5 pads prompts")
    return tokenizer
