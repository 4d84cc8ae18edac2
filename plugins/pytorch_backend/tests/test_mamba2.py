"""Mamba-2 and the hybrids built on its mixer (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1, Zamba2) on the pytorch
backend: greedy parity with transformers' generate (its torch paths: no mamba_ssm / causal_conv1d here) on tiny
random checkpoints whose prompts cross several scan chunks (``chunk_size`` 8), one sequence, a batch of
different lengths, prefill in chunks (some shorter than the convolution), logits parity, the config variants
the real checkpoints use; the mixer against a token-by-token recurrence over a step that mixes fresh prompts,
continued chunks and decode rows; and the layouts refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers import attention_layers
from core_pytorch_backend.layers.recurrent import (
    recurrent_layers,
    state_bytes_per_sequence,
    unbind_recurrent_states,
)
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.models.mamba2_mixer import Mamba2Mixer, MixerSpec, ssd_step
from core_pytorch_backend.native.library import available as native_kernels
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    allocate_poisoned_states,
    assert_greedy_matches,
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

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=257, eos_token_id=258,
              pad_token_id=259)
# Each family's mixer: 8 heads of 16, a state of 16 in 2 groups, chunks of 8, under the family's field names.
MAMBA = dict(mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)
# Zamba2's mixer: 8 heads of 16 (mamba_expand 2 x 64 / 8), a state of 16 in 2 groups, chunks of 8; adapters of 8
ZAMBA = dict(n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=2, chunk_size=8, adapter_rank=8, rms_norm_eps=1e-6)
FALCON_MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.3],
                          key_multiplier=1.5, attention_in_multiplier=0.7, attention_out_multiplier=0.9,
                          ssm_multipliers=[1.2, 0.8, 1.1, 0.9, 1.4], ssm_in_multiplier=1.3, ssm_out_multiplier=0.6)
NEMOTRON = dict(head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48, layer_norm_epsilon=1e-6)
# Granite's multipliers; the softmax scale 0.5, not 4.0-H's 1/128: at 1/128 these random scores are flat and
# rotary (or its absence) changes nothing
GRANITE = dict(**MAMBA, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
               logits_scaling=8.0)

# name -> (config class, overrides)
CONFIGS = {
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=8,
                                    layer_norm_epsilon=1e-6)),
    # Granite 4.0-H-tiny's layout: Mamba layers around an attention layer without rotary, 4 experts (two a
    # token) beside the shared MLP, Granite's multipliers, the head tied (with Granite's embeddings x12 and
    # residual branches x0.22 the random tied model repeats one token; only their ratio counts)
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        **{**GRANITE, "embedding_multiplier": 4.0, "residual_multiplier": 2.0},
        layer_types=["mamba", "attention", "mamba"], position_embedding_type="nope", tie_word_embeddings=True)),
    "bamba": ("BambaConfig", dict(**MAMBA, attn_layer_indices=[1])),
    # Mamba, attention, relu^2 MLP, experts, Mamba
    "nemotron_h": ("NemotronHConfig", dict(**NEMOTRON, hybrid_override_pattern="M*-EM")),
    "falcon_h1": ("FalconH1Config", dict(**MAMBA, **FALCON_MULTIPLIERS, mamba_d_ssm=128, num_hidden_layers=2)),
    # mamba2-130m ... 2.7b: one group, the head tied; biased projections, no convolution bias
    "mamba2-one-group-tied": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=8,
                                                   tie_word_embeddings=True)),
    "mamba2-biases-no-conv-bias": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=4,
                                                        chunk_size=8, use_bias=True, use_conv_bias=False)),
    # a time step limit that clamps the prompt's steps (transformers' decode step does not clamp)
    "mamba2-time-step-limit": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=8,
                                                    time_step_limit=(0.0, 0.6))),
    # Granite 4.0-H-micro: dense (the shared MLP alone), one group, untied
    "granitemoehybrid-dense-one-group": ("GraniteMoeHybridConfig", dict(
        **{**GRANITE, "mamba_n_groups": 1, "num_local_experts": 0}, layer_types=["mamba", "mamba", "attention"],
        position_embedding_type="nope")),
    # granite-4.0-micro: every layer attention, with rotary
    "granitemoehybrid-all-attention-rope": ("GraniteMoeHybridConfig", dict(
        **{**GRANITE, "num_local_experts": 0}, layer_types=["attention"] * 3, position_embedding_type="rope")),
    "bamba-biases-one-group": ("BambaConfig", dict(**{**MAMBA, "mamba_n_groups": 1}, attn_layer_indices=[0],
                                                   attention_bias=True, mlp_bias=True, mamba_proj_bias=True)),
    # Nemotron 3's experts: behind a latent projection, 2 groups of which 1 is kept, scaled, with biases
    "nemotron_h-latent-grouped-biases": ("NemotronHConfig", dict(
        **NEMOTRON, hybrid_override_pattern="ME*E", moe_latent_size=32, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, use_bias=True, mlp_bias=True)),
    # Nemotron-H-8B's dense pattern
    "nemotron_h-dense": ("NemotronHConfig", dict(**NEMOTRON, hybrid_override_pattern="M-M*-")),
    # a shared expert of size 0: transformers' of intermediate_size (found by fuzzing configs: a load error)
    "nemotron_h-shared-expert-size-0": ("NemotronHConfig", dict(**{**NEMOTRON, "moe_shared_expert_intermediate_size": 0},
                                                                 hybrid_override_pattern="ME*E")),
    # the gated norm, normed before the gate, of mamba_expand * hidden_size; biased out_proj
    "falcon_h1-norm-before-gate": ("FalconH1Config", dict(
        **MAMBA, **FALCON_MULTIPLIERS, num_hidden_layers=2, mamba_d_ssm=None, mamba_expand=1, mamba_rms_norm=True,
        mamba_norm_before_gate=True, projectors_bias=True)),
    "falcon_h1-norm-after-gate-tied": ("FalconH1Config", dict(
        **MAMBA, **FALCON_MULTIPLIERS, num_hidden_layers=2, mamba_d_ssm=128, mamba_rms_norm=True,
        mamba_norm_before_gate=False, tie_word_embeddings=True)),
    # Zamba2: Mamba layers around two hybrid ones that run one shared block (its attention over [h, embeddings],
    # scale (head_dim / 2) ** -0.5, a GELU MLP), each with its own adapters, KV cache and output projection
    "zamba2": ("Zamba2Config", dict(
        **ZAMBA, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
        use_shared_attention_adapter=True, num_key_value_heads=4)),
    # two blocks taking turns over three hybrid layers (the third runs the first block again, with its own
    # adapter), rotary, grouped k/v heads, no attention adapters, biased projections, a clamping time_step_min
    "zamba2-two-blocks-rope-biases": ("Zamba2Config", dict(
        **ZAMBA, num_hidden_layers=4, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"], num_mem_blocks=2,
        use_mem_rope=True, add_bias_linear=True, time_step_min=0.6)),
    # untied: transformers ties the blocks only with the embeddings, so each hybrid layer has a block of its own
    "zamba2-untied-own-blocks": ("Zamba2Config", dict(
        **ZAMBA, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
        use_shared_attention_adapter=True, num_key_value_heads=4, tie_word_embeddings=False)),
}
PARITY = ("mamba2", "granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "zamba2")
VARIANTS = [name for name in CONFIGS if name not in PARITY]


def _build(name: str, folder: Path) -> Path:
    """A tiny random checkpoint, weights of std 0.2 (A_log, dt_bias and D too: decays of about e^-0.7 a token,
    so the state carries the prompt; Zamba2's shared blocks 0.1), Nemotron-H's routing correction biases large
    enough to change which experts are chosen."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra = CONFIGS[name]
    config = getattr(transformers, cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model, std=0.2)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():  # a buffer there, left at zero by reinit_
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.5)
        for param_name, param in model.named_parameters():  # Zamba2's shared blocks and their projections at 0.1:
            if ".shared_transformer." in param_name or param_name.endswith(".linear.weight"):  # at 0.2, float32
                param.mul_(0.5)  # rounding alone moves its logits past 1e-4 (transformers' own against float64)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, _build)


@pytest.fixture(scope="module", params=PARITY)
def pair(request, checkpoint):
    return ours_and_transformers(checkpoint(request.param))


def test_single_sequence_matches_transformers(pair):
    assert_greedy_matches(pair, [21], block_size=16)


def test_batched_varlen_prefill_then_decode(pair):
    assert_greedy_matches(pair, [3, 13, 1, 8, 30], seed=2)


def test_chunked_prefill_continues_the_states(pair):
    assert_greedy_matches(pair, [14, 27], seed=3, prefill_chunks=3)


def test_prefill_in_chunks_shorter_than_the_convolution(pair):
    assert_greedy_matches(pair, [17, 11], seed=4, prefill_chunks=8)  # 8 chunks: 1 to 3 tokens each, the kernel 4 wide


def test_logits_match_transformers(pair):
    ours, hf = pair
    (prompt,) = random_prompts([19], seed=5)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(prompt_logits(ours, prompt), expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(variant, checkpoint):
    ours, hf = ours_and_transformers(checkpoint(variant))
    prompts = random_prompts([23, 6], seed=7)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


def test_time_step_limit_clamps_prompt_tokens_alone_in_their_chunks(checkpoint):
    """transformers clamps the time steps of a whole prompt (its prefill), never a generated token's: a prompt token
    alone in its chunk is clamped too (found by fuzzing configs: the scan took the step for it, and a 3-token prompt
    prefilled a token at a time gave other text)."""
    assert_greedy_matches(ours_and_transformers(checkpoint("mamba2-time-step-limit")), [14, 3, 1], seed=3,
                          prefill_chunks=3)


def test_mamba2_owns_no_kv_cache_only_states(checkpoint):
    model = load_checkpoint(checkpoint("mamba2"), dtype="float32").model
    assert attention_layers(model) == []
    # per layer: the convolution's last 3 inputs of 128 + 2 x 2 x 16 channels, and an 8 x 16 x 16 float32 state
    assert state_bytes_per_sequence(model, torch.float32) == 3 * (3 * 192 + 8 * 16 * 16) * 4


@pytest.mark.parametrize("name", ["mamba2", "granitemoehybrid"])
def test_bfloat16_keeps_float32_ssm_states_and_starts_as_float32(name, checkpoint):
    path = checkpoint(name)
    model = load_checkpoint(path, dtype="bfloat16").model
    assert next(model.parameters()).dtype == torch.bfloat16
    assert [spec.dtype for spec in recurrent_layers(model)[0].state_specs()] == [None, torch.float32]
    ref = load_checkpoint(path, dtype="float32").model
    prompts = random_prompts([12, 9, 15], seed=5)  # random weights: later tokens part at bfloat16's rounding
    got, want = paged_greedy(model, prompts, max_new=2), paged_greedy(ref, prompts, max_new=2)
    assert [g[0] for g in got] == [w[0] for w in want]


# ---------------------------------------------------------------- the mixer against a plain recurrence

SPEC = MixerSpec(hidden_size=32, heads=4, head_dim=8, state_size=6, groups=2, conv_kernel=4, chunk_size=4,
                 norm_eps=1e-6, conv_bias=True)


def _recurrence(mixer: Mamba2Mixer, inputs: torch.Tensor) -> torch.Tensor:
    """One sequence's outputs [L, hidden], token by token as written in the Mamba-2 paper."""
    spec = mixer.spec
    z, xbc, dt = mixer.in_proj(inputs).split([spec.inner, spec.conv_channels, spec.heads], dim=-1)
    padded = F.pad(xbc, (0, 0, spec.conv_kernel - 1, 0))
    state = torch.zeros(spec.heads, spec.head_dim, spec.state_size)
    per_group = spec.heads // spec.groups
    outs = []
    for t in range(inputs.shape[0]):
        window = padded[t : t + spec.conv_kernel].t()  # [channels, kernel]
        conv = F.silu((window * mixer.conv1d.weight[:, 0]).sum(-1) + mixer.conv1d.bias)
        x, b, c = conv.split([spec.inner, spec.groups * spec.state_size, spec.groups * spec.state_size])
        x, b, c = x.view(spec.heads, -1), b.view(spec.groups, -1), c.view(spec.groups, -1)
        step = F.softplus(dt[t] + mixer.dt_bias)
        y = torch.empty(spec.heads, spec.head_dim)
        for h in range(spec.heads):
            g = h // per_group
            decay = torch.exp(-torch.exp(mixer.A_log[h]) * step[h])
            state[h] = decay * state[h] + step[h] * torch.outer(x[h], b[g])
            y[h] = state[h] @ c[g] + mixer.D[h] * x[h]
        gated = y.reshape(-1) * F.silu(z[t])
        grouped = gated.view(spec.groups, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
        outs.append(mixer.out_proj(mixer.norm.weight * normed.reshape(-1)))
    return torch.stack(outs)


@torch.inference_mode()
def test_mixer_steps_that_mix_prompts_chunks_and_decode_rows_match_the_recurrence():
    torch.manual_seed(0)
    mixer = Mamba2Mixer(SPEC)
    for param in mixer.parameters():
        param.normal_(0, 0.3)
    tokens = {seq: torch.randn(length, SPEC.hidden_size) for seq, length in (("a", 9), ("b", 8), ("c", 3))}
    slots = allocate_poisoned_states(mixer, 5)
    slot = dict(zip("abc", slots, strict=False))
    # (sequence, rows) per step: fresh prompts, a fresh single row, continued chunks (one shorter than the
    # kernel), decode rows beside a chunk, then decode rows alone
    steps = [[("a", 6), ("b", 2)], [("b", 5), ("a", 1), ("c", 1)], [("a", 1), ("b", 1), ("c", 2)],
             [("c", 0), ("a", 1)]]
    done = {seq: 0 for seq in tokens}
    got = {seq: [] for seq in tokens}
    for step in steps:
        step = [(seq, n) for seq, n in step if n]
        meta = AttentionMetadata.build([done[s] for s, _ in step], [n for _, n in step], [[0]] * len(step), 16,
                                       state_slots=[slot[s] for s, _ in step])
        out = mixer(torch.cat([tokens[s][done[s] : done[s] + n] for s, n in step]), meta)
        for (seq, n), part in zip(step, out.split([n for _, n in step]), strict=True):
            got[seq].append(part)
            done[seq] += n
    unbind_recurrent_states(mixer)
    for seq, parts in got.items():
        torch.testing.assert_close(torch.cat(parts), _recurrence(mixer, tokens[seq][: done[seq]]),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_a_decode_step_matches_the_recurrence_written_out(native):
    """`ssd_step` on the native kernel (csrc/ssd_step.c) and on torch's ops: 3 sequences x 6 heads in 3 groups,
    a state size that is no multiple of a vector, against h' = a h + dt x B^T, y = h' C head by head."""
    if native and native_kernels() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(2)
    batch, heads, head_dim, groups, size = 3, 6, 8, 3, 130
    x = torch.randn(batch, heads, head_dim, generator=gen)
    dt = torch.rand(batch, heads, generator=gen)
    a = -torch.rand(heads, generator=gen)
    b, c = (torch.randn(batch, groups, size, generator=gen) for _ in range(2))
    state = torch.randn(batch, heads, head_dim, size, generator=gen)
    before = state.clone()
    y = ssd_step(state, x, dt, a, b, c, native=native)
    for s in range(batch):
        for h in range(heads):
            g = h // (heads // groups)
            expected = torch.exp(dt[s, h] * a[h]) * before[s, h] + dt[s, h] * torch.outer(x[s, h], b[s, g])
            torch.testing.assert_close(state[s, h], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y[s, h], expected @ c[s, g], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- refused at load

@pytest.mark.parametrize("name, edits, match", [
    ("mamba2", {"hidden_act": "gelu"}, "hidden_act"),
    ("mamba2", {"n_groups": 3}, "n_groups 3"),
    ("granitemoehybrid", {"layer_types": ["mamba", "sliding_attention", "mamba"]}, r"layer_types\[1\]"),
    ("nemotron_h", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    # the k/v adapters are as wide as q: transformers fails at its first step
    ("zamba2", {"num_key_value_heads": 2}, "use_shared_attention_adapter with num_key_value_heads 2"),
])
def test_layouts_not_served_are_refused_at_load(name, edits, match, checkpoint, tmp_path):
    import shutil

    folder = shutil.copytree(checkpoint(name), tmp_path / "refused")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    with pytest.raises(NotImplementedError, match=match):
        load_checkpoint(folder, dtype="float32")
