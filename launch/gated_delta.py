"""The gated delta rule (Gated DeltaNet's token mixer): a chunked torch implementation that runs everywhere, a
token-by-token reference for tests, and flash-linear-attention's Triton kernels on GPU when that package is there.

Shape legend: T tokens (one packed sequence), H value heads, G key heads (H = G·r, GVA), K key head dim, V value
head dim, N chunks, C chunk size.

Recurrence per value head (S is [K, V], one per document, zero at each document's first token):

    S_t = exp(g_t) · S_{t-1} + β_t · k_t (v_t − exp(g_t) · S_{t-1}ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t

with q, k L2-normalized and q scaled by K^-1/2. docs/training.md derives the chunked form used below and how document
boundaries enter it as masks (no state or decay crosses a boundary, and no chunk alignment is needed).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def doc_ids_from_positions(positions_T: torch.Tensor) -> torch.Tensor:
    """Packed sequences restart positions at 0: document index of each token."""
    return torch.cumsum((positions_T == 0).to(torch.int64), 0) - 1


def _expand_gva(x_TGK: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    # value head h reads key head h // r (the same grouping transformers uses, repeat_interleave)
    r = num_v_heads // x_TGK.shape[1]
    return x_TGK if r == 1 else x_TGK.repeat_interleave(r, dim=1)


def chunk_gated_delta_rule_torch(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                                 beta_TH: torch.Tensor, positions_T: torch.Tensor, chunk_size: int = 64
                                 ) -> torch.Tensor:
    """Chunked gated delta rule in fp32 with document boundaries taken from `positions_T` (a 0 starts a document).

    `g_TH` is the log decay (≤ 0), `beta_TH` the write strength in (0, 1). Returns o [T, H, V] in v's dtype.
    """
    out_dtype = v_THV.dtype
    T, H, V = v_THV.shape
    K = q_TGK.shape[-1]
    C = chunk_size
    q = _expand_gva(l2norm(q_TGK.float()), H) * K ** -0.5
    k = _expand_gva(l2norm(k_TGK.float()), H)
    v, g, beta = v_THV.float(), g_TH.float(), beta_TH.float()
    doc_T = doc_ids_from_positions(positions_T)
    starts_T = positions_T == 0

    pad = (-T) % C
    if pad:  # padding tokens form their own document and write nothing (k = 0, β = 0)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        doc_T = torch.cat([doc_T, doc_T.new_full((pad,), int(doc_T[-1]) + 1 if T else 0)])
        starts_T = torch.cat([starts_T, starts_T.new_zeros(pad)])
        starts_T[T] = True
    N = (T + pad) // C

    # [H, N, C, ...] layout
    q, k, v = (x.permute(1, 0, 2).reshape(H, N, C, -1) for x in (q, k, v))
    g, beta = (x.permute(1, 0).reshape(H, N, C) for x in (g, beta))
    doc_NC, starts_NC = doc_T.view(N, C), starts_T.view(N, C)

    cum = g.cumsum(-1)  # log decay from the chunk's start to each position (includes the position's own g)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    same_doc_NCC = doc_NC[:, :, None] == doc_NC[:, None, :]
    pair_NCC = causal_CC & same_doc_NCC
    # exp(cum_i − cum_j) for j ≤ i in the same document, else 0 (masked before exp: no inf·0)
    decay_HNCC = torch.where(pair_NCC, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()
    # tokens that continue the document open at the chunk's start read (and are corrected by) the carried state
    carry_in_NC = (doc_NC == doc_NC[:, :1]) & ~starts_NC[:, :1]
    # tokens of the chunk's last document write into the state carried to the next chunk
    carry_out_NC = doc_NC == doc_NC[:, -1:]

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    a_HNCC = (k_beta @ k.transpose(-1, -2)) * decay_HNCC  # only its strictly lower triangle is used
    read_gain = torch.where(carry_in_NC, cum, float("-inf")).exp()[..., None]
    u = torch.linalg.solve_triangular(a_HNCC, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a_HNCC, k_beta * read_gain, upper=False, unitriangular=True)
    attn_HNCC = (q @ k.transpose(-1, -2)) * decay_HNCC
    q_read = q * read_gain
    k_write = k * torch.where(carry_out_NC, cum[..., -1:] - cum, float("-inf")).exp()[..., None]
    chunk_gain_HN = torch.where(carry_in_NC[:, -1], cum[..., -1], float("-inf")).exp()

    state = q.new_zeros(H, K, V)
    outs = []
    for n in range(N):
        v_new = u[:, n] - w[:, n] @ state  # the part of v the carried state does not already predict
        outs.append(q_read[:, n] @ state + attn_HNCC[:, n] @ v_new)
        state = state * chunk_gain_HN[:, n, None, None] + k_write[:, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).reshape(H, N * C, V)[:, :T]
    return o.permute(1, 0, 2).to(out_dtype)


def recurrent_gated_delta_rule_ref(q_TGK, k_TGK, v_THV, g_TH, beta_TH, positions_T) -> torch.Tensor:
    """Token-by-token reference (fp64), the recurrence written out; for tests."""
    T, H, V = v_THV.shape
    K = q_TGK.shape[-1]
    q = _expand_gva(l2norm(q_TGK.double()), H) * K ** -0.5
    k = _expand_gva(l2norm(k_TGK.double()), H)
    v, g, beta = v_THV.double(), g_TH.double(), beta_TH.double()
    state = q.new_zeros(H, K, V)
    out = torch.empty(T, H, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        if int(positions_T[t]) == 0:
            state = torch.zeros_like(state)
        state = state * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], (v[t] - pred) * beta[t][:, None])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out.to(v_THV.dtype)


# ---- flash-linear-attention (GPU) ----------------------------------------------------------------------------
_FLA_STATE: dict = {}


def fla_status(head_k_dim: int) -> tuple[bool, str]:
    """Whether flash-linear-attention's chunked kernel may be used for this head dim, and why (not).

    fla 0.6.0 refuses its gated backward (`chunk_bwd_dqkwg`) on Hopper with Triton ≥ 3.4, < 3.7.1 (its issue #640):
    the miscompile was reported for BK = 64 tiles. On Hopper the kernel tiles K with BK = min(next_pow2(K), 128), so
    head_k_dim ≥ 128 runs BK = 128, which tests/test_model_gpu.py checks against our torch reference (outputs and
    gradients). We lift the guard only in that case; below 128 we keep fla's refusal and use the torch path.
    """
    key = head_k_dim
    if key in _FLA_STATE:
        return _FLA_STATE[key]
    if not torch.cuda.is_available():
        result = (False, "no CUDA device")
    else:
        try:
            from fla.ops.common import chunk_o
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        except Exception as e:  # ImportError, or a Triton/driver mismatch at import
            result = (False, f"flash-linear-attention not importable: {e}")
        else:
            guarded = (getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
                       and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
            if guarded and head_k_dim >= 128:
                chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the BK=64 guard: our tiles are BK=128 (checked in tests)
                result = (True, "fla (Hopper guard lifted: head_k_dim >= 128 runs BK=128 tiles)")
            elif guarded:
                result = (False, f"fla refuses its gated backward on Hopper with this Triton at BK=64 "
                                 f"(head_k_dim={head_k_dim} < 128)")
            else:
                result = (True, "fla")
    _FLA_STATE[key] = result
    return result


def chunk_gated_delta_rule_fla(q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens: torch.Tensor,
                               chunk_size: int = 64) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if chunk_size != 64:
        warnings.warn(f"flash-linear-attention uses chunk size 64; chunk_size={chunk_size} is ignored", stacklevel=2)
    o, _ = chunk_gated_delta_rule(
        q_TGK[None].contiguous(), k_TGK[None].contiguous(), v_THV[None].contiguous(),
        g=g_TH[None].float().contiguous(), beta=beta_TH[None].to(q_TGK.dtype).contiguous(),
        scale=q_TGK.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long(),
    )
    return o[0]


def gated_delta_rule(q_TGK, k_TGK, v_THV, g_TH, beta_TH, positions_T, cu_seqlens, chunk_size: int = 64,
                     backend: str = "auto") -> torch.Tensor:
    """Dispatch: `torch` (everywhere), `fla` (CUDA, flash-linear-attention), `auto` (fla where usable)."""
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"delta-rule backend must be auto, torch or fla, got {backend!r}")
    if backend != "torch" and q_TGK.is_cuda:
        ok, why = fla_status(q_TGK.shape[-1])
        if ok:
            return chunk_gated_delta_rule_fla(q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, chunk_size)
        if backend == "fla":
            raise RuntimeError(f"delta-rule backend 'fla' requested but unusable: {why}")
    elif backend == "fla":
        raise RuntimeError("delta-rule backend 'fla' needs CUDA tensors")
    return chunk_gated_delta_rule_torch(q_TGK, k_TGK, v_THV, g_TH, beta_TH, positions_T, chunk_size)


def chunk_flops(T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Forward matmul FLOPs of the chunked rule (for TFLOP/s accounting): per chunk and head, KKᵀ, QKᵀ (2·C²K each),
    two triangular solves (≈C²(K+V)), W·S and Q·S (2·CKV each), the intra-chunk A·V (2·C²V) and the state update
    (2·CKV)."""
    n = math.ceil(T / C)
    per = 4 * C * C * K + C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    return float(n * H * per)
