"""A weight kept as 4- or 8-bit codes in the native kernel's layout (``csrc/packed_linear.c``).

``NativeWeight.from_affine`` lays out an ``AffineWeight`` (codes per group of 32 inputs with one scale
and offset each, or 8-bit codes per group of 16: GGUF's Q6_K) in blocks of 16 rows side by side: N is padded to a multiple of 16 and K to a multiple
of 64 with zero codes, scales and offsets; within a block, each step of 4 inputs holds the 16 rows' 4
codes in turn, and 4-bit codes of groups 2p and 2p+1 share a byte (low and high nibble). A symmetric
code's offset (``o = -2^(bits-1) * s``: GGUF Q4_0 and Q8_0, int8) is stored like any other; the K-quants' scales and
offsets as int8 multiples of a float32 unit per 256 inputs (``_factored``). ``linear``
takes float32 or bfloat16 activations and returns the same dtype. Where the kernels have a prompt loop (the
AMX tile loop, or the AVX512-BF16 vector prompt loop), the rows that ``tile_rows.current()`` marks (a
prompt's tokens) take it and the others the VNNI loop (see tile_rows.py for the rule and why it is a
property of the token).

``NativeWeight.from_half`` keeps a 16-bit float weight (a bf16 checkpoint's, a GGUF file's F16 / BF16
tensor) in the same blocks (``bits == 16``, no scales or offsets; ``csrc/half_linear.c``), multiplied in
float32 sums, the same loop for every row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..quant.affine import SUPER_BLOCK, AffineWeight
from . import tile_rows
from .library import CpuKernels

GROUP, PAIR, BLOCK, STEP = 32, 64, 16, 4
HALF_GROUP = 16  # 8-bit codes may have a scale and offset per 16 inputs
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc DT_*
# scales kept as int8 multiples of a float32 unit per 256 inputs (csrc/packed_linear.c's DT_S8_32 / DT_S8_16: an int8
# buffer), by the weight's group
FACTORED_CODES = {GROUP: 4, HALF_GROUP: 5}
HALF_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}  # 16-bit weights' dtypes, as the start-up line says
# a step of prompt and generated rows multiplied a run of rows at a time, in place, up to this many runs (a call
# each); more (rows interleaved), the rows of each loop gathered and their outputs scattered back
MAX_RUNS = 8


def native_fits(weight: AffineWeight) -> bool:
    """Whether the native kernel takes ``weight`` (groups of 32 or 16 inputs, codes of up to 8 bits)."""
    return weight.group_size in (GROUP, HALF_GROUP) and weight.bits <= 8


def _padded(array: np.ndarray, rows: int, columns: int) -> np.ndarray:
    if array.shape == (rows, columns):
        return array
    out = np.zeros((rows, columns), dtype=array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out


def _block_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [Np, Kp] -> the kernel's blocks (see the module docstring), as one flat array.

    A step's 4 codes (bytes) move together, so the transposes move them as one uint32 (a byte-wise
    transpose of the default model's 28 MB LM head took most of its load)."""
    n, kp = codes.shape
    steps = GROUP // STEP
    if bits == 8:  # [b, r, g, j, (t)] -> [b, g, j, r, (t)]
        words = np.ascontiguousarray(codes).view(np.uint32).reshape(n // BLOCK, BLOCK, kp // GROUP, steps)
        return words.transpose(0, 2, 3, 1).ravel().view(np.uint8)
    pairs = codes.reshape(n // BLOCK, BLOCK, kp // PAIR, 2, steps, STEP)  # [b, r, p, half, j, t]
    nibbles = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)  # [b, r, p, j, t], a new array
    words = nibbles.view(np.uint32).reshape(n // BLOCK, BLOCK, kp // PAIR, steps)  # [b, r, p, j, (t)]
    return words.transpose(0, 2, 3, 1).ravel().view(np.uint8)


def _block_floats(values: np.ndarray) -> np.ndarray:
    """float [Np, G] -> [Np / 16, G, 16]."""
    n, groups = values.shape
    return values.reshape(n // BLOCK, BLOCK, groups).transpose(0, 2, 1).ravel()


def _factored(weight: AffineWeight, np_: int, kp: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The scales and offsets as int8 multiples of ``weight.units`` (one float32 per 256 inputs of a row), where
    they are exactly that (GGUF's K-quants): three eighths of float32's bytes or less (Q4_K: 0.75 bits a weight for
    both instead of 2; Q6_K: 1.25 instead of 4), the same values in the kernel (``code * unit`` in float32: the file's
    ``d * sc``). Per block of 16 rows and super-block: the groups' 16 rows' codes, then the 16 rows' units
    [Np / 16, K / 256, groups a super-block x 16 + 64] bytes (csrc/packed_linear.c ``factored_super``). None where
    there are no units, K is not whole super-blocks, or a value is not such a multiple."""
    if weight.units is None or weight.shape[1] % SUPER_BLOCK or kp != weight.shape[1]:
        return None
    per = SUPER_BLOCK // weight.group_size
    laid_out = []
    for values, unit in zip((weight.scale, weight.offset), weight.units, strict=True):
        values, unit = values.astype(np.float32, copy=False), unit.astype(np.float32, copy=False)
        repeated = np.repeat(unit, per, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            codes = np.where(repeated != 0, np.rint(values / repeated), 0)
        if not (-128 <= codes.min(initial=0) and codes.max(initial=0) <= 127) or not np.array_equal(
                codes.astype(np.float32) * repeated, values):
            return None
        codes = _padded(codes.astype(np.int8), np_, kp // weight.group_size)
        unit = _padded(unit, np_, kp // SUPER_BLOCK)
        blocks, supers = np_ // BLOCK, kp // SUPER_BLOCK
        code_bytes = codes.reshape(blocks, BLOCK, supers, per).transpose(0, 2, 3, 1).reshape(blocks, supers, -1)
        unit_bytes = unit.reshape(blocks, BLOCK, supers).transpose(0, 2, 1).copy().view(np.int8)
        laid_out.append(np.concatenate((code_bytes, unit_bytes), axis=2).ravel())
    return laid_out[0], laid_out[1]


def scale_code(scale: torch.Tensor, group: int) -> int:
    """csrc DT_* of a packed weight's scale buffer: its float dtype, or the factored layout's code (int8)."""
    return FACTORED_CODES[group] if scale.dtype == torch.int8 else DTYPE_CODES[scale.dtype]


def _exact_halves(*arrays: np.ndarray) -> bool:
    """Whether float16 holds every value of ``arrays`` exactly."""
    with np.errstate(over="ignore"):
        return all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)


class NativeWeight(nn.Module):
    """A [N, K] weight multiplied by the native CPU kernel (see the module docstring)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 shape: tuple[int, int], padded_k: int, kernels: CpuKernels, group: int = GROUP) -> None:
        super().__init__()
        self.shape = shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bits = bits
        self.group = group
        self.padded_k = padded_k
        self.kernels = kernels
        # whether gated_linear can take this weight as a [gate | up] pair: codes in groups of 32 on a CPU with a
        # prompt loop, each half whole blocks
        self.fuses_silu = (bits != 16 and group == GROUP and shape[0] % (2 * BLOCK) == 0
                           and kernels.prompt_loop is not None)

    @classmethod
    def from_affine(cls, weight: AffineWeight, kernels: CpuKernels) -> NativeWeight:
        if not native_fits(weight):
            raise ValueError(f"a {weight.bits}-bit weight with groups of {weight.group_size} does not fit "
                             "the native kernel (groups of 32 or 16, up to 8 bits)")
        n, k = weight.shape
        np_, kp = -(-n // BLOCK) * BLOCK, -(-k // PAIR) * PAIR
        group = weight.group_size
        bits = 4 if weight.bits <= 4 and group == GROUP else 8
        codes = _block_codes(_padded(weight.q.astype(np.uint8, copy=False), np_, kp), bits)
        scale, offset = weight.scale.astype(np.float32, copy=False), weight.offset.astype(np.float32, copy=False)
        factored = _factored(weight, np_, kp)
        if factored is not None:
            scale, offset = factored
        else:
            halves = _exact_halves(scale, offset)
            scale, offset = (_block_floats(_padded(a.astype(np.float16) if halves else a, np_, kp // group))
                             for a in (scale, offset))
        return cls(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scale, offset)), bits, (n, k), kp,
                   kernels, group)

    @classmethod
    def from_half(cls, weight: torch.Tensor, kernels: CpuKernels) -> NativeWeight:
        """A bfloat16 or float16 [N, K] weight in the blocks of ``csrc/half_linear.c`` (N padded to 16, K to
        64): bfloat16 two inputs a row a step, float16 one."""
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
            raise ValueError("weight must be a 2-D bfloat16 or float16 tensor, got "
                             f"{weight.dtype} of shape {tuple(weight.shape)}")
        n, k = weight.shape
        np_, kp = -(-n // BLOCK) * BLOCK, -(-k // PAIR) * PAIR
        padded = torch.zeros(np_, kp, dtype=weight.dtype)
        padded[:n, :k] = weight
        if weight.dtype == torch.bfloat16:  # [b, r, p, t] -> [b, p, r, t]
            blocks = padded.view(np_ // BLOCK, BLOCK, kp // 2, 2).transpose(1, 2)
        else:  # [b, r, i] -> [b, i, r]
            blocks = padded.view(np_ // BLOCK, BLOCK, kp).transpose(1, 2)
        none = torch.empty(0, dtype=weight.dtype)  # no scales: their dtype names the weight's for the kernel
        return cls(blocks.contiguous().view(torch.uint8).flatten(), none, none.clone(), 16, (n, k), kp, kernels)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of a 16-bit weight as ``dtype`` [*ids.shape, K] (the lookups of an embedding table tied
        to this weight: the blocks hold it exactly)."""
        if self.bits != 16:
            raise ValueError(f"rows of a {self.bits}-bit weight are not kept; only 16-bit weights give rows")
        n, k = self.shape
        flat = ids.reshape(-1)
        block, row = flat // BLOCK, flat % BLOCK
        values = self.codes.view(self.scale.dtype)
        if self.scale.dtype == torch.bfloat16:  # [b, p, r, t]
            picked = values.view(-1, self.padded_k // 2, BLOCK, 2)[block, :, row, :]
        else:  # [b, i, r]
            picked = values.view(-1, self.padded_k, BLOCK)[block, :, row]
        return picked.reshape(flat.numel(), self.padded_k)[:, :k].to(dtype).view(*ids.shape, k)

    @property
    def kind(self) -> str:
        """What the start-up line calls this layer's weights."""
        return f"{HALF_NAMES[self.scale.dtype]}-native" if self.bits == 16 else f"int{self.bits}-native"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, *, reference: bool = False,
               tiles: bool | None = None) -> torch.Tensor:
        """x @ W^T + bias. ``tiles``: True / False forces the tile / VNNI loop for every row (True raises
        CpuKernelError where the kernels have no tiles); None (the default) follows ``tile_rows.current()``
        where the kernels have tiles. ``reference``: the plain-C loop (the VNNI loop's oracle)."""
        # A decode step calls this ~120 times, so it does no more than it must: buffers read from
        # _buffers (an nn.Module attribute lookup is a slow __getattr__), the ctypes function called
        # directly (4 us of the 11 us a call took on a 2-core EPYC was Python around the kernel).
        n, k = self.shape
        flat = x.reshape(-1, k)
        code = DTYPE_CODES.get(flat.dtype) if flat.dtype != torch.float16 else None
        if code is None:
            flat, code = flat.float(), 0
        elif not flat.is_contiguous():
            flat = flat.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()  # named: alive during the call
        if reference:
            out = self._call("core_packed_linear_reference", flat, code, bias)
        elif tiles is not None:
            out = self._call("core_packed_linear_tiles" if tiles else "core_packed_linear", flat, code, bias)
        else:
            out = self._by_rows(flat, code, bias)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def gated_linear(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor | None:
        """silu(gate) * up of this [gate | up] weight's product (``activation`` "silu"), [..., N / 2], in the prompt
        loop's epilogue: the bits of ``linear`` and then the native silu * up, in a marked step
        (``tile_rows.current()``: a prefill chunk, any step under ``--amx-rows all``, or a step of prompt and
        generated rows in at most MAX_RUNS runs, whose generated rows' product is followed by silu * up);
        None otherwise (the caller multiplies, then applies its activation)."""
        if activation != "silu" or not self.fuses_silu:
            return None
        n, k = self.shape
        flat = x.reshape(-1, k)
        rows = tile_rows.current()
        code = DTYPE_CODES.get(flat.dtype) if flat.dtype != torch.float16 else None
        if rows is None or rows.total != flat.shape[0] or code is None or len(rows.runs) > MAX_RUNS:
            return None
        flat = flat.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()  # named: alive during the call
        if rows.all_tiled:
            out = self._call("core_packed_linear_tiles_silu", flat, code, bias, n // 2)
        else:  # a step of prompt and generated rows: each run in place, the VNNI loop's product then silu * up
            out = torch.empty((flat.shape[0], n // 2), dtype=flat.dtype)
            silu = self.kernels.function("core_silu_and_mul")
            for first, stop, tiled in rows.runs:
                if tiled:
                    self._call("core_packed_linear_tiles_silu", flat[first:stop], code, bias, n // 2, out[first:stop])
                    continue
                product = self._call("core_packed_linear", flat[first:stop], code, bias)
                status = silu(product.data_ptr(), code, stop - first, n // 2, out[first:stop].data_ptr())
                if status:
                    self.kernels.raise_for("core_silu_and_mul", status)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n // 2)

    def _by_rows(self, flat: torch.Tensor, code: int, bias: torch.Tensor | None) -> torch.Tensor:
        """The step's prompt-token rows on the tiles, the others by the VNNI loop (tile_rows.py)."""
        rows = tile_rows.current() if self.kernels.prompt_loop is not None and self.bits != 16 else None
        if rows is None or rows.total != flat.shape[0]:
            return self._call("core_packed_linear", flat, code, bias)
        if rows.all_tiled:
            return self._call("core_packed_linear_tiles", flat, code, bias)
        out = torch.empty((flat.shape[0], self.shape[0]), dtype=flat.dtype)
        if len(rows.runs) <= MAX_RUNS:  # each run in place
            for first, stop, tiled in rows.runs:
                self._call("core_packed_linear_tiles" if tiled else "core_packed_linear", flat[first:stop], code, bias,
                           out=out[first:stop])
            return out
        for tiled in (True, False):  # many runs: each loop's rows gathered, their outputs scattered back
            index = rows.rows(tiled)
            out.index_copy_(0, index, self._call("core_packed_linear_tiles" if tiled else "core_packed_linear",
                                                 flat.index_select(0, index), code, bias))
        return out

    def _call(self, kernel: str, flat: torch.Tensor, code: int, bias: torch.Tensor | None,
              width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`kernel`'s y [M, width] (default N) for the rows `flat` (contiguous), into `out` (contiguous) if given."""
        m = flat.shape[0]
        if out is None:
            out = torch.empty((m, width or self.shape[0]), dtype=flat.dtype)
        buffers = self._buffers
        status = self.kernels.function(kernel)(
            flat.data_ptr(), code, m, self.shape[1], buffers["codes"].data_ptr(), self.bits, self.group, self.shape[0],
            self.padded_k, buffers["scale"].data_ptr(), buffers["offset"].data_ptr(),
            scale_code(buffers["scale"], self.group), None if bias is None else bias.data_ptr(), out.data_ptr(), code)
        if status:
            self.kernels.raise_for(kernel, status)
        return out

    def extra_repr(self) -> str:
        if self.bits == 16:
            return f"shape={self.shape}, {str(self.scale.dtype).replace('torch.', '')}, {self.kernels.variant}"
        scales = "int8 x unit" if self.scale.dtype == torch.int8 else str(self.scale.dtype).replace("torch.", "")
        return f"shape={self.shape}, bits={self.bits}, groups of {self.group}, {scales} scales, {self.kernels.variant}"
