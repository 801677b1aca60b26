"""The decoder's step replayed as a CUDA graph (``DecodeConfig.cuda_graphs``): a ``StepDecoder`` for
``aiayn.decode.search`` whose step is one launch on a GPU.

A decoding step of a base model is a few hundred small operations (about 400 with beam search's own)
that the host issues one at a time; on a GPU the device waits for the host. A CUDA graph issues a
captured step in one launch, but replays fixed shapes at fixed addresses. So ``GraphDecoder`` keeps the
decoder's state in buffers of fixed sizes, rounded up so that batches of similar shape share a graph
(``Bucket``):

- Bb sentences (the batch rounded up to a multiple of ``SENTENCES``; the rest are padding sentences),
  g rows each (the beam), Tmax positions (rounded up to ``POSITIONS``), S source positions (rounded up
  to ``SOURCE``, padding);
- self-attention keys/values in shared beam slots, ``aiayn.decode.cache``'s layout: position j of slot
  b at index j*g + b, (Bb,H,Tmax*g,K); zero where unwritten; the ancestor table (Bb,g,Tmax);
- the step's position is a device scalar: the step writes its keys/values there (``index_copy_``) and
  attends over every slot with a mask that keeps each row's own prefix (the other slots' weights are
  exactly 0, so this is Eq. 1 over the same keys);
- a sentence that leaves the search stays in the buffers (its rows computed, not read): the search's
  rows map to the buffers' through ``GraphState.live``;
- the step also selects each row's K best tokens (``step_topk``; the banned tokens' -inf from a
  buffer), so beam search reads (N, K) numbers a step, not the (N, V) log-probabilities.

The step's arithmetic is ``CachedDecoder``'s with shared slots (``Transformer.decode`` with a
``DecoderCache``) but for the order of the softmax's sums over the longer, masked rows. On the CPU the
step runs as it is, without a graph (the tests hold it to ``CachedDecoder`` there); on CUDA each bucket's
step is captured once and then replayed.

Shapes: B sentences, g rows per sentence, N = B*g rows, H heads, K d_k, Dv d_v, V target vocabulary.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.decode.adapter import log_softmax_rows
from aiayn.decode.cache import group_rows
from aiayn.decode.topk import select_topk, topk_rows
from aiayn.model import Transformer
from aiayn.model.attention import MultiHeadAttention, key_mask
from aiayn.model.positional import SinusoidalPositions

SENTENCES = 8  # Bb: the batch's sentences rounded up to a multiple of this
POSITIONS = 32  # Tmax: the output's maximum length rounded up to a multiple of this
SOURCE = 16  # S: the source length rounded up to a multiple of this
KEPT_GRAPHS = 8  # buckets a GraphDecoder keeps (the least recently used goes first) ...
KEPT_BYTES = 2 << 30  # ... and their buffers' bytes beyond the bucket in use (a base model's 400 sentences: 1.3 GB)
NEG_INF = float("-inf")


def replays_graphs(device: torch.device) -> bool:
    """Whether ``DecodeConfig.cuda_graphs`` takes effect on ``device``: CUDA's (the CPU decodes as without it)."""
    return device.type == "cuda"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Shape:
    """A bucket's sizes: Bb sentences of g rows, Tmax positions, S source positions."""
    sentences: int
    group: int
    positions: int
    source: int

    @classmethod
    def of(cls, B: int, g: int, T: int, S: int) -> "Shape":
        return cls(_round_up(B, SENTENCES), g, _round_up(T, POSITIONS), _round_up(S, SOURCE))


class Bucket:
    """One shape's buffers and its step: computed directly (CPU), or captured as a CUDA graph at its first
    ``run`` and replayed after."""

    def __init__(self, model: Transformer, shape: Shape, device: torch.device):
        self.model, self.shape, self.device = model, shape, device
        Bb, g, Tmax, S = shape.sentences, shape.group, shape.positions, shape.source
        dtype = next(model.parameters()).dtype
        self.tokens = torch.zeros(Bb * g, dtype=torch.long, device=device)  # (N,)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # the position this step writes
        self.src_pad = torch.ones(Bb, S, dtype=torch.bool, device=device)  # (Bb,S) True at padding
        self.ancestors = torch.zeros(Bb, g, Tmax, dtype=torch.long, device=device)
        self.self_kv, self.cross_kv = [], []
        for layer in model.decoder_layers:
            a, c = layer.self_attn, layer.cross_attn
            self.self_kv.append((torch.zeros(Bb, a.n_heads, Tmax * g, a.d_k, dtype=dtype, device=device),
                                 torch.zeros(Bb, a.n_heads, Tmax * g, a.d_v, dtype=dtype, device=device)))
            self.cross_kv.append((torch.zeros(Bb, c.n_heads, S, c.d_k, dtype=dtype, device=device),
                                  torch.zeros(Bb, c.n_heads, S, c.d_v, dtype=dtype, device=device)))
        self._slots = torch.arange(g, device=device)  # (g,)
        self._own = self._slots.view(1, g, 1).expand(Bb, g, 1).contiguous()  # (Bb,g,1): each row its own slot
        self._positions = torch.arange(Tmax, device=device)  # (Tmax,)
        pe = model.tgt_pos
        if isinstance(pe, SinusoidalPositions):
            pe(0, Tmax)  # the table extended to Tmax first: it is read by index below
            self._pe = pe.table
        else:
            self._pe = pe.weight
        V = model.cfg.target_vocab_size
        self.k = min(g, V)  # the best tokens a row's step also selects (beam search's K = g)
        self.ban = torch.zeros(V, dtype=torch.float32, device=device)  # (V,) -inf at the banned tokens, else 0
        self._banned: Tensor | None = None  # the banned ids ``ban`` holds
        self._graph = None
        self._out: tuple[Tensor, Tensor, Tensor] | None = None  # log-probs (N,V), the k best values, ids (N,k)

    @property
    def nbytes(self) -> int:
        """The buffers' bytes (the self-attention slots are most of them)."""
        return sum(x.nbytes for kv in (*self.self_kv, *self.cross_kv) for x in kv) + self.ancestors.nbytes

    def load(self, memory: Tensor, src_pad: Tensor) -> None:
        """A new batch: its encoder output (B,S',D) and padding (B,S'); the self-attention slots cleared
        (masked slots must hold finite numbers: 0 x NaN would not be 0)."""
        B, S = src_pad.shape
        self.src_pad.fill_(True)
        self.src_pad[:, 0] = False  # padding sentences attend to one zero key: their rows stay finite
        self.src_pad[:B, :S] = src_pad
        for layer, (k, v), (self_k, self_v) in zip(self.model.decoder_layers, self.cross_kv, self.self_kv):
            new_k, new_v = layer.cross_attn.project_kv(memory)  # (B,H,S',K), (B,H,S',Dv)
            k.zero_()
            v.zero_()
            k[:B, :, :S] = new_k
            v[:B, :, :S] = new_v
            self_k.zero_()
            self_v.zero_()
        self.ancestors.zero_()

    def run(self, tokens: Tensor, live: Tensor, position: int, banned: Tensor | None = None) -> list[Tensor]:
        """The step at ``position`` for the sentences ``live`` (B',) whose rows take ``tokens`` (B'*g,);
        returns their next-token log-probabilities (B'*g, V), float32, or, given the ``banned`` ids
        (``search.select_topk``'s), each row's k best tokens: values and ids (B'*g, k)."""
        g = self.shape.group
        self.tokens.view(-1, g).index_copy_(0, live, tokens.view(-1, g))
        self.pos.fill_(position)
        if banned is not None and banned is not self._banned:  # (beam search passes one of two tensors)
            self.ban.zero_().index_fill_(0, banned, NEG_INF)
            self._banned = banned
        if not replays_graphs(self.device):
            out = self._step()
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            out = self._out
        wanted = out[:1] if banned is None else out[1:]
        return [x.view(self.shape.sentences, g, -1).index_select(0, live).view(tokens.numel(), -1) for x in wanted]

    def _capture(self) -> None:
        """The step captured as a CUDA graph, after warm-up runs on a side stream (which write the same
        keys/values at the same position as the first replay will: the step is idempotent)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):  # a memory pool of its own
            self._out = self._step()

    def _step(self) -> tuple[Tensor, Tensor, Tensor]:
        """``Transformer.decode`` of one position over the buffers: (N,) tokens -> (N,V) log-probs, and
        each row's k best tokens but the banned (``search.select_topk``: -inf added where it writes -inf)."""
        m, Bb, g = self.model, self.shape.sentences, self.shape.group
        self.ancestors.index_copy_(2, self.pos, self._own)  # position pos of each row is its own slot
        own = (self.ancestors[..., None] == self._slots) & (self._positions <= self.pos)[:, None]  # (Bb,g,Tmax,g)
        self_mask = own.view(Bb, 1, g, -1)  # (Bb,1,g,Tmax*g)
        memory_mask = key_mask(self.src_pad)  # (Bb,1,1,S)
        x = m.tgt_embed(self.tokens[:, None]) + self._pe.index_select(0, self.pos).to(m.tgt_embed.weight.dtype)
        x = m.dropout(x)  # (N,1,D)
        for i, layer in enumerate(m.decoder_layers):
            x, _, _ = layer(x, _FixedLayer(self, i, self_mask, memory_mask), False)
        log_probs = log_softmax_rows(m.output_logits(m.decoder_norm(x))[:, -1])  # (N,V)
        values, ids = topk_rows(log_probs + self.ban, self.k)  # (N,k)
        return log_probs, values, ids


class _FixedLayer:
    """Layer i's two attentions at a step over a ``Bucket``'s buffers (``DecoderLayer.forward``'s ``kv``)."""

    def __init__(self, bucket: Bucket, i: int, self_mask: Tensor, memory_mask: Tensor):
        self.bucket, self.i, self.self_mask, self.memory_mask = bucket, i, self_mask, memory_mask

    def self_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (N,1,D) -> (N,1,D): this position's keys/values written into each row's own slot, then every
        slot attended to through the mask (each row's own prefix)."""
        b, (self_k, self_v) = self.bucket, self.bucket.self_kv[self.i]
        Bb, g, Tmax = b.shape.sentences, b.shape.group, b.shape.positions
        q, k, v = attn.project_qkv(x)  # (N,H,1,K)
        H = q.size(1)
        for buf, new in ((self_k, k), (self_v, v)):  # slot r of position pos <- row s*g + r's
            buf.view(Bb, H, Tmax, g, -1).index_copy_(2, b.pos, new.view(Bb, g, H, 1, -1).permute(0, 2, 3, 1, 4))
        a, _ = attn.attend(group_rows(q, g), self_k, self_v, self.self_mask)  # (Bb,g,D)
        return a.reshape(q.size(0), 1, a.size(-1)), None

    def cross_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (N,1,D) -> (N,1,D): the g rows of a sentence attend to its encoder output in one call."""
        k, v = self.bucket.cross_kv[self.i]
        q = attn.project_q(x)  # (N,H,1,K)
        a, _ = attn.attend(group_rows(q, self.bucket.shape.group), k, v, self.memory_mask)  # (Bb,g,D)
        return a.reshape(q.size(0), 1, a.size(-1)), None


class GraphState:
    """A search's state over a ``Bucket``: which of its sentences are still searched (``live``), how many
    positions are written. Taken at the search's start (``reorder`` into g rows a sentence, or the first
    step: one row each); after that it moves only as beam search moves beams (``reorder_beams``), in
    place: the search must not use an older state again."""

    def __init__(self, decoder: "GraphDecoder", memory: Tensor, src_pad: Tensor, max_len: int):
        self.decoder, self.memory, self.src_pad, self.max_len = decoder, memory, src_pad, max_len
        self.bucket: Bucket | None = None
        self.live: Tensor | None = None  # (B',) the buffers' sentences the search's rows belong to, in order
        self.length = 0  # positions written

    def _begin(self, g: int) -> None:
        B, S = self.src_pad.shape
        self.bucket = self.decoder.bucket(Shape.of(B, g, self.max_len, S), self.src_pad.device)
        self.bucket.load(self.memory, self.src_pad)
        self.live = torch.arange(B, device=self.src_pad.device)
        self.memory = None

    def step(self, tokens: Tensor, banned: Tensor | None) -> list[Tensor]:
        """The bucket's step (``Bucket.run``) at the next position for the live sentences; the first step
        takes the bucket where no ``reorder`` did (one row a sentence)."""
        if self.bucket is None:
            self._begin(1)
        if self.length >= self.bucket.shape.positions:
            raise ValueError(f"a search of more than {self.max_len} steps")
        out = self.bucket.run(tokens, self.live, self.length, banned)
        self.length += 1
        return out

    def reorder(self, idx: Tensor) -> "GraphState":
        """Only at the start: idx (B*g,) = each sentence repeated g times (beam search's first move)."""
        B = self.src_pad.size(0)
        g = idx.numel() // B if B else 1
        expected = torch.arange(B, device=idx.device).repeat_interleave(g)
        if self.bucket is not None or idx.numel() != B * g or not torch.equal(idx, expected):
            raise ValueError("a GraphState reorders only each sentence into g rows, before its first step; "
                             "later, beams (reorder_beams)")
        self._begin(g)
        return self

    def reorder_beams(self, keep: Tensor | None, parent: Tensor | None) -> "GraphState":
        """``search.reorder_state``: the sentences ``keep`` (B',) of the live ones go on (None: all), row j of
        sentence i continues its row parent[i, j] ((B', g); None for g = 1)."""
        b = self.bucket
        if keep is not None:
            self.live = self.live.index_select(0, keep)
        if parent is not None and b.shape.group > 1:
            if parent.size(1) != b.shape.group:
                raise ValueError(f"beams of {parent.size(1)} rows in a state of {b.shape.group}")
            anc = b.ancestors.index_select(0, self.live)  # (B',g,Tmax)
            b.ancestors.index_copy_(0, self.live, anc.gather(1, parent[:, :, None].expand(-1, -1, anc.size(2))))
        return self


class GraphDecoder:
    """A ``StepDecoder`` (``aiayn.decode.search``) whose steps run over fixed buffers (``Bucket``), replayed
    as CUDA graphs on a GPU. It keeps the buckets of the shapes last used (``KEPT_GRAPHS``, ``KEPT_BYTES``),
    each graph with its memory pool (replayed in any order). One search at a time: a bucket's buffers are
    the state of the search that uses it."""

    def __init__(self, model: Transformer):
        self.model = model
        self._buckets: OrderedDict[Shape, Bucket] = OrderedDict()

    def bucket(self, shape: Shape, device: torch.device) -> Bucket:
        """The bucket of ``shape`` (made, or the kept one), now the most recently used; the least recently
        used others go while more than ``KEPT_GRAPHS`` are kept or they hold more than ``KEPT_BYTES``."""
        b = self._buckets.pop(shape, None)
        others = sum(x.nbytes for x in self._buckets.values())
        while self._buckets and (len(self._buckets) >= KEPT_GRAPHS or others > KEPT_BYTES):
            others -= self._buckets.popitem(last=False)[1].nbytes
        if b is None:
            b = Bucket(self.model, shape, device)
        self._buckets[shape] = b
        return b

    def start(self, src: Tensor, max_len: int) -> GraphState:
        """src (B,S) -> a state of B sentences with room for max_len positions."""
        enc = self.model.encode(src)
        return GraphState(self, enc.memory, enc.src_pad, max_len)

    def step(self, tokens: Tensor, state: GraphState) -> tuple[Tensor, GraphState]:
        """tokens (N,) at the next position -> next-token log-probabilities (N, V), float32."""
        out, = state.step(tokens, None)
        return out, state

    def step_topk(self, tokens: Tensor, state: GraphState, k: int, banned: Tensor) -> tuple[Tensor, Tensor, GraphState]:
        """``step`` then ``search.select_topk``, the selection inside the step (on a GPU, inside its graph):
        each row's min(k, V) best tokens, never one of ``banned``, and their log-probs, (N, k) each."""
        if state.bucket is not None and k == state.bucket.k:
            values, ids = state.step(tokens, banned)
            return values, ids, state
        log_probs, state = self.step(tokens, state)
        values, ids = select_topk(log_probs, k, banned)
        return values, ids, state
