"""The decoders the native decode stack takes (``native_decode.py``): each family's module classes and how its layers
differ from Llama's, as data the C layer carries (``csrc/decoder_stack.c``: the norms' places and kind, the parallel
forms, an ungated MLP (tanh GELU, relu^2 or xIELU: StarCoder 2, Phi, Arcee, Jais 2, Nemotron, Apertus), Granite's
multiplier, OLMo's whole-projection q/k norms, NanoChat's q/k norms after rotary, OLMoE's clip_qkv, Ministral 3's
per-position query scale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core_pytorch_backend.kernels.native import ACT_GELU_TANH, ACT_RELU2, ACT_SILU, ACT_XIELU
from core_pytorch_backend.layers.activation import OP_OF, XIELU, GeluTanhAndMul, SiluAndMul
from core_pytorch_backend.layers.norm import LayerNorm, RMSNorm, WeightlessRMSNorm
from core_pytorch_backend.models.apertus import ApertusDecoderLayer, ApertusMLP, ApertusModel
from core_pytorch_backend.models.arcee import ArceeDecoderLayer, ArceeModel
from core_pytorch_backend.models.cohere import (
    CohereAttention,
    CohereDecoderLayer,
    CohereLayerNorm,
    CohereModel,
)
from core_pytorch_backend.models.exaone4 import Exaone4DecoderLayer, Exaone4Model
from core_pytorch_backend.models.gemma import GemmaDecoderLayer, GemmaModel
from core_pytorch_backend.models.gemma2 import Gemma2Model
from core_pytorch_backend.models.gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3MLP,
    Gemma3Model,
    GemmaRMSNorm,
)
from core_pytorch_backend.models.glm4 import Glm4DecoderLayer, Glm4Model
from core_pytorch_backend.models.granite import GraniteDecoderLayer, GraniteModel
from core_pytorch_backend.models.granitemoe import GraniteMoeDecoderLayer, GraniteMoeModel
from core_pytorch_backend.models.jais2 import Jais2DecoderLayer, Jais2Model
from core_pytorch_backend.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from core_pytorch_backend.models.ministral3 import (
    Ministral3Attention,
    Ministral3DecoderLayer,
    Ministral3Model,
)
from core_pytorch_backend.models.mixtral import MixtralDecoderLayer, MixtralModel
from core_pytorch_backend.models.nanochat import NanoChatAttention, NanoChatDecoderLayer, NanoChatModel
from core_pytorch_backend.models.nemotron import LayerNorm1P, NemotronDecoderLayer, NemotronModel
from core_pytorch_backend.models.olmo2 import Olmo2Attention, Olmo2DecoderLayer, Olmo2Model
from core_pytorch_backend.models.olmo3 import Olmo3Model
from core_pytorch_backend.models.olmoe import OlmoeAttention, OlmoeDecoderLayer, OlmoeModel
from core_pytorch_backend.models.phi import PhiAttention, PhiDecoderLayer, PhiModel
from core_pytorch_backend.models.sparse_moe import QwenMoeDecoderLayer, QwenMoeModel
from core_pytorch_backend.models.stablelm import StableLmAttention, StableLmDecoderLayer, StableLmModel
from core_pytorch_backend.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2Model
from core_pytorch_backend.models.ungated_mlp import UngatedMLP
from core_pytorch_backend.models.vaultgemma import VaultGemmaModel

# A layer's norms by the C layer's places for them (core_layer: input_norm, post_norm, attn_out_norm, mlp_out_norm;
# None: none there): Llama's before the attention and before the MLP; Gemma 2 and 3's and GLM-4's "sandwich" norms,
# which add those of the attention's and the MLP's outputs (Gemma's post_attention_layernorm is the attention
# output's, GLM-4's the MLP input's); OLMo 2's post-norm layers, only the outputs'
PRE = ("input_layernorm", "post_attention_layernorm", None, None)
GEMMA_SANDWICH = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                  "post_feedforward_layernorm")
GLM4_SANDWICH = ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")
POST = (None, None, "post_attention_layernorm", "post_feedforward_layernorm")
PARALLEL_NONE, PARALLEL_RESIDUAL, PARALLEL_SUM = 0, 1, 2  # csrc/decoder_stack.c
NORM_RMS, NORM_RMS_FLOAT, NORM_LAYER = 0, 1, 2  # csrc/decoder_stack.c


@dataclass(frozen=True)
class Family:
    """The module classes of one decoder family the stack takes, and how its layers differ from Llama's."""

    layer: type
    attention: type
    mlp: type
    norm: type  # RMSNorm (weights of the activations' dtype), GemmaRMSNorm (float32 1 + w) or a LayerNorm (a bias;
    # its scale(): Nemotron's 1 + w in the weight's dtype)
    places: tuple[str | None, ...]  # the layer's norms at the C layer's places (PRE, GEMMA_SANDWICH, ...)
    scaled: bool = False  # the attention's and the MLP's outputs times the layer's residual_multiplier (Granite)
    qk_whole: bool = False  # q and k normalized over all their heads at once (OLMo 2 and 3, OLMoE)
    # a layer without a norm before its MLP: post-norm (OLMo 2), or its MLP beside the attention on the attention's
    # input norm (csrc/decoder_stack.c PARALLEL_RESIDUAL: StableLM's use_parallel_residual; PARALLEL_SUM: Phi's)
    parallel: int = PARALLEL_NONE
    o_proj: str = "o_proj"  # the attention's output projection (Phi's: dense)
    qk_norms: bool = True  # the attention has q_norm and k_norm (None: none); Phi's has q_layernorm, k_layernorm
    qk_after_rope: bool = False  # q and k normalized after rotary (NanoChat), not before

    def norms(self, layer: nn.Module) -> dict[str, nn.Module | None]:
        """The layer's norms by the place the C layer has for each (None: none there)."""
        found = {name: getattr(layer, place) if place else None
                 for name, place in zip(("input", "before_mlp", "attn_out", "mlp_out"), self.places, strict=True)}
        attention = layer.self_attn
        return found | ({"q": attention.q_norm, "k": attention.k_norm} if self.qk_norms else {"q": None, "k": None})


FAMILIES = {LlamaModel: Family(LlamaDecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, PRE),
             GraniteModel: Family(GraniteDecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, PRE, scaled=True),
             QwenMoeModel: Family(QwenMoeDecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, PRE),
             MixtralModel: Family(MixtralDecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, PRE),
             GraniteMoeModel: Family(GraniteMoeDecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, PRE, scaled=True),
             OlmoeModel: Family(OlmoeDecoderLayer, OlmoeAttention, LlamaMLP, RMSNorm, PRE, qk_whole=True),
             Olmo2Model: Family(Olmo2DecoderLayer, Olmo2Attention, LlamaMLP, RMSNorm, POST, qk_whole=True),
             Olmo3Model: Family(Olmo2DecoderLayer, Olmo2Attention, LlamaMLP, RMSNorm, POST, qk_whole=True),
             Exaone4Model: Family(Exaone4DecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, POST),
             Glm4Model: Family(Glm4DecoderLayer, LlamaAttention, LlamaMLP, RMSNorm, GLM4_SANDWICH),
             Starcoder2Model: Family(Starcoder2DecoderLayer, LlamaAttention, UngatedMLP, LayerNorm, PRE),
             Jais2Model: Family(Jais2DecoderLayer, LlamaAttention, UngatedMLP, LayerNorm, PRE),
             ArceeModel: Family(ArceeDecoderLayer, LlamaAttention, UngatedMLP, RMSNorm, PRE),
             Ministral3Model: Family(Ministral3DecoderLayer, Ministral3Attention, LlamaMLP, RMSNorm, PRE),
             ApertusModel: Family(ApertusDecoderLayer, LlamaAttention, ApertusMLP, RMSNorm, PRE),
             NanoChatModel: Family(NanoChatDecoderLayer, NanoChatAttention, UngatedMLP, WeightlessRMSNorm, PRE,
                                    qk_after_rope=True),
             NemotronModel: Family(NemotronDecoderLayer, LlamaAttention, UngatedMLP, LayerNorm1P, PRE),
             StableLmModel: Family(StableLmDecoderLayer, StableLmAttention, LlamaMLP, LayerNorm, PRE,
                                    parallel=PARALLEL_RESIDUAL),
             CohereModel: Family(CohereDecoderLayer, CohereAttention, LlamaMLP, CohereLayerNorm,
                                  ("input_layernorm", None, None, None), parallel=PARALLEL_RESIDUAL),
             PhiModel: Family(PhiDecoderLayer, PhiAttention, UngatedMLP, LayerNorm, ("input_layernorm", None, None, None),
                               parallel=PARALLEL_SUM, o_proj="dense", qk_norms=False),
             GemmaModel: Family(GemmaDecoderLayer, Gemma3Attention, Gemma3MLP, GemmaRMSNorm, PRE),
             Gemma2Model: Family(Gemma3DecoderLayer, Gemma3Attention, Gemma3MLP, GemmaRMSNorm, GEMMA_SANDWICH),
             VaultGemmaModel: Family(GemmaDecoderLayer, Gemma3Attention, Gemma3MLP, GemmaRMSNorm, PRE),  # Gemma 2's
             Gemma3Model: Family(Gemma3DecoderLayer, Gemma3Attention, Gemma3MLP, GemmaRMSNorm, GEMMA_SANDWICH)}
ACTIVATIONS = {SiluAndMul: ACT_SILU, GeluTanhAndMul: ACT_GELU_TANH}
# an Activation's op (layers.activation.OP_OF) -> the C layer's code
UNGATED_ACTIVATIONS = {"gelu_tanh": ACT_GELU_TANH, "relu2": ACT_RELU2}
NORM_KINDS = {RMSNorm: NORM_RMS, GemmaRMSNorm: NORM_RMS_FLOAT, LayerNorm: NORM_LAYER, CohereLayerNorm: NORM_LAYER,
              LayerNorm1P: NORM_LAYER, WeightlessRMSNorm: NORM_RMS_FLOAT}


def family_of(decoder: nn.Module | None) -> Family | None:
    """The family of the decoder's class or of the nearest base class in FAMILIES whose forward it runs as it is
    (a subclass that only builds itself otherwise, e.g. its rotary tables: its layers are checked one by one)."""
    for cls in type(decoder).__mro__:
        family = FAMILIES.get(cls)
        if family is not None:
            kept = all(getattr(type(decoder), name) is getattr(cls, name) for name in ("forward", "run_layers"))
            return family if kept else None
    return None


def mlp_parts(mlp: nn.Module) -> tuple[nn.Module, nn.Module, int | None]:
    """A dense MLP's first projection (gate_up, or an ungated MLP's up), its down projection and the code of its
    activation (None: one the C layer does not run as the modules do)."""
    if type(mlp) is UngatedMLP:
        up, down = mlp.projections()
        return up, down, None if mlp.act.op is None else UNGATED_ACTIVATIONS[OP_OF[mlp.act.hidden_act]]
    if type(mlp) is ApertusMLP:
        xielu = type(mlp.act_fn) is XIELU and mlp.act_fn.op is not None
        return mlp.up_proj, mlp.down_proj, ACT_XIELU if xielu else None
    return mlp.gate_up_proj, mlp.down_proj, ACTIVATIONS.get(type(mlp.act_fn))


def parallel_form(layer: nn.Module, family: Family) -> int:
    """The layer's form: its MLP after the attention (PARALLEL_NONE) or beside it (the family's parallel form)."""
    return family.parallel if family.norms(layer)["before_mlp"] is None else PARALLEL_NONE


def act_params_of(mlp: nn.Module) -> tuple[float, float, float, float]:
    """The parameters of a dense MLP's activation the C layer reads (Apertus's xIELU: alpha_p, alpha_n, beta, eps;
    zeros for the others)."""
    return mlp.act_fn.params() if type(mlp) is ApertusMLP else (0.0, 0.0, 0.0, 0.0)


def query_scales_of(attention: nn.Module) -> torch.Tensor | None:
    """Each position's factor on q after rotary, float32 (Ministral 3's Llama 4 scaling; None: none)."""
    return attention.query_scales() if type(attention) is Ministral3Attention else None


def clip_qkv_of(attention: nn.Module) -> float:
    """The bound OLMoE's attention clamps q, k and v to (0: none)."""
    return (attention.clip_qkv or 0.0) if type(attention) is OlmoeAttention else 0.0
