"""KVM for pretrained transformers models (the families of ``convert.FAMILIES``: Llama, Qwen, Mistral, Gemma, Phi,
OLMo, Granite, StableLM, StarCoder2, SmolLM3, GPT-NeoX, GPT-2 and their MoE kin).

``convert.py`` converts a loaded model in place (``convert_hf``) and reloads a saved one
(``load_converted``); ``attention.py`` is the converted layer's attention function; ``op.py`` the
training-free KVM op over the model's own q/k/v, with ``routing.py``, ``reserve.py`` and ``board.py``
deciding which tokens keep rows; ``batch.py`` runs padded batches and rollback; ``cache.py`` is the
cache layer ``generate`` sees; ``distill.py`` trains the learned read-out; ``ppl.py`` and ``bench.py``
compare full attention, StreamingLLM, KVM and kvpress, with the arms, StreamingLLM's mask and the forward per
window of ``arms.py``; ``fetch.py`` brings real models from PyPI.
"""
