"""Serving KVM models with vLLM (docs/serving.md).

``kvmeans.serve.state_slots`` (plain torch, no vLLM) lays a converted layer's state
(:class:`kvmeans.pretrained.op.ConvertedKVMState`) out in fixed-shape per-request slots, loads and stores it, and
decodes a batch of requests straight from the slots. Only the ``kvmeans.serve.vllm*`` modules import vLLM: the
plugin (``vllm_plugin.register``, the ``vllm.general_plugins`` entry point, with the start-up checks) and the
model classes (``vllm_model``), and only when vLLM calls them. Nothing else in kvmeans imports them.
"""
