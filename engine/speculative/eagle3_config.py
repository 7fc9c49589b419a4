"""An EAGLE-3 head's config (engine/speculative/eagle3.py runs the head): tandem's own heads'
config.json (demo/train_eagle3.py writes them), or a published head's read into the same
fields (eagle3_published.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.config import MlaConfig, RopeScaling
from engine.errors import CheckpointError

ARCHITECTURE = "Eagle3Head"
# fields only a published head's config sets: not in tandem's files
PUBLISHED_ONLY = ("rope_scaling", "mla")


@dataclass(frozen=True)
class HeadConfig:
    """The head's config.json; the attention fields mirror a Llama config so the KV cache and
    attention backend take it as they are."""

    hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_layers: int = 1
    sliding_window: int | None = None
    # a published head's (eagle3_published.py); tandem's train without
    rope_scaling: RopeScaling = RopeScaling()
    mla: MlaConfig | None = None  # a published DeepSeek-layout head's multi-head latent attention
    # Published heads' options (EAGLE-3.1): the residual is the normed feature; each aux state
    # normed before `fc`; the normed output fed back as the next position's feature.
    norm_before_residual: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def kv_layout(
        self,
    ) -> tuple[int, int, int]:  # as ModelConfig's: the head's K and V per KV head, or its latent
        return self.mla.kv_layout if self.mla else (2, self.num_kv_heads, self.head_dim)

    def attention_shape(self) -> dict:
        if self.mla:
            return self.mla.attention_shape(self.num_heads, self.rope_scaling.softmax_mscale)
        return dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sliding_window=None,
        )

    @staticmethod
    def from_folder(folder: str) -> HeadConfig:
        path = os.path.join(folder, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"{folder}: cannot read an EAGLE-3 head's config.json: {exc}"
            ) from None
        if raw.get("architectures") != [ARCHITECTURE]:
            raise CheckpointError(
                f"{folder}: not an EAGLE-3 head (architectures {raw.get('architectures')})"
            )
        fields = {
            k: raw[k]
            for k in HeadConfig.__dataclass_fields__
            if k in raw and k not in PUBLISHED_ONLY
        }
        fields["aux_layers"] = tuple(raw["aux_layers"])
        return HeadConfig(**fields)

    def to_dict(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            **{k: getattr(self, k) for k in self.__dataclass_fields__ if k not in PUBLISHED_ONLY},
            "aux_layers": list(self.aux_layers),
        }
