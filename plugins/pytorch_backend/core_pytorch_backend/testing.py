"""Tiny random-weight checkpoints and the greedy-parity drivers the model tests run: a paged driver that
assigns KV blocks by hand (shuffled, non-contiguous), prefills several sequences at once (whole or in chunks)
and decodes one token per sequence per step, and transformers' generate as the oracle. A third party adding
an architecture checks it the same way (``paged_greedy(ours, prompts) == [hf_greedy(hf, p) for p in prompts]``).
Importable from any test module (pytest's ``--import-mode=importlib`` puts no test folder on sys.path)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers import allocate_kv_caches, unbind_kv_caches
from core_pytorch_backend.layers.recurrent import allocate_recurrent_states, unbind_recurrent_states

NEW_TOKENS = 20
TINY_VOCAB = 260  # 256 byte-level tokens + 4 specials
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
def reinit_(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> None:
    """Larger-than-default random weights, so greedy decoding is far from ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if "norm" in name else noise)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny_checkpoint(config: Any, folder: Path, seed: int = 0, reinit: Callable[..., None] | None = None
                         ) -> Path:
    """A random float32 model of the transformers ``config`` (``reinit``'s weights, ``reinit_`` by default)
    saved with ``tiny_tokenizer`` into ``folder``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    (reinit or reinit_)(model, seed=seed)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def allocate_poisoned_states(model, slots: int) -> list[int]:
    """Bind ``slots`` recurrent-state slots of ``model`` (if it has recurrent layers) filled with NaN, as memory
    never written may be (a fresh sequence must never read its slot), and return them shuffled."""
    for states in allocate_recurrent_states(model, slots):
        for state in states:
            state.fill_(float("nan"))
    order = list(range(slots))
    random.Random(slots).shuffle(order)
    return order


def _step(model, chunks, computed, tables, block_size, slots, prompt_lens):
    """One forward over several sequences' new tokens; returns each sequence's greedy next token. ``prompt_lens``
    tells a prompt token alone in its chunk from a generated one, as the engine's runner does."""
    meta = AttentionMetadata.build(computed, [len(c) for c in chunks], tables, block_size,
                                   prompt_lens=prompt_lens, state_slots=slots[: len(chunks)])
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
    hidden = model(ids, meta.positions(), meta)
    logits = model.compute_logits(hidden[meta.last_token_indices()])
    return logits.argmax(-1).tolist()


def _split(prompt, n_chunks):
    """``n_chunks`` consecutive parts of ``prompt``, the last never empty (its row gives the next token), so a
    prompt shorter than ``n_chunks`` has empty chunks before it."""
    bounds = [i * len(prompt) // n_chunks for i in range(n_chunks + 1)]
    return [prompt[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@torch.inference_mode()
def paged_greedy(model, prompts, max_new=NEW_TOKENS, block_size=4, prefill_chunks=1, seed=0):
    """Greedy continuation of every prompt, run together as one batch."""
    need = [-(-(len(p) + max_new) // block_size) for p in prompts]
    ids = list(range(sum(need) + 3))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start : start + n])
        start += n
    allocate_kv_caches(model, len(ids), block_size)
    slots = allocate_poisoned_states(model, len(prompts) + 2)
    computed = [0] * len(prompts)
    prompt_lens = [len(p) for p in prompts]
    chunked = [_split(p, prefill_chunks) for p in prompts]
    for i in range(prefill_chunks):
        chunks = [c[i] for c in chunked]
        nxt = _step(model, chunks, computed, tables, block_size, slots, prompt_lens)
        computed = [n + len(c) for n, c in zip(computed, chunks, strict=True)]
    outs = [[t] for t in nxt]
    for _ in range(max_new - 1):
        nxt = _step(model, [[o[-1]] for o in outs], computed, tables, block_size, slots, prompt_lens)
        computed = [n + 1 for n in computed]
        for o, t in zip(outs, nxt, strict=True):
            o.append(t)
    unbind_kv_caches(model)
    unbind_recurrent_states(model)
    return outs


def built_once(tmp_path_factory: Any, build: Callable[[str, Path], Path]) -> Callable[[str], Path]:
    """``get(name)``: the checkpoint ``build(name, folder)`` saves into a fresh temporary folder, built once per
    name (the body of a module-scoped ``checkpoint`` fixture)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


def ours_and_transformers(path: Path, **load: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Our float32 model of the checkpoint at ``path`` (``load``: more of load_checkpoint's arguments) and
    transformers' (in eval mode): the two sides of a parity test."""
    from transformers import AutoModelForCausalLM

    from core_pytorch_backend.loader import load_checkpoint

    ours = load_checkpoint(path, dtype="float32", **load).model
    return ours, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt, max_new=NEW_TOKENS):
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in lengths]


def assert_greedy_matches(pair, lengths, seed=1, block_size=4, prefill_chunks=1) -> None:
    """Greedy outputs of random prompts of ``lengths`` (``random_prompts``) through our paged engine step
    (``paged_greedy``) equal transformers' ``generate`` (``hf_greedy``); ``pair`` is (ours, transformers')."""
    ours, hf = pair
    prompts = random_prompts(lengths, seed=seed)
    got = paged_greedy(ours, prompts, block_size=block_size, prefill_chunks=prefill_chunks)
    expected = [hf_greedy(hf, p) for p in prompts]
    if got != expected:
        raise AssertionError(f"greedy outputs differ from transformers':\n ours   {got}\n theirs {expected}")


def reinit_with_layer_norms_(model: torch.nn.Module, std: float = 0.15, seed: int = 0) -> None:
    """``reinit_`` for models with LayerNorms: LayerNorm weights 1 + noise and their biases noise (``reinit_``
    finds norms by name and sets their biases near 1, which makes such models repeat one token), Bloom's
    embedding norm at 0.3 of that (with a tied head a unit-scale embedding makes it repeat its input token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=gen) * std
                if isinstance(module, torch.nn.LayerNorm) and name == "weight":
                    noise = (1.0 + noise) * (0.3 if "word_embeddings_layernorm" in module_name else 1.0)
                param.copy_(noise)


@torch.inference_mode()
def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt's prefill, its blocks out of order."""
    blocks = -(-len(prompt) // 4)
    allocate_kv_caches(model, blocks + 2, 4)
    slots = allocate_poisoned_states(model, 3)
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(blocks + 1, 0, -1))], 4, state_slots=slots[:1])
    hidden = model(torch.tensor(prompt), meta.positions(), meta)
    unbind_kv_caches(model)
    unbind_recurrent_states(model)
    return model.compute_logits(hidden)


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()  # small logits must not hide in the absolute tolerance
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * scale)


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, float32 scale per block, the weight they stand for) of ``weight``, in DeepSeek's
    layout (each block's largest value the largest code, 448)."""
    scale = torch.zeros(-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    codes, exact = torch.empty_like(weight), torch.empty_like(weight)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[rows, cols].abs().max() / 448.0
            codes[rows, cols] = weight[rows, cols] / scale[i, j]
            exact[rows, cols] = codes[rows, cols].to(torch.float8_e4m3fn).float() * scale[i, j]
    return codes.to(torch.float8_e4m3fn), scale, exact


def gguf_writer(target: Path, architecture: str, config: Any, tokenizer_source: Path) -> Any:
    """A GGUF writer for ``architecture`` holding the keys every file llama.cpp writes states (layers, context,
    widths, attention heads) and the tokenizer fields of the GGUF ``tokenizer_source``: a test adds its
    architecture's own keys (the KV heads among them) and its tensors, then ``finish_gguf``."""
    import gguf

    writer = gguf.GGUFWriter(target, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    for name, field in gguf.GGUFReader(tokenizer_source).fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    return writer


def finish_gguf(writer: Any, target: Path) -> Path:
    """Write ``gguf_writer``'s file out and close it; returns its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def llama_cpp_qk_rows(name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """A Llama checkpoint tensor's rows as llama.cpp's converter writes them: q / k projections' rows in its
    rotary layout (each head's halves interleaved; the loader undoes it), any other tensor as it is."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    count = next((n for part, n in heads.items() if f".{part}." in name), None)
    if count is None:
        return tensor
    return tensor.reshape(count, 2, tensor.shape[0] // count // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(
        tensor.shape)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's (and so the native kernels': one libgomp) thread count set to ``count`` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
