"""Serving KVM models with vLLM (docs/serving.md).

``kvmeans.serve.state_slots`` (plain torch, no vLLM) lays a converted layer's state
(:class:`kvmeans.pretrained.op.ConvertedKVMState`) out in fixed-shape per-request slots, loads and stores it, and
decodes a batch of requests straight from the slots; ``kvmeans.serve.native_slots`` (plain torch) packs a native
model's whole per-request cache (:class:`kvmeans.models.cache.ModelCache`) into one byte slot and back. Only the
``kvmeans.serve.vllm*`` modules import vLLM: the plugin (``vllm_plugin.register``, the ``vllm.general_plugins``
entry point, with the start-up checks) and the model classes (``vllm_model`` for converted folders,
``vllm_native`` for native ones), and only when vLLM calls them. Nothing else in kvmeans imports them.
"""
