"""The gated delta rule, the token mixer of Gated DeltaNet (one decay per head and token) and of Kimi Delta Attention
(KDA: one decay per key channel, head and token): a chunked torch implementation that runs everywhere, a
token-by-token reference for tests, and flash-linear-attention's Triton kernels on GPU when that package is there.
A gate g of shape [T, H] is Gated DeltaNet's, [T, H, K] KDA's; every function here takes either.

Shape legend: T tokens (one packed sequence), H value heads, G key heads (H = G·r, GVA), K key head dim, V value
head dim, N chunks, C chunk size.

Recurrence per value head (S is [K, V], one per document, zero at each document's first token; D_t = diag(exp(g_t))
over the K rows, the same factor on every row for Gated DeltaNet):

    S_t = D_t S_{t-1} + β_t · k_t (v_t − (D_t S_{t-1})ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t

with q, k L2-normalized and q scaled by K^-1/2. docs/training.md derives the chunked form used below and how document
boundaries enter it as masks (no state or decay crosses a boundary, and no chunk alignment is needed).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

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


@dataclass
class DeltaRuleChunks:
    """The per-chunk factors of the chunked rule, [H, N, C, ...]: everything but the carried state. A chunk's
    output and outgoing state are affine in its incoming state S (docs/training.md):

        v_new = u − w S,    o = q_read S + attn v_new,    S_next = gain · S + k_writeᵀ v_new
    """

    u: torch.Tensor  # [H, N, C, V]  (I + A)^{-1} diag(β) V
    w: torch.Tensor  # [H, N, C, K]  (I + A)^{-1} diag(β) (K ⊙ e^c) on carry-in tokens
    attn: torch.Tensor  # [H, N, C, C]  the decayed Q Kᵀ over same-document causal pairs
    q_read: torch.Tensor  # [H, N, C, K]  Q ⊙ e^c on carry-in tokens
    k_write: torch.Tensor  # [H, N, C, K]  K ⊙ e^{c_C − c} on the chunk's last document
    gain: torch.Tensor  # [H, N, K]  e^{c_C} (per key channel) when the whole chunk continues the incoming document
    num_tokens: int  # T before padding to whole chunks
    out_dtype: torch.dtype


DECAYED_PRODUCT_ELEMENTS = 1 << 24  # KDA's [h, n, C, C, K] pairwise decays are formed this many elements at a time


def _decayed_products(x_HNCK: torch.Tensor, y_HNCK: torch.Tensor, cum_HNCK: torch.Tensor,
                      pair_NCC: torch.Tensor) -> torch.Tensor:
    """Σ_d x_id y_jd exp(cum_id − cum_jd) for the pairs (i, j) of `pair_NCC` (j ≤ i in one document), else 0:
    [H, N, C, C]. Per-channel decays do not factor into a row and a column term that both stay finite (exp(−cum_j)
    overflows once a chunk's decay passes fp32's range), so each pair's decay is formed as it is (≤ 1), a block of
    chunks at a time, the blocks recomputed in the backward rather than kept."""
    from torch.utils.checkpoint import checkpoint

    H, N, C, K = x_HNCK.shape

    def block(x, y, cum, pair):
        decay = torch.where(pair[..., None], cum[..., :, None, :] - cum[..., None, :, :], float("-inf")).exp()
        return torch.einsum("hnik,hnjk,hnijk->hnij", x, y, decay)

    step = max(1, DECAYED_PRODUCT_ELEMENTS // (H * C * C * K))
    outs = []
    for a in range(0, N, step):
        b = slice(a, a + step)
        args = (x_HNCK[:, b], y_HNCK[:, b], cum_HNCK[:, b], pair_NCC[b])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in args[:3])
        outs.append(checkpoint(block, *args, use_reentrant=False) if grad else block(*args))
    return torch.cat(outs, 1)


def chunk_factors(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                  beta_TH: torch.Tensor, positions_T: torch.Tensor, chunk_size: int = 64) -> DeltaRuleChunks:
    """The chunk-local part of the chunked rule (every chunk at once), in fp32 (fp64 inputs stay fp64). Document
    boundaries are read off `positions_T` (a 0 starts a document); a sequence that is not whole chunks is padded
    with tokens that form their own document and write nothing. `g_TH`: [T, H] (one decay per head) or [T, H, K]
    (per key channel, KDA)."""
    out_dtype = v_THV.dtype
    dt = torch.promote_types(v_THV.dtype, torch.float32)
    T, H, V = v_THV.shape
    K = q_TGK.shape[-1]
    C = chunk_size
    q = _expand_gva(l2norm(q_TGK.to(dt)), H) * K ** -0.5
    k = _expand_gva(l2norm(k_TGK.to(dt)), H)
    v, g, beta = v_THV.to(dt), g_TH.to(dt), beta_TH.to(dt)
    doc_T = doc_ids_from_positions(positions_T)
    starts_T = positions_T == 0

    pad = (-T) % C
    per_channel = g.dim() == 3
    if pad:  # padding tokens form their own document and write nothing (k = 0, β = 0)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0) * (g.dim() - 1) + (0, pad))
        beta = F.pad(beta, (0, 0, 0, pad))
        doc_T = torch.cat([doc_T, doc_T.new_full((pad,), int(doc_T[-1]) + 1 if T else 0)])
        starts_T = torch.cat([starts_T, starts_T.new_zeros(pad)])
        starts_T[T] = True
    N = (T + pad) // C

    # [H, N, C, ...] layout
    q, k, v = (x.permute(1, 0, 2).reshape(H, N, C, -1) for x in (q, k, v))
    beta = beta.permute(1, 0).reshape(H, N, C)
    # log decays [H, N, C, K'] with K' = K per channel, 1 per head (broadcast over the channels below)
    g = g.permute(1, 0, 2).reshape(H, N, C, K) if per_channel else g.permute(1, 0).reshape(H, N, C, 1)
    doc_NC, starts_NC = doc_T.view(N, C), starts_T.view(N, C)

    cum = g.cumsum(-2)  # log decay from the chunk's start to each position (includes the position's own g)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    same_doc_NCC = doc_NC[:, :, None] == doc_NC[:, None, :]
    pair_NCC = causal_CC & same_doc_NCC
    # tokens that continue the document open at the chunk's start read (and are corrected by) the carried state
    carry_in_NC = (doc_NC == doc_NC[:, :1]) & ~starts_NC[:, :1]
    # tokens of the chunk's last document write into the state carried to the next chunk
    carry_out_NC = doc_NC == doc_NC[:, -1:]

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    if per_channel:
        a_HNCC = _decayed_products(k_beta, k, cum, pair_NCC)  # only its strictly lower triangle is used
        attn_HNCC = _decayed_products(q, k, cum, pair_NCC)
    else:
        c = cum[..., 0]
        # exp(cum_i − cum_j) for j ≤ i in the same document, else 0 (masked before exp: no inf·0)
        decay_HNCC = torch.where(pair_NCC, c[..., :, None] - c[..., None, :], float("-inf")).exp()
        a_HNCC = (k_beta @ k.transpose(-1, -2)) * decay_HNCC
        attn_HNCC = (q @ k.transpose(-1, -2)) * decay_HNCC
    read_gain = torch.where(carry_in_NC[..., None], cum, float("-inf")).exp()
    u = torch.linalg.solve_triangular(a_HNCC, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a_HNCC, k_beta * read_gain, upper=False, unitriangular=True)
    q_read = q * read_gain
    k_write = k * torch.where(carry_out_NC[..., None], cum[..., -1:, :] - cum, float("-inf")).exp()
    chunk_gain_HNK = torch.where(carry_in_NC[:, -1, None], cum[..., -1, :], float("-inf")).exp().expand(H, N, K)
    return DeltaRuleChunks(u, w, attn_HNCC, q_read, k_write, chunk_gain_HNK, T, out_dtype)


def chunk_outputs(f: DeltaRuleChunks, initial_SHKV: torch.Tensor | None = None) -> torch.Tensor:
    """The loop over chunks with the carried state: o [T, H, V] in the inputs' dtype. `initial_SHKV`: the state
    entering each of S equal consecutive segments of whole chunks (None: one segment from a zero state); a segment
    whose first token starts a document ignores it (the carry-in mask)."""
    H, N, C, V = f.u.shape
    K = f.w.shape[-1]
    if initial_SHKV is None:
        initial_SHKV = f.u.new_zeros(1, H, K, V)
    per_segment = _chunks_per_segment(N, initial_SHKV.shape[0])
    outs = []
    for n in range(N):
        if n % per_segment == 0:
            state = initial_SHKV[n // per_segment].to(f.u.dtype)
        v_new = f.u[:, n] - f.w[:, n] @ state  # the part of v the carried state does not already predict
        outs.append(f.q_read[:, n] @ state + f.attn[:, n] @ v_new)
        if (n + 1) % per_segment:
            state = state * f.gain[:, n, :, None] + f.k_write[:, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).reshape(H, N * C, V)[:, :f.num_tokens]
    return o.permute(1, 0, 2).to(f.out_dtype)


def segment_pass(f: DeltaRuleChunks, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over `num_segments` equal consecutive segments of whole chunks, each from an unknown incoming state
    S_in: the segments' outputs as affine functions of S_in, o = O_0 + Q_eff S_in, returned as o_aug [T, H, V + K] =
    [O_0 | Q_eff] in the compute dtype, and each segment's outgoing state S_out = M S_in + B, returned as
    maps [num_segments, H, K, V + K] = [B | M].

    Everything a chunk does is linear in the pair (values, incoming state) and acts on each column of the state
    alone, so one pass over the augmented state [S | X] from [0 | I] with values [u | 0] carries, in its first V
    columns, the zero-state run (outputs O_0, final state B) and, in its last K, the response to the incoming
    state (outputs Q_eff, final state M: the product of the chunks' linear parts). A document starting inside the
    segment zeroes M (gain 0, and only its tokens write) and its tokens' Q_eff rows (they read nothing carried in),
    which is the reset. `with_incoming_states` then applies the true S_in."""
    H, N, C, V = f.u.shape
    K = f.w.shape[-1]
    per_segment = _chunks_per_segment(N, num_segments)
    u_aug = torch.cat([f.u, f.u.new_zeros(H, N, C, K)], -1)
    start = torch.cat([f.u.new_zeros(H, K, V), torch.eye(K, dtype=f.u.dtype, device=f.u.device).expand(H, K, K)], -1)
    outs, maps = [], []
    for n in range(N):
        if n % per_segment == 0:
            state = start
        v_new = u_aug[:, n] - f.w[:, n] @ state
        outs.append(f.q_read[:, n] @ state + f.attn[:, n] @ v_new)
        state = state * f.gain[:, n, :, None] + f.k_write[:, n].transpose(-1, -2) @ v_new
        if (n + 1) % per_segment == 0:
            maps.append(state)
    o = torch.stack(outs, 1).reshape(H, N * C, V + K)[:, :f.num_tokens]
    return o.permute(1, 0, 2), torch.stack(maps)


def with_incoming_states(o_aug_THX: torch.Tensor, states_SHKV: torch.Tensor) -> torch.Tensor:
    """The outputs [T, H, V] of S equal consecutive segments from their augmented outputs [O_0 | Q_eff] (a
    segment_pass) and their true incoming states [S, H, K, V]: O_0 + Q_eff S_in, segment by segment, in the outputs'
    dtype (the products in the wider of the two: fp32 for bf16 outputs and fp32 states)."""
    T, H, X = o_aug_THX.shape
    S, _, K, V = states_SHKV.shape
    if T % S or X != V + K:
        raise ValueError(f"augmented outputs {tuple(o_aug_THX.shape)} do not match {S} segments of states "
                         f"{tuple(states_SHKV.shape[1:])}")
    return _Completion.apply(o_aug_THX, states_SHKV)


COMPLETION_BLOCK_TOKENS = 8192  # tokens a segment's completion works on at once (bounds its temporaries)


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) in fp32 from 16-bit operands: one GEMM with fp32 output on CUDA, fp32 operands elsewhere."""
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch.bmm(a.float(), b.float())


class _Completion(torch.autograd.Function):
    """O = O_0 + Q_eff S_in block by block, so that no temporary outlives a block, saving only Q_eff (in its own
    dtype) and the states for the backward: dO_0 = dO, dQ_eff = dO S_inᵀ, dS_in = Σ_t Q_effᵀ dO.

    16-bit outputs: tensor-core GEMMs in the outputs' dtype with fp32 accumulation, S_in rounded to that dtype as
    fla's own output kernel rounds its states for the same product; O_0 is added in fp32 inside the GEMM and rounded
    once, and dS_in is summed over the tokens in fp32. Per segment and head the operands are strided views (no copy
    of the augmented outputs). Wider outputs (fp32, fp64): the products in that dtype, exact to it."""

    @staticmethod
    def forward(ctx, o_aug_THX, states_SHKV):
        T, H, X = o_aug_THX.shape
        S, _, K, V = states_SHKV.shape
        seg = o_aug_THX.reshape(S, T // S, H, X)
        out = o_aug_THX.new_empty(S, T // S, H, V)
        if o_aug_THX.element_size() == 2:
            st = states_SHKV.to(o_aug_THX.dtype)
            for s in range(S):
                for a in range(0, T // S, COMPLETION_BLOCK_TOKENS):
                    blk = seg[s, a:a + COMPLETION_BLOCK_TOKENS].transpose(0, 1)  # [H, t, X]
                    out[s, a:a + COMPLETION_BLOCK_TOKENS] = torch.baddbmm(
                        blk[..., :V], blk[..., V:], st[s]).transpose(0, 1)
        else:
            dt = torch.promote_types(o_aug_THX.dtype, states_SHKV.dtype)
            st = states_SHKV.to(dt)
            for a in range(0, T // S, COMPLETION_BLOCK_TOKENS):
                b = slice(a, a + COMPLETION_BLOCK_TOKENS)
                out[:, b] = (seg[:, b, :, :V].to(dt)
                             + torch.einsum("sthk,shkv->sthv", seg[:, b, :, V:].to(dt), st)).to(out.dtype)
        ctx.save_for_backward(seg[..., V:].contiguous(), states_SHKV)
        return out.reshape(T, H, V)

    @staticmethod
    def backward(ctx, dO_THV):
        q_eff, states = ctx.saved_tensors  # [S, t, H, K], [S, H, K, V]
        S, t, H, K = q_eff.shape
        V = states.shape[-1]
        dO = dO_THV.reshape(S, t, H, V)
        d_aug = q_eff.new_empty(S, t, H, V + K)
        d_aug[..., :V] = dO
        if q_eff.element_size() == 2:
            dO = dO.to(q_eff.dtype)
            st_t = states.to(q_eff.dtype).transpose(-1, -2)  # [S, H, V, K]
            d_states = torch.zeros(S, H, K, V, dtype=torch.float32, device=states.device)
            for s in range(S):
                for a in range(0, t, COMPLETION_BLOCK_TOKENS):
                    b = slice(a, a + COMPLETION_BLOCK_TOKENS)
                    g = dO[s, b].transpose(0, 1)  # [H, t, V]
                    d_aug[s, b, :, V:] = torch.bmm(g, st_t[s]).transpose(0, 1)
                    d_states[s] += _bmm_f32(q_eff[s, b].permute(1, 2, 0), g)
        else:
            dt = torch.promote_types(q_eff.dtype, states.dtype)
            st = states.to(dt)
            d_states = torch.zeros(S, H, K, V, dtype=dt, device=states.device)
            for a in range(0, t, COMPLETION_BLOCK_TOKENS):
                b = slice(a, a + COMPLETION_BLOCK_TOKENS)
                g = dO[:, b].to(dt)
                d_aug[:, b, :, V:] = torch.einsum("sthv,shkv->sthk", g, st)
                d_states += torch.einsum("sthk,sthv->shkv", q_eff[:, b].to(dt), g)
        return d_aug.reshape(S * t, H, V + K), d_states.to(states.dtype)


def fold_state_maps(maps_SHKX: torch.Tensor) -> torch.Tensor:
    """The state entering each segment, from the segments' maps [S, H, K, V + K] in sequence order: S_in(0) = 0,
    S_in(j+1) = M_j S_in(j) + B_j. Returns [S, H, K, V]."""
    S, H, K, X = maps_SHKX.shape
    V = X - K
    state = maps_SHKX.new_zeros(H, K, V)
    states = [state]
    # unbind + split, not maps[j, ..., V:]: the backward of an indexed view writes a zero-filled gradient of the
    # whole [S, H, K, V + K] stack per step (O(S^2) traffic); these backwards are one stack and one cat per map
    for m_HKX in maps_SHKX[:-1].unbind(0):
        b_HKV, a_HKK = m_HKX.split([V, K], dim=-1)
        state = torch.baddbmm(b_HKV, a_HKK, state)
        states.append(state)
    return torch.stack(states)


def _chunks_per_segment(num_chunks: int, num_segments: int) -> int:
    if num_segments < 1 or num_chunks % num_segments:
        raise ValueError(f"{num_chunks} chunks do not split into {num_segments} equal segments of whole chunks")
    return num_chunks // num_segments


def chunk_gated_delta_rule_torch(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                                 beta_TH: torch.Tensor, positions_T: torch.Tensor, chunk_size: int = 64
                                 ) -> torch.Tensor:
    """Chunked gated delta rule in fp32 with document boundaries taken from `positions_T` (a 0 starts a document).

    `g_TH` is the log decay (≤ 0), [T, H] or per key channel [T, H, K]; `beta_TH` the write strength in (0, 1).
    Returns o [T, H, V] in v's dtype.
    """
    return chunk_outputs(chunk_factors(q_TGK, k_TGK, v_THV, g_TH, beta_TH, positions_T, chunk_size))


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
        state = state * (g[t].exp()[:, :, None] if g.dim() == 3 else g[t].exp()[:, None, None])
        pred = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], (v[t] - pred) * beta[t][:, None])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out.to(v_THV.dtype)


# ---- flash-linear-attention (GPU) ----------------------------------------------------------------------------
_FLA_STATE: dict = {}


def fla_status(head_k_dim: int, per_channel: bool = False) -> tuple[bool, str]:
    """Whether flash-linear-attention's chunked kernel (`chunk_kda` for per-channel decays) may be used for this head
    dim, and why (not).

    fla 0.6.0 refuses its gated backward (`chunk_bwd_dqkwg`) on Hopper with Triton ≥ 3.4, < 3.7.1 (its issue #640):
    the miscompile was reported for BK = 64 tiles. On Hopper the kernel tiles K with BK = min(next_pow2(K), 128), so
    head_k_dim ≥ 128 runs BK = 128, which tests/test_model_gpu.py checks against our torch reference (outputs and
    gradients). We lift the guard only in that case; below 128 we keep fla's refusal and use the torch path. KDA's
    backward (`fla.ops.kda`) runs kernels of its own, which the guard does not cover.
    """
    key = (head_k_dim, per_channel)
    if key in _FLA_STATE:
        return _FLA_STATE[key]
    if not torch.cuda.is_available():
        result = (False, "no CUDA device")
    else:
        try:
            from fla.ops.common import chunk_o
            fla_rule(per_channel)
        except Exception as e:  # ImportError, or a Triton/driver mismatch at import
            result = (False, f"flash-linear-attention not importable: {e}")
        else:
            # the guard is on Gated DeltaNet's gated backward (chunk_bwd_dqkwg); KDA's backward has its own kernels
            guarded = (not per_channel and getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
                       and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
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


def fla_rule(per_channel: bool):
    """flash-linear-attention's chunked kernel for the gate's form: `chunk_kda` for per-channel decays (KDA),
    `chunk_gated_delta_rule` for one decay per head; both take the same arguments here."""
    if per_channel:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def chunk_gated_delta_rule_fla(q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens: torch.Tensor,
                               chunk_size: int = 64) -> torch.Tensor:
    if chunk_size != 64:
        warnings.warn(f"flash-linear-attention uses chunk size 64; chunk_size={chunk_size} is ignored", stacklevel=2)
    o, _ = fla_rule(g_TH.dim() == 3)(
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
        ok, why = fla_status(q_TGK.shape[-1], g_TH.dim() == 3)
        if ok:
            return chunk_gated_delta_rule_fla(q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, chunk_size)
        if backend == "fla":
            raise RuntimeError(f"delta-rule backend 'fla' requested but unusable: {why}")
    elif backend == "fla":
        raise RuntimeError("delta-rule backend 'fla' needs CUDA tensors")
    return chunk_gated_delta_rule_torch(q_TGK, k_TGK, v_THV, g_TH, beta_TH, positions_T, chunk_size)

