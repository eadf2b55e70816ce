"""nn.Module layers built on ``kvmeans.ops``."""
from .attention import KVMAttention, KVMAttentionConfig
from .rope import RotaryEmbedding
from .token_shift import TokenShift, token_shift

__all__ = ["KVMAttention", "KVMAttentionConfig", "RotaryEmbedding", "TokenShift", "token_shift"]
