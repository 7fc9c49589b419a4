"""Grammar-constrained decoding (structured outputs) with llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar (the gateway makes one from a
JSON schema, `json_object`, or a forced tool call: `LLMatcher.grammar_from_json_schema`,
`grammar_from_lark`). Each such sequence gets a matcher over this model's tokenizer that
follows its output; before every draw the matcher's token mask removes the tokens the
grammar does not allow, in the batched sampler (logprobs stay the model's own).

With speculative decoding, drafts are cut to the prefix the grammar accepts before they are
verified, each draft position is masked in the state after the drafts before it (consumed,
then rolled back), and the matcher advances only on the tokens finally kept: never on a
rejected one.
"""

from __future__ import annotations

import json

import torch

from engine.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """This model's tokenizer as llguidance sees it (built once: a few ms for a small vocabulary)."""

    def __init__(self, tokenizer, eos_token_ids: list[int], vocab_size: int):
        """`tokenizer`: the model's (engine/tokenizer.py): from its tokenizer.json, or its tiktoken encoding."""
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        eos = self.eos_token_ids or None
        if tokenizer.tokenizer_json is not None:
            with open(tokenizer.tokenizer_json) as f:
                text = f.read()
            self.tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
            spec = json.loads(text)
            replacements = decoder_replacements(spec)
            if replacements:
                tokens = DecodedTokens(self.tokenizer, tokenizer.encode, spec, replacements)
                self.tokenizer = LLTokenizer(tokens, n_vocab=vocab_size, eos_token=eos)
        else:
            from llguidance.tiktoken import lltokenizer_from_encoding

            self.tokenizer = lltokenizer_from_encoding(
                tokenizer.tiktoken_encoding, n_vocab=vocab_size, eos_token=eos
            )

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the output grammar is invalid: {matcher.get_error()}")
        return matcher

    def allowed(self, matcher) -> torch.Tensor:
        """[vocab] bool: the tokens the matcher allows next."""
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words[:, None] >> _BITS) & 1).bool().reshape(-1)[: self.vocab_size]
        if not allowed.any():  # a matcher in error (it never should be): end the request
            allowed[self.eos_token_ids] = True
        return allowed

    def masks(self, matcher, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, vocab] bool: the allowed tokens at the draft's positions and after it,
        each in the state after the drafts before it; the matcher ends where it began."""
        rows = [self.allowed(matcher)]
        consumed = 0
        for token in draft:
            if token in self.eos_token_ids:
                # Never consumed: llguidance's rollback does not undo an end token. A request
                # that keeps it ends there, so the rows after it are never drawn from.
                rows += rows[-1:] * (len(draft) + 1 - len(rows))
                break
            matcher.consume_token(token)
            consumed += 1
            rows.append(self.allowed(matcher))
        if consumed:
            matcher.rollback(consumed)
        return torch.stack(rows)


def decoder_replacements(tokenizer_json: dict) -> list[tuple[bytes, bytes]]:
    """The string replacements a tokenizer's decoder makes after its byte-level step (the demo
    model's NAME_SPACE, decoded to a space). llguidance reads a byte-level token as its bytes and
    skips them, so its grammar would see U+2581 where the output has a space."""
    decoder = tokenizer_json.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    replacements, bytes_decoded = [], False
    for step in steps:
        bytes_decoded |= step.get("type") == "ByteLevel"
        if bytes_decoded and step.get("type") == "Replace" and "String" in step["pattern"]:
            replacements.append((step["pattern"]["String"].encode(), step["content"].encode()))
    return replacements


class DecodedTokens:
    """A tokenizer as llguidance's TokenizerWrapper: each token as the bytes it decodes to, and
    the tokenizer's own encoding for the text a grammar forces."""

    is_tokenizer_wrapper = True

    def __init__(
        self, lltokenizer, encode, tokenizer_json: dict, replacements: list[tuple[bytes, bytes]]
    ):
        """`encode(text, add_special_tokens)`: the model's tokenizer's (engine/tokenizer.py)."""
        self._encode = encode
        self.tokens = []
        for token in range(lltokenizer.vocab_size):
            data = lltokenizer.decode_bytes([token])
            for old, new in replacements:
                data = data.replace(old, new)
            self.tokens.append(data)
        self.special_token_ids = [
            t["id"] for t in tokenizer_json.get("added_tokens", []) if t["special"]
        ]
        self.eos_token_id = lltokenizer.eos_token
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


def valid_prefix(matcher: object | None, draft: list[int]) -> list[int]:
    """The draft's leading tokens the grammar accepts (all of them without a grammar)."""
    return draft if matcher is None or not draft else draft[: matcher.validate_tokens(draft)]
