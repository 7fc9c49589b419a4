"""The draft service's configuration (flags generated from the fields: services/settings.py)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional

from services import settings


@dataclass(frozen=True)
class DraftConfig:
    model: str = field(metadata={"help": "the target model's folder (its vocabulary and context)"})
    draft_model: str = field(metadata={"help": "a draft model's folder (the target's tokenizer) or an "
                                           "EAGLE-3 head's (demo/train_eagle3.py)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on", "env": "TANDEM_DRAFT_HOST"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0: any free port (printed at start)"})
    kv_cache_bytes: int = field(default=64 << 20, metadata={"help": "the drafter's KV pool, in bytes"})
    dtype: str = field(default="auto", metadata={"help": "auto: the draft checkpoint's, or the target's for an "
                                                 "EAGLE-3 head (fp32 on CPU for fp16)",
                                                 "choices": ("auto", "float32", "bfloat16", "float16")})

    def __post_init__(self):
        for name in ("model", "draft_model"):
            if not os.path.isdir(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a directory")

    @staticmethod
    def from_args(argv: Optional[list[str]] = None) -> "DraftConfig":
        parser = argparse.ArgumentParser(prog="python -m services.draft", description="tandem draft service")
        settings.add_flags(parser, DraftConfig)
        return DraftConfig(**settings.values(parser.parse_args(argv), DraftConfig))
