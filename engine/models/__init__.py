"""Model classes by architecture: the Llama-family decoder (llama.py) and the families built on
it with other MLPs (qwen3_moe.py, mixtral.py), and DeepSeek-V3 / Kimi-K2 (deepseek_v3.py:
latent attention, grouped routing), and Gemma 3 (gemma3.py: the Llama layer with Gemma's
norms, GELU and sliding-window layers), gpt-oss (gpt_oss.py: attention sinks, MXFP4 experts with
biases and a clamped SwiGLU), and Llama 4 (llama4.py: NoPE and chunked layers, experts
scaling their inputs, FBGEMM FP8). The architectures served are listed once, in
engine.config.SUPPORTED_ARCHITECTURES (with their model_type)."""

from engine.config import SUPPORTED_ARCHITECTURES
from engine.models.deepseek_v3 import DeepseekV3Model
from engine.models.gemma3 import Gemma3Model
from engine.models.gpt_oss import GptOssModel
from engine.models.llama import LlamaModel
from engine.models.llama4 import Llama4Model
from engine.models.mixtral import MixtralModel
from engine.models.qwen3_moe import Qwen3MoeModel

# The model types whose decoder is not the Llama one (Mistral, Qwen2 and Qwen3 are).
_OWN_CLASSES = {
    "qwen3_moe": Qwen3MoeModel,
    "mixtral": MixtralModel,
    "deepseek_v3": DeepseekV3Model,
    "gemma3": Gemma3Model,
    "gpt_oss": GptOssModel,
    "llama4": Llama4Model,
}


def model_class(architecture: str) -> type[LlamaModel]:
    return _OWN_CLASSES.get(SUPPORTED_ARCHITECTURES[architecture], LlamaModel)


__all__ = ["LlamaModel", "model_class"]
