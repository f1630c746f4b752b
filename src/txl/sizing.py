"""Know before you launch: per-process bytes of a training run, for DDP and FSDP at any process count.

    txl size --preset wt103_large --world-size 1,8,64 --gpu-memory 80

For one process of W (B/W streams, each of ``grad_accum`` chunks B/(W A)), fp32 weights and Adam:

* parameters 4P, gradients 4P, optimiser state 8P (Adam's two moments), and DDP's gradient buckets 4P;
  FSDP keeps 1/W of each (of the padded size), plus the whole parameters of the two largest units at a time
  (the unit running and the one prefetched) and the whole gradients of one unit before its reduce-scatter;
* recurrent memory: L x (B/W) x M x d x 4 (each process keeps its own streams' memory, Dai et al. 2019,
  section 3.2), twice at the step boundary (the old memory and the new one);
* activations: what autograd saves for the backward pass, *counted*, not guessed: one forward of a model
  of the config's layer shape with a 2-symbol vocabulary, one stream, with ``saved_tensors_hooks`` summing
  the bytes of every tensor saved; with 1 and 2 layers, so the difference is one layer's (megabytes and a
  second on a CPU even for the large presets). A chunk holds B/(W A) streams. The output layer's part is
  computed (``softmax_bytes``): the adaptive softmax's tail clusters score only the tokens whose targets fall
  in them, their shares estimated from Zipf's law (rank r has frequency ~ 1/r), which natural text follows.
  With activation checkpointing a layer keeps only its input; one layer at a time is recomputed in the
  backward pass, beside the gradients of its activations (about as large again, as measured).

The peak is params + optimiser state + buckets or units in flight + 2 memories + the larger of (activations +
the gradients of the output layer, which come first in the backward pass) and (all the gradients + with
activation checkpointing, the first layer recomputed at the end of the backward pass and its gradients).
``benchmarks/scaling.py`` measures the peak of real runs with torch's MemTracker to validate it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from txl.config import ComputeConfig, ModelConfig, RunConfig

F32 = 4


@dataclass(kw_only=True)
class Sizing:
    """Bytes per process of one training configuration."""

    parallel: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    buckets: int
    """DDP's gradient communication buckets (0 under FSDP)."""
    unsharded: int
    """FSDP: the whole parameters and gradients of the units in flight (0 under DDP)."""
    memory: int
    activations: int
    head_grads: int
    """Gradients of the output layer (embedding and softmax), allocated before the activations are freed."""
    recompute: int
    """Activation checkpointing: one layer recomputed in the backward pass and its activations' gradients,
    alive while nearly every gradient exists (the first layer comes last); 0 without it."""
    checkpointing: bool

    @property
    def peak(self) -> int:
        static = self.params + self.optimizer + self.buckets + 2 * self.memory + self.unsharded
        return static + max(self.activations + self.head_grads, self.grads + self.recompute)

    def row(self) -> dict[str, int | str | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"peak": self.peak}


def saved_bytes(model: nn.Module, batch: int, tgt_len: int, mem_len: int) -> int:
    """Bytes autograd saves in one training forward of ``model`` at this shape, parameters excluded, each
    storage counted once (one stream of one or two layers: megabytes, even for the large presets)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    c = model.config
    x = torch.zeros(batch, tgt_len, dtype=torch.long)
    memory = tuple(torch.zeros(batch, mem_len, c.d_model) for _ in range(c.n_layer)) if mem_len else None
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, memory=memory, return_log_probs=False)  # the softmax's part: softmax_bytes
        del out
    return sum(seen.values())


def softmax_bytes(config: ModelConfig, tokens: int) -> int:
    """What the adaptive softmax saves for ``tokens`` targets: per cluster, its float32 log-probabilities
    (log_softmax's backward reads its output) and its projected input; the head's weight with the cluster rows
    concatenated to it is a new tensor too."""
    from txl.model.adaptive import cluster_bounds, cluster_widths, zipf_shares

    bounds, widths = cluster_bounds(config), cluster_widths(config)
    n_clusters = len(config.cutoffs)
    total = tokens * config.d_model * F32  # the softmax's input, (N, d)
    for i, share in enumerate(zipf_shares(config)):
        n = tokens if i == 0 else round(tokens * share)
        v = bounds[i + 1] - bounds[i] + (n_clusters if i == 0 else 0)
        proj = widths[i] if config.d_embed != config.d_model or config.div_val != 1 else 0
        total += n * (v + proj) * F32
        if i == 0 and n_clusters:
            total += v * widths[0] * F32 + v * F32  # torch.cat of the head and cluster weights and biases
    return total


def activation_bytes(config: ModelConfig, *, streams: int, tgt_len: int, checkpointing: bool,
                     compute: ComputeConfig | None = None) -> tuple[int, int]:
    """(saved activations of one chunk of ``streams``, those of one decoder layer) for the config's shape, computed
    as ``compute`` says (None: the defaults; recompute_attention keeps no probabilities)."""
    compute_json = json.dumps(asdict(compute or ComputeConfig()), sort_keys=True)
    per_stream, layer = _per_stream(json.dumps(config.to_dict(), sort_keys=True), compute_json, tgt_len, checkpointing)
    return per_stream * streams, layer * streams


@functools.lru_cache(maxsize=64)
def _per_stream(config_json: str, compute_json: str, tgt_len: int, checkpointing: bool) -> tuple[int, int]:
    from txl.model import TransformerXL
    from txl.parallel import checkpoint_layers

    config = ModelConfig.from_dict(json.loads(config_json))

    def measure(n_layer: int, ckpt: bool) -> int:
        small = config.replace(n_layer=n_layer, vocab_size=2, cutoffs=[], tie_projs=[False], div_val=1,
                               d_embed=config.d_model)
        torch.manual_seed(0)
        model = TransformerXL(small, ComputeConfig(**json.loads(compute_json)))
        if ckpt:
            checkpoint_layers(model)
        return saved_bytes(model, 1, tgt_len, config.mem_len)

    layer = measure(2, False) - measure(1, False)
    kept = measure(2, checkpointing) - measure(1, checkpointing)
    base = measure(1, checkpointing) - kept
    per_stream = base + config.n_layer * kept + softmax_bytes(config, tgt_len)
    if checkpointing:  # one layer recomputed at a time in the backward pass, beside its activations' gradients
        per_stream += 2 * layer
    return per_stream, layer


def estimate(cfg: RunConfig, *, world_size: int, parallel: str, checkpointing: bool) -> Sizing:
    """The per-process bytes of training ``cfg`` on ``world_size`` processes."""
    from txl.model import TransformerXL

    c, t = cfg.model, cfg.train
    with torch.device("meta"):
        model = TransformerXL(c)
    n = sum(p.numel() for p in model.parameters())
    head = {id(p): p.numel() for m in (model.embed, model.softmax) for p in m.parameters()}
    n_head = sum(head.values())
    n_layer = sum(p.numel() for p in model.layers[0].parameters())
    streams = t.batch_size // world_size
    acts, layer = activation_bytes(c, streams=streams // t.grad_accum, tgt_len=t.tgt_len, checkpointing=checkpointing,
                                   compute=cfg.compute)
    memory = c.n_layer * streams * c.mem_len * c.d_model * F32
    fsdp = parallel == "fsdp" and world_size > 1
    shard = (lambda x: math.ceil(x / world_size)) if fsdp else (lambda x: x)
    unsharded = (2 * max(n_head, n_layer) + max(n_head, n_layer)) * F32 if fsdp else 0
    return Sizing(parallel=parallel, world_size=world_size, params=shard(n) * F32, grads=shard(n) * F32,
                  optimizer=2 * shard(n) * F32, buckets=n * F32 if parallel == "ddp" and world_size > 1 else 0,
                  unsharded=unsharded, memory=memory, activations=acts, head_grads=shard(n_head) * F32,
                  recompute=2 * layer if checkpointing else 0, checkpointing=checkpointing)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
