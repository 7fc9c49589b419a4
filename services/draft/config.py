"""The draft service's configuration (flags generated from the fields: services/settings.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.gguf.folder import resolve_fields
from services import settings


@dataclass(frozen=True)
class DraftConfig(settings.ServiceConfig):
    SERVICE = "draft"
    DESCRIPTION = "tandem draft service"
    model: str = field(metadata={"help": "the target model's folder (its vocabulary and context)"})
    draft_model: str = field(
        metadata={
            "help": "a draft model's folder (the target's tokenizer) or an "
            "EAGLE-3 head's (demo/train_eagle3.py)"
        }
    )
    kv_cache_bytes: int = field(
        default=64 << 20, metadata={"help": "the drafter's KV pool, in bytes"}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto: the draft checkpoint's, or the target's for an "
            "EAGLE-3 head (fp32 on CPU for fp16)",
            "choices": ("auto", "float32", "bfloat16", "float16"),
        },
    )

    def __post_init__(self):
        super().__post_init__()
        resolve_fields(self, "model", "draft_model")
        for name in ("model", "draft_model"):
            if not os.path.isdir(getattr(self, name)):
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a directory"
                )
