"""kvmeans: Key-Value Means attention for PyTorch."""
from .ops import KVMState, StateBudget, kvm_attention

__version__ = "0.1.0"
__all__ = ["kvm_attention", "StateBudget", "KVMState", "__version__"]
