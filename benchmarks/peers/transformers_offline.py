"""transformers' batched `generate` on the same prompts, offline (the fallback when its server cannot run).

    python transformers_offline.py MODEL_DIR SPEC.json RESULT.json [--threads 2]

SPEC: {"output_len": N, "levels": [{"concurrency": C, "prompts": [...]}, ...]}. Each level runs its
prompts in left-padded batches of C, greedy, exactly N new tokens (min_new_tokens = max_new_tokens), and
records output tokens/s. The C = 1 level also records TTFT (a generate of one token) and decode tokens/s
((N - 1) / (time for N tokens - TTFT)).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate(model, tokenizer, prompts: list[str], new_tokens: int) -> tuple[int, float, int]:
    """(output tokens, seconds, prompt tokens) of one padded batch."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts), seconds, int(batch["attention_mask"].sum())


def run_level(model, tokenizer, prompts: list[str], concurrency: int, new_tokens: int) -> dict:
    tokens = seconds = prompt_tokens = 0
    for i in range(0, len(prompts), concurrency):
        t, s, p = generate(model, tokenizer, prompts[i:i + concurrency], new_tokens)
        tokens, seconds, prompt_tokens = tokens + t, seconds + s, prompt_tokens + p
    result = {"concurrency": concurrency, "completed": len(prompts), "output_tokens": tokens,
              "duration_s": seconds, "output_throughput": tokens / seconds,
              "mean_prompt_tokens": prompt_tokens / len(prompts)}
    if concurrency == 1:
        ttfts = [generate(model, tokenizer, [p], 1)[1] for p in prompts]
        ttft = sum(ttfts) / len(ttfts)
        per_request = seconds / len(prompts)
        result.update(ttft_ms=ttft * 1000, decode_tok_s=(new_tokens - 1) / max(per_request - ttft, 1e-9))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("spec")
    parser.add_argument("result")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = json.load(open(args.spec))
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    generate(model, tokenizer, spec["levels"][0]["prompts"][:1], 4)  # warm-up
    levels = [run_level(model, tokenizer, level["prompts"], level["concurrency"], spec["output_len"])
              for level in spec["levels"]]
    with open(args.result, "w") as f:
        json.dump({"levels": levels}, f)


if __name__ == "__main__":
    main()
