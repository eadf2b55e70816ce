"""RWKV-7's time-mixing operator (the paper's fixed-state RNN baseline): naive / chunk / recurrent paths and
flash-linear-attention's kernels on CUDA, behind one entry point."""
from kvmeans.ops.rwkv7.op import BACKENDS, rwkv7_attention

__all__ = ["rwkv7_attention", "BACKENDS"]
