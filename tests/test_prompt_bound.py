"""The least tokens of a text, read from a tokenizer's rules (core.prompt_bound): never more than the text
really is (adversarial texts through real `tokenizers` objects), no bound where the rules may drop or fuse
characters, and a prompt that cannot fit is refused before it is tokenized, one that fits never."""

from __future__ import annotations

import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest

from core.backend import ModelInfo
from core.chat_template import ChatTemplate
from core.config import GenerationConfig
from core.errors import ContextTooLongError, InvalidRequestError
from core.prompt_bound import (
    CANONICAL_EXPANSION,
    COMPATIBILITY_EXPANSION,
    _byte_alphabet,
    bound_of,
    token_bound,
)
from core.request import RequestPreparer
from core.testing.fake import ByteTokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

CORPUS = ["hello world, hello there", "#" * 64, "        return x  # indented", "aaaa bbbb aaaa", "ça va? déjà"] * 5
ALPHABET = pre_tokenizers.ByteLevel.alphabet()


def byte_level(normalizer=None, **bpe) -> Tokenizer:
    """A byte-level BPE trained on CORPUS (pieces up to 16 '#'), as GPT-2's, Llama 3's, Qwen's, SmolLM2's."""
    tok = Tokenizer(models.BPE(**bpe))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=340, initial_alphabet=ALPHABET,
                                                        special_tokens=["<s>", "</s>"], show_progress=False))
    return tok


def byte_level_without(missing: str) -> Tokenizer:
    """Byte-level pieces, no merges, the bytes of `missing` left out of the vocabulary (SmolLM2's GGUF vocabulary
    has no piece for six ASCII control bytes: its tokenizer drops them)."""
    gone = {_byte_alphabet()[b] for b in missing.encode()}
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(set(ALPHABET) - gone))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama 2's layout: a prepended and replaced "▁", byte fallback for what the pieces miss."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁hello", "▁world", "▁▁▁▁", *"abcdefgh"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                               unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    return tok


def spec(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def adversarial_texts(tok: Tokenizer, count: int = 150) -> list[str]:
    """Runs of the longest pieces, spaces, newlines, control bytes, combining marks, astral characters."""
    rng = random.Random(7)
    pieces = [decoders.ByteLevel().decode([p]) if tok.decoder is None else tok.decode([i], skip_special_tokens=False)
              for p, i in tok.get_vocab().items()]
    pools = [lambda: rng.choice(pieces) * rng.randint(1, 20), lambda: " " * rng.randint(1, 300),
             lambda: "\n" * rng.randint(1, 50), lambda: "".join(chr(rng.randint(0, 127)) for _ in range(40)),
             lambda: "α\u0314\u0342\u0345" * rng.randint(1, 30), lambda: "\u1100\u1161\u11a8" * rng.randint(1, 30),
             lambda: "".join(chr(rng.randint(0x80, 0x2FFFF)) for _ in range(20)), lambda: "<s></s>" * 3]
    texts = ["".join(rng.choice(pools)() for _ in range(rng.randint(1, 12))) for _ in range(count)]
    return [t.encode("utf-8", "ignore").decode("utf-8") for t in texts]


@pytest.mark.parametrize("make", [byte_level, lambda: byte_level(normalizers.NFC()),
                                  lambda: byte_level(normalizers.NFKC()),
                                  lambda: byte_level_without("\x04\x06\x13"), sentencepiece_like],
                         ids=["byte-level", "nfc", "nfkc", "dropped-bytes", "sentencepiece"])
def test_no_text_is_fewer_tokens_than_the_bound(make):
    tok = make()
    bound = bound_of(spec(tok))
    assert bound is not None
    for text in adversarial_texts(tok):
        assert len(tok.encode(text).ids) >= bound.min_tokens(text), repr(text[:80])


def test_the_default_models_tokenizer_is_never_fewer_tokens_than_the_bound():
    """SmolLM2's own tokenizer (the GGUF's vocabulary, six control bytes missing), on adversarial texts and on
    this repository's prose and code."""
    pytest.importorskip("core_pytorch_backend")
    from transformers import AutoTokenizer

    from core_pytorch_backend.loader import cached_gguf_folder, default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    hf = AutoTokenizer.from_pretrained(cached_gguf_folder(path, with_weights=False))
    bound = token_bound(hf)
    assert bound is not None and bound.byte_tiers and bound.dropped == "\x04\x06\x13\x14\x16\x1d"
    root = Path(__file__).parents[1]
    texts = [*adversarial_texts(hf.backend_tokenizer, 100), *(root / name for name in ("README.md", "core/request.py"))]
    for text in texts:
        text = text.read_text() if isinstance(text, Path) else text
        assert len(hf.encode(text, add_special_tokens=False)) >= bound.min_tokens(text), repr(text[:80])


def test_the_bound_reads_the_longest_piece_the_normalizer_and_the_dropped_bytes():
    assert bound_of(spec(byte_level())).chars_per_token == max(len(p) for p in byte_level().get_vocab())
    assert bound_of(spec(byte_level(normalizers.NFC()))).shrink == CANONICAL_EXPANSION
    assert bound_of(spec(byte_level_without("\x04\x06"))).dropped == "\x04\x06"
    tok = byte_level_without("\x04")
    assert tok.encode("\x04" * 1000).ids == []  # why: a bound counting them would refuse a prompt that fits


@pytest.mark.parametrize("change", [
    lambda tok: setattr(tok, "normalizer", normalizers.Strip()),  # removes characters
    lambda tok: setattr(tok, "normalizer", normalizers.Replace("  ", " ")),  # shrinks
    lambda tok: setattr(tok, "pre_tokenizer", pre_tokenizers.Whitespace()),  # drops spaces
    lambda tok: setattr(tok, "pre_tokenizer", pre_tokenizers.Split(" ", "removed")),
    lambda tok: tok.add_special_tokens([tokenizers.AddedToken("<x>", rstrip=True)]),  # swallows spaces after it
])
def test_rules_that_may_drop_characters_give_no_bound(change):
    tok = byte_level()
    change(tok)
    assert bound_of(spec(tok)) is None


def test_models_that_may_drop_or_fuse_characters_give_no_bound():
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))  # a long word: one [UNK]
    assert bound_of(spec(wordpiece)) is None
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert bound_of(spec(fused)) is None
    assert bound_of(spec(Tokenizer(models.BPE({"a": 0}, [])))) is None  # no unknown token: drops the rest
    assert bound_of(spec(byte_level_without("\x80"))) is None  # a continuation byte: whole characters dropped
    assert token_bound(ByteTokenizer()) is None  # not a Hugging Face tokenizer: nothing read


def test_the_expansion_constants_are_unicodes():
    longest = {form: max(len(unicodedata.normalize(form, chr(c))) for c in range(sys.maxunicode + 1))
               for form in ("NFD", "NFKD")}
    assert longest == {"NFD": CANONICAL_EXPANSION, "NFKD": COMPATIBILITY_EXPANSION}


def test_the_byte_alphabet_is_tokenizers():
    byte_level_pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = _byte_alphabet()
    for char in ["\x00", "\x7f", "é", "\u07ff", "\uffef", "\U0001f600", *map(chr, range(128))]:
        [(mapped, _)] = byte_level_pre.pre_tokenize_str(char)
        assert mapped == "".join(alphabet[b] for b in char.encode())
    assert sorted(alphabet) == sorted(ALPHABET)


# -- the preparer refuses a prompt that cannot fit before tokenizing it -------------------------------------

WINDOW = 64


class CountingTokenizer:
    """A Hugging Face fast tokenizer of `tok` that counts its encode calls."""

    def __init__(self, tok: Tokenizer) -> None:
        from transformers import PreTrainedTokenizerFast

        self.hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        self.backend_tokenizer = self.hf.backend_tokenizer
        self.eos_token_id, self.all_special_ids = self.hf.eos_token_id, self.hf.all_special_ids
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += 1
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


class Plain(ChatTemplate):
    def render(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


@pytest.fixture
def preparer() -> RequestPreparer:
    pytest.importorskip("transformers")
    tokenizer = CountingTokenizer(byte_level())
    info = ModelInfo("tiny", "Tiny", WINDOW, eos_token_ids=(tokenizer.eos_token_id,), vocab_size=340)
    return RequestPreparer(info, tokenizer, Plain())


def longest_piece(preparer: RequestPreparer) -> str:
    vocab = preparer.tokenizer.hf.get_vocab()
    return preparer.tokenizer.decode([vocab[max(vocab, key=len)]])


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(preparer, chat):
    """An 8 MiB prompt took 4-6 s of tokenizing before its 400 on a 2-core EPYC; now it takes milliseconds."""
    text = "x" * (WINDOW * preparer.token_bound.most_chars)
    inputs = [{"role": "user", "content": text}] if chat else text
    with pytest.raises(ContextTooLongError, match=f"at least .* tokens .* context window is {WINDOW} tokens"):
        preparer.prepare(inputs, GenerationConfig())
    assert preparer.tokenizer.encoded == 0


def test_bytes_that_only_short_pieces_hold_bound_a_prompt_tighter(preparer):
    """No piece holding "x" is longer than 2 bytes: a run of x's is at least half as many tokens, though the
    longest piece (16 '#') alone would let it through."""
    bound = preparer.token_bound
    text = "x" * (4 * WINDOW)
    assert -(-len(text) // bound.most_chars) < WINDOW <= bound.min_tokens(text)
    with pytest.raises(ContextTooLongError):
        preparer.prepare(text, GenerationConfig())
    assert preparer.tokenizer.encoded == 0


def test_a_prompt_at_the_bound_that_fits_is_served(preparer):
    """The longest piece, window - 1 times: exactly as many characters as the bound lets through, and
    window - 1 tokens: it fits, so it is tokenized and served; one character more cannot fit."""
    piece = longest_piece(preparer)
    assert len(piece) == preparer.token_bound.chars_per_token
    prepared = preparer.prepare(piece * (WINDOW - 1), GenerationConfig())
    assert len(prepared.prompt_token_ids) == WINDOW - 1 and preparer.tokenizer.encoded == 1
    with pytest.raises(ContextTooLongError):
        preparer.prepare(piece * (WINDOW - 1) + "#", GenerationConfig())
    assert preparer.tokenizer.encoded == 1


def test_a_prompt_to_be_truncated_is_tokenized_and_kept_whole_to_its_last_tokens(preparer):
    text = "x" * (WINDOW * preparer.token_bound.most_chars)
    prepared = preparer.prepare(text, GenerationConfig(truncate_prompt_tokens=8))
    assert len(prepared.prompt_token_ids) == 8 and preparer.tokenizer.encoded == 1


def test_characters_the_tokenizer_drops_are_not_counted():
    """SmolLM2's tokenizer drops six control bytes: a long run of them is no tokens, never a 400 for length."""
    pytest.importorskip("transformers")
    tokenizer = CountingTokenizer(byte_level_without("\x04"))
    preparer = RequestPreparer(ModelInfo("tiny", "Tiny", WINDOW, vocab_size=256), tokenizer, Plain())
    with pytest.raises(InvalidRequestError, match="empty after tokenization"):
        preparer.prepare("\x04" * (100 * WINDOW), GenerationConfig())
    assert tokenizer.encoded == 1
