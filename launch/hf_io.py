"""Hugging Face safetensors checkpoints in and out.

Reads a directory holding `model.safetensors` or a sharded `model.safetensors.index.json` (or one .safetensors
file). Accepted key spellings, all mapped onto our parameter names (which are Hugging Face's without the prefix):
- prefixes `model.` (…ForCausalLM) and `model.language_model.` (Qwen3.5 …ForConditionalGeneration); `mtp.*` and
  MiniMax-M2's `mtp_modules.*` / `mtp_transition*`,
  vision-tower keys and the multi-token-prediction layers after the stack (DeepSeek-V3's, GLM-4.5's) are skipped;
- DeepSeek-V3's and GLM-4.5's `mlp.shared_experts` (ours: `mlp.shared_expert`), and the sigmoid router's
  `mlp.gate.e_score_correction_bias` (a buffer);
- routed experts one tensor per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what transformers
  writes) or fused (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]; Qwen3-VL-MoE's
  releases with the input dimension first, [E, D, 2I] and [E, I, D]); Mixtral's
  `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down), and MiniMax-M2's (the same,
  with the router's correction bias on the block: `block_sparse_moe.e_score_correction_bias`, or `mlp.…`);
- Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba`, split into Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a (the same network: the rows are only reordered);
- block-quantized fp8 weights (DeepSeek-V3's and Kimi-K2's releases: float8_e4m3 with a `weight_scale_inv` per
  128 × 128 block, `quantization_config.weight_block_size`), dequantized as they are read;
- gpt-oss's names and layouts: the router `mlp.router` (ours: `mlp.gate`, with its bias), fused experts with the
  input dimension first, `mlp.experts.gate_up_proj` [E, D, 2I] whose columns interleave gate and up (gate the even
  ones), `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, D], `down_proj_bias` [E, D] (ours: [E, 2I, D]
  rows [gate | up], [E, D, I]), `self_attn.sinks`; and its MXFP4 release, whose expert matrices are `*_blocks`
  (uint8 [E, rows, cols/32, 16]: two e2m1 fp4 values a byte, low nibble first) and `*_scales` (uint8 e8m0
  [E, rows, cols/32]: 2^(s − 127) for each run of 32 values), dequantized to bf16 as each layer is read;
- compressed-tensors' pack-quantized integer weights (Kimi-K2-Thinking's and Kimi-K2.5's int4 releases:
  `weight_packed` int32 words of 8 codes, the first in the lowest bits, each 4-bit value stored + 8; `weight_scale`
  one scale per 32 inputs of a row; `weight_shape`), dequantized to bf16 as they are read; Kimi-K2.5's text model
  under `language_model.` with its vision tower and projector skipped.

Our Gated DeltaNet keeps in_proj_qkv's rows and conv1d's channels grouped per key head ([q | k | r value heads] × G,
launch/model.py: a tensor-parallel shard is whole heads); both Hugging Face layouts keep [all q | all k | all v]
there, so load and export reorder those two tensors (`gdn_grouped_order`), and checkpoints of every layout hold
the same tensors.

Export writes the layout transformers itself writes for the architecture (per-expert tensors, `model.` prefix;
Mixtral's own names, and MiniMax-M2's: Mixtral's with the correction bias on the block; gpt-oss's fused bf16 layout,
not quantized) and a config.json, so `from_pretrained` and our loader both read it back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from launch.hf_files import safetensors_files
from launch.model import GatedDeltaNet, Transformer, assign_full, whole_model_name
from recipe.models import ModelShape

# MTP (DeepSeek's `mtp.`, MiniMax-M2's `mtp_modules.`), vision (Qwen3.5's `visual.`, Llama 4's and Step-3.7's
# `vision_model.`, Llama 4's `multi_modal_projector.`, Step-3.7's `vit_large_projector.`, Kimi-K2.5's and Gemma 4's
# `vision_tower.`, Kimi-K2.5's `mm_projector.`, Gemma 4's `embed_vision.` and its audio tower's), Qwen3-Omni's audio tower, talker and code-to-wave model (its thinker's text model is read,
# under `thinker.`)
_SKIP = re.compile(r"^(model\.|thinker\.)?(mtp[._]|visual\.|vision_model\.|vision_tower\.|multi_modal_projector\.|"
                   r"vit_large_projector\.|mm_projector\.|audio_tower\.|embed_vision\.|embed_audio\.)|"
                   r"^(talker|code2wav)\.")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Mixtral's names for the MoE block and its experts' three matrices (ours: `mlp`, gate_proj/up_proj/down_proj)
_MIXTRAL_BLOCK = re.compile(r"^(layers\.\d+)\.block_sparse_moe\.")
_OUR_MOE_BLOCK = re.compile(r"^(layers\.\d+)\.mlp\.")
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts\.\d+)\.(w1|w2|w3)\.weight$")
# DeepSeek-V3's and GLM-4.5's shared experts are `mlp.shared_experts` (ours, Qwen's: `mlp.shared_expert`)
_SHARED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp)\.shared_experts\.")
_OUR_SHARED_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.shared_expert\.")
_PLURAL_SHARED_ARCHS = ("deepseek_v3", "glm4_moe", "ernie4_5_moe")
# ERNIE-4.5 keeps its router's correction bias as `mlp.moe_statics.e_score_correction_bias` [1, E] in its checkpoints
# (`mlp.gate.moe_statics.…` in transformers' module tree); ours is the gate's, [E]
_ERNIE_BIAS = re.compile(r"^(layers\.\d+\.mlp)\.(?:gate\.)?moe_statics\.e_score_correction_bias$")
_OUR_BIAS = re.compile(r"^(layers\.\d+\.mlp)\.gate\.e_score_correction_bias$")
# MiniMax-M2 keeps it on the MoE block (`block_sparse_moe.e_score_correction_bias` in its releases)
_BLOCK_BIAS = re.compile(r"^(layers\.\d+\.mlp)\.e_score_correction_bias$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
# gpt-oss: the router is `mlp.router` (ours: `mlp.gate`); its fused experts' tensors (stripped of `mlp.experts.`)
_ROUTER = re.compile(r"^(layers\.\d+\.mlp)\.router\.")
_OUR_ROUTER = re.compile(r"^(layers\.\d+\.mlp)\.gate\.")
_FUSED_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
# Llama 4's FFN is `feed_forward` (ours: `mlp`), dense or MoE; its router `feed_forward.router`, its fused experts
# input dimension first: gate_up_proj [E, D, 2I] (columns [gate | up]), down_proj [E, I, D]
_FEED_FORWARD = re.compile(r"^(layers\.\d+)\.feed_forward\.")
_OUR_FFN = re.compile(r"^(layers\.\d+)\.mlp\.")
# Granite MoE's releases (and what transformers writes): the experts `block_sparse_moe.input_linear` [E, 2I, D] (rows
# [gate | up]) and `output_linear` [E, D, I], the router `block_sparse_moe.router.layer`, the shared expert
# `shared_mlp.input_linear` [2I, D] and `output_linear` beside the block
_GRANITE_IN = {"mlp.input_linear.weight": "mlp.experts.gate_up_proj", "mlp.output_linear.weight": "mlp.experts.down_proj",
               "mlp.router.layer.weight": "mlp.gate.weight", "mlp.router.weight": "mlp.gate.weight",
               "shared_mlp.output_linear.weight": "mlp.shared_expert.down_proj.weight"}
_GRANITE_OUT = {"mlp.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
                "mlp.experts.down_proj": "block_sparse_moe.output_linear.weight",
                "mlp.gate.weight": "block_sparse_moe.router.layer.weight",
                "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight"}
# Granite-SWA's (what transformers writes for it): the experts fused, the router without `layer`
_GRANITE_SWA_OUT = {**_GRANITE_OUT, "mlp.experts.gate_up_proj": "block_sparse_moe.experts.gate_up_proj",
                    "mlp.experts.down_proj": "block_sparse_moe.experts.down_proj",
                    "mlp.gate.weight": "block_sparse_moe.router.weight"}
_LAYER_REST = re.compile(r"^(layers\.\d+)\.(.*)$")
# Hunyuan-V3's names (ours on the right): the correction bias on the block, the router, the shared experts
_HY_V3_IN = ((".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"), (".mlp.router.gate.", ".mlp.gate."),
             (".mlp.shared_mlp.", ".mlp.shared_expert."))
# MiMo-V2-Flash's: the sinks
_MIMO_IN = ((".self_attn.attention_sink_bias", ".self_attn.sinks"),)
# Cohere2-MoE's: the shared experts, plural (the loader's DeepSeek rule makes them singular first)
_COHERE2_IN = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
# AFMoE's: the router and its correction bias (the output gate's projection: `_fuse_output_gate`)
_AFMOE_IN = ((".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"), (".mlp.router.gate.", ".mlp.gate."))
# Laguna's: the correction bias beside the experts (the loader's DeepSeek rule makes `shared_experts` singular)
_LAGUNA_IN = ((".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)
# Step-3.7's releases: the MoE block `moe` with its router, correction bias and experts stacked a matrix each
# (gate_proj and up_proj [E, I, D] joined by `_join_step_experts`), the shared expert `share_expert` beside it
_STEP_IN = ((".moe.gate.weight", ".mlp.gate.weight"), (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
            (".moe.down_proj.weight", ".mlp.experts.down_proj"), (".share_expert.", ".mlp.shared_expert."))
_STEP_EXPERTS = re.compile(r"^(layers\.\d+)\.moe\.(gate_proj|up_proj)\.weight$")
# A.X K2's checkpoints (its releases' and what transformers saves): the query and gate projection `q_b_proj` (ours,
# transformers' module: `q_gate_proj`), each gated norm's low-rank gate `W_down` / `W_up` (ours: `mlp.fc1` / `mlp.fc2`)
_AXK2_IN = ((".self_attn.q_b_proj.", ".self_attn.q_gate_proj."), ("layernorm.W_down.", "layernorm.mlp.fc1."),
            ("layernorm.W_up.", "layernorm.mlp.fc2."))
# Gemma 4's layer-level names (its router, experts and dense MLP beside each other on the layer, its sandwich norms
# around the FFN) and ours: the router our MoE's gate, the dense MLP its shared expert
_GEMMA4_NAMES = (("router.proj.", "mlp.gate."), ("router.", "mlp.gate."), ("experts.", "mlp.experts."),
                 ("mlp.", "mlp.shared_expert."), ("pre_feedforward_layernorm.", "pre_mlp_layernorm."),
                 ("post_feedforward_layernorm.", "post_mlp_layernorm."))
_GEMMA4_IN = re.compile(r"^(layers\.\d+)\.(" + "|".join(re.escape(a) for a, _ in _GEMMA4_NAMES) + ")")
_GEMMA4_OUT = re.compile(r"^(layers\.\d+)\.(mlp\.gate\.weight$|mlp\.gate\.|mlp\.experts\.|mlp\.shared_expert\.|"
                         r"pre_mlp_layernorm\.|post_mlp_layernorm\.)")
_GEMMA4_OUT_NAMES = {"mlp.gate.weight": "router.proj.weight", "mlp.gate.": "router.", "mlp.experts.": "experts.",
                     "mlp.shared_expert.": "mlp.", "pre_mlp_layernorm.": "pre_feedforward_layernorm.",
                     "post_mlp_layernorm.": "post_feedforward_layernorm."}


def _gemma_names(sd: dict[str, torch.Tensor], to_ours: bool, moe: bool = True) -> None:
    """Gemma 4's tensors under our names (`to_ours`) or back under its own, in place; a dense model's MLP keeps
    its name (`moe` False: it is no MoE's shared expert)."""
    pattern = _GEMMA4_IN if to_ours else _GEMMA4_OUT
    names = dict(_GEMMA4_NAMES) if to_ours else _GEMMA4_OUT_NAMES
    for key in list(sd):
        if (hit := pattern.match(key)) and (moe or hit.group(2) not in ("mlp.", "mlp.shared_expert.")):
            sd[f"{hit.group(1)}.{names[hit.group(2)]}{key[hit.end():]}"] = sd.pop(key)


def _names_in(shape: ModelShape) -> tuple[tuple[str, str], ...]:
    """(a checkpoint's name part, ours) for the families whose checkpoints name some tensors their own way."""
    if shape.arch == "hunyuan_moe":
        return _HUNYUAN_IN
    return {"hy_v3": _HY_V3_IN, "mimo_v2_flash": _MIMO_IN, "afmoe": _AFMOE_IN, "cohere2_moe": _COHERE2_IN,
            "step3p5": _STEP_IN, "laguna": _LAGUNA_IN, "axk2": _AXK2_IN}.get(shape.hf_model_type, ())


def _names_out(shape: ModelShape) -> tuple[tuple[str, str], ...]:
    """(the export's first name part, the checkpoint's) for the same families: `_names_in` reversed, but for
    Hunyuan-V3 and AFMoE, whose bias the export first puts on the block (and Hunyuan-V3's shared experts it first
    names as DeepSeek's)."""
    if shape.hf_model_type in ("hy_v3", "afmoe"):
        out = ((".mlp.e_score_correction_bias", ".mlp.expert_bias"), (".mlp.gate.weight", ".mlp.router.gate.weight"))
        return out + (((".mlp.shared_experts.", ".mlp.shared_mlp."),) if shape.hf_model_type == "hy_v3" else ())
    return tuple((ours, theirs) for theirs, ours in _names_in(shape))
# Hunyuan-A13B's names (ours on the right): q/k norms, the router's `wg`, the shared expert
_HUNYUAN_IN = (("self_attn.query_layernorm.", "self_attn.q_norm."), ("self_attn.key_layernorm.", "self_attn.k_norm."),
               ("mlp.gate.wg.", "mlp.gate."), ("mlp.shared_mlp.", "mlp.shared_expert."))


def _strip(key: str) -> str:
    # Llama 4's multimodal releases: `language_model.model.` and `language_model.lm_head`
    # Qwen3-Omni's: `thinker.model.` and `thinker.lm_head`
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "thinker.model.", "thinker.",
                   "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE = ".weight_scale_inv"  # an fp8 weight's per-block scales (DeepSeek-V3's, Kimi-K2's, MiniMax-M2's releases)


def _quantization_config(path: str | Path) -> dict:
    """The `quantization_config` of the checkpoint's config.json ({} without one, or without a readable config)."""
    path = Path(path)
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    try:
        raw = json.loads(cfg.read_text())
        q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return q if isinstance(q, dict) else {}


def fp8_block_size(path: str | Path) -> tuple[int, int]:
    """The [rows, columns] of one scale block of a block-quantized fp8 checkpoint: `quantization_config.
    weight_block_size` of its config.json, 128 × 128 (every published fp8 release's) without one."""
    try:
        block = _quantization_config(path).get("weight_block_size") or (128, 128)
        return int(block[0]), int(block[1])
    except (ValueError, TypeError, IndexError, AttributeError):
        return 128, 128


_PACKED, _PACKED_SCALE, _PACKED_SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"


def packed_int_format(path: str | Path) -> tuple[int, int] | None:
    """(bits, group size) of a compressed-tensors "pack-quantized" checkpoint (Kimi-K2-Thinking's and Kimi-K2.5's
    int4 releases: symmetric integers of `num_bits` packed into int32 words, a scale per `group_size` inputs of each
    row), None for any other checkpoint; a form this reader does not dequantize (asymmetric, another strategy or
    width) is refused in one line."""
    q = _quantization_config(path)
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
        return None
    groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    forms = {(w.get("num_bits"), w.get("group_size"), w.get("symmetric", True), w.get("strategy", "group"),
              w.get("type", "int")) for w in groups}
    if len(forms) != 1:
        raise ValueError(f"{path}: a pack-quantized checkpoint with {len(forms)} weight formats (this reader takes "
                         f"one)")
    bits, group, symmetric, strategy, kind = forms.pop()
    if kind != "int" or strategy != "group" or not symmetric or bits not in (4, 8) or not isinstance(group, int) \
            or group <= 0:
        raise ValueError(f"{path}: pack-quantized weights of {bits}-bit {kind}, strategy {strategy!r}, symmetric "
                         f"{symmetric}, group {group} are not read (only symmetric 4- or 8-bit integers by group)")
    return bits, group


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Signed integers [..., columns] from int32 words [..., ⌈columns·bits/32⌉]: 32/bits values a word, the first in
    its lowest bits, each stored as value + 2^(bits − 1) (so 4-bit codes 0..15 are −8..7)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # the arithmetic shift's sign bits masked
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)[..., :columns]
    return (codes - (1 << (bits - 1))).to(torch.int8)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, bits: int, group: int, columns: int
                      ) -> torch.Tensor:
    """A pack-quantized weight [..., O, I] in bf16: each integer times its group's scale (scale [..., O, ⌈I/group⌉])."""
    q = unpack_int32(packed, bits, columns).float()
    s = scale.float().repeat_interleave(group, dim=-1)[..., :columns]
    return (q * s).to(torch.bfloat16)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An fp8 weight [..., O, I] times its scales [..., ⌈O/bo⌉, ⌈I/bi⌉] (each covering one bo × bi block; the
    leading dimensions a stacked tensor's, Step-3.7's experts), in bf16 (the product of a 4-bit significand and an
    fp32 scale, rounded once; bf16 halves what a layer's read holds in host memory, DeepSeek-V3's MoE layer 23 GB
    instead of 45)."""
    bo, bi = block
    o, i = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(bo, -2)[..., :o, :].repeat_interleave(bi, -1)[..., :i]
    return (w.float() * s).to(torch.bfloat16)


# the 16 values of an e2m1 fp4 code (sign bit, 2 exponent bits, 1 mantissa bit), by code
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"  # an MXFP4 tensor's codes and scales (gpt-oss's release)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes [E, R, G, 16] (uint8: two e2m1 values a byte, the low nibble first, so 32 values a row of 16
    bytes) and scales [E, R, G] (uint8 e8m0: 2^(s − 127) for each of those runs of 32) → bf16 [E, G·32, R], the
    layout of the tensor the release quantized (transformers' gpt-oss parameter: input dimension first), as a
    transposed view. Each value is an fp4 value times a power of two, exact in fp32 and rounded once to bf16 (only
    where it falls below bf16's normal range); one expert at a time, so the integer temporaries stay an expert's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} must be uint8 [..., R, G, 16] and [..., R, G]")
    *lead, R, G, _ = blocks.shape
    codes, exps = blocks.reshape(-1, R, G, 16), scales.reshape(-1, R, G)
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(codes.shape[0], R, G * 32, dtype=torch.bfloat16, device=blocks.device)
    for e in range(codes.shape[0]):
        c = codes[e].long()
        values = torch.stack([lut[c & 0x0F], lut[c >> 4]], dim=-1).view(R, G, 32)  # low nibble first
        out[e] = torch.ldexp(values, exps[e].int()[..., None] - 127).view(R, G * 32).to(torch.bfloat16)
    return out.view(*lead, R, G * 32).transpose(-1, -2)


def _dequantized(raw: dict[str, torch.Tensor], block: tuple[int, int], packed: tuple[int, int] | None = None
                 ) -> dict[str, torch.Tensor]:
    """`raw` with every block-quantized fp8 weight, every MXFP4 tensor and (with `packed`: bits, group size) every
    pack-quantized integer weight replaced by its bf16 value and its scales dropped (on the meta device: the
    shape)."""
    out = {}
    for key, t in raw.items():
        if key.endswith(_SCALE) or (key.endswith(_SCALES) and key[:-len(_SCALES)] + _BLOCKS in raw):
            continue
        if packed is not None and key.endswith((_PACKED_SCALE, _PACKED_SHAPE)) \
                and key.rsplit(".", 1)[0] + _PACKED in raw:
            continue
        if packed is not None and key.endswith(_PACKED):
            base = key[:-len(_PACKED)]
            bits, group = packed
            scale, shape = raw.get(base + _PACKED_SCALE), raw.get(base + _PACKED_SHAPE)
            if scale is None:
                raise ValueError(f"{key}: packed integers without their {_PACKED_SCALE[1:]}")
            columns = t.shape[-1] * (32 // bits)
            if shape is not None and not shape.is_meta:
                columns = int(shape.reshape(-1)[-1])
            out[base + ".weight"] = (torch.empty(*t.shape[:-1], columns, dtype=torch.bfloat16, device="meta")
                                     if t.is_meta else dequantize_packed(t, scale, bits, group, columns))
            continue
        if key.endswith(_BLOCKS):
            base = key[:-len(_BLOCKS)]
            scales = raw.get(base + _SCALES)
            if scales is None:
                raise ValueError(f"{key}: MXFP4 blocks without their {base.rsplit('.', 1)[-1]}{_SCALES}")
            if t.is_meta:
                *lead, R, G, _ = t.shape
                out[base] = torch.empty(*lead, R, G * 32, dtype=torch.bfloat16, device="meta").transpose(-1, -2)
            else:
                out[base] = dequantize_mxfp4(t, scales)
            continue
        scale = raw.get(key + "_scale_inv")  # `x.weight` → `x.weight_scale_inv`
        if scale is not None:
            t = (torch.empty(t.shape, dtype=torch.bfloat16, device="meta") if t.is_meta
                 else dequantize_fp8(t, scale, block))
        elif t.dtype in _FP8:
            raise ValueError(f"{key}: an fp8 tensor without its {_SCALE[1:]} (only block-quantized fp8 is read)")
        out[key] = t
    return out


def _tensor_groups(path: str | Path, meta: bool):
    """The checkpoint's tensors that the text model reads, one decoder layer at a time and then the rest (so a
    layer's per-expert tensors are stacked together), read lazily; `meta`: their shapes and dtypes only, as meta
    tensors, with nothing read."""
    from safetensors import safe_open

    groups: dict[int, list] = {}
    for f in safetensors_files(path):
        h = safe_open(str(f), framework="pt")
        for key in h.keys():
            if _SKIP.match(key):
                continue
            hit = _LAYER.match(_strip(key))
            groups.setdefault(int(hit.group(1)) if hit else -1, []).append((h, key))
    for g in sorted(groups, key=lambda i: (i < 0, i)):
        if meta:
            out = {}
            for h, key in groups[g]:
                sl = h.get_slice(key)
                out[key] = torch.empty(sl.get_shape(), dtype=_SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.float32),
                                       device="meta")
            yield out
        else:
            yield {key: h.get_tensor(key) for h, key in groups[g]}


def _deinterleave_qwen3_next(sd: dict[str, torch.Tensor], prefix: str, m: GatedDeltaNet) -> None:
    """in_proj_qkvz rows are grouped per key head: [q (Kd) | k (Kd) | v (r·Vd) | z (r·Vd)] × G; in_proj_ba rows
    [b (r) | a (r)] × G. Regroup into [all q | all k | all v], z, b, a."""
    g, r = m.num_k_heads, m.num_v_heads // m.num_k_heads
    kd, vd = m.head_k_dim, m.head_v_dim
    w = sd.pop(prefix + "in_proj_qkvz.weight").view(g, 2 * kd + 2 * r * vd, -1)
    q, k, v, z = torch.split(w, [kd, kd, r * vd, r * vd], dim=1)
    sd[prefix + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v)])
    sd[prefix + "in_proj_z.weight"] = z.reshape(-1, w.shape[-1])
    ba = sd.pop(prefix + "in_proj_ba.weight").view(g, 2 * r, -1)
    b, a = ba.split([r, r], dim=1)
    sd[prefix + "in_proj_b.weight"] = b.reshape(-1, ba.shape[-1])
    sd[prefix + "in_proj_a.weight"] = a.reshape(-1, ba.shape[-1])


def _interleave_qwen3_next(sd: dict[str, torch.Tensor], prefix: str, m: GatedDeltaNet) -> None:
    g, r = m.num_k_heads, m.num_v_heads // m.num_k_heads
    kd, vd = m.head_k_dim, m.head_v_dim
    qkv = sd.pop(prefix + "in_proj_qkv.weight")
    d = qkv.shape[-1]
    q, k, v = torch.split(qkv, [g * kd, g * kd, g * r * vd])
    z = sd.pop(prefix + "in_proj_z.weight")
    parts = [x.view(g, -1, d) for x in (q, k, v, z)]
    sd[prefix + "in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, d)
    b, a = sd.pop(prefix + "in_proj_b.weight"), sd.pop(prefix + "in_proj_a.weight")
    sd[prefix + "in_proj_ba.weight"] = torch.cat([b.view(g, r, d), a.view(g, r, d)], dim=1).reshape(-1, d)


def gdn_grouped_order(m: GatedDeltaNet) -> torch.Tensor:
    """Row index into Hugging Face's [all q | all k | all v] giving our per-key-head order [q_g | k_g | v_g] × G."""
    g, r = m.num_k_heads, m.num_v_heads // m.num_k_heads
    kd, vdr = m.head_k_dim, r * m.head_v_dim
    return torch.cat([torch.cat([torch.arange(i * kd, (i + 1) * kd), torch.arange((g + i) * kd, (g + i + 1) * kd),
                                 torch.arange(2 * g * kd + i * vdr, 2 * g * kd + (i + 1) * vdr)]) for i in range(g)])


def _regroup_gdn(sd: dict[str, torch.Tensor], prefix: str, m: GatedDeltaNet, to_ours: bool) -> None:
    order = gdn_grouped_order(m)
    if not to_ours:
        order = torch.argsort(order)
    for key in ("in_proj_qkv.weight", "conv1d.weight"):
        if prefix + key in sd:
            sd[prefix + key] = sd[prefix + key][order.to(sd[prefix + key].device)]


def _gpt_oss_experts_to_ours(name: str, t: torch.Tensor) -> torch.Tensor:
    """A gpt-oss fused expert tensor in our layout: gate_up_proj [E, D, 2I] → [E, 2I, D] and its bias [E, 2I], their
    interleaved gate/up columns (gate the even ones) regrouped [gate | up]; down_proj [E, I, D] → [E, D, I]."""
    if name.startswith("gate_up_proj"):
        t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    return t if name.endswith("_bias") else t.transpose(1, 2)


def _gpt_oss_experts_to_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of `_gpt_oss_experts_to_ours`."""
    if not name.endswith("_bias"):
        t = t.transpose(1, 2)
    if name.startswith("gate_up_proj"):
        gate, up = t.chunk(2, dim=-1)
        t = torch.stack([gate, up], dim=-1).flatten(-2)  # columns gate_0, up_0, gate_1, up_1, …
    return t


def hf_to_ours(raw: dict[str, torch.Tensor], model: Transformer) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    gpt_oss, llama4, granite = (model.shape.arch == a for a in ("gpt_oss", "llama4", "granitemoe"))
    vl_moe = model.shape.hf_model_type in ("qwen3_vl_moe", "qwen3_omni_moe")
    names = _names_in(model.shape)
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    mtp = range(model.shape.num_layers, model.shape.num_layers + model.shape.mtp_layers)
    for key, t in raw.items():
        if _SKIP.match(key):
            continue
        key = _strip(key)
        layer = _LAYER.match(key)
        if layer and int(layer.group(1)) in mtp:  # DeepSeek-V3's and GLM-4.5's MTP layers follow the stack
            continue
        key = _SHARED_EXPERTS.sub(r"\1.shared_expert.", _MIXTRAL_BLOCK.sub(r"\1.mlp.", key))
        if _ERNIE_BIAS.match(key):
            key, t = _ERNIE_BIAS.sub(r"\1.gate.e_score_correction_bias", key), t.reshape(-1)
        key = _BLOCK_BIAS.sub(r"\1.gate.e_score_correction_bias", key)
        if llama4:
            key = _FEED_FORWARD.sub(r"\1.mlp.", key)
        for theirs, ours in names:
            key = key.replace(theirs, ours)
        if granite and (parts := _LAYER_REST.match(key)):
            layer, rest = parts.groups()
            if rest == "shared_mlp.input_linear.weight":  # [gate | up] rows of the shared expert
                gate, up = t.chunk(2, dim=0)
                sd[f"{layer}.mlp.shared_expert.gate_proj.weight"] = gate
                sd[f"{layer}.mlp.shared_expert.up_proj.weight"] = up
                continue
            key = f"{layer}.{_GRANITE_IN.get(rest, rest)}"
        if gpt_oss or llama4:
            key = _ROUTER.sub(r"\1.gate.", key)
            fused = _FUSED_EXPERT.match(key)
            if fused:
                t = _gpt_oss_experts_to_ours(fused.group(1), t) if gpt_oss else t.transpose(1, 2)
        elif vl_moe and (fused := _FUSED_EXPERT.match(key)):
            # Qwen3-VL-MoE's releases keep the input dimension first (gate_up_proj [E, D, 2I], down_proj [E, I, D]);
            # what transformers itself saves keeps ours: told apart by the rows, as transformers does
            rows = 2 * model.shape.expert_ffn if fused.group(1) == "gate_up_proj" else model.shape.hidden_size
            if t.dim() == 3 and t.shape[1] != rows:
                t = t.transpose(1, 2)
        w = _MIXTRAL_EXPERT.match(key)
        if w:
            key = f"{w.group(1)}.{_MIXTRAL_W[w.group(2)]}.weight"
        hit = _EXPERT.match(key)
        if hit:
            per_expert.setdefault(hit.group(1), {}).setdefault(int(hit.group(2)), {})[hit.group(3)] = t
        else:
            sd[key] = t
    for prefix, experts in per_expert.items():
        num = len(experts)
        if sorted(experts) != list(range(num)) or any(len(v) != 3 for v in experts.values()):
            raise ValueError(f"{prefix}: incomplete per-expert tensors (experts {sorted(experts)[:8]}…)")
        sd[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(num)])
        sd[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(num)])
    for name, m in model.named_modules():
        if isinstance(m, GatedDeltaNet):
            if f"{name}.in_proj_qkvz.weight" in sd:
                _deinterleave_qwen3_next(sd, name + ".", m)
            _regroup_gdn(sd, name + ".", m, to_ours=True)
    if model.shape.hf_model_type == "afmoe":
        _fuse_output_gate(sd, model.shape.head_dim, to_ours=True)
    if model.shape.hf_model_type == "step3p5":
        _join_step_experts(sd)
    if model.shape.hf_model_type == "kimi_linear":
        _kimi_kda_to_ours(sd)
    _family_layout(sd, model.shape, to_ours=True)
    if model.shape.hf_model_type == "axk1":  # transformers keeps the MoE output norm in the block; ours (and the
        # releases') at the layer
        for key in [k for k in sd if ".mlp.post_mlp_layernorm." in k]:
            sd[key.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")] = sd.pop(key)
    return sd


def _kimi_kda_to_ours(sd: dict[str, torch.Tensor]) -> None:
    """KDA's tensors under our names, in place: A_log one value a head ([1, 1, H, 1] in the releases); from
    transformers' module tree also the forget gate's own level (`self_attn.forget_gate.f_a_proj` …) and the three
    convs as one (`self_attn.conv1d` [3·H·K, 1, W], channels [q | k | v])."""
    for key in [k for k in sd if ".self_attn.forget_gate." in k]:
        sd[key.replace(".forget_gate.", ".")] = sd.pop(key)
    for key in [k for k in sd if k.endswith(".self_attn.conv1d.weight")]:
        for part, t in zip("qkv", sd.pop(key).chunk(3, dim=0)):
            sd[key.replace(".conv1d.", f".{part}_conv1d.")] = t
    for key in [k for k in sd if k.endswith(".self_attn.A_log")]:
        sd[key] = sd[key].reshape(-1)


def _join_step_experts(sd: dict[str, torch.Tensor]) -> None:
    """Step-3.7's stacked gate_proj and up_proj [E, I, D] a MoE layer, as its releases hold them, into our
    gate_up_proj [E, 2I, D] (rows [gate | up] an expert), in place."""
    for layer in [hit.group(1) for k in sd if (hit := _STEP_EXPERTS.match(k)) and hit.group(2) == "gate_proj"]:
        up = sd.pop(f"{layer}.moe.up_proj.weight", None)
        if up is None:
            raise ValueError(f"{layer}.moe: gate_proj without up_proj in the checkpoint")
        sd[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([sd.pop(f"{layer}.moe.gate_proj.weight"), up], dim=1)


_GATE_PROJ = re.compile(r"^(.*self_attn)\.gate_proj\.weight$")


def _family_layout(sd: dict[str, torch.Tensor], shape: ModelShape, to_ours: bool) -> None:
    """The Gemma, Phi-3 and GLM-4 checkpoints' names and fused tensors under ours (`to_ours`) or back, in place."""
    if shape.hf_model_type in ("gemma4_text", "gemma3_text"):
        _gemma_names(sd, to_ours, moe=shape.arch != "dense")
    elif shape.hf_model_type == "phi3":
        _phi3_projections(sd, shape, to_ours)
    elif shape.hf_model_type == "glm4":
        _phi3_projections(sd, shape, to_ours, attention=False)
        _glm4_norm_names(sd, to_ours)


def _phi3_projections(sd: dict[str, torch.Tensor], shape: ModelShape, to_ours: bool, attention: bool = True) -> None:
    """Phi-3's fused projections, in place: `self_attn.qkv_proj` [q | k | v] rows and `mlp.gate_up_proj` [gate | up]
    rows split into ours (q_proj, k_proj, v_proj; gate_proj, up_proj), or joined back (GLM-4's: the MLP's alone,
    `attention` False)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if to_ours:
        for key in [k for k in sd if k.endswith("self_attn.qkv_proj.weight")]:
            base = key[: -len("qkv_proj.weight")]
            for name, t in zip(("q_proj", "k_proj", "v_proj"), sd.pop(key).split([q, kv, kv])):
                sd[f"{base}{name}.weight"] = t
        for key in [k for k in sd if k.endswith("mlp.gate_up_proj.weight")]:
            base = key[: -len("gate_up_proj.weight")]
            sd[f"{base}gate_proj.weight"], sd[f"{base}up_proj.weight"] = sd.pop(key).chunk(2)
        return
    for key in [k for k in sd if k.endswith("self_attn.q_proj.weight") and attention]:
        base = key[: -len("q_proj.weight")]
        sd[f"{base}qkv_proj.weight"] = torch.cat([sd.pop(f"{base}{n}_proj.weight") for n in "qkv"])
    for key in [k for k in sd if k.endswith("mlp.gate_proj.weight")]:
        base = key[: -len("gate_proj.weight")]
        sd[f"{base}gate_up_proj.weight"] = torch.cat([sd.pop(key), sd.pop(f"{base}up_proj.weight")])


# GLM-4's sandwich norms (its names on the left, ours on the right): after the attention, before and after the MLP
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
               "post_mlp_layernorm": "post_mlp_layernorm"}
_NORM_KEY = re.compile(r"^(layers\.\d+)\.(\w+_layernorm)\.(.*)$")


def _glm4_norm_names(sd: dict[str, torch.Tensor], to_ours: bool) -> None:
    """GLM-4's block norms under our names (`to_ours`) or back, in place, each key renamed once (its
    `post_attention_layernorm` is our `pre_mlp_layernorm`, ours its `post_self_attn_layernorm`)."""
    names = _GLM4_NORMS if to_ours else {v: k for k, v in _GLM4_NORMS.items()}
    for key in list(sd):
        if (hit := _NORM_KEY.match(key)) and hit.group(2) in names:
            sd[f"{hit.group(1)}.{names[hit.group(2)]}.{hit.group(3)}"] = sd.pop(key)


def _fuse_output_gate(sd: dict[str, torch.Tensor], head_dim: int, to_ours: bool) -> None:
    """AFMoE's attention output gate: its own projection in its checkpoints (`self_attn.gate_proj` [heads · d, h]),
    ours the second half of each head's rows of q_proj ([q_h | gate_h] a head, Qwen3.5's layout), in place."""
    if to_ours:
        for key in [k for k in sd if _GATE_PROJ.match(k)]:
            q_key = _GATE_PROJ.match(key).group(1) + ".q_proj.weight"
            g, q = sd.pop(key), sd[q_key]
            h = q.shape[-1]
            sd[q_key] = torch.stack([q.reshape(-1, head_dim, h), g.reshape(-1, head_dim, h)], dim=1).reshape(-1, h)
        return
    for key in [k for k in sd if k.endswith("self_attn.q_proj.weight")]:
        h = sd[key].shape[-1]
        both = sd[key].reshape(-1, 2, head_dim, h)
        sd[key], sd[key[: -len("q_proj.weight")] + "gate_proj.weight"] = (
            both[:, 0].reshape(-1, h), both[:, 1].reshape(-1, h))


def load_hf_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Copy a Hugging Face checkpoint into `model` (any dtype/device; values are cast): a whole Transformer, or what
    `parallelize` made of one — each rank keeps its shard of every tensor it holds (launch.model.assign_full).

    Checked first, reading nothing: the checkpoint's names and shapes, converted on the meta device against a copy
    of the whole model there; a mismatch raises ValueError naming the missing, unexpected or mis-shaped tensors and
    leaves `model` untouched. Then read and converted one decoder layer at a time, so a rank's host memory holds
    one layer of the checkpoint, not the model."""
    with torch.device("meta"):
        whole = Transformer(model.shape)
    ours = whole.state_dict()
    if model.shape.tie_embeddings:
        ours.pop("lm_head.weight", None)

    block, packed = fp8_block_size(path), packed_int_format(path)

    def converted(meta: bool):
        for raw in _tensor_groups(path, meta):
            sd = hf_to_ours(_dequantized(raw, block, packed), whole)
            if model.shape.tie_embeddings:
                sd.pop("lm_head.weight", None)
            yield sd

    found: dict[str, torch.Size] = {}
    for sd in converted(meta=True):
        found.update({k: t.shape for k, t in sd.items()})
    missing = sorted(set(ours) - set(found))
    unexpected = sorted(set(found) - set(ours))
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint {path} does not match model {model.shape.name}: "
                         f"missing {missing[:6]}{'…' if len(missing) > 6 else ''}, "
                         f"unexpected {unexpected[:6]}{'…' if len(unexpected) > 6 else ''}")
    bad = [f"{k}: checkpoint {tuple(found[k])} vs model {tuple(v.shape)}"
           for k, v in ours.items() if k in found and found[k] != v.shape]
    if bad:
        raise ValueError(f"checkpoint {path} shape mismatch: " + "; ".join(bad[:6]))
    params = {whole_model_name(n): p for n, p in [*model.named_parameters(), *model.named_buffers()]}
    with torch.no_grad():
        for sd in converted(meta=False):
            for k, t in sd.items():
                if k in params:
                    assign_full(params[k], t.to(device=params[k].device))


def hf_config(shape: ModelShape) -> dict:
    """A transformers config.json for `shape` (text model)."""
    cfg = dict(
        hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers, vocab_size=shape.vocab_size,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_embeddings, hidden_act="silu",
        max_position_embeddings=shape.max_position, num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.expert_ffn, attention_bias=shape.attn_bias,
        rope_parameters=_rope_parameters(shape),
    )
    if shape.pad_token_id is not None:  # the embedding row transformers never updates
        cfg["pad_token_id"] = shape.pad_token_id
    if shape.hf_model_type == "gemma4_text":
        return _gemma4_config(shape, cfg)
    if shape.hf_model_type == "gemma3_text":
        return _gemma3_config(shape, cfg)
    if shape.arch == "dense":  # Llama-family: Qwen3 has q/k norms, Qwen2 q/k/v biases, Llama neither
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            cfg.pop(k)
        if shape.hf_model_type in _DENSE_FAMILIES:  # the dense families transformers builds under their own types
            architecture, dropped, fields = _DENSE_FAMILIES[shape.hf_model_type](shape)
            for k in dropped:
                cfg.pop(k)
            return cfg | {"model_type": shape.hf_model_type, "architectures": [architecture],
                          "intermediate_size": shape.dense_ffn, "rope_theta": shape.rope_theta} | fields
        # Llama's blocks with a sliding window: Mistral's type where every layer slides, Ministral's (its
        # layer_types) where some do
        sliding = shape.num_sliding_layers > 0
        windowed = "mistral" if shape.num_sliding_layers == shape.num_layers else "ministral"
        model_type = "qwen3" if shape.qk_norm else "qwen2" if shape.attn_bias else windowed if sliding else "llama"
        arch_name = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                     "mistral": "MistralForCausalLM", "ministral": "MinistralForCausalLM"}
        cfg.update(model_type=model_type, architectures=[arch_name[model_type]], intermediate_size=shape.dense_ffn,
                   rope_theta=shape.rope_theta, layer_types=list(shape.layer_types))
        if sliding:  # Qwen2/Qwen3 and Ministral slide the layers their layer_types name
            cfg.update(sliding_window=shape.sliding_window, use_sliding_window=True)
        if model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        return cfg
    if shape.hf_model_type == "cohere2_moe":  # Cohere2-MoE: its norms, logit scale, shared experts, layer types
        layer_norm = shape.norm_kind == "layer"
        cfg.update(model_type="cohere2_moe", architectures=["Cohere2MoeForCausalLM"],
                   intermediate_size=shape.expert_ffn,
                   num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn, logit_scale=shape.logit_scale,
                   shared_expert_combination_strategy="average" if shape.shared_expert_mean else "sum",
                   expert_selection_fn="sigmoid" if shape.sigmoid_top else "softmax",
                   norm_topk_prob=shape.norm_topk_prob, layer_types=list(shape.layer_types),
                   mlp_layer_types=["dense" if shape.is_dense_layer(i) else "sparse" for i in range(shape.num_layers)],
                   prefix_dense_intermediate_size=shape.dense_ffn or None,
                   prefix_dense_sliding_window_pattern=1 if shape.rotated_prefix or not shape.first_dense_layers else 2,
                   sliding_window=shape.sliding_window,
                   rms_norm_eps=None if layer_norm else shape.rms_norm_eps,
                   layer_norm_eps=shape.rms_norm_eps if layer_norm else 1e-5, rope_theta=shape.rope_theta)
        cfg.pop("moe_intermediate_size")
        return cfg
    if shape.arch == "qwen3_moe" and shape.hf_model_type == "mellum":  # Mellum: its layer and MLP types, RoPE by type
        cfg.update(model_type="mellum", architectures=["MellumForCausalLM"], norm_topk_prob=shape.norm_topk_prob,
                   intermediate_size=shape.dense_ffn or shape.expert_ffn, layer_types=list(shape.layer_types),
                   mlp_layer_types=_mlp_layer_types(shape), sliding_window=shape.sliding_window,
                   rope_parameters=_rope_by_layer_type(shape))
        return cfg
    if shape.arch == "qwen3_moe":
        cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=shape.norm_topk_prob,
                   intermediate_size=shape.expert_ffn, layer_types=list(shape.layer_types))
        return cfg
    if shape.arch == "ernie4_5_moe":
        for k in ("num_experts", "num_experts_per_tok", "attention_bias"):
            cfg.pop(k)
        cfg.update(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"], moe_num_experts=shape.num_experts,
                   moe_k=shape.top_k, moe_num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn,
                   moe_layer_start_index=shape.first_dense_layers, moe_layer_end_index=shape.num_layers - 1,
                   moe_layer_interval=1, intermediate_size=shape.dense_ffn or shape.expert_ffn, use_bias=False)
        return cfg
    if shape.arch == "olmoe":
        cfg.update(model_type="olmoe", architectures=["OlmoeForCausalLM"], norm_topk_prob=shape.norm_topk_prob,
                   intermediate_size=shape.expert_ffn, clip_qkv=shape.clip_qkv, layer_types=list(shape.layer_types))
        if shape.hf_model_type == "flex_olmo":  # FlexOlmo: OLMoE's blocks, OLMo-2's norms after each sublayer
            cfg.update(model_type="flex_olmo", architectures=["FlexOlmoForCausalLM"])
            cfg.pop("clip_qkv")
        return cfg
    if shape.arch == "qwen2_moe":
        cfg.pop("attention_bias")
        cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], norm_topk_prob=shape.norm_topk_prob,
                   qkv_bias=shape.attn_bias, shared_expert_intermediate_size=shape.shared_expert_ffn,
                   intermediate_size=shape.dense_ffn or shape.shared_expert_ffn or shape.expert_ffn,
                   decoder_sparse_step=shape.moe_layer_step,
                   mlp_only_layers=[], use_sliding_window=False, layer_types=list(shape.layer_types))
        return cfg
    if shape.arch in _PLURAL_SHARED_ARCHS:  # DeepSeek-V3, GLM-4.5: sigmoid routing, shared experts, dense first layers
        r = shape.sigmoid_router or shape.softmax_router  # the latter: DeepSeek-V2
        cfg.pop("num_experts")
        cfg.update(n_routed_experts=shape.num_experts, n_shared_experts=shape.shared_expert_ffn // shape.expert_ffn,
                   n_group=r.groups, topk_group=r.topk_groups, routed_scaling_factor=r.scaling,
                   norm_topk_prob=shape.norm_topk_prob, first_k_dense_replace=shape.first_dense_layers,
                   intermediate_size=shape.dense_ffn or shape.expert_ffn, num_mtp_layers=0)
        if shape.hf_model_type == "kimi_linear":
            return _kimi_linear_config(shape, cfg)
        if shape.hf_model_type == "mistral4":  # DeepSeek-V3's MLA and experts, a softmax router, the query scale
            a = shape.mla
            # transformers rotates head_dim · partial_rotary_factor channels, head_dim forced to Dn + Dr
            rope = _rope_parameters(shape) | {
                "partial_rotary_factor": a.qk_rope_head_dim / (a.qk_nope_head_dim + a.qk_rope_head_dim)}
            if shape.query_scale_period:
                rope.update(llama_4_scaling_beta=shape.query_scale_beta,
                            original_max_position_embeddings=shape.query_scale_period)
            cfg.update(model_type="mistral4", architectures=["Mistral4ForCausalLM"], rope_interleave=True,
                       q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
                       qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                       v_head_dim=a.v_head_dim, head_dim=a.qk_nope_head_dim + a.qk_rope_head_dim,
                       rope_parameters=rope)
            cfg.pop("num_mtp_layers")
            return cfg
        if shape.hf_model_type == "dots1":  # dots.llm1: GLM-4.5's blocks, per-head q/k norms, full RoPE
            cfg.update(model_type="dots1", architectures=["Dots1ForCausalLM"], layer_types=list(shape.layer_types))
        elif shape.hf_model_type == "mimo_v2_flash":  # MiMo-V2-Flash: its attention's fields and RoPE by layer type
            cfg.update(model_type="mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"],
                       v_head_dim=shape.value_width, attention_value_scale=shape.value_scale,
                       sliding_window=shape.sliding_window, layer_types=list(shape.layer_types),
                       mlp_layer_types=_mlp_layer_types(shape), rope_parameters=_rope_by_layer_type(shape))
            for k in ("first_k_dense_replace", "n_shared_experts", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.hf_model_type == "hy_v3":  # Hunyuan-V3: its own names for the shared experts' count and scaling
            cfg.update(model_type="hy_v3", architectures=["HYV3ForCausalLM"], num_experts=shape.num_experts,
                       num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn, router_scaling_factor=r.scaling,
                       mlp_layer_types=_mlp_layer_types(shape),
                       intermediate_size=shape.dense_ffn or shape.expert_ffn, output_router_logits=False)
            for k in ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "first_k_dense_replace", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.hf_model_type == "afmoe":  # AFMoE: its own names for the counts and the scale, its layer types
            cfg.update(model_type="afmoe", architectures=["AfmoeForCausalLM"], num_experts=shape.num_experts,
                       num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn, route_scale=r.scaling,
                       num_dense_layers=shape.first_dense_layers, intermediate_size=shape.dense_ffn or shape.expert_ffn,
                       layer_types=list(shape.layer_types), sliding_window=shape.sliding_window,
                       mup_enabled=shape.embedding_scale != 1.0, output_router_logits=False)
            for k in ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "first_k_dense_replace", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.hf_model_type == "exaone_moe":  # K-EXAONE: its own names for the counts, its layer types
            cfg.update(model_type="exaone_moe", architectures=["ExaoneMoeForCausalLM"], num_experts=shape.num_experts,
                       num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn,
                       mlp_layer_types=_mlp_layer_types(shape),
                       layer_types=list(shape.layer_types), sliding_window=shape.sliding_window)
            for k in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "num_mtp_layers",
                      "attention_bias"):
                cfg.pop(k)
        elif shape.hf_model_type == "solar_open":  # Solar Open: GLM-4.5's MoE, Llama's attention, every layer MoE
            cfg.update(model_type="solar_open", architectures=["SolarOpenForCausalLM"],
                       partial_rotary_factor=shape.partial_rotary_factor)
            for k in ("first_k_dense_replace", "intermediate_size", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.hf_model_type == "step3p5":  # Step-3.7's text model, in transformers' field names
            cfg.update(model_type="step3p5", architectures=["Step3p5ForCausalLM"], n_routed_experts=shape.num_experts,
                       share_expert_dim=shape.shared_expert_ffn, moe_router_scaling_factor=r.scaling,
                       mlp_layer_types=_mlp_layer_types(shape),
                       intermediate_size=shape.dense_ffn or shape.expert_ffn, layer_types=list(shape.layer_types),
                       sliding_window=shape.sliding_window,
                       num_sliding_attention_heads=shape.heads_at("sliding_attention"),
                       query_pre_attn_scalar=shape.query_pre_attn_scalar or shape.head_dim,
                       swiglu_limits=list(shape.swiglu_limits) or None,
                       swiglu_limits_shared=list(shape.swiglu_limits_shared) or None,
                       rope_parameters=_rope_by_layer_type(shape))
            for k in ("n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
                      "norm_topk_prob", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.hf_model_type == "laguna":  # Laguna: its own names for the experts, heads by layer, RoPE by type
            cfg.update(model_type="laguna", architectures=["LagunaForCausalLM"], num_experts=shape.num_experts,
                       shared_expert_intermediate_size=shape.shared_expert_ffn, moe_routed_scaling_factor=r.scaling,
                       mlp_layer_types=_mlp_layer_types(shape),
                       intermediate_size=shape.dense_ffn or shape.expert_ffn, layer_types=list(shape.layer_types),
                       sliding_window=shape.sliding_window, gating="per-head",
                       num_attention_heads_per_layer=[shape.heads_at(k) for k in shape.layer_types],
                       rope_parameters=_rope_by_layer_type(shape))
            for k in ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "first_k_dense_replace", "norm_topk_prob", "num_mtp_layers"):
                cfg.pop(k)
        elif shape.arch == "glm4_moe":
            cfg.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], use_qk_norm=shape.qk_norm,
                       partial_rotary_factor=shape.partial_rotary_factor)
        else:
            a = shape.mla
            cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True,
                       q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
                       qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                       v_head_dim=a.v_head_dim, head_dim=a.qk_rope_head_dim)
            if shape.hf_model_type == "axk1":  # A.X K1: DeepSeek-V3's config under its own type
                cfg.update(model_type="axk1", architectures=["AXK1ForCausalLM"])
                cfg.pop("num_mtp_layers")
            if shape.hf_model_type == "glm4_moe_lite":  # GLM-4.7-Flash: its dense layers by type, not by count
                cfg.update(model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"],
                           mlp_layer_types=_mlp_layer_types(shape))
                for k in ("first_k_dense_replace", "num_mtp_layers"):
                    cfg.pop(k)
            if shape.dsa is not None:  # DeepSeek-V3.2, GLM-5: the indexer's fields, every layer sparse
                d = shape.dsa
                cfg.update(model_type=shape.hf_model_type, index_topk=d.topk, index_n_heads=d.index_heads,
                           index_head_dim=d.index_head_dim,
                           mlp_layer_types=_mlp_layer_types(shape),
                           layer_types=["deepseek_sparse_attention"] * shape.num_layers,
                           architectures=[{"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                                           "axk2": "AXK2ForCausalLM"}[shape.hf_model_type]])
                if shape.hf_model_type == "axk2":  # A.X K2: its gated norms' rank, its router ungrouped as null
                    cfg.update(gated_norm_rank=shape.gated_norm_rank, n_group=r.groups if r.groups > 1 else None,
                               topk_group=r.topk_groups if r.groups > 1 else None)
                    cfg.pop("first_k_dense_replace")
                for k in ("num_mtp_layers", "rope_interleave"):
                    cfg.pop(k)
                if shape.hf_model_type == "glm_moe_dsa":
                    cfg["indexer_types"] = ["shared" if i in d.shared_layers else "full"
                                            for i in range(shape.num_layers)]
            if shape.softmax_router is not None:  # DeepSeek-V2: softmax routing, no correction bias
                cfg.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], scoring_func="softmax",
                           topk_method="group_limited_greedy" if r.groups > 1 else "greedy")
                cfg.pop("rope_interleave")
        return cfg
    if shape.arch == "gpt_oss":
        for k in ("num_experts", "moe_intermediate_size"):
            cfg.pop(k)
        cfg.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=shape.num_experts,
                   intermediate_size=shape.expert_ffn, sliding_window=shape.sliding_window,
                   layer_types=list(shape.layer_types), output_router_logits=False)
        return cfg
    if shape.arch == "hunyuan_moe":
        for k in ("num_experts_per_tok", "moe_intermediate_size"):
            cfg.pop(k)
        cfg.update(model_type="hunyuan_v1_moe", architectures=["HunYuanMoEV1ForCausalLM"], moe_topk=shape.top_k,
                   intermediate_size=shape.expert_ffn)
        return cfg
    if shape.arch == "granitemoe":
        for k in ("num_experts", "moe_intermediate_size"):
            cfg.pop(k)
        g, shared = shape.granite, shape.shared_expert_ffn
        cfg.update(model_type="granitemoeshared" if shared else "granitemoe",
                   architectures=["GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM"],
                   num_local_experts=shape.num_experts, intermediate_size=shape.expert_ffn,
                   embedding_multiplier=g.embedding, attention_multiplier=g.attention,
                   residual_multiplier=g.residual, logits_scaling=g.logits, output_router_logits=False)
        if shared:
            cfg["shared_intermediate_size"] = shared
        if shape.hf_model_type == "granitemoe_swa":  # its sinks, windows and RoPE base a layer (0: none)
            thetas = [shape.rope_theta_at(kind) if shape.rotated(i) else 0.0
                      for i, kind in enumerate(shape.layer_types)]
            cfg.update(model_type="granitemoe_swa", architectures=["GraniteMoeSWAForCausalLM"],
                       shared_intermediate_size=shared, layer_types=list(shape.layer_types),
                       sliding_window=shape.sliding_window, layer_rope_theta=thetas)
        return cfg
    if shape.arch == "llama4":
        for k in ("num_experts", "moe_intermediate_size"):
            cfg.pop(k)
        l4 = shape.llama4
        rope_layers = [int(t == "chunked_attention") for t in shape.layer_types]
        cfg.update(model_type="llama4_text", architectures=["Llama4ForCausalLM"], num_local_experts=shape.num_experts,
                   intermediate_size=shape.expert_ffn, intermediate_size_mlp=shape.dense_ffn or shape.expert_ffn,
                   interleave_moe_layer_step=shape.moe_layer_step,
                   moe_layers=[i for i in range(shape.num_layers) if not shape.is_dense_layer(i)],
                   no_rope_layers=rope_layers, layer_types=list(shape.layer_types),
                   attention_chunk_size=shape.attention_chunk, use_qk_norm=l4.qk_norm,
                   attn_temperature_tuning=l4.temperature_tuning, floor_scale=l4.floor_scale,
                   attn_scale=l4.attn_scale, router_aux_loss_coef=0.0, output_router_logits=False)
        return cfg
    if shape.arch == "minimax_m2":
        for k in ("num_experts", "moe_intermediate_size", "attention_bias"):
            cfg.pop(k)
        cfg.update(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], num_local_experts=shape.num_experts,
                   intermediate_size=shape.expert_ffn, rotary_dim=round(shape.head_dim * shape.partial_rotary_factor),
                   use_qk_norm=shape.qk_norm, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                   shared_intermediate_size=0, use_mtp=False, router_jitter_noise=0.0, output_router_logits=False)
        return cfg
    if shape.arch == "mixtral":
        for k in ("num_experts", "moe_intermediate_size", "attention_bias"):
            cfg.pop(k)
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=shape.num_experts,
                   intermediate_size=shape.expert_ffn, sliding_window=shape.sliding_window,
                   router_jitter_noise=0.0, output_router_logits=False)
        return cfg
    la = shape.linear_attn
    cfg.update(
        layer_types=list(shape.layer_types), partial_rotary_factor=shape.partial_rotary_factor,
        shared_expert_intermediate_size=shape.shared_expert_ffn, linear_conv_kernel_dim=la.conv_kernel,
        linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
        linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
    )
    if shape.arch == "qwen3_next":
        cfg.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], norm_topk_prob=shape.norm_topk_prob,
                   intermediate_size=shape.shared_expert_ffn)
    elif shape.arch == "qwen3_5":
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            cfg.pop(k)
        cfg.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], intermediate_size=shape.dense_ffn)
    else:
        cfg.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    return cfg


def _kimi_linear_config(shape: ModelShape, cfg: dict) -> dict:
    """Kimi-Linear's config.json in its releases' field names (transformers reads the same): the KDA and MLA layers
    as 1-based lists under `linear_attn_config`, the MoE counts under their own names."""
    a, la, r = shape.mla, shape.linear_attn, shape.sigmoid_router
    layers = {kind: [i + 1 for i, t in enumerate(shape.layer_types) if t == kind]
              for kind in ("linear_attention", "full_attention")}
    for k in ("n_routed_experts", "n_shared_experts", "n_group", "num_experts_per_tok", "norm_topk_prob",
              "num_mtp_layers", "max_position_embeddings", "rope_parameters", "head_dim"):
        cfg.pop(k, None)
    cfg.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], num_experts=shape.num_experts,
               num_experts_per_token=shape.top_k, num_shared_experts=shape.shared_expert_ffn // shape.expert_ffn,
               moe_renormalize=shape.norm_topk_prob, num_expert_group=r.groups, topk_group=r.topk_groups,
               moe_router_activation_func="sigmoid", moe_layer_freq=1, model_max_length=shape.max_position,
               q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
               qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, mla_use_nope=True,
               rope_theta=shape.rope_theta, num_nextn_predict_layers=0,
               linear_attn_config={"kda_layers": layers["linear_attention"],
                                   "full_attn_layers": layers["full_attention"], "num_heads": la.num_k_heads,
                                   "head_dim": la.head_k_dim, "short_conv_kernel_size": la.conv_kernel})
    return cfg


def _layers_and_window(shape: ModelShape) -> dict:
    return {"layer_types": list(shape.layer_types), "sliding_window": shape.sliding_window}


# dense families' config.json beside Llama's fields: model_type → (its class, Llama's fields it drops, its own)
_DENSE_FAMILIES = {
    # Cohere2 dense: its LayerNorm's eps, logit scale and layer types
    "cohere2": lambda s: ("Cohere2ForCausalLM", ("rms_norm_eps",), {
        "logit_scale": s.logit_scale, "layer_norm_eps": s.rms_norm_eps, **_layers_and_window(s)}),
    "ernie4_5": lambda s: ("Ernie4_5ForCausalLM", ("attention_bias",), {"use_bias": False}),
    # GLM-4 (0414): its rotated share (its q/k/v biases are attention_bias)
    "glm4": lambda s: ("Glm4ForCausalLM", (), {"partial_rotary_factor": s.partial_rotary_factor}),
    # Phi-3 / Phi-4: its window over every layer where it has one
    "phi3": lambda s: ("Phi3ForCausalLM", (), {"sliding_window": s.sliding_window,
                                               "partial_rotary_factor": s.partial_rotary_factor}),
    # SmolLM3: its RoPE-free layers
    "smollm3": lambda s: ("SmolLM3ForCausalLM", (), {
        "no_rope_layers": [int(i not in s.nope_layers) for i in range(s.num_layers)], "use_sliding_window": False}),
    "exaone4": lambda s: ("Exaone4ForCausalLM", (), _layers_and_window(s)),
    # Granite 3.x dense: the four multipliers
    "granite": lambda s: ("GraniteForCausalLM", (), {
        "embedding_multiplier": s.granite.embedding, "attention_multiplier": s.granite.attention,
        "residual_multiplier": s.granite.residual, "logits_scaling": s.granite.logits}),
    "gemma": lambda s: ("GemmaForCausalLM", (), {"hidden_act": "gelu_pytorch_tanh"}),
    # OLMo 2 and 3: norms after the sublayers (no field); OLMo 3's layer types and RoPE by type
    "olmo2": lambda s: ("Olmo2ForCausalLM", (), {}),
    "olmo3": lambda s: ("Olmo3ForCausalLM", (), {**_layers_and_window(s), "rope_parameters": _rope_by_layer_type(s)}),
}


def _gemma3_config(shape: ModelShape, cfg: dict) -> dict:
    """Gemma 3's text config.json in transformers' field names (Gemma3TextConfig): RoPE by layer type (the full
    layers' with their scaling, the sliding layers' at their own base, unscaled)."""
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "hidden_act"):
        cfg.pop(k)
    cfg.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], intermediate_size=shape.dense_ffn,
               hidden_activation="gelu_pytorch_tanh",  # (transformers takes the scalar as a whole number)
               query_pre_attn_scalar=int(shape.query_pre_attn_scalar),
               sliding_window=shape.sliding_window, layer_types=list(shape.layer_types),
               final_logit_softcapping=shape.final_logit_softcap, attn_logit_softcapping=None,
               rope_parameters={"full_attention": {k: v for k, v in _rope_parameters(shape).items()
                                                   if k != "partial_rotary_factor"},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": shape.rope_theta_at("sliding_attention")}})
    return cfg


def _gemma4_config(shape: ModelShape, cfg: dict) -> dict:
    """Gemma 4's text config.json in transformers' field names (Gemma4TextConfig, the MoE block on or off): the sliding
    layers' head width and KV heads as `head_dim` and `num_key_value_heads`, the full layers' as `global_head_dim`
    and `num_global_key_value_heads`, RoPE by layer type (the full layers' proportional), no per-layer inputs."""
    for k in ("num_experts_per_tok", "hidden_act", "max_position_embeddings"):
        cfg.pop(k)
    if shape.arch == "dense":
        for k in ("num_experts", "moe_intermediate_size"):
            cfg.pop(k)
    full_rope = {"rope_type": "proportional" if shape.rope_proportional else "default",
                 "rope_theta": shape.rope_theta, "partial_rotary_factor": shape.partial_rotary_factor}
    moe = shape.arch != "dense"
    cfg.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], enable_moe_block=moe,
               top_k_experts=shape.top_k if moe else None,
               intermediate_size=shape.shared_expert_ffn if moe else shape.dense_ffn,
               head_dim=shape.head_dim_at("sliding_attention"), global_head_dim=shape.head_dim,
               num_key_value_heads=shape.kv_heads_at("sliding_attention"),
               num_global_key_value_heads=shape.num_kv_heads if shape.keys_as_values else None,
               attention_k_eq_v=shape.keys_as_values, layer_types=list(shape.layer_types),
               sliding_window=shape.sliding_window, hidden_activation="gelu_pytorch_tanh",
               final_logit_softcapping=shape.final_logit_softcap, hidden_size_per_layer_input=0,
               num_kv_shared_layers=0, max_position_embeddings=shape.max_position,
               rope_parameters={"full_attention": full_rope, "sliding_attention": {
                   "rope_type": "default", "rope_theta": shape.rope_theta_at("sliding_attention")}})
    return cfg


def _rope_by_layer_type(shape: ModelShape) -> dict:
    """`rope_parameters` by layer type (Step-3.7's, Laguna's, Mellum's, MiMo-V2-Flash's): the full layers' (with the
    scaling) and the sliding layers' base and rotated share, without the scaling where they rotate plain."""
    full = _rope_parameters(shape)
    return {"full_attention": full, "sliding_attention": {
        **({"rope_type": "default"} if shape.sliding_rope_plain else full),
        "rope_theta": shape.rope_theta_at("sliding_attention"),
        "partial_rotary_factor": shape.rotary_factor_at("sliding_attention")}}


def _mlp_layer_types(shape: ModelShape) -> list[str]:
    """`mlp_layer_types`: the dense layers first, then the sparse ones."""
    first = shape.first_dense_layers
    return ["dense"] * first + ["sparse"] * (shape.num_layers - first)


def _rope_parameters(shape: ModelShape) -> dict:
    out = {"rope_type": "default", "rope_theta": shape.rope_theta,
           "partial_rotary_factor": shape.partial_rotary_factor}
    sc = shape.rope_scaling
    if sc is not None:
        out["rope_type"] = sc.kind
        out.update({k: v for k, v in (
            ("factor", sc.factor), ("original_max_position_embeddings", sc.original_max_position or None),
            ("beta_fast", sc.beta_fast), ("beta_slow", sc.beta_slow), ("mscale", sc.mscale),
            ("mscale_all_dim", sc.mscale_all_dim), ("attention_factor", sc.attention_factor),
            ("low_freq_factor", sc.low_freq_factor), ("high_freq_factor", sc.high_freq_factor),
            ("alpha", sc.alpha)) if v is not None})
        if not sc.truncate:
            out["truncate"] = False
    return out


def ours_to_hf(model: Transformer, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our parameters (the model's own, or `state_dict`: the same names, e.g. full tensors gathered from shards) under
    transformers' names and layout."""
    sd = {k: v.detach() for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
    for name, m in model.named_modules():
        if isinstance(m, GatedDeltaNet):
            prefix = name.replace("_checkpoint_wrapped_module.", "") + "."
            _regroup_gdn(sd, prefix, m, to_ours=False)
            if model.shape.arch == "qwen3_next":
                _interleave_qwen3_next(sd, prefix, m)
    if model.shape.hf_model_type == "afmoe":
        _fuse_output_gate(sd, model.shape.head_dim, to_ours=False)
    _family_layout(sd, model.shape, to_ours=False)
    out: dict[str, torch.Tensor] = {}
    mixtral = model.shape.arch in ("mixtral", "minimax_m2")  # MiniMax-M2's releases keep Mixtral's names
    kimi = model.shape.hf_model_type == "kimi_linear"  # Kimi-Linear's: Mixtral's on its MoE layers
    ours = {v: k for k, v in _MIXTRAL_W.items()} if mixtral or kimi else {}
    name = lambda w: ours.get(w, w)  # noqa: E731 - an expert matrix's name in the checkpoint

    step = model.shape.hf_model_type == "step3p5"  # Step-3.7's names: `_names_out`; its experts stacked
    # Mistral 4's experts as transformers holds and saves them, fused (gate_up_proj [E, 2I, D], down_proj [E, D, I])
    fused_out = model.shape.hf_model_type == "mistral4"
    # Laguna's releases name its shared expert `shared_expert` (ours), as Step-3.7's do theirs `share_expert`
    plural = model.shape.arch in _PLURAL_SHARED_ARCHS and not step and model.shape.hf_model_type != "laguna"
    gpt_oss, ernie = model.shape.arch == "gpt_oss", model.shape.arch == "ernie4_5_moe"
    llama4, granite = model.shape.arch == "llama4", model.shape.arch == "granitemoe"
    bias_on_block = mixtral or model.shape.hf_model_type in ("hy_v3", "exaone_moe", "afmoe")

    def block(key: str) -> str:  # Mixtral's MoE block is `block_sparse_moe`; DeepSeek's shared expert plural
        if kimi and (hit := _LAYER.match(key)) and not model.shape.is_dense_layer(int(hit.group(1))):
            return _OUR_MOE_BLOCK.sub(r"\1.block_sparse_moe.", _OUR_SHARED_EXPERT.sub(r"\1.shared_experts.", key))
        if plural:
            return _OUR_SHARED_EXPERT.sub(r"\1.shared_experts.", key)
        return _OUR_MOE_BLOCK.sub(r"\1.block_sparse_moe.", key) if mixtral else key

    for key, t in sd.items():
        fused = _FUSED_EXPERT.match(key) if gpt_oss or llama4 else None
        parts = _LAYER_REST.match(key) if granite else None
        if parts:  # Granite's names: the fused experts whole, the shared expert's gate and up as one matrix
            layer, rest = parts.groups()
            if rest.startswith("mlp.shared_expert.") and rest.endswith(("gate_proj.weight", "up_proj.weight")):
                if rest.endswith("gate_proj.weight"):
                    up = sd[f"{layer}.mlp.shared_expert.up_proj.weight"]
                    out[f"model.{layer}.shared_mlp.input_linear.weight"] = torch.cat([t, up])
                continue
            names = _GRANITE_SWA_OUT if model.shape.hf_model_type == "granitemoe_swa" else _GRANITE_OUT
            out[f"model.{layer}.{names.get(rest, rest)}"] = t
        elif llama4:  # its own names and fused layout, input dimension first
            key = _OUR_FFN.sub(r"\1.feed_forward.", _OUR_ROUTER.sub(r"\1.router.", key))
            out[key if key == "lm_head.weight" else "model." + key] = t.transpose(1, 2) if fused else t
        elif fused:  # gpt-oss: its own fused layout
            out["model." + key] = _gpt_oss_experts_to_hf(fused.group(1), t)
        elif gpt_oss and _OUR_ROUTER.match(key):
            out["model." + _OUR_ROUTER.sub(r"\1.router.", key)] = t
        elif ernie and _OUR_BIAS.match(key):
            out["model." + _OUR_BIAS.sub(r"\1.moe_statics.e_score_correction_bias", key)] = t[None]
        elif bias_on_block and _OUR_BIAS.match(key):  # MiniMax-M2, Hunyuan-V3, K-EXAONE: on the block
            out["model." + block(key).replace(".gate.e_score_correction_bias", ".e_score_correction_bias")] = t
        elif step and key.endswith("mlp.experts.gate_up_proj"):  # stacked [E, I, D] a matrix
            layer = key[: -len(".mlp.experts.gate_up_proj")]
            out[f"model.{layer}.moe.gate_proj.weight"], out[f"model.{layer}.moe.up_proj.weight"] = t.chunk(2, dim=1)
        elif step and key.endswith("mlp.experts.down_proj"):
            out["model." + key] = t
        elif fused_out and key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out["model." + key] = t
        elif key.endswith("mlp.experts.gate_up_proj"):
            base = "model." + block(key[: -len(".gate_up_proj")])
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{name('gate_proj')}.weight"] = t[e, :ffn]
                out[f"{base}.{e}.{name('up_proj')}.weight"] = t[e, ffn:]
        elif key.endswith("mlp.experts.down_proj"):
            base = "model." + block(key[: -len(".down_proj")])
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{name('down_proj')}.weight"] = t[e]
        elif key == "lm_head.weight":
            if not model.shape.tie_embeddings:
                out[key] = t
        elif kimi and key.endswith("self_attn.A_log"):  # one a head, kept [1, 1, H, 1] by the releases
            out["model." + key] = t.reshape(1, 1, -1, 1)
        else:
            out["model." + block(key)] = t
    renamed = {}
    for k, v in out.items():
        for ours, theirs in _names_out(model.shape):
            k = k.replace(ours, theirs)
        renamed[k] = v
    return {k: v.contiguous().cpu() for k, v in renamed.items()}


def export_hf_checkpoint(model: Transformer, out_dir: str | Path, dtype: torch.dtype | None = None,
                         state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model.safetensors` + `config.json` (transformers' own layout for the arch) into `out_dir`, from the
    model's parameters or from `state_dict` (full tensors under the model's names)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = ours_to_hf(model, state_dict)
    if dtype is not None:  # the sigmoid router's correction bias stays fp32, as transformers keeps it (Hunyuan-V3's
        # checkpoints name it `expert_bias`)
        tensors = {k: v if k.endswith(("e_score_correction_bias", ".mlp.expert_bias", ".moe.router_bias"))
                   else v.to(dtype)
                   for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(model.shape)
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir
