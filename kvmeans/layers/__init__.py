"""nn.Module layers built on ``kvmeans.ops``: KVM attention and the baseline mixers."""
from kvmeans.layers.attention import AttentionConfig, GPTAlphaAttention, KVMAttention, KVMAttentionConfig
from kvmeans.layers.baselines import (
           BlockSlidingWindowAttention,
           BSWAConfig,
           FullAttention,
           SlidingWindowAttention,
           SWAConfig,
)
from kvmeans.layers.ovq import OVQAttention, OVQConfig, OVQState
from kvmeans.layers.rope import RotaryEmbedding
from kvmeans.layers.rwkv7 import RWKV7Config, RWKV7State, RWKV7TimeMix
from kvmeans.layers.states import KVCacheState
from kvmeans.layers.token_shift import TokenShift, token_shift

__all__ = ["AttentionConfig", "GPTAlphaAttention", "KVMAttention", "KVMAttentionConfig", "FullAttention",
           "SlidingWindowAttention", "BlockSlidingWindowAttention", "SWAConfig", "BSWAConfig", "OVQAttention",
           "OVQConfig", "OVQState", "RWKV7Config", "RWKV7TimeMix", "RWKV7State", "KVCacheState", "RotaryEmbedding",
           "TokenShift", "token_shift"]
