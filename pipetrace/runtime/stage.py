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

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

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

    input: torch.Tensor | None  # the received activation (a leaf that requires grad)
    output: torch.Tensor  # the activation sent on, or the scaled loss on the last stage
    output_grad: torch.Tensor | None = None  # kept by I for W on the first stage
    groups: list[_Group] | None = None  # kept by I for W on the other stages


class PipelineStage:
    """A model chunk at position ``stage_index`` of ``num_stages``.

    The last stage applies ``loss_fn(output, target)`` and backpropagates ``loss * loss_scale``
    (the executor passes 1/M so that gradients accumulated over M micro-batches are the mean,
    as with one big batch). Gradients accumulate in ``param.grad`` across micro-batches until
    the optimizer zeroes them.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        loss_fn: LossFn | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} outside 0..{num_stages - 1}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"stage {stage_index} is the last stage and needs a loss_fn")
        self.loss_fn = loss_fn
        self.losses: dict[int, torch.Tensor] = {}  # micro-batch -> unscaled loss (last stage)
        self._saved: dict[int, _Saved] = {}

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
            stage_input = x.detach().requires_grad_(True)
            x = stage_input
        output = self.module(x)
        if self.is_last:
            loss = self.loss_fn(output, target)  # type: ignore[misc]
            self.losses[mb] = loss.detach()
            self._saved[mb] = _Saved(stage_input, loss * loss_scale if loss_scale != 1.0 else loss)
            return self.losses[mb]
        self._saved[mb] = _Saved(stage_input, output)
        return output.detach()

    def backward(self, mb: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Full backward (dx and dw) of micro-batch ``mb``; returns dx (None on stage 0)."""
        saved = self._saved.pop(mb)
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
        if stage_input is None:
            saved.output_grad = output_grad
            return None
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
        saved = self._saved.pop(mb)
        if saved.groups is None:  # stage 0: the whole backward happens here
            torch.autograd.backward(saved.output, None if self.is_last else saved.output_grad)
            return
        for group in saved.groups:
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node in group.nodes:
                for index, grad in enumerate(group.grads.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            clamps = []
            if len(group.nodes) > 1:
                # One frontier node lies above another on the dx path (a parameter used
                # twice): autograd would add the upper node's contribution to the lower node
                # on top of the gradient we already hold for it. Pin each node's incoming
                # gradient to the recorded one.
                clamps = [node.register_prehook(_pin(group.grads[node])) for node in group.nodes]
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
            finally:
                for clamp in clamps:
                    clamp.remove()

    def pending(self) -> int:
        """Micro-batches whose backward has not finished (0 after a clean iteration)."""
        return len(self._saved)

    def reset(self) -> None:
        """Forget per-iteration state (losses and anything an aborted iteration left)."""
        self._saved.clear()
        self.losses.clear()


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
    input_node = get_gradient_edge(stage_input).node
    param_of: dict[Node, torch.Tensor] = {get_gradient_edge(p).node: p for p in params}

    # Post-order walk (children before parents); iterative so deep models do not recurse.
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

    on_dx: dict[Node, bool] = {}
    below: dict[Node, frozenset[Node]] = {}  # off-path nodes: parameter nodes reachable
    frontier: list[tuple[Node, frozenset[Node]]] = []
    empty: frozenset[Node] = frozenset()
    for node in order:
        kids = [c for c, _ in node.next_functions if c is not None]
        dx = node is input_node or any(on_dx[c] for c in kids)
        on_dx[node] = dx
        hanging = empty.union(*(below[c] for c in kids if not on_dx[c]))
        if dx:
            if hanging:
                frontier.append((node, hanging))
        else:
            below[node] = hanging | {node} if node in param_of else hanging
    if not on_dx[root]:
        # The output does not depend on the input at all: I never runs the root, so its
        # incoming gradient is the output gradient itself.
        grad = torch.ones_like(output) if output_grad is None else output_grad
        return [_Group([root], [param_of[n] for n in below[root]], {root: (grad,)})]

    # Merge frontier nodes that reach a common parameter node.
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
    return [_Group(nodes, [param_of[n] for n in reach if n in param_of]) for nodes, reach in groups]
