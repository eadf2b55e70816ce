"""The KVM operator: budgets, carried state, and the three agreeing paths (naive, chunked, recurrent)."""
from .budget import StateBudget
from .kvm import kvm_attention
from .state import KVMState

__all__ = ["kvm_attention", "StateBudget", "KVMState"]
