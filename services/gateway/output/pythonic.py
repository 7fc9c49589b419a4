"""Python's call syntax as models write tool calls in it (`[NAME(KEY=VALUE, ...)]`, Llama 4's
pythonic form), read without running anything: the values of literals as JSON holds them, and
where a keyword argument's value ends while its text is still being written.

A value is a Python literal: a string, a number, True/False/None, a list, tuple or set (a JSON
array), a dict with string keys; JSON's true/false/null are read too, as vLLM's pythonic parsers
read them. Bytes, NaN and infinities, expressions and names are not values.
"""

from __future__ import annotations

import ast
import math
import re
import warnings

_JSON_NAMES = {"true": True, "false": False, "null": None}


def literal(node: ast.expr):
    """A Python literal's value as JSON can hold it; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return {k.value: literal(v) for k, v in zip(node.keys, node.values)}
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a JSON value: {ast.dump(node)}")


def dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted_name(node.value)
        return head and f"{head}.{node.attr}"
    return None


def parse_expression(text: str) -> ast.expr | None:
    with warnings.catch_warnings():  # "invalid escape sequence" in a model's string
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError):
            return None


def escape_size(text: str, at: int) -> int | None:
    """Length of the escape at `at` (a backslash) in a string literal; None while later
    characters could still change it (`\\x4`, `\\12`, `\\N{...`)."""
    kind = text[at + 1 : at + 2]
    if kind in ("x", "u", "U"):
        size = 2 + {"x": 2, "u": 4, "U": 8}[kind]
    elif kind == "N":
        close = text.find("}", at)
        size = close + 1 - at if close >= 0 else len(text) + 1 - at
    elif kind and kind in "01234567":
        digits = len(re.match(r"[0-7]{1,3}", text[at + 1 : at + 4])[0])
        grows = digits < 3 and at + 1 + digits == len(text)
        size = len(text) + 1 - at if grows else 1 + digits
    else:
        size = 2
    return size if at + size <= len(text) else None


class ValueScan:
    """Where a keyword argument's value ends as its text grows: its `,` or the call's `)`, at
    depth 0 outside strings. Each character is read once; while the value is a plain string
    literal still open, `settled` is where its characters are known up to (a whole escape)."""

    def __init__(self, text: str, start: int):
        self.start, self.i, self.depth = start, start, 0
        self.close = ""  # the open string's closing quote(s)
        quote = text[start : start + 1]
        self.plain = quote in ("'", '"')  # a string literal with no prefix, so far
        self.settled = start + 1

    def end(self, text: str) -> int | None:
        """The index of the value's `,` or `)`; None while it may go on; -1 if it cannot be one."""
        while self.i < len(text):
            i = self.i
            c = text[i]
            if self.close:
                if c == "\\":
                    size = escape_size(text, i)
                    if size is None:
                        return None
                    self.i += size
                elif text.startswith(self.close, i):
                    self.i += len(self.close)
                    self.close = ""
                elif self.close.startswith(text[i:]):
                    return None  # the start of a triple quote's end
                else:
                    self.i += 1
                if self.close and self.plain:
                    self.settled = self.i
                continue
            if c in "'\"":
                if text[i:] in (c, c * 2):
                    return None  # "" may open a triple quote
                self.close = c * 3 if text.startswith(c * 3, i) else c
                self.plain = self.plain and i == self.start and len(self.close) == 1
                self.i += len(self.close)
                self.settled = self.i
                continue
            self.plain = False
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    return i if c == ")" else -1
                self.depth -= 1
            elif c == "," and self.depth == 0:
                return i
            self.i += 1
        return None
