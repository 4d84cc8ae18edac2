"""Greedy parity of the built-in architectures under random config variants, through the path a user runs.

For every causal-LM architecture of the built-in registry whose transformers config class builds a tiny model,
draw random variants of the fields that config class takes (its __init__ signature) and its modeling code reads
(``config.<field>`` in its source, ``self.<field>`` in the config class's), build each tiny random checkpoint
(testing.save_tiny_checkpoint; for half the variants its config.json rewritten in transformers 4's form, as most
Hub checkpoints are), and compare greedy tokens of ``core.pipeline(path, dtype="float32")`` (engine, scheduler,
paged cache, native decode stack where it runs) with transformers' ``generate``: a batch of prompts of different
lengths, the longest again (a prefix-cache hit), and the batch once more with chunked prefill forced small. A
variant transformers itself cannot build or run is ``invalid``; one our loader refuses by name is ``refused``;
otherwise ``pass``, ``diverge`` (with the first differing step and transformers' top-1 minus top-2 logit there:
near 0 is a tie) or ``error`` (with the file and line in core where it rose).

    python benchmarks/parity_sweep.py --variants 4 --seed 0             # every architecture
    python benchmarks/parity_sweep.py --arch qwen3_moe --variants 20 -v  # one, with tracebacks
    python benchmarks/parity_sweep.py --arch llama --only 3 --seed 0     # rerun variant 3 of that draw
    python benchmarks/parity_sweep.py --arch olmo --eager                # the modules without the native stack
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from core_pytorch_backend.testing import (
    hf_greedy,
    random_prompts,
    reinit_,
    reinit_with_layer_norms_,
    save_tiny_checkpoint,
)

NEW_TOKENS = 12
LENGTHS = (5, 21, 38)  # one batch; the 38 again afterwards hits the prefix cache (blocks of 16)
SMALL_CHUNK = 7  # max_num_batched_tokens of the chunked run

# Tiny sizes, set where the config class takes the field (its own names for them included).
TINY = dict(
    vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=257, eos_token_id=258, pad_token_id=259,
    n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256, ffn_dim=128, word_embed_proj_dim=64,
    d_model=64, n_layers=2, n_heads=4, max_seq_len=256, num_layers=2, num_heads=4, ffn_hidden_size=128,
    head_dim=16, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_num_experts=4, moe_k=2, moe_topk=2, shared_expert_intermediate_size=48,
    shared_intermediate_size=48, intermediate_size_mlp=128, rms_norm_eps=1e-6,
)
# Per-architecture sizes the generic ones do not make consistent (from the family's own test files).
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=48)
# test_deepseek's: MLA over 4 heads (as many k/v heads: transformers' MLA takes no fewer), 16 experts of 32
DEEPSEEK = dict(MLA, head_dim=8, num_key_value_heads=4, intermediate_size=96, n_routed_experts=16,
                n_shared_experts=1, first_k_dense_replace=1)
BASE = {
    "gpt_neox": dict(num_key_value_heads=None),
    "deepseek_v2": dict(DEEPSEEK, n_group=4, topk_group=2, topk_method="group_limited_greedy"),
    "deepseek_v3": dict(DEEPSEEK, n_group=4, topk_group=2),
    "glm4_moe_lite": dict(DEEPSEEK, n_group=1, topk_group=1),
    "youtu": dict(DEEPSEEK),
    "minicpm3": dict(MLA, num_key_value_heads=4),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "zamba2": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=8,
                   mamba_d_state=16, mamba_ngroups=2, chunk_size=8, adapter_rank=8, num_key_value_heads=4),
    "glm4_moe": dict(n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, head_dim=16),
    "dots1": dict(n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, sliding_window=None),
    "llama4_text": dict(intermediate_size=32, num_hidden_layers=4, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                        attention_chunk_size=8, floor_scale=4, attn_scale=0.5),
    "ernie4_5_moe": dict(num_hidden_layers=3, moe_layer_start_index=1, moe_num_shared_experts=1),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=8),
    "bamba": dict(num_hidden_layers=3, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
                  attn_layer_indices=[1]),
    "granitemoehybrid": dict(num_hidden_layers=3, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                             mamba_chunk_size=8, layer_types=["mamba", "attention", "mamba"], intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=5, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                       chunk_size=8, moe_shared_expert_intermediate_size=48, hybrid_override_pattern="M*-EM"),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, mamba_d_ssm=128),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=0),
    "mamba": dict(state_size=16), "falcon_mamba": dict(state_size=16),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                 block_multiple_of=32),
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                     num_dense_layers=1),
    "minimax": dict(num_hidden_layers=4, intermediate_size=32, block_size=5,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    "kimi_linear": dict(MLA, num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=None, intermediate_size=96,
                        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4,
                        linear_head_dim=16, linear_conv_kernel_dim=4, n_shared_experts=1, n_group=1, topk_group=1),
    "qwen3_next": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, head_dim=32),
    "qwen3_5_text": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, head_dim=32),
    "qwen3_5_moe_text": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, head_dim=32),
    "olmo_hybrid": dict(num_hidden_layers=4),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    "bloom": dict(hidden_size=96, n_head=6),
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    "xglm": dict(pad_token_id=1),  # its learned positions start after the padding token's
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=6),
}
# Fields no checkpoint varies for serving (training switches, outputs) or whose values the table draws itself.
NOT_DRAWN = ("use_cache", "return_dict", "output_hidden_states", "output_router_logits", "is_encoder_decoder",
             "add_cross_attention", "is_decoder", "use_mambapy", "use_mamba_kernels", "use_associative_scan",
             "tie_encoder_decoder", "rescale_prenorm_residual", "residual_in_fp32", "pretraining_tp",
             "use_bidirectional_attention")
MODEL_TYPE = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2", "Llama4ForCausalLM": "llama4_text",
              "DeepseekV3ForCausalLM": "deepseek_v3", "Glm4MoeForCausalLM": "glm4_moe",
              "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
SKIP = ("ForConditionalGeneration", "Model", "ForSequenceClassification", "ForMaskedLM")


def _rope(rng: random.Random) -> dict:
    kind = rng.choice(["default", "default", "linear", "dynamic", "yarn", "llama3"])
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": rng.choice([10000.0, 500.0, 1e6])}
    if kind in ("linear", "dynamic"):
        rope["factor"] = rng.choice([2.0, 4.0])
    if kind == "yarn":
        rope.update(factor=4.0, original_max_position_embeddings=rng.choice([16, 64]))
    if kind == "llama3":
        rope.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    if rng.random() < 0.4:
        rope["partial_rotary_factor"] = rng.choice([0.25, 0.5, 0.75, 1.0])
    return rope


def _layer_types(rng: random.Random, layers: int) -> list[str]:
    return [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]


# field -> draw(rng, layers): the values real checkpoints carry, drawn where the config class takes the field.
DRAWS: dict[str, Any] = {
    "tie_word_embeddings": lambda r, n: r.choice([True, False]),
    "attention_bias": lambda r, n: r.choice([True, False]),
    "mlp_bias": lambda r, n: r.choice([True, False]),
    "use_bias": lambda r, n: r.choice([True, False]),
    "bias": lambda r, n: r.choice([True, False]),
    "qkv_bias": lambda r, n: r.choice([True, False]),
    "attention_out_bias": lambda r, n: r.choice([True, False]),
    "lm_head_bias": lambda r, n: r.choice([True, False]),
    "head_dim": lambda r, n: r.choice([8, 16, 32]),
    "num_key_value_heads": lambda r, n: r.choice([1, 2, 4]),
    "hidden_act": lambda r, n: r.choice(["silu", "gelu", "gelu_pytorch_tanh", "relu", "gelu_new"]),
    "hidden_activation": lambda r, n: r.choice(["gelu_pytorch_tanh", "gelu", "silu"]),
    "rms_norm_eps": lambda r, n: r.choice([1e-6, 1e-5, 0.1]),
    "layer_norm_eps": lambda r, n: r.choice([1e-5, 0.1]),
    "layer_norm_epsilon": lambda r, n: r.choice([1e-5, 0.1]),
    "norm_eps": lambda r, n: r.choice([1e-5, 0.1]),
    "sliding_window": lambda r, n: r.choice([None, 4, 7, 4096]),
    "use_sliding_window": lambda r, n: r.choice([True, False]),
    "max_window_layers": lambda r, n: r.choice([0, 1, n]),
    "layer_types": lambda r, n: _layer_types(r, n),
    "rope_parameters": lambda r, n: None,  # drawn by _ropes (per layer type where the config keys it so)
    "partial_rotary_factor": lambda r, n: r.choice([0.25, 0.5, 1.0]),
    "rotary_pct": lambda r, n: r.choice([0.25, 0.5, 1.0]),
    "qk_layernorm": lambda r, n: r.choice([True, False]),
    "use_qk_norm": lambda r, n: r.choice([True, False]),
    "qk_norm": lambda r, n: r.choice([True, False]),
    "norm_topk_prob": lambda r, n: r.choice([True, False]),
    "num_experts_per_tok": lambda r, n: r.choice([1, 2, 3]),
    "decoder_sparse_step": lambda r, n: r.choice([1, 2]),
    "mlp_only_layers": lambda r, n: r.choice([[], [0], [n - 1]]),
    "first_k_dense_replace": lambda r, n: r.choice([0, 1]),
    "shared_expert_intermediate_size": lambda r, n: r.choice([0, 48]),
    "n_shared_experts": lambda r, n: r.choice([0, 1, 2]),
    "routed_scaling_factor": lambda r, n: r.choice([1.0, 2.5]),
    "attn_logit_softcapping": lambda r, n: r.choice([None, 5.0]),
    "final_logit_softcapping": lambda r, n: r.choice([None, 3.0]),
    "logit_scale": lambda r, n: r.choice([0.25, 1.0]),
    "residual_multiplier": lambda r, n: r.choice([1.0, 0.22]),
    "embedding_multiplier": lambda r, n: r.choice([1.0, 4.0]),
    "attention_multiplier": lambda r, n: r.choice([0.0625, 0.25]),
    "logits_scaling": lambda r, n: r.choice([1.0, 8.0]),
    "clip_qkv": lambda r, n: r.choice([None, 0.5]),
    "query_pre_attn_scalar": lambda r, n: r.choice([16, 24]),
    "use_parallel_residual": lambda r, n: r.choice([True, False]),
    "parallel_attn": lambda r, n: r.choice([True, False]),
    "multi_query": lambda r, n: r.choice([True, False]),
    "scale_attn_weights": lambda r, n: r.choice([True, False]),
    "scale_attn_by_inverse_layer_idx": lambda r, n: r.choice([True, False]),
    "reorder_and_upcast_attn": lambda r, n: r.choice([True, False]),
    "activation_function": lambda r, n: r.choice(["gelu_new", "gelu", "relu", "gelu_pytorch_tanh"]),
    "no_rope_layers": lambda r, n: [r.choice([0, 1]) for _ in range(n)],
    "eos_token_id": lambda r, n: r.choice([258, [258, 256]]),
}


def _ropes(rng: random.Random, default: Any) -> dict:
    """A drawn rope_parameters, one per layer type where the config keys its default so (Gemma 3, OLMo 3)."""
    if isinstance(default, dict) and default and all(isinstance(v, dict) for v in default.values()):
        return {layer_type: _rope(rng) for layer_type in default}
    return _rope(rng)


def causal_archs() -> dict[str, type]:
    """Built-in architecture -> the transformers config class of its model type (where transformers has one)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    from core_pytorch_backend.models import BUILTIN_ARCHITECTURES

    types: dict[str, str] = {}
    for model_type, arch in CAUSAL.items():
        types.setdefault(arch, model_type)
    types.update(MODEL_TYPE)
    return {arch: CONFIG_MAPPING[types[arch]] for arch in BUILTIN_ARCHITECTURES
            if arch in types and not arch.endswith(SKIP)}


def config_fields(config_cls: type) -> dict[str, str]:
    """The keyword fields of ``config_cls``'s __init__, with their annotations."""
    params = inspect.signature(config_cls.__init__).parameters.values()
    return {p.name: str(p.annotation) for p in params if p.kind == p.KEYWORD_ONLY}


def modeling_reads(config_cls: type) -> set[str]:
    """Fields transformers reads: in the model's source (``config.x``, ``getattr(config, "x"``) or in the config
    class's own (``self.x``: Qwen2's use_sliding_window and max_window_layers make its layer_types)."""
    modeling = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        source = inspect.getsource(importlib.import_module(modeling))
    except (ImportError, OSError):
        source = ""
    reads = set(re.findall(r"config\.(\w+)", source))
    reads |= set(re.findall(r"getattr\(\w*config, \"(\w+)\"", source))
    return reads | set(re.findall(r"self\.(\w+)", inspect.getsource(config_cls)))


def default_rope(config_cls: type, base: dict) -> Any:
    """The rope_parameters ``config_cls`` makes of ``base`` (None where it cannot: its variants are invalid)."""
    try:
        return getattr(config_cls(**base), "rope_parameters", None)
    except Exception:  # noqa: BLE001 - transformers' validators raise several kinds
        return None


def draw_variant(config_cls: type, rng: random.Random) -> tuple[dict, dict]:
    """(tiny base fields, drawn variant fields) of ``config_cls``: each field that applies drawn with chance 1/2."""
    fields = config_fields(config_cls)
    base = {k: v for k, v in TINY.items() if k in fields}
    base.update(BASE.get(config_cls.model_type, {}))
    layers = base.get("num_hidden_layers") or base.get("n_layer") or base.get("num_layers") or 2
    reads = modeling_reads(config_cls) | {"tie_word_embeddings", "rope_parameters", "eos_token_id"}
    drawn = {name for name in fields if name in reads and name not in NOT_DRAWN
             and name not in BASE.get(config_cls.model_type, {})  # sizes the family's others must match
             and (name in DRAWS or fields[name].startswith("bool"))}
    if "layer_types" in base or "sliding_window" not in fields:  # hybrids' layer kinds; no windows to lay out
        drawn.discard("layer_types")
    variant: dict[str, Any] = {}
    for name in sorted(drawn):
        if rng.random() < 0.5:
            if name == "rope_parameters":
                variant[name] = _ropes(rng, default_rope(config_cls, base))
            else:
                variant[name] = DRAWS[name](rng, layers) if name in DRAWS else rng.choice([True, False])
    if "sliding_attention" in variant.get("layer_types", ()) and "use_sliding_window" in fields:
        variant["use_sliding_window"] = True  # else Qwen2's and Qwen3's configs drop the window they lay out
    return base, variant


def reinit_any(model: torch.nn.Module, seed: int = 0) -> None:
    """``reinit_with_layer_norms_`` where the model has LayerNorms with biases (``reinit_`` sets those near 1 and
    the model repeats one token: a weak check), ``reinit_`` elsewhere."""
    biased = any(isinstance(m, torch.nn.LayerNorm) and m.bias is not None for m in model.modules())
    (reinit_with_layer_norms_ if biased else reinit_)(model, seed=seed)


def legacy_config(folder: Path) -> None:
    """Rewrite the folder's config.json as transformers 4 wrote it (most checkpoints on the Hub): ``rope_theta``,
    ``partial_rotary_factor`` and ``rope_scaling`` apart, where transformers 5 keeps one ``rope_parameters``."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:  # none, or one per layer type (no such old form)
        return
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2))


def theirs(folder: Path, prompts: list[list[int]]) -> tuple[Any, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def ours(folder: Path, batches: list[list[list[int]]], **engine: Any) -> list[list[list[int]]]:
    """Greedy tokens of each batch, run one after another on one pipeline."""
    import core

    with core.pipeline(str(folder), dtype="float32", **engine) as pipe:
        return [[list(r.token_ids) for r in pipe.infer(batch, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                        ignore_eos=True, use_tqdm=False)] for batch in batches]


def margin(hf: Any, prompt: list[int], expected: list[int], step: int) -> float:
    """transformers' top-1 minus top-2 logit where the outputs part."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + expected[:step]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(hf: Any, prompts, expected, got, path: str) -> str | None:
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        if want != have:
            step = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
            gap = margin(hf, prompt, want, step)
            return f"{path}: prompt of {len(prompt)} tokens at step {step} (margin {gap:.2g})"
    return None


def where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback in core's code (the triage's first clue)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/core" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} " if frames else ""


def run_variant(config_cls: type, base: dict, variant: dict, seed: int, legacy: bool, verbose: bool,
                engine: dict) -> tuple[str, str]:
    """(status, detail) of one variant (``legacy``: its config.json in transformers 4's form; ``engine``: more
    of core.pipeline's options)."""
    from core.errors import UnsupportedError

    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = save_tiny_checkpoint(config_cls(**{**base, **variant}), Path(tmp), seed, reinit_any)
            if legacy:
                legacy_config(folder)
            prompts = random_prompts(LENGTHS, seed=seed)
            hf, expected = theirs(folder, prompts)
        except Exception as exc:  # transformers cannot build or run it: not ours to serve
            return "invalid", f"{type(exc).__name__}: {str(exc)[:150]}"
        try:
            batch, again = ours(folder, [prompts, prompts[-1:]], **engine)
            (chunked,) = ours(folder, [prompts], max_num_batched_tokens=SMALL_CHUNK, **engine)
        except (NotImplementedError, UnsupportedError, ValueError) as exc:  # refused by name (read the detail)
            return "refused", f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            return "error", f"{where(exc)}{type(exc).__name__}: {str(exc)[:200]}"
        for path, got, want_prompts, want in (("batch", batch, prompts, expected),
                                               ("prefix-hit", again, prompts[-1:], expected[-1:]),
                                               ("chunked", chunked, prompts, expected)):
            problem = compare(hf, want_prompts, want, got, path)
            if problem:
                return "diverge", problem
    flat = all(len(set(tokens)) == 1 for tokens in expected)  # a weak check: reinit_'s weights repeat one token
    return "pass", "(each continuation one token repeated)" if flat else ""


STATUSES = ("pass", "diverge", "error", "refused", "invalid")


def sweep_arch(arch: str, config_cls: type, args: argparse.Namespace, engine: dict) -> list[dict]:
    """The rows of ``args.variants`` variants of the architecture ``arch`` (printed as they come)."""
    rng = random.Random(f"{args.seed}-{arch}")
    rows = []
    for index in range(args.variants):
        base, variant = draw_variant(config_cls, rng)
        if args.only is not None and index != args.only:
            continue
        legacy = random.Random(json.dumps(variant, sort_keys=True)).random() < 0.5  # the draws' stream as it is
        status, detail = run_variant(config_cls, base, variant, args.seed + index, legacy, args.verbose, engine)
        rows.append(dict(arch=config_cls.model_type, index=index, status=status, variant=variant,
                         legacy=legacy, detail=detail))
        form = "v4" if legacy else "v5"
        print(f"{config_cls.model_type:18} {index:3} {form} {status:8} {json.dumps(variant)} {detail}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="model_type or architecture (repeatable); default all")
    parser.add_argument("--variants", type=int, default=3, help="variants drawn per architecture")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, help="run only this variant index of each architecture's draw")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    parser.add_argument("--block-size", type=int, help="the KV cache's block size (default: the engine's, 16)")
    parser.add_argument("--eager", action="store_true",
                        help="without the native decode stack (backend option enforce_eager)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine: dict[str, Any] = {"backend_options": {"enforce_eager": True}} if args.eager else {}
    if args.block_size:
        engine["block_size"] = args.block_size
    rows = [row for arch, config_cls in causal_archs().items()
            if not args.arch or arch in args.arch or config_cls.model_type in args.arch
            for row in sweep_arch(arch, config_cls, args, engine)]
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    print(" ".join(f"{k} {v}" for k, v in counts.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if counts["diverge"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
