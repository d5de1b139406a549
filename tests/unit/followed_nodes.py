"""The start of every hand-wired agent on a simulated (KWOK-style) node in the unit tests: its
GpuLayout source synced, its pod book filled, the spec it acts on; and the slices its status
reports. As ``assembling.connect_cluster`` starts ``--kubelet simulated``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from migpilot.agent.cluster import boundpods, following, kubeapi
from migpilot.api import gpulayouts as gl


@dataclass
class Followed:
    source: following.GpuLayoutSource
    book: boundpods.PodBook
    reserving: Callable[[], gl.LayoutSpec | None]
    """The spec the agent acts on (what the stand-in kubelet and the slices read)."""


def follow(api: kubeapi.InMemoryNodeApi, node: str) -> Followed:
    """``node``'s GpuLayout source, synced, and its pod book, listed from ``api``."""
    source = following.GpuLayoutSource(api, node=node)
    source.sync()
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=node).items)

    def reserving() -> gl.LayoutSpec | None:
        return source.acted_on.spec if source.acted_on is not None else None

    return Followed(source, book, reserving)


def slice_states(
    api: kubeapi.InMemoryNodeApi, node: str, gpu: int = 0
) -> dict[int, tuple[int, str, str | None]]:
    """Slice id -> (GB, state, used by) of ``gpu`` as the node's GpuLayout status reports."""
    got = api.layout(node)
    assert got is not None and got.status is not None
    (g,) = [g for g in got.status.gpus if g.index == gpu]
    return {s.id: (s.memory_gb, s.state.value, s.used_by) for s in g.mps}
