"""CUDA's operand rules on the CPU: run a model as a GPU hands its ops to CUDA's kernels, refuse what they refuse.

A CPU kernel often accepts what its CUDA twin refuses: a layer norm handed a bf16 input beside float32 weights runs
on the CPU and raises "expected scalar type BFloat16 but found Float" on a GPU (issue 43: every bf16 GPU run crashed
at step 1 while the CPU suite passed). ``cuda_rules()`` closes that gap in two parts, both active inside the block:

1. **CUDA's autocast, on the CPU.** The two autocasts follow different lists: CUDA's runs layer norm, softmax, sums,
   exp and log in float32 and a few more matmuls (addmv, mv, einsum) in 16 bits; the CPU's does neither but promotes
   cat and stack and runs cross-entropy in float32. While the block is open, every op either autocast knows is
   re-registered at the CPU's autocast key with CUDA's policy (``CUDA_AUTOCAST``; an op only the CPU's list has runs
   as CUDA's fallthrough: unchanged, its inner ops autocast). So under ``torch.autocast('cpu', ...)`` each op
   receives the dtypes CUDA's autocast would give it: the CPU runs the GPU's dtypes, forward and backward.
2. **CUDA's operand rules.** A ``TorchDispatchMode`` sees every op after autocast and autograd (backward's ops too,
   and a compiled graph's ops as they run) and refuses, with ``CudaRuleError`` naming the op, its operand dtypes and
   the rule, the operand dtypes CUDA's kernels refuse (``SAME_DTYPE``, ``INDEX_DTYPES``, the attention masks).

So each op is judged by what CUDA would hand its kernel: part 1 makes the CPU hand it the same, part 2 judges.
The rules are the ones CUDA's kernels check (their error messages): a rule here that CUDA does not have would only
refuse a correct program, and one CUDA has that is missing here lets a crash through; ``SAME_DTYPE`` lists what
txl's model and trainer reach, not all of torch.

Process-wide while open (the autocast registrations are the dispatcher's, not one thread's): a test tool, never
for a library path. Usage::

    with cuda_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=y).loss
    loss.backward()  # still judged: the mode is open around backward too in ``cuda_rules``' callers
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# -- 1. CUDA's autocast policy ---------------------------------------------------------------------------------------

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")

CUDA_AUTOCAST: dict[str, str] = {
    **dict.fromkeys((
        "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
        "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear",
        "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"), LOWER),
    **dict.fromkeys((
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"), FP32),
    **dict.fromkeys((
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList"), FP32_SET_OPT_DTYPE),
    **dict.fromkeys(("norm.Scalar", "norm.ScalarOpt_dim"), FP32_APPEND_DTYPE),
    **dict.fromkeys(("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                     "tensordot", "scatter_add"), PROMOTE),
    "binary_cross_entropy": BANNED,
}
"""Each op CUDA's autocast handles and its policy: LOWER casts floating operands to the autocast dtype, FP32 to
float32, FP32_SET_OPT_DTYPE runs a reduction or softmax in float32 (its ``dtype`` argument, when not given),
FP32_APPEND_DTYPE the same for ``norm``, PROMOTE to the widest floating operand, BANNED refuses (torch's own
lists, ``aten/src/ATen/autocast_mode.cpp``; an op CUDA's autocast has that is missing here fails ``cuda_rules``
with a message, so a new torch release cannot widen the gap silently)."""


@functools.cache
def _ops_with(key: str) -> frozenset[str]:
    """'name' or 'name.overload' of every aten op with a kernel at dispatch ``key``."""
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
            found.add(qualified[len("aten::"):])
    return frozenset(found)


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _eligible(t: Any) -> bool:
    """What autocast casts: a floating tensor that is not float64 (on the CPU, standing for a CUDA one here)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(args: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if _eligible(t) else t, args)


_NO_AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU)


def _policy_kernel(op: torch._ops.OpOverload, policy: str):
    """The CPU's autocast kernel for ``op`` that does what CUDA's does."""
    names = [a.name for a in op._schema.arguments]

    def kernel(keyset, *args, **kwargs):
        if policy == BANNED:
            raise RuntimeError(f"{op} is unsafe to autocast (CUDA's autocast refuses it): use "
                               "binary_cross_entropy_with_logits")
        first = args[0] if args else None
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):  # the op and what it calls: no autocast again
            if policy == LOWER:
                return op(*_cast(args, torch.get_autocast_dtype("cpu")), **_cast(kwargs, torch.get_autocast_dtype(
                    "cpu")))
            if policy == FP32:
                return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
            if policy == PROMOTE:
                floats = [t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs)) if _eligible(t)]
                widest = floats[0] if floats else None
                for d in floats[1:]:
                    widest = torch.promote_types(widest, d)
                return op(*args, **kwargs) if widest is None else op(*_cast(args, widest), **_cast(kwargs, widest))
            if not _eligible(first):  # set_opt / append: only when the first operand is eligible
                return op(*args, **kwargs)
            if policy == FP32_SET_OPT_DTYPE:
                at = names.index("dtype")
                if at < len(args):
                    args = (*args[:at], torch.float32 if args[at] is None else args[at], *args[at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            # FP32_APPEND_DTYPE: norm(x, p[, dim, keepdim]) -> the overload with dtype=float32
            target = torch.ops.aten.norm.ScalarOpt_dtype if len(args) + len(kwargs) <= 2 else \
                torch.ops.aten.norm.ScalarOpt_dim_dtype
            return target(*args, **kwargs, dtype=torch.float32)

    return kernel


def _fallthrough_kernel(op: torch._ops.OpOverload):
    """An op only the CPU's autocast handles: as CUDA's fallthrough, unchanged; a composite op (cross-entropy) runs
    its decomposition, whose ops autocast as they would on CUDA."""
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")

    def kernel(keyset, *args, **kwargs):
        if composite:
            return op.decompose(*args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Inside the block, ``torch.autocast('cpu', ...)`` follows CUDA's autocast lists (``CUDA_AUTOCAST``)."""
    cuda, cpu = _ops_with("AutocastCUDA"), _ops_with("AutocastCPU")
    unknown = sorted(cuda - set(CUDA_AUTOCAST))
    if unknown:
        raise RuntimeError(f"CUDA's autocast of this torch ({torch.__version__}) handles {unknown}, which "
                           "txl.testing.cuda_rules.CUDA_AUTOCAST does not list: add each with its policy "
                           "(aten/src/ATen/autocast_mode.cpp of this release)")
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": the point, undone on exit
            warnings.simplefilter("ignore")
            for name in sorted(cuda | cpu):
                op = _overload(name)
                kernel = _policy_kernel(op, CUDA_AUTOCAST[name]) if name in cuda else _fallthrough_kernel(op)
                lib.impl(name, kernel, "AutocastCPU", with_keyset=True)
        yield
    finally:
        lib._destroy()  # the CPU's own autocast kernels are back


# -- 2. CUDA's operand rules -----------------------------------------------------------------------------------------

SAME_DTYPE: dict[str, tuple[str, ...]] = {
    # the matmul family: cuBLAS takes one dtype for every operand
    "mm": ("self", "mat2"), "bmm": ("self", "mat2"), "mv": ("self", "vec"), "dot": ("self", "tensor"),
    "vdot": ("self", "other"), "matmul": ("self", "other"), "addmm": ("self", "mat1", "mat2"),
    "_addmm_activation": ("self", "mat1", "mat2"), "baddbmm": ("self", "batch1", "batch2"),
    "addbmm": ("self", "batch1", "batch2"), "addmv": ("self", "mat", "vec"), "addr": ("self", "vec1", "vec2"),
    "linear": ("input", "weight", "bias"),
    # norms: "expected scalar type BFloat16 but found Float" (the crash of issue 43), and their backward
    "native_layer_norm": ("input", "weight", "bias"),
    "native_layer_norm_backward": ("grad_out", "input", "weight", "bias"),
    "native_group_norm": ("input", "weight", "bias"), "native_group_norm_backward": ("grad_out", "input", "weight"),
    "_fused_rms_norm": ("input", "weight"), "_fused_rms_norm_backward": ("grad_out", "input", "weight"),
    # convolution (cuDNN: "Input type and bias type should be the same")
    "convolution": ("input", "weight", "bias"), "convolution_backward": ("grad_output", "input", "weight"),
    # attention kernels: one dtype for query, key and value
    "_scaled_dot_product_flash_attention_for_cpu": ("query", "key", "value"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("grad_out", "query", "key", "value"),
    "_scaled_dot_product_attention_math": ("query", "key", "value"),
    "_scaled_dot_product_efficient_attention": ("query", "key", "value", "attn_bias"),
    "_scaled_dot_product_efficient_attention_backward": ("grad_out_", "query", "key", "value", "attn_bias"),
    "_scaled_dot_product_flash_attention": ("query", "key", "value"),
    # writes of one tensor into another: "scatter(): Expected self.dtype to be equal to src.dtype"
    "scatter": ("self", "src"), "scatter_add": ("self", "src"), "scatter_reduce": ("self", "src"),
    "index_add": ("self", "source"), "index_copy": ("self", "source"), "index_put": ("self", "values"),
    "masked_scatter": ("self", "source"),
    # a loss's class weights in the dtype of its input
    "nll_loss_forward": ("self", "weight"), "nll_loss2d_forward": ("self", "weight"),
}
"""Op (its name, in-place and out= variants alike) -> the operands CUDA's kernel needs in one dtype."""

_INT = (torch.int64, torch.int32)
INDEX_DTYPES: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    "embedding": {"indices": _INT}, "embedding_dense_backward": {"indices": _INT},
    "index_select": {"index": _INT}, "index_add": {"index": _INT}, "index_copy": {"index": (torch.int64,)},
    "gather": {"index": (torch.int64,)}, "scatter": {"index": (torch.int64,)},
    "scatter_add": {"index": (torch.int64,)}, "scatter_reduce": {"index": (torch.int64,)},
    "nll_loss_forward": {"target": (torch.int64,)}, "nll_loss_backward": {"target": (torch.int64,)},
    "nll_loss2d_forward": {"target": (torch.int64,)}, "nll_loss2d_backward": {"target": (torch.int64,)},
}
"""Op -> operand -> the integer dtypes CUDA's kernel takes for it (an index, a loss's target)."""

MASKS: dict[str, str] = {
    "_scaled_dot_product_flash_attention_for_cpu": "attn_mask",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "attn_mask",
    "_scaled_dot_product_attention_math": "attn_mask",
}
"""Attention ops whose mask must be bool or the query's dtype (CUDA's memory-efficient kernel, which txl's
``kernels.sdpa`` pins for a dense bias: "invalid dtype for bias - should match query's dtype")."""


class CudaRuleError(RuntimeError):
    """An op was handed operand dtypes that CUDA's kernel refuses."""


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = {a.name: v for a, v in zip(func._schema.arguments, args)}
    named.update(kwargs)
    return named


def _dtypes(named: dict[str, Any], names: tuple[str, ...]) -> dict[str, torch.dtype]:
    return {n: named[n].dtype for n in names if isinstance(named.get(n), torch.Tensor)}


def check(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Raise ``CudaRuleError`` if CUDA's kernel for ``func`` refuses these operands."""
    name = func._schema.name.split("::")[-1].rstrip("_")  # 'baddbmm_' and 'baddbmm.out' are judged as 'baddbmm'
    if name not in SAME_DTYPE and name not in INDEX_DTYPES and name not in MASKS:
        return
    named = _bind(func, args, kwargs)
    if name in SAME_DTYPE:
        seen = _dtypes(named, SAME_DTYPE[name])
        if len(set(seen.values())) > 1:
            raise CudaRuleError(f"{func}: operands {_show(seen)}: CUDA's kernel takes one dtype for "
                                f"{', '.join(SAME_DTYPE[name])} (it raises where the CPU's accepts the mix)")
    for operand, allowed in INDEX_DTYPES.get(name, {}).items():
        t = named.get(operand)
        if isinstance(t, torch.Tensor) and t.dtype not in allowed:
            raise CudaRuleError(f"{func}: {operand} is {_short(t.dtype)}: CUDA's kernel takes "
                                f"{' or '.join(map(_short, allowed))} for it")
    mask = named.get(MASKS.get(name, ""))
    if isinstance(mask, torch.Tensor) and mask.dtype not in (torch.bool, named["query"].dtype):
        raise CudaRuleError(f"{func}: attn_mask is {_short(mask.dtype)} beside a {_short(named['query'].dtype)} "
                            "query: CUDA's attention kernels take a bool mask or one in the query's dtype")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _show(seen: dict[str, torch.dtype]) -> str:
    return ", ".join(f"{n} {_short(d)}" for n, d in seen.items())


class CudaRules(TorchDispatchMode):
    """Refuses each op whose operands CUDA's kernel would refuse (``check``); the op runs otherwise. ``seen``: the
    names of the ops judged, for a test that wants to know a path was reached."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check(func, args, kwargs)
        self.seen.add(func._schema.name.split("::")[-1])
        return func(*args, **kwargs)


def judge_graph(gm: torch.fx.GraphModule) -> set[str]:
    """``check`` each aten op of a traced graph (AOTAutograd's, torch.export's) on its operands' traced dtypes (the
    nodes' fake values); returns the ops' names. torch.compile refuses to trace under a dispatch mode, so a compiled
    function's graphs are judged here as they are made (``judging_backend``), forward and backward."""
    seen = set()

    def value(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            check(node.target, tree_map(value, node.args), tree_map(value, node.kwargs))
            seen.add(node.target._schema.name.split("::")[-1])
    return seen


class JudgingBackend:
    """A torch.compile backend: ``aot_eager`` (AOTAutograd's graphs run as they are, no code generation) with each
    forward and backward graph judged by ``judge_graph`` when made; ``seen``: the ops judged. Compile under
    ``cuda_autocast()`` so that the traced autocast is CUDA's."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.seen: set[str] = set()

        def judged(gm, example_inputs):
            self.seen |= judge_graph(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=judged, bw_compiler=judged)

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)


@contextlib.contextmanager
def cuda_rules() -> Iterator[CudaRules]:
    """CUDA's autocast and CUDA's operand rules on the CPU inside the block (the module's docstring); yields the
    mode (its ``seen`` ops)."""
    with cuda_autocast(), CudaRules() as mode:
        yield mode


__all__ = ["CUDA_AUTOCAST", "INDEX_DTYPES", "MASKS", "SAME_DTYPE", "CudaRuleError", "CudaRules", "JudgingBackend",
           "check", "cuda_autocast", "cuda_rules", "judge_graph"]
