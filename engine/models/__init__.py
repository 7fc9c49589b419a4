"""Model classes by architecture: the Llama-family decoder (llama.py) and the families built on
it with other MLPs (qwen3_moe.py, mixtral.py)."""

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
}

__all__ = ["MODEL_CLASSES", "LlamaModel"]
