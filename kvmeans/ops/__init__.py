"""The KVM operator: budgets, carried state, and the three agreeing paths (naive, chunked, recurrent)."""
from kvmeans.ops.budget import StateBudget
from kvmeans.ops.kvm import kvm_attention
from kvmeans.ops.state import KVMState

__all__ = ["kvm_attention", "StateBudget", "KVMState"]
