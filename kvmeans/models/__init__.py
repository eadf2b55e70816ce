"""Language models on the GPTAlpha-2 backbone with KVM and baseline sequence mixers."""
from .cache import ModelCache
from .config import PRESETS, KVMModelConfig, preset
from .mlp import MLP
from .transformer import KVMLanguageModel, KVMModel

__all__ = ["KVMLanguageModel", "KVMModel", "KVMModelConfig", "ModelCache", "MLP", "PRESETS", "preset"]
