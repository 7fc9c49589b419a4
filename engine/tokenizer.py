"""A checkpoint's tokenizer and chat template, from tokenizer.json and tokenizer_config.json.

Torch-free on purpose: the gateway tokenizes and applies the chat template without torch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

from engine.errors import CheckpointError


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot parse: {exc}") from exc


def _token_text(value) -> Optional[str]:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        generation = _read_json(os.path.join(folder, "generation_config.json"))
        self.chat_template: Optional[str] = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        eos_ids = generation.get("eos_token_id")
        if eos_ids is None and self.eos_token is not None:
            eos_ids = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_ids is None else (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
        )
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.cache
    def _compiled_template(self):
        """Compiled once: compiling a template costs far more than rendering it."""
        if not self.chat_template:
            raise CheckpointError("this model has no chat template (tokenizer_config.json: chat_template)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> str:
        """`template_kwargs`: more variables the template may read (enable_thinking, ...)."""
        return self._compiled_template().render(
            **template_kwargs,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
