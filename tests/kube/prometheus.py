"""A real Prometheus scraping migpilot's processes, queried with PromQL over its HTTP API.

The binary is the one ``scripts/k8s-tools`` builds (``MIGPILOT_PROMETHEUS_BIN``). One
:class:`Prometheus` per test: it listens on a free loopback port, keeps its TSDB in the test's
directory, scrapes every second (``interval_s``), and is stopped (SIGTERM, waited for) at the end.

Targets are ``static_configs``, one job per kind of process (``controller``, ``agent``,
``fleet``, ...), and each target's ``instance`` label is the process's name (``controller-c1``,
``agent-ctl-a100``), not its address, so checks read well. No other target label is added: a
target label would shadow a series' own label of the same name (``node``, say) as ``exported_node``.
:meth:`Prometheus.scrape` changes the targets at any time (the config is rewritten and reloaded
with SIGHUP) and returns once Prometheus has them. With a :class:`tests.kube.system.System`
made with ``metrics=True``, :func:`targets_of` lists its processes' metrics endpoints.

Checks use :meth:`Prometheus.query` (an instant query: a list of :class:`Sample`),
:meth:`Prometheus.wait` (until a query's result passes a check) and
:meth:`Prometheus.wait_up` (until ``up == 1`` for every target). A query that does not parse
raises :class:`PromQLError` at once, never a timeout.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.kube import controlplane

T = TypeVar("T")

SCRAPE_INTERVAL_S = 1.0
WAIT_S = 60.0
_START_TIMEOUT_S = 60.0


class PromQLError(AssertionError):
    """Prometheus refused a query (it does not parse, or cannot be evaluated)."""


@dataclass(frozen=True)
class Target:
    """One ``/metrics`` endpoint on the loopback: its job, its name (the ``instance`` label)
    and its port."""

    job: str
    instance: str
    port: int
    path: str = "/metrics"

    @property
    def address(self) -> str:
        return f"{controlplane.LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class Sample:
    """One element of an instant vector: its labels (``__name__`` included when the series has
    one) and its value."""

    labels: Mapping[str, str]
    value: float

    def __getitem__(self, label: str) -> str:
        return self.labels[label]


def config(targets: Iterable[Target], *, interval_s: float = SCRAPE_INTERVAL_S) -> dict[str, Any]:
    """The Prometheus configuration that scrapes ``targets``: one scrape config per job and
    path, one static config (address and ``instance`` label) per target."""
    jobs: dict[tuple[str, str], list[Target]] = {}
    for t in targets:
        jobs.setdefault((t.job, t.path), []).append(t)
    every = f"{int(interval_s * 1000)}ms"
    names = [job for job, _ in jobs]
    return {
        "global": {
            "scrape_interval": every,
            "scrape_timeout": every,
            "evaluation_interval": every,
        },
        "scrape_configs": [
            {
                # Two paths of one job would clash on the job name: the second gets its path.
                "job_name": job if names.count(job) == 1 else f"{job}{path}",
                "metrics_path": path,
                "static_configs": [
                    {"targets": [t.address], "labels": {"instance": t.instance}} for t in group
                ],
            }
            for (job, path), group in sorted(jobs.items())
        ],
    }


def targets_of(system: Any) -> list[Target]:
    """The metrics endpoints of a :class:`tests.kube.system.System` made with ``metrics=True``:
    its controllers (job ``controller``), agents (``agent``), fleet (``fleet``) and webhook
    (``webhook``: its plain-HTTP metrics port, not its TLS one) now running."""
    ports: Mapping[str, int] = system.metrics_ports
    out = []
    for name, port in sorted(ports.items()):
        job = name.split("-", 1)[0]
        out.append(Target(job=job, instance=name, port=port))
    return out


@dataclass
class Prometheus:
    """A Prometheus process (:meth:`start` one) and its HTTP API."""

    binary: Path
    root: Path
    port: int
    component: controlplane.Component | None = None
    targets: list[Target] = field(default_factory=list)
    interval_s: float = SCRAPE_INTERVAL_S
    """Seconds between two scrapes of a target (and between rule evaluations)."""

    @classmethod
    def start(
        cls,
        binary: Path,
        root: Path,
        targets: Sequence[Target] = (),
        *,
        interval_s: float = SCRAPE_INTERVAL_S,
    ) -> Prometheus:
        """Start Prometheus with its config, TSDB and log under ``root``, scraping ``targets``
        every ``interval_s`` seconds; returns once it is ready and has the targets."""
        if not interval_s >= 0.001:
            raise ValueError(f"interval_s: Prometheus scrapes at most every 1 ms, got {interval_s}")
        root.mkdir(parents=True, exist_ok=True)
        [port] = controlplane.free_ports(1)
        prom = cls(
            binary=binary, root=root, port=port, targets=list(targets), interval_s=interval_s
        )
        prom._write_config()
        prom.component = controlplane.launch(
            "prometheus",
            [
                str(binary),
                f"--config.file={prom.config_file}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address={controlplane.LOOPBACK}:{port}",
                "--log.level=warn",
            ],
            log=root / "prometheus.log",
            cwd=root,
        )
        try:
            controlplane.wait_for(
                prom._ready,
                what="Prometheus to be ready",
                timeout=_START_TIMEOUT_S,
                watch=[prom.component],
            )
            prom._wait_active()
        except BaseException:
            prom.stop()
            raise
        return prom

    @property
    def config_file(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def url(self) -> str:
        return f"http://{controlplane.LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self.component is not None:
            controlplane.stop_components([self.component])
            self.component = None

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.component.tail() if self.component is not None else ""

    # --- targets ---------------------------------------------------------------------------

    def scrape(self, targets: Sequence[Target]) -> None:
        """Scrape exactly ``targets`` from now on (the config reloaded); returns once
        Prometheus's active targets are those."""
        assert self.component is not None, "Prometheus is not running"
        self.targets = list(targets)
        self._write_config()
        self.component.signal(signal.SIGHUP)
        self._wait_active()

    def _write_config(self) -> None:
        text = yaml.safe_dump(config(self.targets, interval_s=self.interval_s), sort_keys=False)
        tmp = self.config_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config_file)

    def active_targets(self) -> list[dict[str, Any]]:
        """``/api/v1/targets``' active targets (each with ``labels``, ``health``, ``lastError``)."""
        got: list[dict[str, Any]] = self._get("/api/v1/targets", {"state": "active"})[
            "activeTargets"
        ]
        return got

    def _wait_active(self) -> None:
        want = {(t.instance, t.address) for t in self.targets}

        def loaded() -> bool | None:
            active = self.active_targets()  # scrapeUrl: http://ADDRESS/PATH
            have = {(a["labels"]["instance"], a["scrapeUrl"].split("/")[2]) for a in active}
            return True if have == want else None

        self._until(loaded, "Prometheus to load its targets", WAIT_S)

    def wait_up(self, timeout: float = WAIT_S) -> list[Sample]:
        """Until every target has been scraped and ``up == 1`` for each; returns ``up``'s
        samples. Fails with the targets' last errors."""
        want = {t.instance for t in self.targets}

        def all_up() -> list[Sample] | None:
            got = self.query("up")
            up = {s["instance"] for s in got if s.value == 1}
            return got if up == want and len(got) == len(want) else None

        try:
            return self._until(all_up, "every target up", timeout)
        except PromQLError:
            raise
        except AssertionError as e:
            errors = {a["labels"]["instance"]: a["lastError"] for a in self.active_targets()}
            raise AssertionError(f"{e}\ntargets' last errors: {errors}") from None

    # --- queries ---------------------------------------------------------------------------

    def query(self, promql: str) -> list[Sample]:
        """An instant query: the samples of its vector (a scalar comes as one sample with no
        labels). Raises :class:`PromQLError` if Prometheus refuses it."""
        data = self._get("/api/v1/query", {"query": promql})
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [Sample(labels=r["metric"], value=float(r["value"][1])) for r in result]
        if kind == "scalar":
            return [Sample(labels={}, value=float(result[1]))]
        raise PromQLError(f"{promql!r} gives a {kind}, not an instant vector")

    def value(self, promql: str) -> float:
        """The value of a query that gives exactly one sample."""
        got = self.query(promql)
        if len(got) != 1:
            raise AssertionError(f"{promql!r} gives {len(got)} samples, not one: {got}")
        return got[0].value

    def wait(
        self,
        promql: str,
        check: Callable[[list[Sample]], object] = bool,
        *,
        what: str = "",
        timeout: float = WAIT_S,
    ) -> list[Sample]:
        """Query ``promql`` until ``check(samples)`` is true (by default: until it gives any
        sample) and return those samples; on a timeout, fail with the last result."""
        last: list[Sample] = []

        def passes() -> list[Sample] | None:
            nonlocal last
            last = self.query(promql)
            return last if check(last) else None

        try:
            return self._until(passes, what or f"{promql!r} to pass its check", timeout)
        except PromQLError:
            raise
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast result of {promql!r}: {last}") from None

    def wait_gone(self, promql: str, *, timeout: float = WAIT_S) -> None:
        """Until ``promql`` gives no sample (a series that went is marked stale at the next
        scrape, so an instant query drops it at once)."""
        self.wait(promql, lambda got: not got, what=f"{promql!r} to give nothing", timeout=timeout)

    # --- plumbing --------------------------------------------------------------------------

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400 (bad query) and 422 (cannot evaluate)
            body = json.load(e)
        if body.get("status") != "success":
            raise PromQLError(f"{params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def _until(self, probe: Callable[[], T | None], what: str, timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            if self.component is not None:
                self.component.check_running()
            got = probe()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}\n"
                    f"--- Prometheus's log:\n{self.log()}"
                )
            time.sleep(0.2)
