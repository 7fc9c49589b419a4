"""The families' tokenizers as their Hugging Face checkpoints ship them (tokenizer.json,
tokenizer_config.json, generation_config.json), built from the vocabularies that pip packages
carry, with transformers' own converters (the ones that made the published tokenizer.json files).

- Llama 3.1: the llama-models package's tiktoken `tokenizer.model` and its 256 special tokens.
- Mistral Nemo: mistral-common's `tekken_240718.json` (Nemo's tekken, July 2024).
- Qwen3: Qwen's 151,643 byte-level BPE ranks (`qwen.tiktoken`, from the dashscope package),
  which Qwen2 and Qwen3 keep unchanged, with Qwen3's 26 added tokens at their published ids.
"""

from __future__ import annotations

import json
import os

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens from id 151643, and whether each is special (the markup is not).
QWEN3_ADDED = [
    (t, True)
    for t in (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
] + [
    (t, False)
    for t in (
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    )
]


def _write(folder: str, tokenizer, config: dict, generation: dict, template: str) -> None:
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)


def _added_tokens(tokenizer) -> dict:
    return {
        str(i): {"content": t.content, "special": t.special}
        for i, t in sorted(tokenizer.get_added_tokens_decoder().items())
    }


def llama31_tokenizer(folder: str, template: str) -> int:
    """As meta-llama/Llama-3.1-8B-Instruct: <|begin_of_text|> first (the template writes it),
    <|eot_id|> ends a turn, and generation stops at <|end_of_text|>, <|eom_id|> or <|eot_id|>.
    Returns the vocabulary size."""
    import llama_models.llama3
    from llama_models.llama3.tokenizer import Tokenizer as Llama3
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta = Llama3.get_instance()
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    path = os.path.join(os.path.dirname(llama_models.llama3.__file__), "tokenizer.model")
    tokenizer = TikTokenConverter(
        path, pattern=meta.pat_str, extra_special_tokens=specials
    ).converted()
    bos = meta.special_tokens["<|begin_of_text|>"]
    tokenizer.post_processor = processors.Sequence(
        [  # as published: BOS added to encode(add_special_tokens)
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "added_tokens_decoder": _added_tokens(tokenizer),
        "model_max_length": 131072,
    }
    eos = [meta.special_tokens[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    _write(folder, tokenizer, config, {"bos_token_id": bos, "eos_token_id": eos}, template)
    return tokenizer.get_vocab_size()


def mistral_nemo_tokenizer(folder: str, template: str) -> int:
    """As mistralai/Mistral-Nemo-Instruct-2407: tekken's 1,000 special ids first ([INST],
    [TOOL_CALLS], ...), <s> written by the template, </s> ends a turn."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers.integrations.mistral.tokenizer import MistralConverter

    with open(
        os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240718.json")
    ) as f:
        tekken = json.load(f)
    # This early tekken file names no special tokens: they are mistral-common's own list.
    tekken["special_tokens"] = [
        {**t, "token_str": t["token_str"].value} for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS
    ]
    path = os.path.join(folder, "tekken-source.json")
    with open(path, "w") as f:
        json.dump(tekken, f)
    tokenizer = MistralConverter(path).converted()
    # the published folder's tokenizer.json alone (a tekken.json would pick transformers' mistral backend)
    os.remove(path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": _added_tokens(tokenizer),
        "model_max_length": 1024000,
    }
    _write(folder, tokenizer, config, {"bos_token_id": 1, "eos_token_id": 2}, template)
    return tokenizer.get_vocab_size()


def qwen3_tokenizer(folder: str, template: str) -> int:
    """As Qwen/Qwen3-8B: NFC, Qwen's split pattern, byte-level BPE; <|im_end|> ends a turn and
    generation also stops at <|endoftext|>; no BOS."""
    import dashscope
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = os.path.join(os.path.dirname(dashscope.__file__), "resources", "qwen.tiktoken")
    tokenizer = TikTokenConverter(path, pattern=QWEN_PATTERN).converted()
    tokenizer.normalizer = normalizers.NFC()
    for content, special in QWEN3_ADDED:  # ids from 151643 on, in order
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
    assert tokenizer.token_to_id("</think>") == 151668
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "errors": "replace",
        "added_tokens_decoder": _added_tokens(tokenizer),
        "model_max_length": 131072,
    }
    _write(
        folder,
        tokenizer,
        config,
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        template,
    )
    return tokenizer.get_vocab_size()
