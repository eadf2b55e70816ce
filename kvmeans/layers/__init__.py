"""nn.Module layers built on ``kvmeans.ops``: KVM attention and the baseline mixers."""
from .attention import AttentionConfig, GPTAlphaAttention, KVMAttention, KVMAttentionConfig
from .baselines import BlockSlidingWindowAttention, BSWAConfig, FullAttention, SlidingWindowAttention, SWAConfig
from .ovq import OVQAttention, OVQConfig, OVQState
from .rope import RotaryEmbedding
from .rwkv7 import RWKV7Config, RWKV7State, RWKV7TimeMix
from .states import KVCacheState
from .token_shift import TokenShift, token_shift

__all__ = ["AttentionConfig", "GPTAlphaAttention", "KVMAttention", "KVMAttentionConfig", "FullAttention",
           "SlidingWindowAttention", "BlockSlidingWindowAttention", "SWAConfig", "BSWAConfig", "OVQAttention",
           "OVQConfig", "OVQState", "RWKV7Config", "RWKV7TimeMix", "RWKV7State", "KVCacheState", "RotaryEmbedding",
           "TokenShift", "token_shift"]
