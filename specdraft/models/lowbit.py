"""Low-bit linear layers for the transformers backend: ``NAME:int8``, ``NAME:int4`` (group size 128),
``NAME:int4-g64`` (weight-only) or ``NAME:w8a8`` (int8 weights and dynamic int8 activations) loads
NAME and swaps every ``nn.Linear`` for one of these.

The kernels are torch's own CPU ones (``aten._weight_int8pack_mm``: per-output-channel int8;
``aten._weight_int4pack_mm_for_cpu``: asymmetric int4 with a scale and zero per group of input
channels). torchao 0.18 was tried first (docs/design.md): its int8 weight-only config was slower
than bf16 here, and its int4 config needs ``mslk``, which has no CPU build. Activations stay in the
model's dtype, except for ``w8a8``: its rows are quantized at each call and multiplied in int8 by
oneDNN (``onednn.qlinear_pointwise``: AMX tiles or AVX-512 VNNI), which reads the weight's bytes once
for all rows, so a forward of 16 tokens costs little more than one (the verification path of
docs/benchmark-log.md, "Cost curves of the low-bit paths").

A quantized model is a different model: its greedy output is compared with its own plain decoding.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from ..core.errors import ConfigError

DEFAULT_GROUP = 128
GROUPS = (32, 64, 128, 256)  # what the int4 kernel takes
# The low-bit kernels' cost grows about linearly with rows (a 1536x8960 matmul, bf16 activations:
# int4 0.17 ms for 1 row, 1.18 for 16, 77 for 1,024; bf16 0.75 / 0.96 / 29; docs/results/quant/prefill.py).
# So a prefill takes another path: the dense weight of the model it was quantized from, when that
# model is in memory (the target, for --draft self:int4), from SHARED_DENSE_FROM rows; otherwise the
# weight dequantized on the fly (about 20 ms per matrix), from DEQUANTIZE_FROM rows.
SHARED_DENSE_FROM = 16
DEQUANTIZE_FROM = 512
QUANT_RE = re.compile(r"^(?:int(8|4)(?:-g(\d+))?|(w8a8))$")


class Quant(NamedTuple):
    bits: int  # of the weights
    group: int  # input channels per int4 scale; 0: one scale per output channel
    dynamic: bool = False  # activations quantized to int8 at each call (w8a8)


def parse_quant(q: str) -> Quant:
    """ "int8" -> (8, 0); "int4" -> (4, 128); "int4-g64" -> (4, 64); "w8a8" -> (8, 0, dynamic)."""
    m = QUANT_RE.match(q)
    if not m or (m.group(1) == "8" and m.group(2)):
        raise ConfigError(
            f"unknown weight quantization {q!r} on the hf backend; use int8, int4, int4-gN "
            "(N: the group size, 32, 64, 128 or 256; e.g. int4-g64) or w8a8"
        )
    if m.group(3):
        return Quant(8, 0, True)
    bits, group = int(m.group(1)), int(m.group(2) or (DEFAULT_GROUP if m.group(1) == "4" else 0))
    if bits == 4 and group not in GROUPS:
        raise ConfigError(f"the int4 group size must be one of {', '.join(map(str, GROUPS))}, got {group}")
    return Quant(bits, group)


def is_quant_suffix(q: str) -> bool:
    return bool(QUANT_RE.match(q))


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 rows (``levels`` steps each side of 0) and one scale per row
    (symmetric)."""

    def __init__(self, lin: nn.Linear, levels: int = 127):
        super().__init__()
        w = lin.weight.detach().float()
        self.levels = levels
        scale = (w.abs().amax(1) / levels).clamp(min=1e-10)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-levels, levels).to(torch.int8))
        self.register_buffer("scales", scale.to(lin.weight.dtype))
        self.bias = lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.dense_source = None  # (an nn.Linear with the original weight,) when one stays in memory

    @property
    def weight(self) -> torch.Tensor:  # the dequantized weight (heads read it; not the hot path)
        return (self.qweight.float() * self.scales.float()[:, None]).to(self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()  # the kernels need it; a batch's last rows are strided
        y = _prefill(self, x2)
        if y is None:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def w8a8_weight_levels() -> int:
    """Weight levels each side of 0 for oneDNN's u8 x s8 matmul on this CPU. Without VNNI (AVX2 only) it
    sums pairs of products in int16 (vpmaddubsw), which saturates past 32767: 2 x 255 x 127 does,
    2 x 255 x 63 does not, so there the weights take 7 bits (FBGEMM's reduce_range; measured: 25% of the
    output's scale off with 127 levels on an AVX2-only EPYC)."""
    from .llama_probe import cpu_flags

    return 127 if {"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_flags()) else 63


class W8A8Linear(Int8Linear):
    """Int8Linear whose input rows are quantized too (one symmetric scale per row, at each call), so
    the product runs on oneDNN's int8 matmul with a prepacked weight."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin, levels=w8a8_weight_levels())
        # opaque and oneDNN's own layout: a plain attribute, not a buffer (it never moves devices)
        self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, [1, self.in_features])
        self.register_buffer("scales_f32", self.scales.float())
        self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        row_scale = (x2.abs().amax(1, keepdim=True) / 127).clamp_(min=1e-10)
        # uint8 with zero point 128: oneDNN's one-row kernel is 5x slower on signed inputs (docs/results/w8a8)
        xq = torch.div(x2, row_scale).round_().add_(128).to(torch.uint8)  # |x / scale| <= 127 by construction
        # x_scale 1 and the row scales applied after: oneDNN takes one activation scale per call
        y = torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, 128, self.packed, self.scales_f32, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        y = y.mul_(row_scale) if self.bias is None else torch.addcmul(self.bias.float(), y, row_scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


# Linear layers that read one input tensor, by their names in the Llama family (Qwen2, SmolLM2, Mistral):
# under w8a8 each group is one matmul, so the input is quantized once and the weights read in one call.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class W8A8Part(nn.Module):
    """One member of a sibling group: its slice of the group's fused product. The first member called
    with an input computes the product for all; the others read it while the input is the same tensor."""

    def __init__(self, fused: W8A8Linear, lo: int, hi: int, members: int):
        super().__init__()
        self.fused = (fused,)  # a tuple: the siblings share it without registering it three times
        self.lo, self.hi, self.members = lo, hi, members
        self.in_features, self.out_features = fused.in_features, hi - lo
        self.bias = None if fused.bias is None else fused.bias[lo:hi]

    @property
    def weight(self) -> torch.Tensor:
        return self.fused[0].weight[self.lo : self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (input, product, members that read it): a member reading twice, or another input, recomputes.
        # Holding the input keeps its identity unique; the siblings of a forward read it before any
        # in-place change (inference tensors have no version counter to check that).
        fused, memo = self.fused[0], getattr(self.fused[0], "memo", None)
        if memo is None or memo[0] is not x or self.lo in memo[2]:
            memo = fused.memo = (x, fused(x), set())
        memo[2].add(self.lo)
        if len(memo[2]) == self.members:  # every sibling has read it: drop the input and the product
            fused.memo = None
        return memo[1][..., self.lo : self.hi]


def fuse_siblings(parent: nn.Module) -> int:
    """Replace each complete sibling group of ``parent``'s nn.Linear children by W8A8Parts over one
    W8A8Linear; -> how many linears were replaced."""
    done = 0
    for names in SIBLINGS:
        lins = [getattr(parent, n, None) for n in names]
        if not all(isinstance(lin, nn.Linear) and lin.in_features == lins[0].in_features for lin in lins):
            continue
        cat = nn.Linear(
            lins[0].in_features,
            sum(lin.out_features for lin in lins),
            bias=any(lin.bias is not None for lin in lins),
            dtype=lins[0].weight.dtype,
        )
        with torch.no_grad():
            cat.weight.copy_(torch.cat([lin.weight for lin in lins]))
            if cat.bias is not None:
                cat.bias.copy_(
                    torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in lins])
                )
        fused, lo = W8A8Linear(cat), 0
        for n, lin in zip(names, lins):
            setattr(parent, n, W8A8Part(fused, lo, lo + lin.out_features, len(names)))
            lo += lin.out_features
        done += len(names)
    return done


class Int4Linear(nn.Module):
    """y = x W^T + b with W stored as 4-bit codes q in 0..15, W = (q - 8) * scale + zero per group of
    ``group`` input channels (asymmetric: scale and zero from each group's min and max)."""

    def __init__(self, lin: nn.Linear, group: int):
        super().__init__()
        n, k = lin.weight.shape
        w = lin.weight.detach().float().reshape(n, k // group, group)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # the same codes two per byte, for prefills (the kernel's layout is opaque): as much memory again
        self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))
        zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.register_buffer(
            "scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(lin.weight.dtype)
        )
        self.bias = lin.bias
        self.group = group
        self.in_features, self.out_features = k, n
        self.dense_source = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (prefills and heads read it)."""
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).reshape(self.out_features, -1, self.group)
        sz = self.scales_zeros.transpose(0, 1)  # [out, in / group, 2]
        return ((q.to(sz.dtype) - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()  # the kernels need it; a batch's last rows are strided
        y = _prefill(self, x2)
        if y is None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _prefill(layer, x2: torch.Tensor) -> torch.Tensor | None:
    """x2 W^T through a dense weight when x2 has enough rows to make that cheaper; None otherwise."""
    rows, dense = x2.shape[0], layer.dense_source
    if dense is not None and rows >= SHARED_DENSE_FROM:
        return x2 @ dense[0].weight.t()
    if rows >= DEQUANTIZE_FROM:
        return x2 @ layer.weight.to(x2.dtype).t()
    return None


def _group_for(k: int, group: int) -> int:
    """The requested group size, or the largest smaller one the kernel takes that divides ``k``."""
    for g in GROUPS[::-1]:
        if g <= group and k % g == 0:
            return g
    raise ConfigError(f"an input width of {k} has no int4 group size ({', '.join(map(str, GROUPS))}) dividing it")


@torch.no_grad()
def quantize_linears(model: nn.Module, quant: str, dense_from: nn.Module | None = None, fuse: bool = True) -> dict:
    """Swap every nn.Linear of ``model`` (the LM head included) for its ``quant`` version, in place;
    -> {"bits", "group", "layers", "groups_used"}. ``dense_from``: a model of the same structure and
    weights that stays in memory (the target, when ``model`` is its copy drafting for it): prefills
    use its dense layers, so drafting costs no slow low-bit prefill. ``fuse`` (w8a8 without ``dense_from``):
    sibling linears (SIBLINGS) become one matmul; the product is the same, bit for bit."""
    bits, group, dynamic = parse_quant(quant)
    if next(model.parameters()).device.type != "cpu":
        raise ConfigError("int8 / int4 weights use torch's CPU kernels; load the model on the CPU")
    if dynamic and not torch.backends.mkldnn.is_available():
        raise ConfigError("w8a8 needs torch's oneDNN (mkldnn) kernels, which this torch build lacks; use int8 or int4")
    dense = dict(dense_from.named_modules()) if dense_from is not None else {}
    used, count = set(), 0
    for pname, parent in list(model.named_modules()):
        if dynamic and fuse and not dense:
            count += fuse_siblings(parent)
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if dynamic:
                new = W8A8Linear(child)
            elif bits == 8:
                new = Int8Linear(child)
            else:
                g = _group_for(child.in_features, group)
                used.add(g)
                new = Int4Linear(child, g)
            src = dense.get(f"{pname}.{name}" if pname else name)
            if isinstance(src, nn.Linear) and src.weight.shape == child.weight.shape:
                new.dense_source = (src,)  # a tuple: not registered as a submodule of this model
            setattr(parent, name, new)
            count += 1
    return {
        "bits": bits,
        "group": group,
        "dynamic": dynamic,
        "layers": count,
        "groups_used": sorted(used),
        "shares_dense_prefill": bool(dense),
    }
