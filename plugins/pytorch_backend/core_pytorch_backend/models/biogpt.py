"""BioGPT (Microsoft's BioGPT, BioGPT-Large): OPT's decoder (models/opt.py: learned positions at position + 2,
pre-norm layers with LayerNorms of eps 1e-5 whatever ``layer_norm_eps`` says, biased projections, an ungated
``fc1`` / ``fc2`` MLP, here GELU) with embeddings times ``sqrt(hidden_size)`` (``scale_embedding``), the attention
scores scaled rather than q (BART's attention), and the LM head (``output_projection``) tied to the embeddings.
Following transformers' ``modeling_biogpt``; its ``biogpt.`` names are read as this model's."""

from __future__ import annotations

from .opt import OPTAttention, OPTDecoderLayer, OPTForCausalLM, ScaledEmbeddingOPTModel

RENAMED = (("biogpt.layer_norm.", "model.norm."), ("biogpt.", "model."), ("output_projection.", "lm_head."))


class BioGptAttention(OPTAttention):
    scales_queries = False


class BioGptDecoderLayer(OPTDecoderLayer):
    attention_class = BioGptAttention


class BioGptModel(ScaledEmbeddingOPTModel):
    layer_class = BioGptDecoderLayer


class BioGptForCausalLM(OPTForCausalLM):
    model_class = BioGptModel
    checkpoint_renames = RENAMED
