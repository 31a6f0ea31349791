"""Tokenizers: the small one the tiny preset builds locally, loading any saved one, and
converting big_vision's SentencePiece file.

The real pi0.5 uses the PaliGemma SentencePiece tokenizer. It circulates in two forms:
- big_vision's `paligemma_tokenizer.model` (a SentencePiece model, 257152 pieces), which openpi
  downloads itself from gs://big_vision/paligemma_tokenizer.model into its cache
  (`$OPENPI_DATA_HOME`, by default ~/.cache/openpi/big_vision/; openpi
  `src/openpi/models/tokenizer.py`, `src/openpi/shared/download.py`). `fetch_base` converts it
  once into a transformers `GemmaTokenizer` (transformers' own SentencePiece conversion, which
  needs the `sentencepiece` and `protobuf` packages) and checks the conversion against
  SentencePiece itself: the same pieces at the same ids, the same ids for pi0.5-style prompts.
- a Hugging Face tokenizer directory (`google/paligemma-3b-pt-224`, gated), loaded as it is.
The converted tokenizer is saved in transformers' format (tokenizer.json), so the stages after
`fetch_base` load it like any other. The tiny preset gets a WordPiece tokenizer with a fixed vocabulary:
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


# Texts the converted SentencePiece tokenizer must encode exactly as SentencePiece does: pi0.5's
# prompt (task, discretised state, "Action:"), RECAP's advantage suffix, whitespace runs, tabs,
# digits, punctuation and characters outside ASCII (byte fallback).
SENTENCEPIECE_PROBES = (
    "Task: put both moka pots on the stove, State: 12 200 7 0 255 128 31 64;\nAction: ",
    "pick up the book and place it in the back compartment of the caddy\nAdvantage: positive",
    "turn on the stove and put the moka pot on it",
    "  two  spaces,\ta tab; 1234567890 (x) [y] {z} <w> 3.5% \u00fcn\u00efc\u00f8de \u6f22\u5b57 \U0001f916",
    "",
)


def _need(module: str, what: Path) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        package = {"google.protobuf": "protobuf"}.get(module, module)
        raise ModelLoadError(
            f"{what}: converting a SentencePiece tokenizer needs the `{package}` package, which this "
            f"environment lacks. Run `make setup` (both locks pin sentencepiece and protobuf), or "
            f"give model.tokenizer a Hugging Face tokenizer directory (with tokenizer.json) instead."
        ) from None


def tokenizer_from_sentencepiece(model_file: str | Path):
    """A transformers `GemmaTokenizer` made from a SentencePiece model file (big_vision's
    `paligemma_tokenizer.model`), refused unless it reproduces SentencePiece exactly.

    Settings as PaliGemma's own Hugging Face tokenizer: a BOS token first, no EOS (openpi encodes
    prompts with `add_bos=True`), padding with the model's pad piece.
    """
    import json
    import shutil
    import tempfile

    model_file = Path(model_file)
    if not model_file.is_file():
        raise ModelLoadError(f"{model_file}: SentencePiece model file not found")
    _need("sentencepiece", model_file)
    _need("google.protobuf", model_file)
    import sentencepiece
    from transformers import AutoTokenizer

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except Exception as exc:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError for a bad file
        raise ModelLoadError(
            f"{model_file}: not a SentencePiece model ({type(exc).__name__}: {str(exc).strip()}); model.tokenizer "
            f"takes big_vision's paligemma_tokenizer.model or a Hugging Face tokenizer directory"
        ) from None
    size = sp.get_piece_size()
    ids = {"pad": sp.pad_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}
    absent = [name for name, i in ids.items() if i < 0]
    if absent:
        raise ModelLoadError(f"{model_file}: the SentencePiece model defines no {', '.join(absent)} piece; "
                             f"PaliGemma's (pad 0, eos 1, bos 2, unk 3) has all four: wrong tokenizer file")
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
              **{f"{name}_token": sp.id_to_piece(i) for name, i in ids.items()}}
    if sp.piece_to_id("<mask>") == sp.unk_id():
        config["mask_token"] = None  # GemmaTokenizer would add one that SentencePiece does not have
    with tempfile.TemporaryDirectory(prefix="pisft-spm-") as tmp:
        shutil.copyfile(model_file, Path(tmp, "tokenizer.model"))
        Path(tmp, "tokenizer_config.json").write_text(json.dumps(config))
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types here
            raise ModelLoadError(f"{model_file}: transformers could not convert this SentencePiece model "
                                 f"({type(exc).__name__}: {exc})") from None
    problems = []
    if len(tokenizer) != size:
        problems.append(f"{len(tokenizer)} tokens after conversion, {size} SentencePiece pieces")
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    moved = [i for i, piece in enumerate(pieces) if piece != sp.id_to_piece(i)]
    if moved:
        problems.append(f"{len(moved)} ids name other pieces (first: id {moved[0]} is "
                        f"{pieces[moved[0]]!r}, SentencePiece has {sp.id_to_piece(moved[0])!r})")
    for text in SENTENCEPIECE_PROBES:
        want = [sp.bos_id(), *sp.encode(text)]
        got = tokenizer(text)["input_ids"]
        if got != want:
            problems.append(f"{text!r} encodes to {got[:12]}... where SentencePiece gives {want[:12]}...")
            break
    if problems:
        raise ModelLoadError(f"{model_file}: the transformers conversion does not reproduce SentencePiece "
                             f"({'; '.join(problems)}); this is not a PaliGemma/Gemma-style BPE tokenizer, "
                             f"or the conversion changed: give a Hugging Face tokenizer directory instead")
    return tokenizer


def tokenizer_form(path: str | Path) -> str:
    """"sentencepiece" (a SentencePiece model file, or a directory holding only one) or
    "transformers" (a directory a transformers tokenizer's save_pretrained wrote)."""
    path = Path(path)
    if path.is_file():
        return "sentencepiece"
    hf_files = ("tokenizer.json", "tokenizer_config.json")
    if path.is_dir() and not any((path / n).is_file() for n in hf_files) and len(list(path.glob("*.model"))) == 1:
        return "sentencepiece"
    return "transformers"


def open_tokenizer(path: str | Path):
    """(tokenizer, form): a SentencePiece model file (converted, see tokenizer_from_sentencepiece)
    or a transformers tokenizer directory."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: not found; model.tokenizer takes big_vision's paligemma_tokenizer.model "
                             f"(a file) or a Hugging Face tokenizer directory")
    form = tokenizer_form(path)
    if form == "sentencepiece":
        model_file = path if path.is_file() else next(path.glob("*.model"))
        tokenizer = tokenizer_from_sentencepiece(model_file)
        if tokenizer.pad_token_id is None:
            raise ModelLoadError(f"{model_file}: the tokenizer has no padding token; pi0.5 pads prompts")
        return tokenizer, form
    return load_tokenizer(path), form
