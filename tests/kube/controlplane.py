"""A real Kubernetes control plane on loopback ports, for tests that must meet the real API.

etcd, kube-apiserver (TLS, client-cert users, Node+RBAC authorization, service-account tokens,
the aggregation layer's front-proxy certs), kube-controller-manager, kube-scheduler and KWOK
(which plays the kubelet of fake nodes), each a child process with its log in a file.
`ControlPlane.start` boots them and waits until each works; `ControlPlane.stop` ends them (only
them) and deletes the temporary directory.

A test process that dies without tearing down must not leave them running: every child gets the
parent-death signal SIGKILL (Linux prctl, through util-linux's ``setpriv``), runs in its own
process group (so a Ctrl-C reaches pytest, which stops them in order), and an atexit hook stops
what is still up.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx2
import lightkube
import yaml
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, ServiceAccount
from lightkube.types import PatchType

from tests.kube import certs, tools

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
ISSUER = "https://kubernetes.default.svc.cluster.local"
_STOP_TIMEOUT_S = 15.0
_START_TIMEOUT_S = 90.0  # generous: the machine may be busy; the usual start takes seconds
_LOG_TAIL_LINES = 40
HPA_SYNC_PERIOD = "1s"
"""kube-controller-manager's ``--horizontal-pod-autoscaler-sync-period``: how often the HPA
controller reads each HPA's metrics and scales."""


class ControlPlaneError(RuntimeError):
    """A component failed to start or to do what a helper waited for."""


# --- processes -------------------------------------------------------------------------------

_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _dies_with_parent(args: Sequence[str]) -> list[str]:
    """``args`` started so that they get SIGKILL when the thread that starts them ends: under
    ``setpriv --pdeathsig KILL``, which sets the signal (prctl) and execs a shell that gives up
    if this process has already gone (the signal would never come), else execs ``args``. Where
    setpriv is missing (not Linux), ``args`` as they are: the atexit hook is all that is left.

    Not a ``preexec_fn`` calling prctl in the child: a ``preexec_fn`` makes :mod:`subprocess`
    ``fork()`` instead of ``vfork()``, and ``fork()`` runs every ``pthread_atfork`` handler.
    grpcio installs gRPC's (fork support is on by default): in the child they restart the
    event engine's threads and poller, and the poller aborts the child (SIGABRT, "Epoll1Poller
    ... encountered epoll_wait error: Bad file descriptor") when it polls after subprocess has
    closed the inherited descriptors and before the exec. A process that runs gRPC servers (the
    soak bench's fake kubelet) lost about one start in 250 so: an agent that never ran, its log
    that one line. With no ``preexec_fn`` nothing runs in the child between vfork and exec."""
    if _SETPRIV is None:
        return list(args)
    check = 'test "$PPID" = "$0" && exec "$@"'
    return [_SETPRIV, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", check, str(os.getpid()), *args]


@dataclass
class Component:
    """One child process and where its log goes."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def check_running(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ControlPlaneError(
                f"{self.name} exited with status {code}; last lines of {self.log}:\n{self.tail()}"
            )

    def signal(self, signum: int) -> None:
        # Only a child not yet reaped can be signalled: its pid cannot have been reused.
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)


def launch(
    name: str,
    args: Sequence[str],
    *,
    log: Path,
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> Component:
    """Start one component: its own process group, the parent-death signal, output to `log`;
    `env` is added to this process's environment. Nothing runs in the child between its vfork
    and its exec (see :func:`_dies_with_parent`)."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            _dies_with_parent(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
        )
    return Component(name=name, process=process, log=log)


def stop_components(components: Sequence[Component], *, timeout: float = _STOP_TIMEOUT_S) -> None:
    """SIGTERM all, wait for each to exit (the apiserver takes seconds), SIGKILL stragglers."""
    for component in components:
        component.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for component in components:
        try:
            component.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            component.signal(signal.SIGKILL)
            component.process.wait()


def free_ports(count: int) -> list[int]:
    """Ports free on the loopback now (held together so they differ)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def etcd_args(binary: Path, *, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://{LOOPBACK}:{client_port}", f"http://{LOOPBACK}:{peer_port}"
    return [
        str(binary),
        "--name=migpilot",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=migpilot={peer}",
        "--unsafe-no-fsync",  # a throwaway store: durability buys nothing, fsync costs seconds
        "--log-level=warn",
    ]


# --- waiting ---------------------------------------------------------------------------------


def wait_for(
    probe: Callable[[], T | None],
    *,
    what: str,
    timeout: float = 60.0,
    watch: Sequence[Component] = (),
    interval: float = 0.05,
) -> T:
    """Call `probe` until it returns something other than None (or False); fail with the log
    tails of `watch` when one of them exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        for component in watch:
            component.check_running()
        try:
            result = probe()
        except (OSError, lightkube.ApiError, httpx2.HTTPError, http.client.HTTPException) as e:
            result, last_error = None, e
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- last lines of {c.name} ({c.log}):\n{c.tail()}" for c in watch)
            because = f" (last error: {last_error})" if last_error else ""
            raise ControlPlaneError(
                f"timed out after {timeout:.0f} s waiting for {what}{because}{tails}"
            )
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


# --- kubeconfigs -----------------------------------------------------------------------------


def write_kubeconfig(path: Path, *, server: str, ca: Path, user: certs.KeyPair, name: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "migpilot", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {
                "name": name,
                "user": {"client-certificate": str(user.cert), "client-key": str(user.key)},
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": "migpilot", "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def client_for(kubeconfig: Path) -> lightkube.Client:
    """A lightkube client for one kubeconfig; proxies from the environment are not for loopback."""
    return lightkube.Client(config=lightkube.KubeConfig.from_file(kubeconfig), trust_env=False)


# --- the control plane -----------------------------------------------------------------------


@dataclass
class ControlPlane:
    """A running control plane. Build it with `ControlPlane.start()`; end it with `stop()`."""

    directory: Path
    """Temporary directory holding certs, kubeconfigs, etcd's data and `logs/`; deleted by stop."""
    server: str
    """The apiserver's URL, https://127.0.0.1:<port>."""
    kubeconfig: Path
    """An admin kubeconfig (client cert, group system:masters)."""
    ca: certs.CertificateAuthority
    components: list[Component] = field(default_factory=list)
    started_in_s: float = 0.0
    """Seconds from the first process started to the whole control plane ready."""
    _client: lightkube.Client | None = None
    _apiserver_args: list[str] = field(default_factory=list)
    _apiserver_port: int = 0

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.components]

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    @property
    def client(self) -> lightkube.Client:
        """A sync lightkube client as the admin (shared; make your own for other users)."""
        if self._client is None:
            self._client = client_for(self.kubeconfig)
        return self._client

    def async_client(self) -> lightkube.AsyncClient:
        """A new async lightkube client as the admin; close it when done."""
        config = lightkube.KubeConfig.from_file(self.kubeconfig)
        return lightkube.AsyncClient(config=config, trust_env=False)

    # --- starting and stopping ---

    @classmethod
    def start(
        cls,
        *,
        found: tools.Tools | None = None,
        scheduler_qps: int = 200,
        scheduler_burst: int = 400,
        scheduler_backoff_s: tuple[int, int] | None = None,
        timeout: float = _START_TIMEOUT_S,
    ) -> ControlPlane:
        """Boot etcd, the apiserver, controller-manager, scheduler and KWOK; wait until they work.

        ``scheduler_backoff_s``: kube-scheduler's ``podInitialBackoffSeconds`` and
        ``podMaxBackoffSeconds`` (``None``: its defaults, 1 and 10), for a replay that compresses
        time and wants the scheduler's retry order as it would be at full time.

        On any failure everything started so far is stopped and the directory deleted; the error
        carries the tail of the failing component's log.
        """
        found = found or tools.locate()
        directory = Path(tempfile.mkdtemp(prefix="migpilot-kube-"))
        (directory / "logs").mkdir()
        pki = directory / "pki"
        pki.mkdir()
        ca = certs.CertificateAuthority(pki)
        etcd_port, peer_port, api_port = free_ports(3)
        server = f"https://{LOOPBACK}:{api_port}"
        admin = ca.issue("admin", common_name="migpilot-admin", organizations=("system:masters",))
        plane = cls(
            directory=directory,
            server=server,
            kubeconfig=write_kubeconfig(
                directory / "admin.kubeconfig",
                server=server,
                ca=ca.pair.cert,
                user=admin,
                name="admin",
            ),
            ca=ca,
        )
        _LIVE.append(plane)
        try:
            plane._boot(
                found,
                etcd_port=etcd_port,
                peer_port=peer_port,
                api_port=api_port,
                scheduler_qps=scheduler_qps,
                scheduler_burst=scheduler_burst,
                scheduler_backoff_s=scheduler_backoff_s,
                timeout=timeout,
            )
        except BaseException:
            plane.stop()
            raise
        return plane

    def _boot(
        self,
        found: tools.Tools,
        *,
        etcd_port: int,
        peer_port: int,
        api_port: int,
        scheduler_qps: int,
        scheduler_burst: int,
        scheduler_backoff_s: tuple[int, int] | None,
        timeout: float,
    ) -> None:
        began = time.monotonic()
        d, pki = self.directory, self.directory / "pki"
        sa = certs.service_account_keys(pki)
        serving = self.ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            server_ips=(LOOPBACK, SERVICE_IP),
        )

        def run(name: str, args: list[str]) -> Component:
            component = launch(name, args, log=self.logs / f"{name}.log", cwd=d)
            self.components.append(component)
            return component

        # The aggregation layer, set up as kubeadm does: the apiserver proxies requests for an
        # aggregated API (KEDA's external metrics) with a client cert from its own CA, and the
        # aggregated server trusts the user that cert's headers name.
        (pki / "front-proxy").mkdir()
        front_proxy = certs.CertificateAuthority(pki / "front-proxy")
        proxy_client = front_proxy.issue("front-proxy-client", common_name="front-proxy-client")
        etcd = run(
            "etcd",
            etcd_args(found.etcd, data_dir=d / "etcd", client_port=etcd_port, peer_port=peer_port),
        )
        wait_for(
            lambda: _etcd_healthy(etcd_port), what="etcd /health", timeout=timeout, watch=[etcd]
        )
        self._apiserver_port = api_port
        self._apiserver_args = [
            str(found.kube_apiserver),
            f"--etcd-servers=http://{LOOPBACK}:{etcd_port}",
            f"--bind-address={LOOPBACK}",
            f"--advertise-address={LOOPBACK}",
            f"--secure-port={api_port}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.ca.pair.cert}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={sa.cert}",
            f"--service-account-signing-key-file={sa.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The `kubernetes` Service would point at 127.0.0.1, which endpoints reject.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={d / 'apiserver'}",
            f"--requestheader-client-ca-file={front_proxy.pair.cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={proxy_client.cert}",
            f"--proxy-client-key-file={proxy_client.key}",
        ]
        apiserver = run("kube-apiserver", self._apiserver_args)
        wait_for(
            lambda: self._readyz(api_port),
            what="kube-apiserver /readyz",
            timeout=timeout,
            watch=[apiserver],
        )

        kcm_user = self.ca.issue("controller-manager", common_name="system:kube-controller-manager")
        run(
            "kube-controller-manager",
            [
                str(found.kube_controller_manager),
                f"--kubeconfig={self._component_kubeconfig('controller-manager', kcm_user)}",
                f"--bind-address={LOOPBACK}",
                "--secure-port=0",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={self.ca.pair.cert}",
                f"--cluster-signing-cert-file={self.ca.pair.cert}",
                f"--cluster-signing-key-file={self.ca.pair.key}",
                # 1.37 has no cloud controllers left in kube-controller-manager to switch off.
                "--controllers=*",
                "--cluster-name=migpilot",
                # The HPA controller's loop (15 s by default): the GPU-utilisation scenario
                # (tests/kube/gpu_hpa.py) times how fast the loop closes, and a 15 s tick would
                # be most of what it measures. Only HPAs feel it (none but the autoscaling
                # tests make one); each sync reads an HPA's metric once.
                f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
            ],
        )
        scheduler_user = self.ca.issue("scheduler", common_name="system:kube-scheduler")
        scheduler_config = d / "kube-scheduler.yaml"
        scheduler_settings: dict[str, object] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {
                "kubeconfig": str(self._component_kubeconfig("scheduler", scheduler_user)),
                "qps": scheduler_qps,
                "burst": scheduler_burst,
            },
            "leaderElection": {"leaderElect": False},
        }
        if scheduler_backoff_s is not None:
            initial, most = scheduler_backoff_s
            scheduler_settings["podInitialBackoffSeconds"] = initial
            scheduler_settings["podMaxBackoffSeconds"] = most
        scheduler_config.write_text(yaml.safe_dump(scheduler_settings))
        run(
            "kube-scheduler",
            [
                str(found.kube_scheduler),
                f"--config={scheduler_config}",
                f"--bind-address={LOOPBACK}",
                "--secure-port=0",
            ],
        )
        # KWOK writes node and pod status and node leases; an admin, as in its own deployments.
        kwok_user = self.ca.issue("kwok", common_name="kwok", organizations=("system:masters",))
        key, value = KWOK_ANNOTATION
        run(
            "kwok",
            [
                str(found.kwok),
                f"--kubeconfig={self._component_kubeconfig('kwok', kwok_user)}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={key}={value}",
                "--node-lease-duration-seconds=40",
                f"--server-address={LOOPBACK}:0",
                *(f"--config={stage}" for stage in found.kwok_stages),
            ],
        )
        # The service-account controller creating `default` proves the controller-manager runs
        # with working credentials (and pods in `default` can be created from now on).
        wait_for(
            lambda: self.client.get(ServiceAccount, "default", namespace="default"),
            what="the controller-manager to create the default ServiceAccount",
            timeout=timeout,
            watch=self.components,
        )
        for component in self.components:
            component.check_running()
        self.started_in_s = time.monotonic() - began

    def restart_apiserver(self, *, down_s: float = 0.0, timeout: float = _START_TIMEOUT_S) -> None:
        """Stop kube-apiserver (waiting for it to exit), leave it down ``down_s`` seconds, start
        it again with the same flags (etcd keeps the state) and wait until it is ready."""
        old = self.component("kube-apiserver")
        stop_components([old])
        self.components.remove(old)
        time.sleep(down_s)
        new = launch(
            "kube-apiserver",
            self._apiserver_args,
            log=self.logs / "kube-apiserver.log",
            cwd=self.directory,
        )
        self.components.append(new)
        wait_for(
            lambda: self._readyz(self._apiserver_port),
            what="kube-apiserver /readyz after a restart",
            timeout=timeout,
            watch=[new],
        )

    def _readyz(self, port: int) -> bool:
        status, body = self._get_raw(port, "/readyz")
        return status == 200 and body == b"ok"

    def get_raw(self, path: str, *, timeout: float = 10.0) -> tuple[int, bytes]:
        """GET `path` from the apiserver as the admin (`kubectl get --raw`): status and body."""
        return self._get_raw(self._apiserver_port, path, timeout=timeout)

    def _get_raw(self, port: int, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
        context = ssl.create_default_context(cafile=str(self.ca.pair.cert))
        admin = self.directory / "pki"
        context.load_cert_chain(admin / "admin.crt", admin / "admin.key")
        connection = http.client.HTTPSConnection(LOOPBACK, port, context=context, timeout=timeout)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _component_kubeconfig(self, name: str, user: certs.KeyPair) -> Path:
        return write_kubeconfig(
            self.directory / f"{name}.kubeconfig",
            server=self.server,
            ca=self.ca.pair.cert,
            user=user,
            name=name,
        )

    def stop(self) -> None:
        """Stop what this control plane started (clients first, etcd last); delete its directory."""
        if self._client is not None:
            self._client.close()
            self._client = None
        by_name = {c.name: c for c in self.components}
        stop_components([c for c in self.components if c.name not in ("kube-apiserver", "etcd")])
        for name in ("kube-apiserver", "etcd"):
            if name in by_name:
                stop_components([by_name[name]])
        shutil.rmtree(self.directory, ignore_errors=True)
        if self in _LIVE:
            _LIVE.remove(self)

    # --- users ---

    def user_kubeconfig(self, user: str, *, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for a client-cert user with these groups; RBAC grants it nothing."""
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in user)
        pair = self.ca.issue(f"user-{safe}", common_name=user, organizations=tuple(groups))
        return write_kubeconfig(
            self.directory / f"user-{safe}.kubeconfig",
            server=self.server,
            ca=self.ca.pair.cert,
            user=pair,
            name=safe,
        )

    # --- KWOK nodes ---

    def add_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        resources: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Node:
        """Create a KWOK node (labelled `kubernetes.io/hostname`), wait until it is Ready and
        schedulable, then give it `resources` (capacity and allocatable, e.g.
        `{"nvidia.com/mig-1g.10gb": "2"}`) as a device plugin's kubelet would."""
        key, value = KWOK_ANNOTATION
        node = Node(
            metadata=ObjectMeta(
                name=name,
                labels={"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})},
                annotations={key: value},
            )
        )
        self.client.create(node)
        watch = [self.component(n) for n in ("kwok", "kube-controller-manager")]
        wait_for(
            lambda: _schedulable(self.client.get(Node, name)),
            what=f"KWOK node {name} to be Ready without taints",
            timeout=timeout,
            watch=watch,
        )
        if resources:
            self.set_node_resources(name, resources, timeout=timeout)
        return self.client.get(Node, name)

    def set_node_resources(
        self, name: str, resources: Mapping[str, str], *, timeout: float = 60.0
    ) -> None:
        """Merge `resources` into a node's status capacity and allocatable."""
        patch = {"status": {"capacity": dict(resources), "allocatable": dict(resources)}}
        self.client.patch(Node.Status, name, patch, patch_type=PatchType.MERGE)

        def shown() -> bool:
            status = self.client.get(Node, name).status
            allocatable = (status.allocatable if status else None) or {}
            return all(allocatable.get(k) == v for k, v in resources.items())

        wait_for(shown, what=f"node {name} to show {dict(resources)}", timeout=timeout)


def _schedulable(node: Node) -> bool:
    status, spec = node.status, node.spec
    ready = (
        any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
        if status
        else False
    )
    return ready and not (spec and spec.taints)


def _etcd_healthy(port: int) -> bool:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return response.status == 200 and b'"health":"true"' in response.read()
    finally:
        connection.close()


_LIVE: list[ControlPlane] = []


@atexit.register
def _stop_leftovers() -> None:
    """A test run that ends without tearing down (an error in a fixture, sys.exit) still stops
    everything it started."""
    for plane in list(_LIVE):
        plane.stop()


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
