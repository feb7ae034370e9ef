"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) for training: the lightning indexer's top-k selection and
multi-head latent attention over the selected keys only.

Shape legend: T queries, S keys (the same tokens, or a context-parallel rank's queries against the whole
micro-batch's keys), H attention heads, C the latent a key carries (kv_lora_rank normed latent, then the RoPE'd
shared key: 512 + 64 for DeepSeek-V3.2 and GLM-5), Cv = kv_lora_rank the part of it that is the value, K the
top-k, N index heads of width I.

Indexer (no gradient: the selection is discrete, and the indexer's weights are loaded, used and exported
unchanged, as transformers runs it)

    score(t, s) = Σ_j w[t, j] · relu(scale_I · qI[t, j] · kI[s])      for s in t's document, s ≤ t

and each query keeps its K highest keys (all of them while it has no more than K; equal scores go to the earlier
key), the rest never read.

Attention in the absorbed form. MLA's key of head h is [W_k[h] c_s | r_s] and its value W_v[h] c_s, where c_s is
the normed latent, r_s the RoPE'd shared key and W_k[h], W_v[h] head h's rows of kv_b_proj. So

    q_h · k_h,s = (W_k[h]ᵀ q_nope,h) · c_s + q_rope,h · r_s = q̂_h · latent_s,      q̂_h = [W_k[h]ᵀ q_nope,h | q_rope,h]
    o_h = Σ_s p_h,s W_v[h] c_s = W_v[h] ô_h,                                        ô_h = Σ_s p_h,s c_s

Every head of a query reads the same K latents (C values each), not K expanded keys per head: a query's gather is
K·C values where the expanded form's would be K·H·(q·k + v width), 57 times more for GLM-5's 64 heads. The
attention is a batched product per query: its H heads × its K gathered latents.

`sparse_latent_attention` runs that flash-style: the forward keeps each query's output and log-sum-exp per head,
the backward recomputes the probabilities from them. On a GPU, Triton kernels (kernels/sparse_mla_triton.py: one
program per query and block of heads, the latent gradient added with atomics); elsewhere, torch over blocks of
queries (`_SparseLatentAttention`, the reference the kernels are tested against), no [T, H, K] tensor outliving its
block, the latent's gradient summed into [S, C] fp32 rows with `index_add_`. Scores and softmax in fp32. The
derivation and the costs: docs/sparse_attention.md.
"""

from __future__ import annotations

import torch

from kernels.dsa_index import SELECT_CAP, index_scores, select_keys
from kernels.gdn_fused import _pick_backend

BLOCK_BYTES = 1 << 28  # a block's working set: its gathered latents and its fp32 [block, H, K] scores and gradients
INDEX_BLOCK_BYTES = 1 << 30  # the indexer's: a block of queries' fp32 scores over their span and the selection's work


def _f32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) with an fp32 result: bf16/fp16 products accumulated in fp32 on a GPU, fp32 elsewhere."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    acc = torch.promote_types(a.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    return torch.bmm(a.to(acc), b.to(acc))


def _block(rows_per_query_bytes: int, total: int) -> int:
    return max(1, min(total, BLOCK_BYTES // max(rows_per_query_bytes, 1)))


@torch.no_grad()
def index_topk(qI_TNI: torch.Tensor, w_TN: torch.Tensor, kI_SI: torch.Tensor, query_index: torch.Tensor,
               doc_start: torch.Tensor, topk: int, scale: float, backend: str | None = "auto") -> torch.Tensor:
    """Each query's selected keys [T, topk] (int32 indices into the S keys, −1 past the query's own count).

    qI_TNI: index queries [T, N, I]; w_TN: their head weights [T, N]; kI_SI: index keys [S, I] in key order;
    query_index[t]: the query's own key index; doc_start[t]: the key index of its document's first token (int64 CPU
    tensors [T], or sequences of ints: the blocks' spans are read on the host, with no device sync). Valid keys are
    doc_start[t] ≤ s ≤ query_index[t]. Queries go in blocks of consecutive rows, each block scored against the key
    span its queries can see (kernels/dsa_index.py); `backend` as there (the scores' and the selection's)."""
    T = qI_TNI.shape[0]
    out = torch.empty(T, topk, dtype=torch.int32, device=qI_TNI.device)  # each block's rows written whole below
    if T == 0:
        return out
    qi_host = torch.as_tensor(query_index, dtype=torch.int64)
    st_host = torch.as_tensor(doc_start, dtype=torch.int64)
    qi_all = qi_host.to(qI_TNI.device, non_blocking=True)
    st_all = st_host.to(qI_TNI.device, non_blocking=True)
    span = int(qi_host.max()) + 1 - int(st_host.min())
    # a block's bytes a query: its fp32 scores, and the selection kernel's gathered keys (on the torch path, its N
    # heads' products and topk's work); blocks of up to INDEX_BLOCK_BYTES (fewer, larger blocks: the kernels run at
    # their rate from about a thousand queries a block, and each block costs the host its launches)
    on_triton = _pick_backend(qI_TNI, backend) == "triton"
    per_row = 4 * span + 4 * SELECT_CAP * (span > SELECT_CAP) if on_triton else 4 * span * (qI_TNI.shape[1] + 6)
    step = max(1, min(T, INDEX_BLOCK_BYTES // per_row))
    # one buffer for every block's scores (their spans grow with the block: a tensor a block would have the
    # allocator reserve a new, larger segment each time)
    buf = torch.empty(step * span, dtype=torch.float32, device=qI_TNI.device) if on_triton and T > step else None
    for a in range(0, T, step):
        b = min(T, a + step)
        lo, hi = int(st_host[a:b].min()), int(qi_host[a:b].max()) + 1
        view = buf[:(b - a) * (hi - lo)].view(b - a, hi - lo) if buf is not None else None
        score = index_scores(qI_TNI[a:b], w_TN[a:b], kI_SI[lo:hi], qi_all[a:b], st_all[a:b], lo, scale, backend,
                             out=view)
        k = min(topk, hi - lo)
        select_keys(score, qi_all[a:b], st_all[a:b], lo, k, out[a:b], backend)
        if k < topk:  # a span shorter than topk: the slots no key can fill
            out[a:b, k:] = -1
    return out


class _SparseLatentAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THC, latent_SC, idx_TK, scale: float, v_dim: int):
        from kernels import sparse_mla_triton as k

        q_THC, latent_SC, idx_TK = q_THC.contiguous(), latent_SC.contiguous(), idx_TK.int().contiguous()
        count = (idx_TK >= 0).sum(1, dtype=torch.int32)
        o, lse = k.forward(q_THC, latent_SC, idx_TK, count, scale, v_dim)
        ctx.save_for_backward(q_THC, latent_SC, idx_TK, count, o, lse)
        ctx.scale, ctx.v_dim = scale, v_dim
        return o

    @staticmethod
    def backward(ctx, do_THV):
        from kernels import sparse_mla_triton as k

        q, latent, idx, count, o, lse = ctx.saved_tensors
        dq, dlatent = k.backward(q, latent, idx, count, o, lse, do_THV.contiguous(), ctx.scale, ctx.v_dim)
        return dq, dlatent.to(latent.dtype), None, None, None


def _block_scores(q_nHC, latent_SC, idx_nK, scale: float):
    """A block of queries' selected keys: which slots are valid [n, K], their latent rows [n, K] and latents
    [n, K, C], and the scaled fp32 scores [n, H, K] (−inf at the invalid slots)."""
    valid = idx_nK >= 0
    rows = idx_nK.clamp(min=0).long()
    g = latent_SC[rows]
    s = _f32_bmm(q_nHC, g.transpose(1, 2)) * scale
    return valid, rows, g, s.masked_fill(~valid[:, None, :], float("-inf"))


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THC, latent_SC, idx_TK, scale: float, v_dim: int):
        T, H, C = q_THC.shape
        K = idx_TK.shape[1]
        o = torch.empty(T, H, v_dim, dtype=q_THC.dtype, device=q_THC.device)
        lse = torch.empty(T, H, dtype=torch.promote_types(q_THC.dtype, torch.float32), device=q_THC.device)
        step = _block(K * C * latent_SC.element_size() + 4 * H * K * 2, T)
        for a in range(0, T, step):
            b = min(T, a + step)
            _, _, g, s = _block_scores(q_THC[a:b], latent_SC, idx_TK[a:b], scale)  # [n, K, C], [n, H, K]
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            denom = p.sum(-1, keepdim=True)
            lse[a:b] = (m + denom.log()).squeeze(-1)
            ov = _f32_bmm((p / denom).to(g.dtype), g[..., :v_dim])
            o[a:b] = ov.to(o.dtype)
        ctx.save_for_backward(q_THC, latent_SC, idx_TK, o, lse)
        ctx.scale, ctx.v_dim = scale, v_dim
        return o

    @staticmethod
    def backward(ctx, do_THV):
        q_THC, latent_SC, idx_TK, o, lse = ctx.saved_tensors
        scale, v_dim = ctx.scale, ctx.v_dim
        T, H, C = q_THC.shape
        K = idx_TK.shape[1]
        dq = torch.empty(T, H, C, dtype=q_THC.dtype, device=q_THC.device)
        dlatent = torch.zeros(latent_SC.shape, dtype=lse.dtype, device=latent_SC.device)
        do_THV = do_THV.contiguous()
        step = _block(K * C * (latent_SC.element_size() + 4) + 4 * H * K * 3, T)
        for a in range(0, T, step):
            b = min(T, a + step)
            valid, rows, g, s = _block_scores(q_THC[a:b], latent_SC, idx_TK[a:b], scale)
            p = torch.exp(s - lse[a:b, :, None])  # [n, H, K]
            do = do_THV[a:b]
            dp = _f32_bmm(do, g[..., :v_dim].transpose(1, 2))  # [n, H, K]
            delta = (do.to(lse.dtype) * o[a:b].to(lse.dtype)).sum(-1, keepdim=True)
            ds = p * (dp - delta) * scale
            dq[a:b] = _f32_bmm(ds.to(g.dtype), g).to(dq.dtype)
            dg = _f32_bmm(ds.transpose(1, 2).to(g.dtype), q_THC[a:b])  # [n, K, C]
            dg[..., :v_dim] += _f32_bmm(p.transpose(1, 2).to(g.dtype), do)
            dg = dg.masked_fill(~valid[..., None], 0.0)
            dlatent.index_add_(0, rows.reshape(-1), dg.reshape(-1, C))
        return dq, dlatent.to(latent_SC.dtype), None, None, None


def sparse_latent_attention(q_THC: torch.Tensor, latent_SC: torch.Tensor, idx_TK: torch.Tensor, scale: float,
                            v_dim: int, backend: str | None = "auto") -> torch.Tensor:
    """Each query's heads [T, H, C] (absorbed: module docstring) attending to its selected latents (idx_TK: rows of
    latent_SC, its valid entries first and −1 after them, at least one each, as `index_topk` gives them) with
    softmax scale `scale`; the value is a latent's first `v_dim` channels. Returns ô [T, H, v_dim] in q's dtype.
    `backend`: "auto" runs the Triton kernels (kernels/sparse_mla_triton.py) on CUDA/ROCm tensors when triton is
    installed, the torch blocks here otherwise; "torch" and "triton" force one."""
    if _pick_backend(q_THC, backend) == "triton":
        return _SparseLatentAttentionTriton.apply(q_THC, latent_SC, idx_TK, scale, v_dim)
    return _SparseLatentAttention.apply(q_THC, latent_SC, idx_TK, scale, v_dim)
