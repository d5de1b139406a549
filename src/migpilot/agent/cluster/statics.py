"""Static layouts in a cluster, mig-manager's way: the Node's ``nvidia.com/mig.config`` label
names a config of a mig-parted file held in a ConfigMap.

Why it exists: not every node should be repartitioned on demand (a training pool, a node an
admin wants fixed). NVIDIA's mig-manager lays such a node out from the label
``nvidia.com/mig.config=<name>`` and a mig-parted config in a ConfigMap
(``default-mig-parted-config``, key ``config.yaml``, in the GPU Operator's namespace), and
reports ``nvidia.com/mig.config.state`` = ``pending``/``success``/``failed`` on the Node. The
agent does the same here: while the label is on its Node, :class:`StaticOrDynamic` gives the
reconciler the layouts that config names (the same parser, board-aware device filters and
placement as ``migpilot agent --config``); without it the node follows its GpuLayout as the
controller plans it (the controller never plans a node with the label). The label and the
ConfigMap are watched, so a change takes effect at once. The same reconciler applies either,
so an instance in use is never destroyed, whatever the config says.

Bad input (a name the file lacks, a malformed file, no such ConfigMap or key) changes nothing:
the pass logs why, the agent's labels say ``nvidia.com/mig.config.state=failed`` (the
label it writes after every pass that has a layout to apply: pending, success or failed), and
the GpuLayout's ``Ready`` condition is ``False`` with reason ``InvalidConfig`` (the reporter
reads :attr:`StaticOrDynamic.applied` and :attr:`StaticOrDynamic.problem`). While the label is
on, the GpuLayout's reservations and reported use still protect instances
(:meth:`~following.GpuLayoutSource.keep_protecting`), and its spec is not applied.

A shell module: the API through :class:`~kubeapi.NodeApi` only; no client, no gRPC.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors, logs, probes
from migpilot.agent.cluster import following, kubeapi, watching
from migpilot.agent.rules import changes, desired
from migpilot.gpu import backend
from migpilot.kube import objects
from migpilot.mig import migparted
from migpilot.planning import modes

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConfigMapRef:
    """Where the mig-parted config lives."""

    namespace: str = "gpu-operator"
    """Default: the GPU Operator's namespace."""
    name: str = "default-mig-parted-config"
    """Default: the GPU Operator's own mig-parted ConfigMap."""
    key: str = "config.yaml"
    """The data key holding the file. Default ``config.yaml``."""

    @classmethod
    def parse(cls, text: str) -> ConfigMapRef:
        """``NAMESPACE/NAME[:KEY]``; a clear error otherwise."""
        where, _, key = text.partition(":")
        namespace, sep, name = where.partition("/")
        if not sep or not namespace or not name or (_ and not key):
            raise errors.AgentConfigError(
                f"--mig-parted-configmap {text!r}: expected NAMESPACE/NAME[:KEY]"
            )
        return cls(namespace, name, key or "config.yaml")

    def __str__(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} key {self.key}"


class StaticOrDynamic:
    """Desired layouts from the mig-parted config the Node's label names, else the GpuLayout."""

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        dynamic: following.GpuLayoutSource,
        configmap: ConfigMapRef = ConfigMapRef(),
    ) -> None:
        self._api = api
        self.dynamic = dynamic
        self.node = dynamic.node
        self.configmap = configmap
        self._lock = threading.Lock()
        self._labels: Mapping[str, str] = {}
        """The Node's labels as the watch last saw them: the static config's label, the mode,
        and any other label the agent reads (:meth:`node_label`); one Node watch per agent."""
        self._text: str | None = None
        self._problem: str | None = None
        self._applied: str | None = None
        self._doc: Mapping[str, Any] | None = None
        self._observers: list[Callable[[Mapping[str, Any] | None], None]] = []

    # -- following the Node and the ConfigMap --------------------------------------------------
    def sync(self) -> None:
        """Read the Node's label and the ConfigMap once (errors: :class:`KubeApiError`)."""
        self._nodes(self._api.list_node(self.node).items)
        self._maps(self._api.list_configmap(self.configmap.namespace, self.configmap.name).items)

    def follow(self, stop: threading.Event, *, health: probes.Watches | None = None) -> None:
        """Watch the Node and the ConfigMap until ``stop`` (blocks: run it in a thread); each
        watch marked down in ``health`` while it fails."""
        ref = self.configmap
        thread = threading.Thread(
            target=watching.follow,
            kwargs={
                "what": str(ref),
                "lister": lambda: self._api.list_configmap(ref.namespace, ref.name),
                "watcher": lambda v: self._api.watch_configmap(
                    ref.namespace, ref.name, resource_version=v
                ),
                "listed": self._maps,
                "changed": lambda e: self._maps(
                    () if e.type is objects.EventType.DELETED else (e.object,)
                ),
                "stop": stop,
                "health": health,
            },
            name="migpilot-configmap",
            daemon=True,
        )
        thread.start()
        watching.follow(
            what=f"Node {self.node}",
            lister=lambda: self._api.list_node(self.node),
            watcher=lambda v: self._api.watch_node(self.node, resource_version=v),
            listed=self._nodes,
            changed=lambda e: self._nodes(
                () if e.type is objects.EventType.DELETED else (e.object,)
            ),
            stop=stop,
            health=health,
        )

    def observe(self, observer: Callable[[Mapping[str, Any] | None], None]) -> None:
        """Tell ``observer`` the Node (``None``: gone) now and whenever the watch sees it
        change (the startup taint reads its taints and allocatable from this one watch)."""
        with self._lock:
            self._observers.append(observer)
            doc = self._doc
        observer(doc)

    def _nodes(self, docs: Sequence[Mapping[str, Any]]) -> None:
        labels: Mapping[str, str] = {}
        last: Mapping[str, Any] | None = None
        for doc in docs:
            labels = dict(objects.labels_of(doc))
            last = doc
        with self._lock:
            self._doc = last
            observers = list(self._observers)
        for observer in observers:
            observer(last)
        label = labels.get(desired.CONFIG_LABEL)
        with self._lock:
            if label != self._labels.get(desired.CONFIG_LABEL):
                _log.info("Node %s: %s", self.node,
                          f"{desired.CONFIG_LABEL}={label}: static layout" if label
                          else f"no {desired.CONFIG_LABEL}: following its GpuLayout",
                          extra=logs.about(node=self.node))  # fmt: skip
            self._labels = labels

    def node_label(self, key: str) -> str | None:
        """The Node's label ``key`` as the watch last saw it (``None``: absent or empty)."""
        with self._lock:
            return self._labels.get(key) or None

    def _maps(self, docs: Sequence[Mapping[str, Any]]) -> None:
        text = None
        for doc in docs:
            value = (doc.get("data") or {}).get(self.configmap.key)
            text = value if isinstance(value, str) else None
        with self._lock:
            self._text = text

    # -- the desired-layout source ---------------------------------------------------------------
    @property
    def static_name(self) -> str | None:
        """The config the Node's label names (``None``: the node is dynamic)."""
        with self._lock:
            return self._labels.get(desired.CONFIG_LABEL)

    @property
    def mps_node(self) -> bool:
        """Whether the Node's ``migpilot.io/mode`` label says ``mps`` (its GPUs with MIG
        disabled are then reported in the GpuLayout's status, for the controller to slice)."""
        return self.node_label(modes.MODE_LABEL) == modes.Mode.MPS.value

    @property
    def dra_node(self) -> bool:
        """Whether the Node's ``migpilot.io/mode`` label says ``dra`` (the agent then publishes
        ResourceSlices instead of serving the device plugin, ``docs/dra.md``)."""
        return self.node_label(modes.MODE_LABEL) == modes.Mode.DRA.value

    @property
    def dynamic_mig(self) -> bool:
        """Whether the Node is labelled ``migpilot.io/mig-mode=dynamic`` (its idle GPUs' MIG
        mode may then be switched, ``docs/migmode.md``)."""
        return self.node_label(modes.MIG_MODE_LABEL) == modes.DYNAMIC_MIG

    @property
    def problem(self) -> str | None:
        """Why the static config could not be applied at the last pass (``None``: it was)."""
        return self._problem

    @property
    def applied(self) -> str | None:
        """The config the last pass applied (``None``: it followed the GpuLayout)."""
        return self._applied

    def fingerprint(self) -> Hashable:
        """Changes with the label, the ConfigMap's text and the GpuLayout (whose reservations
        and reported use still protect instances on a static node)."""
        with self._lock:
            label, text = self._labels.get(desired.CONFIG_LABEL), self._text
        if label is None:
            return ("dynamic", self.dynamic.fingerprint())
        return ("static", label, hash(text), self.dynamic.fingerprint())

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """The layouts of the named config, or the GpuLayout's without the label."""
        with self._lock:
            label, text = self._labels.get(desired.CONFIG_LABEL), self._text
        self._applied = label
        if label is None:
            self._problem = None
            return self.dynamic.desired(gpus=gpus, current=current, in_use=in_use)
        # Reservations and reported use still protect instances while the label is on.
        self.dynamic.keep_protecting(current=current)
        try:
            if text is None:
                raise errors.AgentConfigError(f"{self.configmap} not found")
            config = migparted.parse(text, source=str(self.configmap))
            want = desired.from_migparted(config, label, gpus=gpus, current=current, in_use=in_use)
        except errors.MigpilotError as err:
            self._problem = str(err)
            raise
        self._problem = None
        return want

    def in_use(self) -> frozenset[str]:
        """What the GpuLayout protects (reservations, reported use), static or not."""
        return self.dynamic.in_use()

    def describe(self) -> str:
        """For the log."""
        return f"{self.dynamic.describe()}, or the mig-parted config in {self.configmap} " + (
            f"named by the Node's {desired.CONFIG_LABEL}"
        )
