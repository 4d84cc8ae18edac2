"""Built-in model architectures, by HF architecture name, as lazy "module:Class" strings."""

from __future__ import annotations

from core.registry import import_target

_VL = "core_pytorch_backend.models.vision_language"
BUILTIN_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "core_pytorch_backend.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "core_pytorch_backend.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "core_pytorch_backend.models.qwen3:Qwen3ForCausalLM",
    "MistralForCausalLM": "core_pytorch_backend.models.mistral:MistralForCausalLM",
    "Gemma3ForCausalLM": "core_pytorch_backend.models.gemma3:Gemma3ForCausalLM",
    "SmolLM3ForCausalLM": "core_pytorch_backend.models.smollm3:SmolLM3ForCausalLM",
    "GraniteForCausalLM": "core_pytorch_backend.models.granite:GraniteForCausalLM",
    "Phi3ForCausalLM": "core_pytorch_backend.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "core_pytorch_backend.models.olmo2:Olmo2ForCausalLM",
    "Qwen3MoeForCausalLM": "core_pytorch_backend.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "core_pytorch_backend.models.qwen2_moe:Qwen2MoeForCausalLM",
    "MixtralForCausalLM": "core_pytorch_backend.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "core_pytorch_backend.models.gemma2:Gemma2ForCausalLM",
    "GemmaForCausalLM": "core_pytorch_backend.models.gemma:GemmaForCausalLM",
    "StableLmForCausalLM": "core_pytorch_backend.models.stablelm:StableLmForCausalLM",
    "Starcoder2ForCausalLM": "core_pytorch_backend.models.starcoder2:Starcoder2ForCausalLM",
    "GPTNeoXForCausalLM": "core_pytorch_backend.models.gpt_neox:GPTNeoXForCausalLM",
    "OlmoForCausalLM": "core_pytorch_backend.models.olmo:OlmoForCausalLM",
    "PhiForCausalLM": "core_pytorch_backend.models.phi:PhiForCausalLM",
    "OPTForCausalLM": "core_pytorch_backend.models.opt:OPTForCausalLM",
    "GPT2LMHeadModel": "core_pytorch_backend.models.gpt2:GPT2LMHeadModel",
    "InternLM3ForCausalLM": "core_pytorch_backend.models.llama:LlamaForCausalLM",  # transformers runs it as Llama
    "MinistralForCausalLM": "core_pytorch_backend.models.ministral:MinistralForCausalLM",
    "SeedOssForCausalLM": "core_pytorch_backend.models.seed_oss:SeedOssForCausalLM",
    "HeliumForCausalLM": "core_pytorch_backend.models.helium:HeliumForCausalLM",
    "Ernie4_5ForCausalLM": "core_pytorch_backend.models.ernie4_5:Ernie4_5ForCausalLM",
    "ArceeForCausalLM": "core_pytorch_backend.models.arcee:ArceeForCausalLM",
    "HunYuanDenseV1ForCausalLM": "core_pytorch_backend.models.hunyuan_dense:HunYuanDenseV1ForCausalLM",
    "Olmo3ForCausalLM": "core_pytorch_backend.models.olmo3:Olmo3ForCausalLM",
    "Exaone4ForCausalLM": "core_pytorch_backend.models.exaone4:Exaone4ForCausalLM",
    "GlmForCausalLM": "core_pytorch_backend.models.glm:GlmForCausalLM",
    "Glm4ForCausalLM": "core_pytorch_backend.models.glm4:Glm4ForCausalLM",
    "CohereForCausalLM": "core_pytorch_backend.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "core_pytorch_backend.models.cohere2:Cohere2ForCausalLM",
    "NemotronForCausalLM": "core_pytorch_backend.models.nemotron:NemotronForCausalLM",
    "GPTJForCausalLM": "core_pytorch_backend.models.gptj:GPTJForCausalLM",
    "OlmoeForCausalLM": "core_pytorch_backend.models.olmoe:OlmoeForCausalLM",
    "GraniteMoeForCausalLM": "core_pytorch_backend.models.granitemoe:GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM": "core_pytorch_backend.models.granitemoe:GraniteMoeForCausalLM",
    "GPTBigCodeForCausalLM": "core_pytorch_backend.models.gpt_bigcode:GPTBigCodeForCausalLM",
    "FalconForCausalLM": "core_pytorch_backend.models.falcon:FalconForCausalLM",
    "Ministral3ForCausalLM": "core_pytorch_backend.models.ministral3:Ministral3ForCausalLM",
    # the released checkpoints' class: their language model, for text only (no vision processor registered)
    "Mistral3ForConditionalGeneration": "core_pytorch_backend.models.ministral3:Mistral3ForConditionalGeneration",
    "ApertusForCausalLM": "core_pytorch_backend.models.apertus:ApertusForCausalLM",
    "VaultGemmaForCausalLM": "core_pytorch_backend.models.vaultgemma:VaultGemmaForCausalLM",
    "NanoChatForCausalLM": "core_pytorch_backend.models.nanochat:NanoChatForCausalLM",
    "Jais2ForCausalLM": "core_pytorch_backend.models.jais2:Jais2ForCausalLM",
    "PersimmonForCausalLM": "core_pytorch_backend.models.persimmon:PersimmonForCausalLM",
    "CodeGenForCausalLM": "core_pytorch_backend.models.codegen:CodeGenForCausalLM",
    "XGLMForCausalLM": "core_pytorch_backend.models.xglm:XGLMForCausalLM",
    "BioGptForCausalLM": "core_pytorch_backend.models.biogpt:BioGptForCausalLM",
    "SolarOpenForCausalLM": "core_pytorch_backend.models.solar_open:SolarOpenForCausalLM",
    "YoutuForCausalLM": "core_pytorch_backend.models.youtu:YoutuForCausalLM",
    "Ernie4_5_MoeForCausalLM": "core_pytorch_backend.models.ernie4_5_moe:Ernie4_5_MoeForCausalLM",
    "HunYuanMoEV1ForCausalLM": "core_pytorch_backend.models.hunyuan_moe:HunYuanMoEV1ForCausalLM",
    "PhimoeForCausalLM": "core_pytorch_backend.models.phimoe:PhimoeForCausalLM",
    "Llama4ForCausalLM": "core_pytorch_backend.models.llama4:Llama4ForCausalLM",  # the text decoder alone
    "GptOssForCausalLM": "core_pytorch_backend.models.gpt_oss:GptOssForCausalLM",
    "BloomForCausalLM": "core_pytorch_backend.models.bloom:BloomForCausalLM",
    "MptForCausalLM": "core_pytorch_backend.models.mpt:MptForCausalLM",
    "MPTForCausalLM": "core_pytorch_backend.models.mpt:MptForCausalLM",  # MosaicML's own configs name it so
    "GPTNeoForCausalLM": "core_pytorch_backend.models.gpt_neo:GPTNeoForCausalLM",
    "DeepseekV2ForCausalLM": "core_pytorch_backend.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "core_pytorch_backend.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM": "core_pytorch_backend.models.glm4_moe:Glm4MoeForCausalLM",
    "Dots1ForCausalLM": "core_pytorch_backend.models.dots1:Dots1ForCausalLM",
    "Glm4MoeLiteForCausalLM": "core_pytorch_backend.models.deepseek_v3:Glm4MoeLiteForCausalLM",  # GLM-4.7-Flash
    "ExaoneMoeForCausalLM": "core_pytorch_backend.models.exaone_moe:ExaoneMoeForCausalLM",
    "Cohere2MoeForCausalLM": "core_pytorch_backend.models.cohere2_moe:Cohere2MoeForCausalLM",
    "MiniCPM3ForCausalLM": "core_pytorch_backend.models.minicpm3:MiniCPM3ForCausalLM",  # MLA, dense MLPs
    "FlexOlmoForCausalLM": "core_pytorch_backend.models.flex_olmo:FlexOlmoForCausalLM",
    "DbrxForCausalLM": "core_pytorch_backend.models.dbrx:DbrxForCausalLM",
    "JetMoeForCausalLM": "core_pytorch_backend.models.jetmoe:JetMoeForCausalLM",  # experts in attention and MLP
    "AfmoeForCausalLM": "core_pytorch_backend.models.afmoe:AfmoeForCausalLM",  # Arcee's Trinity
    "Gemma4ForCausalLM": "core_pytorch_backend.models.gemma4:Gemma4ForCausalLM",
    # the released checkpoints' class: their language model, for text only (no vision processor registered)
    "Gemma4ForConditionalGeneration": "core_pytorch_backend.models.gemma4:Gemma4ForConditionalGeneration",
    "Mamba2ForCausalLM": "core_pytorch_backend.models.mamba2:Mamba2ForCausalLM",  # no attention: no KV cache
    "GraniteMoeHybridForCausalLM": "core_pytorch_backend.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "BambaForCausalLM": "core_pytorch_backend.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "core_pytorch_backend.models.nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": "core_pytorch_backend.models.falcon_h1:FalconH1ForCausalLM",
    "Lfm2ForCausalLM": "core_pytorch_backend.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "core_pytorch_backend.models.lfm2_moe:Lfm2MoeForCausalLM",
    "Lfm3ForCausalLM": "core_pytorch_backend.models.lfm3:Lfm3ForCausalLM",
    "MiniMaxForCausalLM": "core_pytorch_backend.models.minimax:MiniMaxForCausalLM",  # lightning + softmax layers
    "MambaForCausalLM": "core_pytorch_backend.models.mamba:MambaForCausalLM",  # no attention: no KV cache
    "FalconMambaForCausalLM": "core_pytorch_backend.models.mamba:FalconMambaForCausalLM",
    "JambaForCausalLM": "core_pytorch_backend.models.jamba:JambaForCausalLM",
    "Qwen3NextForCausalLM": "core_pytorch_backend.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "core_pytorch_backend.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "core_pytorch_backend.models.qwen3_5:Qwen3_5MoeForCausalLM",
    # the released Qwen3.5 checkpoints' class: their language model, for text only (no vision processor registered)
    "Qwen3_5ForConditionalGeneration": "core_pytorch_backend.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "core_pytorch_backend.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
    "OlmoHybridForCausalLM": "core_pytorch_backend.models.olmo_hybrid:OlmoHybridForCausalLM",
    "KimiLinearForCausalLM": "core_pytorch_backend.models.kimi_linear:KimiLinearForCausalLM",  # KDA + MLA layers
    "Zamba2ForCausalLM": "core_pytorch_backend.models.zamba2:Zamba2ForCausalLM",  # Mamba-2 + shared attention blocks
    # Encoders: served on the pooling path (embeddings and scores), never generating.
    "BertModel": "core_pytorch_backend.models.bert:BertModel",
    "RobertaModel": "core_pytorch_backend.models.bert:RobertaModel",
    "XLMRobertaModel": "core_pytorch_backend.models.bert:RobertaModel",
    "ModernBertModel": "core_pytorch_backend.models.modernbert:ModernBertModel",
    "MPNetModel": "core_pytorch_backend.models.mpnet:MPNetModel",
    "MPNetForMaskedLM": "core_pytorch_backend.models.mpnet:MPNetModel",  # all-mpnet-base-v2's config names it
    "DistilBertModel": "core_pytorch_backend.models.distilbert:DistilBertModel",
    # Cross-encoders (rerankers): served on the pooling path too, scoring pairs (/v1/score, /v1/rerank).
    "BertForSequenceClassification": "core_pytorch_backend.models.bert:BertForSequenceClassification",
    "RobertaForSequenceClassification": "core_pytorch_backend.models.bert:RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": "core_pytorch_backend.models.bert:RobertaForSequenceClassification",
    # Vision-language checkpoints: their language model; the vision tower runs in core_vl_models.
    "Qwen2VLForConditionalGeneration": f"{_VL}:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": f"{_VL}:Qwen2VLForConditionalGeneration",
    "LlavaForConditionalGeneration": f"{_VL}:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": f"{_VL}:LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration": f"{_VL}:LlavaForConditionalGeneration",
    "SmolVLMForConditionalGeneration": f"{_VL}:LlavaForConditionalGeneration",
    "InternVLForConditionalGeneration": f"{_VL}:InternVLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "core_pytorch_backend.models.gemma3:Gemma3ForConditionalGeneration",
}


def resolve_class(target: str | type) -> type:
    """A model class, given the class itself or a ``"module:Class"`` string."""
    return target if isinstance(target, type) else import_target(target)


__all__ = ["BUILTIN_ARCHITECTURES", "resolve_class"]
