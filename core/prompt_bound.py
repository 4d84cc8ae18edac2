"""A lower bound on a text's token count, read without tokenizing it, so that a prompt far past the context
window is refused at once (tokenizing an 8 MiB prompt took 4-6 s of a core, to answer a 400).

One token stands for at most `TokenBound.chars_per_token` characters of a text: its vocabulary's longest
piece (a byte-level piece's characters are the bytes it covers, at least as many as the characters it
touches) or added token. So a text of n characters is at least n / chars_per_token tokens, provided every
character reaches a token: the normalizer shrinks the text by a known factor at most, the pre-tokenizer
drops nothing, and the model gives every character a token (a byte-level alphabet, byte fallback, or an
unknown token that is not fused). `token_bound` reads those rules from a Hugging Face fast tokenizer's JSON;
any rule it does not know gives no bound, and such a model's prompts are tokenized to be measured.

A byte-level vocabulary without a normalizer gives a tighter bound, byte by byte: a token of m bytes holds
only bytes that some piece of m bytes or more holds, so a byte b weighs at least 1 / (the longest piece
holding b) of a token. Long pieces are runs of spaces, dashes or newlines; a letter's longest piece is a few
times shorter, so prose is bounded about five times tighter than by the longest piece alone (SmolLM2: 5,257
tokens at least for this README's 23,030, against 838). Bytes are counted by weight tier (powers of two),
one pass over the text a tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# The most characters one character decomposes into (Unicode 14, checked by the tests): a text of n characters
# is at least n / 4 characters after NFC (n <= len(NFD(text)) = len(NFD(NFC(text))) <= 4 len(NFC(text))).
CANONICAL_EXPANSION = 4  # U+1F82 and others
COMPATIBILITY_EXPANSION = 18  # U+FDFA
NEVER_SHRINK = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})  # each character -> 1 or more
SHRINK = {"NFC": CANONICAL_EXPANSION, "NFKC": COMPATIBILITY_EXPANSION}
SPLIT_ONLY = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})
BYTE_FALLBACK_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))


@dataclass(frozen=True)
class TokenBound:
    """At least how many tokens a text is, for one tokenizer.

    :param chars_per_token: the most characters of the (normalized) text one token stands for.
    :param shrink: the most characters of the text that one character of its normalized form stands for.
    :param dropped: characters the model may drop (ASCII bytes missing from a byte-level vocabulary).
    :param byte_tiers: (n, the bytes no piece of more than n bytes holds), for the byte-by-byte bound of a
        byte-level vocabulary without a normalizer (none: only the characters' bound).
    """

    chars_per_token: int
    shrink: int = 1
    dropped: str = ""
    byte_tiers: tuple[tuple[int, bytes], ...] = ()

    @property
    def most_chars(self) -> int:
        """The most characters of a text (before normalizing) that one token stands for."""
        return self.chars_per_token * self.shrink

    def min_tokens(self, text: str, ignored: str = "") -> int:
        """The fewest tokens `text` can be, not counting the characters in `ignored` (removed before it is
        tokenized)."""
        kept = len(text) - sum(text.count(c) for c in set(self.dropped + ignored))
        least = -(-kept // self.most_chars)
        if not self.byte_tiers:
            return least
        for c in set(ignored):
            text = text.replace(c, "")
        data = text.encode("utf-8", "ignore")  # (a lone surrogate, which no tokenizer takes, counts nothing)
        tokens = sum((Fraction(len(data) - len(data.translate(None, tier)), n) for n, tier in self.byte_tiers),
                     Fraction(0))
        return max(least, -(-tokens.numerator // tokens.denominator))


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The bound for `tokenizer`, or None where its rules may drop or fuse characters, or are not read here.
    Only a Hugging Face fast tokenizer's ``backend_tokenizer`` (a ``tokenizers.Tokenizer``) is read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # Hugging Face's own attribute; others give no bound
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return None
    return bound_of(json.loads(to_str()))


def bound_of(spec: dict[str, Any]) -> TokenBound | None:
    """The bound for a tokenizer.json's contents (see `token_bound`)."""
    shrink = _shrink(spec.get("normalizer"))
    pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    added = spec.get("added_tokens") or []
    model = spec.get("model") or {}
    if shrink is None or pre is None or model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    if any(step.get("type") not in SPLIT_ONLY or step.get("behavior") == "Removed" for step in pre):
        return None
    if any(token.get("lstrip") or token.get("rstrip") for token in added):  # they take the spaces beside them
        return None
    vocab = model.get("vocab") or {}
    normalizers = _steps(spec.get("normalizer"), "normalizers") or []
    byte_level = any(step.get("type") == "ByteLevel" for step in (*pre, *normalizers))
    dropped = _dropped(vocab, model, byte_level)
    if dropped is None or (dropped and shrink != 1):
        return None
    longest = max((len(piece) for piece in (*vocab, *(token.get("content", "") for token in added))), default=1)
    tiers = _byte_tiers(vocab, added) if byte_level and not normalizers else ()
    return TokenBound(max(longest, 1), shrink, dropped, tiers)


def _steps(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]] | None:
    """A normalizer's or pre-tokenizer's steps (a Sequence flattened); None where one is not an object."""
    if component is None:
        return []
    if not isinstance(component, dict):
        return None
    if component.get("type") != "Sequence":
        return [component]
    steps: list[dict[str, Any]] = []
    for part in component.get(key) or []:
        inner = _steps(part, key)
        if inner is None:
            return None
        steps += inner
    return steps


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """The most characters in per character out of the normalizer; None where it may remove characters."""
    steps = _steps(normalizer, "normalizers")
    if steps is None:
        return None
    factor = 1
    for step in steps:
        kind = step.get("type")
        if kind == "Replace":
            pattern, content = step.get("pattern") or {}, step.get("content", "")
            if "String" not in pattern or len(content) < len(pattern["String"]):
                return None
        elif kind in SHRINK:
            factor *= SHRINK[kind]
        elif kind not in NEVER_SHRINK:
            return None
    return factor


def _dropped(vocab: dict[str, int], model: dict[str, Any], byte_level: bool) -> str | None:
    """The characters a BPE model may give no token: a byte-level vocabulary's missing ASCII bytes (a character
    of several bytes keeps a token while its continuation bytes are in the vocabulary: None where one is not),
    or none where byte fallback or an unknown token catches every character (None where nothing does)."""
    if byte_level:
        alphabet = _byte_alphabet()
        missing = [b for b in range(256) if alphabet[b] not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):
            return None
        return "".join(chr(b) for b in missing if b < 0x80)
    if model.get("byte_fallback") and BYTE_FALLBACK_PIECES <= vocab.keys():
        return ""
    unknown = model.get("unk_token")
    return "" if unknown is not None and unknown in vocab else None


def _byte_tiers(vocab: dict[str, int], added: list[dict[str, Any]]) -> tuple[tuple[int, bytes], ...]:
    """Each byte's longest piece (a byte-level piece's characters are bytes; an added token's content is raw
    text), rounded up to a power of two (at most the longest piece), and the bytes of each such length;
    bytes no piece holds (dropped) are in none."""
    index = {char: byte for byte, char in enumerate(_byte_alphabet())}
    longest = [0] * 256
    for piece in vocab:
        for char in set(piece):
            byte = index.get(char)
            if byte is not None and len(piece) > longest[byte]:
                longest[byte] = len(piece)
    for token in added:
        content = token.get("content", "").encode()
        for byte in set(content):
            longest[byte] = max(longest[byte], len(content))
    top = max(longest)
    tiers: dict[int, list[int]] = {}
    for byte, n in enumerate(longest):
        if n:
            tiers.setdefault(min(1 << (n - 1).bit_length(), top), []).append(byte)
    return tuple((n, bytes(members)) for n, members in sorted(tiers.items()))


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte (as ``tokenizers``' ByteLevel maps
    them: printable Latin-1 bytes are themselves, the others U+0100 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]
