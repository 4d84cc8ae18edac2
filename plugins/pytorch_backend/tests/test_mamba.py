"""Mamba, FalconMamba and Jamba on the pytorch backend: greedy parity with transformers' generate (its torch
paths: no mamba_ssm or causal_conv1d installed) on tiny random checkpoints, for one sequence, a batch of
different lengths, prefills in chunks (some shorter than the convolution's kernel) and the scan's blocks;
logits parity; config variants the published checkpoints use; the mixer's state handling (steps mixing
prefill and decode rows, poisoned slots) against one whole pass; the prompt scan against a plain loop where
the decays underflow; and what is refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers import allocate_kv_caches, attention_layers, unbind_kv_caches
from core_pytorch_backend.layers.recurrent import allocate_recurrent_states, recurrent_layers
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.models import mamba_mixer
from core_pytorch_backend.models.mamba_mixer import MambaMixer, MixerSizes, selective_scan
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    assert_logits_close,
    built_once,
    hf_greedy,
    ours_and_transformers,
    paged_greedy,
    prompt_logits,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, bos_token_id=257, eos_token_id=258,
              pad_token_id=259)
# Jamba: 4 layers, attention on 1 and 3, 4 experts (two a token) on 0 and 2 (Mamba layers), dense MLPs on 1, 3
JAMBA = dict(num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
             expert_layer_period=2, expert_layer_offset=0, rms_norm_eps=1e-6)
# name -> (config class name, overrides)
CONFIGS = {
    # mamba-*-hf's layout: tied, a convolution bias, no projection biases
    "mamba": ("MambaConfig", dict(state_size=16)),
    "falcon_mamba": ("FalconMambaConfig", dict(state_size=16, tie_word_embeddings=False)),  # falcon-mamba-7b
    "jamba": ("JambaConfig", JAMBA),
    # projection biases, no convolution bias, untied, a kernel of 3
    "mamba-biases-untied-kernel-3": ("MambaConfig", dict(state_size=8, use_bias=True, use_conv_bias=False,
                                                         tie_word_embeddings=False, conv_kernel=3, expand=3)),
    "falcon_mamba-tied-eps": ("FalconMambaConfig", dict(state_size=16, mixer_rms_eps=1e-2)),
    # attention on layer 2 of 4 (Jamba 1.5: 4 of 8), experts on the even layers, the attention layer's too;
    # projection biases, no convolution bias, tied, an explicit dt rank
    "jamba-period-4-biases-tied": ("JambaConfig", {**JAMBA, "attn_layer_period": 4, "attn_layer_offset": 2,
                                                   "expert_layer_offset": 0, "mamba_proj_bias": True,
                                                   "mamba_conv_bias": False, "tie_word_embeddings": True,
                                                   "mamba_dt_rank": 8, "mamba_d_state": 8}),
    "jamba-dense": ("JambaConfig", {**JAMBA, "num_experts": 1}),  # no experts at all: every MLP dense
}
FAMILIES = ("mamba", "falcon_mamba", "jamba")
VARIANTS = [name for name in CONFIGS if name not in FAMILIES]
# the mixers' own parameters keep transformers' initialization (A = -1..-16, D = 1, dt in [0.001, 0.1]): the
# states then remember tens of tokens, as trained ones do
KEPT = ("A_log", ".D", "dt_proj.bias")


def _config(name: str, **overrides):
    import transformers

    cls, extra = CONFIGS[name]
    return getattr(transformers, cls)(**{**COMMON, **extra, **overrides})


def _build(folder: Path, name: str, **overrides) -> Path:
    """A tiny checkpoint: weights of std 0.2 (of 0.1, the tied Mamba repeated its input token), the mixers'
    A_log, D and dt bias as transformers initializes them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name, **overrides), dtype=torch.float32)
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(KEPT)}
    reinit_(model, std=0.2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in kept:
                p.copy_(kept[n])
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


class Pair:
    """Our model and transformers' of one checkpoint; transformers' greedy tokens kept by prompt."""

    def __init__(self, path: Path):
        self.ours, self.hf = ours_and_transformers(path)
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def expected(self, prompts: list[list[int]]) -> list[list[int]]:
        for p in prompts:
            if tuple(p) not in self.cache:
                self.cache[tuple(p)] = hf_greedy(self.hf, p)
        return [self.cache[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, lambda name, folder: _build(folder, name))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, checkpoint) -> Pair:
    return Pair(checkpoint(request.param))


def test_single_sequence_matches_transformers(pair):
    prompts = random_prompts([9])
    assert paged_greedy(pair.ours, prompts, block_size=16) == pair.expected(prompts)


def test_batched_varlen_prefill_then_decode(pair):
    prompts = random_prompts([3, 13, 1, 8], seed=2)
    assert paged_greedy(pair.ours, prompts, block_size=4) == pair.expected(prompts)


def test_chunked_prefill_continues_the_states(pair):
    prompts = random_prompts([14, 7], seed=3)
    assert paged_greedy(pair.ours, prompts, block_size=4, prefill_chunks=3) == pair.expected(prompts)


def test_prefill_chunks_shorter_than_the_kernel(pair):
    """Chunks of 1 to 3 tokens: each convolution reads inputs of two or three chunks before."""
    prompts = random_prompts([13, 9], seed=4)
    assert paged_greedy(pair.ours, prompts, block_size=4, prefill_chunks=7) == pair.expected(prompts)


def test_prompt_scan_in_blocks(pair, monkeypatch):
    """A prompt the scan takes in blocks of 5 tokens (the last one short), then decodes from."""
    width = max(m.A_log.numel() for m in recurrent_layers(pair.ours))
    monkeypatch.setattr(mamba_mixer, "SCAN_BLOCK_ELEMENTS", 5 * width)
    prompts = random_prompts([23, 10], seed=6)
    assert paged_greedy(pair.ours, prompts, block_size=4) == pair.expected(prompts)


def test_logits_match_transformers(pair):
    (prompt,) = random_prompts([40], seed=5)
    with torch.inference_mode():
        expected = pair.hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(prompt_logits(pair.ours, prompt), expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(variant, checkpoint):
    variant_pair = Pair(checkpoint(variant))
    prompts = random_prompts([23, 6], seed=7)
    got = paged_greedy(variant_pair.ours, prompts, block_size=4, prefill_chunks=2)
    assert got == variant_pair.expected(prompts)
    (prompt,) = random_prompts([17], seed=8)
    with torch.inference_mode():
        expected = variant_pair.hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(prompt_logits(variant_pair.ours, prompt), expected)


def test_layers_own_what_the_config_names(pair):
    """Mamba owns no KV cache; Jamba's attention layers are where the period puts them, with caches."""
    config, model = pair.hf.config, pair.ours
    attention = [layer.layer_index for layer in attention_layers(model)]
    assert attention == [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert len(recurrent_layers(model)) == config.num_hidden_layers - len(attention)
    allocate_kv_caches(model, 4, 4)  # none to allocate for Mamba
    unbind_kv_caches(model)


def test_bfloat16_keeps_float32_ssm_states_and_residual_stream(checkpoint):
    """The convolution's window in the model's dtype, the SSM state and (``residual_in_fp32``) the residual
    stream in float32, as transformers keeps them; the first tokens as transformers' bfloat16 model's."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("mamba")
    model = load_checkpoint(path, dtype="bfloat16").model
    (conv, ssm), *_ = allocate_recurrent_states(model, 3)
    assert (conv.shape, conv.dtype) == ((3, 128, 3), torch.bfloat16)
    assert (ssm.shape, ssm.dtype) == ((3, 128, 16), torch.float32)
    streams = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: streams.append(out[1].dtype))
    prompts = random_prompts([9], seed=9)
    got = paged_greedy(model, prompts, max_new=4)
    assert set(streams) == {torch.float32}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert got[0] == hf_greedy(hf, prompts[0], 4)


def test_forward_without_states_raises(checkpoint):
    model = load_checkpoint(checkpoint("mamba"), dtype="float32").model
    meta = AttentionMetadata.build([0], [2], [[0]], 4, state_slots=[0])
    with pytest.raises(RuntimeError, match="no recurrent state is bound"):
        model(torch.tensor([1, 2]), meta.positions(), meta)


def test_unsupported_activation_is_refused_at_load(tmp_path):
    path = _build(tmp_path / "tanh", "mamba", hidden_act="tanh")
    with pytest.raises(NotImplementedError, match="hidden_act 'tanh'"):
        load_checkpoint(path, dtype="float32")


# ---------------------------------------------------------------- the mixer alone

SIZES = MixerSizes(hidden_size=16, intermediate=24, state_size=8, conv_kernel=4, dt_rank=3, bias=True,
                   conv_bias=True, activation="silu")


def _mixer() -> MambaMixer:
    mixer = MambaMixer(SIZES)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        mixer.A_log.copy_(torch.log(torch.arange(1, 9.0)).expand(24, 8))
        mixer.dt_proj.bias.fill_(-3.0)
    return mixer


def _run(mixer: MambaMixer, steps: list[list[tuple[int, int, int]]], inputs: list[torch.Tensor]
         ) -> list[torch.Tensor]:
    """Every step a list of (sequence, first row, rows); returns each sequence's outputs, row by row."""
    states = allocate_recurrent_states(mixer, len(inputs) + 1)[0]
    for state in states:
        state.fill_(float("nan"))
    outs: list[list[torch.Tensor]] = [[] for _ in inputs]
    for step in steps:
        slots = [seq + 1 for seq, _, _ in step]
        meta = AttentionMetadata.build([start for _, start, _ in step], [n for _, _, n in step],
                                       [[0, 1, 2]] * len(step), 4, state_slots=slots)
        hidden = mixer(torch.cat([inputs[seq][start:start + n] for seq, start, n in step]), meta)
        for (seq, _, _), part in zip(step, hidden.split([n for _, _, n in step]), strict=True):
            outs[seq].append(part)
    return [torch.cat(rows) for rows in outs]


@torch.inference_mode()
def test_mixer_steps_mixing_prefill_and_decode_rows_match_one_pass():
    mixer, gen = _mixer(), torch.Generator().manual_seed(1)
    inputs = [torch.randn(9, 16, generator=gen), torch.randn(8, 16, generator=gen)]
    whole = _run(mixer, [[(0, 0, 9), (1, 0, 8)]], inputs)
    steps = [[(0, 0, 5), (1, 0, 2)],  # two prefills
             [(0, 5, 1), (1, 2, 1)],  # one decode row each: the batched step
             [(1, 3, 4), (0, 6, 1)],  # a prefill chunk beside a decode row
             [(0, 7, 1), (1, 7, 1)],
             [(0, 8, 1)]]
    for got, want in zip(_run(mixer, steps, inputs), whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _sequential_scan(x, dt, A, B, C, state):
    outs = []
    for t in range(len(x)):
        state = torch.exp(dt[t, :, None] * A) * state + (dt[t] * x[t])[:, None] * B[t]
        outs.append(state @ C[t])
    return torch.stack(outs), state


@pytest.mark.parametrize("block_tokens", [64, 7])
def test_prompt_scan_matches_a_loop_where_decays_underflow(block_tokens, monkeypatch):
    """Decays from 1 down to exp(-dt * 400) (dt up to 20) per token: a factorized cumsum would overflow."""
    monkeypatch.setattr(mamba_mixer, "SCAN_BLOCK_ELEMENTS", block_tokens * 12 * 4)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, 12, generator=gen)
    B, C = torch.randn(50, 4, generator=gen), torch.randn(50, 4, generator=gen)
    dt = torch.rand(50, 12, generator=gen) ** 4 * 20
    A = -torch.logspace(-3, 2.6, 48).reshape(12, 4)
    state = torch.randn(12, 4, generator=gen)
    got, final = selective_scan(x, dt, A, B, C, state)
    want, want_final = _sequential_scan(x, dt, A, B, C, state)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
