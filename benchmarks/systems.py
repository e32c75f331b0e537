"""Inference contenders any encoder family can reuse: packedenc (eager, compiled and CUDA-graphed), a packed
plain-torch function, and a Hugging Face model with dynamic padding (optionally under torch.compile).

Each system builds its weights on the device in `setup` from one host copy shared by every
system (same values everywhere) and frees them in `close`, so peak memory is its own.

Shapes: T packed tokens, S sequences, L padded length, D hidden.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

import packedenc as pe
from benchmarks.common import Batch, System, Workload


def hf_builder(host_params: Any, dtype: torch.dtype, attn: str = "sdpa") -> Callable[[torch.device], torch.nn.Module]:
    """`build(device)` -> the transformers base model of `host_params`' family (AutoModel of its
    exported config) holding exactly its weights, in eval mode."""

    def build(device: torch.device) -> torch.nn.Module:
        import transformers

        from packedenc.convert.hf import to_state_dict

        sd, cfg_dict = to_state_dict(host_params)
        cfg = transformers.AutoConfig.for_model(**cfg_dict)
        with torch.device(device):
            model = transformers.AutoModel.from_config(cfg, attn_implementation=attn, dtype=dtype)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"HF {type(model).__name__} keys differ from packedenc's export: missing "
                               f"{missing[:4]}, unexpected {unexpected[:4]}")
        return model.eval()

    return build


class PackedencSystem(System):
    """`packedenc.encode(params, ids, cu_seqlens, max_seqlen, backend=...)`."""

    def __init__(self, name: str, host_params: Any, device: torch.device, backend: str = "auto",
                 unfused: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> None:
        self.name, self.host_params, self.device, self.backend = name, host_params, device, backend
        self.unfused = unfused  # composite ops run as their parts (what a fused kernel replaces)
        self.only = only  # workloads this system runs (all when empty)
        self.params: Any = None

    def skip_reason(self, workload: Workload) -> str | None:
        if self.only and workload.name not in self.only:
            return f"measured on {', '.join(self.only)} only"
        return None

    def setup(self) -> None:
        self.params = pe.tree_to(self.host_params, self.device)
        if self.unfused:
            from packedenc.kernels import get_ops, unfused

            ops = get_ops(self.backend, self.device)
            for op in self.unfused:
                ops = unfused(ops, op)
            self.backend = ops

    def prepare(self, batch: Batch) -> tuple[Tensor, Tensor, int]:
        return batch.ids.to(self.device), batch.cu_seqlens.to(self.device), batch.max_seqlen

    def run(self, inputs: tuple[Tensor, Tensor, int]) -> Tensor:
        ids, cu, max_seqlen = inputs
        return pe.encode(self.params, ids, cu, max_seqlen, backend=self.backend)

    def info(self) -> dict[str, Any]:
        ops = pe.get_ops(self.backend, self.device)
        return {"ops": ",".join(f"{op}={b}" for op, b in ops.chosen)}

    def close(self) -> None:
        self.params = None


class CompiledSystem(PackedencSystem):
    """`packedenc.encode` under `torch.compile(dynamic=True, fullgraph=True)`: inductor compiles our
    Triton kernels (they are `triton_op`s) together with the code around them; one graph for every
    batch shape, compiled in the warm-up. Optional (`--systems packedenc+compile`): the compile of a
    full-size model takes a while."""

    optional = True

    def setup(self) -> None:
        super().setup()
        self.fn = torch.compile(pe.encode, dynamic=True, fullgraph=True)

    def run(self, inputs: tuple[Tensor, Tensor, int]) -> Tensor:
        ids, cu, max_seqlen = inputs
        return self.fn(self.params, ids, cu, max_seqlen, backend=self.backend)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "compile": "dynamic=True, fullgraph=True"}

    def close(self) -> None:
        super().close()
        self.fn = None
        torch._dynamo.reset()  # free compiled graphs and their cached workspaces


class GraphedSystem(PackedencSystem):
    """packedenc replayed from CUDA graphs, one graphed encode per workload.

    Each workload gets its own `graphed` object whose budget is that workload's largest batch (what
    a deployment sizes its budget to; the graphs' memory pool is sized by the budget), built when
    the workload starts, so its peak memory holds its own graphs only. Workloads with a batch over
    `max_tokens` / `max_seqs` are skipped. Without CUDA: the same buckets, run eagerly.
    """

    def __init__(self, name: str, host_params: Any, device: torch.device, *, max_tokens: int = 16384,
                 max_seqs: int = 256, backend: str = "auto") -> None:
        super().__init__(name, host_params, device, backend)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.graphed: Any = None
        self._workload: str | None = None

    def skip_reason(self, workload: Workload) -> str | None:
        # The runner asks this first for every workload, before it resets the memory counters:
        # the one place to drop the previous workload's graphs and size the next budget.
        worst = max(workload.batch_tokens(i) for i in range(len(workload.batches)))
        seqs = max(len(b) for b in workload.batches)
        if worst > self.max_tokens or seqs > self.max_seqs:
            return f"batches exceed the graph budget (max_tokens={self.max_tokens}, max_seqs={self.max_seqs})"
        if workload.name != self._workload:
            self._build(worst, seqs)
            self._workload = workload.name
        return None

    def _build(self, max_tokens: int, max_seqs: int) -> None:
        from packedenc.cudagraphs import graphed

        if self.graphed is not None:
            self.graphed.clear()
        self.graphed = graphed(self.params, max_tokens=max_tokens, max_seqs=max_seqs, backend=self.backend,
                               max_graphs=64, capture=self.device.type == "cuda")

    def run(self, inputs: tuple[Tensor, Tensor, int]) -> Tensor:
        ids, cu, max_seqlen = inputs
        if self.graphed is None:  # the parity probe runs before any workload: a budget of its batch
            self._build(ids.numel(), cu.numel() - 1)
        return self.graphed(ids, cu, max_seqlen)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "graph_budget": f"each workload's largest batch (<= {self.max_tokens} tokens / "
                f"{self.max_seqs} seqs)"}

    def close(self) -> None:
        if self.graphed is not None:
            self.graphed.clear()
        self.graphed = None
        super().close()


class PackedFnSystem(PackedencSystem):
    """Any packed function `fn(state, ids, cu_seqlens, max_seqlen, positions)`, e.g. a plain-torch
    baseline; `make_state(params)` turns the device params into what `fn` needs (tables, ...)."""

    def __init__(self, name: str, host_params: Any, device: torch.device, fn: Callable[..., Tensor],
                 make_state: Callable[[Any], Any] = lambda p: p) -> None:
        super().__init__(name, host_params, device)
        self.fn, self.make_state, self.state = fn, make_state, None

    def setup(self) -> None:
        super().setup()
        self.state = self.make_state(self.params)

    def prepare(self, batch: Batch) -> tuple[Tensor, Tensor, int, Tensor]:
        from packedenc.packing import positions_from_cu_seqlens

        ids, cu, L = super().prepare(batch)
        return ids, cu, L, positions_from_cu_seqlens(cu, ids.numel())

    def run(self, inputs: tuple[Tensor, Tensor, int, Tensor]) -> Tensor:
        return self.fn(self.state, *inputs)

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.state = None
        super().close()


class HFPaddedSystem(System):
    """A transformers model on right-padded batches (padded to each batch's longest sequence).

    `build(device)` returns the model in eval mode on the device. `compile=True` wraps it in
    `torch.compile(dynamic=True)`: one graph for every (batch, length), compiled in the warm-up.
    Token-budget packs are skipped: padding a 64k-token pack of mixed lengths is not a fair use.
    """

    def __init__(self, name: str, build: Callable[[torch.device], torch.nn.Module], device: torch.device,
                 *, compile: bool = False, pad_id: int = 0) -> None:
        self.name, self.build, self.device, self.compile, self.pad_id = name, build, device, compile, pad_id
        self.model: Any = None

    def setup(self) -> None:
        model = self.build(self.device)
        self.model = torch.compile(model, dynamic=True) if self.compile else model

    def skip_reason(self, workload: Workload) -> str | None:
        return "token-budget packs are for packed systems (HF pads every batch)" if workload.budget else None

    def prepare(self, batch: Batch) -> tuple[Tensor, Tensor]:
        ids, mask = batch.padded(self.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def run(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        ids, mask = inputs
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    def probe(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.run(inputs)[inputs[1].bool()]  # (S, L, D) -> (T, D): row-major over (S, L) = packed order

    def info(self) -> dict[str, Any]:
        return {"compile": "dynamic=True"} if self.compile else {}

    def close(self) -> None:
        self.model = None
        if self.compile:
            torch._dynamo.reset()  # free compiled graphs and their cached workspaces
