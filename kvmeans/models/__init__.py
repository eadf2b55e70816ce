"""Language models on the GPTAlpha-2 backbone with KVM and baseline sequence mixers."""
from kvmeans.models.cache import ModelCache
from kvmeans.models.config import PRESETS, KVMModelConfig, preset
from kvmeans.models.mlp import MLP
from kvmeans.models.transformer import KVMLanguageModel, KVMModel

__all__ = ["KVMLanguageModel", "KVMModel", "KVMModelConfig", "ModelCache", "MLP", "PRESETS", "preset"]
