"""The authors' checkpoint format: config keys and defaults, tensor layout, a tiny synthetic checkpoint.

``REFERENCE_DEFAULTS`` transcribes the defaults of their flat config dataclass
(``MixerConfigDataclass`` in ``model/rwkv7_backbone.py`` at HEAD, docs/reference-conventions.md §1.1, §5.2);
their ``config.json`` always holds every one of these keys.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from kvmeans.models.config import KVMModelConfig

REFERENCE_MODEL_TYPE = "rwkv7backbone"
# their token_mixer names ("model.<name>_mixer.SequenceMixer") -> ours
MIXER_NAMES = {"kvm": "kvm", "gptalpha": "full", "swa": "swa", "gptalpha_bswa": "bswa", "ovq": "ovq"}
# class-path overrides that are the KVM mixer with the same parameters (Triton / fp32-routing variants)
KVM_CLASS_PATHS = ("model.kvm_mixer.SequenceMixer", "model.kvm_triton_mixer.SequenceMixer",
                   "model.kvm_fp32_routing_reference.SequenceMixer")
# which "<prefix>_token_shift_mode" / "<prefix>_value_residual_mode" keys a mixer reads
# (bswa: the GPTAlpha-derived mixer; [UNSURE] its module is not in the public snapshot we read)
MODE_PREFIX = {"kvm": "kvm", "full": "gptalpha", "bswa": "gptalpha", "swa": "swa", "ovq": "ovq"}

REFERENCE_DEFAULTS: Dict[str, Any] = {
    "model_class_path": "model.rwkv7_backbone.RWKV7BackboneForCausalLM",
    "vocab_size": 50304, "num_hidden_layers": 12, "num_attention_heads": 6, "num_key_value_heads": None,
    "d_qk_head": None, "d_v_head": None, "d_head": None, "hidden_size": 768, "mup_base_dim": 768,
    "rope_theta": 10000.0, "rope_partial_dim": 64, "alt_rope_theta": 10000.0, "alt_rope_partial_dim": 64,
    "alt_share_v0": 0, "ffn_expansion": 4.0, "token_mixer": "rwkv7", "token_mixer_class_path": None,
    "alt_token_mixer": "swa", "alt_token_mixer_class_path": None, "alt_layer_every": -1,
    "use_tokenshift_ffn": 0, "use_block_lambdas": 0, "use_skip_connections": 0, "use_l2wrap": 0,
    "logit_softcap": 0.0, "residual_scale": None,
    "use_value_residual": 1, "gptalpha_value_residual_mode": "rwkv", "gptalpha_token_shift_mode": "rwkv",
    "kvm_value_residual_mode": "rwkv", "kvm_token_shift_mode": "rwkv",
    "kvm_apply_merge_gate_to_initial_state": 0, "kvm_apply_merge_gate_to_appends": 0,
    "kvm_use_merge_gate_keys": 1, "kvm_use_merge_gate_values": 1, "kvm_use_head_temps": 1, "kvm_use_vlens": 1,
    "kvm_aotriton_forward_attention": 1, "kvm_aotriton_precompiled_forward": 0,
    "ovq_value_residual_mode": "rwkv", "ovq_token_shift_mode": "rwkv", "use_tokenshift_att": 0,
    "swa_value_residual_mode": "rwkv", "swa_token_shift_mode": "rwkv", "swa_window_size": -1,
    "ovq_window_size": 128, "ovq_chunk_size": 128, "ovq_max_centroids": 2048, "ovq_normalize_centroids": 0,
    "ovq_use_min_state_size": 0, "ovq_use_counts_for_lr_only": 0, "ovq_use_delta_rule": 0,
    "kda_expand_k": 1.0, "kda_expand_v": 1.0, "kda_conv_size": 4, "kda_conv_bias": 0, "kda_allow_neg_eigval": 0,
    "kda_token_shift_mode": "none", "kda_value_residual_mode": "none",
    "gated_deltanet_expand_k": 0.75, "gated_deltanet_expand_v": 1.5, "gated_deltanet_num_kv_heads": None,
    "gated_deltanet_conv_size": 4, "gated_deltanet_conv_bias": 0, "gated_deltanet_use_mamba_gate": 1,
    "gated_deltanet_token_shift_mode": "none", "gated_deltanet_value_residual_mode": "none",
    "sink_len": 1, "chunk_len": 256, "n_max_d_chunks": 1, "n_bswa_chunks": 2, "state_budget_mode": "fixed",
    "state_growth_factor": 1.0, "state_growth_exponent": 0.5, "state_round_down": 1, "state_min_len": -1,
    "state_saturation_n": None, "use_overflow_v_key_weighting": 1, "use_state_deltarule": 0,
    "use_state_decay": 0,
    "lact_value_residual_mode": "rwkv", "lact_token_shift_mode": "rwkv", "lact_actual_rope_partial_dim": -1,
    "lact_lact_window_size": -1, "lact_chunk_size": -1, "lact_num_fw_heads": -1, "lact_inter_multi": 1.0,
    "lact_norm_eps": 1e-6, "lact_attn_qk_norm": 0, "lact_w0_w2_low_rank": 32, "lact_fw_init_gain": 0.5,
    "lact_ttt_lag": 0, "lact_factor": 1.0, "lact_use_muon": 0, "lact_learnable_muon_lr": 0,
    "lact_muon_lr_reduce_exp": 2, "lact_use_momentum": 1, "lact_ttt_prenorm": 0, "lact_ttt_nope": 0,
    "lact_no_v_silu": 0, "lact_use_bswa": 0, "param_dtype": "bfloat16",
}


def reference_parameter_shapes(config: KVMModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of the authors' checkpoint for ``config`` (reference 5.3), name -> shape.

    d = hidden, V = vocab, H/Hkv heads, D = head_dim, F = ffn_dim, r = value-residual LoRA width
    (``max(32, round(1.3*sqrt(d)/32)*32)``). Per layer: ``ln_attn``/``ln_mlp`` [d]; ``attn.c_q`` [H*D, d],
    ``c_k``/``c_v`` [Hkv*D, d], ``c_proj`` [d, H*D]; token shift: ``x_q`` [H*D], ``x_k``/``x_v`` [Hkv*D];
    value residual: ``v_gate0`` [1,1,Hkv*D], ``v_gate1`` [r, d], ``v_gate2`` [Hkv*D, r] (and an unused zero
    ``x_v`` [Hkv*D] when token shift is off); ``ln_q``/``ln_k`` [D] except OVQ; OVQ ``beta`` [H]; KVM
    ``ln_s_k`` [D], ``key_weighting`` [Hkv, d] (merge gate), ``front/state_head_temp`` [H] (head temps);
    ``mlp.c_fc`` [F, d], ``mlp.c_proj`` [d, F], ``mlp.x_k`` [1,1,d] (MLP token shift).
    """
    c = config
    d, V, H, Hkv, D, F = c.hidden_size, c.vocab_size, c.num_heads, c.kv_heads, c.qk_head_dim, c.ffn_dim
    r = max(32, int(round(1.3 * d ** 0.5 / 32)) * 32)
    shapes: Dict[str, Tuple[int, ...]] = {"transformer.wte.weight": (V, d), "lm_head.weight": (V, d)}

    def ln(name, n):
        shapes[name + ".weight"] = shapes[name + ".bias"] = (n,)

    ln("transformer.ln_emb", d)
    ln("transformer.ln_head", d)
    for i, mixer in enumerate(c.mixer_per_layer()):
        p, a = f"transformer.h.{i}.", f"transformer.h.{i}.attn."
        ln(p + "ln_attn", d)
        ln(p + "ln_mlp", d)
        if c.token_shift:
            shapes.update({a + "x_q": (H * D,), a + "x_k": (Hkv * D,), a + "x_v": (Hkv * D,)})
        if c.value_residual:
            shapes.update({a + "x_v": (Hkv * D,), a + "v_gate0": (1, 1, Hkv * D), a + "v_gate1.weight": (r, d),
                           a + "v_gate2.weight": (Hkv * D, r)})
        shapes.update({a + "c_q.weight": (H * D, d), a + "c_k.weight": (Hkv * D, d),
                       a + "c_v.weight": (Hkv * D, d), a + "c_proj.weight": (d, H * D)})
        if mixer == "ovq":
            shapes[a + "beta"] = (H,)
        elif c.qk_norm:
            ln(a + "ln_q", D)
            ln(a + "ln_k", D)
        if mixer == "kvm":
            ln(a + "ln_s_k", D)
            if c.merge_gate:
                shapes[a + "key_weighting.weight"] = (Hkv, d)
            if c.head_temps:
                shapes[a + "front_head_temp"] = shapes[a + "state_head_temp"] = (H,)
        shapes.update({p + "mlp.c_fc.weight": (F, d), p + "mlp.c_proj.weight": (d, F)})
        if c.mlp_token_shift:
            shapes[p + "mlp.x_k"] = (1, 1, d)
    return shapes


def dropped_names(config: KVMModelConfig) -> List[str]:
    """Reference tensors kvmeans does not have: the zero ``x_v`` the reference creates for value
    residual without token shift (read only by its unused ``rwkv_post_tokenshift`` mode)."""
    if config.value_residual and not config.token_shift:
        return [f"transformer.h.{i}.attn.x_v" for i in range(config.num_layers)]
    return []
