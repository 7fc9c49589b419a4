"""A checkpoint's tokenizer and chat template, as models ship them.

- Vocabulary: `tokenizer.json` (Hugging Face tokenizers), or a tiktoken BPE file
  (`tiktoken.model`, Kimi's: engine/tiktoken_vocab.py), read natively; a gpt-oss folder
  (model_type gpt_oss) with neither gets o200k_harmony, which tandem ships (engine/o200k.py),
  ending turns as gpt-oss's generation_config.json does, and a Llama 4 folder gets Llama 4's
  from the llama-models package (engine/llama4_vocab.py); the checkpoint's own
  Python (`tokenization_*.py`, named by tokenizer_config.json's `auto_map`) is run only with
  `trust_remote_code` (`--trust-remote-code`), through transformers' AutoTokenizer, and only
  where neither native file is there: they stay the default even then.
- Template: `chat_template.jinja` beside the tokenizer, else `chat_template` in
  tokenizer_config.json (a string, or named templates: `tool_use` when tools are given, else
  `default`); a Llama 4 folder with neither gets tandem's, which writes a conversation as
  llama-models does (engine/chat_templates/llama4.jinja). Rendered as transformers renders it:
  trim_blocks, lstrip_blocks, loop controls (`{% break %}`), `tojson`, `raise_exception`,
  `strftime_now`.
- End of turn: generation_config.json's `eos_token_id` (one id or a list), else the eos token's.

Torch-free on purpose: the gateway tokenizes and applies the chat template without torch.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

from engine.errors import CheckpointError

TEMPLATE_FILE = "chat_template.jinja"


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot parse: {exc}") from exc


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


NATIVE_FILES = ("tokenizer.json", "tiktoken.model")


def _gpt_oss(folder: str) -> bool:
    """A gpt-oss checkpoint: its vocabulary is o200k_harmony, whatever files it ships."""
    return _read_json(os.path.join(folder, "config.json")).get("model_type") == "gpt_oss"


def _llama4(folder: str) -> bool:
    """A Llama 4 checkpoint: its vocabulary ships in llama-models where it has no tokenizer.json."""
    from engine.llama4_vocab import is_llama4

    return is_llama4(_read_json(os.path.join(folder, "config.json")))


def has_tokenizer(folder: str, trust_remote_code: bool = False) -> bool:
    """Whether `folder` has a tokenizer tandem will load: a native file (or gpt-oss's built-in
    vocabulary), or with `trust_remote_code` any tokenizer_config.json (transformers then loads it)."""
    if any(os.path.isfile(os.path.join(folder, name)) for name in NATIVE_FILES):
        return True
    if _gpt_oss(folder) or _llama4(folder):
        return True
    return trust_remote_code and os.path.isfile(os.path.join(folder, "tokenizer_config.json"))


def remote_code_file(config: dict) -> str | None:
    """The Python file of the tokenizer class tokenizer_config.json's `auto_map` names
    (`["tokenization_kimi.TikTokenTokenizer", null]` -> tokenization_kimi.py), if any."""
    refs = (config.get("auto_map") or {}).get("AutoTokenizer")
    for ref in refs if isinstance(refs, list) else [refs]:
        if isinstance(ref, str) and "." in ref:
            return ref.split("--")[-1].rsplit(".", 1)[0] + ".py"  # "repo--module.Class": the module
    return None


def missing_tokenizer(folder: str) -> str:
    """Why `folder`'s tokenizer is not loaded without --trust-remote-code, and what to do."""
    code = remote_code_file(_read_json(os.path.join(folder, "tokenizer_config.json")))
    if code:
        return (
            f"{folder}: its tokenizer is the checkpoint's own Python ({code}, named by tokenizer_config.json's "
            f"auto_map) and it has no tokenizer.json or tiktoken.model, which tandem reads natively; to run that "
            f"code, pass --trust-remote-code (TRUST_REMOTE_CODE=1 with make run)"
        )
    return (
        f"{folder}: no tokenizer.json or tiktoken.model (tandem reads these natively; --trust-remote-code "
        f"loads any other tokenizer through transformers, running the checkpoint's code)"
    )


class _HFVocabulary:
    """tokenizer.json through Hugging Face tokenizers."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)


class _RemoteVocabulary:
    """Any other tokenizer, with trust_remote_code: transformers' AutoTokenizer, which runs the
    checkpoint's own tokenization_*.py (and imports torch where it is installed)."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        except Exception as exc:  # its own code may raise anything
            raise CheckpointError(
                f"{folder}: cannot load its tokenizer through transformers: {exc}"
            ) from exc

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tok.convert_tokens_to_ids(token)
        unknown = token_id is None or (
            token_id == self._tok.unk_token_id and token != self._tok.unk_token
        )
        return None if unknown else token_id

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        added = getattr(self._tok, "added_tokens_decoder", {})
        return frozenset(self._tok.all_special_ids) | frozenset(
            i for i, t in added.items() if t.special
        )


def _vocabulary(folder: str, config: dict, trust_remote_code: bool):
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return _HFVocabulary(path)
    if os.path.isfile(os.path.join(folder, "tiktoken.model")):
        from engine.tiktoken_vocab import TiktokenVocabulary

        return TiktokenVocabulary(folder, config)
    if _gpt_oss(folder):
        from engine.o200k import HarmonyVocabulary

        return HarmonyVocabulary()
    if _llama4(folder):
        from engine.llama4_vocab import Llama4Vocabulary

        return Llama4Vocabulary()
    if trust_remote_code:
        return _RemoteVocabulary(folder)
    raise CheckpointError(missing_tokenizer(folder))


def _templates(folder: str, config: dict) -> dict[str, str]:
    """The folder's chat templates by name ('default' for the one template)."""
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return {"default": f.read()}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    if template:
        return {"default": template}
    if _llama4(folder):
        from engine.llama4_vocab import chat_template

        return {"default": chat_template()}
    return {}


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class Tokenizer:
    def __init__(self, folder: str, trust_remote_code: bool = False):
        """`trust_remote_code`: a tokenizer only the checkpoint's own Python reads may be loaded
        (its native files still come first)."""
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        generation = _read_json(os.path.join(folder, "generation_config.json"))
        self._tok = _vocabulary(folder, config, trust_remote_code)
        self.templates = _templates(folder, config)
        self._compiled_templates: dict[str, object] = {}  # name -> jinja2 Template
        self.chat_template: str | None = self.templates.get("default") or next(
            iter(self.templates.values()), None
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        eos_ids = generation.get("eos_token_id")
        if eos_ids is None and self.eos_token is not None:
            eos_ids = self._tok.token_to_id(self.eos_token)
        if eos_ids is None:  # a vocabulary that knows its family's (gpt-oss's, Llama 4's)
            eos_ids = getattr(self._tok, "eos_token_ids", None)
        # and its BOS and EOS tokens where the folder names none (Llama 4's template writes BOS)
        self.bos_token = self.bos_token or getattr(self._tok, "bos_token", None)
        self.eos_token = self.eos_token or getattr(self._tok, "eos_token", None)
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_ids is None else (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
        )
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    @property
    def tokenizer_json(self) -> str | None:
        """The tokenizer.json path (structured outputs build their token tables from it), if any."""
        return getattr(self._tok, "path", None)

    @property
    def tiktoken_encoding(self):
        """The tiktoken Encoding of a tiktoken.model vocabulary, else None."""
        return getattr(self._tok, "encoding", None)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> str:
        """`keep`: special tokens shown even when the others are skipped (a format's markup)."""
        if skip_special_tokens and keep:
            special = self._tok.special_ids
            token_ids = [t for t in token_ids if t not in special or t in keep]
            skip_special_tokens = False
        return self._tok.decode(token_ids, skip_special_tokens)

    def special_markup(self, markers) -> frozenset[int]:
        """The ids of those `markers` that are one special token here (decoding would drop them)."""
        ids = (self._tok.token_to_id(m) for m in markers)
        return frozenset(i for i in ids if i is not None and i in self._tok.special_ids)

    def _compiled_template(self, name: str):
        """Compiled once per tokenizer: compiling a template costs far more than rendering it.
        (A per-instance dict, not functools.cache, which would keep every tokenizer alive.)"""
        if name not in self._compiled_templates:
            self._compiled_templates[name] = self._compile_template(name)
        return self._compiled_templates[name]

    def _compile_template(self, name: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.templates[name])

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        """`template_kwargs`: more variables the template may read (enable_thinking, ...)."""
        if not self.templates:
            raise CheckpointError(
                f"this model has no chat template ({TEMPLATE_FILE} or tokenizer_config.json: "
                f"chat_template)"
            )
        name = (
            "tool_use"
            if tools and "tool_use" in self.templates
            else "default"
            if "default" in self.templates
            else next(iter(self.templates))
        )
        return self._compiled_template(name).render(
            **template_kwargs,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
