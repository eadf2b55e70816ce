"""kvmeans: Key-Value Means attention for PyTorch."""
from kvmeans.ops import KVMState, StateBudget, kvm_attention

__version__ = "0.1.0"
__all__ = ["kvm_attention", "StateBudget", "KVMState", "KVMAttention", "KVMAttentionConfig", "KVMForCausalLM",
           "KVMConfig", "convert_hf", "load_converted", "parse_kvm_spec", "__version__"]

_LAZY = {"KVMAttention": "kvmeans.layers", "KVMAttentionConfig": "kvmeans.layers",
         "KVMForCausalLM": "kvmeans.models.hf", "KVMConfig": "kvmeans.models.hf",
         "convert_hf": "kvmeans.pretrained.convert", "load_converted": "kvmeans.pretrained.convert",
         "parse_kvm_spec": "kvmeans.pretrained.convert"}


def __getattr__(name):
    # the Hugging Face classes need `transformers` (extra "hf"); import them only when asked for
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvmeans' has no attribute {name!r}")
