"""Model classes by architecture: the Llama-family decoder (llama.py) and the families built on
it with other MLPs (qwen3_moe.py, mixtral.py), and DeepSeek-V3 / Kimi-K2 (deepseek_v3.py:
latent attention, grouped routing)."""

from engine.models.deepseek_v3 import DeepseekV3Model
from engine.models.llama import LlamaModel
from engine.models.mixtral import MixtralModel
from engine.models.qwen3_moe import Qwen3MoeModel

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "MixtralForCausalLM": MixtralModel,
    "DeepseekV3ForCausalLM": DeepseekV3Model,
}

__all__ = ["MODEL_CLASSES", "LlamaModel"]
