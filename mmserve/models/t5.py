"""T5 (v1.1 / Flan-T5) as an encoder-decoder language model: the encoder runs once per request on its input
embeddings (BLIP-2: the query tokens, then the question), the decoder over the paged cache.

T5's attention does not scale its scores and adds a learned relative-position bias (from buckets of the key's
distance to the query, computed in the first layer and shared by all layers of the stack); the decoder's
self-attention does so over the paged cache in torch on every device (`torch_backend.paged_attention` with
`bias_fn`; a step's sequences padded together when the bias fits, `torch_backend.padded_batch`), its
cross-attention attends the encoder states without a bias. RMS LayerNorms (no mean, no bias),
gated-GELU or ReLU feed-forward, a final norm per stack; a tied LM head scales its input by d_model^-0.5.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention import torch_backend
from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_rank, get_tp_size
from mmserve.layers.activation import get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.cross_attention import attend_cross
from mmserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mmserve.layers.norm import RMSNorm
from mmserve.models.base import CrossKVLayout
from mmserve.models.family import TextShape
from mmserve.models.registry import register_text_shape


def relative_position_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each key-minus-query distance: exact for small distances, logarithmic up to max_distance;
    a bidirectional (encoder) bias keeps keys after the query in the upper half of the buckets."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -relative.clamp(max=0)
    exact = num_buckets // 2
    large = (
        exact
        + (
            torch.log(relative.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    return buckets + torch.where(relative < exact, relative, large.clamp(max=num_buckets - 1))


def _linears(sharded: bool) -> tuple[type, type]:
    """(the input-side, the output-side) linear classes: split over the tensor-parallel ranks by heads / features,
    or whole on the one rank that runs them (the encoder: the driver runs it alone)."""
    if sharded:
        return ColumnParallelLinear, RowParallelLinear
    return ReplicatedLinear, ReplicatedLinear


def _load_head_columns(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A relative-position bias table [buckets, heads] of the whole model -> this rank's heads' columns."""
    n = param.shape[1]
    param.data.copy_(loaded.narrow(1, get_tp_rank() * n, n))


class T5Attention(nn.Module):
    """q, k, v, o of one T5 attention (no biases, no score scaling); the first self-attention of a stack also holds
    the stack's `relative_attention_bias` (an embedding of distance buckets, one value per head). `sharded`: this
    rank's heads under tensor parallelism (the decoder); else every head (the encoder)."""

    def __init__(
        self, config, has_bias: bool = False, bidirectional: bool = False, sharded: bool = True
    ) -> None:
        super().__init__()
        tp = get_tp_size() if sharded else 1
        self.heads, self.d_kv = config.num_heads // tp, config.d_kv
        inner = config.num_heads * self.d_kv
        column, row = _linears(sharded)
        self.q = column(config.d_model, inner, bias=False)
        self.k = column(config.d_model, inner, bias=False)
        self.v = column(config.d_model, inner, bias=False)
        self.o = row(inner, config.d_model, bias=False)
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = (
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
        )
        if has_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.heads)
            if tp > 1:
                self.relative_attention_bias.weight.weight_loader = _load_head_columns

    def heads_of(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(len(x), self.heads, self.d_kv)

    def position_bias(self, q_pos: torch.Tensor, k_len: int) -> torch.Tensor:
        """[H, q, k] bias of the query positions q_pos against key positions 0..k_len-1."""
        relative = torch.arange(k_len, device=q_pos.device)[None, :] - q_pos[:, None]
        bucket = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        return self.relative_attention_bias(bucket).permute(2, 0, 1)

    def distance_bias(self, n: int, device: torch.device) -> torch.Tensor:
        """[H, n] fp32 bias of a key d = 0..n-1 positions before the query (a decoder's, unidirectional)."""
        bucket = relative_position_bucket(
            -torch.arange(n, device=device), False, self.num_buckets, self.max_distance
        )
        return self.relative_attention_bias(bucket).t().float().contiguous()


class T5DenseAct(nn.Module):
    """`DenseReluDense`: wi -> act -> wo, or gated: act(wi_0 x) * wi_1 x -> wo (Flan-T5's gated-gelu)."""

    def __init__(self, config, sharded: bool = True) -> None:
        super().__init__()
        self.gated = config.is_gated_act
        d, ff = config.d_model, config.d_ff
        column, row = _linears(sharded)
        if self.gated:
            self.wi_0 = column(d, ff, bias=False)
            self.wi_1 = column(d, ff, bias=False)
        else:
            self.wi = column(d, ff, bias=False)
        self.wo = row(ff, d, bias=False)
        self.act = get_act_fn(config.dense_act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(
            self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        )


class T5SelfAttentionLayer(nn.Module):
    def __init__(self, config, has_bias: bool, bidirectional: bool, sharded: bool = True) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(config, has_bias, bidirectional, sharded)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5CrossAttentionLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(config)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5FeedForwardLayer(nn.Module):
    def __init__(self, config, sharded: bool = True) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseAct(config, sharded)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clamp(x + self.DenseReluDense(self.layer_norm(x)))


class T5EncoderBlock(nn.Module):
    """Unsharded: under tensor parallelism the driver runs the encoder alone (its workers drop it) and sends its
    states, from which every rank projects its own heads' cross keys/values."""

    def __init__(self, config, has_bias: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            [
                T5SelfAttentionLayer(config, has_bias, True, sharded=False),
                T5FeedForwardLayer(config, sharded=False),
            ]
        )

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        sa = self.layer[0]
        a, h = sa.SelfAttention, sa.layer_norm(x)
        q, k, v = (a.heads_of(p(h)).transpose(0, 1)[None] for p in (a.q, a.k, a.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype), scale=1.0)
        x = _clamp(x + a.o(o[0].transpose(0, 1).reshape(len(x), -1)))
        return self.layer[1](x)


class T5EncoderStack(nn.Module):
    """The encoder over one request's input embeddings [T, d_model] -> [T, d_model] (no padding)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.block = nn.ModuleList(T5EncoderBlock(config, i == 0) for i in range(config.num_layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = (
            self.block[0]
            .layer[0]
            .SelfAttention.position_bias(torch.arange(len(x), device=x.device), len(x))
        )
        for block in self.block:
            x = block(x, bias)
        return self.final_layer_norm(x)


class T5DecoderBlock(nn.Module):
    def __init__(self, config, slot: int, has_bias: bool) -> None:
        super().__init__()
        self.slot = slot
        self.layer = nn.ModuleList(
            [
                T5SelfAttentionLayer(config, has_bias, False),
                T5CrossAttentionLayer(config),
                T5FeedForwardLayer(config),
            ]
        )
        heads = config.num_heads // get_tp_size()
        self.paged = Attention(heads, config.d_kv, heads, 1.0)  # its paged cache slice

    def project_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[T, d_model] encoder states -> this layer's cross keys/values [T, 2, heads, d_kv]."""
        a = self.layer[1].EncDecAttention
        return torch.stack([a.heads_of(a.k(states)), a.heads_of(a.v(states))], dim=1)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        bias_fn,
        padded: torch_backend.PaddedBatch | None,
        distance: torch.Tensor | None,
    ) -> torch.Tensor:
        sa, p = self.layer[0], self.paged
        a, h = sa.SelfAttention, sa.layer_norm(x)
        q, k, v = a.heads_of(a.q(h)), a.heads_of(a.k(h)), a.heads_of(a.v(h))
        p.backend.write_kv(k, v, p.kv_cache, meta.slot_mapping, p.k_scale, p.v_scale)
        if distance is not None:
            o = p.backend.paged_attention(
                q, p.kv_cache, meta, 1.0, p.k_scale, p.v_scale, distance_bias=distance
            )
        elif padded is not None:
            o = torch_backend.padded_attention(q, p.kv_cache, padded, 1.0, p.k_scale, p.v_scale)
        else:
            o = torch_backend.paged_attention(
                q, p.kv_cache, meta, 1.0, p.k_scale, p.v_scale, bias_fn=bias_fn
            )
        x = _clamp(x + a.o(o.reshape(len(x), -1)))
        ca = self.layer[1]
        c = ca.EncDecAttention
        cq = c.heads_of(c.q(ca.layer_norm(x)))
        x = _clamp(x + c.o(attend_cross(cq, meta.cross, self.slot, 1.0).reshape(len(x), -1)))
        return self.layer[2](x)


class T5DecoderStack(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        layers = (
            config.num_decoder_layers
            if config.num_decoder_layers is not None
            else config.num_layers
        )
        self.block = nn.ModuleList(T5DecoderBlock(config, i, i == 0) for i in range(layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.distance: torch.Tensor | None = (
            None  # the bias by key distance, grown by powers of two
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if meta.cross is None or sum(s.rows.stop - s.rows.start for s in meta.cross.seqs) != len(x):
            raise ValueError("every sequence of an encoder-decoder model needs its encoder states")
        first = self.block[0].layer[0].SelfAttention
        padded = distance = None
        if meta.decode_only and not getattr(
            self.block[0].paged.backend, "PREFERS_PADDED_BIAS", False
        ):
            # the backend's decode kernel adds the bias by key distance (a table graphs can read); a decode graph is
            # captured at max_model_len, so the table never grows after capture
            if self.distance is None or self.distance.shape[1] < meta.max_seq_len:
                self.distance = first.distance_bias(
                    max(64, 1 << (meta.max_seq_len - 1).bit_length()), x.device
                )
            distance = self.distance
        else:  # the relative-position bias and the causal mask of the step's padded layout, once for all layers
            padded = torch_backend.padded_batch(meta, first.position_bias, first.heads)
        for block in self.block:
            x = block(x, meta, first.position_bias, padded, distance)
        return self.final_layer_norm(x)


def _clamp(x: torch.Tensor) -> torch.Tensor:
    """transformers' fp16 guard: T5's activations can overflow half precision; clamp them below its max."""
    if x.dtype != torch.float16:
        return x
    limit = torch.finfo(torch.float16).max - 1000
    return x.clamp(-limit, limit)


class T5LanguageModel(nn.Module):
    """`shared` embedding, the encoder (run per request by the family; `with_encoder=False`: none, as Pix2Struct,
    whose encoder is a vision tower), the decoder over the paged cache, LM head (`output_scale`: what its input is
    multiplied by; default T5's rule)."""

    def __init__(
        self, config, with_encoder: bool = True, output_scale: float | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5EncoderStack(config) if with_encoder else None
        self.decoder = T5DecoderStack(config)
        # the LM head is its own tensor when the checkpoint has one (Flan-T5), else a copy of `shared`
        # (`share_head_if_absent`); transformers 5 reads the old `tie_word_embeddings` as `scale_decoder_outputs`
        self.lm_head = ReplicatedLinear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight.tied = True  # may be absent from the checkpoint
        self.output_scale = (
            output_scale
            if output_scale is not None
            else config.d_model**-0.5
            if getattr(
                config, "scale_decoder_outputs", getattr(config, "tie_word_embeddings", False)
            )
            else 1.0
        )
        for p in self.parameters():
            p.requires_grad_(False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(input_ids)

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder states [T, d_model] -> every decoder layer's cross keys/values [T, layers, 2, heads, d_kv]."""
        return torch.stack([block.project_kv(states) for block in self.decoder.block], dim=1)

    def cross_kv_layout(self) -> CrossKVLayout:
        a = self.decoder.block[0].layer[1].EncDecAttention
        return CrossKVLayout(len(self.decoder.block), a.heads, a.d_kv)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.decoder(inputs_embeds, positions, meta)

    def share_head_if_absent(self, loaded_names: set[str]) -> None:
        """After loading: a checkpoint without an LM head uses the shared embedding as one."""
        if not any(name.endswith("lm_head.weight") for name in loaded_names):
            self.lm_head.weight.data.copy_(self.shared.weight.data)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden * self.output_scale if self.output_scale != 1.0 else hidden)


@register_text_shape("t5")
def t5_text_shape(text: dict) -> TextShape:
    """The decoder stack (num_layers is the encoder's): no biases, RMS norms, a cross-attention in every layer,
    a gated (wi_0, wi_1, wo) or plain (wi, wo) MLP; the relative-position bias table counts as an embedding."""
    heads = int(text["num_heads"])
    gated = str(text.get("feed_forward_proj", "relu")).startswith("gated-")
    return TextShape(
        hidden=int(text["d_model"]),
        layers=int(text.get("num_decoder_layers") or text["num_layers"]),
        heads=heads,
        head_dim=int(text["d_kv"]),
        vocab=int(text["vocab_size"]),
        intermediate=int(text["d_ff"]),
        kv_heads=heads,
        mlp_matrices=3 if gated else 2,
        cross_attention=True,
    )
