"""The prose NIAH samples of `kvmeans bench pretrained` (its samples.jsonl) answered by a vLLM engine serving a
plain folder converted on the fly: python serve_niah.py MODEL SAMPLES.jsonl SPEC OUT.json [LLM_KWARGS_JSON] (greedy,
24 tokens; a sample counts when its answer is in the generated text, as the bench counts)."""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvmeans.serve.vllm_plugin import kvm_hf_overrides  # noqa: E402

model, samples, spec, out = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
rows = [json.loads(line) for line in open(samples)]
llm = vllm.LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
               hf_overrides=kvm_hf_overrides(model, spec), **extra)
gens = llm.generate([TokensPrompt(prompt_token_ids=r["context_ids"] + r["question_ids"]) for r in rows],
                    vllm.SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
answers = [{"id": r["id"], "pred": g.outputs[0].text, "correct": all(a in g.outputs[0].text for a in r["answers"])}
           for r, g in zip(rows, gens)]
score = sum(a["correct"] for a in answers)
with open(out, "w") as f:
    json.dump({"model": model, "spec": spec, "llm_kwargs": extra, "vllm": vllm.__version__, "score": score,
               "samples": len(rows), "answers": answers}, f, indent=1)
print(f"{spec}: {score}/{len(rows)}")
