"""The state dicts the benchmark saves: what each case holds and how many bytes.

- ``uniform``: 8 fp32 tensors, views of one flat buffer that the raw measurements also use;
- ``small``: many small fp32 tensors (default 10,000 × 4 KiB), where per-tensor cost dominates;
- ``transformer``: a decoder stack's parameters in bf16, fp32 master weights and Adam's
  ``exp_avg`` / ``exp_avg_sq`` / ``step`` (a real ``torch.optim.Adam`` step fills them), the CPU
  RNG state and a data-loader position: what a mixed-precision training rank hands over;
- ``adam``: fp32 matrices (64 MiB each by default) with Adam's two moments and a ``step`` each,
  plus a share of the bytes (1 % or 15 %) in 4-64 KiB parameters (norms, biases) with their
  own moments and steps: the GPU workload of scripts/bench_cuda.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Case:
    """One state dict to benchmark, and the flat buffer of the same size the raw limits use."""

    name: str
    state: dict[str, Any]
    payload: torch.Tensor  # uint8, as many bytes as the state's tensors
    tensors: int

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def tensor_bytes(obj: Any) -> tuple[int, int]:
    """(bytes, count) of the tensors in a nested dict / list / tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) \
        else ()
    total = count = 0
    for v in items:
        b, c = tensor_bytes(v)
        total, count = total + b, count + c
    return total, count


def uniform(nbytes: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    per = nbytes // 8 // 4 * 4
    state = {f"layer{i}.weight": flat[i * per:(i + 1) * per].view(torch.float32)
             for i in range(8)}
    return Case("uniform", state, flat, 8)


def small(count: int, nbytes_each: int, seed: int) -> Case:
    state = {f"layer{i}.weight": torch.full((nbytes_each // 4,), float(i + seed))
             for i in range(count)}
    return _with_payload("small", state)


def transformer(d_model: int, layers: int, vocab: int, seed: int) -> Case:
    """A GPT-style stack (attention + 4x MLP, layer norms, tied embedding) after one Adam step."""
    torch.manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (vocab, d_model)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn.qkv.weight": (3 * d_model, d_model), p + "attn.qkv.bias": (3 * d_model,),
            p + "attn.proj.weight": (d_model, d_model), p + "attn.proj.bias": (d_model,),
            p + "mlp.fc1.weight": (4 * d_model, d_model), p + "mlp.fc1.bias": (4 * d_model,),
            p + "mlp.fc2.weight": (d_model, 4 * d_model), p + "mlp.fc2.bias": (d_model,),
            p + "ln1.weight": (d_model,), p + "ln1.bias": (d_model,),
            p + "ln2.weight": (d_model,), p + "ln2.bias": (d_model,),
        })
    shapes["final_ln.weight"] = (d_model,)
    master = {k: torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()}
    opt = torch.optim.Adam(master.values(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    for p in master.values():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in master.values():
        p.grad = None
    names = list(master)
    osd = opt.state_dict()
    state = {
        "model": {k: p.detach().to(torch.bfloat16) for k, p in master.items()},
        "optimizer": {
            # keyed by parameter name, as torch.distributed.checkpoint's helpers produce it
            "state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [names[i] for i in g["params"]]}
                             for g in osd["param_groups"]],
            "fp32_params": {k: p.detach() for k, p in master.items()},
        },
        "rng": {"cpu": torch.get_rng_state()},
        "dataloader": {"epoch": 3, "sample_offset": 1_234_567, "seed": seed},
        "iteration": 1000,
    }
    return _with_payload("transformer", state)


def adam(nbytes: int, small_share: float, seed: int, matrix_nbytes: int = 64 << 20) -> Case:
    """About ``nbytes`` of Adam state: matrices of ``matrix_nbytes`` and ``small_share`` of the
    bytes in small parameters of 4, 8, 16, 32 and 64 KiB in turn."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}

    def param(name: str, numel: int) -> int:
        model[name] = torch.randn(numel, generator=gen)
        state[name] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel, generator=gen),
                       "exp_avg_sq": torch.rand(numel, generator=gen)}
        return 3 * numel * 4 + 4

    large = i = 0
    while i == 0 or large + 3 * matrix_nbytes <= nbytes * (1 - small_share):
        large += param(f"layers.{i}.weight", matrix_nbytes // 4)
        i += 1
    target, small_done, kib = large * small_share / (1 - small_share), 0, (4, 8, 16, 32, 64)
    while small_done < target:
        small_done += param(f"norms.{len(model) - i}.weight", kib[(len(model) - i) % 5] * 256)
    name = f"adam {small_share:.0%} small"
    return _with_payload(name, {"model": model, "optimizer": {"state": state}})


def _with_payload(name: str, state: dict[str, Any]) -> Case:
    nbytes, count = tensor_bytes(state)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return Case(name, state, payload, count)


def build(name: str, nbytes: int, seed: int, small_count: int = 10_000, small_kib: int = 4,
          d_model: int = 768, layers: int = 4, vocab: int = 32_000) -> Case:
    """The case ``name`` for one rank (``seed`` differs per rank so shards differ)."""
    if name == "uniform":
        return uniform(nbytes, seed)
    if name == "small":
        return small(small_count, small_kib * 1024, seed)
    if name == "transformer":
        return transformer(d_model, layers, vocab, seed)
    raise ValueError(f"case: expected uniform, small or transformer, got {name!r}")


def zeros_like(state: Any) -> Any:
    """``state`` with every tensor replaced by zeros of its kind (memory touched): what
    ``load(into=...)`` is given by a restart that built its model first."""
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zeros_like(v) for v in state)
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state
