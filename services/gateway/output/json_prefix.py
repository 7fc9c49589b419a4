"""A streaming check that text is a prefix of one JSON value, a character at a time.

Tool-call arguments stream to clients as the model writes them (tool_calls.py), and a client
must never be shown text that is not the start of valid JSON. `JsonPrefix` reads characters
as they come and says how many of them are *decided*: a prefix every token of which is
complete and valid. A token that could still turn either way waits: a number until the
character after it (`1` may become `1.5` or `1x`), a literal until its last letter (`tr` may
become `true` or `trx`), an escape until its last character (`\\u00` needs two more hex
digits). Characters inside a string are decided one by one, since any of them but a control
character or an unescaped quote or backslash continues the string.

Strict JSON, as json.loads reads it with strict=True except that NaN and Infinity are refused
(they are not JSON, and clients' parsers refuse them).
"""

from __future__ import annotations

WHITESPACE = " \t\n\r"
ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "true", "f": "false", "n": "null"}
# A number's states: which characters may follow, and whether it may end here.
NUMBER_NEXT = {
    "minus": ("digit_or_zero",),
    "zero": (".", "e"),
    "int": ("digit", ".", "e"),
    "dot": ("digit",),
    "frac": ("digit", "e"),
    "e": ("sign", "digit"),
    "e_sign": ("digit",),
    "exp": ("digit",),
}
NUMBER_ENDS = {"zero", "int", "frac", "exp"}


class JsonPrefix:
    """One JSON value's text, fed in pieces. After each `feed`: `failed` (the text is not a
    JSON prefix), `decided` (how many characters are settled valid), `end` (where the value
    ended, once it has; characters after it are not consumed)."""

    def __init__(self):
        self.stack: list[str] = []  # open containers: "{" or "["
        # value | key | key_or_close | value_or_close | colon | after | string | done
        self.state = "value"
        self.in_key = False  # the open string is an object key
        self.token = ""  # an unfinished literal, number state, or escape
        self.token_kind = ""  # literal | number | escape | unicode
        self.read = 0  # characters consumed
        self.decided = 0
        self.failed = False
        self.end: int | None = None

    def feed(self, text: str) -> int:
        """Reads `text`; returns how many of its characters belong to the value."""
        for i, char in enumerate(text):
            if self.failed or self.end is not None:
                return i
            self._char(char)
            if self.end == self.read:  # a bare number ended before this character
                return i
            if not self.failed:
                self.read += 1
                if not self.token_kind:
                    self.decided = self.read
        return len(text)

    def _fail(self) -> None:
        self.failed = True

    def _value_done(self) -> None:
        self.state = "after" if self.stack else "done"
        if not self.stack:
            self.end = self.read + 1

    def _char(self, c: str) -> None:
        kind = self.token_kind
        if kind == "literal":
            self.token = self.token[1:]
            if c != self.token[0]:
                return self._fail()
            if len(self.token) == 1:
                self.token, self.token_kind = "", ""
                self._value_done()
            return
        if kind == "number":
            if self._number(c) or self.failed:
                return
            self.token, self.token_kind = "", ""
            self.decided = self.read  # the number ended before this character
            if not self.stack:  # it was the whole value: this character is not the value's
                self.state, self.end = "done", self.read
                return
            self.state = "after"
        elif kind == "escape":
            if c == "u":
                self.token, self.token_kind = "", "unicode"
            elif c in ESCAPES:
                self.token_kind = ""
            else:
                self._fail()
            return
        elif kind == "unicode":
            if c not in HEX:
                return self._fail()
            self.token += c
            if len(self.token) == 4:
                self.token, self.token_kind = "", ""
            return
        self._structural(c)

    def _structural(self, c: str) -> None:
        state = self.state
        if state == "string":
            if c == '"':
                if self.in_key:
                    self.state, self.in_key = "colon", False
                else:
                    self._value_done()
            elif c == "\\":
                self.token_kind = "escape"
            elif ord(c) < 0x20:
                self._fail()
            return
        if c in WHITESPACE:
            return
        if state in ("value", "value_or_close"):
            if c == "]" and state == "value_or_close":
                return self._close("[")
            if c == "{":
                self.stack.append("{")
                self.state = "key_or_close"
            elif c == "[":
                self.stack.append("[")
                self.state = "value_or_close"
            elif c == '"':
                self.state = "string"
            elif c in LITERALS:
                self.token, self.token_kind = LITERALS[c], "literal"
            elif c == "-" or c in DIGITS:
                self.token_kind = "number"
                self.token = "minus" if c == "-" else "zero" if c == "0" else "int"
            else:
                self._fail()
        elif state in ("key", "key_or_close"):
            if c == "}" and state == "key_or_close":
                return self._close("{")
            if c != '"':
                return self._fail()
            self.state, self.in_key = "string", True
        elif state == "colon":
            if c != ":":
                return self._fail()
            self.state = "value"
        elif state == "after":
            if c == ",":
                self.state = "key" if self.stack[-1] == "{" else "value"
            elif c in "]}":
                self._close("[" if c == "]" else "{")
            else:
                self._fail()
        else:
            self._fail()

    def _close(self, opener: str) -> None:
        if not self.stack or self.stack[-1] != opener:
            return self._fail()
        self.stack.pop()
        self._value_done()

    def _number(self, c: str) -> bool:
        """Whether `c` continues the number (False: the number ended before it, or failed)."""
        allowed = NUMBER_NEXT[self.token]
        if c in DIGITS and ("digit" in allowed or "digit_or_zero" in allowed):
            self.token = {
                "minus": "zero" if c == "0" else "int",
                "dot": "frac",
                "e": "exp",
                "e_sign": "exp",
            }.get(self.token, self.token)
            return True
        if c == "." and "." in allowed:
            self.token = "dot"
            return True
        if c in "eE" and "e" in allowed:
            self.token = "e"
            return True
        if c in "+-" and "sign" in allowed:
            self.token = "e_sign"
            return True
        if self.token not in NUMBER_ENDS:
            self._fail()
        return False
