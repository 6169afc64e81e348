"""One pipeline stage: a module chunk that runs forward, full backward, or the backward split
into its input part (I, "dx") and its weight part (W, "dw") for one micro-batch at a time.

The split is what zero-bubble schedules need: the input gradient is sent to the previous stage
as soon as I is done, and W fills a bubble later. I computes only the input gradient, but on
its way it records the gradient arriving at every autograd node that both lies on the path to
the stage input and consumes a parameter (the *weight frontier*, e.g. a Linear's addmm). W
then restarts autograd at those nodes with the recorded gradients, restricted to the
parameters, so it runs only the weight-gradient kernels: I + W cost one full backward, and the
gradients equal a full backward's exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipetrace.runtime.stage_base import StageBase

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _Group:
    """Frontier nodes whose parameter subgraphs touch; one W autograd call covers them."""

    nodes: list[Node]
    params: list[torch.Tensor]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class _Saved:
    """What one micro-batch keeps between its forward and its (last) backward step."""

    input: torch.Tensor | None  # the received activation (a leaf; requires grad if it can)
    output: torch.Tensor  # the activation sent on, or the scaled loss on the last stage
    output_grad: torch.Tensor | None = None  # kept by I for W on the first stage
    groups: list[_Group] | None = None  # kept by I for W on the other stages


class PipelineStage(StageBase):
    """A torch module chunk (see `StageBase`). Gradients accumulate in ``param.grad``
    across micro-batches until the optimizer zeroes them."""

    module: torch.nn.Module
    losses: dict[int, torch.Tensor]
    _saved: dict[int, _Saved]

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        loss_fn: LossFn | None = None,
    ) -> None:
        super().__init__(module, stage_index=stage_index, num_stages=num_stages, loss_fn=loss_fn)
        self._copies_input = _starts_in_place(module)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The module's parameters, read now: FSDP swaps the registered ones between sharded
        and unsharded tensors."""
        return self.module.parameters()

    def forward(
        self,
        mb: int,
        x: torch.Tensor,
        target: torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Run micro-batch ``mb``; returns the activation to pass on (detached), or the
        detached loss on the last stage."""
        if self.is_first:
            stage_input = None
        else:
            # The gradient is taken with respect to the received tensor, as a leaf; one of
            # integers (token ids) has none, and gets a zero one back.
            stage_input = x.detach()
            if stage_input.is_floating_point() or stage_input.is_complex():
                stage_input.requires_grad_(True)
            # A first layer working in place (nn.ReLU(inplace=True)) may not write into a
            # leaf that requires grad: it gets a copy, through which the gradient flows.
            x = stage_input.clone() if self._copies_input else stage_input
        output = self.module(x)
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"stage {self.stage_index} returned a {type(output).__name__}: a stage returns "
                "one tensor (docs/runtime.md)"
            )
        if self.count_saved:  # inline: a call per forward cost more than this work
            size = self._saved_fixed
            if size is None:
                size = self._saved_per_input.get((x.shape, x.dtype))
                if size is None:
                    size = self._measure_saved(x, output)
            self.held_bytes[mb] = size
        if self.is_last:
            loss = self.loss_fn(output, target)  # type: ignore[misc]
            self.losses[mb] = loss.detach()
            self._saved[mb] = _Saved(stage_input, loss * loss_scale if loss_scale != 1.0 else loss)
            return self.losses[mb]
        self._saved[mb] = _Saved(stage_input, output)
        return output.detach()

    def _measure_saved(self, x: torch.Tensor, output: torch.Tensor) -> int:
        """The bytes autograd saved for the backward of ``output`` (the forward of ``x``),
        measured on the first forward of each input shape and dtype and reused after
        (measuring walks the new autograd graph; a module whose saved tensors depend on the
        data, not only on the shape, would need a measurement per forward); on the first
        forward only with ``input_fixed``."""
        size = self._saved_per_input[(x.shape, x.dtype)] = self._saved_in_graph(output)
        if self.input_fixed:
            self._saved_fixed = size
        return size

    def _saved_in_graph(self, output: torch.Tensor) -> int:
        """The bytes of the tensors the autograd graph under ``output`` saved for its
        backward (its nodes' ``_saved_*`` attributes): each tensor once (by its data pointer;
        a view counts its own elements, not its whole storage: a micro-batch is a view of the
        batch), parameters and their views left out (they are not activations). Read from the
        graph rather than through saved-tensor hooks, so that an activation swap group's hooks
        around the forward keep working."""
        if output.grad_fn is None:
            return 0
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        counted: dict[int, int] = {}
        for node in _post_order(output.grad_fn):
            for name in dir(node):
                if not name.startswith("_saved_"):
                    continue
                value = getattr(node, name)
                for tensor in value if isinstance(value, tuple | list) else (value,):
                    if (
                        isinstance(tensor, torch.Tensor)
                        and tensor.untyped_storage().data_ptr() not in params
                    ):
                        counted[tensor.data_ptr()] = tensor.nbytes
        return sum(counted.values())

    def backward(self, mb: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Full backward (dx and dw) of micro-batch ``mb``; returns dx (None on stage 0)."""
        saved = self._release(mb)
        if saved.output.requires_grad:  # else nothing before it trains (a frozen embedding)
            torch.autograd.backward(saved.output, None if self.is_last else output_grad)
        if saved.input is None:
            return None
        dx = saved.input.grad
        return dx if dx is not None else torch.zeros_like(saved.input)

    def backward_input(self, mb: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """dx of micro-batch ``mb``, keeping what `backward_weight` needs.

        Stage 0 has no input gradient to produce: it only keeps the output gradient, and its
        W does the full backward.
        """
        saved = self._saved[mb]
        stage_input = saved.input
        if stage_input is None or not stage_input.requires_grad:
            saved.output_grad = output_grad  # no dx path: W runs the whole backward
            return None if stage_input is None else torch.zeros_like(stage_input)
        if not saved.output.requires_grad:  # the output depends on nothing that trains
            saved.groups = []
            return torch.zeros_like(stage_input)
        # Read the parameters now, not at construction: FSDP swaps the module's registered
        # parameters between sharded and unsharded tensors, and the graph holds the latter.
        params = [p for p in self.module.parameters() if p.requires_grad]
        groups = _weight_frontier(saved.output, output_grad, stage_input, params)
        hooks = [
            node.register_prehook(_capture(group, node)) for group in groups for node in group.nodes
        ]
        try:
            (dx,) = torch.autograd.grad(
                (saved.output,),
                (stage_input,),
                None if self.is_last else (output_grad,),
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for hook in hooks:
                hook.remove()
        # Only the frontier (and what lies below it) is needed from here on; dropping the
        # output frees the upper part of the graph now rather than after W.
        saved.groups = groups
        saved.output = saved.input = None  # type: ignore[assignment]
        return dx if dx is not None else torch.zeros_like(stage_input)

    def backward_weight(self, mb: int) -> None:
        """dw of micro-batch ``mb`` (after `backward_input`), accumulated into ``param.grad``."""
        saved = self._release(mb)
        if saved.groups is None:  # stage 0: the whole backward happens here
            if saved.output.requires_grad:
                torch.autograd.backward(saved.output, None if self.is_last else saved.output_grad)
            return
        for group in saved.groups:
            _run_weight_group(group)


def _starts_in_place(module: torch.nn.Module) -> bool:
    """Whether the module's first layer writes into its input (``inplace=True``, as
    torchvision's ReLUs do), looking through nested nn.Sequential."""
    while isinstance(module, torch.nn.Sequential) and len(module):
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _run_weight_group(group: _Group) -> None:
    """Restart autograd at the group's frontier nodes with the gradients I recorded there,
    restricted to the group's parameters."""
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    for node in group.nodes:
        for index, grad in enumerate(group.grads.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                grads.append(grad)
    if not edges:
        return
    clamps = []
    if len(group.nodes) > 1:
        # One frontier node lies above another on the dx path (a parameter used twice):
        # autograd would add the upper node's contribution to the lower node on top of the
        # gradient we already hold for it. Pin each node's incoming gradient to the recorded one.
        clamps = [node.register_prehook(_pin(group.grads[node])) for node in group.nodes]
    try:
        torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
    finally:
        for clamp in clamps:
            clamp.remove()


def _capture(group: _Group, node: Node) -> Callable:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[node] = grad_outputs

    return hook


def _pin(grads: tuple[torch.Tensor | None, ...]) -> Callable:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return grads

    return hook


def _weight_frontier(
    output: torch.Tensor,
    output_grad: torch.Tensor | None,
    stage_input: torch.Tensor,
    params: list[torch.Tensor],
) -> list[_Group]:
    """The autograd nodes where weight-gradient work branches off the path to the input.

    A node is on the *dx path* when the stage input's gradient flows through it. A frontier
    node is a dx-path node with a child off that path that leads to parameters; the I pass
    runs every frontier node anyway (it is on the dx path), so recording its incoming
    gradient is free, and W needs nothing above it. Frontier nodes whose parameter subgraphs
    share a node are grouped, so one W call never runs a subgraph twice.
    """
    root = output.grad_fn
    if root is None:
        return []
    param_of: dict[Node, torch.Tensor] = {get_gradient_edge(p).node: p for p in params}
    walk = _DxWalk(get_gradient_edge(stage_input).node, param_of)
    for node in _post_order(root):
        walk.visit(node)
    if not walk.on_dx[root]:
        # The output does not depend on the input at all: I never runs the root, so its
        # incoming gradient is the output gradient itself.
        grad = torch.ones_like(output) if output_grad is None else output_grad
        return [_Group([root], [param_of[n] for n in walk.below[root]], {root: (grad,)})]
    return [
        _Group(nodes, [param_of[n] for n in reach if n in param_of])
        for nodes, reach in _merge_overlapping(walk.frontier)
    ]


def _post_order(root: Node) -> list[Node]:
    """The autograd graph under ``root``, children before parents; iterative so that deep
    models do not recurse."""
    order: list[Node] = []
    seen = {root}
    stack = [(root, iter(root.next_functions))]
    while stack:
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            stack.pop()
            order.append(node)
    return order


@dataclass(slots=True)
class _DxWalk:
    """Classifies nodes, visited children first, as on or off the dx path, and collects the
    frontier: dx-path nodes with off-path children that reach parameter nodes."""

    input_node: Node
    param_of: dict[Node, torch.Tensor]
    on_dx: dict[Node, bool] = field(default_factory=dict)
    below: dict[Node, frozenset[Node]] = field(default_factory=dict)
    """Off-path nodes -> the parameter nodes reachable from them."""
    frontier: list[tuple[Node, frozenset[Node]]] = field(default_factory=list)

    def visit(self, node: Node) -> None:
        kids = [child for child, _ in node.next_functions if child is not None]
        on_dx = node is self.input_node or any(self.on_dx[kid] for kid in kids)
        self.on_dx[node] = on_dx
        hanging = frozenset().union(*(self.below[kid] for kid in kids if not self.on_dx[kid]))
        if on_dx:
            if hanging:
                self.frontier.append((node, hanging))
        else:
            self.below[node] = hanging | {node} if node in self.param_of else hanging


def _merge_overlapping(
    frontier: list[tuple[Node, frozenset[Node]]],
) -> list[tuple[list[Node], set[Node]]]:
    """Frontier nodes grouped so that no two groups reach a common parameter node."""
    groups: list[tuple[list[Node], set[Node]]] = []
    for node, reach in frontier:
        merged_nodes, merged_reach = [node], set(reach)
        keep = []
        for nodes, other in groups:
            if other & merged_reach:
                merged_nodes = nodes + merged_nodes
                merged_reach |= other
            else:
                keep.append((nodes, other))
        groups = keep + [(merged_nodes, merged_reach)]
    return groups
