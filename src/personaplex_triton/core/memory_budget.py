"""A memory budget: the model parameter `gpu_memory_gib`, what the server may take of its GPU.

A large card then stands in for a smaller one (24 GB, 16 GB), or leaves room for a deployment's
other work beside it. The budget caps two things: the pool's sizing counts free memory only up
to the budget (`free_bytes`), and the caching allocator of the process refuses to reserve past it
(`limit_process`). Too small a budget is refused before the weights load (`check_plan`), saying
what the weights and the rest of the plan need. A CUDA context (about half a GiB a process) lies
outside any allocator and so outside the budget: a real card needs that much more.
"""

from __future__ import annotations

GIB = 1 << 30


class MemoryBudgetError(RuntimeError):
    """The budget cannot hold the weights, or them and one conversation."""


def budget_bytes(gpu_memory_gib: float | None) -> int | None:
    """The parameter's bytes, as its config parsed it (serving/parameters.py: a positive number
    of GiB, or None for auto: the whole card, no bound)."""
    return None if gpu_memory_gib is None else int(gpu_memory_gib * GIB)


def check_plan(budget: int | None, weights: int, kept_back: int, per_conversation: int, what: str) -> int:
    """How many conversations `budget` holds beside the weights (`weights` bytes, described by
    `what`, e.g. "7B, float8_e4m3fn") and the bytes the plan keeps back beside the pool, at
    `per_conversation` bytes each; raises MemoryBudgetError where that is none. None: no
    budget, no bound (returns -1)."""
    if budget is None:
        return -1
    if weights > budget:
        raise MemoryBudgetError(
            f"the LM's weights ({what}) need {weights / GIB:.2f} GiB, more than the budget "
            f"gpu_memory_gib = {budget / GIB:.2f} GiB")
    fit = (budget - weights - kept_back) // per_conversation
    if fit < 1:
        raise MemoryBudgetError(
            f"gpu_memory_gib = {budget / GIB:.2f} GiB holds no conversation: the LM's weights ({what}) need "
            f"{weights / GIB:.2f} GiB, the plan keeps {kept_back / GIB:.2f} GiB back beside the pool, and a "
            f"conversation needs {per_conversation / GIB:.2f} GiB")
    return int(fit)


def free_bytes(budget: int, card_free: int, process_reserved: int) -> int:
    """The free memory a pool's sizing may count under a budget: the card's free memory, at most
    what the budget leaves beside what this process's allocator already holds
    (`torch.cuda.memory_reserved`: the weights, Mimi's, code2wav's tick where it runs here)."""
    return max(0, min(card_free, budget - process_reserved))


def limit_process(budget: int | None, device) -> None:
    """This process's caching allocator reserves at most `budget` bytes of `device` (an
    allocation past it raises CUDA's out-of-memory error, as on a card of that size). None: no
    limit."""
    if budget is None:
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise MemoryBudgetError(f"gpu_memory_gib = {budget / GIB:.2f} GiB is more than the card's "
                                f"{total / GIB:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
